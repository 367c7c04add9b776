"""Test doubles for the relay's upstream client, after uvicorn's protocol tests
(tests/protocols/test_http.py there): a transport that records what the client writes and a
connection fed bytes by hand, so every framing case runs without a socket, in microseconds.

`Wire` is one connection of a real `UpstreamPool` (its limits and timeouts are the ones under
test) with a `MockTransport` under it: `send()` a request, `feed()` the upstream's bytes,
`fin()` / `reset()` its close, then read what the client made of them with `outcome()`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from multidict import CIMultiDict

from kvproxy.upstream import UpstreamPool, UpstreamResponse
from kvproxy.upstream.connection import Connection
from kvproxy.upstream.pool import _request_head

URL = "http://upstream.test"


class MockTransport(asyncio.Transport):
    """Records writes; `abort()` and `close()` report the loss to the protocol on the next
    loop turn, as asyncio's transports do. `buffered` plays the kernel: bytes written but
    not taken by the peer (what `get_write_buffer_size` reports); past `full_after` written
    bytes the transport tells the protocol to pause writing, as a full socket would."""

    def __init__(self, protocol: asyncio.Protocol) -> None:
        super().__init__()
        self.protocol = protocol
        self.written = bytearray()
        self.closing = False
        self.aborted = False
        self.reading_paused = False
        self.buffered = 0
        self.full_after: int | None = None
        self.extra: dict[str, Any] = {}

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closing, "a write after the transport was closed"
        self.written += data
        if self.full_after is not None and len(self.written) > self.full_after:
            self.full_after = None
            self.buffered = len(data)
            self.protocol.pause_writing()

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def abort(self) -> None:
        self.aborted = True
        self.close()

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        self.reading_paused = True

    def resume_reading(self) -> None:
        self.reading_paused = False

    def is_reading(self) -> bool:
        return not self.reading_paused

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.extra.get(name, default)


def make_pool(**kw: Any) -> UpstreamPool:
    opts: dict[str, Any] = {
        "limit": 8,
        "keepalive_s": 30.0,
        "connect_timeout_s": 5.0,
        "read_timeout_s": 30.0,
    }
    opts.update(kw)
    return UpstreamPool(**opts)


@dataclass
class Outcome:
    """What the client made of the upstream's bytes."""

    status: int = 0
    reason: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    complete: bool = False  # the body ended as framed (or at a close, when close-delimited)
    error: BaseException | None = None  # what the head or the body raised

    @property
    def failed(self) -> bool:
        return self.error is not None


class Wire:
    """One upstream connection on a MockTransport; see the module docstring."""

    def __init__(self, pool: UpstreamPool, *, idle: bool = False) -> None:
        self.pool = pool
        self.conn = Connection(pool, pool.origin(URL))
        self.transport = MockTransport(self.conn)
        self.conn.connection_made(self.transport)
        pool._open.add(self.conn)
        if idle:
            # In the pool's idle list: the pool's next request to URL takes it.
            self.conn.idle_since = time.monotonic()
            pool._idle.setdefault(self.conn.origin, []).append(self.conn)
        self.body = bytearray()
        self.error: BaseException | None = None
        self.reading = False  # send() was used: feed() reads the body as the relay would

    def send(
        self, method: str = "GET", target: str = "/", body: bytes = b"", **headers: str
    ) -> asyncio.Future[UpstreamResponse]:
        fields: CIMultiDict[str] = CIMultiDict(headers)
        origin = self.pool.origin(URL)
        head = _request_head(method, target, origin.host_header, fields, body)
        self.conn.send(head, body, no_body=method == "HEAD")
        self.reading = True
        assert self.conn.head is not None
        return self.conn.head

    def feed(self, *pieces: bytes) -> None:
        """The upstream's bytes, one data_received per piece (as reads would split them)."""
        for piece in pieces:
            if self.conn.closed:
                return
            self.conn.data_received(piece)
            self.drain()

    def fin(self) -> None:
        """The upstream closed its side (EOF, then the loss asyncio reports)."""
        if not self.conn.closed:
            self.conn.eof_received()
            self.conn.connection_lost(None)
        self.drain()

    def reset(self) -> None:
        if not self.conn.closed:
            self.conn.connection_lost(ConnectionResetError("reset by peer"))
        self.drain()

    def drain(self) -> None:
        """Read what the body holds now, as the relay would (read_nowait)."""
        head = self.conn.head
        resp = self.conn.response
        if not self.reading or resp is None or head is None or not head.done() or head.cancelled():
            return
        if head.exception() is not None:
            return
        try:
            while chunk := resp.read_nowait():
                self.body += chunk
        except Exception as exc:  # the failure the relay would see
            self.error = exc

    def outcome(self, head: asyncio.Future[UpstreamResponse]) -> Outcome:
        self.drain()
        if not head.done():
            return Outcome(error=AssertionError("no head"))
        if head.exception() is not None:
            return Outcome(error=head.exception())
        resp = head.result()
        raw = [
            (k.lower().encode("latin-1"), v.encode("utf-8", "surrogateescape"))
            for k, v in resp.headers.items()
        ]
        return Outcome(
            status=resp.status,
            reason=resp.reason.encode("latin-1"),
            headers=raw,
            body=bytes(self.body),
            complete=resp.at_eof() and self.error is None,
            error=self.error,
        )

    def release(self, head: asyncio.Future[UpstreamResponse]) -> bool:
        """Hand the response back as the relay does at its end; True when the connection
        went back to the pool to be reused."""
        idle = self.pool.idle_connections
        resp = head.result()
        if resp.at_eof():
            resp.release()
        else:
            resp.close()
        return self.pool.idle_connections > idle
