"""The benchmark's profile step: where kvproxy's CPU goes in each policy-cost phase.

`bench/run.py` calls `profile_phases` after the policy-cost phase (not in `--tiny` mode):
for each step of `POLICY_STEPS` and for the SSE relay with the full policy, kvproxy is
started as that step configures it, wrk drives it for a few seconds and `py-spy record`
samples it; `section` renders the top entries per phase for RESULTS.md (self share: the
function itself; inclusive share: it and what it calls), and `summarise` is shared with
`bench/profile_kvproxy.py`.

The shares are fractions of the samples taken in that phase, so they compare within one
phase; the CPU µs per request of the phases are in the policy-cost table of the same run.

Must never: attach to a process it did not start, keep a raw profile outside bench/out/
(the stacks name functions only, never request content), or fail the run when py-spy cannot
be installed (the section then says why).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import targets
import workloads
from payloads import small_chat_body
from targets import Running, Upstream
from wrk_driver import run_wrk

PY_SPY = targets.PEERS_VENV / "bin" / "py-spy"
OUT = targets.BENCH / "out"
# Entries per phase in RESULTS.md: enough to see the policy's own functions.
TOP = 12
# Frames that are not work: the loop waiting in epoll shows as the Runner frame's self time
# only when nothing runs (py-spy skips idle threads), so it stays in; these are the
# interpreter's entry points, 100 % inclusive and saying nothing.
_ENTRY = ("<frozen runpy>", "kvproxy/__main__.py", "kvproxy/cli.py", "uvloop/__init__.py",
          "asyncio/runners.py:Runner.run", "asyncio/runners.py:run")  # fmt: skip

Step = tuple[str, str | None, tuple[tuple[str, str], ...], str]


def ensure_py_spy() -> Path | str:
    """py-spy from the project's venv (the dev extra has it), else bench/out/peers-venv
    (installed on first use), or why it is not there."""
    own = Path(sys.executable).parent / "py-spy"
    if own.exists():
        return own
    if PY_SPY.exists():
        return PY_SPY
    try:
        if not (targets.PEERS_VENV / "bin" / "pip").exists():
            subprocess.run([sys.executable, "-m", "venv", str(targets.PEERS_VENV)], check=True)
        pip = targets.PEERS_VENV / "bin" / "pip"
        cmd = [str(pip), "install", "-q", "--disable-pip-version-check", "py-spy"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"py-spy could not be installed: {type(exc).__name__}"
    return PY_SPY if PY_SPY.exists() else "py-spy could not be installed"


def frame_name(raw: str) -> str:
    """py-spy's "function (path/file.py:LINE)" as "file:function", lines merged."""
    name, _, where = raw.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    short = path.split("site-packages/")[-1].split("/lib/python3.11/")[-1]
    for root in ("/kvproxy/", "/bench/"):
        if root in short:
            short = root.strip("/") + "/" + short.split(root, 1)[1]
    return f"{short}:{name}"


def _stacks(collapsed_text: str) -> Iterator[tuple[str, int]]:
    """(stack, samples) per line of py-spy's collapsed output ("frame;frame;frame N")."""
    for line in collapsed_text.splitlines():
        stack, _, n_text = line.rpartition(" ")
        if stack and n_text.isdigit():
            yield stack, int(n_text)


def _shares(c: Counter[str], total: int, top: int) -> list[tuple[str, float]]:
    return [(k, round(100 * n / total, 1)) for k, n in c.most_common(top)]


def summarise(collapsed_text: str, top: int) -> dict[str, Any]:
    """Self and inclusive sample shares per `file:function` from py-spy's collapsed stacks."""
    self_n: Counter[str] = Counter()
    incl_n: Counter[str] = Counter()
    total = 0
    for stack, n in _stacks(collapsed_text):
        total += n
        frames = [frame_name(f) for f in stack.split(";")]
        if frames:
            self_n[frames[-1]] += n
        for f in set(frames):
            if not f.startswith(_ENTRY):
                incl_n[f] += n
    if not total:
        return {"samples": 0, "self": [], "inclusive": []}
    # kvproxy's own functions, inclusive: what the policy costs, stage by stage.
    own = Counter({f: n for f, n in incl_n.items() if f.startswith("kvproxy/")})
    return {
        "samples": total,
        "self": _shares(self_n, total, top),
        "inclusive": _shares(own, total, top),
    }


def record(
    pid: int, seconds: float, out: Path, drive: Callable[[], object], extra: Sequence[str] = ()
) -> str:
    """Sample `pid` with py-spy while `drive()` runs; the collapsed stacks as text.
    `extra`: more `py-spy record` flags."""
    spy_path = ensure_py_spy()
    if isinstance(spy_path, str):
        raise RuntimeError(spy_path)
    # The path ensure_py_spy found (the project's venv first): PY_SPY alone is only where
    # it is installed when the venv has none.
    cmd = [str(spy_path), "record", "--format", "raw", "--rate", "200", "--nonblocking", *extra]
    cmd += ["-d", str(max(1, round(seconds))), "-o", str(out), "-p", str(pid)]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)  # py-spy attaches before the load starts
        drive()
        spy.wait(seconds + 30)
    finally:
        if spy.poll() is None:
            spy.kill()
            spy.wait(10)
    return out.read_text() if out.exists() else ""


