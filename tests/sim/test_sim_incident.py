"""The incident, with no proxy: a pending-rejection prompt is still transferred and decode
reads another tenant's pages (vulnerable), or is refused at admission untouched (fixed)."""

from __future__ import annotations

import json

import aiohttp
from sim_helpers import (
    CHAT,
    canary_text,
    chat,
    marker,
    reply_text,
    running_sim,
    sse_payloads,
    stats,
)

# Prefill pool 5,322 tokens -> max_req_input_len 5,316: a chat of
# 6,000 bytes (byte tokenizer) is over the prefill limit yet under context 8,192 and under
# decode's own limit (8,186): the incident's shape.
OVER_LIMIT_BYTES = 6000


async def _seed_tenant_a(http: aiohttp.ClientSession, base: str) -> None:
    status, body = await chat(http, base, canary_text("A", 3000), max_tokens=64)
    assert status == 200
    assert marker("A")[:10] in reply_text(body)


async def test_vulnerable_over_limit_prompt_gets_200_with_another_tenants_canary() -> None:
    async with running_sim(mode="vulnerable") as sim, aiohttp.ClientSession() as http:
        await _seed_tenant_a(http, sim.router_url)
        status, body = await chat(
            http, sim.router_url, canary_text("B", OVER_LIMIT_BYTES), max_tokens=300
        )
        truth = await stats(http, sim.router_url)
    assert status == 200
    text = reply_text(body)
    assert marker("A") in text
    assert marker("B") not in text
    assert truth["prefill"]["pending_rejections"] == 1
    assert truth["decode"]["stale_page_reads"] > 0
    assert truth["prefill"]["transfers_started"] == 2


async def test_vulnerable_leak_also_reaches_a_stream() -> None:
    async with running_sim(mode="vulnerable") as sim, aiohttp.ClientSession() as http:
        await _seed_tenant_a(http, sim.router_url)
        body = {
            "model": "m",
            "stream": True,
            "max_tokens": 300,
            "messages": [{"role": "user", "content": canary_text("B", OVER_LIMIT_BYTES)}],
        }
        async with http.post(sim.router_url + CHAT, json=body) as resp:
            status, raw = resp.status, await resp.text()
    payloads = sse_payloads(raw)
    assert status == 200
    assert payloads[-1] == "[DONE]"
    text = "".join(json.loads(p)["choices"][0]["delta"].get("content") or "" for p in payloads[:-1])
    assert marker("A") in text


async def test_fixed_over_limit_prompt_is_refused_at_admission_untouched() -> None:
    async with running_sim(mode="fixed") as sim, aiohttp.ClientSession() as http:
        await _seed_tenant_a(http, sim.router_url)
        async with http.post(sim.router_url + "/sim/reset") as resp:
            assert resp.status == 200
        status, body = await chat(
            http, sim.router_url, canary_text("B", OVER_LIMIT_BYTES), max_tokens=300
        )
        truth = await stats(http, sim.router_url)
    assert status == 400
    assert body["object"] == "error"
    assert body["type"] == "BadRequestError"
    assert body["code"] == 400
    assert "exceeds the maximum allowed length (5316 tokens)" in body["message"]
    assert marker("A") not in json.dumps(body)
    for role in ("prefill", "decode"):
        assert truth[role]["transfers_started"] == 0
        assert truth[role]["pages_allocated"] == 0
        assert truth[role]["stale_page_reads"] == 0
    assert truth["prefill"]["rejections_at_admission"] == 1


async def test_fixed_stream_refusal_is_http_200_with_an_error_event() -> None:
    async with running_sim(mode="fixed") as sim, aiohttp.ClientSession() as http:
        body = {
            "model": "m",
            "stream": True,
            "messages": [{"role": "user", "content": canary_text("B", OVER_LIMIT_BYTES)}],
        }
        async with http.post(sim.router_url + CHAT, json=body) as resp:
            status, raw = resp.status, await resp.text()
        truth = await stats(http, sim.router_url)
    payloads = sse_payloads(raw)
    assert status == 200
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[0])["error"]
    assert error["code"] == 400
    assert "exceeds the maximum allowed length" in error["message"]
    assert truth["prefill"]["transfers_started"] == 0
    assert truth["decode"]["transfers_started"] == 0


async def test_prompt_over_context_is_refused_in_both_modes() -> None:
    async with running_sim(mode="vulnerable") as sim, aiohttp.ClientSession() as http:
        status, body = await chat(http, sim.router_url, canary_text("B", 9000))
        truth = await stats(http, sim.router_url)
    assert status == 400
    assert body["message"].startswith("The input (")
    assert "longer than the model's context length (8192 tokens)" in body["message"]
    assert truth["prefill"]["transfers_started"] == 0
