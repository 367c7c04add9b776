"""Exhaustion: the process's file-descriptor limit below the offered concurrency, and a
burst of large bodies against the body-memory limit (kvproxy.serve.overload).

What must hold: kvproxy sheds at the door (503 `overloaded`, or a connection dropped at
accept past the shedding margin: both explicit failures), never crashes, never forwards what
it shed, answers every request it took completely or with an explicit failure, and serves
again once the burst ends, with its fds, tasks and memory back to idle.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import time
from pathlib import Path

import aiohttp
from fault_report import ROWS, Row, baseline, judge_idle, judge_outcomes, judge_truth
from fault_stack import Proxy, Upstream, start_proxy, stop_proxy
from fault_traffic import CHAT, TENANTS, Outcome, Progress, Spec, probe_until_ok, wave

BOUND_S = 30.0
NOFILE = 128  # the fd limit (prlimit); the derived connection limit is (128 - 64) // 2 = 32
OFFERED = 160  # concurrent connections offered: more than the fd limit itself
BODY_BYTES = 4_000_000  # a 1M-token-class prompt
BODIES = 16


def vm_hwm(proxy: Proxy) -> int:
    """The process's peak resident set (VmHWM), bytes."""
    with open(f"/proc/{proxy.pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def first_shed(outcomes: list[Outcome], since: float) -> float | None:
    shed = [o.ended for o in outcomes if o.label in ("503 overloaded", "cut") and o.ended >= since]
    return min(shed) - since if shed else None


async def test_fd_limit_below_the_offered_concurrency(stack: Upstream, tmp_path: Path) -> None:
    started = time.monotonic()
    await stack.quiet()
    await stack.reset()
    row = Row("fd exhaustion", f"nofile {NOFILE}, {OFFERED} concurrent", "sim")
    proxy = await start_proxy(
        tmp_path, "fds", "sim", prefix=["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"]
    )
    base = await baseline(proxy)
    try:
        rng = random.Random(5)
        specs = [
            Spec(CHAT, rng.random() < 0.6, rng.randint(200, 800), 60, TENANTS[i % 2])
            for i in range(OFFERED)
        ]
        t0 = time.monotonic()
        outcomes = await wave(proxy.public, specs, 5, BOUND_S, Progress(), spread_s=0.3, tag="fds")
        row.detect_s = first_shed(outcomes, t0)
        judge_outcomes(row, outcomes, BOUND_S)
        if proxy.proc.poll() is not None:
            row.violations.append(f"kvproxy died ({proxy.proc.returncode})")
        if row.detect_s is None:
            row.violations.append("nothing was shed although the offer exceeded the limit")
        shed = await proxy.metric("kvproxy_overload_shed_total")
        row.note = f"shed {shed:g} (503 or dropped at accept); peak fds within {NOFILE}"
        t_end = time.monotonic()
        ok_at = await probe_until_ok(proxy.public, 20)
        row.recover_s = None if ok_at is None else ok_at - t_end
        if ok_at is None:
            row.violations.append("no complete answer after the burst")
        judge_truth(row, await stack.quiet(), 0)
        await judge_idle(row, proxy, base)
    finally:
        code = await stop_proxy(proxy)
    if code != 0:
        row.violations.append(f"kvproxy exited {code} on SIGTERM")
    row.seconds = time.monotonic() - started
    ROWS.append(row)
    assert not row.violations, (row.fault, row.phase, row.violations, row.outcomes)


async def big_post(base: str, i: int) -> Outcome:
    spec = Spec(CHAT, False, BODY_BYTES, 8, TENANTS[i % 2])
    # One repeated line: the body's size is what matters here, not its text.
    content = ("lorem ipsum dolor sit amet " * (BODY_BYTES // 27 + 1))[:BODY_BYTES]
    payload = {"model": "kvproxy-sim", "messages": [{"role": "user", "content": content}],
               "max_tokens": 8}  # fmt: skip
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        try:
            # A file-like body: aiohttp warns (an error here) on large raw bytes.
            data = io.BytesIO(json.dumps(payload).encode())
            async with http.post(
                base + CHAT,
                data=data,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=BOUND_S + 1),
            ) as resp:
                got = await resp.json(content_type=None)
                code = (got.get("error") or {}).get("code", "") if isinstance(got, dict) else ""
                label = f"{resp.status} {code}".strip()
                kind = "ok" if resp.status == 200 else "failure"
        except (aiohttp.ClientError, OSError):
            kind, label = "failure", "cut"
        except TimeoutError:
            kind, label = "hang", "hang"
    return Outcome(spec, f"big-{i}", t0, time.monotonic(), kind, label)


async def test_burst_of_large_bodies_against_the_memory_limit(
    stack: Upstream, tmp_path: Path
) -> None:
    started = time.monotonic()
    await stack.quiet()
    await stack.reset()
    limit = 3 * BODY_BYTES
    row = Row("memory exhaustion", f"{BODIES} x 4 MB bodies, body memory {limit >> 20} MiB", "sim")
    proxy = await start_proxy(
        tmp_path,
        "bodies",
        "sim",
        max_body_bytes=2 * BODY_BYTES,
        max_body_memory_bytes=limit,
        body_memory_wait_s=1.0,
    )
    base = await baseline(proxy)
    hwm0 = vm_hwm(proxy)
    try:
        t0 = time.monotonic()
        outcomes = list(await asyncio.gather(*(big_post(proxy.public, i) for i in range(BODIES))))
        row.detect_s = first_shed(outcomes, t0)
        judge_outcomes(row, outcomes, BOUND_S)
        if proxy.proc.poll() is not None:
            row.violations.append(f"kvproxy died ({proxy.proc.returncode})")
        if row.detect_s is None:
            row.violations.append("nothing was shed although the burst exceeded the limit")
        # Fail-closed answers only. `503 capacity_unknown` is among them, rightly: the lab
        # runs kvproxy with a 1.5 s staleness bound (fault_stack.PROXY_ENV), and while the
        # loop works through the burst both capacity probes time out (kvproxy's log: "probe
        # ... failed: timeout", then "capacity: unknown" ~4 s after the last success, known
        # again 0.3 s later), so the bodies decided in that window are refused as unmeasured.
        # Nothing is forwarded (judged below on the simulator's counters).
        allowed = (
            "400 context_length_exceeded",
            "503 overloaded",
            "503 token_count_unavailable",
            "503 capacity_unknown",
        )
        odd = sorted({o.label for o in outcomes if o.label not in allowed})
        if odd:
            row.violations.append(f"unexpected answers to over-limit bodies: {odd}")
        grew = vm_hwm(proxy) - hwm0
        row.note = f"peak RSS +{grew >> 20} MiB"
        t_end = time.monotonic()
        ok_at = await probe_until_ok(proxy.public, 20)
        row.recover_s = None if ok_at is None else ok_at - t_end
        if ok_at is None:
            row.violations.append("no complete answer after the burst")
        # Every body was over the engines' limit: none may have reached them.
        judge_truth(row, await stack.quiet(), 0)
        await judge_idle(row, proxy, base)
    finally:
        code = await stop_proxy(proxy)
    if code != 0:
        row.violations.append(f"kvproxy exited {code} on SIGTERM")
    row.seconds = time.monotonic() - started
    ROWS.append(row)
    assert not row.violations, (row.fault, row.phase, row.violations, row.outcomes)
