"""`kvproxy check`: the release gate against the simulator, and its record's schema."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
from aiohttp import web
from kvtest import (
    FakeUpstream,
    canary_settings,
    running_proxy,
    serving,
    sim_and_proxy,
    wait_until,
)

from kvproxy.config import IMPLICIT_MODEL, EngineSpec
from kvproxy.policy.drain import DEFERRED_OUTCOMES
from kvproxy.serve.app import KvproxyServer
from kvproxy.sim.launcher import SimCluster, SimOptions
from kvproxy.tools.check.deferred import deferred_verdict
from kvproxy.tools.check.gate import GateOptions, run_gate
from kvproxy.tools.check.record import SCHEMA_PATH, markdown, write_record

# The vulnerable simulator behind kvproxy: the operator accepts the engine's advisory
# because the proxy stops what it describes (the posture gate itself: tests/posture/).
BEHIND_KVPROXY = ("sglang-pd-pending-rejection-transfer",)


def sim_options(**kw: Any) -> SimOptions:
    # A fixed engine version: these tests are about capacity and isolation; the posture
    # gate (which fails the demo's 0.5.21-sim) is tested in tests/posture/.
    kw.setdefault("engine_version", "0.5.23")
    return SimOptions(port=0, prefill_port=0, decode_port=0, **kw)


def engines_json(sim: SimCluster) -> str:
    return json.dumps(
        [
            {"url": sim.prefill_url, "role": "prefill", "kind": "sglang"},
            {"url": sim.decode_url, "role": "decode", "kind": "sglang"},
        ]
    )


def validate(record_path: Path) -> dict[str, Any]:
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    data: dict[str, Any] = json.loads(record_path.read_text())
    jsonschema.Draft202012Validator(schema).validate(data)
    return data


async def run_cli(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvproxy",
        "check",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_declared_context_above_the_pool_fails_and_names_the_safe_value(
    tmp_path: Path,
) -> None:
    async with SimCluster(sim_options()) as sim:
        rc, out = await run_cli(
            "--engines", engines_json(sim), "--max-context", "8192", "--out", str(tmp_path)
        )
        rc_ok, out_ok = await run_cli(
            "--engines", engines_json(sim), "--max-context", "5315", "--out", str(tmp_path / "ok")
        )
    assert rc == 1, out
    assert "RESULT: FAIL" in out
    assert "largest safe context: 5,315 tokens" in out
    record = validate(tmp_path / "release-record.json")
    prefill = next(e for e in record["engines"] if e["role"] == "prefill")
    assert prefill["input_limit_tokens"] == 5315
    assert prefill["pool_tokens"] == 5322
    assert prefill["sources"]["input_limit_tokens"] == "server_info.max_req_input_len"
    assert record["declared_context_tokens"] == 8192
    assert record["safe_max_context_tokens"] == 5315
    assert record["failed_checks"] == ["declared context fits every engine"]
    md = (tmp_path / "release-record.md").read_text()
    assert "FAIL" in md
    assert "5,315" in md
    assert "8192" in md

    assert rc_ok == 0, out_ok
    assert "RESULT: PASS" in out_ok
    assert validate(tmp_path / "ok" / "release-record.json")["passed"] is True


async def test_an_unreachable_engine_fails_the_gate(tmp_path: Path) -> None:
    engines = (EngineSpec(url="http://127.0.0.1:9", role="prefill"),)
    record = await run_gate(GateOptions(engines=engines, max_context=4096), lambda _: None)
    assert not record.passed
    assert record.engines[0]["error"]["reason"] == "connect"
    # The proxy would not know its limit either (I3): the record says so, not 4,096.
    assert record.limits["known"] is False
    assert record.limits["unknown_engines"] == ["127.0.0.1:9"]
    json_path, _ = write_record(record, tmp_path)
    validate(json_path)
    # ...unless the operator configured a fallback, which the proxy would then enforce.
    fallback = await run_gate(
        GateOptions(engines=engines, max_context=4096, capacity_fallback_limit_tokens=1000),
        lambda _: None,
    )
    assert not fallback.passed
    assert (fallback.limits["admission_limit_tokens"], fallback.limits["source"]) == (
        1000,
        "declared",
    )


async def test_boundary_probes_through_kvproxy_and_directly(tmp_path: Path) -> None:
    async with sim_and_proxy(max_context=5315, tokenizer="engine") as (sim, proxy):
        engines = tuple(EngineSpec(**e) for e in json.loads(engines_json(sim)))
        through = await run_gate(
            GateOptions(
                engines=engines,
                max_context=5315,
                proxy=proxy.public_url,
                proxy_admin=proxy.admin_url,
                sim=sim.router_url,
                accept_advisories=BEHIND_KVPROXY,
            ),
            lambda _: None,
        )
        direct = await run_gate(
            GateOptions(
                engines=engines, max_context=5315, proxy=sim.router_url, sim=sim.router_url
            ),
            lambda _: None,
        )
    checks = {c.name: c for c in through.checks}
    assert through.passed, [c for c in through.checks if not c.passed]
    assert checks["boundary limit+1 (5,316 tokens)"].data["status"] == 400
    assert checks["boundary limit+1 (5,316 tokens)"].data["reached_engines"] == ""
    assert checks["boundary limit+0 (5,315 tokens)"].passed
    assert checks["limit reachable"].passed
    assert checks["boundary limit+0 (5,315 tokens)"].data["probe_kind"] == "text"
    assert through.deferred_cancellations is not None
    assert through.deferred_cancellations["proxy_admission_limit_tokens"] == 5315
    # The vulnerable engine admits the over-limit probe and transfers it: the gate fails.
    assert not direct.passed
    assert "boundary limit+1 (5,316 tokens)" in direct.failed_checks
    json_path, md_path = write_record(through, tmp_path)
    validate(json_path)
    assert md_path.read_text() == markdown(through)


@pytest.mark.slow
async def test_canary_gate_passes_through_kvproxy_and_fails_direct(tmp_path: Path) -> None:
    async with sim_and_proxy(max_context=5315, tokenizer="engine", **canary_settings()) as (
        sim,
        proxy,
    ):
        engines = tuple(EngineSpec(**e) for e in json.loads(engines_json(sim)))
        through = await run_gate(
            GateOptions(
                engines=engines,
                max_context=5315,
                proxy=proxy.public_url,
                proxy_admin=proxy.admin_url,
                sim=sim.router_url,
                accept_advisories=BEHIND_KVPROXY,
                canary=True,
            ),
            lambda _: None,
        )
        direct = await run_gate(
            GateOptions(
                engines=engines,
                max_context=5315,
                proxy=sim.router_url,
                sim=sim.router_url,
                canary=True,
            ),
            lambda _: None,
        )
    assert through.passed, through.failed_checks
    assert through.isolation is not None
    assert through.isolation["verdict"] == "pass"
    assert {s["name"] for s in through.isolation["scenarios"]} == {
        "normal_long",
        "boundary",
        "cancel",
        "transfer_failure",
    }
    assert not direct.passed
    assert any(name.startswith("isolation ") for name in direct.failed_checks)
    json_path, _ = write_record(through, tmp_path)
    assert validate(json_path)["isolation"]["caveats"]


async def test_engines_and_declared_context_come_from_the_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "kvproxy.yaml"
    cfg.write_text(
        "engines:\n"
        '  - {url: "http://127.0.0.1:9", role: prefill, kind: sglang}\n'
        "max_context: 4096\n"
    )
    rc, _ = await run_cli("--config", str(cfg), "--out", str(tmp_path))
    assert rc == 1
    record = validate(tmp_path / "release-record.json")
    assert record["engines"][0]["url"] == "http://127.0.0.1:9"
    assert record["declared_context_tokens"] == 4096


# --- deferred cancellations: an unconfirmed drain fails the gate unless accepted -------------


async def _proxy_with_a_timed_out_deferral(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> AsyncIterator[KvproxyServer]:
    """A real proxy whose one deferred cancellation ended by the drain timeout: the client
    left while the upstream had sent nothing, and the upstream stayed silent."""

    async def silent(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(3000):  # bounded: ~30 s, ended early when the proxy closes
            if request.transport is None or request.transport.is_closing():
                break
            await asyncio.sleep(0.01)
        return resp

    upstream.route("POST", "/v1/chat/completions", silent)
    await upstream.start()
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with running_proxy(upstream.url, drain_timeout_s=0.2) as proxy:
        post = asyncio.ensure_future(
            http.post(proxy.public_url + "/v1/chat/completions", json=body)
        )
        assert await wait_until(lambda: len(upstream.received) == 1)
        post.cancel()  # the client leaves before the first token (before any header, too)
        with contextlib.suppress(asyncio.CancelledError):
            await post
        timeouts = proxy.metrics.deferred_total.labels("timeout", "default")
        assert await wait_until(lambda: timeouts._value.get() == 1)
        yield proxy


STATIC = (EngineSpec(url="static://p", role="unified", kind="static", capacity_tokens=8192),)


@pytest.mark.parametrize("accept", [False, True])
async def test_a_drain_timeout_fails_the_gate_unless_the_operator_accepts_it(
    upstream: FakeUpstream, http: aiohttp.ClientSession, tmp_path: Path, accept: bool
) -> None:
    async for proxy in _proxy_with_a_timed_out_deferral(upstream, http):
        record = await run_gate(
            GateOptions(
                engines=STATIC,
                max_context=None,
                proxy_admin=proxy.admin_url,
                accept_drain_timeouts=accept,
            ),
            lambda _: None,
        )
    check = next(c for c in record.checks if c.name == "deferred cancellations")
    assert check.data["by_outcome"]["timeout"] == 1
    assert check.data["unconfirmed"] == 1
    assert record.accept_drain_timeouts is accept
    assert check.passed is accept
    assert record.passed is accept
    assert ("deferred cancellations" in record.failed_checks) is not accept
    assert "--accept-drain-timeouts" in check.detail
    data = validate(write_record(record, tmp_path)[0])
    assert data["accept_drain_timeouts"] is accept
    assert ("ACCEPTED" in markdown(record)) is accept


async def test_the_deferral_counts_are_read_after_the_scenarios(tmp_path: Path) -> None:
    """The gate's own scenarios defer cancellations: a drain they caused that ended by
    timeout must fail the gate. A proxy admin whose counters change between the gate's first
    read (before the probes) and its end: the verdict and the record use the later read."""
    scrapes: list[int] = []

    async def metrics(request: web.Request) -> web.Response:
        scrapes.append(1)
        timeouts = 0 if len(scrapes) == 1 else 1  # a scenario's drain timed out meanwhile
        name = "kvproxy_deferred_cancellations_total"
        text = (
            f"# TYPE {name} counter\n"
            f'{name}{{outcome="first_token",upstream="default"}} 2\n'
            f'{name}{{outcome="timeout",upstream="default"}} {timeouts}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with serving(app) as admin:
        record = await run_gate(
            GateOptions(engines=STATIC, max_context=None, proxy_admin=admin), lambda _: None
        )
    assert len(scrapes) == 2
    check = next(c for c in record.checks if c.name == "deferred cancellations")
    assert check.data["by_outcome"]["timeout"] == 1
    assert not check.passed
    assert record.deferred_cancellations is not None
    assert record.deferred_cancellations["by_outcome"]["timeout"] == 1
    assert "deferred cancellations" in record.failed_checks


async def test_the_cli_flag_reaches_the_release_record(
    upstream: FakeUpstream, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    engines = json.dumps([{"url": "static://p", "role": "unified", "kind": "static",
                           "capacity_tokens": 8192}])  # fmt: skip
    async for proxy in _proxy_with_a_timed_out_deferral(upstream, http):
        common = ("--engines", engines, "--proxy-admin", proxy.admin_url)
        rc_fail, out_fail = await run_cli(*common, "--out", str(tmp_path / "fail"))
        rc_ok, out_ok = await run_cli(
            *common, "--accept-drain-timeouts", "--out", str(tmp_path / "ok")
        )
    assert rc_fail == 1, out_fail
    assert "FAIL  deferred cancellations" in out_fail
    assert validate(tmp_path / "fail" / "release-record.json")["accept_drain_timeouts"] is False
    assert rc_ok == 0, out_ok
    assert validate(tmp_path / "ok" / "release-record.json")["accept_drain_timeouts"] is True


@pytest.mark.parametrize(
    ("outcomes", "passed"),
    [
        ({"first_token": 3, "completed": 1, "upstream_error": 2}, True),
        ({"first_token": 3, "shutdown": 1}, False),
        ({"timeout": 2}, False),
    ],
)
def test_only_confirmed_drains_pass_without_acceptance(
    outcomes: dict[str, int], passed: bool
) -> None:
    by_outcome = {o: float(outcomes.get(o, 0)) for o in DEFERRED_OUTCOMES}
    assert deferred_verdict({"by_outcome": by_outcome}, False).passed is passed
    assert deferred_verdict({"by_outcome": by_outcome}, True).passed is True


async def test_an_over_strict_proxy_fails_limit_reachable(tmp_path: Path) -> None:
    """kvproxy counting with `tokenizer: bytes` (an upper bound: bytes plus an allowance for
    special tokens) refuses text prompts of limit and limit-1 engine tokens. The probes are
    measured by the engine's /tokenize, so the gate sees it: "limit reachable" fails with
    over_strict, and the record says which probe kind was used."""
    async with sim_and_proxy(max_context=5315, tokenizer="bytes") as (sim, proxy):
        engines = tuple(EngineSpec(**e) for e in json.loads(engines_json(sim)))
        record = await run_gate(
            GateOptions(
                engines=engines,
                max_context=5315,
                proxy=proxy.public_url,
                proxy_admin=proxy.admin_url,
                sim=sim.router_url,
            ),
            lambda _: None,
        )
    checks = {c.name: c for c in record.checks}
    assert not record.passed
    assert "limit reachable" in record.failed_checks
    assert checks["limit reachable"].data["verdict"] == "over_strict"
    assert checks["limit reachable"].detail.startswith("over_strict")
    assert checks["boundary limit+0 (5,315 tokens)"].data["code"] == "context_length_exceeded"
    assert checks["boundary limit+0 (5,315 tokens)"].data["probe_kind"] == "text"
    # limit+1 is still rejected before the engines: over-strict, not unsafe.
    assert checks["boundary limit+1 (5,316 tokens)"].passed
    validate(write_record(record, tmp_path)[0])


async def test_the_model_comes_from_v1_models_and_token_ids_can_be_asked_for(
    tmp_path: Path,
) -> None:
    async with sim_and_proxy(max_context=5315) as (sim, proxy):
        engines = tuple(EngineSpec(**e) for e in json.loads(engines_json(sim)))
        record = await run_gate(
            GateOptions(
                engines=engines,
                max_context=5315,
                proxy=proxy.public_url,
                sim=sim.router_url,
                probe_kind="token_ids",
                # The vulnerable sim's version (0.5.21) is behind kvproxy here, as above.
                accept_advisories=BEHIND_KVPROXY,
            ),
            lambda _: None,
        )
    checks = {c.name: c for c in record.checks}
    # Token ids are counted exactly by kvproxy: the limit is reachable with them.
    assert record.passed, record.failed_checks
    assert checks["limit reachable"].data["probe_kind"] == "token_ids"


async def test_the_gate_reports_the_limits_the_monitor_publishes(tmp_path: Path) -> None:
    """One config file, read by the proxy's capacity monitor and by `kvproxy check`: the
    same limits (the old gate dropped the margin and probed 5,315 where the proxy, with a
    15-token margin, enforces 5,300)."""
    from kvproxy.capacity import CapacityMonitor
    from kvproxy.cli import build_parser
    from kvproxy.config import load_settings
    from kvproxy.observe.metrics import Metrics
    from kvproxy.tools.check.cli import options_from

    async with SimCluster(sim_options(context_length=8192, prefill_pool_tokens=5322)) as sim:
        config = tmp_path / "kvproxy.yaml"
        config.write_text(
            f"engines: {engines_json(sim)}\nmax_context: 5315\nlimit_margin_tokens: 15\n",
            encoding="utf-8",
        )
        args = build_parser(["check"]).parse_args(["check", "--config", str(config)])
        record = await run_gate(options_from(args), lambda _: None)
        metrics = Metrics()
        async with aiohttp.ClientSession() as http:
            monitor = CapacityMonitor(load_settings(config_path=config), metrics, http)
            await monitor.refresh_now()
            published = monitor.limits()
    # By hand: SGLang refuses len >= max_req_input_len = min(8,192, 5,322) - 6, so the
    # largest prompt is 5,315; minus the margin, 5,300.
    assert published.admission_limit_tokens == 5300
    limit = metrics.registry.get_sample_value(
        "kvproxy_admission_limit_tokens", {"model": IMPLICIT_MODEL}
    )
    assert limit == 5300
    assert record.limits == published.to_json()
    assert record.safe_max_context_tokens == 5315
