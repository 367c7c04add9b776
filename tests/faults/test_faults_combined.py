"""Faults combined: the router and Redis blackholed at once while two replicas sharing a
Redis budget run mixed traffic with disconnects during prefill; then a router reset while
the engine's admin endpoint is blackholed (capacity going stale under a reset).

The same ground truth as each fault alone: no over-commit, no early cancellation, no lease
leaked, nothing sent twice, every reply complete or an explicit failure within its
timeouts, the replicas back to idle and serving after the repair.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
from fault_report import ROWS, Row, baseline, judge_idle, judge_outcomes, judge_truth
from fault_stack import (
    DECODE_PORT,
    PROXY_ENV,
    REDIS_PORT,
    ROUTER_PORTS,
    Upstream,
    poll,
    start_proxy,
    stop_proxy,
)
from fault_traffic import Outcome, Progress, mix, probe_until_ok, wave

READ_S = float(PROXY_ENV["KVPROXY_UPSTREAM_READ_TIMEOUT_S"])
TTL_S = float(PROXY_ENV["KVPROXY_REDIS_LEASE_TTL_S"])
BUDGET = 6000
# The wave's own bound: queue (2 s) + prefill + decode, with the read timeout on top.
BOUND_S = 20.0


@pytest.mark.parametrize(
    "combo", ["router blackhole + Redis blackhole", "router reset + engine admin blackhole"]
)
async def test_combined(stack: Upstream, tmp_path: Path, combo: str) -> None:
    started = time.monotonic()
    await stack.quiet()
    await stack.reset()
    await stack.redis_flush()
    row = Row(combo, "prefill", "sim")
    tag = "combo-" + combo.split()[1]
    proxies = [
        await start_proxy(
            tmp_path,
            f"{tag}-{i}",
            "sim",
            budget_backend="redis",
            max_inflight_prompt_tokens=BUDGET,
            budget_expected_replicas=2,
        )
        for i in range(2)
    ]
    bases = [await baseline(p) for p in proxies]
    lab = stack.lab
    outcomes: list[Outcome] = []
    try:
        waves = [
            asyncio.ensure_future(
                wave(
                    p.public,
                    mix(random.Random(30 + i), 10, leave=0.2, prompt=(2000, 3000)),
                    30 + i,
                    BOUND_S + READ_S,
                    Progress(),
                    tag=f"{tag}-{i}",
                )
            )
            for i, p in enumerate(proxies)
        ]

        async def in_prefill() -> bool:
            return int((await stack.stats())["prefill"]["running"]) >= 2

        assert await poll(in_prefill, 20, 0.02), "traffic never reached prefill"
        t_fault = time.monotonic()
        if combo.startswith("router blackhole"):
            lab.blackhole("up", (ROUTER_PORTS["sim"],))
            lab.blackhole("redis", (REDIS_PORT,))
            await asyncio.sleep(READ_S + 1.0)
        else:
            lab.blackhole("up", (DECODE_PORT,))
            lab.reset("up", (ROUTER_PORTS["sim"],))
            await asyncio.sleep(2.0)
        lab.heal()
        t_heal = time.monotonic()
        for w in waves:
            outcomes += await w
        fails = [o for o in outcomes if o.kind == "failure" and o.ended >= t_fault
                 and not o.label.startswith(("400", "429"))]  # fmt: skip
        if fails:
            row.detect_s = min(o.ended for o in fails) - t_fault
        oks = [await probe_until_ok(p.public, 30) for p in proxies]
        if any(ok is None for ok in oks):
            row.violations.append("no complete answer within 30 s of the repair")
        else:
            row.recover_s = max(ok for ok in oks if ok is not None) - t_heal
        for p in proxies:
            assert await poll(p.idle, 30, 0.1), p.tail()

        async def clear() -> bool:
            return await stack.redis_state() == (0, 0, 0, 0)

        if not await poll(clear, 3 * TTL_S + 5, 0.1):
            row.violations.append(f"leases left in Redis: {await stack.redis_state()}")
        truth = await stack.quiet()
        peak = int(truth["prefill"].get("peak_prompt_tokens_in_flight", 0))
        row.note = f"engine peak {peak:,} of {BUDGET:,} tokens"
        if peak > BUDGET:
            row.violations.append(f"over-commit: the engines held {peak:,} > {BUDGET:,} tokens")
        judge_outcomes(row, outcomes, BOUND_S + READ_S)
        # A reset destroys the router's end (as in the router rows): its cancellations are
        # counted and explained, not kvproxy's.
        judge_truth(row, truth, 0, killed="reset" in combo)
        for p, b in zip(proxies, bases, strict=True):
            await judge_idle(row, p, b)
    finally:
        lab.heal()
        codes = [await stop_proxy(p) for p in proxies]
    row.violations += [f"kvproxy exited {c} on SIGTERM" for c in codes if c != 0]
    row.seconds = time.monotonic() - started
    ROWS.append(row)
    assert not row.violations, (row.fault, row.phase, row.violations, row.outcomes)
