"""Defaults that pass their own gate (issue #33.1): the tokenizer default, the simulator's
posture per mode, and the demo's configuration against `kvproxy canary` and `kvproxy check`.

In-process (one event loop, ports chosen by the OS); tests/test_demo.py runs the real
`kvproxy demo` and the commands its banner prints.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from kvtest import sim_and_proxy

from kvproxy.cli import build_parser, demo_settings
from kvproxy.config import EngineSpec, Settings, effective_tokenizer, load_settings
from kvproxy.config.models import ModelSpec
from kvproxy.observe.metrics import Metrics
from kvproxy.serve.app import KvproxyServer
from kvproxy.sim.launcher import SimCluster, SimOptions, options_from_args
from kvproxy.tokens import build_counter
from kvproxy.tools.check.gate import GateOptions, run_gate
from kvproxy.tools.isolation.diagnosis import arming_config, arming_settings
from kvproxy.tools.isolation.harness import CanaryOptions, run_isolation, summary

SGLANG = EngineSpec(url="http://127.0.0.1:1", role="prefill", kind="sglang")
VLLM = EngineSpec(url="http://127.0.0.1:2", role="decode", kind="vllm")
STATIC = EngineSpec(url="static://", role="unified", kind="static", capacity_tokens=8192)


# --- the tokenizer default ----------------------------------------------------------------------


def test_the_default_tokenizer_is_auto_and_means_the_engines_own() -> None:
    assert Settings().tokenizer == "auto"
    assert ModelSpec(name="m", engines=(SGLANG,)).tokenizer == "auto"
    assert effective_tokenizer("auto", (SGLANG,)) == "engine"
    assert effective_tokenizer("auto", (STATIC, VLLM)) == "engine"
    # Static pools have no tokenizer to ask: the byte bound, which holds for any.
    assert effective_tokenizer("auto", (STATIC,)) == "bytes"
    assert effective_tokenizer("auto", ()) == "bytes"
    # Anything spelled out is itself.
    for spec in ("bytes", "engine", "hf:/m", "tiktoken:/t"):
        assert effective_tokenizer(spec, (SGLANG,)) == spec


async def test_auto_builds_the_engine_counter_or_the_bound() -> None:
    async with aiohttp.ClientSession() as http:
        engine = build_counter(load_settings(engines=[SGLANG.model_dump()]), session=http)
        bound = build_counter(load_settings(engines=[STATIC.model_dump()]), session=http)
    try:
        assert engine.method == "engine"
        assert "engine /tokenize at http://127.0.0.1:1" in engine.describe()
        assert bound.method == "bound"
    finally:
        await engine.aclose()
        await bound.aclose()


async def test_the_default_configuration_reaches_its_published_limit() -> None:
    """kvproxy as configured out of the box in front of SGLang engines: the release gate's
    boundary probes (text prompts of limit-1 and limit engine tokens, one output token)
    are admitted. With the old default (`bytes`) "limit reachable" failed: over_strict."""
    async with sim_and_proxy({"mode": "fixed"}, max_context=8192) as (sim, proxy):
        record = await run_gate(
            GateOptions(
                engines=tuple(s for s in proxy.settings.engines),
                max_context=None,
                proxy=proxy.public_url,
                proxy_admin=proxy.admin_url,
                sim=sim.router_url,
            ),
            lambda _: None,
        )
    checks = {c.name: c for c in record.checks}
    assert checks["limit reachable"].passed, checks["limit reachable"].detail
    assert checks["limit reachable"].data["probe_kind"] == "text"
    assert record.passed, record.failed_checks


# --- the simulator's posture follows its mode ---------------------------------------------------


def sim_args(*flags: str) -> SimOptions:
    args = build_parser(["sim"]).parse_args(["sim", *flags])
    return options_from_args(args)


@pytest.mark.parametrize(
    ("flags", "version", "checksum"),
    [
        ((), "0.5.21-sim", False),
        (("--mode", "vulnerable"), "0.5.21-sim", False),
        (("--mode", "fixed"), "0.5.23-sim", True),
        (("--mode", "fixed", "--version", "0.5.20", "--no-kv-checksum"), "0.5.20", False),
        (("--mode", "vulnerable", "--version", "0.5.23", "--kv-checksum"), "0.5.23", True),
    ],
)
def test_the_simulators_posture_follows_its_mode_unless_overridden(
    flags: tuple[str, ...], version: str, checksum: bool
) -> None:
    opts = sim_args(*flags)
    assert (opts.version(), opts.checksum()) == (version, checksum)


async def server_info(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/server_info") as resp:
        data: dict[str, Any] = await resp.json()
        return data


@pytest.mark.parametrize("mode", ["fixed", "vulnerable"])
async def test_kvproxy_check_passes_a_fixed_simulator_and_fails_a_vulnerable_one(
    mode: str,
) -> None:
    opts = sim_args("--mode", mode, "--port", "0", "--prefill-port", "0", "--decode-port", "0")
    async with SimCluster(opts) as sim, aiohttp.ClientSession() as http:
        infos = [await server_info(http, u) for u in (sim.prefill_url, sim.decode_url)]
        record = await run_gate(
            GateOptions(
                engines=(
                    EngineSpec(url=sim.prefill_url, role="prefill"),
                    EngineSpec(url=sim.decode_url, role="decode"),
                ),
                max_context=None,
            ),
            lambda _: None,
        )
    fixed = mode == "fixed"
    for info in infos:
        assert info["version"] == ("0.5.23-sim" if fixed else "0.5.21-sim")
        assert info["disaggregation_enable_kv_checksum"] is fixed
    assert record.passed is fixed, record.failed_checks
    if not fixed:
        assert record.failed_checks == ["engine posture"]


# --- the demo -------------------------------------------------------------------------------------


@asynccontextmanager
async def demo(*flags: str) -> AsyncIterator[tuple[SimCluster, KvproxyServer]]:
    """`kvproxy demo`'s simulator and kvproxy, configured by the demo's own code."""
    args = build_parser(["demo"]).parse_args(
        ["demo", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", *flags]
    )
    opts = SimOptions(host="127.0.0.1", port=0, prefill_port=0, decode_port=0, mode=args.mode)
    async with SimCluster(opts) as sim:
        settings = demo_settings(args, opts, sim).model_copy(update={"access_log": False})
        server = KvproxyServer(settings, Metrics())
        await server.start()
        try:
            await server.services.models.first.capacity.refresh_now()
            yield sim, server
        finally:
            await server.stop()


async def test_the_demo_is_configured_as_its_checks_ask() -> None:
    async with demo() as (sim, server):
        s = server.settings
        held = min(sim.opts.context_length, sim.opts.prefill_pool_tokens)
    assert effective_tokenizer(s.tokenizer, s.engines) == "engine"
    assert s.max_context == held
    # The tripwire, exactly as the harness prints the configuration that arms it.
    armed = arming_settings(("canary-a", "canary-b"), "X-Tenant-ID")
    assert s.trust_tenant_header is armed["trust_tenant_header"]
    assert (s.tenant_header, s.canary_action) == ("X-Tenant-ID", "block")
    assert [c.model_dump(exclude_defaults=True) for c in s.canaries] == [
        {"tenant": c["tenant"], "patterns": tuple(c["patterns"])} for c in armed["canaries"]
    ]
    assert "trust_tenant_header: true" in arming_config(CanaryOptions(target="t"))


@pytest.mark.slow
async def test_the_demo_passes_the_isolation_test_and_fails_the_gate_on_posture_only() -> None:
    """The demo's engines are the vulnerable ones; through kvproxy every scenario runs and
    passes (the leaks of the failed-send mode are withheld by the tripwire), and the gate
    at the demo's declared context fails on the engines' posture alone."""
    async with demo() as (sim, server):
        report = await run_isolation(
            CanaryOptions(
                target=server.public_url,
                proxy_admin=server.admin_url,
                sim=sim.router_url,
                rounds=1,
            )
        )
        record = await run_gate(
            GateOptions(
                engines=server.settings.engines,
                max_context=server.settings.max_context,
                proxy=server.public_url,
                proxy_admin=server.admin_url,
                sim=sim.router_url,
            ),
            lambda _: None,
        )
    assert report.verdict == "pass", summary(report)
    assert (report.scenarios_run, report.not_run) == (4, {})
    assert report.limit_source == f"{server.admin_url}/capacity admission_limit_tokens"
    by_name = {s.name: s for s in report.scenarios}
    assert by_name["transfer_failure"].blocked_by_tripwire > 0
    assert by_name["boundary"].probe_kind == "text"
    assert record.failed_checks == ["engine posture"], [
        (c.name, c.detail) for c in record.checks if not c.passed
    ]
