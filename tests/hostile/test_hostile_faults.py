"""Faults while traffic runs: a misbehaving router, misbehaving engine admin endpoints,
engines whose names do not resolve.

The upstream sits behind `ChaosFront`, a raw TCP front whose mode a test flips while
clients keep sending: pass bytes through, refuse (listener closed, live connections
dropped), answer garbage, stall before headers, or cut the response mid-stream. Engine
admin endpoints sit behind `ChaosEngine`, which serves the simulator's real answers or
is slow, down, or HTML. Ground truth: the fake upstream's record and the simulator's
counters (nothing over the limit got through), the proxy's in-flight count, its open fds
and the loop's tasks (nothing leaked), and /readyz (readiness tells the truth).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import Counter
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from kvtest import FakeUpstream, running_proxy, static_engines, wait_until

from kvproxy.policy.errors import UPSTREAM_OUTCOMES
from kvproxy.serve.app import KvproxyServer
from kvproxy.sim.launcher import SimCluster, SimOptions

CHAT = "/v1/chat/completions"
LIMIT = 4096
OVER = "x" * 6000  # over LIMIT under any bound
MODES = ("pass", "refuse", "garbage", "stall", "cut")


class ChaosFront:
    """A TCP front for `target_port` whose behaviour per new connection is `mode`."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.mode = "pass"
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._release = asyncio.Event()

    async def listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def set_mode(self, mode: str) -> None:
        assert mode in MODES
        self._release.set()  # stalled connections end when the mode changes
        self._release = asyncio.Event()
        self._drop_connections()
        if mode == "refuse" and self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        elif mode != "refuse" and self._server is None:
            await self.listen()
        self.mode = mode

    def _drop_connections(self) -> None:
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self._release.set()
        self._drop_connections()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        # Aborted transports end every task; cancelling them instead makes asyncio's
        # start_server callback log the CancelledError as an error (Python 3.11).
        await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), 10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        self._writers.add(writer)
        mode, release = self.mode, self._release
        try:
            if mode == "garbage":
                await reader.read(65536)
                writer.write(b"\x16\x03\x01 this is not HTTP at all\r\n\r\n\x00\xff" * 4)
                await writer.drain()
            elif mode == "stall":
                await reader.read(65536)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(release.wait(), 20)
            else:
                await self._pipe(reader, writer, cut_after=600 if mode == "cut" else None)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.transport.abort()
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cut_after: int | None
    ) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers.add(up_w)

        async def upward() -> None:
            while data := await reader.read(65536):
                up_w.write(data)
                await up_w.drain()

        up = asyncio.ensure_future(upward())
        try:
            sent = 0
            while data := await up_r.read(65536):
                if cut_after is not None and sent + len(data) > cut_after:
                    writer.write(data[: max(0, cut_after - sent)])
                    return  # the caller aborts: a reset in the middle of the response
                writer.write(data)
                sent += len(data)
                await writer.drain()
        finally:
            up.cancel()
            with contextlib.suppress(BaseException):
                await up
            self._writers.discard(up_w)
            up_w.transport.abort()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _sse(n: int) -> list[bytes]:
    ev = [
        b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]})
        for i in range(n)
    ]
    return [e + b"\n\n" for e in ev] + [b"data: [DONE]\n\n"]


