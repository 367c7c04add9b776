"""Where kvproxy's CPU goes under one benchmark workload: py-spy, summarised per function.

Run: `.venv/bin/python bench/profile_kvproxy.py [--workload chat|sse|big|streams]
[--seconds 10]`. It starts the same upstream, simulator and full-policy kvproxy as
`bench/run.py`, drives the workload with wrk (4 MB prompts for `big`; for `streams`,
`--streams N` paced SSE streams held open as in bench/streams.py, sampled over the window
in which all are open, `--target bare` to profile the bare forwarder instead), samples it
with `py-spy record`
(installed into bench/out/peers-venv on first use) and prints the functions with the
largest self and inclusive share of samples, as `file:function`.

Must never: attach to a process it did not start, or keep the raw profile outside
bench/out/ (the stacks name functions only, never request content).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import nginx
import procstat
import profile_phases
import streams
import targets
import workloads
from payloads import long_chat_body, small_chat_body
from run import POOL_EXACT, SSE_CHUNKS, TOKENIZER_DIR
from servers import Managed, free_port, stop_all, wait_port
from wrk_driver import run_wrk

OUT = targets.BENCH / "out"


def _lines(collapsed: Path, top: int) -> list[str]:
    got = profile_phases.summarise(collapsed.read_text(), top)
    if not got["samples"]:
        return ["no samples"]
    out = [f"{got['samples']} samples", "", "self %  function"]
    out += [f"{pct:5.1f}  {f}" for f, pct in got["self"]]
    out += ["", "incl %  kvproxy function"]
    out += [f"{pct:5.1f}  {f}" for f, pct in got["inclusive"]]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", choices=["chat", "sse", "big", "streams"], default="chat")
    p.add_argument("--streams", type=int, default=1000, help="streams held open (streams)")
    p.add_argument("--target", choices=["kvproxy", "bare"], default="kvproxy", help="streams")
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    spy = profile_phases.ensure_py_spy()
    if isinstance(spy, str):
        print(spy, file=sys.stderr)
        return 2
    procstat.pin_self(targets.LOAD_CPU)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvbench-prof-") as tmp:
        work = Path(tmp)
        try:
            if args.workload == "streams":
                collapsed = _profile_streams(args, spy, work)
                return _print(args, collapsed)
            if args.workload == "sse":
                port = free_port()
                cmd = [
                    sys.executable,
                    str(targets.BENCH / "sse_upstream.py"),
                    "--port",
                    str(port),
                    "--chunks",
                    str(SSE_CHUNKS),
                ]
                m = Managed("sse", cmd, cpu=targets.LOAD_CPU, log=work / "sse.log").start()
                wait_port(port, proc=m)
            else:
                port = free_port()
                m = nginx.start_upstream(work / "up", port, cpu=targets.LOAD_CPU)
            up = targets.Upstream(f"http://127.0.0.1:{port}", port, m.pid)
            _, sim = targets.start_sim_prefill(work, pool_tokens=POOL_EXACT)
            opts = targets.KvproxyOptions(tokenizer=f"hf:{TOKENIZER_DIR}", engine_url=sim)
            run = targets.start_kvproxy(up, work, opts)
            workloads.check(run, chunks=SSE_CHUNKS if args.workload == "sse" else None)
            collapsed = OUT / f"profile-{args.workload}.txt"
            spy_cmd = [
                str(spy),
                "record",
                "--format",
                "raw",
                "--rate",
                "250",
                "--nonblocking",
                "-d",
                str(args.seconds),
                "-o",
                str(collapsed),
                "-p",
                str(run.pids[0]),
            ]
            spy_proc = subprocess.Popen(
                spy_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            time.sleep(0.5)
            if args.workload == "big":
                body = long_chat_body(4 * 1024 * 1024)
                deadline = time.monotonic() + args.seconds
                for _ in range(1000):
                    if time.monotonic() > deadline:
                        break
                    workloads.post(run.url, body)
            else:
                stream = args.workload == "sse"
                run_wrk(
                    run.url,
                    small_chat_body(stream=stream),
                    duration_s=args.seconds - 1,
                    connections=16 if stream else 32,
                )
            spy_proc.wait(args.seconds + 30)
        finally:
            stop_all()
    return _print(args, collapsed)


def _print(args: argparse.Namespace, collapsed: Path) -> int:
    who = args.target if args.workload == "streams" else "kvproxy"
    print(f"{who} under '{args.workload}' ({collapsed}):")
    print("\n".join(_lines(collapsed, args.top)))
    return 0


def _profile_streams(args: argparse.Namespace, spy: Path, work: Path) -> Path:
    """`--streams` paced streams through the target; py-spy over the window only."""
    plan = streams.StreamPlan((args.streams,), float(args.seconds))
    streams.raise_fd_limit()
    phase = streams.StreamsPhase(plan, work, print)
    _, up = streams.start_upstream(work, phase.most_events())
    phase.upstream_pid = up.pid
    conns = args.streams + 64
    if args.target == "bare":
        run = targets.start_bare(up, work, conns)
    else:
        _, sim = targets.start_sim_prefill(work, pool_tokens=POOL_EXACT)
        env = (("KVPROXY_UPSTREAM_MAX_CONNECTIONS", str(conns)),)
        opts = targets.KvproxyOptions(f"hf:{TOKENIZER_DIR}", sim, env)
        run = targets.start_kvproxy(up, work, opts)
    phase.warm_up(run)
    collapsed = OUT / f"profile-streams-{args.target}.txt"
    sched = streams.Schedule.make(time.monotonic(), args.streams, plan, phase.pace_s)
    spy_cmd = [str(spy), "record", "--format", "raw", "--rate", "250", "--nonblocking", "-d",
               str(args.seconds), "-o", str(collapsed), "-p", str(run.pids[0])]  # fmt: skip

    def start_spy() -> subprocess.Popen[bytes]:
        time.sleep(max(0.0, sched.window[0] - time.monotonic()))
        return subprocess.Popen(spy_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        spying = pool.submit(start_spy)
        step = phase.step(run, args.streams, procstat.memory(run.pids[0]).rss_kib)
        spying.result().wait(args.seconds + 30)
    print({k: step[k] for k in ("streams", "cpu_us_per_event", "target_cpu_share", "lost",
                                "late_p99_ms", "load_cpu_share")})  # fmt: skip
    if "lag_p99_ms" in step:
        print(f"loop lag p99 {step['lag_p99_ms']} ms")
    return collapsed


if __name__ == "__main__":
    sys.exit(main())
