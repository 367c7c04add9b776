"""A capture worker on loopback: answers a router's registration probes like an SGLang
engine and records the exact bytes of every request body it is sent, so a test can see
what a router (smg) or kvproxy forwards.

Two of them stand in for a PD pair behind smg (`capture_pair`); one is enough as
kvproxy's upstream. Bounded: each keeps at most `MAX_BODIES` bodies.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web
from ports import free_port

MODEL = "oracle-capture"  # the model id /model_info reports (smg routes by it)
MAX_BODIES = 1000


@dataclass
class Capture:
    role: str
    port: int = 0
    bodies: list[tuple[str, bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def posted(self, path: str) -> list[bytes]:
        return [b for p, b in self.bodies if p == path]


def _app(cap: Capture) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": MODEL,
                "served_model_name": MODEL,
                "disaggregation_mode": cap.role,
                "disaggregation_bootstrap_port": cap.port,
                "context_length": 1_000_000,
                "max_total_num_tokens": 1_000_000,
                "version": "0.5.23",
            }
        )

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}
        )

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def post(request: web.Request) -> web.Response:
        body = await request.read()
        if len(cap.bodies) < MAX_BODIES:
            cap.bodies.append((request.path, body))
        if request.path == "/generate":
            return web.json_response(
                {"text": "ok", "meta_info": {"prompt_tokens": 1, "completion_tokens": 1}}
            )
        return web.json_response(
            {
                "id": "cap",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "text": "ok",
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    app = web.Application(client_max_size=64 * 1024 * 1024)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, health)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/{tail:.*}", post)
    return app


@contextlib.asynccontextmanager
async def capture_worker(role: str = "unified") -> AsyncIterator[Capture]:
    cap = Capture(role)
    runner = web.AppRunner(_app(cap), access_log=None)
    await runner.setup()
    try:
        for _ in range(20):  # bounded: another test may take the port between probe and bind
            cap.port = free_port()
            site = web.TCPSite(runner, "127.0.0.1", cap.port)
            try:
                await site.start()
                break
            except OSError:
                continue
        else:
            raise RuntimeError("no free loopback port for the capture worker")
        yield cap
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def capture_pair() -> AsyncIterator[tuple[Capture, Capture]]:
    async with capture_worker("prefill") as prefill, capture_worker("decode") as decode:
        yield prefill, decode
