"""kvproxy in front of the real router, ``smg`` 1.13.0 (PyPI, Rust; the successor of
``sglang-router``) in PD mode, in front of the simulator's prefill and decode servers:
software nobody here wrote, between us and the oracle.

Shows: every route and mode passes through intact; a rejection never reaches the router
(its own Prometheus counters and the sim's ground truth agree); a client leaving during
prefill: smg 1.13 lets prefill run to the end and aborts decode after the transfer (as
measured; sglang-router 0.3.2 cut both legs), and kvproxy in front changes nothing unsafe;
the disconnect storm does not leak through kvproxy and smg. One legacy test keeps the
evidence that the storm leaks through a router that cuts prefill (sglang-router 0.3.2).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from e2e_stack import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    TENANT_A,
    body_for,
    deferred_by_outcome,
    disconnect_after,
    drains_over,
    get_json,
    leak_counters,
    parse_prometheus,
    poll,
    post,
    proxy_for,
    sample,
    scrape,
    sim_cluster,
    sim_quiet,
    sim_stats,
    tenant_headers,
    tenant_prompt,
)
from e2e_storm import assert_storm_contained, disconnect_storm
from real_router import RealRouter, legacy_router, real_router

from kvproxy.sim import SimCluster

pytestmark = [pytest.mark.slow, pytest.mark.router]

ROUTES = (CHAT, COMPLETIONS, GENERATE)


async def router_requests(http: aiohttp.ClientSession, router: RealRouter) -> dict[str, float]:
    """Requests the router itself counted, by path (``smg_http_requests_total``)."""
    samples = parse_prometheus(await scrape(http, router.metrics_url))
    out: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name == "smg_http_requests_total":
            path = dict(labels).get("path", "")
            out[path] = out.get(path, 0.0) + value
    return out


async def test_every_route_and_mode_passes_through(tmp_path: Path) -> None:
    rng = random.Random(11)
    async with (
        sim_cluster(mode="fixed") as sim,
        real_router(sim, tmp_path / "router.log") as router,
        proxy_for(sim, router.url) as proxy,
        aiohttp.ClientSession() as http,
    ):
        before = await router_requests(http, router)
        for path in ROUTES:
            for stream in (False, True):
                prompt = tenant_prompt(TENANT_A, rng.randint(100, 600), rng)
                body = body_for(path, prompt, stream=stream, max_tokens=2048)
                reply = await post(http, proxy.public_url, path, body, tenant_headers(TENANT_A))
                assert reply.status == 200, (path, stream, reply.status, reply.error)
                assert reply.headers["X-Kvproxy-Decision"] == "admitted"
                assert int(reply.headers["X-Kvproxy-Prompt-Tokens"]) >= len(prompt)
                assert reply.done, (path, stream)
                assert reply.error is None, (path, stream)
                # The echo model replies with the prompt read back from decode's pages.
                assert prompt in reply.text, (path, stream, len(reply.text))
        after = await router_requests(http, router)
        truth = await sim_stats(http, sim)
    for path in ROUTES:
        assert after.get(path, 0) - before.get(path, 0) == 2, (path, before, after)
        assert truth["prefill"]["requests_by_route"].get(path) == 2
        assert truth["decode"]["requests_by_route"].get(path) == 2
    assert truth["decode"]["transfers_completed"] == 6
    assert leak_counters(truth) == dict.fromkeys(leak_counters(truth), 0)


async def test_rejections_never_reach_the_router(tmp_path: Path) -> None:
    """Over-long prompts (past prefill's measured pool) and over-long outputs (past decode's
    pool) are refused by kvproxy with a 400, in vulnerable mode where the engine itself
    would have run the incident. The router's own counters do not move."""
    rng = random.Random(12)
    async with (
        sim_cluster(mode="vulnerable") as sim,
        real_router(sim, tmp_path / "router.log") as router,
        proxy_for(sim, router.url) as proxy,
        aiohttp.ClientSession() as http,
    ):
        limit = int(sample(proxy, "kvproxy_admission_limit_tokens"))
        assert 0 < limit < sim.opts.context_length  # the pool, not the context, binds
        before_router = await router_requests(http, router)
        before_sim = await sim_stats(http, sim)
        replies: list[tuple[str, Any]] = []
        for path in ROUTES:
            for stream in (False, True):
                long_prompt = tenant_prompt(TENANT_A, limit + 1 + rng.randint(0, 2000), rng)
                body = body_for(path, long_prompt, stream=stream, max_tokens=8)
                replies.append((path, await post(http, proxy.public_url, path, body)))
                short = tenant_prompt(TENANT_A, 200, rng)
                body = body_for(path, short, stream=stream, max_tokens=sim.opts.decode_pool_tokens)
                replies.append((path, await post(http, proxy.public_url, path, body)))
        after_router = await router_requests(http, router)
        after_sim = await sim_stats(http, sim)
    for path, reply in replies:
        assert reply.status == 400, (path, reply.status)
        assert reply.headers["X-Kvproxy-Decision"] == "rejected"
        assert reply.error is not None
        assert reply.headers["X-Kvproxy-Error-Code"] == "context_length_exceeded"
        if path == GENERATE:
            assert list(reply.error) == ["error"]  # SGLang's native shape
        else:
            assert reply.error["error"]["code"] == "context_length_exceeded"
            assert reply.error["error"]["type"] == "invalid_request_error"
    assert sample(proxy, "kvproxy_rejections_total", reason="context_length") == 6
    assert sample(proxy, "kvproxy_rejections_total", reason="decode_budget") == 6
    # Nothing reached the router, so nothing reached an engine either (I7).
    assert after_router == before_router
    for role in ("prefill", "decode"):
        assert after_sim[role]["requests_by_route"] == before_sim[role]["requests_by_route"]
        assert after_sim[role]["pending_rejections"] == 0
        assert after_sim[role]["pages_allocated"] == before_sim[role]["pages_allocated"]