def _upstream_app(upstream: FakeUpstream) -> None:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())  # cached: the recorder read it first
        if not body.get("stream"):
            return web.json_response({"id": "c", "choices": [{"message": {"content": "ok"}}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in _sse(40):
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    upstream.route("POST", CHAT, chat)


async def _one(
    http: aiohttp.ClientSession, proxy: KvproxyServer, stream: bool, content: str = "hi"
) -> tuple[int, str]:
    """One request; returns (status, outcome) where outcome names how it ended."""
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": content}]}
    async with http.post(proxy.public_url + CHAT, json=body) as resp:
        try:
            data = await resp.read()
        except aiohttp.ClientPayloadError:
            return resp.status, "truncated"  # the proxy cut its own stream short
    assert resp.status != 500, data[:300]
    if resp.status == 200:
        if stream and not data.endswith(b"data: [DONE]\n\n"):
            return 200, "truncated"
        if b'"code":"upstream_' in data:  # a stream ended by an error event
            code = orjson.loads(data.split(b"data: ")[-2])["error"]["code"]
            assert code in UPSTREAM_OUTCOMES
            return 200, code
        return 200, "ok"
    err = orjson.loads(data)["error"]
    return resp.status, err["code"]


async def test_router_faults_map_to_502_504_while_traffic_runs(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    _upstream_app(upstream)
    await upstream.start()
    front = ChaosFront(upstream.port)
    await front.listen()
    fds_before = _fds()
    tasks_before = len(asyncio.all_tasks())
    try:
        async with running_proxy(
            front.url,
            engines=static_engines(LIMIT),
            upstream_read_timeout_s=0.5,
            upstream_connect_timeout_s=2.0,
        ) as proxy:
            want = {
                "pass": {(200, "ok")},
                "garbage": {(502, "upstream_bad_response"), (502, "upstream_reset")},
                "stall": {(504, "upstream_timeout")},
                "refuse": {(502, "upstream_unreachable"), (502, "upstream_reset")},
                "cut": {(200, "upstream_reset"), (200, "upstream_bad_response"),
                        (200, "truncated"), (502, "upstream_reset")},
            }  # fmt: skip
            for mode in ("pass", "garbage", "stall", "refuse", "cut", "pass"):
                await front.set_mode(mode)
                for stream in (False, True):
                    got = await _one(http, proxy, stream)
                    if mode == "cut" and not stream:
                        # A short JSON body may fit before the cut: delivered whole.
                        assert got in want[mode] | {(200, "ok")}, (mode, got)
                    else:
                        assert got in want[mode], (mode, stream, got)

            # Then everything at once: 6 clients keep sending while the mode flips.
            outcomes: Counter[tuple[int, str]] = Counter()

            async def client(i: int) -> None:
                for j in range(12):
                    over = (i + j) % 5 == 0
                    status, code = await _one(http, proxy, stream=j % 2 == 0,
                                              content=OVER if over else "hi")  # fmt: skip
                    if over:
                        assert (status, code) == (400, "context_length_exceeded")
                    outcomes[(status, code)] += 1

            clients = asyncio.gather(*(client(i) for i in range(6)))
            for mode in ("cut", "stall", "pass", "garbage", "refuse", "pass"):
                await front.set_mode(mode)
                await asyncio.sleep(0.05)
            await front.set_mode("pass")
            await asyncio.wait_for(clients, 120)
            allowed_codes = {"ok", "truncated", "context_length_exceeded", *UPSTREAM_OUTCOMES}
            assert {code for _, code in outcomes} <= allowed_codes, outcomes
            assert {status for status, _ in outcomes} <= {200, 400, 502, 504}, outcomes

            # Healthy again, and nothing is left behind.
            assert await _one(http, proxy, stream=True) == (200, "ok")
            assert await wait_until(lambda: proxy.state.inflight == 0, 30)
            assert await wait_until(lambda: proxy.services.watcher.watched == 0, 30)
            assert proxy.metrics.deferred_in_progress.labels("default")._value.get() == 0
    finally:
        await front.close()
    # I7 / I1: no over-limit prompt ever reached the router.
    assert all(len(r["body"]) < LIMIT for r in upstream.received)
    assert await wait_until(lambda: _fds() <= fds_before + 3, 30), (_fds(), fds_before)
    assert await wait_until(lambda: len(asyncio.all_tasks()) <= tasks_before, 30)


# --- engine admin endpoints ---------------------------------------------------------------


class ChaosEngine:
    """Serves a real engine's admin answers, or is slow, down, or speaks HTML."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.mode = "ok"
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.release = asyncio.Event()

    async def start(self, session: aiohttp.ClientSession) -> None:
        async def any_get(request: web.Request) -> web.StreamResponse:
            if self.mode == "slow":
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.release.wait(), 10)
            if self.mode == "down":
                return web.Response(status=503, text="engine restarting")
            if self.mode == "html":
                return web.Response(text="<html><body>502 Bad Gateway</body></html>",
                                    content_type="text/html")  # fmt: skip
            async with session.get(self.target + request.rel_url.raw_path_qs) as resp:
                body = await resp.read()
                return web.Response(status=resp.status, body=body,
                                    content_type=resp.content_type)  # fmt: skip

        app = web.Application()
        app.router.add_get("/{tail:.*}", any_get)
        self.runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def set_mode(self, mode: str) -> None:
        self.release.set()
        self.release = asyncio.Event()
        self.mode = mode

    async def close(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def _ready(http: aiohttp.ClientSession, proxy: KvproxyServer) -> int:
    async with http.get(proxy.admin_url + "/readyz") as resp:
        await resp.read()
        return resp.status


def _probe_errors(proxy: KvproxyServer, engine: str) -> float:
    total = 0.0
    for metric in proxy.metrics.capacity_probe_errors.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.labels.get("engine") == engine:
                total += sample.value
    return total


@pytest.mark.slow
async def test_engine_admin_faults_fail_closed_while_traffic_runs(
    http: aiohttp.ClientSession,
) -> None:
    sim = SimCluster(SimOptions(port=0, prefill_port=0, decode_port=0, mode="vulnerable"))
    await sim.start()
    chaos = ChaosEngine(sim.prefill_url)
    await chaos.start(http)
    try:
        engines = [
            {"url": chaos.url, "role": "prefill", "kind": "sglang", "name": "prefill-0"},
            {"url": sim.decode_url, "role": "decode", "kind": "sglang", "name": "decode-0"},
        ]
        async with running_proxy(
            sim.router_url,
            engines=engines,
            capacity_refresh_s=0.2,
            capacity_stale_s=1.5,
            capacity_probe_timeout_s=0.3,
        ) as proxy:
            limit = proxy.services.models.first.capacity.limits().admission_limit_tokens
            assert limit is not None
            seen: Counter[tuple[int, str]] = Counter()
            stop = asyncio.Event()

            async def traffic() -> None:
                for i in range(10_000):  # bounded; stopped by the event long before
                    if stop.is_set():
                        return
                    content = OVER if i % 4 == 0 else "hello"
                    body = {"model": "m", "max_tokens": 2,
                            "messages": [{"role": "user", "content": content}]}  # fmt: skip
                    async with http.post(proxy.public_url + CHAT, json=body) as resp:
                        data = await resp.read()
                    if resp.status == 200:
                        assert int(resp.headers["X-Kvproxy-Prompt-Tokens"]) <= limit
                        seen[(200, "ok")] += 1
                        continue
                    code = orjson.loads(data)["error"]["code"]
                    seen[(resp.status, code)] += 1
                    if resp.status == 503:
                        assert int(resp.headers["Retry-After"]) >= 1

            runner = asyncio.ensure_future(traffic())
            try:
                for mode in ("slow", "html", "down"):
                    chaos.set_mode("ok")
                    assert await wait_until(proxy.services.models.first.capacity.ready, 15)
                    before = _probe_errors(proxy, "prefill-0")
                    chaos.set_mode(mode)
                    assert await wait_until(
                        lambda b=before: _probe_errors(proxy, "prefill-0") > b,
                        15,
                    )
                    # One failed probe does not forget a fresh measurement: readiness follows
                    # freshness, never a single error.
                    snap = proxy.services.models.first.capacity.snapshot_json()
                    prefill = next(e for e in snap["engines"] if e["engine"] == "prefill-0")
                    assert prefill["last_error"] is not None
                    assert snap["known"] == (prefill["state"] == "fresh"), snap
                    # Stale: fail closed, and say so.
                    assert await wait_until(
                        lambda: not proxy.services.models.first.capacity.ready(), 15
                    )
                    assert await _ready(http, proxy) == 503
                    got = await _one(http, proxy, stream=False)
                    assert got == (503, "capacity_unknown"), (mode, got)
                chaos.set_mode("ok")
                assert await wait_until(proxy.services.models.first.capacity.ready, 15)
                assert await _ready(http, proxy) == 200
                assert (await _one(http, proxy, stream=False))[0] == 200
            finally:
                stop.set()
                await asyncio.wait_for(runner, 60)
            # The default tokenizer counts a prompt whose byte bound is over the limit with
            # the prefill engine's /tokenize: while that engine fails, such a prompt is
            # refused 503 token_count_unavailable (fail closed), never admitted.
            assert set(seen) <= {(200, "ok"), (400, "context_length_exceeded"),
                                 (503, "capacity_unknown"),
                                 (503, "token_count_unavailable")}, seen  # fmt: skip
            assert seen[(503, "capacity_unknown")] > 0
            assert await wait_until(lambda: proxy.state.inflight == 0, 30)
        async with http.get(sim.router_url + "/sim/stats") as resp:
            stats: dict[str, Any] = await resp.json()
        # Nothing over the engines' limit ever reached them (the simulator's own arithmetic).
        assert stats["prefill"]["rejections_at_admission"] == 0
        assert stats["prefill"]["pending_rejections"] == 0
    finally:
        await chaos.close()
        await sim.close()


async def test_unresolvable_engine_is_not_ready_and_does_not_crash(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    _upstream_app(upstream)
    await upstream.start()
    engines = [
        {"url": "http://prefill-0.kvproxy-test.invalid:30000", "role": "prefill", "kind": "sglang"},
        {"url": "http://decode.kvproxy-test.invalid:30001", "role": "decode", "kind": "sglang"},
    ]
    async with running_proxy(
        upstream.url, engines=engines, capacity_refresh_s=0.2, capacity_probe_timeout_s=0.5
    ) as proxy:
        # Several refresh rounds go by, each failing on DNS; the monitor keeps running.
        assert await wait_until(
            lambda: proxy.services.models.first.capacity.snapshot_json()["refreshes"] >= 3, 15
        )
        assert not proxy.services.models.first.capacity.ready()
        assert await _ready(http, proxy) == 503
        for stream in (False, True):
            assert await _one(http, proxy, stream) == (503, "capacity_unknown")
        async with http.get(proxy.admin_url + "/capacity") as resp:
            snap = await resp.json()
        assert snap["known"] is False
        for engine in snap["engines"]:
            assert engine["state"] == "unmeasured"
            assert engine["last_error"]["reason"] == "dns"
        async with http.get(proxy.admin_url + "/healthz") as resp:
            assert resp.status == 200  # alive, just not ready
    assert upstream.received == []
