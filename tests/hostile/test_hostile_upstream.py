"""A hostile upstream, byte by byte, through the whole proxy, read by a raw-socket client
that parses what it gets with h11 (so no client library fills a gap for it).

- An upstream response that cannot be completed (cut length, cut chunks, a stall past the
  read timeout, the last CRLF missing, a reset) reaches the client as an incomplete message
  on a connection the proxy closes: never padded to its length, never well framed.
  An event stream keeps its documented ending: an error event, then a proper end.
- An interim response's body, a head past the bound and bad transfer codings are a 502
  JSON error, and nothing of them reaches the client.
- An upload the upstream answers early and then stops reading gets the early answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import h11
import orjson
import pytest
from kvtest import running_proxy, static_engines, wait_until
from scripted_upstream import Seen, read_request, server

CHAT = "/v1/chat/completions"
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
TEN = b"0123456789"


@dataclass
class Seen_by_client:
    """What the raw client read: the bytes, whether h11 found one whole response in them,
    and how the connection ended."""

    raw: bytes
    status: int
    body: bytes
    complete: bool
    ended: str  # "eof", "reset" or "open" (still open when the client stopped waiting)


async def ask(
    port: int,
    *,
    body: bytes = BODY,
    started: asyncio.Event | None = None,
    wait_s: float = 15.0,
) -> Seen_by_client:
    """POST `body` on a keep-alive connection and read until the proxy closes it or one
    whole response came (then wait a moment more for a close that should not come).
    `started` is set once the head and a first body byte arrived."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: kvproxy\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (CHAT.encode(), len(body)) + body
    )
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target=CHAT, headers=[("Host", "kvproxy")]))
    raw = b""
    status = 0
    got = b""
    complete = False
    ended = "open"
    try:
        async with asyncio.timeout(wait_s):
            while True:
                try:
                    chunk = await reader.read(65536)
                except ConnectionResetError:
                    ended = "reset"
                    break
                if not chunk:
                    ended = "eof"
                    break
                raw += chunk
                conn.receive_data(chunk)
                while (event := conn.next_event()) is not h11.NEED_DATA:
                    if isinstance(event, h11.Response):
                        status = event.status_code
                    elif isinstance(event, h11.Data):
                        got += event.data
                        if started is not None:
                            started.set()
                    elif isinstance(event, h11.EndOfMessage):
                        complete = True
                        break
                if complete:
                    break
    except TimeoutError:
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return Seen_by_client(raw, status, got, complete, ended)


# --- honest truncation (#31.2) --------------------------------------------------------------

Cut = Callable[[asyncio.StreamWriter], Awaitable[None]]


async def fin(w: asyncio.StreamWriter) -> None:
    w.close()


async def rst(w: asyncio.StreamWriter) -> None:
    sock = w.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    w.transport.abort()


async def stall(w: asyncio.StreamWriter) -> None:
    await asyncio.sleep(20)  # past the proxy's read timeout (0.5 s here); bounded


async def last_crlf_missing(w: asyncio.StreamWriter) -> None:
    w.write(b"0\r\n")
    await w.drain()
    w.close()


LENGTH_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
)
# The upstream's first bytes, its body bytes among them, and how it then fails.
CUTS: dict[str, tuple[bytes, bytes, Cut]] = {
    "length cut short": (LENGTH_HEAD + TEN, TEN, fin),
    "length then reset": (LENGTH_HEAD + TEN, TEN, rst),
    "length then stall": (LENGTH_HEAD + TEN, TEN, stall),
    "chunks cut short": (CHUNKED_HEAD + b"a\r\n" + TEN + b"\r\n14\r\n" + TEN, TEN * 2, fin),
    "chunks then stall": (CHUNKED_HEAD + b"a\r\n" + TEN + b"\r\n", TEN, stall),
    "last CRLF missing": (CHUNKED_HEAD + b"a\r\n" + TEN + b"\r\n", TEN, last_crlf_missing),
}