def gil_holders(pid: int, seconds: float, out: Path) -> dict[str, Any]:
    """What holds the GIL in `pid` for the next `seconds` (the caller keeps it loaded).

    `py-spy record --gil --threads` samples only the thread holding it (and nothing while no
    thread does), so each share is the part of the GIL-held time in which one thread (or one
    function, its own frame) kept every other thread, the event loop among them, from
    running Python. By thread name (numbered workers merged) and by the innermost frame."""
    spy = ensure_py_spy()
    if isinstance(spy, str):
        return {"skipped": spy}
    text = record(pid, seconds, out, lambda: None, extra=("--gil", "--threads"))
    return summarise_gil(text, seconds)


def summarise_gil(text: str, seconds: float) -> dict[str, Any]:
    """`gil_holders`' shares from py-spy's raw `--threads` output."""
    rows = list(_stacks(text))
    total = sum(n for _, n in rows)
    if not total:
        return {"seconds": seconds, "samples": 0, "threads": [], "functions": []}
    threads: Counter[str] = Counter()
    frames: Counter[str] = Counter()
    for stack, n in rows:
        # "thread (TID): NAME;frame;frame": worker threads are NAME_0, NAME_1, ...
        first, _, rest = stack.partition(";")
        threads[first.split(": ", 1)[-1].rstrip("0123456789").rstrip("_")] += n
        frames[frame_name(stack.rsplit(";", 1)[-1]) if rest else first] += n
    return {
        "seconds": seconds,
        "samples": total,
        "threads": _shares(threads, total, TOP),
        "functions": _shares(frames, total, TOP),
    }


def profile_phases(
    steps: Sequence[Step],
    opts_for: Callable[[str | None, tuple[tuple[str, str], ...]], targets.KvproxyOptions],
    chat: Upstream,
    sse: Upstream,
    *,
    seconds: float,
    sse_chunks: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """One short py-spy profile per policy step and of the SSE relay (full policy)."""
    spy = ensure_py_spy()
    if isinstance(spy, str):
        return {"skipped": spy}
    OUT.mkdir(parents=True, exist_ok=True)
    phases: dict[str, Any] = {}
    plan: list[tuple[str, str | None, tuple[tuple[str, str], ...], str, Upstream, bool]] = [
        (name, tok, env, path, chat, False) for name, tok, env, path in steps
    ]
    plan.append(("SSE relay (full policy)", None, (), "/v1/chat/completions", sse, True))
    for i, (name, tok, env, path, up, stream) in enumerate(plan):
        log(f"profile: {name}")
        run: Running | None = None
        try:
            run = targets.start_kvproxy(up, OUT, opts_for(tok, env))
            workloads.check(run, chunks=sse_chunks if stream else None)
            body = small_chat_body(stream=stream)
            conns = 16 if stream else 32
            text = record(
                run.pids[0],
                seconds,
                OUT / f"profile-phase-{i}.txt",
                lambda run=run, body=body, path=path, conns=conns: run_wrk(
                    run.url, body, path=path, duration_s=seconds - 1, connections=conns
                ),
            )
            phases[name] = summarise(text, TOP)
        except Exception as exc:  # one phase failing must not lose the others
            phases[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            if run is not None:
                run.stop()
    return {"seconds": seconds, "phases": phases}


def section(r: dict[str, Any]) -> list[str]:
    """The RESULTS.md section: per phase, the top self and kvproxy-inclusive entries."""
    prof = r.get("profile")
    if not prof:
        return []
    out = ["## Profile: where each phase's CPU goes (py-spy)", ""]
    if "skipped" in prof:
        return [*out, f"Not profiled: {prof['skipped']}.", ""]
    out += [
        f"kvproxy sampled by `py-spy record --rate 200` for {prof['seconds']:g} s per phase "
        "under the same wrk load as the phase (32 connections; 16 streams for SSE), "
        "configured as the policy-cost step of that name. Shares are % of that phase's "
        "samples: *self* is time in the function itself, *incl* is kvproxy's own functions "
        "with what they call. Compare shares within a phase; the µs are in the table above.",
        "",
    ]
    for name, p in prof["phases"].items():
        out += [f"### {name}", ""]
        if "error" in p:
            out += [f"Not profiled: {p['error']}", ""]
            continue
        rows = max(len(p["self"]), len(p["inclusive"]))
        out += [f"{p['samples']} samples.", ""]
        out += ["| self % | function | incl % | kvproxy function |", "|---|---|---|---|"]
        for k in range(rows):
            s = p["self"][k] if k < len(p["self"]) else ("", "")
            c = p["inclusive"][k] if k < len(p["inclusive"]) else ("", "")
            out.append(f"| {s[1]} | `{s[0]}` | {c[1]} | `{c[0]}` |".replace("``", ""))
        out.append("")
    return out


__all__ = ["gil_holders", "profile_phases", "section", "summarise", "summarise_gil"]
