"""A live kvproxy's /metrics: promtool's lint is clean, and every series the dashboard and
alerts read is there after one admitted and one rejected request, except those that only a
fault creates (listed, and still declared by HELP/TYPE)."""

from __future__ import annotations

import aiohttp
import orjson
from aiohttp import web
from kvtest import FakeUpstream
from obs_support import needs_promtool, promtool, sample_families, scraped_samples

from grafana import dashboard, rules
from grafana.promql import metric_names
from grafana.render import all_queries
from kvproxy.app import KvproxyServer
from kvproxy.config import load_settings
from kvproxy.metrics import Metrics

COMPLETIONS = "/v1/completions"
# Series that exist only once something went wrong (or a specific path ran); a healthy
# proxy serving one admitted and one rejected request cannot show them.
FAULT_ONLY = {
    "kvproxy_capacity_probe_errors_total": "a capacity probe failed",
    "kvproxy_upstream_errors_total": "an upstream request failed",
    # kvproxy.posture: series exist while a finding applies / once an SGLang engine's
    # /metrics exported its failure counters (the fake engines here export none).
    "kvproxy_engine_advisory": "an engine posture finding is active",
    "kvproxy_engine_transfer_failures": "an SGLang engine exported its failure counters",
    # Series exist once a request's exact count was withheld for an unverified feature
    # (the traffic here is plain chats far below the limit: the bound admits them).
    "kvproxy_unverified_features_total": "a request used a feature the exact count is not "
    "verified for",
}


def dashboard_and_alert_samples() -> set[str]:
    exprs = [e for _, e in all_queries(dashboard.ROWS)] + [a.expr for a in rules.ALERTS]
    return {name for expr in exprs for name in metric_names(expr)}


async def scrape_after_traffic(upstream: FakeUpstream, http: aiohttp.ClientSession) -> str:
    async def completions(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 3}})

    upstream.route("POST", COMPLETIONS, completions)
    await upstream.start()
    settings = load_settings(
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        upstream=upstream.url,
        access_log=False,
        engines=[
            {
                "url": "static://prefill",
                "role": "prefill",
                "kind": "static",
                "capacity_tokens": 4096,
                "name": "prefill-0",
            },
            {
                "url": "static://decode",
                "role": "decode",
                "kind": "static",
                "capacity_tokens": 8192,
                "name": "decode-0",
            },
        ],
        max_context=8192,
        canaries=[{"tenant": "acme", "markers": ["KVCANARY-acme"]}],
    )
    server = KvproxyServer(settings, Metrics())
    await server.start()
    try:
        await server.services.models.first.capacity.refresh_now()
        small = orjson.dumps({"model": "m", "prompt": "hello", "max_tokens": 4})
        async with http.post(server.public_url + COMPLETIONS, data=small) as resp:
            assert resp.status == 200, await resp.text()
        big = orjson.dumps({"model": "m", "prompt": "x" * 20_000, "max_tokens": 4})
        async with http.post(server.public_url + COMPLETIONS, data=big) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "context_length_exceeded"
        # The `http` fixture does not decompress; ask for the plain exposition.
        plain = {"Accept-Encoding": "identity"}
        async with http.get(server.admin_url + "/metrics", headers=plain) as resp:
            assert resp.status == 200
            return await resp.text()
    finally:
        await server.stop()


@needs_promtool
async def test_promtool_check_metrics_on_a_live_scrape(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    text = await scrape_after_traffic(upstream, http)
    done = promtool("check", "metrics", stdin=text)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "", done.stdout


async def test_live_scrape_has_every_series_the_dashboard_reads(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    text = await scrape_after_traffic(upstream, http)
    present = scraped_samples(text)
    wanted = dashboard_and_alert_samples()
    absent = wanted - present
    assert absent == set(FAULT_ONLY), f"missing from a live scrape: {sorted(absent)}"
    # Fault-only families are still declared, so the scrape says what they are.
    family = sample_families()
    for sample in FAULT_ONLY:
        assert f"# TYPE {family[sample]}" in text
