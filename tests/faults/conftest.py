"""The fault suite (`make test-faults`): network namespaces, iptables and signals, as root.

Collected only when KVPROXY_FAULTS=1 (the Makefile target sets it), so the fast and slow
suites never start it; skipped with the reason when not root or without `ip`/`iptables`.
The namespaces and everything in them are torn down by the session fixture's finalizer,
failure or not. At the end the report is printed and written to bench/FAULTS.md.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

collect_ignore_glob = [] if os.environ.get("KVPROXY_FAULTS") == "1" else ["*.py"]

STARTED = time.monotonic()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from fault_lab import lab, missing_tools
    from fault_stack import Upstream

    if os.geteuid() != 0:
        pytest.skip("the fault suite needs root (network namespaces, iptables)")
    missing = missing_tools()
    if missing:
        pytest.skip(
            f"the fault suite needs {', '.join(missing)} (apt-get install iproute2 iptables)"
        )
    logs = tmp_path_factory.mktemp("faults")
    with lab() as the:
        up = Upstream(the, logs)
        try:
            asyncio.run(up.start())
            yield up
        finally:
            up.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from fault_report import ROWS, write_report

    if not ROWS:
        return
    commit = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        or "unknown"
    )
    text = write_report(commit, time.monotonic() - STARTED)
    terminalreporter.write_line("")
    for line in text.splitlines():
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"(written to {Path('bench/FAULTS.md')})")
