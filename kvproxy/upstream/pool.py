"""The relay's HTTP/1.1 client to the router: pooled keep-alive connections, responses
framed by llhttp (httptools, the parser uvicorn serves with), bodies handed over as they
arrive.

Why not aiohttp's ClientSession, which the probes and tools keep using: the relay sends
one shape of request to a handful of origins, and ClientSession's generality (URL objects,
cookies, redirects, tracing, a payload registry, timers per request) costs about twice
this client's CPU per small request (bench/client_cost.py: 129 vs 63 us on a busy run; a
third of the bare forwarder's whole cost on a quiet one).

`UpstreamPool.request(url, method, target, headers, body)` sends one request on an idle
connection to the upstream at `url` (or a new one: at most `limit` open, callers wait when
all are busy) and returns an `UpstreamResponse` once its head arrived; `start` is the same
as a future to race, without a task when an idle connection takes it at once. The
connection and its response are kvproxy.upstream.connection's. Its body is read with
`readany` / `read_nowait` / `at_eof`; `release()` gives back a connection whose response
was read to its end and may be kept alive, `close()` aborts it (the relay's upstream
cancellation).

Timeouts: connecting (`connect_timeout_s`); the gap between two reads of a response while
the client keeps up, the head's wait included (`read_timeout_s`, from the request's send
on: a long prefill sends nothing for minutes); and, while a large body goes out, the gap
the upstream may take no request bytes (`send_timeout_s`). The read timer is one per
connection for its whole life, moved only when it fires, so neither a request nor a
streamed chunk costs timer work. An idle connection is not reused after `keepalive_s` and
is closed by a sweep soon after. Bounds: `max_head_bytes` and `max_headers` per response
head (kvproxy.upstream.connection counts them as bytes arrive; kvproxy.response.head is what a
head may hold).

Raises (kvproxy.upstream.boundary classifies them): UpstreamConnectError (refused, unreachable,
DNS), UpstreamConnectTimeout (a TimeoutError: no connection within connect_timeout_s),
ConnectionResetError (the upstream closed before the response ended), TimeoutError,
UpstreamProtocolError (bytes llhttp cannot read as a response, a head it may not relay or
past its bounds, or bytes with no request outstanding).

Must never: send a request on a connection with a response still unread, reuse one after
a response it could not read to the end (HEAD, close-delimited, failed, aborted) or one
that came before the request body was all sent, send a header value holding CR, LF or NUL,
or hold more than READ_HIGH_WATER unread body bytes (reading the socket pauses until the
relay catches up).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
import time

from multidict import CIMultiDict

from kvproxy.policy import Origin, parse_origin
from kvproxy.upstream.connection import READ_HIGH_WATER as READ_HIGH_WATER
from kvproxy.upstream.connection import WRITE_PIECE, Connection, ConnectionLimits
from kvproxy.upstream.connection import UpstreamConnectError as UpstreamConnectError
from kvproxy.upstream.connection import UpstreamConnectTimeout as UpstreamConnectTimeout
from kvproxy.upstream.connection import UpstreamProtocolError as UpstreamProtocolError
from kvproxy.upstream.connection import UpstreamResponse as UpstreamResponse

# Envoy's defaults for a response head: 60 KiB (max_response_headers_kb) and 100 fields
# (max_headers_count). nginx's proxy_buffer_size (one 4-8 KiB page) is tighter; a router's
# head is well under 1 KiB, so the larger bound refuses nothing real.
DEFAULT_MAX_HEAD_BYTES = 60 * 1024
DEFAULT_MAX_HEADERS = 100
# nginx's proxy_send_timeout: the longest the upstream may take no request bytes.
DEFAULT_SEND_TIMEOUT_S = 60.0


class UpstreamPool:
    """Connections to every upstream origin of this process. One per server."""

    def __init__(
        self,
        *,
        limit: int,
        keepalive_s: float,
        connect_timeout_s: float,
        read_timeout_s: float,
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
        max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
        max_headers: int = DEFAULT_MAX_HEADERS,
    ) -> None:
        self.limit = limit
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        # What each connection may take and wait for (ConnectionOwner.limits).
        self.limits = ConnectionLimits(read_timeout_s, send_timeout_s, max_head_bytes, max_headers)
        self._origins: dict[str, Origin] = {}
        self._idle: dict[Origin, list[Connection]] = {}
        self._open: set[Connection] = set()
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
        self,
        url: str,
        method: str,
        target: str,
        headers: CIMultiDict[str],
        body: bytes,
        *,
        silence: asyncio.Future[None] | None = None,
    ) -> asyncio.Future[UpstreamResponse]:
        """`request` as a future to race, without a task when it can be sent right away (an
        idle connection and a body that goes in one write, the common case). Cancelling
        the future aborts the connection (an upstream cancellation). `silence`: see
        `Connection.send` (the read timeout resolves it instead of failing the request)."""
        origin = self.origin(url)
        if len(body) <= WRITE_PIECE and not self._closed and self._idle.get(origin):
            head = _request_head(method, origin.prefix + target, origin.host_header, headers, body)
            conn = self._reuse(origin)
            if conn is not None:
                try:
                    conn.send(head, body, no_body=method == "HEAD", silence=silence)
                except BaseException:
                    conn.abort()
                    raise
                assert conn.head is not None
                return conn.head
        return asyncio.ensure_future(
            self.request(url, method, target, headers, body, silence=silence)
        )

    async def request(
        self,
        url: str,
        method: str,
        target: str,
        headers: CIMultiDict[str],
        body: bytes,
        *,
        silence: asyncio.Future[None] | None = None,
    ) -> UpstreamResponse:
        """Send `method target` to the upstream at `url`; the response once its head came.
        `headers` must not hold hop-by-hop fields (kvproxy.serve.headers); Host and
        Content-Length are this client's."""
        origin = self.origin(url)
        head = _request_head(method, origin.prefix + target, origin.host_header, headers, body)
        conn = await self._acquire(origin)
        try:
            conn.send(head, body, no_body=method == "HEAD", silence=silence)
            if len(body) > WRITE_PIECE:
                await conn.send_rest(body)
            assert conn.head is not None
            return await conn.head
        except BaseException:
            if conn.head is not None and not conn.head.done():
                conn.head.cancel()  # nobody will read it: no "exception never retrieved"
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

    async def _acquire(self, origin: Origin) -> Connection:
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

    def _reuse(self, origin: Origin) -> Connection | None:
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

    async def _connect(self, origin: Origin) -> Connection:
        loop = asyncio.get_running_loop()
        self._connecting += 1
        conn = Connection(self, origin)
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
                # A blackholed router (a lost node, a dropped SYN) ends here, not refused.
                raise UpstreamConnectTimeout(
                    f"no connection to {origin.host}:{origin.port} within "
                    f"{self.connect_timeout_s:g} s"
                ) from exc
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

    # --- ConnectionOwner: what its connections tell the pool ------------------------------

    def idle(self, conn: Connection) -> None:
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
                conn.abort()  # lost() takes it off the list
        if self.idle_connections:
            loop = asyncio.get_running_loop()
            self._sweep = loop.call_later(self.keepalive_s / 2, self._sweep_idle)

    def lost(self, conn: Connection) -> None:
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
