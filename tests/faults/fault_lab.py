"""The fault suite's network: two namespaces joined to this one by veth pairs, and the
iptables rules that break the links between them.

Addresses come from one private range, 10.235.35.0/27 (RFC 1918), in /30 links; the side in
this (the test's own) namespace is .1/.5/.9/.13, the far side .2/.6/.10/.14:

    kvproxy (here) ── 10.235.35.1 ─ 10.235.35.2  ── "up" ns: the simulator, smg
    driver  (here) ── 10.235.35.5 ─ 10.235.35.6  ── "up" ns (ground truth: /sim/stats)
    kvproxy (here) ── 10.235.35.9 ─ 10.235.35.10 ── "redis" ns: redis-server
    driver  (here) ── 10.235.35.13 ─ 10.235.35.14 ── "redis" ns (Redis state)

kvproxy and the driver (pytest) run in this namespace, so kvproxy's memory, fds and tasks are
read directly; the faults are rules in the far namespaces matching only kvproxy's link
(.2, .10), so the driver's reads of the ground truth never cross a fault. Nothing is routed or
forwarded (every pair is a point-to-point /30), no rule is put in this namespace, and
deleting the far namespaces removes their veths and rules. One lab at a time per machine (a
lock file), since the addresses are fixed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO

RANGE = "10.235.35.0/27"
UP, UP_TRUTH, REDIS, REDIS_TRUTH = "10.235.35.2", "10.235.35.6", "10.235.35.10", "10.235.35.14"
LOCK = "/tmp/kvproxy-faults.lock"
LINKS = (  # (local address, far address, far namespace role)
    ("10.235.35.1", UP, "up"),
    ("10.235.35.5", UP_TRUTH, "up"),
    ("10.235.35.9", REDIS, "redis"),
    ("10.235.35.13", REDIS_TRUTH, "redis"),
)


def missing_tools() -> list[str]:
    return [t for t in ("ip", "iptables") if shutil.which(t) is None]


def run(*argv: str) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")
    return out.stdout


@dataclass
class Lab:
    tag: str = field(default_factory=lambda: f"{os.getpid() % 0xFFFF:04x}")
    rules: dict[str, list[list[str]]] = field(default_factory=dict)
    _lock: IO[str] | None = None

    def ns(self, role: str) -> str:
        return f"kvpf{self.tag}{role[0]}"

    def exec_argv(self, role: str, argv: list[str]) -> list[str]:
        """`argv` run inside the far namespace `role` ("up" or "redis")."""
        return ["ip", "netns", "exec", self.ns(role), *argv]

    def build(self) -> None:
        self._lock = open(LOCK, "w")  # noqa: SIM115 (held for the lab's life)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self.teardown_namespaces()  # a previous run of this pid killed before its teardown
        for role in ("up", "redis"):
            run("ip", "netns", "add", self.ns(role))
            run("ip", "-n", self.ns(role), "link", "set", "lo", "up")
        for i, (here, far, role) in enumerate(LINKS):
            a, b = f"kvpf{self.tag}h{i}", f"kvpf{self.tag}f{i}"
            run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            run("ip", "link", "set", b, "netns", self.ns(role))
            run("ip", "addr", "add", f"{here}/30", "dev", a)
            run("ip", "-n", self.ns(role), "addr", "add", f"{far}/30", "dev", b)
            run("ip", "link", "set", a, "up")
            run("ip", "-n", self.ns(role), "link", "set", b, "up")

    def teardown_namespaces(self) -> None:
        for role in ("up", "redis"):
            ns = self.ns(role)
            if ns not in run("ip", "netns", "list"):
                continue
            # Only processes inside our own namespaces (ours by construction).
            for pid in run("ip", "netns", "pids", ns).split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            run("ip", "netns", "del", ns)
        for i in range(len(LINKS)):  # gone with their peers; a half-built lab may leave one
            name = f"kvpf{self.tag}h{i}"
            if os.path.exists(f"/sys/class/net/{name}"):
                # The namespace's deletion removes the pair asynchronously: gone meanwhile
                # is as good as deleted.
                subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)

    def teardown(self) -> None:
        try:
            self.teardown_namespaces()
        finally:
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    # --- faults ----------------------------------------------------------------------------

    def _rule(self, role: str, *spec: str) -> None:
        run("ip", "netns", "exec", self.ns(role), "iptables", "-I", *spec)
        self.rules.setdefault(role, []).append(list(spec))

    def blackhole(self, role: str, ports: tuple[int, ...], syn_only: bool = False) -> None:
        """Drop kvproxy's packets to `ports` in namespace `role` and the replies: a peer
        that vanished without FIN or RST. `syn_only`: only new connections (the connect
        phase), established ones carry on."""
        addr = UP if role == "up" else REDIS
        for port in ports:
            if syn_only:
                self._rule(role, "INPUT", "-d", addr, "-p", "tcp", "--dport", str(port),
                           "--syn", "-j", "DROP")  # fmt: skip
                continue
            self._rule(role, "INPUT", "-d", addr, "-p", "tcp", "--dport", str(port), "-j", "DROP")
            self._rule(role, "OUTPUT", "-s", addr, "-p", "tcp", "--sport", str(port), "-j", "DROP")

    def reset(self, role: str, ports: tuple[int, ...]) -> None:
        """Reset kvproxy's connections to `ports`: the server's established sockets are
        destroyed (`ss -K`: kvproxy gets an RST at once, mid-transfer or idle), and while the
        rule stands every packet of kvproxy's is answered with RST (a connect is refused)."""
        addr = UP if role == "up" else REDIS
        peer = "10.235.35.1" if role == "up" else "10.235.35.9"
        for port in ports:
            self._rule(role, "INPUT", "-d", addr, "-p", "tcp", "--dport", str(port),
                       "-j", "REJECT", "--reject-with", "tcp-reset")  # fmt: skip
            # Not the resets themselves: REJECT's own RST leaves through OUTPUT too, and a
            # rule that caught it would turn the reset into a blackhole.
            self._rule(role, "OUTPUT", "-s", addr, "-p", "tcp", "--sport", str(port),
                       "!", "--tcp-flags", "RST", "RST",
                       "-j", "REJECT", "--reject-with", "tcp-reset")  # fmt: skip
            run("ip", "netns", "exec", self.ns(role), "ss", "-K", "-t", "dst", peer,
                "sport", "=", f":{port}")  # fmt: skip

    def heal(self, role: str | None = None) -> None:
        for r in [role] if role else list(self.rules):
            if self.rules.pop(r, None):
                run("ip", "netns", "exec", self.ns(r), "iptables", "-F")


@contextmanager
def lab() -> Iterator[Lab]:
    the = Lab()
    try:
        the.build()
        yield the
    finally:
        the.teardown()
