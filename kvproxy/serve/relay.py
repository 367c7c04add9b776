"""The upstream exchange: send the request, pump the response to the client, and obey the
drain state machine when the client leaves.

The policy lives in `drain.DrainMachine` (sans-IO); this module only feeds it events
(headers, chunks, EOF, errors, client gone, deadline, shutdown) and executes its decisions.
What the response bytes mean (the canary tripwire, first-output detection, `usage`, what
may be forwarded and what must be withheld) is decided by `inspector.ResponseInspector`
(sans-IO); this module forwards what it allows and counts and logs what it reports.
Every error body it builds has the request's `style` (the route's, `errors.error_style`).
A response it cannot complete once started is never completed: an event stream ends with
the error event, any other body with the client's connection reset (DESIGN.md, "Nothing
lost means nothing faked"). It never logs or stores response text (I8).

Why the two read paths: racing every read against the disconnect watcher costs a task per
chunk. Once a token has reached a present client the transfer is over, and a disconnect is
noticed by the next failed write, so the hot streaming path is a plain `readany()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from kvproxy.observe import log_event
from kvproxy.policy import ErrorStyle, KvproxyError, UpstreamFailure, drain, errors
from kvproxy.response import CanaryHit, CanaryScanner, ResponseInspector, SSEError, Step
from kvproxy.serve.context import RequestContext
from kvproxy.serve.headers import filter_headers
from kvproxy.serve.replies import error_response
from kvproxy.serve.state import HardStop, Services
from kvproxy.upstream import UpstreamResponse, network_boundary

log = logging.getLogger("kvproxy.relay")

# The bytes of a 5xx body kept to tell a request's error from the router's: the routers'
# error bodies are one small JSON object.
ERROR_BODY_BYTES = 4096
# struct linger {l_onoff = 1, l_linger = 0}: close() sends RST instead of FIN.
_LINGER_RESET = struct.pack("ii", 1, 0)


class _Signal:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


GONE = _Signal("gone")
SILENT = _Signal("silent")
DEADLINE = _Signal("deadline")
SHUTDOWN = _Signal("shutdown")


class Exchange:
    """One request's trip upstream and back. Use once: `await Exchange(...).run(...)`."""

    def __init__(
        self,
        services: Services,
        hard_stop: HardStop,
        request: web.Request,
        record: RequestContext,
        *,
        streaming: bool,
        scanner: CanaryScanner | None,
        extra_headers: dict[str, str],
        style: ErrorStyle,
    ) -> None:
        self.services = services
        self.hard_stop = hard_stop
        self.style: ErrorStyle = style
        self.request = request
        self.record = record
        self.scanner = scanner
        self.extra_headers = extra_headers
        s = services.settings
        self.machine = drain.DrainMachine(
            streaming=streaming, until=s.drain_until, timeout_s=s.drain_timeout_s
        )
        self.streaming = streaming
        self.gone: asyncio.Future[None] = services.watcher.watch(request)
        # Resolved by the upstream connection when the read timeout passes before a safe
        # point (the connection stays open: the drain machine decides, `Hold`); cancelled
        # once a safe point is reached, after which a timeout fails the read as usual.
        # The loop from a future it owns: asyncio.get_running_loop() is a getpid() system
        # call per use on Python 3.11.
        self.silence: asyncio.Future[None] = self.gone.get_loop().create_future()
        self.upstream: UpstreamResponse | None = None
        self.client: web.StreamResponse | None = None
        self.inspector: ResponseInspector | None = None
        self.whole: bytes | None = None  # a body that arrived whole, sent at EOF
        # kvproxy_overhead_seconds{phase="chunk"}: the time from each relayed chunk's arrival
        # to its hand-over to the client's connection, summed, and the chunks relayed.
        self.relay_s = 0.0
        self.relayed = 0
        # The upstream failure that ended the exchange, if one did (the handler's passive
        # health reads it with `upstream`: a connect failure, or a 5xx head).
        self.failure: UpstreamFailure | None = None
        # No head within the read timeout: passive health hears of it at once (a hung
        # router), not when the held request ends, minutes later.
        self.head_timed_out = False
        self.on_head_timeout: Callable[[], None] | None = None
        # The first bytes of a 5xx body: whether the request caused it is in there
        # (kvproxy.policy.routing.request_caused_5xx).
        self.error_body = b""

    @property
    def not_sent(self) -> bool:
        """No byte of the request reached the router: no connection could be opened, refused
        or timed out (the only failure a request may be moved to another cluster after)."""
        f = self.failure
        return self.upstream is None and f is not None and f.unsent

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt size the upstream reported in `usage`, if it did."""
        return self.inspector.prompt_tokens if self.inspector is not None else None

    # --- the racing wait ----------------------------------------------------------------

    async def _wait(self, fut: asyncio.Future[Any]) -> Any:
        """Wait for `fut`, or for the client to go, the drain deadline or hard shutdown.

        asyncio.wait's race by hand: one waiter woken by whichever settles first, and a
        timer only while the drain machine has a deadline (about 5 us less per request)."""
        if not fut.done():
            await self._race(fut)
        if fut.done():
            return fut.result()
        # What the machine has not been told yet: the client left, or the grace period ended
        # (after Shutdown the machine has closed the upstream and nothing waits again).
        if not self.machine.client_gone and self.gone.done():
            return GONE
        if self.hard_stop.future.done():
            return SHUTDOWN
        if self._silent():
            return SILENT
        return DEADLINE

    def _silent(self) -> bool:
        """The read timeout passed before a safe point and the machine was not told yet."""
        s = self.silence
        return (
            s.done()
            and not s.cancelled()
            and not self.machine.client_gone
            and not self.machine.upstream_closed
        )

    async def _race(self, fut: asyncio.Future[Any]) -> None:
        loop = fut.get_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def wake(_: object = None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        # Spelled out rather than a list of the watched futures and a generator over it:
        # this runs once per request (the wait for the response head).
        hard, gone, silence = self.hard_stop, self.gone, self.silence
        client = not self.machine.client_gone
        fut.add_done_callback(wake)
        hard.wakers.add(wake)
        if client:
            gone.add_done_callback(wake)
            silence.add_done_callback(wake)
        timer = None
        # A deadline only while a drain is under way, which needs the client gone: the
        # property is not read for a present one (most waits).
        deadline = None if client else self.machine.deadline
        if deadline is not None:
            timer = loop.call_at(loop.time() + deadline - time.monotonic(), wake)
        try:
            if not (
                fut.done() or hard.future.done() or (client and (gone.done() or silence.done()))
            ):
                await waiter
        finally:
            fut.remove_done_callback(wake)
            hard.wakers.discard(wake)
            if client:
                gone.remove_done_callback(wake)
                silence.remove_done_callback(wake)
            if timer is not None:
                timer.cancel()

    # --- events into the machine ----------------------------------------------------------

    def _client_gone(self) -> drain.Decision:
        decision = self.machine.handle(drain.ClientGone(now=time.monotonic()))
        phase = self.machine.disconnect_phase
        if phase is not None:
            self.record.client_disconnect = phase
            self.services.metrics.client_disconnects.labels(phase, self.record.upstream_label).inc()
            log_event(
                log, logging.DEBUG, "client gone", request_id=self.record.request_id, phase=phase
            )
        if self.machine.deferred:
            self.services.metrics.deferred_in_progress.labels(self.record.upstream_label).inc()
        return decision

    def _signal(self, sig: _Signal) -> drain.Decision:
        now = time.monotonic()
        if sig is GONE:
            return self._client_gone()
        if sig is DEADLINE:
            return self.machine.handle(drain.Deadline(now=now))
        if sig is SILENT:
            return self.machine.handle(drain.UpstreamSilent(now=now))
        return self.machine.handle(drain.Shutdown(now=now))

    # --- the exchange -------------------------------------------------------------------

    async def run(
        self, upstream: str, method: str, target: str, headers: CIMultiDict[str], body: bytes
    ) -> web.StreamResponse | None:
        """Send `method target` to the `upstream` URL; returns a response to send when
        nothing was streamed yet, else None."""
        s = self.services
        t_sent = time.monotonic()
        send = s.upstream.start(upstream, method, target, headers, body, silence=self.silence)
        try:
            result = await self._headers_phase(send)
            # Tested on the plain class: aiohttp's responses are MutableMappings, and an
            # isinstance against one goes through ABCMeta's Python-level check.
            if not isinstance(result, UpstreamResponse):
                return result
            return await self._body_phase(result, t_sent)
        finally:
            if not send.done():
                send.cancel()
                with contextlib.suppress(BaseException):
                    await send
            self._close_upstream()
            s.watcher.unwatch(self.request)
            self._account_deferral()
            if self.relayed:
                # Once per response (an observation per chunk would cost ~10% of a chunk).
                r = self.record
                s.metrics.overhead.labels(r.route, r.decision, "chunk").observe(
                    self.relay_s / self.relayed
                )

    async def _headers_phase(
        self, send: asyncio.Future[UpstreamResponse]
    ) -> UpstreamResponse | web.StreamResponse | None:
        while True:
            try:
                with network_boundary():
                    got = await self._wait(send)
            except UpstreamFailure as err:
                return self._upstream_failed(err)
            if isinstance(got, _Signal):
                decision = self._signal(got)
                if isinstance(decision, drain.CloseUpstream):
                    return None
                if isinstance(decision, drain.Hold):
                    await self._answer_held()
                continue
            up: UpstreamResponse = got
            self.upstream = up
            self.machine.handle(drain.UpstreamHeaders(time.monotonic()))
            return up

    async def _fail_midway(
        self, err: KvproxyError, close: bool = False
    ) -> web.StreamResponse | None:
        """The upstream broke after its headers: end the client's stream with an error event
        if it already started, else answer with the error. `close`: and close the client's
        connection either way."""
        resp = self._upstream_failed(err)
        if self.client is not None and not self.machine.client_gone:
            await self._end_stream_with_error(err, close)
            return None
        if resp is not None and close:
            resp.force_close()
        return resp

    def _upstream_failed(self, err: KvproxyError) -> web.StreamResponse | None:
        if isinstance(err, UpstreamFailure):
            self.failure = err
        self.record.upstream_outcome = err.code
        self.services.metrics.upstream_errors.labels(err.code).inc()
        self.machine.handle(drain.UpstreamError(now=time.monotonic()))
        if self.machine.client_gone:
            return None
        return error_response(err, self.extra_headers, self.style)

    async def _start_client(self, up: UpstreamResponse) -> web.StreamResponse:
        headers = filter_headers(up.headers)
        headers.update(self.extra_headers)
        resp = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
        # An event stream is forwarded event by event (whole events only), not byte for byte,
        # and a held body is answered whole by _finish: neither keeps the upstream's length.
        held = self.inspector is not None and self.inspector.hold
        if up.headers.get("Content-Length") is not None and not (held or _is_sse(up)):
            resp.content_length = int(up.headers["Content-Length"])
        await resp.prepare(self.request)
        self.client = resp
        return resp

    async def _body_phase(self, up: UpstreamResponse, t_sent: float) -> web.StreamResponse | None:
        is_sse = _is_sse(up)
        self.inspector = insp = ResponseInspector(
            self.scanner,
            sse=is_sse,
            block=self.services.settings.canary_action == "block",
            read_usage=not self.streaming,
        )
        got_first = False
        while True:
            m = self.machine
            fast = got_first and not m.client_gone and (not self.streaming or m.token_seen)
            if fast and not self.silence.done():
                # A safe point: from here the read timeout fails the read and closes.
                self.silence.cancel()
                # Nor is the client's departure raced any more (`fast` reads without
                # `_wait`): a gone client fails the next write (`_write`), so the watcher's
                # scan of this request would be work for nothing while the stream lasts.
                self.services.watcher.forget(self.request)
            elif fast and self._silent():
                fast = False  # it fired before the safe point: the racing wait reports it
            try:
                with network_boundary():
                    if fast:
                        chunk = await up.readany()
                    elif buffered := up.read_nowait():
                        # Already here (a small response arrives with its headers): no wait, so
                        # nothing to race and no task to spend.
                        chunk = buffered
                    else:
                        read = asyncio.ensure_future(up.readany())
                        try:
                            got = await self._wait(read)
                        finally:
                            if not read.done():
                                read.cancel()
                                with contextlib.suppress(BaseException):
                                    await read
                        if isinstance(got, _Signal):
                            decision = self._signal(got)
                            if isinstance(decision, drain.Hold):
                                await self._answer_held()
                            elif isinstance(decision, drain.CloseUpstream):
                                if got is SILENT:  # after a token: fail it, as a timeout
                                    return await self._silent_close()
                                return None
                            continue
                        chunk = got
            except UpstreamFailure as err:
                return await self._fail_midway(err)
            now = time.monotonic()
            if not chunk:
                end = insp.finish()
                if self._report(end):
                    return await self._block(up)
                tail = is_sse and end.forward and not self.machine.client_gone
                if tail and not await self._write(up, end.forward):
                    return None
                self.machine.handle(drain.UpstreamEOF(now))
                return await self._finish(up, end)
            got_first = True
            if up.status >= 500 and len(self.error_body) < ERROR_BODY_BYTES:
                self.error_body += chunk[: ERROR_BODY_BYTES - len(self.error_body)]
            try:
                step = insp.feed(chunk)
            except SSEError:
                # An event (a line) past the bound: the stream ends with the error event, or
                # the error when nothing was relayed yet, and the client's connection closes:
                # whatever the upstream still pours is nobody's.
                return await self._fail_midway(
                    errors.upstream_bad_response("oversized SSE event"), close=True
                )
            if step.output or not is_sse:
                # TTFT: the first generated output of a stream (whatever field carries it),
                # the first body byte of anything else.
                self._observe_ttft(now - t_sent)
            if self._report(step):
                return await self._block(up)
            # A token already reached a present client: every chunk is forwarded and changes
            # nothing (the table says so), so the hot path skips building and dispatching it.
            if not m.chunks_change_nothing:
                decision = m.handle(drain.UpstreamChunk(now, step.output))
                if isinstance(decision, drain.CloseUpstream):
                    return None
                if isinstance(decision, drain.Discard):
                    continue
            truncated = insp.truncated
            kept = insp.keep(step.forward)
            if kept.refuse is not None:
                # Too big to hold for scanning; fail closed rather than deliver unscanned.
                return await self._block(up, kept.refuse)
            if insp.truncated and not truncated:
                log_event(
                    log,
                    logging.WARNING,
                    "response too large to scan for canaries: the rest is not scanned",
                    request_id=self.record.request_id,
                )
            if not kept.forward:
                continue
            self.relay_s += time.monotonic() - now
            self.relayed += 1
            if self.client is None and not is_sse and up.at_eof():
                # The whole body is here and nothing was sent yet: answer it in one write at
                # EOF (the next read) instead of a prepared stream, a write and an EOF.
                self.whole = kept.forward
            elif not await self._write(up, kept.forward):
                return None

    async def _answer_held(self) -> None:
        """`Hold`: the upstream went silent before a safe point. The client gets the
        timeout now (an error response, or its started stream ended with the error); the
        upstream stays open as a deferred cancellation (I5), counted by its outcome."""
        err = errors.upstream_failure("timeout", "TimeoutError")
        self.record.upstream_outcome = err.code
        self.services.metrics.upstream_errors.labels(err.code).inc()
        self.services.metrics.deferred_in_progress.labels(self.record.upstream_label).inc()
        if self.upstream is None and not self.head_timed_out:
            self.head_timed_out = True
            if self.on_head_timeout is not None:
                self.on_head_timeout()
        if self.client is not None:
            await self._end_stream_with_error(err)
            return
        resp = error_response(err, self.extra_headers, self.style)
        # The handler returns only once the upstream is closed: a keep-alive client must
        # not queue its next request behind the drain.
        resp.force_close()
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await resp.prepare(self.request)
            await resp.write_eof()
        self.client = resp

    async def _silent_close(self) -> web.StreamResponse | None:
        """Silence after a token reached the client: the transfer is over, so the request
        fails as a timeout and the upstream is closed now."""
        err = errors.upstream_failure("timeout", "TimeoutError")
        self.record.upstream_outcome = err.code
        self.services.metrics.upstream_errors.labels(err.code).inc()
        if self.client is not None:
            await self._end_stream_with_error(err)
            return None
        return error_response(err, self.extra_headers, self.style)

    async def _write(self, up: UpstreamResponse, chunk: bytes) -> bool:
        """Relay one chunk; False when the upstream must now be closed (client gone at a
        safe point)."""
        try:
            client = self.client or await self._start_client(up)
            await client.write(chunk)
            self.record.bytes_out += len(chunk)
        except (ConnectionResetError, RuntimeError):
            # RuntimeError: aiohttp raises it when the payload writer is already closed.
            if isinstance(self._client_gone(), drain.CloseUpstream):
                return False
        return True

    def _observe_ttft(self, ttft: float) -> None:
        if self.record.ttft_s is None:
            self.record.ttft_s = ttft
            self.services.metrics.upstream_ttft.observe(ttft)

    def _report(self, step: Step) -> bool:
        """Count and log each hit; True when the response must be withheld now."""
        for hit in step.hits:
            self._report_canary(hit)
        # Observe only counts. After a disconnect nothing reaches anyone, so the chunk goes
        # to the drain machine like any other (it carries a token).
        return step.withhold and not self.machine.client_gone

    async def _finish(self, up: UpstreamResponse, end: Step) -> web.StreamResponse | None:
        if self.machine.client_gone:
            return None
        assert self.inspector is not None
        body = end.forward if self.inspector.hold else self.whole
        if body is not None:
            headers = filter_headers(up.headers)
            headers.update(self.extra_headers)
            self.record.bytes_out += len(body)
            return web.Response(status=up.status, reason=up.reason, headers=headers, body=body)
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            client = self.client or await self._start_client(up)
            await client.write_eof()
        return None

    def _report_canary(self, hit: CanaryHit) -> None:
        tenant = self.record.tenant or "unknown"
        self.services.metrics.canary_violations.labels(tenant).inc()
        log_event(
            log,
            logging.ERROR,
            "canary violation: foreign tenant marker in a response",
            request_id=self.record.request_id,
            tenant=tenant,
            owner_tenant=hit.owner_tenant,
            marker_id=hit.marker_id,
            action=self.services.settings.canary_action,
        )

    async def _block(
        self, up: UpstreamResponse, err: KvproxyError | None = None
    ) -> web.StreamResponse | None:
        """Withhold the rest of the response (a canary hit, by default)."""
        # The marker arrived in a generated token: decode holds its KV, the transfer is
        # over, so closing the upstream now is a safe point (I5).
        if not self.machine.upstream_closed:
            self.machine.handle(drain.UpstreamEOF(time.monotonic()))
        err = err or errors.canary_violation()
        self.record.upstream_outcome = err.code
        if self.machine.client_gone:
            return None
        if self.client is not None:
            await self._end_stream_with_error(err)
            return None
        return error_response(err, self.extra_headers, self.style)

    async def _end_stream_with_error(self, err: KvproxyError, close: bool = False) -> None:
        """A response already started cannot be completed: an event stream ends with the
        documented error event; any other body with the client's connection reset before
        its framing (a length, or chunks) completes, as nginx and Envoy end it. Padding it
        to its length, or a last chunk, would hand a client a complete-looking lie."""
        assert self.client is not None
        if self.upstream is not None and _is_sse(self.upstream):
            if close:
                # Closed after the event (an upstream still pouring an oversized event): a
                # client reading to the end learns it is over now.
                self.client.force_close()
            with contextlib.suppress(ConnectionResetError, RuntimeError):
                await self.client.write(errors.sse_error_event(err, self.style))
                await self.client.write_eof()
            return
        reset_client(self.request, self.client)

    # --- closing ------------------------------------------------------------------------

    def _close_upstream(self) -> None:
        up = self.upstream
        if up is None:
            return
        if up.at_eof():
            up.release()  # pools the connection (if the upstream keeps it alive)
        else:
            up.close()  # an intentional abort drops it

    def _account_deferral(self) -> None:
        m = self.services.metrics
        if not self.machine.client_gone:
            return
        outcome = self.machine.outcome
        if outcome is None:
            return
        now = time.monotonic()
        duration = self.machine.deferred_for(now)
        self.record.deferred_outcome = outcome
        self.record.deferred_s = duration
        upstream = self.record.upstream_label
        m.deferred_total.labels(outcome, upstream).inc()
        m.deferred_duration.labels(outcome, upstream).observe(duration)
        if self.machine.discarded_token_chunks:
            m.discarded_tokens.inc(self.machine.discarded_token_chunks)
        if self.machine.was_deferred:
            m.deferred_in_progress.labels(upstream).dec()
        if outcome == "timeout":
            log_event(
                log,
                logging.WARNING,
                "deferred cancellation timed out: drain NOT confirmed, KV writes may still land",
                request_id=self.record.request_id,
                deferred_s=round(duration, 3),
            )


def reset_client(request: web.Request, resp: web.StreamResponse) -> None:
    """Drop the client's connection now, unsent bytes and all, with a reset (SO_LINGER 0):
    a close alone could read as the end of a close-delimited (HTTP/1.0) body."""
    resp.force_close()
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    transport.abort()


def _is_sse(up: UpstreamResponse) -> bool:
    return up.headers.get("Content-Type", "").startswith("text/event-stream")
