"""`kvproxy canary`: it has teeth against the vulnerable simulator, and kvproxy in front of
the same simulator passes (leaks the tripwire caught are withheld, never delivered)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from kvtest import canary_settings, serving, sim_and_proxy

from kvproxy.sim.launcher import SimCluster, SimOptions
from kvproxy.tools.client import parse_reply
from kvproxy.tools.isolation.harness import (
    CAVEATS,
    SCENARIOS,
    CanaryOptions,
    run_isolation,
    summary,
)


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
    # Exact counting (the engine's /tokenize): the boundary's text probes of limit and
    # limit-1 tokens must be admitted, which an upper-bound counter cannot promise.
    async with sim_and_proxy(max_context=8192, tokenizer="engine", **canary_settings()) as (
        sim,
        proxy,
    ):
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
    # Each run alone is incomplete (the other's scenarios were not requested); together
    # they ran all four, each of which passed.
    assert safe.verdict == "incomplete", summary(safe)
    assert safe.not_run == {"transfer_failure": "not requested (--scenarios)"}
    assert failing.verdict == "incomplete", summary(failing)
    assert failing.scenarios_run == 1
    assert all(s.verdict == "pass" for s in by_name.values()), summary(safe) + summary(failing)
    for name in ("normal_long", "boundary", "cancel", "transfer_failure"):
        assert by_name[name].foreign_markers == [], name
    assert by_name["boundary"].rejections_seen == 1
    assert by_name["boundary"].probe_kind == "text"
    assert "limit-1 and limit admitted, limit+1 rejected" in by_name["boundary"].notes
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
        CanaryOptions(
            target="http://127.0.0.1:9", model="m", scenarios=("normal_long", "cancel"), rounds=1
        )
    )
    assert report.verdict == "fail"
    assert all(s.verdict == "fail" for s in report.scenarios)
    # None of them ran: the count says so, and why.
    assert report.scenarios_run == 0
    assert set(report.not_run) == set(SCENARIOS)
    assert "FAIL (0 of 4 scenarios run)" in summary(report)
    problem = report.scenarios[0].problems[-1]
    assert "target refused the preflight" in problem, problem
    assert "is the target reachable?" in problem


def test_reply_parsing_recognises_a_withheld_stream_and_errors() -> None:
    blocked = (
        b'data: {"choices":[{"index":0,"delta":{"content":"hello "}}]}\n\n'
        b'data: {"error":{"code":"canary_violation","message":"withheld"}}\n\ndata: [DONE]\n\n'
    )
    reply = parse_reply(200, {"Content-Type": "text/event-stream"}, blocked)
    assert reply.blocked
    assert reply.texts == ["hello "]
    rejected = json.dumps({"error": {"code": "context_length_exceeded"}}).encode()
    reply = parse_reply(400, {"Content-Type": "application/json"}, rejected)
    assert reply.code == "context_length_exceeded"
    assert reply.texts == []
    # SGLang's native shape has no code field: kvproxy's header carries it.
    sglang = json.dumps({"error": {"message": "capacity unknown"}}).encode()
    assert parse_reply(503, {"X-Kvproxy-Error-Code": "capacity_unknown"}, sglang).code == (
        "capacity_unknown"
    )


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


@contextlib.asynccontextmanager
async def refusing_target(models: list[str]) -> AsyncIterator[tuple[str, list[str]]]:
    """A target that lists `models` and answers every generation request the way smg
    answers a request for a model no worker serves: 503 no_available_workers."""
    seen: list[str] = []

    async def list_models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m} for m in models]})

    async def refuse(request: web.Request) -> web.Response:
        seen.append(request.path)
        err = {"type": "server_error", "code": "no_available_workers", "message": "none"}
        return web.json_response({"error": err}, status=503)

    app = web.Application()
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/{tail:.*}", refuse)
    async with serving(app) as url:
        yield url, seen


async def run_canary_cli(*args: str) -> tuple[int | None, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvproxy",
        "canary",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    # Bounded: the old harness waited two minutes per cancel round on such a target.
    out, err = await asyncio.wait_for(proc.communicate(), REFUSAL_BOUND_S)
    return proc.returncode, out.decode(), err.decode()


REFUSAL_BOUND_S = 30.0


async def test_a_target_that_refuses_every_probe_fails_fast_naming_status_and_code() -> None:
    async with refusing_target(["kvproxy-sim"]) as (url, seen):
        code, out, err = await run_canary_cli("--target", url, "--limit", "4000")
    assert code == 1
    assert "model kvproxy-sim (from " in err
    assert "target refused the preflight" in out
    assert "503 no_available_workers — is --model right?" in out
    # Stopped at the first refusal: the scenarios were never sent.
    assert seen == ["/v1/chat/completions"]


async def test_a_refusal_mid_scenario_stops_that_scenario_only() -> None:
    """Every scenario, run on its own against a target that serves the preflight and then
    refuses: each stops at its first refused request, with the status and code."""
    served = {"n": 0}

    async def list_models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def answer(request: web.Request) -> web.Response:
        served["n"] += 1
        if served["n"] == 1:
            body = {"choices": [{"index": 0, "message": {"content": "ok"}}]}
            return web.json_response(body)
        return web.json_response({"error": {"code": "rate_limited"}}, status=429)

    app = web.Application()
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/{tail:.*}", answer)
    async with serving(app) as url:
        report = await asyncio.wait_for(
            run_isolation(CanaryOptions(target=url, limit=400, rounds=2)), REFUSAL_BOUND_S
        )
    by_name = {s.name: s for s in report.scenarios}
    assert report.verdict == "fail"
    for name in ("normal_long", "boundary", "cancel"):
        assert by_name[name].verdict == "fail", name
        assert any("429 rate_limited" in p for p in by_name[name].problems), by_name[name]
    assert by_name["transfer_failure"].verdict == "skipped"


async def test_several_models_with_one_limit_exits_1_asking_which_model() -> None:
    # A limit (or a simulator, or an engine) belongs to one model's engines: with several
    # listed and no --model, nothing is sent and the refusal names them.
    async with refusing_target(["a-model", "b-model"]) as (url, seen):
        code, _, err = await run_canary_cli("--target", url, "--limit", "4000")
    assert code == 1
    assert "2 models (a-model, b-model)" in err
    assert "pass --model too" in err
    assert seen == []


async def test_over_strict_boundary_is_its_own_verdict() -> None:
    """kvproxy counting with `tokenizer: bytes` refuses text prompts of limit and limit-1
    engine tokens (its count is an upper bound): not a pass of the boundary."""
    async with sim_and_proxy(max_context=8192, tokenizer="bytes") as (sim, proxy):
        report = await run_isolation(
            CanaryOptions(target=proxy.public_url, sim=sim.router_url, scenarios=("boundary",))
        )
    boundary = report.scenarios[0]
    assert boundary.verdict == "over_strict", summary(report)
    assert report.verdict == "over_strict"
    assert boundary.probe_kind == "text"
    assert any("a legal prompt was refused" in p for p in boundary.problems)
    assert "OVER_STRICT" in summary(report)


@pytest.mark.slow
async def test_an_unarmed_kvproxy_is_named_with_the_config_that_arms_it() -> None:
    """kvproxy's default configuration (no canaries, tenant header not trusted) in front of
    the vulnerable simulator: the leak is delivered, and the harness says why nothing was
    withheld, from the admin URL when given, else from the response headers."""
    async with sim_and_proxy(max_context=8192) as (sim, proxy):
        with_admin = await run_isolation(
            CanaryOptions(
                target=proxy.public_url,
                sim=sim.router_url,
                proxy_admin=proxy.admin_url,
                rounds=2,
                scenarios=("transfer_failure",),
            )
        )
        headers_only = await run_isolation(
            CanaryOptions(
                target=proxy.public_url,
                sim=sim.router_url,
                rounds=2,
                scenarios=("transfer_failure",),
            )
        )
    assert with_admin.verdict == "fail"
    assert with_admin.scenarios[0].foreign_markers
    trip = with_admin.tripwire
    assert trip is not None
    assert trip["source"].endswith("/tripwire")
    assert any("trust_tenant_header is false" in r for r in trip["reasons"])
    assert any("no canaries configured for canary-a, canary-b" in r for r in trip["reasons"])
    assert "trust_tenant_header: true" in trip["config"]
    assert 'patterns: ["KVCANARY-canary-a-[0-9a-f]{16}"]' in trip["config"]
    assert "kvproxy configuration that arms it" in summary(with_admin)
    assert headers_only.tripwire is not None
    assert headers_only.tripwire["source"] == "X-Kvproxy-Decision response headers"


async def test_an_armed_kvproxy_gets_no_tripwire_advice() -> None:
    async with sim_and_proxy(max_context=8192, **canary_settings()) as (sim, proxy):
        report = await run_isolation(
            CanaryOptions(
                target=proxy.public_url,
                sim=sim.router_url,
                proxy_admin=proxy.admin_url,
                rounds=2,
                scenarios=("transfer_failure",),
            )
        )
    assert report.scenarios[0].blocked_by_tripwire > 0
    assert report.tripwire is None


async def test_a_target_listing_several_models_is_checked_once_per_model(
    tmp_path: Path,
) -> None:
    """No --model and /v1/models lists two (a router serving two models): one run each,
    each requesting its own model, one section each in the report, the worst verdict."""
    asked: list[str] = []

    async def list_models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "qwen"}, {"id": "glm"}]})

    async def refuse(request: web.Request) -> web.Response:
        asked.append(orjson.loads(await request.read()).get("model"))
        err = {"type": "server_error", "code": "no_available_workers", "message": "none"}
        return web.json_response({"error": err}, status=503)

    app = web.Application()
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/{tail:.*}", refuse)
    report = tmp_path / "canary.json"
    async with serving(app) as url:
        code, out, _ = await run_canary_cli("--target", url, "--report", str(report))
    assert code == 1
    assert asked == ["qwen", "glm"]  # each model's preflight, in the listed order
    data = json.loads(report.read_text())
    assert data["schema"] == "kvproxy.canary.models/1"
    assert data["verdict"] == "fail"
    assert list(data["models"]) == ["qwen", "glm"]
    for name, section in data["models"].items():
        assert section["schema"] == "kvproxy.canary/1"
        assert section["model"] == name
        assert section["verdict"] == "fail"
    assert "2 models: FAIL" in out
