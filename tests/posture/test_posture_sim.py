"""Posture against the simulator (the independent oracle): as the demo starts it (SGLang
0.5.21-sim, mooncake, no checksum) /capacity names the advisory with its source, the
metric reports it and `kvproxy check` exits 1 naming it; with a fixed version and the
checksum on both sides the same passes. Readiness follows `posture_action`."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest

from kvproxy.capacity import CapacityMonitor
from kvproxy.config import Settings
from kvproxy.observe.metrics import Metrics
from kvproxy.sim.launcher import SimCluster, SimOptions
from kvproxy.tools.check.record import SCHEMA_PATH

PENDING = "sglang-pd-pending-rejection-transfer"
SOURCE = "https://github.com/sgl-project/sglang/pull/30325"


@pytest.fixture
async def sim_factory() -> AsyncIterator[Any]:
    made: list[SimCluster] = []

    async def make(**opts: Any) -> SimCluster:
        cluster = SimCluster(SimOptions(port=0, prefill_port=0, decode_port=0, **opts))
        await cluster.start()
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        await cluster.close()


def engines(sim: SimCluster) -> list[dict[str, str]]:
    return [
        {"url": sim.prefill_url, "role": "prefill", "kind": "sglang"},
        {"url": sim.decode_url, "role": "decode", "kind": "sglang"},
    ]


async def snapshot(sim: SimCluster, **settings: Any) -> tuple[dict[str, Any], Metrics, bool]:
    metrics = Metrics()
    async with aiohttp.ClientSession() as http:
        monitor = CapacityMonitor(Settings(engines=engines(sim), **settings), metrics, http)
        await monitor.refresh_now()
        return monitor.snapshot_json(), metrics, monitor.posture.blocks_ready()


def advisory_gauge(metrics: Metrics) -> dict[tuple[str, str], float]:
    return {
        (s.labels["engine"], s.labels["advisory"]): s.value
        for fam in metrics.registry.collect()
        if fam.name == "kvproxy_engine_advisory"
        for s in fam.samples
    }


async def test_the_demo_simulator_shows_an_active_advisory(sim_factory: Any) -> None:
    sim = await sim_factory()
    snap, metrics, blocks = await snapshot(sim)
    posture = snap["posture"]
    assert posture["blocking"] == [PENDING]
    finding = next(f for f in posture["findings"] if f["engines"] == [sim_label(sim, "prefill")])
    assert finding["id"] == PENDING
    assert finding["source"] == SOURCE
    assert finding["fixed_in"] == "0.5.22"
    assert "0.5.21-sim" in finding["detail"]
    shown = {e["role"]: e["posture"] for e in posture["engines"]}
    assert shown["prefill"]["version"] == "0.5.21-sim"
    assert shown["prefill"]["transfer_backend"] == "mooncake"
    assert shown["decode"]["kv_checksum"] == "off"
    assert shown["decode"]["failures"] == {"transfer": 0.0, "bootstrap": 0.0}
    # The same posture rides along in each engine's measurement.
    assert snap["engines"][0]["measurement"]["posture"]["version"] == "0.5.21-sim"
    gauge = advisory_gauge(metrics)
    assert gauge == {(sim_label(sim, "prefill"), PENDING): 1.0,
                     (sim_label(sim, "decode"), PENDING): 1.0}  # fmt: skip
    assert not blocks  # posture_action: warn leaves readiness alone


def sim_label(sim: SimCluster, role: str) -> str:
    url = sim.prefill_url if role == "prefill" else sim.decode_url
    return url.removeprefix("http://")


async def test_a_fixed_version_with_checksum_on_both_sides_has_no_finding(
    sim_factory: Any,
) -> None:
    sim = await sim_factory(engine_version="0.5.23", transfer_backend="nixl", kv_checksum=True)
    snap, metrics, blocks = await snapshot(sim, posture_action="not_ready")
    assert snap["posture"]["findings"] == []
    assert {e["posture"]["kv_checksum"] for e in snap["posture"]["engines"]} == {"on"}
    assert advisory_gauge(metrics) == {}
    assert not blocks


async def test_nixl_at_0_5_22_is_still_affected(sim_factory: Any) -> None:
    sim = await sim_factory(engine_version="0.5.22", transfer_backend="nixl")
    snap, _, _ = await snapshot(sim)
    assert snap["posture"]["blocking"] == ["sglang-pd-failed-send-as-drained"]


async def test_not_ready_action_and_acceptance(sim_factory: Any) -> None:
    sim = await sim_factory()
    _, _, blocks = await snapshot(sim, posture_action="not_ready")
    assert blocks
    snap, metrics, blocks = await snapshot(
        sim, posture_action="not_ready", accept_advisories=[PENDING]
    )
    assert not blocks
    assert snap["posture"]["advisories"]["accepted"] == [PENDING]
    assert set(advisory_gauge(metrics).values()) == {0.0}


async def test_a_one_sided_checksum_is_found(sim_factory: Any) -> None:
    sim = await sim_factory(engine_version="0.5.23")
    await sim.stop_server("decode")
    await sim.start_server("decode", kv_checksum=True)
    snap, _, _ = await snapshot(sim)
    assert snap["posture"]["blocking"] == ["kv-checksum-one-sided"]


async def run_check(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvproxy", "check", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def record(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((path / "release-record.json").read_text())
    jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text())).validate(data)
    return data


async def test_kvproxy_check_fails_on_the_demo_simulator_and_passes_when_fixed(
    sim_factory: Any, tmp_path: Path
) -> None:
    demo = await sim_factory()
    fixed = await sim_factory(engine_version="0.5.23", kv_checksum=True)
    rc, out = await run_check("--engines", json.dumps(engines(demo)), "--out", str(tmp_path / "a"))
    rc_ok, out_ok = await run_check(
        "--engines", json.dumps(engines(fixed)), "--out", str(tmp_path / "b")
    )
    assert rc == 1, out
    assert f"{PENDING} on" in out
    assert SOURCE in out
    failed = record(tmp_path / "a")
    assert failed["failed_checks"] == ["engine posture"]
    assert failed["posture"]["blocking"] == [PENDING]
    assert {e["posture"]["version"] for e in failed["posture"]["engines"]} == {"0.5.21-sim"}
    md = (tmp_path / "a" / "release-record.md").read_text()
    assert "## Engine posture" in md
    assert f"`{PENDING}`" in md
    assert "| 0.5.21-sim | mooncake | off |" in md

    assert rc_ok == 0, out_ok
    assert "RESULT: PASS" in out_ok
    passed = record(tmp_path / "b")
    assert passed["posture"]["findings"] == []
    assert {e["posture"]["kv_checksum"] for e in passed["posture"]["engines"]} == {"on"}


async def test_an_accepted_advisory_passes_the_gate_and_is_recorded(
    sim_factory: Any, tmp_path: Path
) -> None:
    demo = await sim_factory()
    config = tmp_path / "kvproxy.yaml"
    config.write_text(f"accept_advisories: [{PENDING}]\n")
    rc, out = await run_check(
        "--config", str(config), "--engines", json.dumps(engines(demo)),
        "--out", str(tmp_path / "r"),
    )  # fmt: skip
    assert rc == 0, out
    assert f"accepted by the operator: {PENDING}" in out
    data = record(tmp_path / "r")
    assert data["posture"]["advisories"]["accepted"] == [PENDING]
    assert all(f["accepted"] for f in data["posture"]["findings"])
    md = (tmp_path / "r" / "release-record.md").read_text()
    assert f"- accepted advisories: {PENDING}" in md
