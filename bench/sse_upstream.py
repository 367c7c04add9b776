"""A fixed-response upstream that streams: each SSE event goes out in its own write.

Run: `python bench/sse_upstream.py --port P --chunks N`. A POST whose body contains
`"stream":true` gets N `chat.completion.chunk` events (chunked transfer encoding, one
`send()` per event, one loop turn apart), anything else gets the fixed chat reply.

With `--pace-ms T` (the streams-at-scale phase, bench/streams.py) a stream is a decode
instead: `max_tokens` events from the request's body (the last two the usage event and
`[DONE]`), one every T ms on a fixed schedule from the request's arrival (a late timer does
not push the next event later), like an engine emitting a token per decode step.

Why not nginx for this one: nginx's `return` writes a whole body at once, so a proxy would
read all N events in one buffer and the figure would not be "per chunk". A real engine emits
one event per token. Why a bare asyncio Protocol and not aiohttp: the upstream must cost as
little as possible so the proxies stay the bottleneck.

Must never: block the loop, or read more than one request ahead per connection.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import sys
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from payloads import CHAT_RESPONSE, sse_stream

_JSON_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(CHAT_RESPONSE)).encode()
    + b"\r\n\r\n"
)
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Upstream(asyncio.Protocol):
    events: ClassVar[list[bytes]] = []

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport is not a subclass of asyncio.Transport, only quacks like one.
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def _request(self) -> tuple[int, bytes] | None:
        """(bytes the first whole request in `buf` takes, its body), or None until it is
        all there (or the connection is gone)."""
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.transport is None:
            return None
        length = 0
        for line in bytes(self.buf[:end]).lower().split(b"\r\n")[1:]:
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        total = end + 4 + length
        if len(self.buf) < total:
            return None
        return total, bytes(self.buf[end + 4 : total])

    def _next(self) -> None:
        request = self._request()
        if request is None:
            return
        total, body = request
        del self.buf[:total]
        if b'"stream":true' in body.replace(b" ", b""):
            self.busy = True
            self.transport.write(_SSE_HEAD)
            asyncio.get_running_loop().call_soon(self._emit, 0)
        else:
            self.transport.write(_JSON_HEAD + CHAT_RESPONSE)
            self._next()

    def _emit(self, i: int) -> None:
        if self.transport is None:
            return
        if i < len(self.events):
            self.transport.write(_chunked(self.events[i]))
            asyncio.get_running_loop().call_soon(self._emit, i + 1)
            return
        self.transport.write(b"0\r\n\r\n")
        self.busy = False
        self._next()


_MAX_TOKENS = re.compile(rb'"max_tokens":\s*(\d+)')


# The paced streams' clock: events go out on whole milliseconds, never early.
TICK_S = 0.001


class Wheel:
    """Every paced stream's next event, by the tick it is due: one timer for the process,
    each tick sending what is due, instead of a `call_at` per event (uvloop makes and frees
    a libuv timer for each: at 40,000 events a second that was most of the upstream's
    CPU, and the upstream shares its core with the clients)."""

    def __init__(self) -> None:
        self.due: dict[int, list[PacedUpstream]] = {}
        self.done = 0  # the last tick sent
        self.loop: asyncio.AbstractEventLoop | None = None

    def add(self, at: float, stream: PacedUpstream) -> None:
        if self.loop is None:
            self.loop = loop = asyncio.get_running_loop()
            self.done = int(loop.time() / TICK_S) - 1
            loop.call_soon(self._tick)
        # A tick already sent (an event late by more than the pace) goes out at the next.
        k = max(math.ceil(at / TICK_S), self.done + 1)
        self.due.setdefault(k, []).append(stream)

    def _tick(self) -> None:
        loop = self.loop
        assert loop is not None
        now = int(loop.time() / TICK_S)
        for k in range(self.done + 1, now + 1):
            self.done = k
            for stream in self.due.pop(k, ()):
                stream._paced()
        if self.due:
            loop.call_at((now + 1) * TICK_S, self._tick)
        else:
            self.loop = None  # idle: the next stream starts the clock again


WHEEL = Wheel()


class PacedUpstream(Upstream):
    """Streams at a decode's pace: `max_tokens` events, one every `pace_s`.

    The schedule is absolute from the request's arrival (`t0 + (i + 1) * pace`), kept by
    the process's one `Wheel`: a `send()` per event, nothing per idle stream."""

    pace_s: ClassVar[float] = 0.05
    # Each event already framed as an HTTP chunk: the per-event work is one write.
    framed: ClassVar[list[bytes]] = []
    framed_last: ClassVar[bytes] = b""
    framed_done: ClassVar[bytes] = b""

    @classmethod
    def prepare(cls, pace_s: float, most: int) -> None:
        from payloads import sse_event

        cls.pace_s = pace_s
        cls.framed = [_chunked(sse_event(i)) for i in range(most)]
        cls.framed_last = _chunked(sse_event(most, last=True))
        cls.framed_done = _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.sent = 0
        self.t0 = 0.0

    def _next(self) -> None:
        request = self._request()
        if request is None:
            return
        total, body = request
        m = _MAX_TOKENS.search(body)
        if m is None or b'"stream":true' not in body.replace(b" ", b""):
            super()._next()
            return
        del self.buf[:total]
        # At least the usage event and [DONE]; the token events are capped by what was framed.
        self.total = max(2, min(int(m.group(1)), len(self.framed) + 2))
        self.sent = 0
        self.busy = True
        self.transport.write(_SSE_HEAD)
        self.t0 = asyncio.get_running_loop().time()
        WHEEL.add(self.t0 + self.pace_s, self)

    def _paced(self) -> None:
        if self.transport is None:
            return  # the client left: its stream ends here
        i = self.sent
        self.sent = i + 1
        if i < self.total - 2:
            self.transport.write(self.framed[i])
        elif i == self.total - 2:
            self.transport.write(self.framed_last)
        else:
            self.transport.write(self.framed_done)
            self.busy = False
            self._next()
            return
        WHEEL.add(self.t0 + (i + 2) * self.pace_s, self)


async def serve(port: int, pace_ms: float = 0.0) -> None:
    loop = asyncio.get_running_loop()
    factory = PacedUpstream if pace_ms > 0 else Upstream
    server = await loop.create_server(factory, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument(
        "--pace-ms", type=float, default=0.0, help="one event per this many ms (0: no pacing)"
    )
    parser.add_argument(
        "--max-events", type=int, default=4096, help="paced: the most token events a stream has"
    )
    args = parser.parse_args()
    Upstream.events = sse_stream(args.chunks)
    if args.pace_ms > 0:
        PacedUpstream.prepare(args.pace_ms / 1e3, args.max_events)
    import uvloop

    uvloop.run(serve(args.port, args.pace_ms))


if __name__ == "__main__":
    main()
