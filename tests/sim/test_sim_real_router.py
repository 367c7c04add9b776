"""The real router, ``smg`` 1.13.0 (PyPI, Rust), in PD mode in front of the sim's prefill and
decode: it accepts them as workers, streams through them, and the incident reproduces
through it in vulnerable mode (and is refused with 400 in fixed mode)."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from real_router import real_router
from sim_helpers import (
    CHAT,
    canary_text,
    chat,
    marker,
    reply_text,
    running_sim,
    sse_payloads,
    stats,
    wait_until,
)

pytestmark = [pytest.mark.router, pytest.mark.slow]


async def test_streaming_through_the_real_router(tmp_path: Path) -> None:
    async with (
        running_sim() as sim,
        real_router(sim, tmp_path / "router.log") as router,
        aiohttp.ClientSession() as http,
    ):
        body = {
            "model": "kvproxy-sim",
            "stream": True,
            "max_tokens": 64,
            "messages": [{"role": "user", "content": canary_text("A", 200)}],
        }
        async with http.post(router.url + CHAT, json=body) as resp:
            status, raw = resp.status, await resp.text()
        truth = await stats(http, sim.router_url)
    payloads = sse_payloads(raw)
    assert status == 200
    assert payloads[-1] == "[DONE]"
    text = "".join(json.loads(p)["choices"][0]["delta"].get("content") or "" for p in payloads[:-1])
    assert text.startswith("<|user|>\ntenant A secret KVCANARY-A")
    # The real router sent the request to both engines with a bootstrap room.
    assert truth["prefill"]["requests_by_route"] == {CHAT: 1}
    assert truth["decode"]["requests_by_route"] == {CHAT: 1}
    assert truth["decode"]["transfers_completed"] == 1


async def test_incident_reproduces_through_the_real_router(tmp_path: Path) -> None:
    async with (
        running_sim(mode="vulnerable") as sim,
        real_router(sim, tmp_path / "router.log") as router,
        aiohttp.ClientSession() as http,
    ):
        status_a, _ = await chat(http, router.url, canary_text("A", 3000), max_tokens=8)
        status, body = await chat(http, router.url, canary_text("B", 6000), max_tokens=300)
        truth = await stats(http, sim.router_url)
    assert status_a == 200
    assert status == 200
    assert marker("A") in reply_text(body)
    assert truth["prefill"]["pending_rejections"] == 1
    assert truth["decode"]["stale_page_reads"] > 0


async def test_fixed_engine_refusal_passes_through_the_real_router(tmp_path: Path) -> None:
    async with (
        running_sim(mode="fixed") as sim,
        real_router(sim, tmp_path / "router.log") as router,
        aiohttp.ClientSession() as http,
    ):
        status, body = await chat(http, router.url, canary_text("B", 6000), max_tokens=300)

        async def decode_idle() -> bool:
            return bool((await stats(http, sim.decode_url))["running"] == 0)

        await wait_until(decode_idle)
        truth = await stats(http, sim.router_url)
    assert status == 400
    assert "exceeds the maximum allowed length" in json.dumps(body)
    assert truth["prefill"]["transfers_started"] == 0
    assert truth["decode"]["transfers_started"] == 0
    assert truth["decode"]["pages_allocated"] == 0
