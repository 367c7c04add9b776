"""CPU and memory of benchmark targets, read from /proc, and the facts about this machine.

Owns: CPU seconds of a process tree (utime + stime of the process, its threads and its live
descendants, e.g. nginx workers), VmRSS / VmHWM, CPU pinning, and the machine description
the report prints. Must never: signal, renice or otherwise touch a process it reads.

Why /proc and not `time` or psutil: the targets are long-lived servers measured over a
window, so the figure is a delta of the kernel's own counters taken right before and right
after each run; psutil would be one more dependency for a dozen lines.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return raw[raw.rfind(")") + 2 :].split()


def process_cpu_s(pid: int) -> float:
    """utime + stime of one process (all its threads), in seconds; 0 if it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    # After the name: state is index 0, utime index 11, stime index 12 (fields 14 and 15).
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def children(pid: int) -> list[int]:
    """Live child pids of `pid`, through every thread's `children` file."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
        except OSError:
            continue
        out.extend(int(p) for p in text.split())
    return out


def tree(pid: int) -> list[int]:
    """`pid` and all its live descendants (bounded: a server tree here has a handful)."""
    seen: list[int] = []
    todo = [pid]
    while todo and len(seen) < 256:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo.extend(children(p))
    return seen


def tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds of the given root processes and every live descendant of theirs."""
    total = 0.0
    for root in pids:
        for p in tree(root):
            total += process_cpu_s(p)
    return total


def listening_inodes(port: int) -> set[int]:
    """Socket inodes listening on TCP `port` (IPv4 and IPv6), from /proc/net/tcp*."""
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            # cols[1] is "ADDR:PORT" in hex, cols[3] the state (0A = LISTEN), cols[9] inode.
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(cols[9]))
    return inodes


def serves_port(pids: list[int], port: int) -> bool:
    """True when the listening socket on `port` is held by one of `pids` or their children:
    proof that requests to the port reach the target and not a stray process."""
    wanted = {f"socket:[{i}]" for i in listening_inodes(port)}
    if not wanted:
        return False
    for root in pids:
        for p in tree(root):
            try:
                fds = os.listdir(f"/proc/{p}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(f"/proc/{p}/fd/{fd}") in wanted:
                        return True
                except OSError:
                    continue
    return False


@dataclass(frozen=True)
class Memory:
    rss_kib: int
    hwm_kib: int

    @property
    def rss_mib(self) -> float:
        return self.rss_kib / 1024

    @property
    def hwm_mib(self) -> float:
        return self.hwm_kib / 1024


def memory(pid: int) -> Memory:
    """VmRSS (now) and VmHWM (peak since start) of one process."""
    values = {"VmRSS": 0, "VmHWM": 0}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return Memory(0, 0)
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in values:
            values[key] = int(rest.split()[0])
    return Memory(values["VmRSS"], values["VmHWM"])


def pin_prefix(cpu: int | None) -> list[str]:
    """`taskset -c N` when pinning is possible on this machine, else nothing."""
    if cpu is None or shutil.which("taskset") is None or (os.cpu_count() or 1) <= cpu:
        return []
    return ["taskset", "-c", str(cpu)]


def pin_self(cpu: int | None) -> bool:
    """Pin the calling process (the harness and its load generators) to one CPU."""
    if cpu is None or (os.cpu_count() or 1) <= cpu:
        return False
    os.sched_setaffinity(0, {cpu})
    return True


def _first_line(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unavailable"
    text = (done.stdout + done.stderr).strip()
    return text.splitlines()[0].strip() if text else "unavailable"


def machine() -> dict[str, str]:
    """What the report needs to say about where the numbers came from."""
    model = "unknown"
    lscpu = shutil.which("lscpu")
    if lscpu:
        for line in subprocess.run(
            [lscpu], capture_output=True, text=True, timeout=10, check=False
        ).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    return {
        "cpu_model": model,
        "cpus": str(os.cpu_count() or 1),
        "memory_gib": f"{mem_kib / 1024 / 1024:.1f}",
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def tool_version(tool: str) -> str:
    """Version of nginx or wrk as the binary reports it."""
    if tool == "nginx":
        line = _first_line(["nginx", "-v"])
        m = re.search(r"nginx/(\S+)", line)
        return m.group(1) if m else line
    if tool == "wrk":
        line = _first_line(["wrk", "-v"])
        m = re.search(r"wrk\s+(\S+)", line)
        return m.group(1) if m else line
    return "unknown"


def load_average() -> str:
    """The 1/5/15-minute load averages: a busy machine makes every figure worse."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])
