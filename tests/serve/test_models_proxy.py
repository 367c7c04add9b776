"""Several models through the running proxy, against two built-in simulator clusters with
different model names and pools, each behind its own router (the `upstream` of its entry).

Ground truth is each simulator's /sim/stats: its own arithmetic (`largest_prompt`) and what
reached its engines. Prompts are token ids (/v1/completions), so the count is exact whatever
the tokenizer: the real-tokenizer version of this test, behind smg, is tests/e2e.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from kvtest import running_proxy, wait_until

from kvproxy.serve.app import KvproxyServer
from kvproxy.sim.launcher import SimCluster, SimOptions

COMPLETIONS = "/v1/completions"
POOL_A, POOL_B = 2048, 5322


def engines_of(sim: SimCluster) -> list[dict[str, Any]]:
    return [
        {"url": sim.prefill_url, "role": "prefill", "kind": "sglang"},
        {"url": sim.decode_url, "role": "decode", "kind": "sglang"},
    ]


@contextlib.asynccontextmanager
async def two_models(
    a_extra: dict[str, Any] | None = None, **overrides: Any
) -> AsyncIterator[tuple[SimCluster, SimCluster, KvproxyServer]]:
    free = {"port": 0, "prefill_port": 0, "decode_port": 0}
    a_opts = SimOptions(**free, model_name="model-a", prefill_pool_tokens=POOL_A)
    b_opts = SimOptions(**free, model_name="model-b", prefill_pool_tokens=POOL_B)
    async with SimCluster(a_opts) as a, SimCluster(b_opts) as b:
        models = [
            {
                "name": "model-a",
                "aliases": ["a"],
                "engines": engines_of(a),
                "upstream": a.router_url,
                **(a_extra or {}),
            },
            {"name": "model-b", "engines": engines_of(b), "upstream": b.router_url},
        ]
        async with running_proxy(
            "http://127.0.0.1:9", refresh=False, engines=None, models=models, **overrides
        ) as proxy:
            for m in proxy.services.models.models:
                await m.capacity.refresh_now()
            yield a, b, proxy


async def truth(http: aiohttp.ClientSession, sim: SimCluster) -> dict[str, Any]:
    async with http.get(sim.router_url + "/sim/stats") as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def post(
    http: aiohttp.ClientSession, proxy: KvproxyServer, body: dict[str, Any], path: str = COMPLETIONS
) -> tuple[int, dict[str, Any]]:
    async with http.post(proxy.public_url + path, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


def ids(model: str, n: int) -> dict[str, Any]:
    return {"model": model, "prompt": [65] * n, "max_tokens": 1}


async def test_each_model_is_admitted_at_its_own_measured_limit(
    http: aiohttp.ClientSession,
) -> None:
    async with two_models() as (a, b, proxy):
        limits = {}
        for sim in (a, b):
            limits[sim] = (await truth(http, sim))["prefill"]["limits"]["largest_prompt"]
        assert limits[a] < limits[b]  # the pools differ, so the limits do
        replies: dict[tuple[str, int], tuple[int, dict[str, Any]]] = {}
        for sim, name in ((a, "model-a"), (b, "model-b")):
            for n in (limits[sim] - 1, limits[sim], limits[sim] + 1):
                replies[name, n - limits[sim]] = await post(http, proxy, ids(name, n))
        # Between the two limits: too long for A, fine for B; and A by its alias.
        middle = (limits[a] + limits[b]) // 2
        replies["a", middle] = await post(http, proxy, ids("a", middle))
        replies["model-b", middle] = await post(http, proxy, ids("model-b", middle))
        after = {sim: await truth(http, sim) for sim in (a, b)}
        registry = proxy.metrics.registry
        gauges = {
            name: registry.get_sample_value("kvproxy_admission_limit_tokens", {"model": name})
            for name in ("model-a", "model-b")
        }
        labelled = {
            s.labels["model"]
            for fam in registry.collect()
            if fam.name
            in (
                "kvproxy_requests",
                "kvproxy_rejections",
                "kvproxy_prompt_tokens",
                "kvproxy_token_bound_exceeded",
                "kvproxy_admission_limit_tokens",
                "kvproxy_inflight_prompt_tokens",
            )
            for s in fam.samples
        }
    # Each model's limit is its own series; requests, counts and budgets are labelled with
    # configured names only (the alias "a" counts as model-a; no "default" series).
    assert gauges == {"model-a": limits[a], "model-b": limits[b]}
    assert labelled == {"model-a", "model-b"}
    for name, sim in (("model-a", a), ("model-b", b)):
        for delta in (-1, 0):
            status, reply = replies[name, delta]
            assert status == 200, reply
            assert reply["usage"]["prompt_tokens"] == limits[sim] + delta
        status, reply = replies[name, 1]
        assert status == 400
        assert reply["error"]["code"] == "context_length_exceeded"
        assert reply["error"]["limit_tokens"] == limits[sim]
    assert replies["a", middle][0] == 400
    assert replies["a", middle][1]["error"]["limit_tokens"] == limits[a]
    assert replies["model-b", middle][0] == 200
    # Ground truth: every prompt that reached an engine fitted it, and each cluster saw only
    # its own model's requests.
    for sim, admitted in ((a, 2), (b, 3)):
        prefill = after[sim]["prefill"]
        assert prefill["requests_by_route"] == {COMPLETIONS: admitted}
        assert prefill["rejections_at_admission"] == 0
        assert prefill["pending_rejections"] == 0
    assert after[a]["prefill"]["prompt_tokens"] == 2 * limits[a] - 1
    assert after[b]["prefill"]["prompt_tokens"] == 2 * limits[b] - 1 + middle


async def test_an_unknown_model_is_404_model_not_found_for_the_openai_sdk(
    http: aiohttp.ClientSession,
) -> None:
    async with two_models() as (a, b, proxy):
        client = openai.AsyncOpenAI(
            base_url=proxy.public_url + "/v1", api_key="unused", max_retries=0
        )
        try:
            with pytest.raises(openai.NotFoundError) as info:
                await client.chat.completions.create(
                    model="model-c", messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )
            ok = await client.completions.create(model="model-b", prompt="hello", max_tokens=1)
        finally:
            await client.close()
        status, gen = await post(http, proxy, {"text": "hi"}, "/generate")
        routed = [
            sum((await truth(http, sim))["router"]["requests_by_route"].values()) for sim in (a, b)
        ]
    err = info.value.body
    assert isinstance(err, dict)
    assert err["code"] == "model_not_found"
    assert err["param"] == "model"
    assert "model-a, model-b" in err["message"]
    assert ok.choices
    # /generate names no model: with no default_model it is refused the same way, in
    # SGLang's native shape.
    assert status == 404
    assert "model-a, model-b" in gen["error"]["message"]
    assert list(gen["error"]) == ["message"]
    assert routed == [0, 1]  # I7: the refused requests reached no router
    assert (
        proxy.metrics.registry.get_sample_value(
            "kvproxy_rejections_total", {"reason": "model_not_found", "model": "_unknown"}
        )
        == 2
    )


async def test_default_model_serves_generate_and_unknown_names(
    http: aiohttp.ClientSession,
) -> None:
    async with two_models(default_model="model-b") as (a, b, proxy):
        gen = await post(
            http, proxy, {"text": "hi", "sampling_params": {"max_new_tokens": 1}}, "/generate"
        )
        other = await post(http, proxy, ids("model-z", 3000))
        too_long_for_a = await post(http, proxy, ids("model-a", 3000))
        routed = [(await truth(http, sim))["prefill"]["requests_by_route"] for sim in (a, b)]
    assert gen[0] == 200
    assert other[0] == 200
    assert too_long_for_a[0] == 400
    assert routed == [{}, {"/generate": 1, COMPLETIONS: 1}]


async def test_one_models_engines_down_fail_closed_for_it_alone(
    http: aiohttp.ClientSession,
) -> None:
    async with two_models(
        capacity_refresh_s=0.2, capacity_stale_s=0.6, capacity_probe_timeout_s=0.5
    ) as (a, _b, proxy):
        assert (await post(http, proxy, ids("model-a", 10)))[0] == 200
        await a.stop_server("prefill")
        model_a = proxy.services.models.resolve("model-a")
        assert model_a is not None
        assert await wait_until(lambda: not model_a.capacity.ready(), timeout_s=20)
        down = await post(http, proxy, ids("model-a", 10))
        up = await post(http, proxy, ids("model-b", 10))
        async with http.get(proxy.admin_url + "/readyz") as resp:
            ready = resp.status, await resp.json()
        async with http.get(proxy.admin_url + "/capacity") as resp:
            capacity = await resp.json()
        proxy.services.models.readiness = "all"
        async with http.get(proxy.admin_url + "/readyz") as resp:
            strict = resp.status, await resp.json()
    assert down[0] == 503
    assert down[1]["error"]["code"] == "capacity_unknown"
    assert "model-a's engines" in down[1]["error"]["message"]
    assert up[0] == 200
    # readiness: any (the default) keeps the pod in the Service for model-b.
    assert ready == (200, {"ready": True})
    assert strict[0] == 503
    assert "model-a" in strict[1]["reason"]
    assert set(capacity["models"]) == {"model-a", "model-b"}
    assert capacity["models"]["model-a"]["known"] is False
    assert capacity["models"]["model-b"]["known"] is True
    assert capacity["models"]["model-a"]["aliases"] == ["a"]


async def test_each_model_has_its_own_inflight_budget(http: aiohttp.ClientSession) -> None:
    async with two_models({"max_inflight_prompt_tokens": 500}) as (a, b, proxy):
        over_a = await post(http, proxy, ids("model-a", 600))
        fine_b = await post(http, proxy, ids("model-b", 600))
        registry = proxy.metrics.registry
        budget_limits = {
            name: registry.get_sample_value("kvproxy_inflight_prompt_tokens_limit", {"model": name})
            for name in ("model-a", "model-b")
        }
        routed = [(await truth(http, sim))["prefill"]["requests_by_route"] for sim in (a, b)]
    assert over_a[0] == 429
    assert over_a[1]["error"]["code"] == "inflight_budget_exceeded"
    assert fine_b[0] == 200  # model-a's budget is not model-b's
    assert budget_limits == {"model-a": 500, "model-b": 0}
    assert routed == [{}, {COMPLETIONS: 1}]
