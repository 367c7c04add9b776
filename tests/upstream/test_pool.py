"""The relay's upstream client (kvproxy/upstream.py) against scripted loopback servers: what
needs a real socket — keep-alive reuse and the pool's limits, connect failures, timeouts,
large bodies both ways with flow control, an upload the upstream answers early and stops
reading — and what must never be sent. Framing is tested without sockets in
test_upstream_conn.py and against h11 in test_upstream_h11.py."""

from __future__ import annotations

import asyncio

import pytest
from multidict import CIMultiDict
from scripted_upstream import Seen, read_request, replies, server

from kvproxy.config import ConfigError, load_settings
from kvproxy.policy.origin import parse_origin
from kvproxy.upstream import UpstreamPool
from kvproxy.upstream.boundary import classify
from kvproxy.upstream.connection import READ_HIGH_WATER, UpstreamConnectError

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Up: 1\r\n\r\nok"


def pool(**kw: float) -> UpstreamPool:
    opts = {"limit": 8, "keepalive_s": 30.0, "connect_timeout_s": 5.0, "read_timeout_s": 30.0}
    opts.update(kw)
    return UpstreamPool(
        limit=int(opts["limit"]),
        keepalive_s=opts["keepalive_s"],
        connect_timeout_s=opts["connect_timeout_s"],
        read_timeout_s=opts["read_timeout_s"],
    )


async def read_all(resp: object) -> bytes:
    out = b""
    for _ in range(10_000):
        chunk = await resp.readany()  # type: ignore[attr-defined]
        if not chunk:
            return out
        out += chunk
    raise AssertionError("the body did not end")


def hdrs(**kv: str) -> CIMultiDict[str]:
    return CIMultiDict((k.replace("_", "-"), v) for k, v in kv.items())


async def test_keep_alive_reuses_one_connection_and_sends_a_plain_head() -> None:
    async with server(replies(OK, OK)) as (url, seen):
        p = pool()
        for _ in range(2):
            resp = await p.request(url, "POST", "/v1/chat?x=1", hdrs(X_Request_ID="r1"), b"{}")
            assert (resp.status, resp.reason, resp.headers["X-Up"]) == (200, "OK", "1")
            assert await read_all(resp) == b"ok"
            resp.release()
        assert seen.connections == 1
        assert p.idle_connections == 1
        host = url.removeprefix("http://").encode()
        assert seen.heads[0] == (
            b"POST /v1/chat?x=1 HTTP/1.1\r\nHost: " + host + b"\r\nX-Request-ID: r1\r\n"
            b"Content-Length: 2\r\n\r\n"
        )
        assert seen.bodies == [b"{}", b"{}"]
        await p.close()
        assert p.open_connections == 0


