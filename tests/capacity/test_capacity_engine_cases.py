"""The engines' own arithmetic, case by case, through kvproxy against the simulator.

For each case the simulator runs the engine's rule (kvproxy/sim/limits.py, written on its
own) and kvproxy derives its limit from what the engine reports. A limit-1 / limit /
limit+1 sweep is sent through kvproxy, and the same requests straight to the simulated
engines: kvproxy must admit exactly what the engine accepts, judged on the simulator's
ground truth (its status codes and its `/sim/stats` counters), never on kvproxy's numbers.
Each limit below is worked out by hand from the engine's rule.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
from kvtest import sim_and_proxy

GENERATE = "/generate"
COMPLETIONS = "/v1/completions"


async def stats(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/sim/stats") as resp:
        data: dict[str, Any] = await resp.json()
        return data


def refused(truth: dict[str, Any]) -> int:
    """Every refusal the engines made, including the vulnerable prefill's pending one."""
    return sum(
        int(truth[role][key])
        for role in ("prefill", "decode")
        for key in ("rejections_at_admission", "pending_rejections")
    )


# Pages of one token make the default per-page transfer time minutes per sweep.
FAST = {"prefill_us_per_token": 0.0, "transfer_ms_per_page": 0.0, "decode_ms_per_token": 0.0}


def generate(n: int, max_new: int) -> dict[str, Any]:
    # Token ids: kvproxy counts them exactly, the simulator takes them as they are.
    return {"input_ids": [7] * n, "sampling_params": {"max_new_tokens": max_new}}


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    async with http.post(url, data=orjson.dumps(body)) as resp:
        await resp.read()
        return resp.status


async def sweep(
    http: aiohttp.ClientSession,
    sim: Any,
    proxy: Any,
    route: str,
    bodies: dict[int, dict[str, Any]],
) -> dict[int, tuple[int, int]]:
    """(kvproxy status, engine status) per prompt length; asserts kvproxy never admitted
    what the engine refused (the engine's own refusal counter stays put through kvproxy)."""
    out = {}
    for n, body in bodies.items():
        before = refused(await stats(http, sim.router_url))
        via_proxy = await post(http, proxy.public_url + route, body)
        after = refused(await stats(http, sim.router_url))
        assert after == before, f"kvproxy let through a {n}-token prompt the engine refused"
        direct = await post(http, sim.router_url + route, body)
        out[n] = (via_proxy, direct)
    return out


async def capacity(http: aiohttp.ClientSession, proxy: Any) -> dict[str, Any]:
    async with http.get(proxy.admin_url + "/capacity") as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def test_sglang_eagle_reserve_binds_below_the_context(http: aiohttp.ClientSession) -> None:
    # EAGLE topk 1 x 3 steps, 16 draft tokens: SGLang reserves max(3, 16) = 16 of the
    # 8,192-token context, refusing input + 16 >= 8,192, so the largest prompt is 8,175
    # (the old fixed 7 admitted up to 8,185).
    sim_opts = {
        **FAST,
        "mode": "fixed",  # refusals answered as 400, not the incident's placeholder
        "context_length": 8192,
        "prefill_pool_tokens": 20000,
        "decode_pool_tokens": 20000,
        "page_size": 1,
        "speculative_algorithm": "EAGLE",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 16,
    }
    async with sim_and_proxy(sim_opts) as (sim, proxy):
        lim = proxy.services.models.first.capacity.limits()
        # 8,175 with no output; with one output token the total check (prompt + 16 + 1
        # within the context, the older >= reading) publishes 8,174.
        assert (lim.input_limit_tokens, lim.admission_limit_tokens) == (8175, 8174)
        got = await sweep(
            http, sim, proxy, GENERATE, {n: generate(n, 0) for n in (8174, 8175, 8176)}
        )
        assert got == {8174: (200, 200), 8175: (200, 200), 8176: (400, 400)}
        # The total check counts the reserve too: prompt + 16 + output within the context.
        # kvproxy keeps the older >= reading (one token stricter than current builds' >).
        got = await sweep(http, sim, proxy, GENERATE, {8174: generate(8174, 1)})
        assert got == {8174: (200, 200)}
        got = await sweep(http, sim, proxy, GENERATE, {8170: generate(8170, 7)})
        assert got == {8170: (400, 400)}
        prefill = next(
            e for e in (await capacity(http, proxy))["engines"] if e["role"] == "prefill"
        )
        m = prefill["measurement"]
        assert "speculative_num_draft_tokens = 16" in m["sources"]["input_limit_tokens"]
        assert "server_info.speculative_algorithm" in m["fields"]["present"]


