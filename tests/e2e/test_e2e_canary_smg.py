"""`kvproxy canary` and `kvproxy check` against today's router: smg 1.13.0 in front of the
vulnerable simulator, run as an operator would (the CLI, no --model), directly and with
kvproxy (tripwire armed) in front of smg.

smg routes by the model its workers report and refuses token-id prompts (400 invalid_type):
the harness must find the model itself and probe the boundary with text whose length the
engine's own /tokenize established. Judged on the report's verdicts and the simulator's
ground truth; the CLI runs under a bounded wait, never a timed assertion.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from e2e_stack import proxy_for, sim_cluster
from real_router import MODEL, real_router

from kvproxy.config import EngineSpec
from kvproxy.tools.check.gate import GateOptions, run_gate

pytestmark = [pytest.mark.slow, pytest.mark.router]

# The CLI's own waits are bounded (probes.py, scenarios.py); this only keeps a hung run
# from hanging the suite.
CLI_BOUND_S = 240.0


async def canary_cli(tmp_path: Path, *args: str) -> tuple[int | None, str, dict[str, Any]]:
    report = tmp_path / "canary.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvproxy",
        "canary",
        *args,
        "--report",
        str(report),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), CLI_BOUND_S)
    return proc.returncode, out.decode(), json.loads(report.read_text())


async def test_canary_through_bare_smg_finds_the_leak_without_being_told_the_model(
    tmp_path: Path,
) -> None:
    async with sim_cluster(mode="vulnerable") as sim:
        async with real_router(sim, tmp_path / "router.log") as router:
            code, out, report = await canary_cli(
                tmp_path, "--target", router.url, "--sim", sim.router_url
            )
    by_name = {s["name"]: s for s in report["scenarios"]}
    assert code == 1, out
    assert report["verdict"] == "fail"
    assert report["model"] == MODEL
    assert report["model_source"] == f"{router.url}/v1/models"
    # Every scenario ran: nothing was refused (the old harness got 503 for "default").
    assert not any("target refused" in p for s in report["scenarios"] for p in s["problems"])
    boundary = by_name["boundary"]
    assert boundary["probe_kind"] == "text"
    assert boundary["verdict"] == "fail"
    assert any("must be rejected before the engine" in p for p in boundary["problems"])
    assert any("reached the engines" in p for p in boundary["problems"])
    markers = [f for s in report["scenarios"] for f in s["foreign_markers"]]
    assert markers
    assert all(f["delivered"] for f in markers)
    # smg is not kvproxy: no tripwire advice.
    assert report["tripwire"] is None


async def test_canary_through_kvproxy_and_smg_passes_with_the_boundary_exact(
    tmp_path: Path,
) -> None:
    async with sim_cluster(mode="vulnerable") as sim:
        async with (
            real_router(sim, tmp_path / "router.log") as router,
            proxy_for(sim, router.url, canary_action="block", tokenizer="engine") as proxy,
        ):
            code, out, report = await canary_cli(
                tmp_path,
                "--target",
                proxy.public_url,
                "--sim",
                sim.router_url,
                "--proxy-admin",
                proxy.admin_url,
            )
    by_name = {s["name"]: s for s in report["scenarios"]}
    assert code == 0, out
    assert report["verdict"] == "pass"
    assert report["model"] == MODEL
    boundary = by_name["boundary"]
    assert boundary["verdict"] == "pass", boundary
    assert boundary["probe_kind"] == "text"
    assert "limit-1 and limit admitted, limit+1 rejected" in boundary["notes"]
    assert boundary["rejections_seen"] == 1
    assert any("simulator confirms it never arrived" in n for n in boundary["notes"])
    assert report["limit_tokens"] is not None
    for s in report["scenarios"]:
        assert all(not f["delivered"] for f in s["foreign_markers"]), s["name"]
    # Failed transfers read stale pages inside the engine; the tripwire withheld them.
    assert by_name["transfer_failure"]["blocked_by_tripwire"] > 0
    assert report["tripwire"] is None


async def test_release_gate_through_kvproxy_and_smg_reaches_the_limit(tmp_path: Path) -> None:
    async with sim_cluster(mode="vulnerable") as sim:
        async with (
            real_router(sim, tmp_path / "router.log") as router,
            proxy_for(sim, router.url, tokenizer="engine") as proxy,
        ):
            engines = (
                EngineSpec(url=sim.prefill_url, role="prefill", kind="sglang"),
                EngineSpec(url=sim.decode_url, role="decode", kind="sglang"),
            )
            through = await run_gate(
                GateOptions(
                    engines=engines,
                    max_context=None,
                    proxy=proxy.public_url,
                    proxy_admin=proxy.admin_url,
                    sim=sim.router_url,
                    # The vulnerable sim reports 0.5.21: its advisory is the posture check's
                    # finding, accepted here because kvproxy is the protection under test.
                    accept_advisories=("sglang-pd-pending-rejection-transfer",),
                ),
                lambda _: None,
            )
            # The bare router as the "proxy": text probes pass it, and the vulnerable
            # engine admits limit+1 and transfers it.
            bare = await run_gate(
                GateOptions(
                    engines=engines, max_context=None, proxy=router.url, sim=sim.router_url
                ),
                lambda _: None,
            )
    checks = {c.name: c for c in through.checks}
    assert through.passed, through.failed_checks
    assert checks["limit reachable"].data["probe_kind"] == "text"
    plus_one = next(c for c in through.checks if c.name.startswith("boundary limit+1"))
    assert plus_one.data["decision"] == "rejected"
    assert plus_one.data["reached_engines"] == ""
    assert not bare.passed
    bare_plus = next(c for c in bare.checks if c.name.startswith("boundary limit+1"))
    assert not bare_plus.passed
    assert bare_plus.data["reached_engines"]
    assert {c.name: c for c in bare.checks}["limit reachable"].passed
