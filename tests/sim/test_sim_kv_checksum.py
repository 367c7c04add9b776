"""The simulator's posture knobs: /server_info reports the version, transfer backend and
--disaggregation-enable-kv-checksum as configured, and the checksum has its effect (SGLang
PR #39500): with it on both sides, a failed send reported as drained is caught on decode,
aborted and counted instead of decoded from stale pages."""

from __future__ import annotations

from typing import Any

import aiohttp
from sim_helpers import canary_text, chat, marker, running_sim, stats, wait_until

# 2,000 tokens = 125 pages, sent one page per batch: a failure leaves most never sent.
FAILING_WIRE: dict[str, Any] = {"transfer_ms_per_page": 4.0, "transfer_batch_pages": 1}


async def server_info(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/server_info") as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def test_server_info_reports_the_posture_as_configured() -> None:
    async with running_sim() as sim, aiohttp.ClientSession() as http:
        default = await server_info(http, sim.decode_url)
    assert default["version"] == "0.5.21-sim"
    assert default["disaggregation_transfer_backend"] == "mooncake"
    assert default["disaggregation_enable_kv_checksum"] is False
    opts = {"engine_version": "0.5.23", "transfer_backend": "nixl", "kv_checksum": True}
    async with running_sim(**opts) as sim, aiohttp.ClientSession() as http:
        for url in (sim.prefill_url, sim.decode_url):
            info = await server_info(http, url)
            assert info["version"] == "0.5.23"
            assert info["disaggregation_transfer_backend"] == "nixl"
            assert info["disaggregation_enable_kv_checksum"] is True


async def _seed_and_fail(http: aiohttp.ClientSession, base: str) -> tuple[int, dict[str, Any]]:
    status, _ = await chat(http, base, canary_text("A", 3000), max_tokens=8)
    assert status == 200
    async with http.post(base + "/sim/faults", json={"transfer_failure_probability": 1.0}) as r:
        assert r.status == 200
    return await chat(http, base, canary_text("B", 2000), max_tokens=64)


async def test_checksum_on_both_sides_catches_a_failed_send_reported_as_drained() -> None:
    async with (
        running_sim(mode="vulnerable", kv_checksum=True, **FAILING_WIRE) as sim,
        aiohttp.ClientSession() as http,
    ):
        status, body = await _seed_and_fail(http, sim.router_url)

        async def released() -> bool:
            decode = await stats(http, sim.decode_url)
            return bool(decode["pages_freed"] >= decode["pages_allocated"])

        await wait_until(released)
        truth = await stats(http, sim.router_url)
    assert status == 500
    assert "KV checksum mismatch" in str(body["message"])
    assert marker("A") not in str(body)
    assert truth["prefill"]["transfer_failures"] == 1  # prefill still reported "drained"
    decode = truth["decode"]
    assert decode["checksum_mismatches"] == 1
    assert decode["transfer_failures"] == 1
    assert decode["stale_page_reads"] == 0


async def test_checksum_on_prefill_only_protects_nothing() -> None:
    async with running_sim(mode="vulnerable", **FAILING_WIRE) as sim:
        await sim.stop_server("prefill")
        await sim.start_server("prefill", kv_checksum=True)
        async with aiohttp.ClientSession() as http:
            status, _ = await _seed_and_fail(http, sim.router_url)
            truth = await stats(http, sim.router_url)
    assert status == 200  # decode never verifies: the stale pages are read
    assert truth["decode"]["checksum_mismatches"] == 0
    assert truth["decode"]["stale_page_reads"] > 0


async def test_checksum_passes_a_healthy_transfer() -> None:
    async with running_sim(mode="fixed", kv_checksum=True, **FAILING_WIRE) as sim:
        async with aiohttp.ClientSession() as http:
            status, _ = await chat(http, sim.router_url, canary_text("A", 3000), max_tokens=8)
            truth = await stats(http, sim.router_url)
    assert status == 200
    assert truth["decode"]["checksum_mismatches"] == 0
    assert truth["decode"]["transfers_completed"] == 1
