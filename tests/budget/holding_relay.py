"""A loopback TCP relay that can hold traffic and deliver it late, for tests that need a
network fault's interleaving without timing luck.

`block()` is a blackhole as a client sees one: connections are accepted and writes succeed,
but nothing reaches the server and no reply comes back, so every call waits for its own
timeout. What was sent meanwhile is kept, as the sender's kernel keeps an unacknowledged
segment. `unblock()` lets traffic through again; with `stale=True` the connections that
lived through the block keep their held bytes until `deliver_stale()` sends them to the
server: a request that timed out in the client and reaches the server after it moved on, as
a TCP retransmission after a blackhole does (even after the client closed the socket: its
kernel still delivers the data before the FIN).

Loopback only; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib


class _Pipe:
    def __init__(self, relay: HoldingRelay) -> None:
        self.relay = relay
        self.held = relay.blocked
        self.stale = False
        self.to_server = bytearray()  # held client -> server bytes
        self.to_client = bytearray()  # held server -> client bytes
        self.server_w: asyncio.StreamWriter | None = None
        self.client_w: asyncio.StreamWriter | None = None
        self.answered = asyncio.Event()  # the server sent something after a late delivery
        self.client_gone = False

    async def run(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.client_w = cw
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", self.relay.target_port)
        except OSError:
            cw.close()
            return
        self.server_w = sw
        up = asyncio.ensure_future(self._up(cr, sw))
        down = asyncio.ensure_future(self._down(sr, cw))
        await asyncio.gather(up, down, return_exceptions=True)
        for w in (cw, sw):
            w.close()

    async def _up(self, cr: asyncio.StreamReader, sw: asyncio.StreamWriter) -> None:
        while True:
            try:
                data = await cr.read(65536)
            except (ConnectionError, OSError):
                data = b""
            if not data:
                self.client_gone = True
                if not self.held:
                    sw.close()
                return  # a held pipe keeps its server side for a late delivery
            if self.held:
                self.to_server += data
            else:
                sw.write(data)

    async def _down(self, sr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        while True:
            try:
                data = await sr.read(65536)
            except (ConnectionError, OSError):
                data = b""
            if not data:
                if not self.held:
                    cw.close()
                return
            if self.stale:
                self.answered.set()  # the client is gone: the reply goes nowhere
            elif self.held:
                self.to_client += data
            elif not cw.is_closing():
                cw.write(data)

    def flush(self) -> None:
        self.held = False
        if self.server_w is not None and self.to_server:
            self.server_w.write(bytes(self.to_server))
        if self.client_w is not None and self.to_client and not self.client_w.is_closing():
            self.client_w.write(bytes(self.to_client))
        self.to_server.clear()
        self.to_client.clear()
        if self.client_gone and self.server_w is not None:
            self.server_w.close()


class HoldingRelay:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.blocked = False
        self.port = 0
        self._pipes: list[_Pipe] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[object]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        pipe = _Pipe(self)
        self._pipes.append(pipe)
        await pipe.run(cr, cw)

    def block(self) -> None:
        self.blocked = True
        for pipe in self._pipes:
            pipe.held = True

    def holds(self, marker: bytes) -> bool:
        """Some held request carries `marker` (it was sent into the blackhole)."""
        return any(marker in pipe.to_server for pipe in self._pipes)

    def unblock(self, stale: bool = False) -> None:
        """Traffic flows again. `stale`: the connections that lived through the block keep
        what they sent until `deliver_stale()`."""
        self.blocked = False
        for pipe in self._pipes:
            if not pipe.held:
                continue
            if stale:
                pipe.stale = True
            else:
                pipe.flush()

    async def deliver_stale(self, timeout_s: float = 10.0) -> int:
        """Send the held bytes of the stale connections to the server now and wait (bounded)
        for the server to answer each; returns how many carried anything."""
        delivered = []
        for pipe in self._pipes:
            if pipe.stale and pipe.to_server and pipe.server_w is not None:
                pipe.server_w.write(bytes(pipe.to_server))
                pipe.to_server.clear()
                delivered.append(pipe)
        for pipe in delivered:
            await asyncio.wait_for(pipe.answered.wait(), timeout_s)
        return len(delivered)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for pipe in self._pipes:
                for w in (pipe.client_w, pipe.server_w):
                    if w is not None:
                        w.close()
            live = {t for t in self._tasks if not t.done()}
            if live:
                await asyncio.wait(live, timeout=5)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)
