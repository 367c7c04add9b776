"""The reverse proxy itself: relay fidelity, header hygiene, limits, error mapping."""

from __future__ import annotations

import asyncio
import dataclasses
import io

import aiohttp
import orjson
import pytest
from aiohttp import web
from kvtest import FakeUpstream, running_proxy, static_engines, wait_until
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families

CHAT = "/v1/chat/completions"


def chat_body(content: str = "hi", stream: bool = True, **extra: object) -> bytes:
    return orjson.dumps(
        {
            "model": "m",
            "stream": stream,
            "messages": [{"role": "user", "content": content}],
            **extra,
        }
    )


def sse_chunks(n: int) -> list[bytes]:
    out = []
    for i in range(n):
        ev = {"id": "x", "choices": [{"index": 0, "delta": {"content": f"tok{i} "}}]}
        out.append(b"data: " + orjson.dumps(ev) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def sse_handler(chunks: list[bytes], delay_s: float = 0.0):  # type: ignore[no-untyped-def]
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in chunks:
            await resp.write(c)
            if delay_s:
                await asyncio.sleep(delay_s)
        await resp.write_eof()
        return resp

    return handler


async def test_streaming_relay_is_byte_for_byte(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    chunks = sse_chunks(50)
    upstream.route("POST", CHAT, sse_handler(chunks))
    await upstream.start()
    async with running_proxy(upstream.url) as proxy:
        body = chat_body()
        async with http.post(proxy.public_url + CHAT, data=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            assert resp.headers["X-Kvproxy-Decision"] == "admitted"
            assert int(resp.headers["X-Kvproxy-Prompt-Tokens"]) > 0
            got = await resp.read()
    assert got == b"".join(chunks)
    # The original request bytes were forwarded, not re-serialised.
    assert upstream.received[0]["body"] == body


async def test_non_streaming_body_and_status_pass_through(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    payload = orjson.dumps({"id": "c1", "choices": [{"message": {"content": "ok"}}]})

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(
            status=201, body=payload, content_type="application/json", headers={"X-Upstream": "yes"}
        )

    upstream.route("POST", CHAT, handler)
    await upstream.start()
    async with running_proxy(upstream.url) as proxy:
        async with http.post(proxy.public_url + CHAT, data=chat_body(stream=False)) as resp:
            assert resp.status == 201
            assert resp.headers["X-Upstream"] == "yes"
            assert await resp.read() == payload


async def test_hop_by_hop_headers_are_stripped_both_ways(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(
            text="{}",
            content_type="application/json",
            headers={
                "X-Keep": "1",
                "Keep-Alive": "timeout=5",
                "X-Secret-Hop": "no",
                "Connection": "X-Secret-Hop",
                "Proxy-Authenticate": "Basic",
            },
        )

    upstream.route("GET", "/v1/models", handler)
    await upstream.start()
    async with running_proxy(upstream.url) as proxy:
        headers = {
            "X-Custom": "kept",
            "Connection": "keep-alive, X-Drop-Me",
            "X-Drop-Me": "1",
            "Keep-Alive": "timeout=10",
            "TE": "trailers",
            "Proxy-Authorization": "Basic abc",
            "Upgrade": "h2c",
        }
        async with http.get(proxy.public_url + "/v1/models", headers=headers) as resp:
            assert resp.status == 200
            assert resp.headers["X-Keep"] == "1"
            for h in ("X-Secret-Hop", "Proxy-Authenticate"):
                assert h not in resp.headers
    got = {k.lower() for k in upstream.received[0]["headers"]}
    assert "x-custom" in got
    for h in ("x-drop-me", "keep-alive", "te", "proxy-authorization", "upgrade"):
        assert h not in got


async def test_oversize_body_is_413_before_reaching_upstream(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    upstream.route("POST", CHAT, sse_handler(sse_chunks(1)))
    await upstream.start()
    async with running_proxy(upstream.url, max_body_bytes=4096) as proxy:
        big = chat_body("x" * 10_000)
        async with http.post(proxy.public_url + CHAT, data=big) as resp:
            assert resp.status == 413
            err = (await resp.json())["error"]
            assert err["code"] == "request_too_large"
            assert resp.headers["X-Kvproxy-Decision"] == "rejected"

        async def chunked():  # type: ignore[no-untyped-def]
            for _ in range(10):
                yield b"x" * 1000

        async with http.post(proxy.public_url + CHAT, data=chunked()) as resp:
            assert resp.status == 413
    assert upstream.received == []


async def test_upstream_refused_is_502_with_json(http: aiohttp.ClientSession) -> None:
    dead = free_port()
    async with running_proxy(f"http://127.0.0.1:{dead}") as proxy:
        async with http.post(proxy.public_url + CHAT, data=chat_body()) as resp:
            assert resp.status == 502
            err = (await resp.json())["error"]
            assert err["code"] == "upstream_unreachable"
        metrics = await _scrape(http, proxy.admin_url)
        assert (
            metrics[("kvproxy_upstream_errors_total", (("outcome", "upstream_unreachable"),))] == 1
        )


async def test_upstream_stall_is_504(upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    release = asyncio.Event()

    async def stall(request: web.Request) -> web.StreamResponse:
        await asyncio.wait_for(release.wait(), 10)
        return web.Response(text="late")

    upstream.route("POST", CHAT, stall)
    await upstream.start()
    try:
        async with running_proxy(upstream.url, upstream_read_timeout_s=0.2) as proxy:
            async with http.post(proxy.public_url + CHAT, data=chat_body()) as resp:
                assert resp.status == 504
                assert (await resp.json())["error"]["code"] == "upstream_timeout"
    finally:
        release.set()


async def test_upstream_reset_mid_stream_ends_the_stream(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    async def reset(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse_chunks(1)[0])
        assert request.transport is not None
        request.transport.abort()
        return resp

    upstream.route("POST", CHAT, reset)
    await upstream.start()
    async with running_proxy(upstream.url) as proxy:
        async with http.post(proxy.public_url + CHAT, data=chat_body()) as resp:
            data = await resp.read()
        # Either the reset came before anything was relayed (a 502 JSON error) or after
        # (the stream ends with an error event); never a hang or a silent truncation.
        assert resp.status in (200, 502)
        assert b'"code":"upstream_' in data
        assert await wait_until(lambda: proxy.state.inflight == 0)


async def test_client_disconnect_mid_stream_leaks_nothing(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    upstream.route("POST", CHAT, sse_handler(sse_chunks(200), delay_s=0.005))
    await upstream.start()
    async with running_proxy(upstream.url) as proxy:
        tasks_before = len(asyncio.all_tasks())
        for _ in range(5):
            resp = await http.post(proxy.public_url + CHAT, data=chat_body())
            await resp.content.readany()
            resp.close()  # the client leaves mid-stream
        assert await wait_until(lambda: proxy.state.inflight == 0)
        assert await wait_until(lambda: proxy.services.watcher.watched == 0)
        m = proxy.metrics
        assert m.client_disconnects.labels("streaming", "default")._value.get() == 5
        assert m.deferred_total.labels("first_token", "default")._value.get() == 5
        assert m.deferred_in_progress.labels("default")._value.get() == 0
        assert await wait_until(lambda: len(asyncio.all_tasks()) <= tasks_before)


async def test_a_stream_past_its_first_token_leaves_the_disconnect_watcher(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """Past the safe point the relay finds a departed client at its next write (the test
    above counts those departures), so the watcher stops checking the request: with
    thousands of open streams its scan, 20 a second each, was a cost per event."""
    gate = asyncio.Event()
    chunks = sse_chunks(3)

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunks[0])
        await gate.wait()
        for c in chunks[1:]:
            await resp.write(c)
        await resp.write_eof()
        return resp

    upstream.route("POST", CHAT, handler)
    await upstream.start()
    async with running_proxy(upstream.url) as proxy:
        resp = await http.post(proxy.public_url + CHAT, data=chat_body())
        first = await resp.content.readany()
        assert b"tok0" in first
        # The stream is still open (the upstream waits on the gate) and no longer watched.
        assert await wait_until(lambda: proxy.services.watcher.watched == 0)
        assert proxy.state.inflight == 1
        gate.set()
        rest = await resp.read()
        assert (first + rest).count(b"data: ") == len(chunks)
        assert rest.endswith(b"data: [DONE]\n\n")
        assert await wait_until(lambda: proxy.state.inflight == 0)


async def test_metrics_endpoint_parses(upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    upstream.route("POST", CHAT, sse_handler(sse_chunks(3)))
    await upstream.start()
    async with running_proxy(upstream.url) as proxy:
        async with http.post(proxy.public_url + CHAT, data=chat_body()) as resp:
            await resp.read()
        metrics = await _scrape(http, proxy.admin_url)
    names = {name for name, _ in metrics}
    for expected in (
        "kvproxy_requests_total",
        "kvproxy_request_duration_seconds_bucket",
        "kvproxy_upstream_ttft_seconds_count",
        "kvproxy_inflight_requests",
        "kvproxy_client_disconnects_total",
        "kvproxy_event_loop_lag_seconds_count",
        "kvproxy_admission_limit_tokens",
    ):
        assert expected in names, expected
    # The single-model form carries one fixed `model` value.
    key = (("decision", "admitted"), ("model", "default"), ("route", "chat"))
    assert metrics[("kvproxy_requests_total", key)] == 1


async def test_healthz_and_readyz(upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    await upstream.start()
    async with running_proxy(upstream.url) as proxy:
        async with http.get(proxy.admin_url + "/healthz") as resp:
            assert resp.status == 200
        async with http.get(proxy.admin_url + "/readyz") as resp:
            assert resp.status == 200


async def _scrape(
    http: aiohttp.ClientSession, admin_url: str
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with http.get(admin_url + "/metrics", headers={"Accept-Encoding": "identity"}) as resp:
        text = await resp.text()
    out = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_keep_alive_connection_carries_consecutive_streams_intact(
    upstream: FakeUpstream,
) -> None:
    # Regression: a streamed response followed by a stray second status line made the
    # client's next request on the same connection hang.
    chunks = sse_chunks(5)
    upstream.route("POST", CHAT, sse_handler(chunks))
    await upstream.start()
    connector = aiohttp.TCPConnector(limit=1)
    async with (
        running_proxy(upstream.url) as proxy,
        aiohttp.ClientSession(connector=connector) as one_conn,
    ):
        for _ in range(3):
            async with one_conn.post(
                proxy.public_url + CHAT, data=chat_body(), timeout=aiohttp.ClientTimeout(total=10)
            ) as resp:
                assert resp.status == 200
                assert await resp.read() == b"".join(chunks)


async def test_a_large_admitted_body_reaches_upstream_byte_for_byte(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})

    upstream.route("POST", CHAT, ok)
    await upstream.start()
    body = chat_body("y" * 3_000_000, stream=False)
    async with running_proxy(
        upstream.url, engines=[{"url": "static://p", "kind": "static", "capacity_tokens": 10**7}]
    ) as proxy:
        async with http.post(proxy.public_url + CHAT, data=io.BytesIO(body)) as resp:
            assert resp.status == 200
    assert upstream.received[0]["body"] == body
    assert upstream.received[0]["headers"]["Content-Length"] == str(len(body))


async def test_decode_clamp_rewrites_the_output_cap_it_forwards(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    payload = orjson.dumps({"id": "c1", "choices": [{"message": {"content": "ok"}}]})

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=payload, content_type="application/json")

    upstream.route("POST", CHAT, handler)
    await upstream.start()
    engines = static_engines(capacity=100_000, decode=3_000)
    async with running_proxy(upstream.url, engines=engines, decode_policy="clamp") as proxy:
        body = chat_body("hi", stream=False, max_tokens=50_000)
        async with http.post(proxy.public_url + CHAT, data=body) as resp:
            assert resp.status == 200
            prompt = int(resp.headers["X-Kvproxy-Prompt-Tokens"])
            clamped = int(resp.headers["X-Kvproxy-Output-Clamped"])
        decode = proxy.services.models.first.capacity.limits().decode_limit_tokens
    sent = orjson.loads(upstream.received[0]["body"])
    assert sent["max_tokens"] == clamped
    assert decode is not None
    assert prompt + clamped == decode
    assert clamped > 0


async def test_clamp_is_decided_again_when_decode_shrank_while_queued(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """One request slot: the second request queues with an output cap that fits decode as
    measured then. Decode shrinks before its turn; the cap it is sent with must fit the
    pool of the moment it is sent, not the one it was first judged against (I4)."""
    release = asyncio.Event()
    payload = orjson.dumps({"id": "c1", "choices": [{"message": {"content": "ok"}}]})

    async def handler(request: web.Request) -> web.StreamResponse:
        if len(upstream.received) == 1:
            await asyncio.wait_for(release.wait(), 30)
        return web.Response(body=payload, content_type="application/json")

    upstream.route("POST", CHAT, handler)
    await upstream.start()
    engines = static_engines(capacity=100_000, decode=10_000)
    async with running_proxy(
        upstream.url,
        engines=engines,
        decode_policy="clamp",
        max_inflight_requests=1,
        queue_timeout_s=30.0,
    ) as proxy:
        capacity = proxy.services.models.first.capacity
        holder = asyncio.ensure_future(
            http.post(proxy.public_url + CHAT, data=chat_body("a", stream=False, max_tokens=8))
        )
        assert await wait_until(lambda: len(upstream.received) == 1)
        queued = asyncio.ensure_future(
            http.post(proxy.public_url + CHAT, data=chat_body("b", stream=False, max_tokens=5_000))
        )
        assert await wait_until(lambda: proxy.services.models.first.budget.queue_depth == 1)
        shrunk = dataclasses.replace(capacity.limits(), decode_limit_tokens=2_000)
        capacity.limits = lambda: shrunk  # type: ignore[method-assign]
        release.set()
        async with await holder as first, await queued as second:
            assert first.status == 200
            assert second.status == 200
            prompt = int(second.headers["X-Kvproxy-Prompt-Tokens"])
            clamped = int(second.headers["X-Kvproxy-Output-Clamped"])
    sent = orjson.loads(upstream.received[1]["body"])
    assert sent["max_tokens"] == clamped
    assert prompt + clamped <= 2_000


async def test_a_request_costs_no_loop_lookup_and_no_randomness_system_call(
    upstream: FakeUpstream, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Python 3.11 asyncio.get_running_loop() is a getpid() system call, and os.urandom
    a getrandom(): a small chat made five of them that its work did not need. kvproxy's
    own code, past a connection's first request, makes none."""
    import os
    import sys

    calls = {"loop": 0, "urandom": 0}
    real_loop, real_urandom = asyncio.get_running_loop, os.urandom

    def counted_loop() -> asyncio.AbstractEventLoop:
        if "/kvproxy/" in sys._getframe(1).f_code.co_filename:
            calls["loop"] += 1
        return real_loop()

    def counted_urandom(n: int) -> bytes:
        calls["urandom"] += 1
        return real_urandom(n)

    upstream.route("POST", CHAT, sse_handler(sse_chunks(3)))
    await upstream.start()
    async with running_proxy(upstream.url) as proxy:
        url = proxy.public_url + CHAT
        ids = set()
        async with http.post(url, data=chat_body()) as resp:  # connects, both sides
            assert resp.status == 200
            await resp.read()
        monkeypatch.setattr(asyncio, "get_running_loop", counted_loop)
        monkeypatch.setattr(asyncio.events, "get_running_loop", counted_loop)
        monkeypatch.setattr(os, "urandom", counted_urandom)
        for stream in (True, False, True):
            async with http.post(url, data=chat_body(stream=stream)) as resp:
                assert resp.status == 200
                await resp.read()
                ids.add(resp.headers["X-Request-ID"])
        monkeypatch.undo()
    assert calls == {"loop": 0, "urandom": 0}
    assert len(ids) == 3


def test_request_ids_are_distinct_random_hex_across_batches_and_forks() -> None:
    from kvproxy.serve.context import _ID_BATCH, new_request_id

    ids = [new_request_id() for _ in range(3 * _ID_BATCH + 5)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    # A forked child drops the parent's batch: what it issues next comes from the OS again,
    # never the ids the parent has still to issue.
    new_request_id.reset()
    assert new_request_id() not in ids