async def test_sglang_dcp_scales_the_pool(http: aiohttp.ClientSession) -> None:
    # DCP 2 over a 5,322-token rank pool: max_req_len = min(16,383, 10,644 - 1) = 10,643,
    # max_req_input_len 10,638, so the largest prompt is 10,637 (the per-rank reading
    # refused everything above 5,315).
    sim_opts = {
        **FAST,
        "mode": "fixed",  # refusals answered as 400, not the incident's placeholder
        "context_length": 16384,
        "prefill_pool_tokens": 5322,
        "decode_pool_tokens": 16384,
        "page_size": 1,
        "dcp_size": 2,
    }
    async with sim_and_proxy(sim_opts) as (sim, proxy):
        assert proxy.services.models.first.capacity.limits().admission_limit_tokens == 10637
        got = await sweep(
            http, sim, proxy, GENERATE, {n: generate(n, 1) for n in (10636, 10637, 10638)}
        )
        assert got == {10636: (200, 200), 10637: (200, 200), 10638: (400, 400)}
        truth = await stats(http, sim.router_url)
        assert truth["prefill"]["pool"]["rank_pool_tokens"] == 5322
        assert truth["prefill"]["limits"]["largest_prompt"] == 10637


async def test_vllm_dp2_without_kv_cache_size_tokens(http: aiohttp.ClientSession) -> None:
    # Two DP engines of 5,322 tokens each; the build exports no kv_cache_size_tokens and
    # num_gpu_blocks is the front end's sum (10,644). max_model_len 4,096 fits one engine,
    # so the largest prompt is 4,095 and each engine's pool is 5,322, not 10,644.
    sim_opts = {
        **FAST,
        "mode": "fixed",
        "flavor": "vllm",
        "context_length": 4096,
        "prefill_pool_tokens": 5322,
        "decode_pool_tokens": 5322,
        "page_size": 1,
        "dp_size": 2,
        "kv_cache_size_label": False,
    }
    async with sim_and_proxy(sim_opts) as (sim, proxy):
        lim = proxy.services.models.first.capacity.limits()
        assert lim.admission_limit_tokens == 4095
        bodies = {
            n: {"model": "kvproxy-sim", "prompt": [7] * n, "max_tokens": 0}
            for n in (4094, 4095, 4096)
        }
        got = await sweep(http, sim, proxy, COMPLETIONS, bodies)
        assert got == {4094: (200, 200), 4095: (200, 200), 4096: (400, 400)}
        snap = await capacity(http, proxy)
        truth = await stats(http, sim.router_url)
        for e in snap["engines"]:
            m = e["measurement"]
            assert m["pool_tokens"] == truth[e["role"]]["pool"]["rank_pool_tokens"] == 5322
            assert "/2 engines" in m["sources"]["pool_tokens"]
            assert "pool_from_blocks" in m["warnings"]
            assert any("kv_cache_size_tokens" in f for f in m["fields"]["absent"])


