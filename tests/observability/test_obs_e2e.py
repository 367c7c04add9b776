"""End to end: a real Prometheus scrapes a real kvproxy in front of the PD simulator, and every
dashboard query, evaluated through Prometheus's HTTP API, returns data.

The scenario is the incident at simulator scale: context 8,192 declared, prefill pool 5,322
allocated (vulnerable mode). Traffic: admitted completions and chats, over-limit prompts
(rejected), non-NFC text (counted exactly by the engine, so token drift is observed),
clients that leave mid-prefill (deferred cancellations; a short drain timeout makes some of
them time out) or mid-stream, and a decode engine taken down for a moment (probe errors).
Ground truth is kvproxy's own registry: Prometheus must agree with it before queries run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest
from obs_prometheus import PrometheusServer, finite_values
from obs_support import PROMETHEUS, REPO, needs_prometheus
from redis_server import needs_redis, redis_server

from grafana import dashboard, rules
from grafana.model import RATE
from grafana.promql import to_promql
from kvproxy.config import load_settings
from kvproxy.observe.metrics import Metrics
from kvproxy.serve.app import KvproxyServer
from kvproxy.sim.launcher import SimCluster, SimOptions

# Generous windows: every query looks back over the whole test, however slow the machine.
WINDOWS = {"$__rate_interval": "5m", "$__range": "10m"}
FALLBACK = " or on() label_replace(vector(0)"  # what grafana.model.zero_if_absent appends
# zero_if_absent queries whose metric this scenario cannot create (no upstream failure).
FALLBACK_ONLY_OK = {"kvproxy_upstream_errors_total"}
PREFILL_POOL = 5322  # SimOptions' demo default, reported as is
DECLARED = 8192


async def poll(pred: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    """Bounded polling for a condition another task drives; fails naming `what`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if pred():
            return
        await asyncio.sleep(0.05)
    assert pred(), f"timed out waiting for {what}"


