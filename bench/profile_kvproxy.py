"""Where kvproxy's CPU goes under one benchmark workload: py-spy, summarised per function.

Run: `.venv/bin/python bench/profile_kvproxy.py [--workload chat|sse|big] [--seconds 10]`.
It starts the same upstream, simulator and full-policy kvproxy as `bench/run.py`, drives
the workload with wrk (or 4 MB prompts for `big`), samples kvproxy with `py-spy record`
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
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import nginx
import procstat
import targets
import workloads
from payloads import long_chat_body, small_chat_body
from run import POOL_EXACT, SSE_CHUNKS, TOKENIZER_DIR
from servers import Managed, free_port, stop_all, wait_port
from wrk_driver import run_wrk

OUT = targets.BENCH / "out"
PY_SPY = targets.PEERS_VENV / "bin" / "py-spy"


def ensure_py_spy() -> Path:
    if PY_SPY.exists():
        return PY_SPY
    if not (targets.PEERS_VENV / "bin" / "pip").exists():
        subprocess.run([sys.executable, "-m", "venv", str(targets.PEERS_VENV)], check=True)
    pip = targets.PEERS_VENV / "bin" / "pip"
    subprocess.run([str(pip), "install", "-q", "--disable-pip-version-check", "py-spy"], check=True)
    return PY_SPY


def summarise(collapsed: Path, top: int) -> list[str]:
    """Self and inclusive sample shares per `file:function` from py-spy's collapsed stacks."""
    self_n: Counter[str] = Counter()
    incl_n: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, n_text = line.rpartition(" ")
        if not stack or not n_text.isdigit():
            continue
        n = int(n_text)
        total += n
        frames = [_frame(f) for f in stack.split(";")]
        if frames:
            self_n[frames[-1]] += n
        for f in set(frames):
            incl_n[f] += n
    if not total:
        return ["no samples"]
    out = [f"{total} samples", "", "self %  function"]
    out += [f"{100 * n / total:5.1f}  {f}" for f, n in self_n.most_common(top)]
    out += ["", "incl %  function"]
    out += [f"{100 * n / total:5.1f}  {f}" for f, n in incl_n.most_common(top)]
    return out


def _frame(raw: str) -> str:
    # py-spy writes "function (path/to/file.py:LINE)"; keep file:function, drop the line so
    # samples on different lines of one function add up.
    name, _, where = raw.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    short = path.split("site-packages/")[-1].split("/work/main/")[-1]
    return f"{short}:{name}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", choices=["chat", "sse", "big"], default="chat")
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    spy = ensure_py_spy()
    procstat.pin_self(targets.LOAD_CPU)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvbench-prof-") as tmp:
        work = Path(tmp)
        try:
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
    print(f"kvproxy under '{args.workload}' ({collapsed}):")
    print("\n".join(summarise(collapsed, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
