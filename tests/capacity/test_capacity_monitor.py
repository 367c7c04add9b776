"""CapacityMonitor against fake engines on 127.0.0.1: fail closed, staleness, pool changes,
discovery, metrics and the /capacity snapshot.

Time is a fake clock injected into the monitor, so staleness is tested by moving the
clock, never by sleeping. Assertions are on ground truth: limits, metric samples, log
records and the fake engines' hit counters.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import aiohttp
import orjson
import pytest
from capacity_fakes import EngineFactory
from ports import free_port

from kvproxy.capacity import CapacityMonitor
from kvproxy.config import Settings
from kvproxy.observe.metrics import Metrics
from kvproxy.policy import errors


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def settings(engines: list[dict[str, Any]], **kw: Any) -> Settings:
    base: dict[str, Any] = {
        "engines": engines,
        "capacity_refresh_s": 10.0,
        "capacity_stale_s": 60.0,
        "capacity_probe_timeout_s": 2.0,
    }
    base.update(kw)
    return Settings(**base)


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def monitor_for(
    s: Settings, session: aiohttp.ClientSession, clock: FakeClock, **kw: Any
) -> tuple[CapacityMonitor, Metrics]:
    metrics = Metrics()
    return CapacityMonitor(s, metrics, session, clock=clock, **kw), metrics


async def test_measured_limit_replaces_declared_context(
    engines: EngineFactory,
    session: aiohttp.ClientSession,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefill = await engines("sglang", pool=5322, context=8192)
    decode = await engines("sglang", pool=40_000, context=8192)
    s = settings(
        [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}],
        max_context=8192,
    )
    mon, metrics = monitor_for(s, session, clock)
    assert not mon.ready()  # nothing measured yet: fail closed
    with caplog.at_level(logging.INFO, logger="kvproxy.capacity"):
        await mon.refresh_now()
    lim = mon.limits()
    assert mon.ready()
    assert (lim.admission_limit_tokens, lim.source) == (5315, "measured")
    assert lim.binding_engine == f"127.0.0.1:{prefill.port}"
    assert lim.why == f"measured prefill KV pool of 127.0.0.1:{prefill.port}"
    # max_req_len = min(8,191, 39,999) = 8,191; uncut output leaves prompt + output <= 8,190.
    assert lim.decode_limit_tokens == 8190
    assert lim.declared_context == 8192

    assert sample(metrics, "kvproxy_admission_limit_tokens", model="default") == 5315
    assert sample(metrics, "kvproxy_decode_limit_tokens", model="default") == 8190
    assert sample(metrics, "kvproxy_declared_context_tokens", model="default") == 8192
    assert sample(metrics, "kvproxy_capacity_known", model="default") == 1
    p = f"127.0.0.1:{prefill.port}"
    assert (
        sample(
            metrics,
            "kvproxy_pool_capacity_tokens",
            engine=p,
            role="prefill",
            source="measured",
            model="default",
        )
        == 5322
    )
    assert (
        sample(
            metrics,
            "kvproxy_engine_input_limit_tokens",
            engine=p,
            role="prefill",
            source="measured",
            model="default",
        )
        == 5315
    )
    assert (sample(metrics, "kvproxy_capacity_last_success_timestamp_seconds", engine=p) or 0) > 0

    # The incident's misconfiguration is logged with both numbers.
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("8,192" in w and "5,315" in w for w in warned), warned

    snap = mon.snapshot_json()
    orjson.dumps(snap)  # serialisable as is
    assert snap["known"] is True
    assert snap["limits"]["admission_limit_tokens"] == 5315
    assert snap["limits"]["why"] == lim.why
    assert snap["declared_context"] == 8192
    assert any("8,192" in w for w in snap["warnings"])
    by_name = {e["engine"]: e for e in snap["engines"]}
    e = by_name[p]
    assert (e["role"], e["kind"], e["state"], e["last_error"]) == (
        "prefill",
        "sglang",
        "fresh",
        None,
    )
    assert e["measurement"]["input_limit_tokens"] == 5315
    assert e["measurement"]["pool_tokens"] == 5322
    assert e["measurement"]["sources"]["input_limit_tokens"] == "server_info.max_req_input_len"
    assert e["age_s"] == 0


async def test_engine_down_at_start_is_not_ready_and_answers_503(
    session: aiohttp.ClientSession, clock: FakeClock
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    mon, metrics = monitor_for(settings([{"url": url, "role": "prefill"}]), session, clock)
    await mon.refresh_now()
    lim = mon.limits()
    assert not mon.ready()
    assert not lim.known
    assert lim.admission_limit_tokens is None
    label = url.removeprefix("http://")
    assert (
        sample(metrics, "kvproxy_capacity_probe_errors_total", engine=label, reason="connect") == 1
    )
    assert sample(metrics, "kvproxy_capacity_known", model="default") == 0
    assert sample(metrics, "kvproxy_admission_limit_tokens", model="default") == 0
    snap = mon.snapshot_json()
    assert snap["engines"][0]["state"] == "unmeasured"
    assert snap["engines"][0]["last_error"]["reason"] == "connect"

    # What the app answers on inference routes while capacity is unknown.
    err = errors.capacity_unknown(mon.retry_after_s(), lim.why)
    assert err.status == 503
    assert err.code == "capacity_unknown"
    retry = int(err.headers["Retry-After"])
    assert 1 <= retry <= math.ceil(10 * 1.1 + 2)
    assert label in orjson.loads(err.body())["error"]["message"]


async def test_engine_gone_later_goes_stale_after_the_window(
    engines: EngineFactory, session: aiohttp.ClientSession, clock: FakeClock
) -> None:
    eng = await engines("sglang")
    mon, metrics = monitor_for(settings([{"url": eng.url, "role": "prefill"}]), session, clock)
    await mon.refresh_now()
    assert mon.limits().admission_limit_tokens == 5315

    await eng.stop()
    clock.advance(30)
    await mon.refresh_now()
    label = f"127.0.0.1:{eng.port}"
    assert (
        sample(metrics, "kvproxy_capacity_probe_errors_total", engine=label, reason="connect") == 1
    )
    # Within the stale window the last measurement still holds.
    assert mon.ready()
    assert mon.limits().admission_limit_tokens == 5315

    clock.advance(31)  # 61 s since the last success: stale, even without another refresh
    assert not mon.ready()
    assert not mon.limits().known
    assert sample(metrics, "kvproxy_capacity_known", model="default") == 0
    assert sample(metrics, "kvproxy_admission_limit_tokens", model="default") == 0
    engine = mon.snapshot_json()["engines"][0]
    assert engine["state"] == "stale"
    assert engine["measurement"]["pool_tokens"] == 5322  # still shown, no longer used
    assert engine["age_s"] == 61


async def test_restart_with_smaller_pool_takes_effect_on_the_next_refresh(
    engines: EngineFactory,
    session: aiohttp.ClientSession,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    eng = await engines("sglang", pool=5322, context=8192)
    mon, metrics = monitor_for(settings([{"url": eng.url, "role": "prefill"}]), session, clock)
    await mon.refresh_now()
    assert mon.limits().admission_limit_tokens == 5315

    await eng.stop()
    eng.pool = 4000
    await eng.start()  # same port
    with caplog.at_level(logging.INFO, logger="kvproxy.capacity"):
        await mon.refresh_now()
    assert mon.limits().admission_limit_tokens == 3993
    assert sample(metrics, "kvproxy_admission_limit_tokens", model="default") == 3993
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "5,322 -> 4,000" in text
    assert "5,315 -> 3,993" in text

    eng.pool = 6000  # a larger pool takes effect too
    await mon.refresh_now()
    assert mon.limits().admission_limit_tokens == 5993


async def test_garbage_is_counted_and_one_bad_engine_never_blocks_another(
    engines: EngineFactory, session: aiohttp.ClientSession, clock: FakeClock
) -> None:
    good = await engines("sglang")
    garbage = await engines("sglang")
    garbage.mode = "garbage"
    hung = await engines("sglang")
    hung.mode = "hang"
    s = settings(
        [
            {"url": good.url, "role": "prefill"},
            {"url": garbage.url, "role": "prefill"},
            {"url": hung.url, "role": "prefill"},
        ],
        capacity_probe_timeout_s=0.3,
    )
    mon, metrics = monitor_for(s, session, clock)
    for _ in range(2):
        await mon.refresh_now()
    g = f"127.0.0.1:{garbage.port}"
    h = f"127.0.0.1:{hung.port}"
    assert sample(metrics, "kvproxy_capacity_probe_errors_total", engine=g, reason="not_json") == 2
    assert sample(metrics, "kvproxy_capacity_probe_errors_total", engine=h, reason="timeout") == 2
    assert good.hits["/server_info"] == 2
    assert not mon.ready()
    states = {e["engine"]: e for e in mon.snapshot_json()["engines"]}
    assert states[f"127.0.0.1:{good.port}"]["state"] == "fresh"
    assert states[g]["consecutive_errors"] == 2
    assert set(mon.limits().unknown_engines) == {g, h}


async def test_fallback_limit_is_declared_and_ready(
    session: aiohttp.ClientSession, clock: FakeClock
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    s = settings([{"url": url, "role": "prefill"}], capacity_fallback_limit_tokens=4000)
    mon, metrics = monitor_for(s, session, clock)
    await mon.refresh_now()
    lim = mon.limits()
    assert mon.ready()
    assert (lim.admission_limit_tokens, lim.source, lim.fallback_used) == (4000, "declared", True)
    assert sample(metrics, "kvproxy_admission_limit_tokens", model="default") == 4000


async def test_static_engines_need_no_network(
    session: aiohttp.ClientSession, clock: FakeClock
) -> None:
    s = settings(
        [{"url": "static://p", "kind": "static", "role": "prefill", "capacity_tokens": 65536}],
        max_context=131_072,
    )
    mon, metrics = monitor_for(s, session, clock)
    await mon.refresh_now()
    lim = mon.limits()
    assert (lim.known, lim.admission_limit_tokens, lim.source) == (True, 65536, "declared")
    assert (
        sample(
            metrics,
            "kvproxy_pool_capacity_tokens",
            engine="p",
            role="prefill",
            source="declared",
            model="default",
        )
        == 65536
    )


async def test_allow_auto_truncate_is_warned(
    engines: EngineFactory,
    session: aiohttp.ClientSession,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    eng = await engines("sglang")
    eng.extra_info = {"allow_auto_truncate": True}
    mon, _ = monitor_for(settings([{"url": eng.url, "role": "unified"}]), session, clock)
    with caplog.at_level(logging.WARNING, logger="kvproxy.capacity"):
        await mon.refresh_now()
        await mon.refresh_now()
    hits = [r for r in caplog.records if "allow_auto_truncate" in r.getMessage()]
    assert len(hits) == 1  # warned when it appears, not on every refresh
    assert any("allow_auto_truncate" in w for w in mon.snapshot_json()["warnings"])


async def test_discovery_expands_a_headless_service_and_forgets_gone_pods(
    engines: EngineFactory, session: aiohttp.ClientSession, clock: FakeClock
) -> None:
    eng = await engines("sglang")
    port = eng.port
    answer: list[str] = ["127.0.0.1", "127.0.0.2"]
    calls: list[str] = []

    async def resolver(host: str, _port: int) -> list[str]:
        calls.append(host)
        if not answer:
            raise OSError("NXDOMAIN")
        return list(answer)

    s = settings([{"url": f"http://pods.test:{port}", "role": "prefill"}])
    mon, metrics = monitor_for(s, session, clock, resolver=resolver)
    await mon.refresh_now()
    names = {e["engine"] for e in mon.snapshot_json()["engines"]}
    assert names == {f"127.0.0.1:{port}", f"127.0.0.2:{port}"}
    # Nothing listens on 127.0.0.2: a pod that cannot be measured keeps us closed.
    assert not mon.ready()
    gone = f"127.0.0.2:{port}"
    assert (
        sample(metrics, "kvproxy_capacity_probe_errors_total", engine=gone, reason="connect") == 1
    )

    answer[:] = ["127.0.0.1"]  # scaled down to one pod: it keeps the configured label
    await mon.refresh_now()
    assert mon.ready()
    names = {e["engine"] for e in mon.snapshot_json()["engines"]}
    assert names == {f"pods.test:{port}"}
    assert mon.limits().binding_engine == f"pods.test:{port}"
    # Series of engines that left discovery are removed.
    assert (
        sample(metrics, "kvproxy_capacity_probe_errors_total", engine=gone, reason="connect")
        is None
    )
    assert (
        sample(
            metrics,
            "kvproxy_pool_capacity_tokens",
            engine=f"127.0.0.1:{port}",
            role="prefill",
            source="measured",
            model="default",
        )
        is None
    )

    answer.clear()  # DNS fails: the last expansion is kept, the failure counted
    await mon.refresh_now()
    assert mon.ready()
    assert (
        sample(
            metrics, "kvproxy_capacity_probe_errors_total", engine=f"pods.test:{port}", reason="dns"
        )
        == 1
    )
    assert calls == ["pods.test"] * 3


async def test_localhost_keeps_its_name(engines: EngineFactory, clock: FakeClock) -> None:
    eng = await engines("sglang")
    s = settings([{"url": f"http://localhost:{eng.port}", "role": "prefill"}])
    mon = CapacityMonitor(s, Metrics(), clock=clock)  # its own session, system resolver
    await mon.start()
    try:
        for _ in range(300):  # bounded: the first refresh runs in the background
            if mon.ready():
                break
            await asyncio.sleep(0.01)
        assert mon.ready()
        assert mon.limits().binding_engine == f"localhost:{eng.port}"
    finally:
        await mon.stop()


async def test_start_never_blocks_and_keeps_refreshing(engines: EngineFactory) -> None:
    eng = await engines("sglang")
    s = settings(
        [{"url": eng.url, "role": "prefill"}], capacity_refresh_s=0.05, capacity_stale_s=60
    )
    mon = CapacityMonitor(s, Metrics())
    await mon.start()
    try:
        assert not mon.ready()  # start() returned before any probe ran
        for _ in range(500):
            if eng.hits["/server_info"] >= 3:
                break
            await asyncio.sleep(0.01)
        assert eng.hits["/server_info"] >= 3
        assert mon.ready()
        assert mon.limits().admission_limit_tokens == 5315
    finally:
        await mon.stop()
    hits = eng.hits["/server_info"]
    await asyncio.sleep(0.1)
    assert eng.hits["/server_info"] == hits  # stopped means stopped


async def test_retry_after_is_bounded(session: aiohttp.ClientSession, clock: FakeClock) -> None:
    mon, _ = monitor_for(settings([]), session, clock)
    assert 1 <= mon.retry_after_s() <= math.ceil(10 * 1.1 + 2)
    lim = mon.limits()
    assert not lim.known  # no engines and no declared context: nothing to admit against
