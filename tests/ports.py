"""Loopback port helpers shared by every test that starts a server or a subprocess."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port that was free a moment ago (bound to 0, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_port_run(n: int = 3) -> int:
    """A base port with n consecutive free ports (the simulator's three servers).

    Each probe socket is closed whether its bind succeeds or not: a socket left open
    after a failed bind surfaced as a ResourceWarning in an unrelated later test.
    """
    for _ in range(50):  # bounded: a busy machine may need a few tries
        base = free_port()
        if base + n >= 65535:
            continue
        try:
            for port in range(base, base + n):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no run of free loopback ports")
