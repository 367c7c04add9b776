"""The fault suite's judge and report.

A run is judged on ground truth only: the simulator's /sim/stats (what reached the engines,
what was cancelled before its transfer was over, what was sent twice), Redis's own usage,
the kvproxy process (alive, its fds, memory and tasks back to their idle level) and the
replies as the clients saw them (fault_traffic). Each run becomes one row of
bench/FAULTS.md: fault x phase -> requests, outcomes by status, ground-truth violations,
time to detect, time to recover.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fault_stack import Proxy
from fault_traffic import OVER_LIMIT_BYTES, Outcome, summary

REPORT = Path(__file__).resolve().parents[2] / "bench" / "FAULTS.md"
LEAKS = ("late_writes_into_reallocated_pages", "late_writes_into_free_pages",
         "pages_freed_before_drain", "stale_page_reads")  # fmt: skip
# Idle levels: what a run may leave above the level measured before it (a pooled keep-alive
# connection closing late, allocator slack), polled for a bounded time after the run.
FD_SLACK, TASK_SLACK, RSS_SLACK = 4, 4, 64 * 1024 * 1024


@dataclass
class Row:
    fault: str
    phase: str
    router: str = "sim"
    requests: int = 0
    outcomes: str = ""
    violations: list[str] = field(default_factory=list)
    early_cancellations: int = 0
    detect_s: float | None = None
    recover_s: float | None = None
    note: str = ""
    seconds: float = 0.0

    def cells(self) -> list[str]:
        def t(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f} s"

        return [
            self.fault,
            self.phase,
            self.router,
            str(self.requests),
            self.outcomes or "-",
            str(len(self.violations))
            + (f": {'; '.join(self.violations)}" if self.violations else ""),
            str(self.early_cancellations),
            t(self.detect_s),
            t(self.recover_s),
            self.note,
        ]


ROWS: list[Row] = []


def judge_outcomes(row: Row, outcomes: list[Outcome], bound_s: float) -> None:
    row.requests += len(outcomes)
    row.outcomes = (
        summary(outcomes) if not row.outcomes else row.outcomes + "; " + summary(outcomes)
    )
    for o in outcomes:
        if o.kind == "broken":
            row.violations.append(f"{o.rid}: {o.label}")
        if o.kind == "hang":
            row.violations.append(f"{o.rid}: no end within {bound_s + 1:.0f} s")
        if o.foreign:
            row.violations.append(f"{o.rid}: foreign marker of {','.join(o.foreign)}")
        if o.kind != "left" and o.duration_s > bound_s + 1.0:
            row.violations.append(f"{o.rid}: ended after {o.duration_s:.1f} s > bound")
        if o.spec.prompt_bytes >= OVER_LIMIT_BYTES and o.kind == "ok":
            row.violations.append(f"{o.rid}: an over-limit prompt was answered 200")


def judge_truth(row: Row, truth: dict[str, Any], admitted: float, killed: bool = False) -> None:
    """The simulator's counters since the run's reset. `killed`: the router's end of
    kvproxy's connections was destroyed under it (kvproxy SIGKILLed, or the reset fault's
    `ss -K` in the router's namespace): the router cancels what it was serving, and no
    proxy can prevent the early cancellations that follow, so they are counted and
    explained, not judged."""
    p, d, r = truth["prefill"], truth["decode"], truth["router"]
    over = sum(
        int(x.get(k, 0)) for x in (p, d) for k in ("pending_rejections", "rejections_at_admission")
    )
    if over:
        row.violations.append(f"{over} over-limit prompts reached an engine")
    early = int(d.get("aborts_before_drain", 0))
    leaks = sum(int(x.get(k, 0)) for x in (p, d) for k in LEAKS)
    row.early_cancellations += early
    if (early or leaks) and not killed:
        row.violations.append(f"{early} upstream requests closed before their transfer was over "
                              f"({leaks} pages/writes)")  # fmt: skip
    if int(r.get("duplicate_request_ids", 0)):
        row.violations.append(f"{r['duplicate_request_ids']} requests sent upstream twice")
    # Not compared with the engines' own count: smg retries a failed request to a worker
    # itself, so behind it the engines may see one request of kvproxy's twice.
    del admitted


async def baseline(proxy: Proxy) -> tuple[int, int, int]:
    """The idle level after a warm-up: pools that grow with use (the upstream keep-alive
    connections, Redis's connection pool, the allocator's arenas) at their working size, so
    what a run leaves above it is what the fault left."""
    from fault_traffic import CHAT, TENANTS, Progress, Spec, wave

    specs = [Spec(CHAT, i % 2 == 0, 300, 8, TENANTS[i % 2]) for i in range(8)]
    await wave(proxy.public, specs, 0, 30.0, Progress(), spread_s=0.0, tag=f"warm-{proxy.name}")
    for _ in range(100):
        if await proxy.idle():
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.5)  # past the upstream keep-alive (1 s): idle connections closed
    m = await proxy.metrics()
    return proxy.fds(), int(m.get("kvproxy_event_loop_tasks", 0)), proxy.rss_bytes()


async def judge_idle(
    row: Row, proxy: Proxy, base: tuple[int, int, int], timeout_s: float = 20.0
) -> None:
    """kvproxy alive, nothing in flight, and back to its idle fds/tasks/memory (bounded)."""
    if proxy.proc.poll() is not None:
        row.violations.append(f"{proxy.name} exited ({proxy.proc.returncode})")
        return
    fds = tasks = rss = 0
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / 0.2) + 1):
        m = await proxy.metrics()
        fds, tasks, rss = proxy.fds(), int(m.get("kvproxy_event_loop_tasks", 0)), proxy.rss_bytes()
        busy = m.get("kvproxy_inflight_requests", 0) or m.get(
            "kvproxy_deferred_cancellations_in_progress", 0
        )
        if (
            not busy
            and fds <= base[0] + FD_SLACK
            and tasks <= base[1] + TASK_SLACK
            and rss <= base[2] + RSS_SLACK
        ):
            return
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    row.violations.append(
        f"{proxy.name} not back to idle: fds {base[0]}->{fds}, tasks {base[1]}->{tasks}, "
        f"rss {base[2] >> 20}->{rss >> 20} MiB"
    )


def write_report(commit: str, total_s: float) -> str:
    head = ["fault", "phase", "router", "requests", "outcomes (by status)",
            "ground-truth violations", "early cancellations", "time to detect",
            "time to recover", "note"]  # fmt: skip
    lines = [
        "# Fault suite report",
        "",
        f"`make test-faults` at {commit}, {len(ROWS)} rows in {total_s:.0f} s. Written by the "
        "suite (tests/faults/); judged on ground truth only (the simulator's /sim/stats, "
        "Redis's usage, the kvproxy processes, the replies as clients saw them).",
        "",
        "Outcomes: `200` a complete answer; `200+error X` a stream ended by the documented error "
        "event; `cut` the connection closed before the response's framing completed; `left` the "
        "client went away on purpose. Early cancellations: upstream requests the simulator saw "
        "cancelled while their KV transfer was still writing (the incident's second race); a "
        "violation everywhere except where the router's end of kvproxy's connection is destroyed "
        "under it: kvproxy SIGKILLed (nothing in a process that is killed can hold a connection "
        "open) and the reset rows (`ss -K` destroys the router's sockets; the router then cancels "
        "what it was serving, exactly as if kvproxy had died). docs/operating.md, Faults, says "
        "what protects that case. The router rows run a kvproxy behind the simulator's router and "
        "one behind smg 1.13 at once, in front of the same engines: the engines' counters of a "
        "run are shown on its `sim` row. Time to detect: from the fault to kvproxy's first "
        "explicit answer about it (or its state change); time to recover: from the repair to the "
        "first complete answer (or the budget whole again).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for row in ROWS:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row.cells()) + " |")
    text = "\n".join(lines) + "\n"
    REPORT.write_text(text)
    return text
