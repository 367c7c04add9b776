"""The sim's admin surface parses the way the real engines' does, and bad input gets the
real engine's error (fields and names as in shared/facts/ENGINES.md)."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sim_helpers import CHAT, chat, running_sim

from kvproxy.sim.engine import EngineServer
from kvproxy.sim.state import EngineConfig


def _samples(text: str) -> dict[str, tuple[str, dict[str, str], float]]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = (family.type, dict(sample.labels), float(sample.value))
    return out


async def test_server_info_carries_the_runtime_pool_and_sglangs_input_limit() -> None:
    async with running_sim() as sim, aiohttp.ClientSession() as http:
        infos = {}
        for role, url in (("prefill", sim.prefill_url), ("decode", sim.decode_url)):
            for path in ("/server_info", "/get_server_info"):
                async with http.get(url + path) as resp:
                    assert resp.status == 200
                    infos[role, path] = await resp.json()
        async with http.get(sim.router_url + "/server_info") as resp:
            via_router = await resp.json()
    prefill = infos["prefill", "/server_info"]
    assert prefill == infos["prefill", "/get_server_info"]
    # 5,322 rounded down to whole 16-token pages, then min(ctx-1, pool-1) - 5.
    assert prefill["max_total_num_tokens"] == 5322
    assert prefill["max_req_input_len"] == 5316
    assert prefill["page_size"] == 16
    assert prefill["context_length"] == 8192
    assert prefill["disaggregation_mode"] == "prefill"
    assert prefill["allow_auto_truncate"] is False
    assert [s["memory_usage"]["token_capacity"] for s in prefill["internal_states"]] == [5322]
    decode = infos["decode", "/server_info"]
    assert decode["disaggregation_mode"] == "decode"
    assert decode["max_total_num_tokens"] == 16384
    assert decode["max_req_input_len"] == 8186
    # The router answers from the first prefill worker only, as the real one does.
    assert via_router["max_total_num_tokens"] == 5322


async def test_largest_accepted_prompt_is_min_of_context_and_pool_minus_7() -> None:
    async with (
        running_sim(mode="fixed", transfer_ms_per_page=0.0, prefill_us_per_token=0.0) as sim,
        aiohttp.ClientSession() as http,
    ):
        results = {}
        for n in (5315, 5316):
            body = {"input_ids": [65] * n, "sampling_params": {"max_new_tokens": 1}}
            async with http.post(sim.router_url + "/generate", json=body) as resp:
                results[n] = (resp.status, await resp.json())
    assert results[5315][0] == 200
    assert results[5315][1]["meta_info"]["prompt_tokens"] == 5315
    assert results[5316][0] == 400
    assert "Input length (5316 tokens)" in results[5316][1]["error"]["message"]


async def test_metrics_use_the_real_sglang_names() -> None:
    async with running_sim() as sim, aiohttp.ClientSession() as http:
        async with http.get(sim.prefill_url + "/metrics") as resp:
            assert resp.status == 200
            samples = _samples(await resp.text())
    kind, labels, value = samples["sglang:max_total_num_tokens"]
    assert (kind, value) == ("gauge", 5322.0)
    assert labels["engine_type"] == "prefill"
    assert set(labels) >= {"model_name", "engine_type", "tp_rank"}
    assert samples["sglang:context_len"][2] == 8192.0
    assert samples["sglang:page_size"][2] == 16.0
    for counter in (
        "sglang:num_transfer_failed_reqs_total",
        "sglang:num_bootstrap_failed_reqs_total",
    ):
        assert samples[counter][0] == "counter"
    assert "sglang:num_prefill_bootstrap_queue_reqs" in samples


async def test_model_info_models_and_tokenize() -> None:
    async with running_sim() as sim, aiohttp.ClientSession() as http:
        url = sim.decode_url
        async with http.get(url + "/model_info") as resp:
            model_info = await resp.json()
        async with http.get(url + "/get_model_info") as resp:
            assert await resp.json() == model_info
        async with http.get(url + "/v1/models") as resp:
            models = await resp.json()
        async with http.post(url + "/tokenize", json={"prompt": "héllo"}) as resp:
            tokens = await resp.json()
        async with http.post(url + "/tokenize", json={"messages": []}) as resp:
            no_messages = resp.status
    assert model_info["model_path"] == "kvproxy-sim"
    assert models["data"][0]["max_model_len"] == 8192
    assert tokens == {"tokens": list("héllo".encode()), "count": 6, "max_model_len": 8192}
    assert no_messages == 422  # SGLang's /tokenize does not apply chat templates


async def test_usage_prompt_tokens_counts_the_templated_prompt() -> None:
    async with running_sim() as sim, aiohttp.ClientSession() as http:
        status, body = await chat(http, sim.router_url, "hi", max_tokens=4)
    assert status == 200
    assert body["usage"]["prompt_tokens"] == len(b"<|user|>\nhi\n<|assistant|>\n")
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": [{"content": "x"}]}, "role"),
        (
            {"model": "m", "max_tokens": "ten", "messages": [{"role": "user", "content": "x"}]},
            "max_tokens",
        ),
        (
            {"model": "m", "max_tokens": 8190, "messages": [{"role": "user", "content": "xx"}]},
            "Requested token count exceeds the model's maximum context length of 8192",
        ),
    ],
)
async def test_bad_chat_input_gets_sglangs_400(body: dict[str, object], fragment: str) -> None:
    async with running_sim() as sim, aiohttp.ClientSession() as http:
        async with http.post(sim.router_url + CHAT, json=body) as resp:
            status, error = resp.status, await resp.json()
    assert status == 400
    assert error["object"] == "error"
    assert error["code"] == 400
    assert fragment in error["message"]


async def test_invalid_json_and_bad_generate_and_direct_calls() -> None:
    async with running_sim() as sim, aiohttp.ClientSession() as http:
        async with http.post(sim.prefill_url + CHAT, data=b"{not json") as resp:
            invalid = resp.status, await resp.json()
        async with http.post(sim.router_url + "/generate", json={"sampling_params": {}}) as resp:
            no_text = resp.status, await resp.json()
        async with http.post(sim.decode_url + "/generate", json={"text": "hi"}) as resp:
            direct = resp.status, await resp.json()
        async with http.post(sim.router_url + "/sim/faults", json={"nope": 1}) as resp:
            bad_fault = resp.status
    assert invalid[0] == 400
    assert invalid[1]["type"] == "BadRequestError"
    assert no_text[0] == 400
    assert "error" in no_text[1]
    assert direct[0] == 400
    assert "bootstrap" in direct[1]["error"]["message"]
    assert bad_fault == 400


async def test_vllm_flavor_exposes_cache_config_info_and_its_error_shape() -> None:
    async with (
        running_sim(flavor="vllm", context_length=4096) as sim,
        aiohttp.ClientSession() as http,
    ):
        async with http.get(sim.prefill_url + "/metrics") as resp:
            samples = _samples(await resp.text())
        async with http.get(sim.prefill_url + "/server_info") as resp:
            server_info = resp.status
        async with http.post(
            sim.prefill_url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
        ) as resp:
            tokenized = await resp.json()
        status, error = await chat(http, sim.router_url, "x" * 5000)
        ok_status, ok = await chat(http, sim.router_url, "hi", max_tokens=2)
    _, labels, value = samples["vllm:cache_config_info"]
    assert value == 1.0
    assert labels["block_size"] == "16"
    assert labels["num_gpu_blocks"] == "333"
    assert labels["kv_cache_size_tokens"] == "5322"
    assert server_info == 404
    assert ok_status == 200
    assert tokenized["count"] == ok["usage"]["prompt_tokens"]
    assert tokenized["max_model_len"] == 4096
    assert status == 400
    assert error["error"]["type"] == "BadRequestError"
    assert "maximum context length is 4096 tokens" in error["error"]["message"]


def test_vllm_refuses_to_start_when_context_exceeds_its_pool() -> None:
    with pytest.raises(ValueError, match="larger than the maximum number of tokens"):
        EngineServer(
            EngineConfig(role="prefill", flavor="vllm", context_length=8192, pool_tokens=5322)
        )


async def test_engine_restarts_with_a_smaller_pool_and_goes_down() -> None:
    async with running_sim() as sim, aiohttp.ClientSession() as http:
        url = sim.prefill_url
        await sim.set_pool_tokens("prefill", 2048)
        assert sim.prefill_url == url
        async with http.get(url + "/server_info") as resp:
            smaller = await resp.json()
        await sim.stop_server("decode")
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(sim.decode_url + "/health"):
                pass
        await sim.start_server("decode")
        async with http.get(sim.decode_url + "/health") as resp:
            back = resp.status
    assert smaller["max_total_num_tokens"] == 2048
    assert smaller["max_req_input_len"] == 2042
    assert back == 200
