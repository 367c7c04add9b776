"""The real-engine suite (`make test-real`): real vLLM engines, see engines.py.

Collected only when KVPROXY_REAL=1 (the Makefile target sets it), so the fast and slow suites
never start an engine; every test here is marked `real` as well. The fixtures (engines.py's
interface) start each engine at most once per run, on first use, and stop its process group at
the end of the run, failure or not.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from engines import (
    UNIFIED_BLOCKS,
    UNIFIED_MAX_MODEL_LEN,
    PDPair,
    VllmEngine,
    build_model,
    pd_pair,
    start_engine,
)

collect_ignore_glob = [] if os.environ.get("KVPROXY_REAL") == "1" else ["*.py"]


# pytest-timeout counts fixture setup: the first test that asks for the pair waits for two
# engines to start (measured up to ~3 min on a loaded 2-core machine) and for the first NIXL
# transfer (its handshake; up to ~130 s under load average 11). Still bounded.
REAL_TEST_TIMEOUT_S = 900


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.real)
            item.add_marker(pytest.mark.timeout(REAL_TEST_TIMEOUT_S))


@pytest.fixture(scope="session")
def real_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every engine's, router's and kvproxy's log of this run (kept by pytest's tmp dirs)."""
    return tmp_path_factory.mktemp("real-engines")


@pytest.fixture(scope="session")
def real_model() -> Path:
    return build_model()


@pytest.fixture(scope="session")
def vllm_unified(real_model: Path, real_logs: Path) -> Iterator[VllmEngine]:
    engine = VllmEngine("unified", real_model, real_logs, UNIFIED_MAX_MODEL_LEN, UNIFIED_BLOCKS)
    with start_engine(engine):
        yield engine


@pytest.fixture(scope="session")
def vllm_pd(real_model: Path, real_logs: Path) -> Iterator[PDPair]:
    with pd_pair(real_model, real_logs) as pair:
        yield pair