async def test_chunked_body_arrives_in_pieces_and_ends() -> None:
    async def script(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(seen, r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await w.drain()
        await asyncio.sleep(0.01)
        w.write(b"6\r\n world\r\n0\r\n\r\n")
        await w.drain()
        await r.read()

    async with server(script) as (url, _):
        p = pool()
        resp = await p.request(url, "GET", "/", hdrs(), b"")
        assert await read_all(resp) == b"hello world"
        assert resp.at_eof()
        resp.release()
        assert p.idle_connections == 1
        await p.close()


async def test_close_delimited_body_ends_at_the_close_and_is_not_reused() -> None:
    resp_bytes = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end"
    async with server(replies(resp_bytes, close=True)) as (url, _):
        p = pool()
        resp = await p.request(url, "GET", "/", hdrs(), b"")
        assert await read_all(resp) == b"until the end"
        resp.release()
        assert p.idle_connections == 0
        await p.close()


async def test_a_close_mid_body_or_before_the_head_is_a_reset() -> None:
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten.."
    async with server(replies(cut, close=True)) as (url, _):
        p = pool()
        resp = await p.request(url, "GET", "/", hdrs(), b"")
        with pytest.raises(ConnectionResetError) as info:
            await read_all(resp)
        assert classify(info.value) == "reset"
        resp.close()
        await p.close()
    async with server(replies(close=True)) as (url, _):
        p = pool()
        with pytest.raises(ConnectionResetError):
            await p.request(url, "GET", "/", hdrs(), b"")
        await p.close()


async def test_silence_past_the_read_timeout_fails_the_read() -> None:
    stuck = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"
    async with server(replies(stuck)) as (url, _):
        p = pool(read_timeout_s=0.2)
        resp = await p.request(url, "GET", "/", hdrs(), b"")
        assert resp.read_nowait() in (b"", b"abc")
        with pytest.raises(TimeoutError) as info:
            await asyncio.wait_for(read_all(resp), 10)
        assert classify(info.value) == "timeout"
        await p.close()
    async with server(replies()) as (url, _):  # reads the request, never answers
        p = pool(read_timeout_s=0.2)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(p.request(url, "GET", "/", hdrs(), b""), 10)
        await p.close()


async def test_refused_connections_are_connect_failures() -> None:
    async with server(replies()) as (url, _):
        pass  # closed: nothing listens on the port any more
    p = pool()
    with pytest.raises(UpstreamConnectError) as info:
        await p.request(url, "GET", "/", hdrs(), b"")
    assert classify(info.value) == "connect"
    assert classify(UpstreamConnectError("no such name", dns=True)) == "dns"
    assert p.open_connections == 0
    await p.close()


async def test_the_limit_makes_callers_wait_for_a_free_connection() -> None:
    async with server(replies(OK, OK, OK)) as (url, seen):
        p = pool(limit=1)
        first = await p.request(url, "GET", "/", hdrs(), b"")
        second = asyncio.ensure_future(p.request(url, "GET", "/", hdrs(), b""))
        await asyncio.sleep(0.05)
        assert not second.done()  # waits: the one connection is busy
        assert await read_all(first) == b"ok"
        first.release()
        resp = await asyncio.wait_for(second, 5)
        assert await read_all(resp) == b"ok"
        resp.release()
        assert seen.connections == 1
        await p.close()


async def test_an_idle_connection_is_not_reused_past_keepalive() -> None:
    async with server(replies(OK, OK)) as (url, seen):
        p = pool(keepalive_s=0.05)
        resp = await p.request(url, "GET", "/", hdrs(), b"")
        await read_all(resp)
        resp.release()
        await asyncio.sleep(0.2)  # the sweep closes it
        assert p.idle_connections == 0
        resp = await p.request(url, "GET", "/", hdrs(), b"")
        await read_all(resp)
        resp.release()
        assert seen.connections == 2
        await p.close()


async def test_large_bodies_both_ways_and_reading_pauses_for_a_slow_reader() -> None:
    big = bytes(range(256)) * (3 * 4096)  # 3 MiB up
    down = b"z" * (4 * READ_HIGH_WATER)

    async def script(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(seen, r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(down) + down)
        await w.drain()
        await r.read()

    async with server(script) as (url, seen):
        p = pool()
        resp = await p.request(url, "POST", "/", hdrs(), big)
        await asyncio.sleep(0.2)  # the server wrote it all; the client must not hold it all
        held = resp._size  # private, but the bound is the point
        assert held <= READ_HIGH_WATER + 256 * 1024
        assert await read_all(resp) == down
        resp.release()
        assert seen.bodies == [big]
        await p.close()


async def test_an_early_answer_reaches_the_caller_while_the_upstream_stops_reading() -> None:
    """#31.4 on a real socket: a 12 MiB POST, the upstream reads the head, answers 413
    (keep-alive) and then neither reads nor closes. The 413 comes back, the rest of the body
    is not sent, and the connection is not reused."""
    release = asyncio.Event()

    async def script(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        seen.heads.append(await r.readuntil(b"\r\n\r\n"))
        w.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 7\r\n\r\ntoo big")
        await w.drain()
        await asyncio.wait_for(release.wait(), 30)

    async with server(script) as (url, seen):
        p = pool(read_timeout_s=3.0)
        try:
            resp = await asyncio.wait_for(
                p.request(url, "POST", "/", hdrs(), b"b" * (12 * 1024 * 1024)), 20
            )
            assert resp.status == 413
            assert await read_all(resp) == b"too big"
            resp.release()
            assert p.idle_connections == 0
        finally:
            release.set()
            await p.close()
    assert seen.connections == 1


async def test_a_path_prefix_of_the_upstream_url_is_kept() -> None:
    async with server(replies(OK)) as (url, seen):
        p = pool()
        resp = await p.request(url + "/router", "GET", "/v1/models", hdrs(), b"")
        await read_all(resp)
        resp.release()
        assert seen.heads[0].startswith(b"GET /router/v1/models HTTP/1.1\r\n")
        await p.close()


@pytest.mark.parametrize("value", ["a\r\nX-Smuggled: 1", "a\nb", "a\x00"])
async def test_line_breaks_never_reach_the_upstream(value: str) -> None:
    async with server(replies(OK)) as (url, seen):
        p = pool()
        with pytest.raises(ValueError, match="CR, LF or NUL"):
            await p.request(url, "GET", "/", hdrs(X_Note=value), b"")
        assert seen.connections == 0
        await p.close()


def test_origins() -> None:
    assert parse_origin("http://router:8000").host_header == b"router:8000"
    https = parse_origin("https://router.svc/")
    assert (https.port, https.tls, https.host_header, https.prefix) == (
        443,
        True,
        b"router.svc",
        "",
    )
    v6 = parse_origin("http://[::1]:9000/base/")
    assert (v6.host, v6.host_header, v6.prefix) == ("::1", b"[::1]:9000", "/base")
    for bad in ("ftp://x", "http://", "http://h/?q=1", "http://u:p@h"):
        with pytest.raises(ValueError, match="upstream"):
            parse_origin(bad)
    with pytest.raises(ConfigError, match="upstream"):
        load_settings(overrides={"upstream": "http://router:8000/?debug=1"})
