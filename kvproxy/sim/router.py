"""A small PD router in front of one prefill and one decode server.

Owns: what the real ``sglang-router`` does with a generation request in PD mode, and no
more: the same JSON body goes to prefill and decode at once with ``bootstrap_host``,
``bootstrap_port`` and a random 63-bit ``bootstrap_room`` added (chat's ``max_tokens``
renamed ``max_completion_tokens``); a prefill error is passed through once; otherwise
decode's answer is relayed, streamed or not. A client that leaves makes it close both
upstream connections at once: the dangerous behaviour a proxy in front must absorb.
``/v1/responses`` and ``/v1/messages`` are forwarded to both workers as they are (smg's HTTP
router does the same; the engines convert them to chat, ``converse``). Also: ``/health``,
``/server_info`` and ``/model_info`` from the first prefill worker only (as the real router
does), ``/v1/models``, and the aggregated ground truth at
``/sim/stats`` as ``{"router": ..., "prefill": ..., "decode": ...}``.

Independent oracle: never imports kvproxy code outside ``kvproxy/sim``; never logs bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from kvproxy.sim.converse import ROUTE_MESSAGES, ROUTE_RESPONSES
from kvproxy.sim.protocol import ROUTE_CHAT, ROUTE_COMPLETIONS, ROUTE_GENERATE

_HOP_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "date",
    "server",
    "content-encoding",
}


class PDRouter:
    def __init__(
        self,
        host: str,
        port: int,
        prefill_url: str,
        decode_url: str,
        bootstrap_port: int | None,
        seed: int = 0,
    ) -> None:
        self.host = host
        self.port = port
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.bootstrap_port = bootstrap_port
        self.rng = random.Random(seed)
        self.requests_by_route: Counter[str] = Counter()
        self.client_disconnects = 0
        self.prefill_errors_passed = 0
        self.upstream_errors = 0
        # A request id seen twice means something in front of the router sent it twice.
        self._seen_ids: set[str] = set()
        self.duplicate_request_ids = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for route in (
            ROUTE_GENERATE,
            ROUTE_COMPLETIONS,
            ROUTE_CHAT,
            ROUTE_RESPONSES,
            ROUTE_MESSAGES,
        ):
            app.router.add_post(route, self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        for path in (
            "/server_info",
            "/get_server_info",
            "/model_info",
            "/get_model_info",
            "/v1/models",
        ):
            app.router.add_get(path, self._from_first_prefill)
        app.router.add_get("/sim/stats", self._stats)
        app.router.add_post("/sim/faults", self._faults)
        app.router.add_post("/sim/reset", self._reset)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,
        )
        self._runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            self.port = int(server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "router not started"
        return self._session

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _from_first_prefill(self, request: web.Request) -> web.Response:
        try:
            async with self.session.get(self.prefill_url + request.path) as resp:
                body = await resp.read()
                return web.Response(body=body, status=resp.status, content_type=resp.content_type)
        except (aiohttp.ClientError, OSError):
            return web.json_response({"error": "prefill worker unreachable"}, status=503)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.requests_by_route[request.path] += 1
        rid = request.headers.get("X-Request-ID")
        if rid is not None:
            if rid in self._seen_ids:
                self.duplicate_request_ids += 1
            elif len(self._seen_ids) < 1 << 20:  # bounded: a long soak forgets nothing soon
                self._seen_ids.add(rid)
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": "Invalid JSON body"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "The request body must be an object"}, status=400)
        body["bootstrap_host"] = urlsplit(self.prefill_url).hostname
        body["bootstrap_port"] = self.bootstrap_port
        body["bootstrap_room"] = self.rng.getrandbits(63)
        if request.path == ROUTE_CHAT and "max_tokens" in body:
            body.setdefault("max_completion_tokens", body.pop("max_tokens"))
        payload = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if "X-Request-ID" in request.headers:
            headers["X-Request-ID"] = request.headers["X-Request-ID"]
        prefill = asyncio.ensure_future(
            self._open(self.prefill_url + request.path, payload, headers)
        )
        decode = asyncio.ensure_future(self._open(self.decode_url + request.path, payload, headers))
        try:
            return await self._relay(request, prefill, decode)
        except asyncio.CancelledError:
            self.client_disconnects += 1
            raise
        finally:
            # Closing both legs at once is what the real router does on a disconnect.
            for leg in (prefill, decode):
                if not leg.done():
                    leg.cancel()
                elif leg.exception() is None:
                    leg.result().close()

    async def _open(
        self, url: str, payload: bytes, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        return await self.session.post(url, data=payload, headers=headers)

    async def _relay(
        self,
        request: web.Request,
        prefill: asyncio.Future[aiohttp.ClientResponse],
        decode: asyncio.Future[aiohttp.ClientResponse],
    ) -> web.StreamResponse:
        try:
            prefill_resp = await prefill
        except (aiohttp.ClientError, OSError):
            self.upstream_errors += 1
            return web.json_response({"error": "prefill worker unreachable"}, status=503)
        if prefill_resp.status != 200:
            self.prefill_errors_passed += 1
            body = await prefill_resp.read()
            return web.Response(
                body=body, status=prefill_resp.status, content_type=prefill_resp.content_type
            )
        # Keep reading prefill to its end: closing it early would abort the transfer.
        drain = asyncio.ensure_future(prefill_resp.read())
        try:
            try:
                decode_resp = await decode
            except (aiohttp.ClientError, OSError):
                self.upstream_errors += 1
                return web.json_response({"error": "decode worker unreachable"}, status=503)
            headers = {
                k: v for k, v in decode_resp.headers.items() if k.lower() not in _HOP_HEADERS
            }
            if decode_resp.content_type != "text/event-stream":
                body = await decode_resp.read()
                out: web.StreamResponse = web.Response(
                    body=body, status=decode_resp.status, headers=headers
                )
            else:
                out = web.StreamResponse(status=decode_resp.status, headers=headers)
                await out.prepare(request)
                async for chunk in decode_resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError):
                await asyncio.wait_for(asyncio.shield(drain), timeout=5)
            return out
        finally:
            if not drain.done():
                drain.cancel()
            elif not drain.cancelled():
                drain.exception()  # retrieved, so asyncio does not warn about it

    # -- ground truth ----------------------------------------------------------------------

    def stats_json(self) -> dict[str, Any]:
        return {
            "requests_by_route": dict(self.requests_by_route),
            "client_disconnects": self.client_disconnects,
            "prefill_errors_passed": self.prefill_errors_passed,
            "upstream_errors": self.upstream_errors,
            "duplicate_request_ids": self.duplicate_request_ids,
            "prefill_url": self.prefill_url,
            "decode_url": self.decode_url,
        }

    async def _fan_out(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for role, base in (("prefill", self.prefill_url), ("decode", self.decode_url)):
            try:
                async with self.session.request(method, base + path, json=body) as resp:
                    out[role] = await resp.json()
            except (aiohttp.ClientError, OSError, json.JSONDecodeError) as exc:
                out[role] = {"error": f"unreachable: {type(exc).__name__}"}
        return out

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"router": self.stats_json(), **await self._fan_out("GET", "/sim/stats")}
        )

    async def _faults(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return web.json_response({"error": "Invalid JSON body"}, status=400)
        result = await self._fan_out("POST", "/sim/faults", body)
        bad = any("error" in v for v in result.values())
        return web.json_response(result, status=400 if bad else 200)

    async def _reset(self, request: web.Request) -> web.Response:
        self.requests_by_route.clear()
        self.client_disconnects = self.prefill_errors_passed = self.upstream_errors = 0
        self.duplicate_request_ids = 0
        return web.json_response(
            {"router": {"reset": True}, **await self._fan_out("POST", "/sim/reset")}
        )