# --- disconnects during prefill: the router's behaviour with and without kvproxy ---------------

LEAVERS = 4
# ~1 s of prefill compute for a 2,024-token prompt: a wide, certain window to leave in.
SLOW_PREFILL: dict[str, Any] = {"mode": "vulnerable", "prefill_us_per_token": 500.0}


async def _leave_during_prefill(http: aiohttp.ClientSession, target: str, sim: SimCluster) -> int:
    """``LEAVERS`` clients, one at a time, each leaving once decode has reserved its pages
    (prefill is computing) and well before the compute can end."""
    rng = random.Random(21)
    cut = 0
    for _ in range(LEAVERS):
        allocated = (await get_json(http, sim.decode_url + "/sim/stats"))["pages_allocated"]

        async def gate(before: int = allocated) -> None:
            async def reserved() -> bool:
                stats = await get_json(http, sim.decode_url + "/sim/stats")
                return bool(stats["pages_allocated"] > before)

            assert await poll(reserved), "decode never reserved the pages"

        # A long reply (~0.5 s of decode): whoever cuts decode does it mid-reply, whatever the
        # machine's load, rather than racing a 16 ms stream to its end.
        body = body_for(CHAT, tenant_prompt(TENANT_A, 2000, rng), stream=True, max_tokens=512)
        cut += await disconnect_after(http, target, body, tenant_headers(TENANT_A), gate)
    return cut


