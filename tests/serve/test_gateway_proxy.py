"""Gateway mode through the running proxy: one model, two built-in simulator clusters of
different pools, each behind its own router (kvproxy.policy.routing, kvproxy.serve.models).

Ground truth is each simulator's /sim/stats: what reached its engines and its own limit
arithmetic (`largest_prompt`). Prompts are token ids (/v1/completions), so counts are exact
whatever the tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import pytest
from kvtest import FakeUpstream, wait_until
from ports import free_port

from kvproxy.config import load_settings
from kvproxy.observe import Metrics
from kvproxy.policy import DEFERRED_OUTCOMES, DISCONNECT_PHASES
from kvproxy.policy.routing import rendezvous
from kvproxy.serve.app import KvproxyServer
from kvproxy.sim.launcher import SimCluster, SimOptions

COMPLETIONS = "/v1/completions"
# Published limits 5,315 and 10,637 (the issue's): pools 5,322 and 10,644, context 16,384.
POOL_SMALL, POOL_LARGE = 5_322, 10_644


def engines_of(sim: SimCluster) -> list[dict[str, Any]]:
    return [
        {"url": sim.prefill_url, "role": "prefill", "kind": "sglang"},
        {"url": sim.decode_url, "role": "decode", "kind": "sglang"},
    ]


@contextlib.asynccontextmanager
async def two_clusters(
    *, small_url: str | None = None, weights: tuple[float, float] = (1, 1), **overrides: Any
) -> AsyncIterator[tuple[SimCluster, SimCluster, KvproxyServer]]:
    sim_extra = overrides.pop("sim", {})
    free = {"port": 0, "prefill_port": 0, "decode_port": 0, "context_length": 16_384}
    small_opts = SimOptions(**free, prefill_pool_tokens=POOL_SMALL, **sim_extra)
    large_opts = SimOptions(**free, prefill_pool_tokens=POOL_LARGE, **sim_extra)
    async with SimCluster(small_opts) as small, SimCluster(large_opts) as large:
        upstreams = [
            {
                "name": "small",
                "url": small_url or small.router_url,
                "engines": engines_of(small),
                "weight": weights[0],
            },
            {
                "name": "large",
                "url": large.router_url,
                "engines": engines_of(large),
                "weight": weights[1],
            },
        ]
        settings = load_settings(
            listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
            access_log=False,
            upstreams=upstreams,
            **overrides,
        )
        proxy = KvproxyServer(settings, Metrics())
        await proxy.start()
        try:
            for c in proxy.services.models.first.clusters:
                await c.capacity.refresh_now()
            yield small, large, proxy
        finally:
            await proxy.stop()


async def truth(http: aiohttp.ClientSession, sim: SimCluster) -> dict[str, Any]:
    async with http.get(sim.router_url + "/sim/stats") as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def arrived(http: aiohttp.ClientSession, sim: SimCluster) -> int:
    return int(sum((await truth(http, sim))["prefill"]["requests_by_route"].values()))


async def post(
    http: aiohttp.ClientSession, proxy: KvproxyServer, n: int, **headers: str
) -> tuple[int, dict[str, Any]]:
    body = {"model": "m", "prompt": [65] * n, "max_tokens": 1}
    async with http.post(proxy.public_url + COMPLETIONS, json=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


def sample(proxy: KvproxyServer, name: str, **labels: str) -> float:
    return proxy.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_spread_by_weight_fit_only_and_refusal_reaching_nothing(
    http: aiohttp.ClientSession,
) -> None:
    async with two_clusters(weights=(1, 3)) as (small, large, proxy):
        limit_s = (await truth(http, small))["prefill"]["limits"]["largest_prompt"]
        limit_l = (await truth(http, large))["prefill"]["limits"]["largest_prompt"]
        assert (limit_s, limit_l) == (5_315, 10_637)
        # Below both: spread by weight (sequential traffic, so every pick is a tie).
        below = [await post(http, proxy, 1_000) for _ in range(40)]
        spread = (await arrived(http, small), await arrived(http, large))
        # Between the limits: only the large cluster holds it.
        between = [await post(http, proxy, n) for n in (limit_s + 1, 8_000, limit_l)]
        after_between = (await arrived(http, small), await arrived(http, large))
        # Over both: refused naming the largest limit, sent nowhere (I7).
        over = await post(http, proxy, limit_l + 1)
        after_over = (await arrived(http, small), await arrived(http, large))
        async with http.get(proxy.admin_url + "/capacity") as resp:
            capacity = await resp.json()
        gauges = {
            c: sample(proxy, "kvproxy_upstream_limit_tokens", model="default", upstream=c)
            for c in ("small", "large")
        }
        model_limit = sample(proxy, "kvproxy_admission_limit_tokens", model="default")
        fit = {
            c: sample(
                proxy, "kvproxy_routing_decisions_total", model="default", upstream=c, reason="fit"
            )
            for c in ("small", "large")
        }
    assert all(status == 200 for status, _ in below)
    assert spread == (10, 30)  # exactly the weights 1:3 (within 30 % is the bar)
    assert [s for s, _ in between] == [200, 200, 200]
    assert [r["usage"]["prompt_tokens"] for _, r in between] == [limit_s + 1, 8_000, limit_l]
    assert after_between == (10, 33)
    assert over[0] == 400
    assert over[1]["error"]["code"] == "context_length_exceeded"
    assert over[1]["error"]["limit_tokens"] == limit_l
    assert after_over == after_between
    # Ground truth: nothing over a cluster's own limit arrived anywhere.
    assert gauges == {"small": limit_s, "large": limit_l}
    assert model_limit == limit_l
    assert fit == {"small": 10, "large": 33}
    clusters = capacity["clusters"]
    assert set(clusters) == {"small", "large"}
    assert clusters["large"]["weight"] == 3
    assert clusters["small"]["ejected_until"] is None
    assert clusters["small"]["limits"]["admission_limit_tokens"] == limit_s
    assert capacity["admission_limit_tokens"] == limit_l


async def test_one_clusters_engines_down_the_other_keeps_serving_and_ready(
    http: aiohttp.ClientSession,
) -> None:
    async with two_clusters(
        capacity_refresh_s=0.2, capacity_stale_s=0.6, capacity_probe_timeout_s=0.5
    ) as (small, large, proxy):
        model = proxy.services.models.first
        small_c = model.clusters[0]
        await small.stop_server("prefill")
        await small.stop_server("decode")
        assert await wait_until(lambda: not small_c.capacity.ready(), timeout_s=20)
        before = await arrived(http, large)
        served = [await post(http, proxy, 1_000) for _ in range(10)]
        after = await arrived(http, large)
        async with http.get(proxy.admin_url + "/readyz") as resp:
            ready = resp.status, await resp.json()
        known = sample(proxy, "kvproxy_upstream_capacity_known", model="default", upstream="small")
        limit_gone = proxy.metrics.registry.get_sample_value(
            "kvproxy_upstream_limit_tokens", {"model": "default", "upstream": "small"}
        )
        await large.stop_server("prefill")
        large_c = model.clusters[1]
        assert await wait_until(lambda: not large_c.capacity.ready(), timeout_s=20)
        none = await post(http, proxy, 10)
        async with http.get(proxy.admin_url + "/readyz") as resp:
            not_ready = resp.status
    assert [s for s, _ in served] == [200] * 10
    assert after - before == 10  # the unmeasured cluster received nothing
    assert ready == (200, {"ready": True})
    assert known == 0
    assert limit_gone is None  # absent while unmeasured, not 0
    assert none[0] == 503
    assert none[1]["error"]["code"] == "capacity_unknown"
    assert not_ready == 503


@contextlib.contextmanager
def blackholed_port() -> Iterator[str]:
    """A loopback URL whose connects hang, as a lost node's do: a listening socket with a
    backlog of 0 that never accepts, its queue filled, so the kernel drops further SYNs."""
    server = socket.socket()
    held: list[socket.socket] = []
    try:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        for _ in range(3):
            c = socket.socket()
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                c.connect(("127.0.0.1", port))
            held.append(c)
        yield f"http://127.0.0.1:{port}"
    finally:
        for c in held:
            c.close()
        server.close()


@contextlib.contextmanager
def refused_port() -> Iterator[str]:
    """A loopback URL nothing listens on: connects are refused at once."""
    yield f"http://127.0.0.1:{free_port()}"


@pytest.mark.parametrize("dead_router", [refused_port, blackholed_port], ids=["refused", "hangs"])
async def test_a_connect_failure_moves_the_request_once_and_ejects_the_cluster(
    http: aiohttp.ClientSession, dead_router: Callable[[], contextlib.AbstractContextManager[str]]
) -> None:
    """The small cluster's engines are measured but its router is gone. Refused, or hanging
    (a lost node, a NetworkPolicy dropping SYNs: before, that was a 504 to every client the
    cluster was picked for), nothing was sent: the request moves once, the cluster is
    ejected after `upstream_outlier_consecutive` (5) connect failures in a row: round-robin
    sends it every other request until then."""
    with dead_router() as dead:
        async with two_clusters(
            small_url=dead, upstream_eject_s=60, upstream_connect_timeout_s=0.3
        ) as (_small, large, proxy):
            replies = [await post(http, proxy, 1_000) for _ in range(12)]
            ejected = sample(proxy, "kvproxy_upstream_ejected", model="default", upstream="small")
            ejections = sample(
                proxy,
                "kvproxy_upstream_ejections_total",
                model="default",
                upstream="small",
                cause="connect",
            )
            retries = sample(
                proxy,
                "kvproxy_routing_decisions_total",
                model="default",
                upstream="large",
                reason="retry",
            )
            reached = await arrived(http, large)
            async with http.get(proxy.admin_url + "/capacity") as resp:
                capacity = await resp.json()
    assert [s for s, _ in replies] == [200] * 12
    assert reached == 12
    assert ejections == 1  # then ejected: the others went straight to the large cluster
    assert ejected == 1
    assert retries == 5
    assert capacity["clusters"]["small"]["ejected_until"] is not None


def failing_router(
    upstream: FakeUpstream, status: int, body: dict[str, Any], hits: list[str]
) -> None:
    async def failing(request: Any) -> Any:
        hits.append(request.headers.get("Authorization", ""))
        await request.read()
        from aiohttp import web

        return web.json_response(body, status=status)

    upstream.route("POST", COMPLETIONS, failing)


async def test_one_tenants_5xx_never_ejects_a_cluster_and_is_never_retried(
    http: aiohttp.ClientSession, upstream: FakeUpstream
) -> None:
    """The issue's lever: one tenant whose requests the router answers 5xx. However many,
    the cluster keeps serving the other tenants; five tenants failing in a row eject it."""
    hits: list[str] = []
    failing_router(upstream, 503, {"error": "boom"}, hits)
    await upstream.start()
    async with two_clusters(small_url=upstream.url, upstream_eject_s=60) as (_s, large, proxy):
        hostile = [await post(http, proxy, 1_000, Authorization="Bearer x") for _ in range(20)]
        after_hostile = sample(proxy, "kvproxy_upstream_ejected", model="default", upstream="small")
        many = []
        for i in range(20):
            many.append(await post(http, proxy, 1_000, Authorization=f"Bearer t{i}"))
            if sample(proxy, "kvproxy_upstream_ejected", model="default", upstream="small"):
                break
        after = [await post(http, proxy, 1_000, Authorization="Bearer y") for _ in range(4)]
        causes = sample(
            proxy,
            "kvproxy_upstream_ejections_total",
            model="default",
            upstream="small",
            cause="status_5xx",
        )
        reached = await arrived(http, large)
    # Ties alternate (round-robin): every other hostile request reached the small cluster,
    # and its 503 was relayed as is: a POST that reached a router is never sent again.
    assert [s for s, _ in hostile] == [503, 200] * 10
    assert after_hostile == 0
    assert len(hits) == 10 + sum(1 for s, _ in many if s == 503)
    # The hostile tenant's one counted failure and four other tenants': ejected.
    assert sum(1 for s, _ in many if s == 503) == 4
    assert [s for s, _ in after] == [200] * 4
    assert causes == 1
    assert reached == 10 + sum(1 for s, _ in many if s == 200) + 4


async def test_a_5xx_the_request_caused_never_counts(
    http: aiohttp.ClientSession, upstream: FakeUpstream
) -> None:
    """vLLM's and SGLang's error bodies say when a 5xx is the request's (a client error
    type, a 4xx code): however many tenants get one, the cluster stays in."""
    hits: list[str] = []
    body = {"error": {"message": "bad", "type": "BadRequestError", "code": 400}}
    failing_router(upstream, 500, body, hits)
    await upstream.start()
    async with two_clusters(small_url=upstream.url, upstream_eject_s=60) as (_s, _l, proxy):
        replies = [await post(http, proxy, 1_000, Authorization=f"Bearer t{i}") for i in range(20)]
        ejected = sample(proxy, "kvproxy_upstream_ejected", model="default", upstream="small")
        outcomes = sample(
            proxy,
            "kvproxy_upstream_outcomes_total",
            model="default",
            upstream="small",
            outcome="request_5xx",
        )
    assert [s for s, _ in replies] == [500, 200] * 10
    assert ejected == 0
    assert outcomes == 10


@contextlib.asynccontextmanager
async def resetting_router() -> AsyncIterator[tuple[str, list[int], asyncio.Event]]:
    """A router that reads each request head and resets the connection (SO_LINGER 0), until
    `healed` is set; then it answers 200 with a completion."""
    served: list[int] = [0]
    healed = asyncio.Event()

    async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            served[0] += 1
            if not healed.is_set():
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                writer.transport.abort()
                return
            body = b'{"choices":[{"text":"x"}],"usage":{"prompt_tokens":1}}'
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            writer.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.transport.abort()

    server = await asyncio.start_server(conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", served, healed
    finally:
        server.close()
        await server.wait_closed()


async def test_a_resetting_router_is_ejected_within_the_threshold_and_comes_back(
    http: aiohttp.ClientSession,
) -> None:
    """A router that takes each request and resets the connection, without a 5xx: ejected
    after five resets in a row (before, never), back once its back-off passed and it
    answers again."""
    async with (
        resetting_router() as (url, served, healed),
        two_clusters(small_url=url, upstream_eject_s=5.0) as (_s, _large, proxy),
    ):
        # Bounded: until it is ejected (round-robin gives it every other request).
        replies = []
        for _ in range(30):
            replies.append(await post(http, proxy, 1_000))
            if sample(proxy, "kvproxy_upstream_ejected", model="default", upstream="small"):
                break
        ejections = sample(
            proxy,
            "kvproxy_upstream_ejections_total",
            model="default",
            upstream="small",
            cause="reset",
        )
        reset_at_ejection = served[0]
        healed.set()
        # Until it serves again: the back-off (5 s) passes, then every other request.
        back = []
        for _ in range(200):  # bounded: 20 s
            back.append(await post(http, proxy, 1_000))
            if served[0] > reset_at_ejection:
                break
            await asyncio.sleep(0.1)
        restores = sample(
            proxy,
            "kvproxy_upstream_restores_total",
            model="default",
            upstream="small",
            cause="reset",
        )
    # Every other request reached it (a tie, round-robin) and got 502 until five had.
    assert [s for s, _ in replies].count(502) == 5
    assert len(replies) == 9  # the fifth reset, on the ninth request, ejected it
    assert reset_at_ejection == 5
    assert ejections == 1
    assert restores == 1
    assert all(s == 200 for s, _ in back)
    assert served[0] == 5 + 1  # back in the rotation, and served


async def test_a_sticky_key_whose_budget_is_full_spills_to_the_idle_cluster_at_once(
    http: aiohttp.ClientSession,
) -> None:
    """The issue's starvation: cluster "small" at its in-flight budget (one request, held in
    a slow prefill); a second request with the same session key went to the queue and got
    429 after the queue timeout while "large" sat idle. Now it spills to "large" at once."""
    async with two_clusters(
        affinity_header="X-Session-ID",
        max_inflight_requests=1,
        queue_timeout_s=30,
        sim={"prefill_us_per_token": 4_000.0},  # 4 s for 1,000 tokens
    ) as (small, large, proxy):
        clusters = proxy.services.models.first.clusters
        key = next(
            k for k in (f"s{i}" for i in range(100)) if rendezvous(k, clusters).name == "small"
        )  # type: ignore[union-attr]
        before = await arrived(http, small)
        held = asyncio.ensure_future(post(http, proxy, 1_000, **{"X-Session-ID": key}))
        for _ in range(200):  # bounded: until prefill has it
            if await arrived(http, small) > before:
                break
            await asyncio.sleep(0.02)
        large_before = await arrived(http, large)
        status, _ = await post(http, proxy, 10, **{"X-Session-ID": key})
        # Served while the held one still runs (4 s of prefill): no wait for its budget.
        still_held = not held.done()
        spills = sample(
            proxy,
            "kvproxy_affinity_spills_total",
            model="default",
            upstream="small",
            reason="budget_full",
        )
        large_after = await arrived(http, large)
        held_status, _ = await held
    assert status == 200
    assert large_after - large_before == 1
    assert spills == 1
    assert held_status == 200
    assert still_held


async def test_disconnect_during_prefill_is_deferred_under_its_clusters_label(
    http: aiohttp.ClientSession,
) -> None:
    # Slow prefill (2 ms a token: 2 s for 1,000), so the client leaves while it runs; the
    # affinity header pins each request to a cluster (rendezvous over the two names).
    async with two_clusters(
        affinity_header="X-Session-ID", sim={"prefill_us_per_token": 2_000.0}
    ) as (small, large, proxy):
        clusters = proxy.services.models.first.clusters
        keys = {}
        for i in range(100):
            home = rendezvous(f"s{i}", clusters)
            assert home is not None
            keys.setdefault(home.name, f"s{i}")
        for name, sim in (("small", small), ("large", large)):
            before = await arrived(http, sim)
            task = asyncio.ensure_future(post(http, proxy, 1_000, **{"X-Session-ID": keys[name]}))
            for _ in range(200):  # bounded: until prefill has it
                if await arrived(http, sim) > before:
                    break
                await asyncio.sleep(0.02)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert await wait_until(lambda: proxy.state.inflight == 0, timeout_s=30)
        by_label = {
            c: (
                sum(
                    sample(proxy, "kvproxy_client_disconnects_total", phase=p, upstream=c)
                    for p in DISCONNECT_PHASES
                ),
                sum(
                    sample(proxy, "kvproxy_deferred_cancellations_total", outcome=o, upstream=c)
                    for o in DEFERRED_OUTCOMES
                ),
                sample(
                    proxy,
                    "kvproxy_routing_decisions_total",
                    model="default",
                    upstream=c,
                    reason="affinity",
                ),
            )
            for c in ("small", "large")
        }
        in_progress = sample(proxy, "kvproxy_deferred_cancellations_in_progress", upstream="small")
    assert by_label == {"small": (1, 1, 1), "large": (1, 1, 1)}
    assert in_progress == 0
