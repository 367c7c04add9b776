"""Fake SGLang / vLLM engines on 127.0.0.1 for the capacity tests, and fixture loaders.

A fake engine answers the capacity endpoints only, and can be switched into the failure
modes the probes must survive: down (socket closed), HTML error pages, garbage, wrong
types, hanging, and restarting with a different pool. Its limit arithmetic is written
out here on its own, the way SGLang computes it, not imported from kvproxy.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

# The `engines` fixture: `await engines(kind, pool=..., context=...)` -> a started engine.
EngineFactory = Callable[..., Awaitable["FakeEngine"]]

FIXTURES = Path(__file__).parent / "fixtures"


def load_json(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
    return data


def load_text(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


class FakeEngine:
    """One engine. `mode` selects the answer: ok, html, html_500, garbage, wrong_type,
    hang, legacy (only /get_server_info), not_found."""

    def __init__(self, kind: str = "sglang", *, pool: int = 5322, context: int = 8192) -> None:
        self.kind = kind
        self.pool = pool
        self.context = context
        self.mode = "ok"
        self.metrics_enabled = True
        # /metrics misbehaves on its own when set; vLLM's /metrics otherwise follows `mode`.
        self.metrics_mode: str | None = None
        self.extra_info: dict[str, Any] = {}  # merged into /server_info
        self.hits: Counter[str] = Counter()
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self._release = asyncio.Event()
        self.entered = asyncio.Event()  # set when a hanging handler is entered

    @property
    def url(self) -> str:
        assert self.port is not None
        return f"http://127.0.0.1:{self.port}"

    # SGLang's scheduler arithmetic, restated independently for the fake.
    def max_req_input_len(self) -> int:
        max_req_len = min(self.context - 1, self.pool - 1)
        return max_req_len - 5

    def server_info(self) -> dict[str, Any]:
        return {
            "model_path": "fake/model",
            "context_length": None,
            "page_size": 1,
            "disaggregation_mode": "prefill",
            "allow_auto_truncate": False,
            "status": "ready",
            "max_total_num_tokens": self.pool,
            "max_req_input_len": self.max_req_input_len(),
            "internal_states": [{"memory_usage": {"token_capacity": self.pool}}],
            "version": "0.5.22-fake",
            **self.extra_info,
        }

    def metrics_text(self) -> str:
        if self.kind == "vllm":
            return (
                "# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{block_size="16",engine="0",'
                f'kv_cache_size_tokens="{self.pool}",num_gpu_blocks="{self.pool // 16}"}} 1.0\n'
            )
        return (
            "# TYPE sglang:max_total_num_tokens gauge\n"
            f'sglang:max_total_num_tokens{{tp_rank="0"}} {float(self.pool)}\n'
            "# TYPE sglang:context_len gauge\n"
            f'sglang:context_len{{tp_rank="0"}} {float(self.context)}\n'
        )

    async def _misbehave(self, mode: str) -> web.StreamResponse | None:
        if mode == "hang":
            self.entered.set()
            await self._release.wait()
            return web.Response(status=503)
        if mode == "html":
            return web.Response(text="<html><body>Login</body></html>", content_type="text/html")
        if mode == "html_500":
            return web.Response(
                status=502, text="<html><h1>502 Bad Gateway</h1></html>", content_type="text/html"
            )
        if mode == "garbage":
            return web.Response(body=b"\x00\xff{garbage", content_type="application/json")
        if mode == "not_found":
            return web.Response(status=404, text="Not Found")
        return None

    async def _server_info(self, request: web.Request) -> web.StreamResponse:
        self.hits[request.path] += 1
        bad = await self._misbehave(self.mode)
        if bad is not None:
            return bad
        if self.mode == "legacy" and request.path == "/server_info":
            return web.json_response({"detail": "Not Found"}, status=404)
        info = self.server_info()
        if self.mode == "wrong_type":
            info["max_total_num_tokens"] = str(self.pool)
        return web.json_response(info)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.hits[request.path] += 1
        mode = self.metrics_mode or (self.mode if self.kind == "vllm" else "ok")
        bad = await self._misbehave(mode)
        if bad is not None:
            return bad
        if not self.metrics_enabled:
            return web.Response(status=404, text="Not Found")
        return web.Response(text=self.metrics_text(), content_type="text/plain")

    async def _models(self, request: web.Request) -> web.StreamResponse:
        self.hits[request.path] += 1
        return web.json_response(
            {"object": "list", "data": [{"id": "fake/model", "max_model_len": self.context}]}
        )

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/get_server_info", self._server_info)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        self._release = asyncio.Event()
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port or 0)
        await site.start()
        if self.port is None:
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        """Go down: the port refuses connections until `start()` again (same port)."""
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
