"""`kvproxy canary`: it has teeth against the vulnerable simulator, and kvproxy in front of
the same simulator passes (leaks the tripwire caught are withheld, never delivered)."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import aiohttp
import pytest
from kvtest import canary_settings, sim_and_proxy

from kvproxy.isolation import CAVEATS, CanaryOptions, _parse_reply, run_isolation, summary
from kvproxy.sim.launcher import SimCluster, SimOptions


def free_sim() -> SimOptions:
    return SimOptions(port=0, prefill_port=0, decode_port=0, mode="vulnerable")


@pytest.mark.slow
async def test_direct_to_the_vulnerable_simulator_the_harness_finds_leaks() -> None:
    async with SimCluster(free_sim()) as sim:
        report = await run_isolation(
            CanaryOptions(target=sim.router_url, sim=sim.router_url, rounds=2)
        )
    by_name = {s.name: s for s in report.scenarios}
    assert report.verdict == "fail"
    for name in ("boundary", "cancel", "transfer_failure"):
        assert by_name[name].verdict == "fail", name
        assert by_name[name].foreign_markers, name
        assert all(f.delivered for f in by_name[name].foreign_markers)
    assert any("must be rejected before the engine" in p for p in by_name["boundary"].problems)
    assert any("reached the engines" in p for p in by_name["boundary"].problems)


@pytest.mark.slow
async def test_through_kvproxy_the_same_run_passes() -> None:
    async with sim_and_proxy(max_context=8192, **canary_settings()) as (sim, proxy):
        safe = await run_isolation(
            CanaryOptions(
                target=proxy.public_url,
                sim=sim.router_url,
                rounds=2,
                scenarios=("normal_long", "boundary", "cancel"),
            )
        )
        truth = await _sim_stats(sim.router_url)
        # Failed sends treated as drained (the vulnerable sim's third mode) do leak: the
        # proxy cannot stop the engine reading stale pages, only withhold what it returns.
        failing = await run_isolation(
            CanaryOptions(
                target=proxy.public_url,
                sim=sim.router_url,
                rounds=2,
                scenarios=("transfer_failure",),
            )
        )
        violations = sum(
            proxy.metrics.canary_violations.labels(t)._value.get() for t in ("canary-a", "canary-b")
        )
    by_name = {s.name: s for s in (*safe.scenarios, *failing.scenarios)}
    assert safe.verdict == "pass", summary(safe)
    assert failing.verdict == "pass", summary(failing)
    for name in ("normal_long", "boundary", "cancel", "transfer_failure"):
        assert by_name[name].foreign_markers == [], name
    assert by_name["boundary"].rejections_seen == 1
    assert any("never arrived" in n for n in by_name["boundary"].notes)
    # Deferred cancellation: no write landed in a page another request owned.
    assert truth["decode"]["late_writes_into_reallocated_pages"] == 0
    assert truth["decode"]["pages_freed_before_drain"] == 0
    assert by_name["transfer_failure"].blocked_by_tripwire == violations
    assert violations > 0


async def _sim_stats(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(url + "/sim/stats") as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def test_an_unreachable_target_is_not_a_pass() -> None:
    report = await run_isolation(
        CanaryOptions(target="http://127.0.0.1:9", scenarios=("normal_long", "cancel"), rounds=1)
    )
    assert report.verdict == "fail"
    assert all(s.verdict == "fail" for s in report.scenarios)
    assert "no request was answered" in report.scenarios[0].problems[-1]


def test_reply_parsing_recognises_a_withheld_stream_and_errors() -> None:
    blocked = (
        b'data: {"choices":[{"index":0,"delta":{"content":"hello "}}]}\n\n'
        b'data: {"error":{"code":"canary_violation","message":"withheld"}}\n\ndata: [DONE]\n\n'
    )
    reply = _parse_reply(200, {"Content-Type": "text/event-stream"}, blocked)
    assert reply.blocked
    assert reply.texts == ["hello "]
    rejected = json.dumps({"error": {"code": "context_length_exceeded"}}).encode()
    reply = _parse_reply(400, {"Content-Type": "application/json"}, rejected)
    assert reply.code == "context_length_exceeded"
    assert reply.texts == []
    sglang = json.dumps({"object": "error", "kvproxy_code": "capacity_unknown"}).encode()
    assert _parse_reply(503, {}, sglang).code == "capacity_unknown"


def test_the_summary_says_what_a_pass_does_not_prove() -> None:
    assert any("not proof" in c for c in CAVEATS)


@pytest.mark.slow
async def test_cli_exits_1_on_leaks_and_writes_the_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    report = tmp_path / "canary.json"
    async with SimCluster(free_sim()) as sim:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvproxy",
            "canary",
            "--target",
            sim.router_url,
            "--sim",
            sim.router_url,
            "--scenarios",
            "boundary",
            "--report",
            str(report),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 1
    assert b"FAIL" in out
    data = json.loads(report.read_text())
    assert data["schema"] == "kvproxy.canary/1"
    assert data["scenarios"][0]["foreign_markers"]
    assert data["caveats"]
