"""`kvproxy check` in gateway mode (kvproxy.tools.check.clusters): every cluster of a model
gated on its own engines and recorded in its own section, and the proxy's routing between
them probed at each cluster's limit, with each cluster's simulator as ground truth.

Two simulator clusters with different pools (limits 2,041 and 5,315) behind a real kvproxy
whose `upstreams` name each simulator's own router; prompts are the simulator's byte
tokens, so their sizes are exact by construction.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ports import free_port
from test_check_gate import validate

from kvproxy.config import ConfigError, load_settings
from kvproxy.observe import Metrics
from kvproxy.serve.app import KvproxyServer
from kvproxy.sim.launcher import SimCluster, SimOptions
from kvproxy.tools.check.cli import add_arguments, check_sims, sim_urls
from kvproxy.tools.check.record import SCHEMA

POOLS = {"small": 2048, "large": 5322}
LIMITS = {"small": 2041, "large": 5315}


def sim_options(pool: int) -> SimOptions:
    # A fixed engine version: the posture gate is tested in tests/posture/.
    return SimOptions(
        port=0, prefill_port=0, decode_port=0, engine_version="0.5.23", prefill_pool_tokens=pool
    )


def upstreams(sims: dict[str, SimCluster], router: dict[str, str]) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "url": router[name],
            "weight": 1,
            "engines": [
                {"url": sim.prefill_url, "role": "prefill", "kind": "sglang"},
                {"url": sim.decode_url, "role": "decode", "kind": "sglang"},
            ],
        }
        for name, sim in sims.items()
    ]


@contextlib.asynccontextmanager
async def gateway(clusters: list[dict[str, Any]]) -> AsyncIterator[KvproxyServer]:
    settings = load_settings(
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        access_log=False,
        upstreams=clusters,
        tokenizer="engine",
        capacity_refresh_s=0.5,
        capacity_stale_s=5.0,
    )
    server = KvproxyServer(settings, Metrics())
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def measured(proxy: KvproxyServer, names: list[str]) -> None:
    """Bounded wait until every cluster is measured (the first probe runs in background)."""
    for _ in range(300):
        if all(
            proxy.metrics.registry.get_sample_value(
                "kvproxy_upstream_capacity_known", {"model": "default", "upstream": n}
            )
            == 1
            for n in names
        ):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the proxy never measured every cluster")


async def check_cli(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvproxy", "check", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode is not None
    return proc.returncode, out.decode() + err.decode()


async def test_check_gates_each_cluster_and_the_routing_between_them(tmp_path: Path) -> None:
    async with (
        SimCluster(sim_options(POOLS["small"])) as small,
        SimCluster(sim_options(POOLS["large"])) as large,
    ):
        sims = {"small": small, "large": large}
        clusters = upstreams(sims, {n: s.router_url for n, s in sims.items()})
        cfg = tmp_path / "kvproxy.yaml"
        cfg.write_text(yaml.safe_dump({"upstreams": clusters, "tokenizer": "engine"}))
        # A second gateway whose clusters' engines answer nowhere: none is measured, so it
        # must fail closed (503 capacity_unknown) rather than pick a cluster.
        blind = [
            {
                **c,
                "engines": [{**e, "url": f"http://127.0.0.1:{free_port()}"} for e in c["engines"]],
            }
            for c in clusters
        ]
        async with gateway(clusters) as proxy, gateway(blind) as unknown:
            await measured(proxy, list(sims))
            rc, out = await check_cli(
                "--config", str(cfg),
                "--proxy", proxy.public_url, "--proxy-admin", proxy.admin_url,
                "--sim", f"small={small.router_url}", "--sim", f"large={large.router_url}",
                "--unknown-probe", unknown.public_url,
                "--out", str(tmp_path / "rec"),
            )  # fmt: skip
    assert rc == 0, out
    record = validate(tmp_path / "rec" / "release-record.json")
    assert record["schema"] == SCHEMA
    assert record["passed"] is True
    # One section per cluster, each on its own engines and limits.
    assert list(record["clusters"]) == ["small", "large"]
    for name, section in record["clusters"].items():
        sim = sims[name]
        assert {e["url"] for e in section["engines"]} == {sim.prefill_url, sim.decode_url}
        assert section["limits"]["admission_limit_tokens"] == LIMITS[name]
        assert section["passed"] is True
        checks = {c["name"]: c for c in section["checks"]}
        assert checks["proxy enforces the measured limit"]["passed"]
    # The model's limits: the largest any cluster offers, naming it.
    assert record["limits"]["admission_limit_tokens"] == LIMITS["large"]
    assert record["limits"]["cluster"] == "large"
    assert {e["cluster"] for e in record["engines"]} == {"small", "large"}
    assert record["deferred_cancellations"]["proxy_upstream_limit_tokens"] == LIMITS
    checks = {c["name"]: c for c in record["checks"]}
    # Between the limits: admitted and arrived only at the large cluster.
    between = checks[f"boundary {LIMITS['small'] + 1:,} tokens (held by large)"]
    assert between["passed"], between
    assert between["data"]["status"] == 200
    assert between["data"]["arrived"]["small"] == ""
    assert between["data"]["arrived"]["large"]
    # At the small limit both hold it; over the large one, refused and arrived nowhere.
    assert checks[f"boundary {LIMITS['small']:,} tokens (held by large, small)"]["passed"]
    over = checks[f"boundary {LIMITS['large'] + 1:,} tokens (over every cluster, ceiling 5,315)"]
    assert over["passed"], over
    assert over["data"]["status"] == 400
    assert over["data"]["arrived"] == {"small": "", "large": ""}
    assert any(name.startswith("cluster small: measure ") for name in checks)
    assert checks["capacity-unknown probe"]["passed"], checks["capacity-unknown probe"]
    md = (tmp_path / "rec" / "release-record.md").read_text()
    assert "## Clusters (gateway mode" in md
    assert "| small |" in md
    assert "| large |" in md


async def test_check_fails_a_target_that_sends_a_prompt_to_a_cluster_too_small(
    tmp_path: Path,
) -> None:
    # The "proxy" is the small cluster's own router: every probe lands there, so the one
    # between the limits reaches an engine whose limit is below it. The gate must say so.
    async with (
        SimCluster(sim_options(POOLS["small"])) as small,
        SimCluster(sim_options(POOLS["large"])) as large,
    ):
        sims = {"small": small, "large": large}
        clusters = upstreams(sims, {n: s.router_url for n, s in sims.items()})
        cfg = tmp_path / "kvproxy.yaml"
        cfg.write_text(yaml.safe_dump({"upstreams": clusters, "tokenizer": "engine"}))
        rc, out = await check_cli(
            "--config", str(cfg), "--proxy", small.router_url,
            "--sim", f"small={small.router_url}", "--sim", f"large={large.router_url}",
            "--model", "kvproxy-sim", "--out", str(tmp_path / "rec"),
        )  # fmt: skip
    assert rc == 1, out
    record = validate(tmp_path / "rec" / "release-record.json")
    checks = {c["name"]: c for c in record["checks"]}
    between = checks[f"boundary {LIMITS['small'] + 1:,} tokens (held by large)"]
    assert not between["passed"]
    assert "it arrived at small, whose limit is below it" in between["detail"]
    # The clusters themselves measured fine: the failure is the routing's.
    assert all(s["passed"] for s in record["clusters"].values())


def test_single_cluster_record_has_no_clusters_section_and_the_schema_says_so() -> None:
    schema = json.loads(
        (
            Path(__file__).parents[2] / "kvproxy/tools/check/schemas/release_record.schema.json"
        ).read_text()
    )
    assert "clusters" in schema["properties"]
    assert "clusters" not in schema["required"]  # additive: today's records stay valid


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_sim_flags_name_clusters_or_one_url() -> None:
    assert sim_urls(parse()) == {}
    assert sim_urls(parse("--sim", "http://a:1/")) == {None: "http://a:1"}
    assert sim_urls(parse("--sim", "small=http://a:1", "--sim", "large=http://b:2")) == {
        "small": "http://a:1",
        "large": "http://b:2",
    }
    with pytest.raises(ConfigError, match="small given twice"):
        sim_urls(parse("--sim", "small=http://a:1", "--sim", "small=http://b:2"))


def test_sim_flags_must_match_the_configured_clusters() -> None:
    engines = [{"url": "http://p:1", "role": "prefill"}, {"url": "http://d:1", "role": "decode"}]
    settings = load_settings(
        upstreams=[
            {"name": "small", "url": "http://r1:8000", "engines": engines},
            {"name": "large", "url": "http://r2:8000", "engines": engines},
        ]
    )
    check_sims(parse("--sim", "small=http://a:1"), settings)
    with pytest.raises(ConfigError, match="no cluster 'medium'"):
        check_sims(parse("--sim", "medium=http://a:1"), settings)
    with pytest.raises(ConfigError, match="CLUSTER=URL for each cluster"):
        check_sims(parse("--sim", "http://a:1"), settings)
