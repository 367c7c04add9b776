"""Shared state of the oracle suites: one model-by-model pass per session (`fast_run`: one
model per template family; `slow_run`: every shipped template), which the corpus and fuzz
tests read, and the per-template summary printed at the end of the run."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizer_files import cache_root

from oracles.models import REPRESENTATIVES, template_models
from oracles.report import REPORT
from oracles.run import Result, run_in_processes

# Fuzz examples per class and model: fast (9 models, in `make test`) and slow.
FAST_EXAMPLES = int(os.environ.get("KVPROXY_ORACLE_FAST_EXAMPLES", "4"))
SLOW_EXAMPLES = int(os.environ.get("KVPROXY_ORACLE_SLOW_EXAMPLES", "20"))

# Tests that need a real engine's own code (marker `real`: SGLang's preprocessing in its
# venv) are collected only under KVPROXY_REAL=1 (`make test-real`): the fast and slow
# suites never start them.
collect_ignore = [] if os.environ.get("KVPROXY_REAL") == "1" else ["test_oracle_sglang_real.py"]


def _once_per_run(
    name: str, build: Callable[[], Result], tmp: pytest.TempPathFactory, worker: str
) -> Result:
    """`build()` once per test run, not once per xdist worker: the first worker to ask builds
    it under a lock and leaves it pickled in the run's shared temp directory; the others wait
    and read it (the pass is derandomised, so every worker would have built the same). The
    fast pass was the fast suite's largest cost built three times (531 s of setup on a
    loaded machine, --durations)."""
    if worker == "master":  # not under xdist
        return build()
    shared = Path(tmp.getbasetemp()).parent
    path = shared / f"oracle-{name}.pickle"
    with (shared / f"oracle-{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            result: Result = pickle.loads(path.read_bytes())
            return result
        result = build()
        path.write_bytes(pickle.dumps(result))
        return result


@pytest.fixture(scope="session")
def fast_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Result:
    def build() -> Result:
        # In worker processes: under xdist the other workers wait for this pass (the lock
        # below), so its models may take the cores they leave (157 s on one core in CI).
        return run_in_processes(
            REPRESENTATIVES,
            FAST_EXAMPLES,
            derandomize=True,
            suite="fast",
            workers=os.cpu_count() or 1,
        )

    return _once_per_run("fast", build, tmp_path_factory, worker_id)


@pytest.fixture(scope="session")
def slow_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Result:
    def build() -> Result:
        # Every shipped template, one model at a time, was `make test-slow`'s longest serial
        # step: spread over the machine's cores (models share nothing; merged in order).
        return run_in_processes(
            tuple(template_models()),
            SLOW_EXAMPLES,
            derandomize=True,
            suite="slow",
            every_model=True,
            workers=os.cpu_count() or 1,
        )

    return _once_per_run("slow", build, tmp_path_factory, worker_id)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = REPORT.lines()
    if not lines:
        return
    terminalreporter.section("oracles: kvproxy vs each engine's preprocessing, per template")
    for line in lines:
        terminalreporter.write_line(line)
    path = cache_root() / "oracle-report.txt"
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        terminalreporter.write_line(f"(also in {path})")
