"""A blackhole between kvproxy and Redis under `budget_backend: redis`: two replicas in front
of the same engines share one budget; Redis goes silent (no FIN, no RST) for less and for
more than the lease TTL, under each `redis_unavailable` policy, while long streams and
bursts run.

What must hold (ground truth): the engines never held more prompt tokens at once than the
budget (the simulator's peak); no lease is leaked (Redis's own usage and lease sets are
empty once traffic ended, within the lease TTL and its grace); every reply complete or an
explicit failure within its timeouts; replicas back to `ok` after the repair.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from pathlib import Path

import pytest
from fault_report import ROWS, Row, baseline, judge_idle, judge_outcomes, judge_truth
from fault_stack import PROXY_ENV, REDIS_PORT, Proxy, Upstream, poll, start_proxy, stop_proxy
from fault_traffic import Progress, mix, probe_until_ok, wave

TTL_S = float(PROXY_ENV["KVPROXY_REDIS_LEASE_TTL_S"])
BUDGET = 6000
BOUND_S = 20.0
REPLICA_SETTINGS = {
    "budget_backend": "redis",
    "max_inflight_prompt_tokens": BUDGET,
    "budget_expected_replicas": 2,
}


async def budget_state(proxy: Proxy) -> str:
    return str((await proxy.capacity())["budget"]["state"])


async def watch_states(proxies: list[Proxy], log: list[tuple[float, str, str]]) -> None:
    """Record every change of each replica's budget state (bounded by cancellation)."""
    last: dict[str, str] = {}
    while True:
        for p in proxies:
            with contextlib.suppress(Exception):
                st = await budget_state(p)
                if last.get(p.name) != st:
                    last[p.name] = st
                    log.append((time.monotonic(), p.name, st))
        await asyncio.sleep(0.05)


async def redis_clear(stack: Upstream, timeout_s: float) -> bool:
    async def clear() -> bool:
        return await stack.redis_state() == (0, 0, 0, 0)

    return await poll(clear, timeout_s, 0.1)


@pytest.mark.parametrize("policy", ["local_share", "reject"])
@pytest.mark.parametrize("outage", ["shorter than TTL", "longer than TTL"])
async def test_redis_blackhole(stack: Upstream, tmp_path: Path, policy: str, outage: str) -> None:
    started = time.monotonic()
    await stack.quiet()
    await stack.reset()
    await stack.redis_flush()
    outage_s = TTL_S / 2 if outage.startswith("shorter") else TTL_S * 2
    row = Row("blackhole Redis", f"{policy}, {outage_s:g} s ({outage})", "sim")
    tag = f"redis-{policy}-{outage_s:g}"
    proxies = [
        await start_proxy(
            tmp_path, f"{tag}-{i}", "sim", redis_unavailable=policy, **REPLICA_SETTINGS
        )
        for i in range(2)
    ]
    bases = [await baseline(p) for p in proxies]
    states: list[tuple[float, str, str]] = []
    watcher = asyncio.ensure_future(watch_states(proxies, states))
    lab = stack.lab
    outcomes = []
    try:
        # Long streams hold budget across the outage; bursts come during and after it.
        rng = random.Random(hash(tag) % 1000)
        specs = [
            mix(
                random.Random(rng.random()),
                12,
                leave=0.1,
                prompt=(1500, 2500),
                max_tokens=(150, 300),
            )
            for _ in proxies
        ]
        holders = [
            asyncio.ensure_future(wave(p.public, s, i, BOUND_S, Progress(), tag=f"{tag}-hold-{i}"))
            for i, (p, s) in enumerate(zip(proxies, specs, strict=True))
        ]

        async def leased() -> bool:
            return (await stack.redis_usage())[0] > 0

        assert await poll(leased, 20, 0.05), "no lease was ever taken"
        t_fault = time.monotonic()
        lab.blackhole("redis", (REDIS_PORT,))
        bursts = [
            asyncio.ensure_future(
                wave(
                    p.public,
                    mix(random.Random(i), 8, leave=0.1),
                    100 + i,
                    BOUND_S,
                    Progress(),
                    spread_s=outage_s,
                    tag=f"{tag}-during-{i}",
                )
            )
            for i, p in enumerate(proxies)
        ]
        await asyncio.sleep(outage_s)
        lab.heal("redis")
        t_heal = time.monotonic()
        for fut in [*holders, *bursts]:
            outcomes += await fut
        after = [
            await wave(
                p.public,
                mix(random.Random(50 + i), 6),
                200 + i,
                BOUND_S,
                Progress(),
                tag=f"{tag}-after-{i}",
            )
            for i, p in enumerate(proxies)
        ]
        for got in after:
            outcomes += got
        for p in proxies:
            assert await poll(p.idle, 30, 0.1), p.tail()

        # Back to ok on every replica, and every lease given back (or expired: TTL + grace).
        async def all_ok() -> bool:
            return all([await budget_state(p) == "ok" for p in proxies])

        if not await poll(all_ok, 30, 0.1):
            row.violations.append("a replica's budget never came back to ok")
        degraded = [t for t, _, st in states if st != "ok" and t >= t_fault]
        if degraded:
            row.detect_s = min(degraded) - t_fault
        oks = [t for t, _, st in states if st == "ok" and t >= t_heal]
        if oks:
            row.recover_s = max(oks) - t_heal
        if not await redis_clear(stack, 3 * TTL_S + 5):
            row.violations.append(
                f"leases left in Redis after traffic: {await stack.redis_state()}"
            )
        truth = await stack.quiet()
        peak = int(truth["prefill"].get("peak_prompt_tokens_in_flight", 0))
        row.note = f"engine peak {peak:,} of {BUDGET:,} tokens"
        if peak > BUDGET:
            row.violations.append(f"over-commit: the engines held {peak:,} > {BUDGET:,} tokens")
        judge_outcomes(row, outcomes, BOUND_S)
        judge_truth(row, truth, 0)
        for p in proxies:
            if await probe_until_ok(p.public, 20) is None:
                row.violations.append(f"{p.name}: no complete answer after the repair")
        for p, b in zip(proxies, bases, strict=True):
            await judge_idle(row, p, b)
    finally:
        lab.heal()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        codes = [await stop_proxy(p) for p in proxies]
    row.violations += [f"kvproxy exited {c} on SIGTERM" for c in codes if c != 0]
    row.seconds = time.monotonic() - started
    ROWS.append(row)
    assert not row.violations, (row.fault, row.phase, row.violations, row.outcomes)
