"""One connection of the relay's upstream client (kvproxy/upstream/pool.py) and the response it
is reading: llhttp's callbacks (httptools) turned into a head, a body read as it arrives
with flow control, and the read timeout (one timer for the connection's life).

Raises into the reader (kvproxy.upstream.boundary classifies them): ConnectionResetError (the
upstream closed before the response ended), TimeoutError (no bytes for the read timeout, or
the upstream took no request bytes for the send timeout), UpstreamProtocolError. A caller
that passed a `silence` future learns of the read timeout through it instead, with the
connection left open (the relay holds an upstream whose transfer may be in flight, I5).

What it accepts of a head is kvproxy.response.head's. The head (status line and field
lines, interim heads included) is bounded by `max_head_bytes`, counted as bytes are fed to
the parser (never more is fed before refusing), and `max_headers` fields per head; a
chunked body's trailer section is bounded the same way.

Must never: take bytes with no request outstanding, reuse itself after a response it could
not read to the end or that came before the request was all sent, hold more than
READ_HIGH_WATER unread body bytes, or parse more than the head bound before refusing.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Protocol

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from kvproxy.policy import Origin, record
from kvproxy.response import UpstreamProtocolError as UpstreamProtocolError
from kvproxy.response import check_interim, check_status, final_fields

# Unread body bytes of one response before its socket stops being read.
READ_HIGH_WATER = 1 << 20
# A request body above this goes out in pieces of this size, each once the socket drained.
WRITE_PIECE = 256 * 1024
_NO_BODY_STATUSES = frozenset({204, 304})


class UpstreamConnectError(ConnectionError):
    """No connection to the upstream could be opened; `dns` when its name did not resolve."""

    def __init__(self, message: str, *, dns: bool = False) -> None:
        super().__init__(message)
        self.dns = dns


class UpstreamConnectTimeout(TimeoutError):
    """No connection to the upstream was opened within the connect timeout: a timeout like
    any other to the client (504), but nothing of the request was sent, so a gateway may
    move it to another cluster and eject this one, as after a refused connect."""


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

    def __init__(self, conn: Connection) -> None:
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


@record
class ConnectionLimits:
    """What a connection may take from its upstream, and how long it waits (its pool's)."""

    read_timeout_s: float
    send_timeout_s: float
    max_head_bytes: int
    max_headers: int


class ConnectionOwner(Protocol):
    """The pool a connection belongs to, as the connection sees it (uvicorn's FlowControl is
    the shape: a small object the protocol talks to, not its owner's private methods)."""

    @property
    def limits(self) -> ConnectionLimits: ...

    def idle(self, conn: Connection) -> None:
        """The connection read a response to its end and may serve another: keep it."""

    def lost(self, conn: Connection) -> None:
        """The connection is closed or will never be reused: forget it."""


class Connection(asyncio.Protocol):
    """One connection and the response it is reading (at most one)."""

    def __init__(self, owner: ConnectionOwner, origin: Origin) -> None:
        self.owner = owner
        self.limits = owner.limits
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        # The loop this connection lives on, known once connected: asyncio.get_running_loop
        # is a getpid() system call per use on Python 3.11, and a request used it once here.
        self._loop: asyncio.AbstractEventLoop | None = None
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
        self._head_room = -1  # bytes the head may still take; -1 once the final one is read
        self._body_phase = False  # the final head was read
        self._max_headers = self.limits.max_headers
        # Reads of the body that carried no body byte (chunk size lines, extensions, the
        # trailer section), back to back: bounded like a head.
        self._got_data = False
        self._dataless = 0
        self._trailers = 0
        self._body_pending = False  # the request body is still being written (send_rest)
        # The caller's: resolved, instead of failing the response and aborting, when the read
        # timeout passes while it is pending (see `send`).
        self._silence: asyncio.Future[None] | None = None

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's quacks like one
        self._loop = asyncio.get_running_loop()

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
        self.owner.lost(self)

    def data_received(self, data: bytes) -> None:
        self.last_read = time.monotonic()
        if self.response is None:
            self._protocol_error("bytes arrived with no request outstanding")
            return
        try:
            room = self._head_room
            if room < 0:  # the body: the hot path, as _feed_body without a call
                self._got_data = False
                self.parser.feed_data(data)
                if not self._got_data:
                    self._count_dataless(len(data))
                elif self._dataless:
                    self._dataless = 0
            elif len(data) <= room:
                self._head_room = room - len(data)
                self.parser.feed_data(data)
            else:
                self._feed_past(data, room)
        except httptools.HttpParserUpgrade:
            self._protocol_error("the upstream switched protocols")
        except httptools.HttpParserError as exc:
            # A callback's own refusal travels as the parser error's context.
            cause = exc.__context__
            why = cause if isinstance(cause, UpstreamProtocolError) else exc
            self._protocol_error(f"unreadable response ({why})")
        except UpstreamProtocolError as exc:
            self._protocol_error(f"unreadable response ({exc})")

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost ends or fails the response

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_sender()

    # --- feeding the parser, bounded ----------------------------------------------------

    def _feed_past(self, data: bytes, room: int) -> None:
        # Only as much as the head may still take: a head past the bound is refused before
        # llhttp (or httptools, which joins a field's pieces in memory) holds more.
        if room:
            self.parser.feed_data(data[:room])
        if self._head_room >= 0:
            raise UpstreamProtocolError(f"response head over {self.limits.max_head_bytes} bytes")
        self._got_data = False
        self.parser.feed_data(data[room:])
        if not self._got_data:
            self._count_dataless(len(data) - room)

    def _count_dataless(self, size: int) -> None:
        # A trailer field's pieces are joined in memory too; an endless one, or an endless
        # chunk extension, is cut once past the head's bound (one read past it at most).
        self._dataless += size
        resp = self.response
        if self._dataless > self.limits.max_head_bytes and resp is not None and not resp._eof:
            raise UpstreamProtocolError(
                f"response trailers over {self.limits.max_head_bytes} bytes"
            )

    # --- llhttp callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        resp = self.response
        if resp is None or resp.status:
            # A second response to one request: the stream is out of step with requests.
            raise UpstreamProtocolError("a response arrived with no request outstanding")

    def on_status(self, status: bytes) -> None:
        self._reason += status  # may come in pieces

    def on_header(self, name: bytes, value: bytes | None) -> None:
        if self._body_phase:
            # A trailer field (after the last chunk): read and dropped, as aiohttp does;
            # only counted.
            self._trailers += 1
            if self._trailers > self._max_headers:
                raise UpstreamProtocolError(f"more than {self._max_headers} trailer fields")
            return
        headers = self._headers
        headers.append((name, value or b""))
        if len(headers) > self._max_headers:
            raise UpstreamProtocolError(f"more than {self._max_headers} header fields")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        reason = check_status(status, self._reason)
        if status < 200:
            # An interim response (100 Continue, 103 Early Hints): the real one follows.
            check_interim(status, self._headers)
            self._interim = True
            self._headers.clear()
            self._reason.clear()
            return
        headers, chunked, has_length = final_fields(self._headers)
        resp = self.response
        assert resp is not None
        self._headers = []
        self._head_room = -1
        self._body_phase = True
        self._dataless = 0
        self._trailers = 0
        resp.status = status
        resp.reason = reason
        resp.headers = CIMultiDictProxy(headers)
        resp.keep_alive = self.parser.should_keep_alive()
        no_body = self._no_body or status in _NO_BODY_STATUSES
        resp.close_delimited = not (no_body or chunked or has_length)
        if resp.close_delimited:
            self.reusable = False
        if self._body_pending:
            # Answered before the request body was all sent: the rest is not sent (the
            # upstream has decided), and what it did not read would be the next request's
            # first bytes, so the connection is not reused.
            self.reusable = False
            self._wake_sender()
        head = self.head
        if head is not None and not head.done():
            head.set_result(resp)
        if self._no_body:
            # A HEAD's Content-Length describes a body that never comes; llhttp would wait
            # for it, so the response ends here and the connection is not reused.
            self.reusable = False
            resp._end()

    def on_body(self, body: bytes) -> None:
        self._got_data = True
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

    def send(
        self,
        head: bytes,
        body: bytes,
        *,
        no_body: bool,
        silence: asyncio.Future[None] | None = None,
    ) -> None:
        """Write the head (and a small body) now; the response comes later.

        `silence`: when the read timeout passes while this future is pending, it is resolved
        and the connection is left open and unfailed (its timer stops: the caller bounds
        the wait from then on), so a caller that must not close an upstream whose KV
        transfer may be in flight can answer its client and hold the upstream (I5). Once
        the caller cancels it (a safe point), a timeout fails the response and aborts."""
        assert self.transport is not None
        assert self._loop is not None  # both set by connection_made
        assert self.response is None
        self._silence = silence
        self.response = UpstreamResponse(self)
        self.head = head_future = self._loop.create_future()
        head_future.add_done_callback(self._head_settled)
        self._no_body = no_body
        self._interim = False
        self._reason.clear()
        self._headers = []
        self._head_room = self.limits.max_head_bytes
        self._body_phase = False
        self.last_read = time.monotonic()
        self._arm_timer()
        if len(body) <= WRITE_PIECE:
            self.transport.writelines((head, body)) if body else self.transport.write(head)
        else:
            self.transport.write(head)
            self._body_pending = True

    async def send_rest(self, body: bytes) -> None:
        """Write a large body in pieces, waiting for the socket to drain between them (at
        most the send timeout each time), or else for the loop's next turn. Stops when the
        response head (or a failure) comes first: RFC 9112 §9.5 has a client stop sending a
        body the server answered without."""
        view = memoryview(body)
        head = self.head
        assert head is not None
        try:
            for start in range(0, len(body), WRITE_PIECE):
                if self.closed:
                    raise ConnectionResetError("the upstream closed the connection mid-request")
                if self._write_paused:
                    await self._wait_drained()
                elif start:
                    # A socket that takes every piece at once (loopback, a fast peer) would
                    # have them all written in one step of the loop: each write is a send()
                    # of the piece, so the loop is handed back between them.
                    await asyncio.sleep(0)
                if head.done():
                    self.reusable = False
                    return
                assert self.transport is not None
                self.transport.write(view[start : start + WRITE_PIECE])
        finally:
            self._body_pending = False

    async def _wait_drained(self) -> None:
        timeout = self.limits.send_timeout_s
        self._drained = drained = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                await drained
        except TimeoutError:
            raise TimeoutError(f"the upstream took no request bytes for {timeout:g} s") from None
        finally:
            self._drained = None

    def _wake_sender(self) -> None:
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    def done_with(self, resp: UpstreamResponse) -> None:
        self.response = None
        self.head = None
        self._silence = None
        # Request bytes the upstream never took (a write buffer left) would precede the next.
        unsent = self.transport is None or self.transport.get_write_buffer_size()
        if self.closed or not self.reusable or unsent:
            self.abort()
            return
        self.idle_since = time.monotonic()
        self.owner.idle(self)

    def abort(self) -> None:
        self._cancel_timer()
        if not self.closed and self.transport is not None:
            self.transport.abort()
        self.closed = True
        self.owner.lost(self)

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
        self._wake_sender()

    def _protocol_error(self, why: str) -> None:
        err = UpstreamProtocolError(why)
        if self.response is not None:
            self.response._fail(err)
        self._head_failed(err)
        self.abort()

    # --- the read timeout ---------------------------------------------------------------

    def _arm_timer(self) -> None:
        if self._timer is None:
            timeout = self.limits.read_timeout_s
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
        timeout = self.limits.read_timeout_s
        if self.response is None or self.response._eof:
            self._timer = asyncio.get_running_loop().call_later(timeout, self._on_timer)
            return
        quiet = time.monotonic() - self.last_read
        if self._reading_paused or quiet < timeout:
            # Data came meanwhile, or the relay is the slow side: look again later.
            wait = timeout if self._reading_paused else timeout - quiet
            self._timer = asyncio.get_running_loop().call_later(wait, self._on_timer)
            return
        silence = self._silence
        if silence is not None and not silence.done():
            silence.set_result(None)
            return
        err = TimeoutError(f"no bytes from the upstream for {timeout:g} s")
        self.response._fail(err)
        self._head_failed(err)
        self.abort()
