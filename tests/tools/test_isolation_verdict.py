"""A canary verdict cannot read as a pass for what it did not run (issue #33.4).

The harness takes the boundary's limit from kvproxy's `/capacity` (`--proxy-admin`); a run
in which some scenario was skipped or not requested is INCOMPLETE, says how many of the
four ran, and exits 1 unless the operator asked for a partial run; the JSON report and the
release gate say the same.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
from aiohttp import web
from kvtest import canary_settings, serving, sim_and_proxy

from kvproxy.tools.check.boundary import isolation_checks
from kvproxy.tools.check.record import SCHEMA_PATH
from kvproxy.tools.isolation.harness import (
    CanaryOptions,
    CanaryReport,
    proxy_capacity,
    run_isolation,
    run_verdict,
    summary,
    worst,
)
from kvproxy.tools.isolation.scenarios import NEEDS_SIM_REASON, SCENARIOS, ScenarioResult

CLI_BOUND_S = 180.0


def test_worst_orders_fail_over_strict_incomplete_pass_and_skipped_is_incomplete() -> None:
    assert worst(["pass", "skipped"]) == "incomplete"
    assert worst(["pass", "incomplete", "over_strict"]) == "over_strict"
    assert worst(["skipped", "fail"]) == "fail"
    assert worst(["pass", "pass"]) == "pass"
    assert worst([]) == "pass"


def report_with(*verdicts: str, accepted: bool = False) -> CanaryReport:
    names = ("normal_long", "boundary", "cancel", "transfer_failure")
    results = [ScenarioResult(n, v) for n, v in zip(names, verdicts, strict=True)]  # type: ignore[arg-type]
    not_run = {r.name: "needs --sim" for r in results if r.verdict == "skipped"}
    return CanaryReport(
        schema="kvproxy.canary/1",
        kvproxy_version="t",
        target="http://t",
        sim=None,
        started_at=0.0,
        finished_at=0.0,
        tenants=["canary-a", "canary-b"],
        model="m",
        model_source="--model",
        limit_tokens=None,
        limit_source=None,
        scenarios=results,
        verdict=worst(verdicts),
        scenarios_run=sum(v != "skipped" for v in verdicts),
        not_run=not_run,
        partial_accepted=accepted,
    )


@pytest.mark.parametrize("accepted", [False, True])
def test_the_gate_fails_a_skipped_scenario_unless_the_partial_run_was_accepted(
    accepted: bool,
) -> None:
    report = report_with("pass", "pass", "skipped", "pass", accepted=accepted)
    assert report.verdict == "incomplete"
    assert report.exit_ok() is accepted
    checks = {c.name: c for c in isolation_checks(report)}
    skipped = checks["isolation cancel"]
    assert skipped.passed is accepted
    assert "not run (needs --sim)" in skipped.detail
    assert skipped.data["how"] == "not run: needs --sim"
    names = ("normal_long", "boundary", "transfer_failure")
    assert all(checks[f"isolation {n}"].passed for n in names)
    assert all(checks[f"isolation {n}"].data["how"].startswith("ran: ") for n in names)
    head = summary(report).splitlines()[0]
    assert "INCOMPLETE (3 of 4 scenarios run" in head
    assert ("partial run accepted" in head) is accepted


def _transfer_failure_skipped(sim: str | None) -> list[ScenarioResult]:
    results = [ScenarioResult(n, "pass") for n in ("normal_long", "boundary", "cancel")]
    skipped = ScenarioResult("transfer_failure", "skipped")
    skipped.notes.append(NEEDS_SIM_REASON if sim is None else "the simulator refused")
    return [*results, skipped]


def test_a_scenario_a_real_stack_cannot_run_is_not_run_but_no_gap() -> None:
    """transfer_failure needs the simulator's fault API. Against a real stack (no --sim) it
    is recorded as not run, with the reason, and neither makes the run incomplete nor fails
    the gate; the three that ran say how they ran."""
    results = _transfer_failure_skipped(None)
    verdict, not_run = run_verdict(results, SCENARIOS, None)
    assert verdict == "pass"
    assert not_run == {"transfer_failure": NEEDS_SIM_REASON}
    report = report_with("pass", "pass", "pass", "skipped")
    report.not_run, report.verdict = not_run, verdict
    assert report.exit_ok()
    checks = {c.name: c for c in isolation_checks(report)}
    tf = checks["isolation transfer_failure"]
    assert tf.passed
    assert "not counted against the gate" in tf.detail
    assert tf.data["how"] == f"not run: {NEEDS_SIM_REASON}"
    assert "--sim" in tf.data["how"]
    for name in ("normal_long", "boundary", "cancel"):
        assert checks[f"isolation {name}"].data["how"] == (
            "ran: 0 requests through the target, judged on the replies' markers only"
        )


def test_with_the_simulator_a_skipped_transfer_failure_is_still_a_gap() -> None:
    """Given --sim, the fault API exists: a transfer_failure that did not run (the simulator
    refused the injection) leaves the run incomplete and fails the gate."""
    sim = "http://sim"
    verdict, not_run = run_verdict(_transfer_failure_skipped(sim), SCENARIOS, sim)
    assert verdict == "incomplete"
    assert "transfer_failure" in not_run
    report = report_with("pass", "pass", "pass", "skipped")
    report.sim, report.not_run, report.verdict = sim, not_run, verdict
    assert not report.exit_ok()
    assert not next(
        c for c in isolation_checks(report) if c.name.endswith("transfer_failure")
    ).passed


async def test_without_the_simulator_the_run_is_incomplete_and_the_limit_comes_from_capacity() -> (
    None
):
    """kvproxy (default tokenizer, armed tripwire) in front of the simulator, the harness
    given only --proxy-admin: the boundary runs at kvproxy's published limit, with prompts
    measured by the engines /capacity lists; transfer_failure cannot run (no fault API),
    so the verdict is INCOMPLETE, not PASS."""
    async with sim_and_proxy(max_context=8192, **canary_settings()) as (_, proxy):
        published = proxy.services.models.first.capacity.limits().admission_limit_tokens
        opts = CanaryOptions(
            target=proxy.public_url,
            proxy_admin=proxy.admin_url,
            scenarios=("boundary", "transfer_failure"),
            rounds=1,
        )
        report = await run_isolation(opts)
    by_name = {s.name: s for s in report.scenarios}
    assert (report.limit_tokens, report.limit_source) == (
        published,
        f"{proxy.admin_url}/capacity admission_limit_tokens",
    )
    assert by_name["boundary"].verdict == "pass", summary(report)
    assert by_name["boundary"].probe_kind == "text"  # the engines' /tokenize, from /capacity
    assert by_name["transfer_failure"].verdict == "skipped"
    assert report.verdict == "incomplete"
    assert (report.scenarios_run, report.scenarios_total) == (1, 4)
    assert set(report.not_run) == {"normal_long", "cancel", "transfer_failure"}
    assert report.not_run["normal_long"] == "not requested (--scenarios)"
    assert "--sim" in report.not_run["transfer_failure"]
    assert not report.exit_ok()
    text = summary(report)
    assert text.splitlines()[0].endswith("INCOMPLETE (1 of 4 scenarios run)")
    assert "not run: transfer_failure" in text
    # The report is what the release record embeds: it validates against that schema.
    schema = json.loads(SCHEMA_PATH.read_text())["properties"]["isolation"]
    jsonschema.Draft202012Validator(schema).validate(json.loads(json.dumps(report.to_json())))


async def run_canary(*args: str) -> tuple[int | None, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvproxy",
        "canary",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), CLI_BOUND_S)
    return proc.returncode, out.decode()


async def test_an_incomplete_run_exits_1_unless_a_partial_run_was_asked_for(
    tmp_path: Path,
) -> None:
    async with sim_and_proxy(max_context=8192, **canary_settings()) as (_, proxy):
        base = ("--target", proxy.public_url, "--proxy-admin", proxy.admin_url, "--rounds", "1")
        base += ("--scenarios", "boundary")
        report = tmp_path / "canary.json"
        code, out = await run_canary(*base, "--report", str(report))
        accepted, accepted_out = await run_canary(*base, "--allow-partial")
    assert code == 1, out
    assert "INCOMPLETE (1 of 4 scenarios run)" in out
    data = json.loads(report.read_text())
    assert data["verdict"] == "incomplete"
    assert (data["scenarios_run"], data["partial_accepted"]) == (1, False)
    assert accepted == 0, accepted_out
    assert "INCOMPLETE (1 of 4 scenarios run; partial run accepted" in accepted_out


@pytest.mark.parametrize(
    ("capacity", "model", "limit"),
    [
        ({"limits": {"known": True, "admission_limit_tokens": 4878}}, "m", 4878),
        ({"limits": {"known": False, "admission_limit_tokens": None}}, "m", None),
        (
            {
                "models": {
                    "qwen": {
                        "aliases": ["q"],
                        "limits": {"known": True, "admission_limit_tokens": 7},
                    },
                    "glm": {"aliases": [], "limits": {"known": True, "admission_limit_tokens": 9}},
                }
            },
            "q",
            7,
        ),
    ],
)
async def test_the_limit_is_the_named_models_published_one(
    capacity: dict[str, Any], model: str, limit: int | None
) -> None:
    async def answer(_: web.Request) -> web.Response:
        return web.json_response(capacity)

    app = web.Application()
    app.router.add_get("/capacity", answer)
    async with serving(app) as url, aiohttp.ClientSession() as http:
        section = await proxy_capacity(http, url, model)
    limits = (section or {}).get("limits") or {}
    got = limits.get("admission_limit_tokens") if limits.get("known") else None
    assert got == limit
