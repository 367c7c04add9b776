"""The cancel race, with no proxy: a client leaves during the KV transfer, decode frees its
pages at once (vulnerable) and prefill's issued writes land in the next request's pages;
with deferred release (fixed) the pages wait for prefill's ABORT_ACK."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from sim_helpers import CHAT, canary_text, chat, marker, reply_text, running_sim, stats, wait_until

# 5,000-token transfer at 2 ms/page lands ~0.63 s after it is issued: a wide window to
# disconnect in, and to run the next (1,000-token, 1 ms/token) request inside.
RACE = {"transfer_ms_per_page": 2.0}


async def _disconnect_during_transfer(http: aiohttp.ClientSession, sim: Any) -> None:
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": canary_text("A", 5000)}],
    }
    resp = await http.post(sim.router_url + CHAT, json=body)
    try:
        assert resp.status == 200

        async def transfer_on_the_wire() -> bool:
            decode = await stats(http, sim.decode_url)
            return bool(decode["transfers_started"] >= 1)

        await wait_until(transfer_on_the_wire)
        decode = await stats(http, sim.decode_url)
        assert decode["transfers_completed"] == 0, "disconnect must happen mid-transfer"
    finally:
        resp.close()  # the client goes away; the router closes both legs

    async def decode_saw_abort() -> bool:
        return bool((await stats(http, sim.decode_url))["aborts"] >= 1)

    await wait_until(decode_saw_abort)


async def test_vulnerable_next_request_reads_previous_requests_late_writes() -> None:
    async with running_sim(mode="vulnerable", **RACE) as sim, aiohttp.ClientSession() as http:
        await _disconnect_during_transfer(http, sim)
        status, body = await chat(http, sim.router_url, canary_text("B", 1000), max_tokens=1000)
        truth = await stats(http, sim.router_url)
    assert status == 200
    assert marker("A") in reply_text(body)
    decode = truth["decode"]
    assert decode["late_writes_into_reallocated_pages"] > 0
    assert decode["pages_freed_before_drain"] > 0
    assert decode["stale_page_reads"] > 0
    assert decode["abort_acks"] == 0


async def test_fixed_holds_pages_until_abort_ack() -> None:
    async with running_sim(mode="fixed", **RACE) as sim, aiohttp.ClientSession() as http:
        await _disconnect_during_transfer(http, sim)
        status, body = await chat(http, sim.router_url, canary_text("B", 1000), max_tokens=1000)

        async def acked() -> bool:
            return bool((await stats(http, sim.decode_url))["abort_acks"] >= 1)

        await wait_until(acked)
        truth = await stats(http, sim.router_url)
    assert status == 200
    text = reply_text(body)
    assert marker("A") not in text
    assert marker("B") in text
    decode = truth["decode"]
    assert decode["late_writes_into_reallocated_pages"] == 0
    assert decode["late_writes_into_free_pages"] == 0
    assert decode["pages_freed_before_drain"] == 0
    assert decode["stale_page_reads"] == 0
    assert decode["abort_acks"] == 1
    assert decode["abort_ack_timeouts"] == 0


async def test_fixed_ack_timeout_is_counted_apart_and_proves_nothing() -> None:
    # The ack can only come once the batch landed (~0.6 s); a 50 ms timeout fires first.
    async with (
        running_sim(mode="fixed", abort_ack_timeout_s=0.05, **RACE) as sim,
        aiohttp.ClientSession() as http,
    ):
        await _disconnect_during_transfer(http, sim)

        async def timed_out() -> bool:
            return bool((await stats(http, sim.decode_url))["abort_ack_timeouts"] >= 1)

        await wait_until(timed_out)
        await asyncio.sleep(0)
        decode = await stats(http, sim.decode_url)
    assert decode["abort_ack_timeouts"] == 1
    assert decode["abort_acks"] == 0
    # Released on a timeout while writes were still in flight: the unsafe case, visible.
    assert decode["pages_freed_before_drain"] > 0
