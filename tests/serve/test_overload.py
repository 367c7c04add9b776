"""Overload shedding (kvproxy.serve.overload): past the connection limit or the body-memory
budget a request gets 503 `overloaded` before its body is read, nothing of it goes upstream,
and service comes back once the burst is over. Judged on what the upstream received and on
the gates' own counters, never on time."""

from __future__ import annotations

import asyncio
import contextlib
import resource

import aiohttp
import orjson
import pytest
from aiohttp import web
from kvtest import FakeUpstream, running_proxy, wait_until

from kvproxy.serve.overload import (
    FD_RESERVE,
    BodyMemoryGate,
    BodyReservation,
    ConnectionGate,
    derived_connection_limit,
)

CHAT = "/v1/chat/completions"


def chat(content: str = "hi", stream: bool = False) -> bytes:
    return orjson.dumps(
        {"model": "m", "stream": stream, "messages": [{"role": "user", "content": content}]}
    )


def answer() -> web.Response:
    return web.json_response({"id": "c", "choices": [{"message": {"content": "ok"}}]})


# --- the gates, sans-IO ---------------------------------------------------------------------


def test_connection_gate_serves_sheds_then_drops() -> None:
    gate = ConnectionGate(2, reserve=4)
    assert [gate.opened() for _ in range(5)] == ["serve", "serve", "shed", "shed", "drop"]
    assert gate.shed_total == 3
    for _ in range(4):
        gate.closed()
    assert gate.opened() == "serve"


def test_derived_limit_pairs_each_connection_with_an_upstream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    assert derived_connection_limit() == (1024 - FD_RESERVE) // 2
    monkeypatch.setattr(resource, "getrlimit", lambda _: (40, 4096))
    assert derived_connection_limit() == 1  # never 0: the process must still serve


async def test_body_gate_queues_in_arrival_order_and_times_out() -> None:
    gate = BodyMemoryGate(100)
    assert await gate.take(60, 0)
    big = asyncio.ensure_future(gate.take(80, 10))
    await wait_until(lambda: gate.waiting == 1)
    # A small body that would fit waits behind the large one (no starvation).
    small = asyncio.ensure_future(gate.take(10, 10))
    await wait_until(lambda: gate.waiting == 2)
    assert not gate.try_take(10)
    gate.give(60)
    assert await big
    assert await small
    assert gate.in_use == 90
    assert not await gate.take(20, 0.01)  # no room within the wait: refused
    assert gate.waiting == 0
    assert gate.in_use == 90
    gate.give(90)
    assert gate.in_use == 0


async def test_a_waiter_that_gives_up_lets_the_next_one_in() -> None:
    gate = BodyMemoryGate(100)
    assert await gate.take(50, 0)
    first = asyncio.ensure_future(gate.take(100, 0.05))  # cannot fit before it gives up
    await wait_until(lambda: gate.waiting == 1)
    second = asyncio.ensure_future(gate.take(40, 10))
    assert not await first
    assert await second
    assert gate.in_use == 90


def test_reservation_shrinks_and_releases_once() -> None:
    gate = BodyMemoryGate(100)
    assert gate.try_take(100)
    r = BodyReservation(gate, 100)
    r.shrink_to(30)
    assert gate.in_use == 30
    r.release()
    r.release()
    assert gate.in_use == 0


# --- through the proxy ------------------------------------------------------------------------


async def _held_post(url: str, path: str, body: bytes, send: int) -> asyncio.StreamWriter:
    """A client that sends the head and `send` bytes of `body`, then waits."""
    host, port = url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    writer.write(head + body[:send])
    await writer.drain()
    return writer


