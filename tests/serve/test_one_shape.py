"""One config shape at run time: a single upstream is a model of one cluster, run by the same
code as a gateway model (kvproxy.serve.handler's admit and pick_cluster, the balancer,
outlier detection). What a lone cluster does differently is data of the shape, never a
branch on the count: these tests hold the single-upstream form and a one-cluster `upstreams`
form to the same decisions, replies and metrics, through the running proxy, with the
simulator's own /sim/stats as ground truth.

Where the two forms differ on purpose (kept byte-for-byte): /capacity and the capacity-unknown
message are shaped by the form (a gateway model lists its clusters), not by the count.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from ports import free_port

from kvproxy.config import load_settings
from kvproxy.observe import Metrics
from kvproxy.serve.app import KvproxyServer
from kvproxy.sim.launcher import SimCluster, SimOptions

COMPLETIONS = "/v1/completions"
AFFINITY = "X-Session-ID"


def engines_of(sim: SimCluster) -> list[dict[str, Any]]:
    return [
        {"url": sim.prefill_url, "role": "prefill", "kind": "sglang"},
        {"url": sim.decode_url, "role": "decode", "kind": "sglang"},
    ]


@contextlib.asynccontextmanager
async def proxy_for(
    sim: SimCluster, form: str, router: str | None = None, **overrides: Any
) -> AsyncIterator[KvproxyServer]:
    """kvproxy in front of `sim`, configured in `form`: "single" (upstream + engines) or
    "upstreams" (one cluster, named as the implicit one so the metric labels match)."""
    url = router or sim.router_url
    if form == "single":
        shape: dict[str, Any] = {"upstream": url, "engines": engines_of(sim)}
    else:
        shape = {"upstreams": [{"name": "default", "url": url, "engines": engines_of(sim)}]}
    settings = load_settings(
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        access_log=False,
        affinity_header=AFFINITY,
        **shape,
        **overrides,
    )
    proxy = KvproxyServer(settings, Metrics())
    await proxy.start()
    try:
        for c in proxy.services.models.first.clusters:
            await c.capacity.refresh_now()
        yield proxy
    finally:
        await proxy.stop()


async def post(
    http: aiohttp.ClientSession, proxy: KvproxyServer, n: int, **headers: str
) -> tuple[int, dict[str, str], bytes]:
    body = {"model": "m", "prompt": [65] * n, "max_tokens": 1}
    async with http.post(proxy.public_url + COMPLETIONS, json=body, headers=headers) as resp:
        kept = {k: v for k, v in resp.headers.items() if k.startswith("X-Kvproxy")}
        body = await resp.read()
        # A completion carries its own id and time; kvproxy's own replies are compared whole.
        return resp.status, kept, b"(completion)" if resp.status == 200 else body


def sample(proxy: KvproxyServer, name: str, **labels: str) -> float:
    value = proxy.metrics.registry.get_sample_value(name, {"model": "default", **labels})
    return value or 0.0


def routing(proxy: KvproxyServer) -> dict[str, float]:
    return {
        reason: sample(proxy, "kvproxy_routing_decisions_total", upstream="default", reason=reason)
        for reason in ("fit", "affinity", "retry")
    }


async def arrived(http: aiohttp.ClientSession, sim: SimCluster) -> int:
    async with http.get(sim.router_url + "/sim/stats") as resp:
        stats = await resp.json()
    return int(sum(stats["prefill"]["requests_by_route"].values()))


async def test_a_single_upstream_and_one_named_cluster_decide_and_reply_alike(
    http: aiohttp.ClientSession,
) -> None:
    """Admitted (with an affinity key: a lone cluster is picked by fit, there is nothing to
    keep the key from) and refused over the limit (the same 400 body, sent nowhere)."""
    opts = SimOptions(port=0, prefill_port=0, decode_port=0, prefill_pool_tokens=5_322)
    seen: dict[str, Any] = {}
    async with SimCluster(opts) as sim:
        for form in ("single", "upstreams"):
            async with proxy_for(sim, form) as proxy:
                limit = proxy.services.models.first.clusters[0].limits().admission_limit_tokens
                assert limit is not None
                before = await arrived(http, sim)
                replies = [
                    await post(http, proxy, 1_000, **{AFFINITY: "conversation-1"}),
                    await post(http, proxy, limit),
                    await post(http, proxy, limit + 1, **{AFFINITY: "conversation-1"}),
                ]
                reached = await arrived(http, sim) - before
                seen[form] = (replies, reached, routing(proxy))
    single, named = seen["single"], seen["upstreams"]
    assert single == named
    replies, reached, reasons = single
    assert [status for status, _, _ in replies] == [200, 200, 400]
    assert b"context_length_exceeded" in replies[2][2]
    assert reached == 2  # the refusal reached nothing (I7)
    assert reasons == {"fit": 2, "affinity": 0, "retry": 0}


async def test_a_lone_cluster_whose_router_refuses_is_neither_retried_nor_ejected(
    http: aiohttp.ClientSession,
) -> None:
    """Its engines measured, its router gone: each request fails once with the same reply
    in both forms; there is no other cluster to move it to, and outlier detection has
    nothing to eject the cluster in favour of (no ejection, none reported as capped), so it
    keeps being tried: the router may come back."""
    opts = SimOptions(port=0, prefill_port=0, decode_port=0, prefill_pool_tokens=5_322)
    dead = f"http://127.0.0.1:{free_port()}"
    seen: dict[str, Any] = {}
    async with SimCluster(opts) as sim:
        for form in ("single", "upstreams"):
            async with proxy_for(sim, form, router=dead, upstream_eject_s=60) as proxy:
                # Past `upstream_outlier_consecutive` (5) connect failures in a row.
                replies = [await post(http, proxy, 100) for _ in range(7)]
                metrics = {
                    "connect": sample(
                        proxy, "kvproxy_upstream_outcomes_total", upstream="default",
                        outcome="connect",
                    ),
                    "ejected": sample(proxy, "kvproxy_upstream_ejected", upstream="default"),
                    "ejections": sum(
                        sample(proxy, name, upstream="default", cause="connect")
                        for name in (
                            "kvproxy_upstream_ejections_total",
                            "kvproxy_upstream_ejections_capped_total",
                        )
                    ),
                    **routing(proxy),
                }  # fmt: skip
                seen[form] = (replies, metrics)
    assert seen["single"] == seen["upstreams"]
    replies, metrics = seen["single"]
    assert {status for status, _, _ in replies} == {502}
    assert len({body for _, _, body in replies}) == 1
    assert metrics == {
        "connect": 7,  # one attempt each: nothing to move to
        "ejected": 0,
        "ejections": 0,
        "fit": 7,
        "affinity": 0,
        "retry": 0,
    }
