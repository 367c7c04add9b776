"""Loopback ports for tests that must name a port before its server binds it (subprocesses:
`kvproxy serve`/`sim`/`demo`, redis-server, prometheus) or that want a port nobody serves.

In-process servers bind port 0 and read the port back (kvtest.FakeUpstream, `serving`,
`running_proxy`); use that whenever the server is ours. This module exists for the rest,
and must stay safe while pytest-xdist workers and other developers' test sessions on the
same machine ask for ports at the same moment. A port is handed out only when

- it lies below the kernel's ephemeral range (`ip_local_port_range`): bind(0) and outgoing
  connect() never pick such a port, so nobody takes it between our probe and the server's
  bind (the race of the old bind-0-then-release helper);
- this process holds an exclusive lock on that port's file in a machine-wide directory
  until it exits, so no other test process on the machine hands out the same port;
- a bind to it (without SO_REUSEADDR, so a port in TIME_WAIT is skipped too) succeeded.

A process never hands out the same port twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import random
import socket
import tempfile
from pathlib import Path
from typing import IO

# Below the ephemeral range, with 200 ports of margin; nothing in the suite binds a fixed
# port in the span below it (the demo's fixed ports are 8080, 9090 and 30000-30002, which
# the span's upper end, 32568, would include: they are skipped explicitly).
_SPAN = 12_000
_FIXED = frozenset({30000, 30001, 30002})
_LOCK_DIR = Path(tempfile.gettempdir()) / "kvproxy-test-ports"


class _Reservations:
    """This process's ports: the lock files it holds, and where the next search starts."""

    def __init__(self) -> None:
        self.held: dict[int, IO[bytes]] = {}
        self.cursor: int | None = None

    def range(self) -> tuple[int, int]:
        try:
            text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text(encoding="ascii")
            ephemeral_low = int(text.split()[0])
        except (OSError, ValueError, IndexError):
            ephemeral_low = 32768  # Linux's default range starts here
        high = ephemeral_low - 200
        return max(1024, high - _SPAN), high

    def reserve(self, port: int) -> bool:
        """Lock `port` for this process's lifetime; True if it can also be bound now."""
        if port in self.held or port in _FIXED:
            return False
        try:
            _LOCK_DIR.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):
                _LOCK_DIR.chmod(0o1777)  # machine-wide: every user's sessions share it
            lock = (_LOCK_DIR / str(port)).open("ab")
        except OSError:
            return False
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            return False  # another test process holds it
        # Held from here on, even when the bind fails (never tried again by this process).
        self.held[port] = lock
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
        except OSError:
            return False  # served by something outside this scheme, or in TIME_WAIT
        return True

    def run(self, n: int) -> int:
        low, high = self.range()
        if self.cursor is None:
            # A random start per process: workers and sessions begin far apart.
            self.cursor = random.SystemRandom().randrange(low, high)
        for _ in range(2_000):  # bounded: every miss moves the cursor on
            base = self.cursor
            self.cursor = base + n if base + 2 * n <= high else low
            if base + n > high:
                continue
            if all(self.reserve(port) for port in range(base, base + n)):
                return base
        raise RuntimeError(f"no run of {n} free loopback ports in {low}-{high}")


_RESERVATIONS = _Reservations()


def free_port() -> int:
    """A loopback port reserved for this process (see the module docstring)."""
    return _RESERVATIONS.run(1)


def free_port_run(n: int = 3) -> int:
    """A base port with n consecutive ports reserved (the simulator's three servers)."""
    return _RESERVATIONS.run(n)
