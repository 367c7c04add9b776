"""The capacity monitor against the simulator (kvproxy/sim), the independent oracle: the
issue's acceptance numbers, a restart with a smaller pool, and the vLLM flavor.

The expected numbers are worked out by hand from the engine rule (largest prompt =
min(context, pool) - 7), never from kvproxy's own code.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from kvproxy.capacity import CapacityMonitor
from kvproxy.config import Settings
from kvproxy.observe.metrics import Metrics

launcher = pytest.importorskip("kvproxy.sim.launcher")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def sim_factory() -> AsyncIterator[Any]:
    made: list[Any] = []

    async def make(**opts: Any) -> Any:
        cluster = launcher.SimCluster(launcher.SimOptions(port=0, **opts))
        await cluster.start()
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        await cluster.close()


def monitor_for(
    cluster: Any, kind: str, session: aiohttp.ClientSession, clock: Clock, **kw: Any
) -> tuple[CapacityMonitor, Metrics]:
    s = Settings(
        engines=[
            {"url": cluster.prefill_url, "role": "prefill", "kind": kind},
            {"url": cluster.decode_url, "role": "decode", "kind": kind},
        ],
        **kw,
    )
    metrics = Metrics()
    return CapacityMonitor(s, metrics, session, clock=clock), metrics


async def test_sim_prefill_pool_binds_not_the_declared_context(
    sim_factory: Any, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    # Context 8,192, prefill pool 5,322 tokens in pages of 1: SGLang reports
    # max_req_input_len 5,316 and refuses 5,316, so the largest prompt is 5,315.
    cluster = await sim_factory(context_length=8192, prefill_pool_tokens=5322, page_size=1)
    clock = Clock()
    mon, metrics = monitor_for(cluster, "sglang", session, clock, max_context=8192)
    with caplog.at_level(logging.WARNING, logger="kvproxy.capacity"):
        await mon.refresh_now()
    lim = mon.limits()
    assert (lim.known, lim.admission_limit_tokens, lim.source) == (True, 5315, "measured")
    assert (
        metrics.registry.get_sample_value("kvproxy_admission_limit_tokens", {"model": "default"})
        == 5315
    )
    assert (
        metrics.registry.get_sample_value("kvproxy_declared_context_tokens", {"model": "default"})
        == 8192
    )
    # Decode pool 16,384 > context: max_req_len = 8,191, so prompt + output <= 8,190 is
    # generated without the scheduler cutting max_new_tokens.
    assert lim.decode_limit_tokens == 8190
    snap = mon.snapshot_json()
    engines = {e["role"]: e for e in snap["engines"]}
    assert engines["prefill"]["measurement"]["input_limit_tokens"] == 5315
    assert engines["decode"]["measurement"]["pool_tokens"] == 16384
    assert snap["declared_context"] == 8192
    assert any("8,192" in w and "5,315" in w for w in snap["warnings"])
    assert any("8,192" in r.getMessage() and "5,315" in r.getMessage() for r in caplog.records)


async def test_sim_default_pages_and_a_smaller_pool_after_restart(
    sim_factory: Any, session: aiohttp.ClientSession
) -> None:
    # The demo's defaults (pages of 16): the sim reports 5,322 and max_req_input_len 5,316.
    cluster = await sim_factory(context_length=8192, prefill_pool_tokens=5322, page_size=16)
    clock = Clock()
    mon, _ = monitor_for(cluster, "sglang", session, clock, max_context=8192)
    await mon.refresh_now()
    assert mon.limits().admission_limit_tokens == 5315

    await cluster.set_pool_tokens("prefill", 4096)  # restarts on the same port
    await mon.refresh_now()
    assert mon.limits().admission_limit_tokens == 4089

    await cluster.stop_server("prefill")
    await mon.refresh_now()
    assert mon.ready()  # the last measurement is still fresh
    clock.now += 61
    assert not mon.ready()


async def test_sim_vllm_flavor_reads_kv_cache_size_tokens(
    sim_factory: Any, session: aiohttp.ClientSession
) -> None:
    # vLLM refuses to start with max_model_len above its pool, so the context is 4,096 here.
    cluster = await sim_factory(
        flavor="vllm", context_length=4096, prefill_pool_tokens=5322, page_size=1
    )
    mon, _ = monitor_for(cluster, "vllm", session, Clock())
    await mon.refresh_now()
    lim = mon.limits()
    assert (lim.admission_limit_tokens, lim.decode_limit_tokens) == (4095, 4096)
    prefill = next(e for e in mon.snapshot_json()["engines"] if e["role"] == "prefill")
    m = prefill["measurement"]
    assert m["pool_tokens"] == 5322
    assert m["sources"]["pool_tokens"].endswith("kv_cache_size_tokens")
    assert "kv_cache_size_tokens" in m["sources"]["input_limit_tokens"]
