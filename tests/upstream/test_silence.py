"""The read timeout with a `silence` future (kvproxy/upstream/connection.py): the relay's way
to learn that an upstream went quiet without the connection being closed under it (I5: a
silent router may still be mid-transfer). Without the future, or once it is cancelled (a
safe point), the timeout fails the read and aborts as before."""

from __future__ import annotations

import asyncio

import pytest
from scripted_upstream import replies, server
from test_pool import hdrs, pool, read_all

LATE = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nlate"


async def test_silence_resolves_the_future_and_keeps_the_connection() -> None:
    async with server(replies()) as (url, _):  # reads the request, never answers
        p = pool(read_timeout_s=0.2)
        loop = asyncio.get_running_loop()
        silence: asyncio.Future[None] = loop.create_future()
        head = p.start(url, "POST", "/", hdrs(), b"{}", silence=silence)
        await asyncio.wait_for(asyncio.shield(silence), 10)
        assert not head.done()  # not failed: the caller decides
        assert p.open_connections == 1  # and not aborted
        head.cancel()  # the caller's close (an upstream cancellation)
        with pytest.raises(asyncio.CancelledError):
            await head
        await asyncio.sleep(0)
        assert p.open_connections == 0
        await p.close()


async def test_a_cancelled_silence_future_restores_the_timeout() -> None:
    stuck = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"
    async with server(replies(stuck)) as (url, _):
        p = pool(read_timeout_s=0.2)
        silence: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        resp = await p.start(url, "GET", "/", hdrs(), b"", silence=silence)
        silence.cancel()  # a safe point was reached
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(read_all(resp), 10)
        assert p.open_connections == 0
        await p.close()


async def test_a_held_connection_still_reads_what_comes_late() -> None:
    gate = asyncio.Event()
    served = asyncio.Event()

    async def late(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await gate.wait()
            writer.write(LATE)
            await writer.drain()
            await reader.read()  # until the client closes
        finally:
            writer.close()
            served.set()

    srv = await asyncio.start_server(late, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    try:
        p = pool(read_timeout_s=0.2)
        silence: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        head = p.start(url, "GET", "/", hdrs(), b"", silence=silence)
        await asyncio.wait_for(asyncio.shield(silence), 10)
        gate.set()
        resp = await asyncio.wait_for(head, 10)
        assert await read_all(resp) == b"late"
        resp.release()
        await p.close()
        # The handler closes its side once the pool's close reaches it: waited for, or its
        # socket outlives the test and warns in whichever test the collector runs next.
        await asyncio.wait_for(served.wait(), 10)
    finally:
        gate.set()
        srv.close()
        await srv.wait_closed()
