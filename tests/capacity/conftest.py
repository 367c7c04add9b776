"""Fixtures for the capacity tests: fake engines (see capacity_fakes.py), a client session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from capacity_fakes import EngineFactory, FakeEngine


@pytest.fixture
async def engines() -> AsyncIterator[EngineFactory]:
    """Factory: `await engines(kind, pool=..., context=...)` -> a started FakeEngine."""
    made: list[FakeEngine] = []

    async def make(kind: str = "sglang", **kw: Any) -> FakeEngine:
        eng = FakeEngine(kind, **kw)
        await eng.start()
        made.append(eng)
        return eng

    yield make
    for eng in made:
        await eng.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s
