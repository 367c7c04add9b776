"""Faults between kvproxy and the router, one at a time: a blackhole (DROP) and a reset (RST)
during connect, during prefill, mid-stream and while a deferred cancellation is draining.
Each run puts two kvproxy processes in front of the same engines, one behind the simulator's
router and one behind the real smg 1.13, both crossing the faulted link.

What must hold (fault_report): every reply complete or an explicit failure within the
timeout that applies + 1 s (connect 1 s, read 5 s); nothing sent upstream twice (never
retried); no early cancellation (a silent router is held until a safe point, not closed at
the read timeout; a reset's own, where the router's end is destroyed and it cancels, are
counted and explained), no over-limit prompt at the engines, no foreign marker; kvproxy
back to its idle fds, tasks and memory; a complete answer again after the repair.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
from fault_report import ROWS, Row, baseline, judge_idle, judge_outcomes, judge_truth
from fault_stack import PROXY_ENV, ROUTER_PORTS, Proxy, Upstream, poll, start_proxy, stop_proxy
from fault_traffic import Outcome, Progress, mix, probe_until_ok, wave

CONNECT_S = float(PROXY_ENV["KVPROXY_UPSTREAM_CONNECT_TIMEOUT_S"])
READ_S = float(PROXY_ENV["KVPROXY_UPSTREAM_READ_TIMEOUT_S"])
# The longest a request may take here without a fault: queue (2 s) + prefill (<= 2.4 s) +
# decode (<= 1.2 s), with room for a loaded machine; a fault adds its timeout on top.
BOUND_S = 15.0
ROUTERS = ("sim", "smg")


async def trigger(
    phase: str, stack: Upstream, proxies: dict[str, Proxy], progress: dict[str, Progress]
) -> bool:
    """Wait (bounded) until the traffic is in `phase`."""
    if phase == "prefill":

        async def in_prefill() -> bool:
            return int((await stack.stats())["prefill"]["running"]) >= 4

        return await poll(in_prefill, 20, 0.02)
    if phase == "midstream":

        async def streaming() -> bool:
            return all(p.streaming >= 2 for p in progress.values())

        return await poll(streaming, 20, 0.02)
    if phase == "draining":

        async def draining() -> bool:
            got = [
                await p.metric("kvproxy_deferred_cancellations_in_progress")
                for p in proxies.values()
            ]
            return all(g >= 1 for g in got)

        return await poll(draining, 20, 0.02)
    return True


@pytest.mark.parametrize("fault", ["blackhole", "reset"])
@pytest.mark.parametrize("phase", ["connect", "prefill", "midstream", "draining"])
async def test_router_fault(stack: Upstream, tmp_path: Path, fault: str, phase: str) -> None:
    started = time.monotonic()
    await stack.quiet()
    await stack.reset()
    seed = hash((fault, phase)) % 10_000
    proxies = {r: await start_proxy(tmp_path, f"{fault}-{phase}-{r}", r) for r in ROUTERS}
    bases = {r: await baseline(p) for r, p in proxies.items()}
    rows = {r: Row(fault, phase, r) for r in ROUTERS}
    progress = {r: Progress() for r in ROUTERS}
    leave = 0.5 if phase == "draining" else 0.15
    prompt = (2000, 3000) if phase in ("prefill", "draining") else (1000, 2500)
    specs = {
        r: mix(random.Random(seed + i), 10, leave=leave, prompt=prompt)
        for i, r in enumerate(ROUTERS)
    }
    ports = tuple(ROUTER_PORTS.values())
    lab = stack.lab
    t_fault = 0.0
    waves: dict[str, asyncio.Future[list[Outcome]]] = {}
    try:
        if phase == "connect":
            t_fault = time.monotonic()
            if fault == "blackhole":
                lab.blackhole("up", ports, syn_only=True)
            else:
                lab.reset("up", ports)
        for i, r in enumerate(ROUTERS):
            waves[r] = asyncio.ensure_future(
                wave(
                    proxies[r].public,
                    specs[r],
                    seed + i,
                    BOUND_S,
                    progress[r],
                    tag=f"{fault}-{phase}-{r}",
                )
            )
        if phase != "connect":
            assert await trigger(phase, stack, proxies, progress), f"traffic never reached {phase}"
            t_fault = time.monotonic()
            if fault == "blackhole":
                lab.blackhole("up", ports)
            else:
                lab.reset("up", ports)
        # A blackhole outlasts the read timeout (every wait it causes must end by itself); a
        # reset needs only a moment.
        await asyncio.sleep(READ_S + 1.0 if fault == "blackhole" else 1.0)
        lab.heal("up")
        t_heal = time.monotonic()
        outcomes = {r: await w for r, w in waves.items()}
        for r, p in proxies.items():
            ok_at = await probe_until_ok(p.public, 30)
            rows[r].recover_s = None if ok_at is None else ok_at - t_heal
            if ok_at is None:
                rows[r].violations.append("no complete answer within 30 s of the repair")
        for p in proxies.values():
            assert await poll(p.idle, 30, 0.1), p.tail()
        truth = await stack.quiet()
        admitted = sum(
            [
                await p.metric_where("kvproxy_requests_total", decision="admitted")
                for p in proxies.values()
            ]
        )
        for r, p in proxies.items():
            row = rows[r]
            judge_outcomes(row, outcomes[r], BOUND_S + (READ_S if fault == "blackhole" else 0))
            timeout_s = CONNECT_S if phase == "connect" else READ_S
            # The fault's own failures: kvproxy's refusals (400, 429) are not about it.
            fails = [
                o
                for o in outcomes[r]
                if o.kind == "failure"
                and o.ended >= t_fault
                and not o.label.startswith(("400", "429"))
            ]
            if fails:
                row.detect_s = min(o.ended for o in fails) - t_fault
            for o in fails:
                late = o.ended - max(o.started, t_fault)
                if late > timeout_s + 1.0 + (1.0 if fault == "blackhole" else 0.0) + 0.5 * (
                    phase == "connect"
                ):
                    row.violations.append(
                        f"{o.rid}: failed {late:.1f} s after the fault (timeout {timeout_s:g} s)"
                    )
            await judge_idle(row, p, bases[r])
        # A reset destroys the router's end of the connection (ss -K): the router cancels
        # what it was serving, as if kvproxy had been killed.
        judge_truth(rows["sim"], truth, admitted, killed=fault == "reset")
        if fault == "reset" and rows["sim"].early_cancellations:
            rows["sim"].note = (
                "early cancellations: the router's end of the connection was destroyed, "
                "and it cancelled (no proxy can prevent it)"
            )
        rows["smg"].violations += [
            v for v in rows["sim"].violations if "engine" in v or "upstream" in v or "twice" in v
        ]
    finally:
        lab.heal()
        for w in waves.values():
            if not w.done():
                w.cancel()
        codes = {r: await stop_proxy(p) for r, p in proxies.items()}
    for r, row in rows.items():
        if codes[r] != 0:
            row.violations.append(f"kvproxy exited {codes[r]} on SIGTERM")
        row.seconds = time.monotonic() - started
        ROWS.append(row)
    for row in rows.values():
        assert not row.violations, (row.fault, row.phase, row.router, row.violations, row.outcomes)
