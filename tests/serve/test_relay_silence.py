"""An upstream that goes silent past the read timeout before a safe point (a router behind a
blackhole, found by the fault suite): the client gets its 504 / error event at the timeout,
and the upstream connection is NOT closed until a safe point (a token, the end, an error or
the drain deadline), counted as a deferred cancellation by its outcome (I5).

Ground truth is the upstream's own socket: did it see kvproxy close before it wrote?"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from kvtest import running_proxy, wait_until

from kvproxy.serve import KvproxyServer

CHAT = "/v1/chat/completions"
TOKEN = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'


@dataclass
class SilentRouter:
    """Reads one request, says nothing until `release`, then answers; records whether
    kvproxy closed the connection before the answer was written."""

    stream: bool
    head_first: bool = False  # send the response head at once, then go silent
    release: asyncio.Event = field(default_factory=asyncio.Event)
    closed_before_answer: bool | None = None
    closed_after_answer: asyncio.Event = field(default_factory=asyncio.Event)
    requests: int = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.requests += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        if self.head_first:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
        eof = asyncio.ensure_future(reader.read(1))
        released = asyncio.ensure_future(self.release.wait())
        await asyncio.wait({eof, released}, return_when=asyncio.FIRST_COMPLETED)
        self.closed_before_answer = eof.done()
        released.cancel()
        if not self.closed_before_answer:
            if self.stream:
                if not self.head_first:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n"
                    )
                writer.write(b"%x\r\n%s\r\n" % (len(TOKEN), TOKEN))
            else:
                body = orjson.dumps({"id": "c", "choices": [{"message": {"content": "hi"}}]})
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
                await asyncio.wait_for(eof, 30)  # kvproxy closes (or pools) it now
        self.closed_after_answer.set()
        writer.close()


@contextlib.asynccontextmanager
async def silent_router(router: SilentRouter) -> AsyncIterator[str]:
    server = await asyncio.start_server(router.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        router.release.set()
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def proxied(
    router: SilentRouter, **settings: Any
) -> AsyncIterator[tuple[KvproxyServer, aiohttp.ClientSession]]:
    """kvproxy (with `settings`) in front of `router`, and a client session."""
    async with (
        silent_router(router) as url,
        running_proxy(url, **settings) as proxy,
        aiohttp.ClientSession() as http,
    ):
        yield proxy, http


def chat(stream: bool) -> bytes:
    return orjson.dumps(
        {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    )


def in_progress(proxy: object) -> float:
    got = proxy.metrics.registry.get_sample_value(  # type: ignore[attr-defined]
        "kvproxy_deferred_cancellations_in_progress", {"upstream": "default"}
    )
    return float(got or 0.0)


def deferred(proxy: object, outcome: str) -> float:
    got = proxy.metrics.registry.get_sample_value(  # type: ignore[attr-defined]
        "kvproxy_deferred_cancellations_total", {"outcome": outcome, "upstream": "default"}
    )
    return float(got or 0.0)


@pytest.mark.parametrize(
    ("stream", "head_first", "outcome"),
    [(True, False, "first_token"), (True, True, "first_token"), (False, False, "completed")],
)
async def test_silent_upstream_is_answered_504_and_held_until_a_safe_point(
    stream: bool, head_first: bool, outcome: str
) -> None:
    router = SilentRouter(stream=stream, head_first=head_first)
    async with proxied(
        router, upstream_read_timeout_s=0.3, drain_timeout_s=60, upstream_keepalive_s=0.5
    ) as (proxy, http):
        async with http.post(proxy.public_url + CHAT, data=chat(stream)) as resp:
            data = await resp.read()
            # Nothing was relayed yet (a head alone is not forwarded): a 504, and the
            # connection is not kept alive behind the held upstream.
            assert resp.status == 504
            assert orjson.loads(data)["error"]["code"] == "upstream_timeout"
            assert resp.headers["Connection"].lower() == "close"
        # The client has its answer; the upstream is held (not closed) as a deferral.
        assert await wait_until(lambda: in_progress(proxy) == 1)
        assert router.closed_before_answer is None  # still waiting: kvproxy did not close
        router.release.set()
        assert await wait_until(lambda: deferred(proxy, outcome) == 1)
        await asyncio.wait_for(router.closed_after_answer.wait(), 30)
        assert router.closed_before_answer is False
        assert in_progress(proxy) == 0
        assert router.requests == 1  # never retried


async def test_silence_that_outlasts_the_drain_deadline_closes_as_timeout() -> None:
    router = SilentRouter(stream=True)
    async with proxied(router, upstream_read_timeout_s=0.2, drain_timeout_s=0.3) as (proxy, http):
        async with http.post(proxy.public_url + CHAT, data=chat(True)) as resp:
            assert resp.status == 504
        assert await wait_until(lambda: deferred(proxy, "timeout") == 1)
        await asyncio.wait_for(router.closed_after_answer.wait(), 30)
        assert router.closed_before_answer is True  # closed by kvproxy, at the deadline


async def test_a_held_upstream_still_open_when_the_grace_period_ends_closes_as_shutdown() -> None:
    """The hard stop (the shutdown grace period over) wakes the wait a held upstream is in
    (kvproxy.serve.state.HardStop: a set of wake-ups, not a callback on one shared future):
    it is closed then, counted as a `shutdown` deferral, and the server's stop returns."""
    router = SilentRouter(stream=True)
    async with proxied(
        router, upstream_read_timeout_s=0.3, drain_timeout_s=600, shutdown_grace_s=0.2
    ) as (proxy, http):
        async with http.post(proxy.public_url + CHAT, data=chat(True)) as resp:
            assert resp.status == 504
            await resp.read()
        assert await wait_until(lambda: in_progress(proxy) == 1)
        assert router.closed_before_answer is None  # held: kvproxy did not close it
        # Bounded, not timed: the drain deadline (600 s) is far past this bound, so only the
        # hard stop can end the wait within it.
        await asyncio.wait_for(proxy.stop(), 60)
        assert deferred(proxy, "shutdown") == 1
        assert in_progress(proxy) == 0
        await asyncio.wait_for(router.closed_after_answer.wait(), 30)
        assert router.closed_before_answer is True  # closed by kvproxy, never answered