async def test_prefill_disconnect_smg_lets_prefill_finish_and_so_does_kvproxy(
    tmp_path: Path,
) -> None:
    async with sim_cluster(**SLOW_PREFILL) as sim, aiohttp.ClientSession() as http:
        async with real_router(sim, tmp_path / "router.log") as router:
            # Without kvproxy: smg 1.13 keeps prefill running after the client left.
            assert await _leave_during_prefill(http, router.url, sim) == LEAVERS
            bare = await sim_quiet(http, sim)
            async with http.post(sim.router_url + "/sim/reset") as resp:
                assert resp.status == 200
            # The same run through kvproxy.
            async with proxy_for(sim, router.url) as proxy:
                assert await _leave_during_prefill(http, proxy.public_url, sim) == LEAVERS
                await drains_over(proxy, LEAVERS)
                outcomes = deferred_by_outcome(proxy)
            proxied = await sim_quiet(http, sim)
    # Bare smg 1.13 (measured): prefill is never aborted, every transfer completes, and decode
    # is aborted only afterwards. sglang-router 0.3.2 aborted both legs mid-prefill here.
    assert bare["prefill"]["aborts"] == 0, bare["prefill"]
    assert bare["decode"]["transfers_completed"] == LEAVERS, bare["decode"]
    assert bare["decode"]["aborts"] == LEAVERS, bare["decode"]
    assert leak_counters(bare) == dict.fromkeys(leak_counters(bare), 0)
    # Through kvproxy: prefill ran to the end and every transfer completed before the
    # upstream was closed at decode's first token.
    assert proxied["prefill"]["aborts"] == 0, proxied["prefill"]
    assert proxied["decode"]["transfers_completed"] == LEAVERS
    assert proxied["prefill"]["transfers_completed"] == LEAVERS
    # Each drain ended at a safe point (decode's first token, or the reply's end).
    assert outcomes["first_token"] + outcomes["completed"] == LEAVERS, outcomes
    assert leak_counters(proxied) == dict.fromkeys(leak_counters(proxied), 0)


# --- the disconnect storm through the real router --------------------------------------------

VICTIMS = 40
SEED = 7
# As in the sim-router storm: ~0.3 s of prefill and ~0.25 s of transfer per victim.
STORM_SIM: dict[str, Any] = {
    "mode": "vulnerable",
    "prefill_us_per_token": 150.0,
    "transfer_ms_per_page": 2.0,
}


async def test_legacy_router_cuts_both_legs_and_the_storm_leaks_through_it(
    tmp_path: Path,
) -> None:
    """sglang-router 0.3.2 (January 2026), the one legacy test: it closes prefill and decode
    while prefill computes, so the storm leaks through it. Evidence that the storm has teeth
    against a router that cuts the dangerous window, which smg 1.13 no longer does."""
    async with sim_cluster(**SLOW_PREFILL) as sim, aiohttp.ClientSession() as http:
        async with legacy_router(sim, tmp_path / "router.log") as router:
            assert await _leave_during_prefill(http, router.url, sim) == LEAVERS
            bare = await sim_quiet(http, sim)
    assert bare["prefill"]["aborts"] == LEAVERS, bare["prefill"]
    assert bare["decode"]["aborts"] == LEAVERS
    assert bare["decode"]["transfers_completed"] == 0
    async with (
        sim_cluster(**STORM_SIM) as sim,
        legacy_router(sim, tmp_path / "legacy-storm.log") as router,
        aiohttp.ClientSession() as http,
    ):
        storm = await disconnect_storm(http, router.url, sim, victims=VICTIMS, seed=SEED)
        truth = await sim_quiet(http, sim)
    leaks = leak_counters(truth)
    assert 0 < storm.victims_cut <= VICTIMS
    assert leaks["late_writes_into_reallocated_pages"] > 0, leaks
    assert storm.foreign_replies > 0, (storm.other_replies, leaks)


async def test_storm_through_kvproxy_and_the_router_does_not_leak(tmp_path: Path) -> None:
    async with (
        sim_cluster(**STORM_SIM) as sim,
        real_router(sim, tmp_path / "router.log") as router,
        proxy_for(sim, router.url) as proxy,
    ):
        async with aiohttp.ClientSession() as http:
            storm = await disconnect_storm(http, proxy.public_url, sim, victims=VICTIMS, seed=SEED)
            await drains_over(proxy, storm.victims_cut)
            truth = await sim_quiet(http, sim)
        assert_storm_contained(proxy, storm, truth, VICTIMS)
