"""Builds the public and admin aiohttp apps and owns the lifecycle.

Lifecycle (explicit, like uvicorn's Server):
  start: probe session and upstream pool -> capacity monitor (first probe in the
         background) -> token counter -> watchers -> admin site -> public site.
  stop:  readiness false and the public port closed (no new connections) -> wait for
         in-flight and deferred requests up to `shutdown_grace_s` -> hard stop: deferred
         drains still open end as `shutdown` -> close sites, monitor, counter, pool, session.
The admin site stays up until the very end so Prometheus can scrape the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from prometheus_client.aiohttp import make_aiohttp_handler

from kvproxy.config import Settings
from kvproxy.observe import Metrics, redact
from kvproxy.policy import TenantResolver, admission, errors, route_table
from kvproxy.response import CanaryRules
from kvproxy.serve.handler import SERVICES_KEY, STATE_KEY, handle
from kvproxy.serve.headers import MAX_FIELD_BYTES, MAX_LINE_BYTES
from kvproxy.serve.models import build_table
from kvproxy.serve.overload import (
    SHED_SERIES,
    BodyMemoryGate,
    ConnectionGate,
    derived_connection_limit,
)
from kvproxy.serve.replies import error_response
from kvproxy.serve.state import HardStop, ServerState, Services
from kvproxy.serve.watch import DisconnectWatcher, LoopLagMonitor, release_heap, settle_heap
from kvproxy.tokens import TokenCounter
from kvproxy.upstream import UpstreamPool

log = logging.getLogger("kvproxy.app")

# Time for in-progress handlers to return after the hard stop fired (they only have to
# close upstream sockets and write a last line).
FINAL_CLEANUP_S = 5.0


class KvproxyServer:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics | None = None,
        *,
        counter: TokenCounter | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self._counter = counter
        self._state: ServerState | None = None
        self._services: Services | None = None
        self._public: web.AppRunner | None = None
        self._admin: web.AppRunner | None = None
        self._public_site: web.TCPSite | None = None
        self.public_port = 0
        self.admin_port = 0

    @property
    def state(self) -> ServerState:
        assert self._state is not None, "server not started"
        return self._state

    @property
    def services(self) -> Services:
        assert self._services is not None, "server not started"
        return self._services

    @property
    def public_url(self) -> str:
        host, _ = self.settings.listen_host_port
        return f"http://{_url_host(host)}:{self.public_port}"

    @property
    def admin_url(self) -> str:
        host, _ = self.settings.admin_host_port
        return f"http://{_url_host(host)}:{self.admin_port}"

    async def start(self) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(
            limit=s.upstream_max_connections,
            keepalive_timeout=s.upstream_keepalive_s,
            enable_cleanup_closed=True,
        )
        session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=None,
                sock_connect=s.upstream_connect_timeout_s,
                sock_read=s.upstream_read_timeout_s,
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        try:
            # One bundle per model (kvproxy.serve.models); the single-model form is one of them.
            models = await build_table(s, self.metrics, session, counter=self._counter)
        except BaseException:
            # A tokenizer that cannot be loaded (a missing extra, a bad path) ends the start
            # with one line; the session made above must not leak an "Unclosed" warning too.
            await session.close()
            raise
        first = models.models[0]
        self._services = services = Services(
            settings=s,
            metrics=self.metrics,
            session=session,
            upstream=UpstreamPool(
                limit=s.upstream_max_connections,
                keepalive_s=s.upstream_keepalive_s,
                connect_timeout_s=s.upstream_connect_timeout_s,
                read_timeout_s=s.upstream_read_timeout_s,
                send_timeout_s=s.upstream_send_timeout_s,
                max_head_bytes=s.upstream_max_head_bytes,
                max_headers=s.upstream_max_headers,
            ),
            watcher=DisconnectWatcher(),
            lag=LoopLagMonitor(self.metrics),
            models=models,
            tenants=TenantResolver(s),
            canaries=CanaryRules.from_settings(s),
            connections=ConnectionGate(s.max_connections or derived_connection_limit()),
            body_memory=BodyMemoryGate(s.max_body_memory_bytes),
            policy=admission.Policy(s.decode_policy, s.default_output_tokens),
            routes=route_table(s.passthrough_routes),
        )
        self._state = state = ServerState(hard_stop=HardStop(loop))
        state.idle.set()
        # Read at scrape time: a gauge write per request start and end was measurable.
        self.metrics.inflight.set_function(lambda: state.inflight)
        self.metrics.event_loop_tasks.set_function(lambda: len(asyncio.all_tasks(loop)))
        self.metrics.public_connections.set_function(lambda: services.connections.open)
        self.metrics.public_connections_limit.set(services.connections.limit)
        self.metrics.body_memory_bytes.set_function(lambda: services.body_memory.in_use)
        self.metrics.body_memory_limit_bytes.set(services.body_memory.limit)
        for resource, action in SHED_SERIES:
            self.metrics.overload_shed.labels(resource, action)
        for canary in s.canaries:
            self.metrics.canary_violations.labels(canary.tenant)
        for m in models.models:
            prefix = "" if models.implicit else f"model {m.name}: "
            log.info("%stoken counting: %s", prefix, m.counter.describe())
        self.metrics.set_tokenizer_backend(first.counter.backend)
        await models.start()
        services.watcher.start()
        settle_heap()  # before the lag monitor's first tick: start-up garbage is not a stall
        services.lag.start()

        self._admin = web.AppRunner(self._admin_app(), access_log=None)
        await self._admin.setup()
        host, port = s.admin_host_port
        admin_site = web.TCPSite(self._admin, host, port)
        await admin_site.start()
        self.admin_port = _bound_port(admin_site)

        self._public = web.AppRunner(
            self._public_app(),
            access_log=None,
            handler_cancellation=False,  # I5: a client leaving must not cancel the handler
            # Bodies arrive as sent: kvproxy.serve.body decides what a Content-Encoding means,
            # for counted and pass-through routes alike.
            auto_decompress=False,
            shutdown_timeout=FINAL_CLEANUP_S,
            # An idle kept-alive connection is closed after this (aiohttp's default: 75 s).
            keepalive_timeout=s.keepalive_timeout_s,
            # aiohttp's defaults, pinned: kvproxy.serve.headers' total bound relies on them.
            max_field_size=MAX_FIELD_BYTES,
            max_line_size=MAX_LINE_BYTES,
        )
        await self._public.setup()
        # aiohttp has no header-read timeout: wrap its protocol factory so a connection that
        # never completes a request head (slowloris) is closed instead of held forever.
        self._public._server = _HeaderDeadline(  # type: ignore[assignment]
            self._public.server, s.header_read_timeout_s, services.connections, self.metrics
        )
        host, port = s.listen_host_port
        self._public_site = web.TCPSite(self._public, host, port, backlog=1024)
        await self._public_site.start()
        self.public_port = _bound_port(self._public_site)
        log.info(
            "kvproxy listening",
            extra={
                "fields": {
                    "public": self.public_url,
                    "admin": self.admin_url,
                    "upstream": s.upstream,
                }
            },
        )

    def _public_app(self) -> web.Application:
        # client_max_size is enforced by our own reader (413 with a JSON body), not aiohttp's.
        app = web.Application(client_max_size=self.settings.max_body_bytes + 1)
        app[STATE_KEY] = self.state
        app[SERVICES_KEY] = self.services
        app.router.add_route("*", "/{tail:.*}", handle)
        return app

    def _admin_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", make_aiohttp_handler(self.metrics.registry))
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/capacity", self._capacity)
        app.router.add_get("/tripwire", self._tripwire)
        return app

    async def _healthz(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        state, models = self.state, self.services.models
        if state.stopping:
            return _json({"ready": False, "reason": "shutting down"}, 503)
        if not models.ready():
            return _json({"ready": False, "reason": models.not_ready_reason()}, 503)
        return _json({"ready": True})

    async def _capacity(self, request: web.Request) -> web.Response:
        # Engine and router URLs may carry credentials: never shown.
        body = redact(orjson.dumps(self.services.models.snapshot_json()).decode())
        return web.Response(text=body, content_type="application/json")

    async def _tripwire(self, request: web.Request) -> web.Response:
        # What `kvproxy canary` needs to say why the tripwire withheld nothing: whose tenant
        # header is believed and which tenants have canaries. Tenant names only: never the
        # markers, patterns or tenant tokens.
        s = self.settings
        return _json(
            {
                "tenant_header": s.tenant_header,
                "trust_tenant_header": s.trust_tenant_header,
                "canary_action": s.canary_action,
                "canary_tenants": sorted({c.tenant for c in s.canaries}),
            }
        )

    async def stop(self) -> None:
        """Graceful: stop accepting, wait for in-flight and deferred requests, then close."""
        state, services = self._state, self._services
        if state is None or services is None:
            return
        state.stopping = True
        # Queued requests were never forwarded: tell them now (429) rather than at the end.
        services.models.reject_waiting()
        if self._public_site is not None:
            await self._public_site.stop()
        if state.inflight:
            log.info(
                "draining %d in-flight requests (grace %.0f s)",
                state.inflight,
                self.settings.shutdown_grace_s,
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(state.idle.wait(), self.settings.shutdown_grace_s)
        state.hard_stop.fire()
        if state.inflight:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(state.idle.wait(), FINAL_CLEANUP_S)
        if self._public is not None:
            await self._public.cleanup()
        await services.watcher.stop()
        await services.lag.stop()
        await services.models.stop_capacity()
        await services.models.aclose()
        await services.upstream.close()
        await services.session.close()
        if self._admin is not None:
            await self._admin.cleanup()
        self._state = self._services = None
        release_heap()


class _PublicHandler(RequestHandler):
    """aiohttp's protocol, with the requests its parser refuses (a line over 8,190 bytes,
    more than 128 fields, a malformed request line or field) answered as kvproxy answers
    bad input: a JSON error naming the problem, with aiohttp's status (400). aiohttp's own
    answer was plain text quoting the offending line, and its log line carried the same
    bytes (an Authorization header among them): here only the exception's type is logged.

    Counted by the connection gate (kvproxy.serve.overload) from accept to close: `shed`
    marks a connection accepted past the limit (its request gets 503 `overloaded`). Tells
    the gate when it is idle (no request in progress and no byte of the next head), so the
    limit can close the longest idle connection first. Each request head after the first
    must be parsed within `head_timeout_s` of its first byte, or the connection is closed
    (the first is held to the accept deadline, `_HeaderDeadline`)."""

    __slots__ = ("_drop", "_gate", "_head_timeout_s", "_head_timer", "shed")

    def __init__(
        self, *args: Any, gate: ConnectionGate, head_timeout_s: float, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._gate: ConnectionGate | None = gate
        self.shed = False
        self._drop = False
        self._head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._drop:
            # Past the shedding margin even a 503 costs what the process lacks.
            transport.abort()  # type: ignore[attr-defined]  # uvloop's and asyncio's have it
        elif self._gate is not None and not self.shed:
            self._gate.went_idle(self, self._reclaimed)

    def _reclaimed(self) -> None:
        # The gate counted this connection closed already: it must not count it again.
        self._gate = None
        if self.transport is not None:
            self.transport.close()

    def _between_requests(self) -> bool:
        return not self._request_in_progress and not self._messages

    def data_received(self, data: bytes) -> None:
        count = self._request_count
        between = self._between_requests()
        gate = self._gate
        if gate is not None and data:
            gate.busy(self)
        super().data_received(data)
        if self._request_count > count:
            self._stop_head_timer()
        elif between and data and count > 0 and self._head_timer is None:
            # The first byte of a later head on a kept-alive connection: its deadline.
            self._head_timer = self._loop.call_later(
                self._head_timeout_s, self._head_timeout, count
            )

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self, count: int) -> None:
        self._head_timer = None
        if self._request_count == count and self.transport is not None:
            self.transport.close()

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        got = await super().finish_response(request, resp, start_time)
        if self._gate is not None and not self._messages and self._keepalive:
            self._gate.went_idle(self, self._reclaimed)
        return got

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_timer()
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.closed(self)
        super().connection_lost(exc)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status != 400 or not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        log.debug("unreadable request head (%s)", type(exc).__name__)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was started: no error response can follow")
        if isinstance(exc, LineTooLong):
            what = f"a request line or header field is over {self.max_field_size:,} bytes"
        elif "Too many headers" in str(exc):
            what = f"the request has more than {self.max_headers} header fields"
        else:
            what = f"the request head is not valid HTTP/1.1 ({type(exc).__name__})"
        resp = error_response(errors.malformed_request(what), None, "openai")
        resp.force_close()
        return resp


class _HeaderDeadline:
    """Protocol factory around aiohttp's: makes each connection's protocol a _PublicHandler,
    and closes a connection whose first request head has not been parsed `timeout_s` after
    it was accepted. Everything else is delegated."""

    def __init__(
        self, server: web.Server | None, timeout_s: float, gate: ConnectionGate, metrics: Metrics
    ) -> None:
        assert server is not None
        self._server = server
        self._timeout_s = timeout_s
        self._gate = gate
        self._metrics = metrics

    def __call__(self) -> Any:
        server = self._server
        gate = self._gate
        # What web.Server.__call__ builds, as the subclass (aiohttp 3.10-3.14: _loop, _kwargs).
        handler = _PublicHandler(
            server,
            loop=server._loop,
            gate=gate,
            head_timeout_s=self._timeout_s,
            **server._kwargs,
        )
        reclaimed = gate.reclaimed
        verdict = gate.opened()
        if gate.reclaimed > reclaimed:
            self._metrics.overload_shed.labels("connections", "close_idle").inc()
        if verdict == "drop":
            self._metrics.overload_shed.labels("connections", "drop").inc()
            handler._drop = True
        else:
            handler.shed = verdict == "shed"
            asyncio.get_running_loop().call_later(self._timeout_s, _cut_if_headless, handler)
        return handler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


def _cut_if_headless(handler: Any) -> None:
    # `_request_count` counts request heads parsed on this connection (aiohttp 3.9+).
    if getattr(handler, "_request_count", 1) == 0 and handler.transport is not None:
        handler.transport.close()


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _bound_port(site: web.TCPSite) -> int:
    # uvloop's Server is not an asyncio.Server, but both expose `sockets`.
    sockets = getattr(site._server, "sockets", None) or []
    return int(sockets[0].getsockname()[1])


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