async def open_post(
    base: str, path: str, body: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send a POST on a raw socket, so the test decides exactly when the client hangs up."""
    parts = urlsplit(base)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    return reader, writer


async def read_until(reader: asyncio.StreamReader, marker: bytes) -> None:
    seen = b""
    async with asyncio.timeout(30):
        while marker not in seen:
            chunk = await reader.read(65536)
            assert chunk, "connection closed before the marker"
            seen += chunk


async def hang_up(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


def completion(prompt: str, *, stream: bool = False, max_tokens: int = 8) -> bytes:
    return orjson.dumps(
        {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    )


def chat(content: str, *, stream: bool = True, role: str = "user") -> bytes:
    return orjson.dumps(
        {
            "model": "m",
            "stream": stream,
            "max_tokens": 8,
            "messages": [{"role": role, "content": content}],
        }
    )


class Traffic:
    """The requests of the scenario, in two waves with a Prometheus scrape between them: a
    series born in wave 1 then has a sample before wave 2 moves it, so rate() sees it."""

    def __init__(self, proxy: KvproxyServer, sim: SimCluster, http: aiohttp.ClientSession):
        self.proxy, self.sim, self.http = proxy, sim, http
        self.url = proxy.public_url
        self.sample = proxy.metrics.registry.get_sample_value

    async def post(self, path: str, body: bytes, status: int) -> None:
        # A proxy that never finishes a response fails here, not at the suite's timeout.
        async with asyncio.timeout(60), self.http.post(self.url + path, data=body) as resp:
            await resp.read()
            assert resp.status == status, (path, resp.status)

    def idle(self) -> bool:
        return (self.sample("kvproxy_inflight_requests") or 0) == 0

    async def wave1(self) -> None:
        """One request of each kind, so every labelled series exists."""
        await self.post("/v1/completions", completion("hello"), 200)
        await self.post("/v1/chat/completions", chat("question"), 200)
        await self.post("/v1/completions", completion("x" * 6000), 400)
        await self.post("/v1/chat/completions", chat("y" * 7000), 400)
        # A role spelling no verified row covers, too long for the bound to admit: the exact
        # count is withheld, the bound decides (400) and the feature is counted.
        await self.post("/v1/chat/completions", chat("y" * 7000, role="User"), 400)

    async def wave2(self) -> None:
        for i in range(5):
            await self.post("/v1/completions", completion(f"hello {i} " * (20 * i + 1)), 200)
            await self.post("/v1/chat/completions", chat(f"question {i}"), 200)
        # Non-NFC text: the byte bound triples, so the engine counts it (drift observed).
        await self.post("/v1/completions", completion("e\u0301" * 700), 200)
        for size in (9000, 20000):
            await self.post("/v1/completions", completion("x" * size), 400)
        await self.post("/v1/chat/completions", chat("y" * 9000), 400)
        await self.post("/v1/chat/completions", chat("y" * 9000, role="User"), 400)

        # Leave mid-prefill: the upstream stays open until the transfer is over, or until
        # the short drain timeout (outcome=timeout).
        held = {"model": "default"}
        tokens_held = lambda: (self.sample("kvproxy_inflight_prompt_tokens", held) or 0) > 0  # noqa: E731
        for size in (300, 4000, 4000):
            await poll(self.idle, "the previous request to end")
            body = completion("z" * size, stream=True)
            _, writer = await open_post(self.url, "/v1/completions", body)
            await poll(tokens_held, "the request to be forwarded")
            await hang_up(writer)
        # Leave mid-stream, after the first token.
        await poll(self.idle, "the previous request to end")
        body = completion("w" * 200, stream=True, max_tokens=400)
        reader, writer = await open_post(self.url, "/v1/completions", body)
        await read_until(reader, b"data:")
        await hang_up(writer)
        await poll(self.idle, "deferred cancellations to end")

    async def decode_down(self, prom: PrometheusServer) -> None:
        """Take decode down until Prometheus has seen its probe errors rise, then restore."""
        await self.sim.stop_server("decode")
        errors = "increase(kvproxy_capacity_probe_errors_total[5m]) > 0"
        for _ in range(60):
            if await prom.query(self.http, errors):
                break
            await asyncio.sleep(0.5)
        assert await prom.query(self.http, errors), prom.log_tail()
        await self.sim.start_server("decode")
        await self.proxy.services.models.first.capacity.refresh_now()
        await poll(self.proxy.services.models.first.capacity.ready, "capacity known again")


def registry_total(proxy: KvproxyServer, family: str) -> float:
    return sum(
        s.value
        for f in proxy.metrics.registry.collect()
        if f.name == family
        for s in f.samples
        if s.name == family + "_total"
    )


COUNTED = (
    "kvproxy_requests",
    "kvproxy_rejections",
    "kvproxy_deferred_cancellations",
    "kvproxy_client_disconnects",
)


async def synced(prom: PrometheusServer, proxy: KvproxyServer, http: aiohttp.ClientSession) -> None:
    """Wait until Prometheus's latest scrape agrees with kvproxy's own counters."""
    want = {family: registry_total(proxy, family) for family in COUNTED}
    got: dict[str, float] = {}
    for _ in range(60):
        for family in COUNTED:
            result = await prom.query(http, f"sum({family}_total)")
            got[family] = float(result[0]["value"][1]) if result else -1.0
        if got == want:
            return
        await asyncio.sleep(0.5)
    assert got == want, prom.log_tail()


@pytest.mark.slow
@needs_prometheus
@needs_redis
async def test_every_dashboard_query_returns_data(tmp_path: Path) -> None:
    assert PROMETHEUS is not None
    # The budget is held in a real redis-server, so its panels (round trips, renewals) have
    # data too; the local budget's panels read the same replica gauges either way.
    async with redis_server(tmp_path) as redis:
        await _every_dashboard_query_returns_data(tmp_path, redis.url)


async def _every_dashboard_query_returns_data(tmp_path: Path, redis_url: str) -> None:
    assert PROMETHEUS is not None
    sim = SimCluster(SimOptions(port=0, mode="vulnerable", prefill_us_per_token=300.0))
    proxy: KvproxyServer | None = None
    prom: PrometheusServer | None = None
    async with aiohttp.ClientSession() as http:
        try:
            await sim.start()
            settings = load_settings(
                listen="127.0.0.1:0",
                admin_listen="127.0.0.1:0",
                upstream=sim.router_url,
                access_log=False,
                engines=[
                    {
                        "url": sim.prefill_url,
                        "role": "prefill",
                        "kind": "sglang",
                        "name": "prefill-0",
                    },
                    {"url": sim.decode_url, "role": "decode", "kind": "sglang", "name": "decode-0"},
                ],
                max_context=DECLARED,
                tokenizer="engine",
                capacity_refresh_s=1.0,
                capacity_stale_s=30.0,
                drain_timeout_s=0.3,
                max_inflight_prompt_tokens=100_000,
                budget_backend="redis",
                redis_url=redis_url,
                redis_lease_ttl_s=3.0,
                canaries=[
                    {"tenant": "acme", "markers": ["KVCANARY-acme-7f3a"]},
                    {"tenant": "globex", "markers": ["KVCANARY-globex-91c2"]},
                ],
            )
            proxy = KvproxyServer(settings, Metrics())
            await proxy.start()
            await proxy.services.models.first.capacity.refresh_now()
            admin = urlsplit(proxy.admin_url).netloc
            prom = PrometheusServer(
                PROMETHEUS, tmp_path, [admin], [REPO / "grafana/alerts.rules.yml"]
            )
            await prom.start(http)
            for _ in range(60):  # the first scrape comes a few seconds after start
                if await prom.query(http, 'up{job="kvproxy"} == 1'):
                    break
                await asyncio.sleep(0.5)
            assert await prom.query(http, 'up{job="kvproxy"} == 1'), prom.log_tail()

            traffic = Traffic(proxy, sim, http)
            await traffic.wave1()
            await synced(prom, proxy, http)
            await traffic.wave2()
            await traffic.decode_down(prom)
            await synced(prom, proxy, http)
            assert registry_total(proxy, "kvproxy_rejections") == 7
            assert registry_total(proxy, "kvproxy_deferred_cancellations") >= 1
            await check_prometheus(prom, http)
        finally:
            if prom is not None:
                await prom.close()
            if proxy is not None:
                await proxy.stop()
            await sim.close()


async def check_prometheus(prom: PrometheusServer, http: aiohttp.ClientSession) -> None:
    # Every dashboard query answers, with at least one finite value.
    failures = []
    for row in dashboard.ROWS:
        for panel in row.panels:
            for query in panel.queries:
                expr = to_promql(query.expr, WINDOWS)
                assert RATE not in expr
                result = await prom.query(http, expr)
                if not finite_values(result):
                    failures.append(f"{panel.title!r}: {expr} -> {result}")
                    continue
                if FALLBACK in expr:
                    primary = expr.split(FALLBACK, 1)[0]
                    metric_is_real = bool(await prom.query(http, primary))
                    allowed = any(m in expr for m in FALLBACK_ONLY_OK)
                    if not metric_is_real and not allowed:
                        failures.append(f"{panel.title!r}: only the zero fallback: {primary}")
    assert not failures, "\n".join(failures)

    # The gap panel shows the incident's gap, and the rules are loaded and evaluate cleanly.
    gap_panel = next(p for p in dashboard.AT_A_GLANCE.panels if "smallest KV pool" in p.title)
    gap = await prom.query(http, to_promql(gap_panel.queries[0].expr, WINDOWS))
    assert float(gap[0]["value"][1]) == DECLARED - PREFILL_POOL
    groups = (await prom.api(http, "rules"))["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(loaded) == {a.name for a in rules.ALERTS}
    assert all(r["health"] == "ok" for r in loaded.values()), loaded

    async def pool_alert_pending() -> bool:
        alerts = (await prom.api(http, "alerts"))["alerts"]
        return any(
            a["labels"]["alertname"] == "KvproxyPoolBelowDeclaredContext"
            and a["labels"].get("engine") == "prefill-0"
            for a in alerts
        )

    for _ in range(40):
        if await pool_alert_pending():
            break
        await asyncio.sleep(0.5)
    assert await pool_alert_pending(), "the incident's gap did not trip its alert"
