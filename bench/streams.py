"""Streams at scale: thousands of long SSE streams held open through one proxy on one core.

A chat stream lives for tens of seconds; a sidecar in front of a busy cluster holds
thousands at once, each getting a token every few tens of milliseconds. This phase opens N
streams at once through the target (kvproxy with the comparison's full policy, or the bare
forwarder), each receiving an event every `PACE_MS` from `sse_upstream.py --pace-ms`, and
measures over a window in which all N are open:

- CPU per relayed event (the target's utime+stime over the window / events the clients
  received in it), and kvproxy / bare at `HEADLINE` streams;
- RSS per open stream ((VmRSS with N open − VmRSS idle before the ramp) / N);
- event-loop lag p99: kvproxy's own `kvproxy_event_loop_lag_seconds` histogram over the
  window; the bare forwarder exports none, so for every target the clients also measure
  the interval between a stream's consecutive events minus the pace ("late", p99), and
  `direct` (no proxy) gives the floor the upstream and the clients add themselves;
- streams lost (stream_client.lost_reason): must be 0;
- capacity: steps of `StreamPlan.steps`, each one fresh set of streams against the same
  target process; the capacity is the last step before the first whose lag p99 passes
  20 ms or that loses a stream, or where the load generator's CPU (upstream + clients) is
  saturated (then a lower bound, and the report says so). Every step up to `HEADLINE` runs
  (its figures are the issue's); past it the ramp stops at the first step that failed.

Layout as every phase: target on CPU 0, upstream, clients and harness on CPU 1. Must never:
measure a step whose streams were not all open over the whole window (the stream length is
computed from the window), or leave a client or upstream process behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import procstat
import scrape
from servers import Managed, free_port, wait_port
from stream_client import Histogram
from targets import LOAD_CPU, Running, Upstream

BENCH = Path(__file__).resolve().parent
PACE_MS = 50.0
# The figures: CPU per event is compared at 2,000 streams; a step passes while the
# loop lag p99 is at most 20 ms and no stream is lost.
HEADLINE = 2000
LAG_LIMIT_MS = 20.0
STALL_S = 1.0
# The upstream and the clients share CPU 1; past this share of it over the window the load
# generator, not the target, may be what limits the step.
LOAD_SATURATED = 0.9
# Streams opened per second during a step's ramp (its streams start evenly over it): a
# stream's start costs kvproxy its admission (~200 µs here), so 2,000 a second on top of the
# events took a third of its core and left a backlog the window then measured; the settle
# time after the ramp lets what a start leaves behind clear before the window.
RAMP_PER_S = 1000.0
# Descriptors a target keeps besides two per stream (client side and upstream side).
FD_SPARE = 256


@dataclass(frozen=True)
class StreamPlan:
    steps: tuple[int, ...]
    window_s: float
    settle_s: float = 2.0
    client_procs: int = 1


PLANS = {
    "full": StreamPlan((250, 500, 1000, 1500, 2000, 3000, 4000, 6000, 8000), 8.0),
    "quick": StreamPlan((500, 1000, 2000), 3.0, settle_s=1.5),
    "tiny": StreamPlan((100,), 1.0, settle_s=0.5),
}


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (children inherit it); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return int(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def start_upstream(workdir: Path, most_events: int) -> tuple[Managed, Upstream]:
    port = free_port()
    cmd = [sys.executable, str(BENCH / "sse_upstream.py"), "--port", str(port), "--pace-ms",
           f"{PACE_MS:g}", "--max-events", str(most_events)]  # fmt: skip
    m = Managed("paced-upstream", cmd, cpu=LOAD_CPU, log=workdir / "paced-upstream.log").start()
    wait_port(port, proc=m)
    return m, Upstream(f"http://127.0.0.1:{port}", port, m.pid)


@dataclass(frozen=True)
class Schedule:
    """One step's times (CLOCK_MONOTONIC) and stream length, all streams open over the window."""

    start: float
    ramp_s: float
    window: tuple[float, float]
    events: int
    deadline: float

    @classmethod
    def make(cls, now: float, n: int, plan: StreamPlan, pace_s: float) -> Schedule:
        # The clients need ~0.5 s to import and start their loop.
        start = now + 1.0
        ramp = max(0.5, n / RAMP_PER_S)
        w0 = start + ramp + plan.settle_s
        w1 = w0 + plan.window_s
        # The first stream opened must still stream at w1 (+ half a second of margin); the
        # usage event and [DONE] come after the token events.
        events = math.ceil((w1 + 0.5 - start) / pace_s) + 2
        deadline = start + ramp + events * pace_s + 2 * STALL_S + 1.0
        return cls(start, ramp, (w0, w1), events, deadline)


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def merge_clients(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """The tallies of the client processes of one step, as if one client had held them all."""
    late, first = Histogram(), Histogram()
    lost: dict[str, int] = {}
    for o in outs:
        late.merge(Histogram.from_json(o["late"]))
        first.merge(Histogram.from_json(o["first"]))
        for k, v in o["lost"].items():
            lost[k] = lost.get(k, 0) + int(v)
    return {
        "streams": sum(int(o["streams"]) for o in outs),
        "window_events": sum(int(o["window_events"]) for o in outs),
        "lost": lost,
        "late": late,
        "first": first,
        "max_gap_ms": max((float(o["max_gap_ms"]) for o in outs), default=0.0),
    }


def step_figures(
    *,
    n: int,
    window_s: float,
    clients: dict[str, Any],
    target_cpu_s: float,
    load_cpu_s: dict[str, float],
    rss_idle_kib: int,
    rss_kib: int,
    lag: scrape.HistDelta | None,
) -> dict[str, Any]:
    """One step's figures from what was read over its window (pure: the tests feed it)."""
    events = clients["window_events"]
    expected = n * window_s * 1e3 / PACE_MS
    load = sum(load_cpu_s.values())
    lost = sum(clients["lost"].values())
    late_p99 = clients["late"].quantile_ms(0.99)
    out: dict[str, Any] = {
        "streams": n,
        "window_s": window_s,
        "events": events,
        "events_per_s": round(events / window_s, 1),
        # Below 1 the target (or the load generator) did not keep the pace.
        "delivered_share": round(events / expected, 3) if expected else None,
        "cpu_s": round(target_cpu_s, 3),
        "cpu_us_per_event": round(target_cpu_s / events * 1e6, 3) if events else None,
        "target_cpu_share": round(target_cpu_s / window_s, 3),
        "load_cpu_share": round(load / window_s, 3),
        "load_cpu_share_by_process": {k: round(v / window_s, 3) for k, v in load_cpu_s.items()},
        "rss_mib": round(rss_kib / 1024, 1),
        "rss_kib_per_stream": round((rss_kib - rss_idle_kib) / n, 2) if n else None,
        "late_p99_ms": late_p99,
        "late_p50_ms": clients["late"].quantile_ms(0.5),
        "first_event_p99_ms": clients["first"].quantile_ms(0.99),
        "max_gap_ms": clients["max_gap_ms"],
        "lost": lost,
        "lost_by_reason": clients["lost"],
    }
    if lag is not None:
        out["lag_p99_ms"] = round(lag.quantile(0.99) * 1e3, 2)
        out["lag_p99_ceiling_ms"] = round(lag.at_most(0.99) * 1e3, 2)
    return out


def lag_ms(step: dict[str, Any]) -> float | None:
    """The lag a step is judged on: the target's own loop-lag metric when it exports one
    (kvproxy), else the clients' interval lateness (the bare forwarder, direct)."""
    v = step.get("lag_p99_ms", step.get("late_p99_ms"))
    return float(v) if isinstance(v, int | float) else None


def step_verdict(step: dict[str, Any]) -> str:
    """ "ok", or why the ramp stops at this step: "load" (the upstream and the clients used
    more than LOAD_SATURATED of their CPU: the step says nothing about the target, which got
    less than the planned load), "lost" (a stream lost) or "lag" (lag p99 over 20 ms)."""
    if step["load_cpu_share"] > LOAD_SATURATED:
        return "load"
    if step["lost"]:
        return "lost"
    lag = lag_ms(step)
    if lag is None or lag > LAG_LIMIT_MS:
        return "lag"
    return "ok"


def capacity(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest stream count held (lag p99 ≤ 20 ms, nothing lost) before the first step
    that was not: `bound` is that step's verdict ("lag", "lost": the capacity is below the
    step that failed; "load": the load generator saturated there, so the capacity is at
    least `streams`), or "plan" when every step held (at least `streams` too)."""
    held = 0
    for s in steps:
        v = s.get("verdict") or step_verdict(s)
        if v != "ok":
            return {"streams": held, "bound": v, "failed_at": s["streams"]}
        held = s["streams"]
    return {"streams": held, "bound": "plan", "failed_at": None}


def ratio_at(
    results: dict[str, Any], n: int, num: str = "kvproxy", den: str = "bare"
) -> float | None:
    """CPU per event num / den at the step of `n` streams, when both ran it."""
    a = step_at(results, num, n).get("cpu_us_per_event")
    b = step_at(results, den, n).get("cpu_us_per_event")
    if not isinstance(a, int | float) or not isinstance(b, int | float) or not b:
        return None
    return float(a) / float(b)


def both_held(results: dict[str, Any]) -> int | None:
    """The largest stream count both proxies held (verdict ok), None when one held none:
    where their CPU per event compares unsaturated (past its capacity a proxy's events
    batch up per wakeup and its CPU per event falls)."""
    held = [
        {s["streams"] for s in (results.get(t) or {}).get("steps", []) if s.get("verdict") == "ok"}
        for t in ("kvproxy", "bare")
    ]
    common = held[0] & held[1]
    return max(common) if common else None


def step_at(results: dict[str, Any], target: str, n: int) -> dict[str, Any]:
    for s in (results.get(target) or {}).get("steps", []):
        if s.get("streams") == n:
            return dict(s)
    return {}


class StreamsPhase:
    """Runs the ramp against each target; `Bench.streams` in run.py owns the targets."""

    def __init__(self, plan: StreamPlan, workdir: Path, log: Callable[[str], None]) -> None:
        self.plan = plan
        self.work = workdir
        self.log = log
        self.pace_s = PACE_MS / 1e3
        self.upstream_pid = 0

    def most_events(self) -> int:
        biggest = Schedule.make(0.0, max(self.plan.steps), self.plan, self.pace_s)
        return biggest.events + 16

    def warm_up(self, run: Running) -> None:
        """Twenty short streams: every one must arrive whole (else the target is not
        measured), and the first connections and buffers are made before the idle RSS."""
        sched = Schedule.make(time.monotonic(), 20, StreamPlan((20,), 0.2, 0.1), self.pace_s)
        clients = self._clients(run, 20, sched)
        got = merge_clients(clients)
        if sum(got["lost"].values()):
            raise RuntimeError(f"{run.name}: streams lost in the warm-up: {got['lost']}")

    def ramp(self, run: Running, fd_limit: int) -> dict[str, Any]:
        self.warm_up(run)
        time.sleep(0.5)
        idle = procstat.memory(run.pids[0]).rss_kib
        out: dict[str, Any] = {"rss_idle_mib": round(idle / 1024, 1), "steps": []}
        for n in self.plan.steps:
            if 2 * n + FD_SPARE > fd_limit:
                out["skipped"] = (
                    f"{n} streams need {2 * n + FD_SPARE} descriptors (limit {fd_limit})"
                )
                break
            self.log(f"streams at scale: {run.name}, {n} streams")
            step = self.step(run, n, idle)
            step["verdict"] = step_verdict(step)
            out["steps"].append(step)
            self.log(
                f"  {n} streams: {step['cpu_us_per_event']} µs/event, lag p99 {lag_ms(step)} ms, "
                f"lost {step['lost']}, load CPU {step['load_cpu_share']}, {step['verdict']}"
            )
            # The headline count is measured whatever happened below it (its CPU ratio and
            # lost streams are the figures); past it, the first failed step ends
            # the ramp.
            if step["verdict"] != "ok" and n >= HEADLINE:
                break
        out["capacity"] = capacity(out["steps"])
        return out

    def step(self, run: Running, n: int, rss_idle_kib: int) -> dict[str, Any]:
        sched = Schedule.make(time.monotonic(), n, self.plan, self.pace_s)
        procs = self._spawn(run, n, sched)
        try:
            _sleep_until(sched.window[0])
            cpu0, load0 = procstat.tree_cpu_s(run.pids), self._load_cpu(procs)
            before = scrape.scrape(run.admin_url) if run.admin_url else None
            _sleep_until(sched.window[1])
            cpu1, load1 = procstat.tree_cpu_s(run.pids), self._load_cpu(procs)
            rss = procstat.memory(run.pids[0]).rss_kib
            after = scrape.scrape(run.admin_url) if run.admin_url else None
            clients = merge_clients(self._collect(procs, sched))
        finally:
            for p in procs:
                p.stop()
        lag = (
            scrape.hist_delta(before, after, "kvproxy_event_loop_lag_seconds")
            if before is not None and after is not None
            else None
        )
        return step_figures(
            n=n,
            window_s=sched.window[1] - sched.window[0],
            clients=clients,
            target_cpu_s=cpu1 - cpu0,
            load_cpu_s={k: load1[k] - load0[k] for k in load0},
            rss_idle_kib=rss_idle_kib,
            rss_kib=rss,
            lag=lag,
        )

    def _load_cpu(self, procs: list[Managed]) -> dict[str, float]:
        return {
            "upstream": procstat.process_cpu_s(self.upstream_pid),
            "clients": sum(procstat.process_cpu_s(p.pid) for p in procs if p.proc is not None),
        }

    def _spawn(self, run: Running, n: int, sched: Schedule) -> list[Managed]:
        k = max(1, min(self.plan.client_procs, n))
        procs = []
        for j in range(k):
            share = n // k + (1 if j < n % k else 0)
            cmd = [sys.executable, str(BENCH / "stream_client.py"), "--url", run.url,
                   "--streams", str(share), "--events", str(sched.events), "--pace-ms",
                   f"{PACE_MS:g}", "--start", repr(sched.start), "--ramp", repr(sched.ramp_s),
                   "--window", repr(sched.window[0]), repr(sched.window[1]), "--deadline",
                   repr(sched.deadline), "--stall-s", f"{STALL_S:g}",
                   "--offset", str(j)]  # fmt: skip
            log = self.work / f"streams-{run.name}-{n}-{j}.log"
            log.unlink(missing_ok=True)
            procs.append(Managed(f"stream-client-{j}", cmd, cpu=LOAD_CPU, log=log).start())
        return procs

    def _clients(self, run: Running, n: int, sched: Schedule) -> list[dict[str, Any]]:
        procs = self._spawn(run, n, sched)
        try:
            return self._collect(procs, sched)
        finally:
            for p in procs:
                p.stop()

    def _collect(self, procs: list[Managed], sched: Schedule) -> list[dict[str, Any]]:
        outs = []
        for p in procs:
            assert p.proc is not None
            with contextlib.suppress(Exception):
                p.proc.wait(max(5.0, sched.deadline - time.monotonic() + 10.0))
            line = ""
            if p.log is not None and p.log.exists():
                lines = [x for x in p.log.read_text().splitlines() if x.startswith("{")]
                line = lines[-1] if lines else ""
            if not line:
                raise RuntimeError(f"{p.name} gave no tally: {p.log_tail()}")
            outs.append(json.loads(line))
        return outs
