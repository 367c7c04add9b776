"""Failure mode 3: a failed KV send reported as drained (vulnerable: HTTP 200 with stale
pages, pages reused while writes are pending) or as an error (fixed)."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from sim_helpers import canary_text, chat, marker, reply_text, running_sim, stats, wait_until

# 2,000 tokens = 125 pages at 4 ms/page: the failed batch keeps landing for ~0.5 s.
SLOW_WIRE = {"transfer_ms_per_page": 4.0}


async def _seed_and_fail(http: aiohttp.ClientSession, base: str) -> tuple[int, dict[str, object]]:
    status, _ = await chat(http, base, canary_text("A", 3000), max_tokens=8)
    assert status == 200
    async with http.post(base + "/sim/faults", json={"transfer_failure_probability": 1.0}) as r:
        assert r.status == 200
    return await chat(http, base, canary_text("B", 2000), max_tokens=64)


async def _failed_counter(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sglang:num_transfer_failed_reqs_total":
                return float(sample.value)
    raise AssertionError("sglang:num_transfer_failed_reqs_total missing")


async def test_vulnerable_failed_send_is_treated_as_drained() -> None:
    async with running_sim(mode="vulnerable", **SLOW_WIRE) as sim, aiohttp.ClientSession() as http:
        status, body = await _seed_and_fail(http, sim.router_url)

        async def landed_late() -> bool:
            decode = await stats(http, sim.decode_url)
            return bool(decode["pages_landed"] >= 188 + 125)

        await wait_until(landed_late)
        truth = await stats(http, sim.router_url)
        failed = await _failed_counter(http, sim.prefill_url)
    assert status == 200
    assert marker("A") in reply_text(body)
    assert truth["prefill"]["transfer_failures"] == 1
    assert failed == 1.0
    decode = truth["decode"]
    assert decode["transfer_failures"] == 0  # decode was told the transfer drained
    assert decode["stale_page_reads"] > 0
    assert decode["pages_freed_before_drain"] > 0


async def test_fixed_failed_send_is_an_error_and_pages_wait_for_the_ack() -> None:
    async with running_sim(mode="fixed", **SLOW_WIRE) as sim, aiohttp.ClientSession() as http:
        status, body = await _seed_and_fail(http, sim.router_url)

        async def acked() -> bool:
            return bool((await stats(http, sim.decode_url))["abort_acks"] >= 1)

        await wait_until(acked)
        truth = await stats(http, sim.router_url)
        failed = await _failed_counter(http, sim.decode_url)
    assert status == 500
    assert body["object"] == "error"
    assert body["type"] == "InternalServerError"
    assert "KV transfer failed" in str(body["message"])
    assert marker("A") not in str(body)
    decode = truth["decode"]
    assert decode["transfer_failures"] == 1
    assert failed == 1.0
    assert decode["stale_page_reads"] == 0
    assert decode["pages_freed_before_drain"] == 0
    assert decode["late_writes_into_free_pages"] == 0


async def test_decode_gives_up_a_transfer_it_waited_too_long_for() -> None:
    """SGLang's waiting timeout (SGLANG_DISAGGREGATION_WAITING_TIMEOUT): a decode whose
    transfer never finishes in time fails the request instead of running forever (the
    fault suite's resets left decodes waiting on a prefill leg the router had cancelled)."""
    async with (
        running_sim(mode="fixed", transfer_ms_per_page=300.0) as sim,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(sim.router_url + "/sim/faults", json={"waiting_timeout_s": 0.3}) as r:
            assert r.status == 200
        status, body = await chat(http, sim.router_url, canary_text("A", 200), max_tokens=8)

        async def idle() -> bool:
            return bool((await stats(http, sim.decode_url))["running"] == 0)

        await wait_until(idle)
        decode = await stats(http, sim.decode_url)
    assert status == 500
    assert "waiting timed out" in str(body["message"])
    assert decode["waiting_timeouts"] == 1
    assert decode["transfer_failures"] == 1
