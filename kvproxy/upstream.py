"""The relay's HTTP/1.1 client to the router: pooled keep-alive connections, responses
framed by llhttp (httptools, the parser uvicorn serves with), bodies handed over as they
arrive.

Why not aiohttp's ClientSession, which the probes and tools keep using: the relay sends
one shape of request to a handful of origins, and ClientSession's generality (URL objects,
cookies, redirects, tracing, a payload registry, timers per request) costs about twice
this client's CPU per small request (bench/client_cost.py: 129 vs 63 us on a busy run; a
third of the bare forwarder's whole cost on a quiet one).

`UpstreamPool.request(origin, method, target, headers, body)` sends one request on an idle
connection to `origin` (or a new one: at most `limit` open, callers wait when all are
busy) and returns an `UpstreamResponse` once its head arrived. Its body is read with
`readany` / `read_nowait` / `at_eof`; `release()` gives back a connection whose response
was read to its end and may be kept alive, `close()` aborts it (the relay's upstream
cancellation).

Timeouts, as aiohttp's sock_connect / sock_read were configured: connecting, and the gap
between two reads of a response while the client keeps up (from the request's send on: a
long prefill sends nothing for minutes). One timer per connection for its whole life,
moved only when it fires, so neither a request nor a streamed chunk costs timer work. An idle
connection is not reused after `keepalive_s` and is closed by a sweep soon after.

Raises (kvproxy.netio classifies them): UpstreamConnectError (refused, unreachable, DNS),
ConnectionResetError (the upstream closed before the response ended), TimeoutError,
UpstreamProtocolError (bytes llhttp cannot read as a response, or bytes with no request
outstanding).

Must never: send a request on a connection with a response still unread, reuse one after
a response it could not read to the end (HEAD, close-delimited, failed, aborted), send a
header value holding CR or LF, or hold more than READ_HIGH_WATER unread body bytes
(reading the socket pauses until the relay catches up).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
import time

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from kvproxy.origin import Origin, parse_origin

# Unread body bytes of one response before its socket stops being read.
READ_HIGH_WATER = 1 << 20
# A request body above this goes out in pieces of this size, each once the socket drained.
WRITE_PIECE = 256 * 1024
_NO_BODY_STATUSES = frozenset({204, 304})


class UpstreamProtocolError(Exception):
    """The upstream sent bytes that are not a readable HTTP/1.1 response."""


class UpstreamConnectError(ConnectionError):
    """No connection to the upstream could be opened; `dns` when its name did not resolve."""

    def __init__(self, message: str, *, dns: bool = False) -> None:
        super().__init__(message)
        self.dns = dns


class UpstreamResponse:
    """One response: its head, and its body as it arrives. Not reusable."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_eof",
        "_exc",
        "_released",
        "_size",
        "_waiter",
        "close_delimited",
        "headers",
        "keep_alive",
        "reason",
        "status",
    )

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
        self.keep_alive = False
        self.close_delimited = False
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._released = False

    # --- reading (the relay) ------------------------------------------------------------

    def read_nowait(self) -> bytes:
        """What arrived and was not read yet (b"" when nothing did); raises the failure
        once nothing is left to read."""
        if self._chunks:
            return self._take()
        if self._exc is not None:
            raise self._exc
        return b""

    async def readany(self) -> bytes:
        """The next bytes of the body; b"" at its end."""
        while not self._chunks:
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return b""
            await self._wait()
        return self._take()

    def at_eof(self) -> bool:
        return self._eof and not self._chunks

    def release(self) -> None:
        """Done with it: the connection goes back to the pool if the body was read to its
        end and the upstream keeps it alive, else it is closed."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        if self.at_eof() and self._exc is None and self.keep_alive:
            conn.done_with(self)
        else:
            conn.abort()

    def close(self) -> None:
        """Abort: the connection is dropped whatever was read (upstream cancellation)."""
        if not self._released:
            self._released = True
            self._conn.abort()

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        self._conn.resume_reading()
        return data

    async def _wait(self) -> None:
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- fed by the connection ----------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > READ_HIGH_WATER:
            self._conn.pause_reading()
        self._wake()

    def _end(self) -> None:
        self._eof = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None and not self._eof:
            self._exc = exc
        self._wake()


class _Connection(asyncio.Protocol):
    """One connection and the response it is reading (at most one)."""

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.head: asyncio.Future[UpstreamResponse] | None = None
        self.closed = False
        self.reusable = True
        self.idle_since = 0.0
        self.last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._reading_paused = False
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._interim = False
        self._reason = bytearray()
        self._headers: list[tuple[bytes, bytes]] = []
        self._no_body = False

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's quacks like one

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        resp = self.response
        if resp is not None and not resp._eof:
            if exc is None and resp.close_delimited:
                resp._end()  # the close is this body's end
            else:
                resp._fail(ConnectionResetError("the upstream closed the connection mid-response"))
        self._head_failed(ConnectionResetError("the upstream closed the connection"))
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_exception(ConnectionResetError("the upstream closed the connection"))
        self.pool._forget(self)

    def data_received(self, data: bytes) -> None:
        self.last_read = time.monotonic()
        if self.response is None:
            self._protocol_error("bytes arrived with no request outstanding")
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._protocol_error("the upstream switched protocols")
        except httptools.HttpParserError as exc:
            self._protocol_error(f"unreadable response ({exc})")

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost ends or fails the response

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    # --- llhttp callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        resp = self.response
        if resp is None or resp.status:
            # A second response to one request: the stream is out of step with requests.
            raise UpstreamProtocolError("a response arrived with no request outstanding")

    def on_status(self, status: bytes) -> None:
        self._reason += status  # may come in pieces

    def on_header(self, name: bytes, value: bytes | None) -> None:
        self._headers.append((name, value or b""))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            # An interim response (100 Continue, 103 Early Hints): the real one follows.
            self._interim = True
            self._headers.clear()
            self._reason.clear()
            return
        resp = self.response
        assert resp is not None
        headers: CIMultiDict[str] = CIMultiDict()
        chunked = has_length = False
        for name, value in self._headers:
            key = name.decode("latin-1")
            text = value.decode("utf-8", "surrogateescape")
            headers.add(key, text)
            lk = key.lower()
            if lk == "content-length":
                has_length = True
            elif lk == "transfer-encoding" and "chunked" in text.lower():
                chunked = True
        self._headers = []
        resp.status = status
        resp.reason = self._reason.decode("latin-1")
        resp.headers = CIMultiDictProxy(headers)
        resp.keep_alive = self.parser.should_keep_alive()
        no_body = self._no_body or status in _NO_BODY_STATUSES
        resp.close_delimited = not (no_body or chunked or has_length)
        if resp.close_delimited:
            self.reusable = False
        head = self.head
        if head is not None and not head.done():
            head.set_result(resp)
        if self._no_body:
            # A HEAD's Content-Length describes a body that never comes; llhttp would wait
            # for it, so the response ends here and the connection is not reused.
            self.reusable = False
            resp._end()

    def on_body(self, body: bytes) -> None:
        resp = self.response
        if resp is not None and not self._no_body:
            resp._feed(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        resp = self.response
        if resp is not None:
            resp._end()

    # --- the pool's side ----------------------------------------------------------------

    def send(self, head: bytes, body: bytes, *, no_body: bool) -> None:
        """Write the head (and a small body) now; the response comes later."""
        assert self.transport is not None
        assert self.response is None
        self.response = UpstreamResponse(self)
        self.head = head_future = asyncio.get_running_loop().create_future()
        head_future.add_done_callback(self._head_settled)
        self._no_body = no_body
        self._interim = False
        self._reason.clear()
        self._headers = []
        self.last_read = time.monotonic()
        self._arm_timer()
        if len(body) <= WRITE_PIECE:
            self.transport.writelines((head, body)) if body else self.transport.write(head)
        else:
            self.transport.write(head)

    async def send_rest(self, body: bytes) -> None:
        """Write a large body in pieces, waiting for the socket to drain between them."""
        view = memoryview(body)
        for start in range(0, len(body), WRITE_PIECE):
            if self.closed:
                raise ConnectionResetError("the upstream closed the connection mid-request")
            if self._write_paused:
                self._drained = asyncio.get_running_loop().create_future()
                try:
                    await self._drained
                finally:
                    self._drained = None
            assert self.transport is not None
            self.transport.write(view[start : start + WRITE_PIECE])

    def done_with(self, resp: UpstreamResponse) -> None:
        self.response = None
        self.head = None
        if self.closed or not self.reusable:
            self.abort()
            return
        self.idle_since = time.monotonic()
        self.pool._put(self)

    def abort(self) -> None:
        self._cancel_timer()
        if not self.closed and self.transport is not None:
            self.transport.abort()
        self.closed = True
        self.pool._forget(self)

    def pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = False
            self.last_read = time.monotonic()  # the wait was the client's, not the upstream's
            self.transport.resume_reading()

    def _head_settled(self, head: asyncio.Future[UpstreamResponse]) -> None:
        if head.cancelled():
            self.abort()  # the caller gave up on the response: an upstream cancellation

    def _head_failed(self, exc: BaseException) -> None:
        head = self.head
        if head is not None and not head.done():
            head.set_exception(exc)

    def _protocol_error(self, why: str) -> None:
        err = UpstreamProtocolError(why)
        if self.response is not None:
            self.response._fail(err)
        self._head_failed(err)
        self.abort()

    # --- the read timeout ---------------------------------------------------------------

    def _arm_timer(self) -> None:
        if self._timer is None:
            timeout = self.pool.read_timeout_s
            self._timer = asyncio.get_running_loop().call_later(timeout, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        # Kept for the connection's life rather than set and cancelled per request: the
        # timer heap work would be a measurable part of a small request's cost.
        self._timer = None
        if self.closed:
            return
        timeout = self.pool.read_timeout_s
        if self.response is None or self.response._eof:
            self._timer = asyncio.get_running_loop().call_later(timeout, self._on_timer)
            return
        quiet = time.monotonic() - self.last_read
        if self._reading_paused or quiet < timeout:
            # Data came meanwhile, or the relay is the slow side: look again later.
            wait = timeout if self._reading_paused else timeout - quiet
            self._timer = asyncio.get_running_loop().call_later(wait, self._on_timer)
            return
        err = TimeoutError(f"no bytes from the upstream for {timeout:g} s")
        self.response._fail(err)
        self._head_failed(err)
        self.abort()


class UpstreamPool:
    """Connections to every upstream origin of this process. One per server."""

    def __init__(
        self,
        *,
        limit: int,
        keepalive_s: float,
        connect_timeout_s: float,
        read_timeout_s: float,
    ) -> None:
        self.limit = limit
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._origins: dict[str, Origin] = {}
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._connecting = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._tls: ssl.SSLContext | None = None
        self._closed = False
        self._sweep: asyncio.TimerHandle | None = None

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @property
    def idle_connections(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def origin(self, url: str) -> Origin:
        got = self._origins.get(url)
        if got is None:
            got = self._origins[url] = parse_origin(url)
        return got

    def start(
        self, url: str, method: str, target: str, headers: CIMultiDict[str], body: bytes
    ) -> asyncio.Future[UpstreamResponse]:
        """`request` as a future to race, without a task when it can be sent right away (an
        idle connection and a body that goes in one write, the common case). Cancelling
        the future aborts the connection (an upstream cancellation)."""
        origin = self.origin(url)
        if len(body) <= WRITE_PIECE and not self._closed and self._idle.get(origin):
            head = _request_head(method, origin.prefix + target, origin.host_header, headers, body)
            conn = self._reuse(origin)
            if conn is not None:
                try:
                    conn.send(head, body, no_body=method == "HEAD")
                except BaseException:
                    conn.abort()
                    raise
                assert conn.head is not None
                return conn.head
        return asyncio.ensure_future(self.request(url, method, target, headers, body))

    async def request(
        self, url: str, method: str, target: str, headers: CIMultiDict[str], body: bytes
    ) -> UpstreamResponse:
        """Send `method target` to the upstream at `url`; the response once its head came.
        `headers` must not hold hop-by-hop fields (kvproxy.headers); Host and
        Content-Length are this client's."""
        origin = self.origin(url)
        head = _request_head(method, origin.prefix + target, origin.host_header, headers, body)
        conn = await self._acquire(origin)
        try:
            conn.send(head, body, no_body=method == "HEAD")
            if len(body) > WRITE_PIECE:
                await conn.send_rest(body)
            assert conn.head is not None
            return await conn.head
        except BaseException:
            conn.abort()
            raise

    async def close(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self._open):
            conn.abort()
        self._idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(UpstreamConnectError("the upstream pool is closed"))
        self._waiters.clear()

    # --- connections --------------------------------------------------------------------

    async def _acquire(self, origin: Origin) -> _Connection:
        while True:
            if self._closed:
                raise UpstreamConnectError("the upstream pool is closed")
            conn = self._reuse(origin)
            if conn is not None:
                return conn
            if len(self._open) + self._connecting < self.limit:
                return await self._connect(origin)
            if not self._close_one_idle():
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                try:
                    await waiter
                finally:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)

    def _reuse(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        too_old = time.monotonic() - self.keepalive_s
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be closing
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                conn.abort()
                continue
            if conn.idle_since < too_old:
                conn.abort()
                continue
            return conn
        return None

    def _close_one_idle(self) -> bool:
        """At the limit with idle connections to other origins: close one to make room."""
        for idle in self._idle.values():
            if idle:
                idle.pop(0).abort()
                return True
        return False

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        self._connecting += 1
        conn = _Connection(self, origin)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(
                    lambda: conn,
                    origin.host,
                    origin.port,
                    ssl=self._tls_context() if origin.tls else None,
                    server_hostname=origin.host if origin.tls else None,
                )
        except socket.gaierror as exc:
            raise UpstreamConnectError(
                f"cannot resolve {origin.host}: {exc.strerror}", dns=True
            ) from exc
        except (ConnectionError, OSError) as exc:
            if isinstance(exc, TimeoutError):
                raise
            raise UpstreamConnectError(
                f"cannot connect to {origin.host}:{origin.port}: {exc.strerror or exc}"
            ) from exc
        finally:
            self._connecting -= 1
        self._open.add(conn)
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _put(self, conn: _Connection) -> None:
        if self._closed:
            conn.abort()
            return
        self._idle.setdefault(conn.origin, []).append(conn)
        self._wake_one()
        if self._sweep is None:
            loop = asyncio.get_running_loop()
            self._sweep = loop.call_later(self.keepalive_s, self._sweep_idle)

    def _sweep_idle(self) -> None:
        """Close the connections idle for longer than keepalive_s; look again while any
        are idle (one timer for the pool, not one per connection)."""
        self._sweep = None
        too_old = time.monotonic() - self.keepalive_s
        for idle in self._idle.values():
            for conn in [c for c in idle if c.idle_since <= too_old]:
                conn.abort()  # _forget takes it off the list
        if self.idle_connections:
            loop = asyncio.get_running_loop()
            self._sweep = loop.call_later(self.keepalive_s / 2, self._sweep_idle)

    def _forget(self, conn: _Connection) -> None:
        if conn in self._open:
            self._open.discard(conn)
            idle = self._idle.get(conn.origin)
            if idle and conn in idle:
                idle.remove(conn)
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def _request_head(
    method: str, target: str, host: bytes, headers: CIMultiDict[str], body: bytes
) -> bytes:
    fields = [f"{name}: {value}" for name, value in headers.items()]
    # Headers reach here as aiohttp parsed them (it refuses CR and LF in the client's
    # request); kvproxy's own values are ids and numbers. Checked anyway, on the fields
    # before they are joined: a line break sent upstream would smuggle a request to the
    # router. One scan of the joined fields instead of three per header.
    joined = "".join(fields) + method + target
    if "\r" in joined or "\n" in joined or "\x00" in joined or " " in target:
        raise ValueError("a header or target for the upstream holds CR, LF or NUL (or a space)")
    line = f"{method} {target or '/'} HTTP/1.1\r\nHost: ".encode("utf-8", "surrogateescape")
    parts = [line, host]
    if fields:
        parts += (b"\r\n", "\r\n".join(fields).encode("utf-8", "surrogateescape"))
    if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
        parts += (b"\r\nContent-Length: ", str(len(body)).encode())
    parts.append(b"\r\n\r\n")
    return b"".join(parts)
