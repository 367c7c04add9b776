"""A scripted upstream on loopback that speaks raw bytes: each connection runs a script
(`replies(...)` answers each request with the next canned response), and `Seen` records
what arrived. Used where the bytes an upstream sends must be exactly the test's (framing
the proxy must refuse or cut), which an aiohttp app would not write."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

Script = Callable[["Seen", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Seen:
    """What the server saw: connections opened, and each request's head and body."""

    connections: int = 0
    heads: list[bytes] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)


async def read_request(seen: Seen, reader: asyncio.StreamReader) -> bool:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return False
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    seen.heads.append(head)
    seen.bodies.append(await reader.readexactly(length))
    return True


def replies(*responses: bytes, close: bool = False) -> Script:
    """Answer each request on a connection with the next response; close after if asked."""

    async def script(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        for resp in responses:
            if not await read_request(seen, r):
                return
            w.write(resp)
            await w.drain()
        if close:
            w.close()
            return
        await r.read()  # hold the connection until the client lets go

    return script


@asynccontextmanager
async def server(script: Script) -> AsyncIterator[tuple[str, Seen]]:
    seen = Seen()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        seen.connections += 1
        try:
            await script(seen, r, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        srv.close()
        await asyncio.wait_for(srv.wait_closed(), 5)
