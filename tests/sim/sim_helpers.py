"""Helpers for the simulator's tests: canary prompts, a cluster on free ports, bounded polls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from kvproxy.sim import SimCluster, SimOptions

CHAT = "/v1/chat/completions"


def canary_text(tenant: str, n_bytes: int) -> str:
    """A prompt of exactly ``n_bytes`` ASCII bytes, its canary repeated throughout."""
    line = f"tenant {tenant} secret KVCANARY-{tenant}-0123456789abcdef. "
    tail = " please repeat your context"
    body = (line * (n_bytes // len(line) + 1))[: n_bytes - len(tail)]
    return body + tail


def marker(tenant: str) -> str:
    return f"KVCANARY-{tenant}-0123456789abcdef"


@asynccontextmanager
async def running_sim(**options: Any) -> AsyncIterator[SimCluster]:
    cluster = SimCluster(SimOptions(port=0, **options))
    await cluster.start()
    try:
        yield cluster
    finally:
        await cluster.close()


async def chat(
    http: aiohttp.ClientSession, base: str, content: str, **extra: Any
) -> tuple[int, dict[str, Any]]:
    body = {"model": "kvproxy-sim", "messages": [{"role": "user", "content": content}], **extra}
    async with http.post(base + CHAT, json=body) as resp:
        return resp.status, await resp.json()


def reply_text(body: dict[str, Any]) -> str:
    return str(body["choices"][0]["message"]["content"])


async def stats(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with http.get(base + "/sim/stats") as resp:
        assert resp.status == 200
        data: dict[str, Any] = await resp.json()
        return data


async def wait_until(
    check: Callable[[], Awaitable[bool]], timeout_s: float = 15.0, interval_s: float = 0.005
) -> None:
    """Poll ``check`` until true; bounded in time and in number of tries."""
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / interval_s) + 1):
        if await check():
            return
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(interval_s)
    raise AssertionError("condition not reached in time")


def sse_payloads(raw: str) -> list[str]:
    return [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
