"""Fixtures shared by the whole suite (helpers live in kvtest.py)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from hypothesis import settings
from kvtest import SUMMARIES, FakeUpstream, SummarySections, add_summary
from shared_loads import shared_tokenizer_loads as _shared_loads

# CI (CI=true) runs every property test on a fixed sequence of examples, so a landing never
# depends on which examples one run happened to draw; local runs keep exploring, and what
# they find becomes a test of its own.
# No profile has a deadline: hypothesis's default (200 ms per example) is a timed assertion,
# and on a shared 2-core machine a loaded example outlives it (seen: a routing property
# "failing" only while other suites ran). Speed is the benchmarks' business.
settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="module")
def shared_tokenizer_loads() -> Iterator[None]:
    """Each `hf:` tokenizer loaded once for the module (tests/shared_loads.py): for modules
    that start a proxy or build a counter per test. `pytestmark =
    pytest.mark.usefixtures("shared_tokenizer_loads")`."""
    with _shared_loads():
        yield


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    up = FakeUpstream()
    yield up
    await up.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        yield session


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker hands its summary sections to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["kvproxy_summaries"] = session.config.stash.get(SUMMARIES, {})


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """The controller merges a finished worker's summary sections (xdist hook)."""
    config: pytest.Config = node.config  # type: ignore[attr-defined]
    sections: SummarySections = getattr(node, "workeroutput", {}).get("kvproxy_summaries", {})
    for title, (path, lines) in sections.items():
        add_summary(config, title, lines, path)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Sections tests added (e.g. the chat differential's over-counts), shown without -s."""
    if hasattr(terminalreporter.config, "workeroutput"):
        return
    for title, (path, lines) in sorted(terminalreporter.config.stash.get(SUMMARIES, {}).items()):
        if not lines:
            continue
        text = [lines[key] for key in sorted(lines)]
        terminalreporter.section(title)
        for line in text:
            terminalreporter.write_line(line)
        if path:
            with contextlib.suppress(OSError):
                Path(path).write_text("\n".join(text) + "\n", encoding="utf-8")
                terminalreporter.write_line(f"(also in {path})")
