"""Deferred cancellation end to end against the vulnerable simulator (free-on-abort on).

The same seeded storm runs twice: tenant A's clients leave during prefill or during the KV
transfer while tenant B keeps sending. Straight at the sim's PD router the leak happens
(decode frees pages that prefill is still writing; B reads A's markers). Through kvproxy
the upstream is held until decode has the KV, so the ground truth stays clean, and the
deferred-cancellation metrics account for every disconnect the proxy saw.
"""

from __future__ import annotations

import aiohttp
from e2e_stack import (
    TENANT_B,
    deferred_by_outcome,
    disconnect_storm,
    disconnects_by_phase,
    leak_counters,
    poll,
    proxy_for,
    sample,
    sim_cluster,
    sim_quiet,
)

from kvproxy.app import KvproxyServer

VICTIMS = 40
SEED = 5
# 2,024-token victims: ~80 ms of prefill, 127 pages landing ~0.25 s after they are issued.
SIM = {"mode": "vulnerable", "transfer_ms_per_page": 2.0}


async def test_direct_to_the_vulnerable_sim_leaks() -> None:
    """The control: the storm is able to see a leak when nothing defers the cancel."""
    async with sim_cluster(**SIM) as sim, aiohttp.ClientSession() as http:
        storm = await disconnect_storm(http, sim.router_url, sim, victims=VICTIMS, seed=SEED)
        truth = await sim_quiet(http, sim)
    leaks = leak_counters(truth)
    assert storm.victims_cut == VICTIMS
    assert set(storm.phases) == {"prefill", "transfer"}
    assert truth["router"]["client_disconnects"] >= VICTIMS
    assert leaks["late_writes_into_reallocated_pages"] > 0, leaks
    assert storm.foreign_replies > 0, (storm.other_replies, leaks)


async def test_through_kvproxy_the_same_storm_does_not_leak() -> None:
    async with sim_cluster(**SIM) as sim, proxy_for(sim) as proxy:
        async with aiohttp.ClientSession() as http:
            storm = await disconnect_storm(http, proxy.public_url, sim, victims=VICTIMS, seed=SEED)
            await _drains_over(proxy)
            truth = await sim_quiet(http, sim)
        leaks = leak_counters(truth)
        outcomes = deferred_by_outcome(proxy)
        phases = disconnects_by_phase(proxy)
        assert storm.victims_cut == VICTIMS
        assert storm.foreign_replies == 0
        assert set(storm.other_statuses) == {200}, storm.other_statuses
        assert leaks == dict.fromkeys(leaks, 0), leaks
        assert sample(proxy, "kvproxy_canary_violations_total", tenant=TENANT_B) == 0
        # Every client that left was seen, and every one of them was deferred to a safe
        # point: the transfer ended (first token) or the response did. None by timeout.
        assert sum(phases.values()) == VICTIMS, phases
        assert phases["streaming"] == 0, phases  # all left before their first token
        assert sum(outcomes.values()) == VICTIMS, outcomes
        assert outcomes["first_token"] + outcomes["completed"] == VICTIMS, outcomes
        assert sample(proxy, "kvproxy_deferred_cancellations_in_progress") == 0
        # The engines never saw an abort before decode had the KV: every victim's transfer
        # completed, and prefill was never cut.
        assert truth["prefill"]["aborts"] == 0, truth["prefill"]["aborts"]
        assert truth["decode"]["transfers_completed"] == truth["decode"]["transfers_started"]


async def _drains_over(proxy: KvproxyServer) -> None:
    async def settled() -> bool:
        seen = sum(disconnects_by_phase(proxy).values())
        ended = sum(deferred_by_outcome(proxy).values())
        return (
            seen >= VICTIMS
            and ended == seen
            and sample(proxy, "kvproxy_deferred_cancellations_in_progress") == 0
            and proxy.state.inflight == 0
        )

    assert await poll(settled, timeout_s=30.0, interval_s=0.02), (
        disconnects_by_phase(proxy),
        deferred_by_outcome(proxy),
    )