@pytest.mark.parametrize("name", list(CUTS))
async def test_a_response_that_cannot_be_completed_ends_with_the_connection(name: str) -> None:
    first, sent, cut = CUTS[name]
    go = asyncio.Event()

    async def script(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(seen, r)
        w.write(first)
        await w.drain()
        # Cut only once the client has the head and the first bytes: the relay has started
        # the client's response, and must now end it without completing it.
        await asyncio.wait_for(go.wait(), 15)
        await cut(w)

    async with server(script) as (url, _):
        async with running_proxy(url, upstream_read_timeout_s=0.5) as proxy:
            got = await ask(proxy.public_port, started=go)
            assert await wait_until(lambda: proxy.state.inflight == 0)
            outcome = proxy.metrics.upstream_errors
            counted = sum(
                outcome.labels(code)._value.get()
                for code in ("upstream_reset", "upstream_timeout", "upstream_bad_response")
            )
    assert got.status == 200
    assert not got.complete, got  # h11 never read a whole response
    assert got.ended == "reset", got  # and the proxy reset the connection (SO_LINGER 0)
    assert got.body == sent[: len(got.body)]  # what came is the upstream's, unpadded
    assert b"error" not in got.raw
    assert counted == 1


async def test_an_event_stream_cut_short_ends_with_its_error_event() -> None:
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    event = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    go = asyncio.Event()

    async def script(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(seen, r)
        w.write(head + b"%x\r\n" % len(event) + event + b"\r\n")
        await w.drain()
        await asyncio.wait_for(go.wait(), 15)
        w.close()

    async with server(script) as (url, _):
        async with running_proxy(url) as proxy:
            got = await ask(proxy.public_port, started=go, wait_s=5)
            assert await wait_until(lambda: proxy.state.inflight == 0)
    assert (got.status, got.complete) == (200, True)  # framed whole: the stream says why
    *_, error, done = got.body.rstrip(b"\n").split(b"\n\n")
    assert orjson.loads(error.removeprefix(b"data: "))["error"]["code"] == "upstream_reset"
    assert done == b"data: [DONE]"
    assert got.ended == "open"  # a stream that ended honestly keeps its connection


# --- refused upstream bytes -----------------------------------------------------------------

REFUSED = {
    # #31.1: the interim response's body came first, and would have been relayed.
    "a 199 with a body": b"HTTP/1.1 199 Odd\r\nContent-Length: 24\r\n\r\nthe interim body, 24 byt"
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    # #31.3: a head past the bound (60 KiB): 10,000 header lines, a 1 MiB reason.
    "10,000 header lines": b"HTTP/1.1 200 OK\r\n"
    + b"X-Header-Line: 1234567890123456789012345678901234567890123456789012345678901234567890\r\n"
    * 10_000
    + b"Content-Length: 2\r\n\r\nok",
    "a 1 MiB reason": b"HTTP/1.1 200 " + b"r" * (1 << 20) + b"\r\nContent-Length: 2\r\n\r\nok",
    "gzip then chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
    b"2\r\nok\r\n0\r\n\r\n",
    "status 099": b"HTTP/1.1 099 OK\r\nContent-Length: 2\r\n\r\nok",
}


@pytest.mark.parametrize("name", list(REFUSED))
async def test_unrelayable_upstream_bytes_are_a_502_and_nothing_of_them_is_relayed(
    name: str,
) -> None:
    async def script(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(seen, r)
        w.write(REFUSED[name])
        with contextlib.suppress(ConnectionError):
            await w.drain()
        await r.read()

    async with server(script) as (url, seen):
        async with running_proxy(url) as proxy:
            got = await ask(proxy.public_port)
            assert await wait_until(lambda: proxy.state.inflight == 0)
            assert await wait_until(lambda: proxy.services.upstream.open_connections == 0)
    assert (got.status, got.complete) == (502, True), got
    assert orjson.loads(got.body)["error"]["code"] == "upstream_bad_response"
    assert b"interim" not in got.raw
    assert b"ok" not in got.body
    assert seen.connections == 1


# --- an early answer to an upload (#31.4) ---------------------------------------------------


async def test_an_early_413_reaches_the_client_while_the_upstream_stops_reading() -> None:
    release = asyncio.Event()

    async def script(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        seen.heads.append(await r.readuntil(b"\r\n\r\n"))
        w.write(
            b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\n"
            b"Content-Length: 17\r\n\r\n" + b'{"error":"large"}'
        )
        await w.drain()
        await asyncio.wait_for(release.wait(), 30)  # neither reads nor closes

    content = b"a" * (12 * 1024 * 1024)
    big = b'{"model":"m","messages":[{"role":"user","content":"' + content + b'"}]}'
    async with server(script) as (url, _):
        try:
            async with running_proxy(
                url, upstream_read_timeout_s=3, engines=static_engines(20_000_000)
            ) as proxy:
                got = await ask(proxy.public_port, body=big, wait_s=20)
                assert await wait_until(lambda: proxy.state.inflight == 0)
                assert proxy.services.upstream.idle_connections == 0
        finally:
            release.set()
    assert (got.status, got.complete, got.body) == (413, True, b'{"error":"large"}'), got
