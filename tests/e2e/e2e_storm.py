"""The disconnect storm: tenant A's clients leave mid-prefill or mid-transfer while tenant B
keeps sending, and what it must show when kvproxy is in front.

Shared by the deferred-cancellation suite (the sim's own PD router) and the real-router
suite, so both run the very same seeded storm with and without kvproxy.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from e2e_stack import (
    CHAT,
    COMPLETIONS,
    TENANT_A,
    TENANT_B,
    body_for,
    deferred_by_outcome,
    disconnect_after,
    disconnects_by_phase,
    get_json,
    leak_counters,
    poll,
    post,
    sample,
    tenant_headers,
    tenant_prompt,
)

from kvproxy.serve.app import KvproxyServer
from kvproxy.sim import SimCluster


@dataclass
class StormResult:
    victims_cut: int = 0  # victims that left while their response was still open
    # Where each cut victim was aimed to leave (prefill or transfer); where it really left is
    # what kvproxy recorded (kvproxy_client_disconnects_total{phase}).
    phases: Counter[str] = field(default_factory=Counter)
    other_statuses: Counter[int] = field(default_factory=Counter)
    other_replies: int = 0
    foreign_replies: int = 0  # the other tenant's replies carrying the victim tenant's marker


async def disconnect_storm(
    http: aiohttp.ClientSession,
    target: str,
    sim: SimCluster,
    *,
    victims: int,
    seed: int,
    victim_bytes: int = 2000,
    other_bytes: tuple[int, int] = (150, 400),
    other_lanes: int = 2,
) -> StormResult:
    """Tenant A's streaming requests leave at seeded random points during prefill or the KV
    transfer, one after another, while tenant B keeps sending (``other_lanes`` at a time,
    plus one request right behind each victim) and its replies are scanned for A's markers.

    When to leave is gated on ground truth: decode has reserved the victim's pages (so
    prefill is computing), then a seeded delay drawn from the sim's own physics places the
    exit inside the compute time ("prefill") or inside the transfer ("transfer")."""
    rng = random.Random(seed)
    opts = sim.opts
    result = StormResult()
    stop = asyncio.Event()
    # The byte template adds "<|user|>\n", "\n<|assistant|>\n": a few dozen tokens.
    victim_tokens = victim_bytes + 24
    victim_pages = -(-victim_tokens // opts.page_size)
    compute_s = victim_tokens * opts.prefill_us_per_token / 1e6
    transfer_s = victim_pages * opts.transfer_ms_per_page / 1e3

    async def other_request(rng: random.Random) -> None:
        path = rng.choice((CHAT, CHAT, COMPLETIONS))
        prompt = tenant_prompt(TENANT_B, rng.randint(*other_bytes), rng)
        body = body_for(path, prompt, stream=rng.random() < 0.5, max_tokens=1024)
        reply = await post(http, target, path, body, tenant_headers(TENANT_B))
        result.other_replies += 1
        result.other_statuses[reply.status] += 1
        if TENANT_A in reply.foreign(TENANT_B):
            result.foreign_replies += 1

    async def other_lane(lane: int) -> None:
        lane_rng = random.Random(seed * 1000 + lane)
        while not stop.is_set():
            await other_request(lane_rng)

    async def decode_allocated() -> int:
        stats = await get_json(http, sim.decode_url + "/sim/stats")
        return int(stats["pages_allocated"])

    lanes = [asyncio.ensure_future(other_lane(i)) for i in range(other_lanes)]
    followers: list[asyncio.Future[None]] = []
    try:
        for _ in range(victims):
            phase = rng.choice(("prefill", "transfer"))
            if phase == "prefill":
                delay = rng.uniform(0.0, 0.9 * compute_s)
            else:
                delay = compute_s + rng.uniform(0.05, 0.9) * transfer_s
            before = await decode_allocated()

            async def gate(before: int = before, delay: float = delay) -> None:
                async def reserved() -> bool:
                    return await decode_allocated() >= before + victim_pages

                assert await poll(reserved), "decode never reserved the victim's pages"
                await asyncio.sleep(delay)

            prompt = tenant_prompt(TENANT_A, victim_bytes, rng)
            # A long reply (~0.5 s of decode): the exit comes long before it could end, so a
            # late gate on a loaded machine still cuts a live response.
            body = body_for(CHAT, prompt, stream=True, max_tokens=512)
            if await disconnect_after(http, target, body, tenant_headers(TENANT_A), gate):
                result.victims_cut += 1
                result.phases[phase] += 1
            # Tenant B right behind: the request that receives whatever pages the victim
            # gave up (the pool hands out the most recently freed pages first).
            followers.append(asyncio.ensure_future(other_request(rng)))
    finally:
        stop.set()
        await asyncio.gather(*lanes, *followers)
    return result


def assert_storm_contained(
    proxy: KvproxyServer, storm: StormResult, truth: dict[str, Any], victims: int
) -> None:
    """What the storm must show through kvproxy: no leak by ground truth or by marker, and
    every disconnect accounted as a drain that ended at a safe point.

    Nothing here depends on where each exit landed: the storm aims its exits at prefill and
    at the transfer, but on a loaded machine a client can leave after its first token has
    arrived. Every phase kvproxy recorded must be safe, so the properties are asserted for
    all of them, whatever the mix (the mix is in the assertion messages, for the reader)."""
    leaks = leak_counters(truth)
    outcomes = deferred_by_outcome(proxy)
    phases = disconnects_by_phase(proxy)
    # A victim whose whole response ended before its exit was not cut and is not a
    # disconnect; the storm counts only the ones it did cut.
    assert 0 < storm.victims_cut <= victims, storm
    assert storm.foreign_replies == 0
    assert set(storm.other_statuses) == {200}, storm.other_statuses
    assert leaks == dict.fromkeys(leaks, 0), leaks
    assert sample(proxy, "kvproxy_canary_violations_total", tenant=TENANT_B) == 0
    # Every client that left was seen once, in whatever phase it left, and each drain ended
    # at a safe point: decode's first token, or the response's end. None timed out, none
    # was cut early, none is still open.
    assert sum(phases.values()) == storm.victims_cut, (phases, storm.phases)
    assert sum(outcomes.values()) == storm.victims_cut, (outcomes, phases)
    assert outcomes["first_token"] + outcomes["completed"] == storm.victims_cut, outcomes
    assert sample(proxy, "kvproxy_deferred_cancellations_in_progress") == 0
    # Decode received every transfer it started: nothing was cut mid-way.
    assert truth["decode"]["transfers_completed"] == truth["decode"]["transfers_started"]
