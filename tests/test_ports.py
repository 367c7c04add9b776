"""tests/ports.py: ports handed out to one test process are never handed to another one at
the same time (pytest-xdist workers, other sessions on the machine), and lie where the
kernel never picks a port by itself (outside the ephemeral range)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import ports

TESTS = Path(__file__).resolve().parent


def test_ports_lie_below_the_ephemeral_range_and_are_never_repeated() -> None:
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    got = [ports.free_port() for _ in range(20)] + [ports.free_port_run(3) for _ in range(5)]
    assert all(p >= 1024 and p + 3 <= ephemeral_low for p in got), got
    singles, bases = got[:20], got[20:]
    handed = singles + [b + i for b in bases for i in range(3)]
    assert len(set(handed)) == len(handed)
    # A bind(0) gets a port from the ephemeral range: never one of ours.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        assert sock.getsockname()[1] >= ephemeral_low


def test_a_port_another_process_holds_is_not_handed_out_here() -> None:
    mine = ports._Reservations()
    low, _ = mine.range()
    start = low + 7_000  # away from where this process's own cursor is likely to be
    script = (
        "import sys, ports\n"
        f"ports._RESERVATIONS.cursor = {start}\n"
        "print(' '.join(str(ports.free_port()) for _ in range(30)), flush=True)\n"
        "sys.stdin.read()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=TESTS,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdout is not None
        assert child.stdin is not None
        theirs = {int(p) for p in child.stdout.readline().split()}
        assert len(theirs) == 30
        mine.cursor = start
        ours = {mine.run(1) for _ in range(30)}
        child.stdin.close()  # the child exits; leaving the block waits for it
    assert not ours & theirs
    # Once the other process exits, its locks are gone: its ports can be handed out again.
    again = ports._Reservations()
    again.cursor = start
    assert again.run(1) == min(theirs)
    for lock in [*mine.held.values(), *again.held.values()]:
        lock.close()
