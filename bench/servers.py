"""Starting, waiting for and stopping the processes a benchmark run needs.

Owns: free loopback ports, one `Managed` subprocess per server (own session, so stopping it
also stops its children, e.g. nginx workers), and waiting for an HTTP endpoint to answer.
Must never: stop a process it did not start, or leave one running when the run ends (every
`Managed` is registered and `stop_all()` runs at exit).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from procstat import pin_prefix

_RUNNING: list[Managed] = []


def free_port() -> int:
    """A port free right now on 127.0.0.1 (the kernel picks it; a tiny race is acceptable
    for a benchmark, and servers that can take port 0 themselves are not all of ours)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StartError(RuntimeError):
    """A server did not come up; the message carries the tail of its log."""


class Managed:
    """One server subprocess, pinned to a CPU, logging to a file (or /dev/null)."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        *,
        cpu: int | None,
        log: Path | None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.cmd = [*pin_prefix(cpu), *cmd]
        self.log = log
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Managed:
        out = open(self.log, "ab") if self.log else open(os.devnull, "wb")  # noqa: SIM115
        with out:
            self.proc = subprocess.Popen(
                self.cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env={**os.environ, **(self.env or {})},
                start_new_session=True,
            )
        _RUNNING.append(self)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} not started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 600) -> str:
        if self.log is None or not self.log.exists():
            return "(no log)"
        return self.log.read_text(errors="replace")[-chars:].strip()

    def stop(self, timeout_s: float = 10.0) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            # The session id is this child's pid (start_new_session): the group holds only
            # what it spawned itself (nginx workers), nothing else on the machine.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if self in _RUNNING:
            _RUNNING.remove(self)
        self.proc = None


def stop_all() -> None:
    for m in list(reversed(_RUNNING)):
        m.stop()


atexit.register(stop_all)


def wait_http(
    url: str,
    *,
    timeout_s: float = 30.0,
    expect: int = 200,
    proc: Managed | None = None,
) -> None:
    """Poll `url` until it answers `expect`; fail early if `proc` died meanwhile."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    for _ in range(int(timeout_s / 0.05) + 1):
        if proc is not None and not proc.alive():
            raise StartError(f"{proc.name} exited: {proc.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == expect:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
            if exc.code == expect:
                return
        except (OSError, urllib.error.URLError) as exc:
            last = str(exc)
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    tail = proc.log_tail() if proc is not None else ""
    raise StartError(f"{url} not ready after {timeout_s:.0f} s ({last}) {tail}".strip())


def wait_port(port: int, *, timeout_s: float = 15.0, proc: Managed | None = None) -> None:
    """Poll until something accepts TCP connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / 0.05) + 1):
        if proc is not None and not proc.alive():
            raise StartError(f"{proc.name} exited: {proc.log_tail()}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    raise StartError(f"port {port} not open after {timeout_s:.0f} s")