async def test_unified_pool_limit_is_reachable_with_an_output(http: aiohttp.ClientSession) -> None:
    # Issue #15.5 on a pool of 5,007 tokens in pages of 1: the admission limit is 5,000
    # (max_req_input_len 5,001 - 1). The scheduler serves prompt + output uncut while
    # max_new <= min(5,006 - P - 1, 5,007 - P - 1 - 1) = 5 at P = 5,000, so a 5,000-token
    # prompt with max_tokens 1..5 is served in full; 6 would be cut silently.
    sim_opts = {
        **FAST,
        "mode": "fixed",  # refusals answered as 400, not the incident's placeholder
        "context_length": 8192,
        "prefill_pool_tokens": 5007,
        "decode_pool_tokens": 5007,
        "page_size": 1,
    }
    async with sim_and_proxy(sim_opts) as (sim, proxy):
        lim = proxy.services.models.first.capacity.limits()
        assert (lim.admission_limit_tokens, lim.decode_limit_tokens) == (5000, 5005)
        for max_new, expect in ((1, 200), (5, 200), (6, 400)):
            before = await stats(http, sim.router_url)
            status = await post(http, proxy.public_url + GENERATE, generate(5000, max_new))
            after = await stats(http, sim.router_url)
            assert status == expect, max_new
            # Nothing kvproxy admitted was cut or refused by the engine.
            assert after["decode"]["outputs_clamped"] == before["decode"]["outputs_clamped"]
            assert refused(after) == refused(before)
        # What kvproxy refused is what the engine could not serve in full: sent straight,
        # the engine answers 200 but silently cuts the output.
        before = await stats(http, sim.router_url)
        assert await post(http, sim.router_url + GENERATE, generate(5000, 6)) == 200
        after = await stats(http, sim.router_url)
        assert after["decode"]["outputs_clamped"] == before["decode"]["outputs_clamped"] + 1


async def test_pages_of_16_keep_the_limit_reachable_without_output(
    http: aiohttp.ClientSession,
) -> None:
    # Both pools 5,312 tokens in pages of 16: the largest prompt is 5,305 with no output.
    # The scheduler's page-aware clamp leaves 5,312 - ceil16(P) - 16 - 1 output tokens, none
    # at all past P = 5,280; kvproxy's linear bound serves prompt + output uncut up to
    # 5,312 - 32 = 5,280, so the published limit (one output token) is 5,279.
    sim_opts = {
        **FAST,
        "mode": "fixed",
        "context_length": 8192,
        "prefill_pool_tokens": 5312,
        "decode_pool_tokens": 5312,
        "page_size": 16,
    }
    async with sim_and_proxy(sim_opts) as (sim, proxy):
        lim = proxy.services.models.first.capacity.limits()
        assert (lim.input_limit_tokens, lim.decode_limit_tokens) == (5305, 5280)
        assert lim.admission_limit_tokens == 5279
        # One output token: the published limit is admitted and served in full, one more is
        # refused as too long a prompt (not as too many output tokens: 1 is the least).
        got = await sweep(http, sim, proxy, GENERATE, {5279: generate(5279, 1)})
        assert got == {5279: (200, 200)}
        async with http.post(proxy.public_url + GENERATE, json=generate(5280, 1)) as r:
            assert r.status == 400
            assert r.headers["X-Kvproxy-Error-Code"] == "context_length_exceeded"
            assert "accepts at most 5,279" in (await r.json())["error"]["message"]
        # No output asked: the input-only limit is reachable and the engine serves it.
        got = await sweep(
            http, sim, proxy, GENERATE, {n: generate(n, 0) for n in (5304, 5305, 5306)}
        )
        assert got == {5304: (200, 200), 5305: (200, 200), 5306: (400, 400)}
        # One output token at 5,290: the engine would answer 200 with nothing generated.
        before = await stats(http, sim.router_url)
        assert await post(http, proxy.public_url + GENERATE, generate(5290, 1)) == 400
        assert await post(http, sim.router_url + GENERATE, generate(5290, 1)) == 200
        after = await stats(http, sim.router_url)
        assert after["decode"]["outputs_clamped"] == before["decode"]["outputs_clamped"] + 1
