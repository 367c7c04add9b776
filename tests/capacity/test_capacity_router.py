"""What sits between kvproxy and the engines (kvproxy.capacity.router): the classifier on
recorded answers (sans-IO), detection against the simulator's engines and mini router, the
monitor feeding the model's Verifier, and (slow) the real smg 1.13 and sglang-router 0.3.2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kvtest import static_engines
from real_router import legacy_router, smg_router

from kvproxy.capacity import CapacityMonitor
from kvproxy.capacity.router import Answer, classify, detect_router
from kvproxy.config import load_settings
from kvproxy.observe.metrics import Metrics
from kvproxy.sim import SimCluster
from kvproxy.sim.launcher import SimOptions
from kvproxy.tokens import build_verifier
from kvproxy.tokens.gate.verified import SGLANG_ORACLE

NOT_FOUND = Answer(404, {"content-type": "text/plain"})
NO_ANSWER = Answer(0, {})

# As recorded from each upstream (bodies cut to the fields read; headers lower-cased).
SMG = {
    "/workers": Answer(200, {"content-type": "application/json"}, {"workers": [{"id": "w"}]}),
    "/server_info": Answer(404, {"x-smg-error-code": "unknown_url"}, {"error": {}}),
    "/get_server_info": Answer(200, {}, {"version": "0.5.21", "disaggregation_mode": "prefill"}),
    "/version": Answer(404, {"x-smg-error-code": "unknown_url"}, {"error": {}}),
}
LEGACY = {
    "/workers": Answer(200, {}, {"workers": [{"worker_type": "prefill"}]}),
    "/server_info": Answer(404, {}),
    "/get_server_info": Answer(200, {}, {"router_manager": True, "routers_count": 1}),
    "/version": Answer(404, {}),
}
OLD_PD_ROUTER = {
    "/workers": NOT_FOUND,
    "/server_info": Answer(200, {}, {"version": "0.5.9", "disaggregation_mode": "prefill"}),
    "/get_server_info": Answer(200, {}, {"version": "0.5.9", "disaggregation_mode": "prefill"}),
    "/version": NOT_FOUND,
}
SGLANG_ENGINE = {
    "/workers": NOT_FOUND,
    "/server_info": Answer(200, {}, {"version": "0.5.9", "disaggregation_mode": "null"}),
    "/get_server_info": Answer(200, {}, {"version": "0.5.9", "disaggregation_mode": "null"}),
    "/version": NOT_FOUND,
}
VLLM_ENGINE = {
    "/workers": NOT_FOUND,
    "/server_info": NOT_FOUND,
    "/get_server_info": NOT_FOUND,
    "/version": Answer(200, {}, {"version": "0.11.0"}),
}


@pytest.mark.parametrize(
    ("answers", "kind"),
    [
        (SMG, "smg"),
        (LEGACY, "sglang-router"),
        (OLD_PD_ROUTER, "sglang-router"),
        (SGLANG_ENGINE, "none"),
        (VLLM_ENGINE, "none"),
        # A router answering /workers that is not identified (vllm-router answers it too):
        # failing towards unverified, never "none".
        ({**VLLM_ENGINE, "/workers": Answer(200, {}, {"workers": []})}, None),
        # An API key on smg's control plane: /workers says 401, its error layer still shows.
        ({**SMG, "/workers": Answer(401, {})}, "smg"),
        (dict.fromkeys(SMG, NO_ANSWER), None),
        (dict.fromkeys(SMG, NOT_FOUND), None),
        # HTML or a non-object where JSON was expected tells nothing.
        (
            {
                **SGLANG_ENGINE,
                "/server_info": Answer(200, {}, ["x"]),
                "/get_server_info": Answer(500, {}),
            },
            None,
        ),
        ({}, None),
    ],
)
def test_classify(answers: dict[str, Answer], kind: str | None) -> None:
    got, why = classify(answers)
    assert got == kind
    assert why


async def test_detects_the_simulators_engines_and_router() -> None:
    sim = SimCluster(SimOptions(port=0))
    vllm = SimCluster(SimOptions(port=0, flavor="vllm", context_length=4096))
    await sim.start()
    await vllm.start()
    try:
        async with aiohttp.ClientSession() as http:
            # The mini router forwards /server_info from its first prefill engine, as the
            # PD router before /workers did.
            assert (await detect_router(http, sim.router_url, 5))[0] == "sglang-router"
            assert (await detect_router(http, vllm.prefill_url, 5))[0] == "none"
            closed = f"http://127.0.0.1:{_closed_port()}"
            kind, why = await detect_router(http, closed, 2)
            assert kind is None
            assert "no answer" in why
    finally:
        await vllm.close()
        await sim.close()


def _closed_port() -> int:
    from ports import free_port

    return free_port()  # nothing listens there


async def test_the_monitor_feeds_versions_and_the_router_to_the_verifier() -> None:
    # A release the verified table names: the router matters, so it is asked.
    sim = SimCluster(SimOptions(port=0, engine_version=SGLANG_ORACLE))
    await sim.start()
    try:
        settings = load_settings(
            upstream=sim.router_url,
            engines=[
                {"url": sim.prefill_url, "role": "prefill", "kind": "sglang"},
                {"url": sim.decode_url, "role": "decode", "kind": "sglang"},
            ],
        )
        verifier = build_verifier(settings)
        async with aiohttp.ClientSession() as http:
            monitor = CapacityMonitor(settings, Metrics(), http, verifier=verifier)
            await monitor.refresh_now()
            snapshot: Any = monitor.snapshot_json()["verification"]
    finally:
        await sim.close()
    assert verifier.router == "sglang-router"
    assert sorted(verifier.engines) == [("sglang", SGLANG_ORACLE), ("sglang", SGLANG_ORACLE)]
    assert snapshot["router_kind"] == "sglang-router"
    assert "prefill" in snapshot["router_evidence"]
    assert "role:user" in snapshot["verified_features"]["replica"]


async def test_the_upstream_is_not_asked_when_the_router_changes_nothing(
    upstream: Any,
) -> None:
    """A static pool (or versions no row names) reads the same rows behind any router: no
    detection traffic reaches the upstream."""
    await upstream.start()
    settings = load_settings(upstream=upstream.url, engines=static_engines(50))
    verifier = build_verifier(settings)
    assert not verifier.router_matters()
    async with aiohttp.ClientSession() as http:
        monitor = CapacityMonitor(settings, Metrics(), http, verifier=verifier)
        await monitor.refresh_now()
    assert upstream.received == []
    assert verifier.router is None
    assert verifier.router_evidence == "not detected yet"


async def test_a_configured_router_kind_is_kept() -> None:
    settings = load_settings(engines=static_engines(50), router_kind="vllm-router")
    verifier = build_verifier(settings)
    async with aiohttp.ClientSession() as http:
        monitor = CapacityMonitor(settings, Metrics(), http, verifier=verifier)
        await monitor.refresh_now()
    assert verifier.router == "vllm-router"
    assert verifier.router_evidence == "configured (router_kind)"


@pytest.mark.slow
@pytest.mark.router
async def test_detects_the_real_smg(tmp_path: Path) -> None:
    sim = SimCluster(SimOptions(port=0))
    await sim.start()
    try:
        async with (
            smg_router(sim.prefill_url, sim.decode_url, tmp_path / "smg.log") as router,
            aiohttp.ClientSession() as http,
        ):
            kind, why = await detect_router(http, router.url, 5)
    finally:
        await sim.close()
    assert kind == "smg", why


@pytest.mark.slow
@pytest.mark.router
async def test_detects_the_real_legacy_sglang_router(tmp_path: Path) -> None:
    sim = SimCluster(SimOptions(port=0))
    await sim.start()
    try:
        async with (
            legacy_router(sim, tmp_path / "legacy.log") as router,
            aiohttp.ClientSession() as http,
        ):
            kind, why = await detect_router(http, router.url, 5)
    finally:
        await sim.close()
    assert kind == "sglang-router", why
