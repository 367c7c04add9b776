"""kvproxy killed while it holds deferred cancellations: two replicas sharing a Redis budget,
clients that leave during a long prefill on the doomed one (their upstreams are held until
the first token, I5), then SIGKILL or SIGTERM.

SIGKILL: nothing in a killed process can hold a connection open, so the kernel closes its
upstream sockets and the router cancels those requests, some while their KV transfer is
still writing: the simulator counts them (`aborts_before_drain`), the report shows them as
early cancellations (not violations; docs/operating.md "Faults" says what protects that
case). Time to recover is how long until the survivor has the killed replica's budget back
(Redis usage back to zero: its leases expire after the TTL).

SIGTERM: the replica stops accepting, drains everything it holds within the grace period
and exits 0; no early cancellation; its leases are released, not left to expire.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

import pytest
from fault_report import ROWS, Row, baseline, judge_idle, judge_outcomes, judge_truth
from fault_stack import PROXY_ENV, Proxy, Upstream, poll, start_proxy, stop_proxy
from fault_traffic import CHAT, TENANTS, Progress, Spec, mix, wave

TTL_S = float(PROXY_ENV["KVPROXY_REDIS_LEASE_TTL_S"])
GRACE_S = float(PROXY_ENV["KVPROXY_SHUTDOWN_GRACE_S"])
BUDGET = 40000
BOUND_S = 20.0
SETTINGS = {
    "budget_backend": "redis",
    "max_inflight_prompt_tokens": BUDGET,
    "budget_expected_replicas": 2,
}


def leavers(n: int, rng: random.Random) -> list[Spec]:
    """Streams with a long prefill (6,000-7,500 tokens at 0.15 ms each: about a second) whose
    clients leave during it: each is held by kvproxy until its first token."""
    return [
        Spec(CHAT, True, rng.randint(6000, 7500), 60, TENANTS[i % 2], rng.uniform(0.2, 0.4))
        for i in range(n)
    ]


async def deferring(proxy: Proxy) -> float:
    return await proxy.metric("kvproxy_deferred_cancellations_in_progress")


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
async def test_kill_while_deferring(stack: Upstream, tmp_path: Path, sig: str) -> None:
    started = time.monotonic()
    await stack.quiet()
    await stack.reset()
    await stack.redis_flush()
    row = Row(sig, "while deferring (2 replicas, redis budget)", "sim")
    doomed = await start_proxy(tmp_path, f"{sig}-doomed", "sim", **SETTINGS)
    survivor = await start_proxy(tmp_path, f"{sig}-survivor", "sim", **SETTINGS)
    base = await baseline(survivor)
    killed = sig == "SIGKILL"
    outcomes = []
    try:
        rng = random.Random(11)
        doomed_wave = asyncio.ensure_future(
            wave(doomed.public, leavers(6, rng), 1, BOUND_S, Progress(), spread_s=0.2, tag=sig)
        )
        survivor_wave = asyncio.ensure_future(
            wave(
                survivor.public,
                mix(rng, 10),
                2,
                BOUND_S,
                Progress(),
                spread_s=3.0,
                tag=f"{sig}-survivor",
            )
        )

        async def holding() -> bool:
            return await deferring(doomed) >= 2

        if not await poll(holding, 20, 0.02):
            m = await doomed.metrics()
            seen = {k: v for k, v in m.items() if "deferred" in k or "disconnect" in k
                    or k.startswith(("kvproxy_requests_total", "kvproxy_rejections"))}  # fmt: skip
            raise AssertionError(f"never held 2 deferred cancellations: {seen}")
        held = int(await deferring(doomed))
        t_sig = time.monotonic()
        doomed.signal(signal.Signals[sig])
        code = await doomed.wait_exit(GRACE_S + 10)
        t_exit = time.monotonic()
        outcomes += await doomed_wave
        outcomes += await survivor_wave
        if killed:
            # The survivor gets the killed replica's budget back when its leases expire.
            async def budget_back() -> bool:
                return (await stack.redis_usage())[0] == 0 and await survivor.idle()

            if await poll(budget_back, 3 * TTL_S + 10, 0.05):
                row.recover_s = time.monotonic() - t_sig
            else:
                row.violations.append(f"the killed replica's leases never expired: "
                                      f"{await stack.redis_state()}")  # fmt: skip
            row.note = f"{held} held at the kill; budget back after its lease TTL ({TTL_S:g} s)"
        else:
            if code != 0:
                row.violations.append(f"exit {code} after SIGTERM")
            row.recover_s = t_exit - t_sig  # drained and exited
            if t_exit - t_sig > GRACE_S + 1:
                row.violations.append(f"drained in {t_exit - t_sig:.1f} s > grace {GRACE_S:g} s")
            row.note = f"{held} held at SIGTERM, drained; exit {code}"

            async def released() -> bool:
                return (await stack.redis_usage())[0] == 0 and await survivor.idle()

            # Released at each upstream close, not left to expire.
            if not await poll(released, min(TTL_S, 2.0) + 20, 0.05):
                row.violations.append(
                    f"leases left after a clean exit: {await stack.redis_state()}"
                )
        assert await poll(survivor.idle, 30, 0.1), survivor.tail()
        judge_outcomes(row, outcomes, BOUND_S)
        truth = await stack.quiet()
        judge_truth(row, truth, 0, killed=killed)
        await judge_idle(row, survivor, base)
    finally:
        if doomed.proc.poll() is None:
            doomed.signal(signal.SIGKILL)
            await doomed.wait_exit(10)
        code2 = await stop_proxy(survivor)
    if code2 != 0:
        row.violations.append(f"the survivor exited {code2} on SIGTERM")
    row.seconds = time.monotonic() - started
    ROWS.append(row)
    assert not row.violations, (row.fault, row.phase, row.violations, row.outcomes)
