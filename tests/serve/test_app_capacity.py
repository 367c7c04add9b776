"""Capacity as the running proxy uses it: measured limits on /capacity and /metrics, and
fail-closed behaviour (I3) when engines are down, stale or shrink."""

from __future__ import annotations

import aiohttp
import orjson
from kvtest import sim_and_proxy, wait_until

CHAT = "/v1/chat/completions"


def chat(content: str = "hello", max_tokens: int = 8) -> bytes:
    return orjson.dumps(
        {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}
    )


async def test_capacity_shows_the_measured_limit_not_the_declared_context(
    http: aiohttp.ClientSession,
) -> None:
    async with sim_and_proxy(max_context=8192) as (_, proxy):
        async with http.get(proxy.admin_url + "/capacity") as resp:
            assert resp.status == 200
            snap = await resp.json(content_type=None)
        async with http.get(proxy.admin_url + "/readyz") as resp:
            assert resp.status == 200
        assert proxy.metrics.admission_limit.labels("default")._value.get() == 5315
        assert proxy.metrics.declared_context.labels("default")._value.get() == 8192
    engines = {e["role"]: e for e in snap["engines"]}
    prefill = engines["prefill"]["measurement"]
    assert prefill["input_limit_tokens"] == 5315
    assert prefill["pool_tokens"] == 5322
    assert prefill["sources"]["input_limit_tokens"] == "server_info.max_req_input_len"
    assert engines["decode"]["measurement"]["pool_tokens"] == 16384
    assert snap["declared_context"] == 8192
    assert snap["limits"]["admission_limit_tokens"] == 5315
    assert snap["limits"]["source"] == "measured"
    assert any("8,192" in w and "5,315" in w for w in snap["warnings"])


async def test_engine_down_at_start_means_not_ready_and_503(http: aiohttp.ClientSession) -> None:
    engines = [{"url": "http://127.0.0.1:9", "role": "prefill", "kind": "sglang"}]
    async with sim_and_proxy(engines=engines, capacity_probe_timeout_s=1.0) as (sim, proxy):
        async with http.get(proxy.admin_url + "/readyz") as resp:
            assert resp.status == 503
        async with http.post(proxy.public_url + CHAT, data=chat()) as resp:
            assert resp.status == 503
            assert int(resp.headers["Retry-After"]) >= 1
            assert resp.headers["X-Kvproxy-Decision"] == "rejected"
            assert (await resp.json())["error"]["code"] == "capacity_unknown"
        stats = await (await http.get(sim.router_url + "/sim/stats")).json()
    assert sum(stats["router"]["requests_by_route"].values()) == 0  # I7: nothing forwarded


async def test_stale_measurement_fails_closed_and_a_smaller_pool_lowers_the_limit(
    http: aiohttp.ClientSession,
) -> None:
    async with sim_and_proxy(
        capacity_refresh_s=0.2, capacity_stale_s=0.6, capacity_probe_timeout_s=0.5
    ) as (sim, proxy):
        assert proxy.services.models.first.capacity.limits().admission_limit_tokens == 5315
        await sim.set_pool_tokens("prefill", 4096)  # the engine restarts smaller
        await proxy.services.models.first.capacity.refresh_now()
        assert proxy.services.models.first.capacity.limits().admission_limit_tokens == 4089
        async with http.post(proxy.public_url + CHAT, data=chat("x" * 4500)) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["limit_tokens"] == 4089

        await sim.stop_server("prefill")
        assert await wait_until(
            lambda: not proxy.services.models.first.capacity.ready(), timeout_s=20
        )
        async with http.post(proxy.public_url + CHAT, data=chat()) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "capacity_unknown"
        async with http.get(proxy.admin_url + "/readyz") as resp:
            assert resp.status == 503
        errors = proxy.metrics.registry.get_sample_value(
            "kvproxy_capacity_probe_errors_total",
            {"engine": sim.prefill_url.split("://")[1], "reason": "connect"},
        )
        assert errors is not None
        assert errors >= 1

        await sim.start_server("prefill")
        assert await wait_until(lambda: proxy.services.models.first.capacity.ready(), timeout_s=20)
        async with http.post(proxy.public_url + CHAT, data=chat()) as resp:
            assert resp.status == 200
