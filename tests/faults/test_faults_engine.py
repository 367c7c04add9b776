"""A blackhole between kvproxy and one engine's admin endpoint (the decode engine's info and
metrics port, which kvproxy polls directly; the router's own path to it is untouched).

What must hold: capacity goes stale and kvproxy fails closed (503 capacity_unknown, /readyz
503) within capacity_stale_s plus one refresh and one probe timeout (+1 s); the monitor
never hangs (/capacity and /metrics keep answering); nothing is admitted meanwhile, so
nothing reaches the engines; capacity and service come back after the repair.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

from fault_report import ROWS, Row, baseline, judge_idle, judge_outcomes, judge_truth
from fault_stack import DECODE_PORT, PROXY_ENV, Upstream, start_proxy, stop_proxy
from fault_traffic import Progress, mix, probe_until_ok, wave

STALE_S = float(PROXY_ENV["KVPROXY_CAPACITY_STALE_S"])
REFRESH_S = float(PROXY_ENV["KVPROXY_CAPACITY_REFRESH_S"])
PROBE_S = float(PROXY_ENV["KVPROXY_CAPACITY_PROBE_TIMEOUT_S"])
BOUND_S = 15.0


async def test_engine_admin_blackhole(stack: Upstream, tmp_path: Path) -> None:
    started = time.monotonic()
    await stack.quiet()
    await stack.reset()
    row = Row("blackhole", "engine admin (decode)", "sim")
    proxy = await start_proxy(tmp_path, "engine-admin", "sim")
    base = await baseline(proxy)
    lab = stack.lab
    try:
        t_fault = time.monotonic()
        lab.blackhole("up", (DECODE_PORT,))
        # Poll readiness and the admin endpoints: each answer must come (never a hang).
        not_ready_at = None
        for _ in range(int((STALE_S + 10) / 0.1)):
            t0 = time.monotonic()
            ready = await proxy.ready()
            await proxy.capacity()
            waited = time.monotonic() - t0
            if waited > 2.0:
                row.violations.append(f"the admin endpoints took {waited:.1f} s during the fault")
            if not ready:
                not_ready_at = time.monotonic()
                break
            await asyncio.sleep(0.1)
        bound = STALE_S + REFRESH_S + PROBE_S + 1.0
        if not_ready_at is None:
            row.violations.append("readiness never went false")
        else:
            row.detect_s = not_ready_at - t_fault
            if row.detect_s > bound:
                row.violations.append(f"failed closed after {row.detect_s:.1f} s > {bound:.1f} s")
        before = sum((await stack.stats())["router"]["requests_by_route"].values())
        outcomes = await wave(
            proxy.public, mix(random.Random(7), 9, leave=0.0), 7, BOUND_S, Progress(), tag="eng"
        )
        routed = sum((await stack.stats())["router"]["requests_by_route"].values()) - before
        judge_outcomes(row, outcomes, BOUND_S)
        admitted = [o for o in outcomes if o.label.startswith("200")]
        if admitted or routed:
            row.violations.append(
                f"{len(admitted)} answered and {routed} routed while capacity was stale"
            )
        # /generate answers in SGLang's shape, which carries only a message.
        if not all(o.label in ("503 capacity_unknown", "503") for o in outcomes):
            row.note = "unexpected: " + ", ".join(sorted({o.label for o in outcomes}))
        lab.heal("up")
        t_heal = time.monotonic()
        ok_at = await probe_until_ok(proxy.public, 30)
        row.recover_s = None if ok_at is None else ok_at - t_heal
        if ok_at is None:
            row.violations.append("no complete answer within 30 s of the repair")
        judge_truth(row, await stack.quiet(), 0)
        await judge_idle(row, proxy, base)
    finally:
        lab.heal()
        code = await stop_proxy(proxy)
    if code != 0:
        row.violations.append(f"kvproxy exited {code} on SIGTERM")
    row.seconds = time.monotonic() - started
    ROWS.append(row)
    assert not row.violations, (row.fault, row.phase, row.violations, row.outcomes)
