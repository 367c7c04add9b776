"""Fixtures shared by the whole suite (helpers live in kvtest.py)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import aiohttp
import pytest
from hypothesis import settings
from kvtest import FakeUpstream

# CI (CI=true) runs every property test on a fixed sequence of examples, so a landing never
# depends on which examples one run happened to draw; local runs keep exploring, and what
# they find becomes a test of its own.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    up = FakeUpstream()
    yield up
    await up.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        yield session
