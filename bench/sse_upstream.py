"""A fixed-response upstream that streams: each SSE event goes out in its own write.

Run: `python bench/sse_upstream.py --port P --chunks N`. A POST whose body contains
`"stream":true` gets N `chat.completion.chunk` events (chunked transfer encoding, one
`send()` per event, one loop turn apart), anything else gets the fixed chat reply.

Why not nginx for this one: nginx's `return` writes a whole body at once, so a proxy would
read all N events in one buffer and the figure would not be "per chunk". A real engine emits
one event per token. Why a bare asyncio Protocol and not aiohttp: the upstream must cost as
little as possible so the proxies stay the bottleneck.

Must never: block the loop, or read more than one request ahead per connection.
"""

from __future__ import annotations

import argparse
import asyncio
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

    def _next(self) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.transport is None:
            return
        head = bytes(self.buf[:end]).lower()
        length = 0
        for line in head.split(b"\r\n")[1:]:
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        total = end + 4 + length
        if len(self.buf) < total:
            return
        body = bytes(self.buf[end + 4 : total])
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


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Upstream, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=64)
    args = parser.parse_args()
    Upstream.events = sse_stream(args.chunks)
    import uvloop

    uvloop.run(serve(args.port))


if __name__ == "__main__":
    main()
