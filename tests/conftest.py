"""Fixtures shared by the whole suite (helpers live in kvtest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from kvtest import FakeUpstream


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    up = FakeUpstream()
    yield up
    await up.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        yield session
