"""Tests that import the engines' own code from their cached venvs (`make test-real`).

Collected only when KVPROXY_REAL=1; every test here is marked `real`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

collect_ignore_glob = [] if os.environ.get("KVPROXY_REAL") == "1" else ["*.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.real)