async def test_connections_past_the_limit_get_503_overloaded_and_service_recovers(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return answer()

    upstream.route("POST", CHAT, slow)
    await upstream.start()
    async with running_proxy(upstream.url, max_connections=2) as proxy:
        url = proxy.public_url + CHAT
        held = [asyncio.ensure_future(http.post(url, data=chat("a"))) for _ in range(2)]
        assert await wait_until(lambda: len(upstream.received) == 2)
        assert proxy.services.connections.open == 2
        # A fresh session: its own (third) connection.
        async with (
            aiohttp.ClientSession() as other,
            other.post(url, data=chat("b")) as resp,
        ):
            assert resp.status == 503
            assert resp.headers["Connection"].lower() == "close"
            assert resp.headers["Retry-After"] == "1"
            err = (await resp.json())["error"]
            assert err["code"] == "overloaded"
            assert "connections" in err["message"]
        assert len(upstream.received) == 2  # nothing of the shed request went upstream
        release.set()
        for fut in held:
            resp = await fut
            assert resp.status == 200
            resp.release()
        await http.close()
        assert await wait_until(lambda: proxy.services.connections.open == 0)
        async with aiohttp.ClientSession() as again, again.post(url, data=chat("c")) as resp:
            assert resp.status == 200
        shed = proxy.metrics.overload_shed.labels("connections", "reply")._value.get()
        assert shed == 1


@pytest.mark.parametrize("wait_s", [0.2, 30.0])
async def test_bodies_past_the_memory_budget_queue_then_get_503_overloaded(
    upstream: FakeUpstream, wait_s: float
) -> None:
    """A body that finds no room waits (first come first served) up to body_memory_wait_s:
    refused unread when the room does not come (0.2 s), served once it does (30 s)."""
    upstream.route("POST", CHAT, _answer_after_read)
    await upstream.start()
    body = chat("x" * 60_000)
    async with running_proxy(
        upstream.url,
        max_body_bytes=len(body),
        max_body_memory_bytes=len(body) + 1000,
        body_memory_wait_s=wait_s,
    ) as proxy:
        gate = proxy.services.body_memory
        slow = await _held_post(proxy.public_url, CHAT, body, send=100)
        try:
            assert await wait_until(lambda: gate.in_use == len(body))
            async with aiohttp.ClientSession() as http:
                second = asyncio.ensure_future(http.post(proxy.public_url + CHAT, data=body))
                try:
                    if wait_s < 1:
                        resp = await second
                        assert resp.status == 503
                        assert (await resp.json())["error"]["code"] == "overloaded"
                        assert upstream.received == []  # refused unread, nothing sent
                    else:
                        assert await wait_until(lambda: gate.waiting == 1)
                        assert upstream.received == []
                        slow.write(body[100:])  # the first body completes: room again
                        await slow.drain()
                        resp = await second
                        assert resp.status == 200
                    resp.release()
                finally:
                    second.cancel()
            if wait_s < 1:
                slow.write(body[100:])
                await slow.drain()
            reader_done = await wait_until(lambda: len(upstream.received) >= 1)
            assert reader_done
        finally:
            slow.close()
        assert await wait_until(lambda: gate.in_use == 0)
        shed = proxy.metrics.overload_shed.labels("body_memory", "reply")._value.get()
        assert shed == (1 if wait_s < 1 else 0)
        assert len(upstream.received) == (1 if wait_s < 1 else 2)


async def _answer_after_read(request: web.Request) -> web.Response:
    await request.read()
    return answer()


# --- per-request header timeout, idle keep-alive, idle sockets under the connection limit -----


async def _raw(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


async def _one_response(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await asyncio.wait_for(reader.readexactly(length), 10)
    return head


async def _closed(reader: asyncio.StreamReader, within_s: float = 10.0) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), within_s) == b""
    except ConnectionResetError:
        return True


async def test_a_kept_alive_connections_second_head_trickled_past_the_header_timeout_is_closed(
    upstream: FakeUpstream,
) -> None:
    """The header timeout held for a connection's first request only: the second head on a
    kept-alive connection could trickle forever. Now each head gets the timeout from its
    first byte: the trickle is cut long before its end."""
    upstream.route("GET", "/health", lambda r: _ok())
    await upstream.start()
    async with running_proxy(upstream.url, header_read_timeout_s=0.5) as proxy:
        reader, writer = await _raw(proxy.public_url)
        writer.write(HEALTH)
        assert b" 200 " in await _one_response(reader)
        trickle = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
        sent = 0
        closed = asyncio.ensure_future(_closed(reader, 30))
        for byte in trickle:  # ~20 s at 0.1 s a byte if nothing cuts it
            if closed.done():
                break
            with contextlib.suppress(ConnectionError):
                writer.write(bytes([byte]))
                await writer.drain()
            sent += 1
            await asyncio.sleep(0.1)
        assert await closed
        writer.close()
    assert sent < len(trickle)


async def test_an_idle_kept_alive_connection_is_closed_after_the_keepalive_timeout(
    upstream: FakeUpstream,
) -> None:
    upstream.route("GET", "/health", lambda r: _ok())
    await upstream.start()
    async with running_proxy(upstream.url, keepalive_timeout_s=0.3) as proxy:
        reader, writer = await _raw(proxy.public_url)
        writer.write(HEALTH)
        assert b" 200 " in await _one_response(reader)
        assert await _closed(reader, 10)
        writer.close()
        assert await wait_until(lambda: proxy.services.connections.open == 0)


async def test_the_connection_limit_closes_the_longest_idle_socket_for_a_real_request(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """Twelve idle sockets at a limit of 12 turned a real request into 503. As nginx does
    under pressure, the longest idle kept-alive (or never used) socket is closed instead."""
    upstream.route("GET", "/health", lambda r: _ok())
    await upstream.start()
    async with running_proxy(upstream.url, max_connections=3) as proxy:
        idle = []
        for i in range(3):
            reader, writer = await _raw(proxy.public_url)
            if i > 0:  # kept alive after a request
                writer.write(HEALTH)
                await _one_response(reader)
            idle.append((reader, writer))
        assert await wait_until(lambda: proxy.services.connections.open == 3)
        async with (
            aiohttp.ClientSession() as other,
            other.get(proxy.public_url + "/health") as resp,
        ):
            status = resp.status
        oldest_closed = await _closed(idle[0][0])
        reclaimed = proxy.metrics.overload_shed.labels("connections", "close_idle")._value.get()
        for _, writer in idle:
            writer.close()
    assert status == 200
    assert oldest_closed
    assert reclaimed == 1


async def _ok() -> web.Response:
    return web.json_response({"ok": True})
