"""Posture through the running proxy: /readyz is unchanged by default (posture_action:
warn) and 503 under `not_ready` while a high finding is unaccepted; /capacity and
/metrics show the finding; the start log names every acceptance."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import pytest
from kvtest import sim_and_proxy

PENDING = "sglang-pd-pending-rejection-transfer"


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


@pytest.mark.parametrize(
    ("settings", "ready"),
    [
        ({}, True),
        ({"posture_action": "not_ready"}, False),
        ({"posture_action": "not_ready", "accept_advisories": [PENDING]}, True),
    ],
)
async def test_readiness_follows_posture_action(settings: dict[str, Any], ready: bool) -> None:
    async with sim_and_proxy(**settings) as (_, proxy), aiohttp.ClientSession() as http:
        status, body = await get(http, proxy.admin_url + "/readyz")
        _, capacity = await get(http, proxy.admin_url + "/capacity")
        _, metrics = await get(http, proxy.admin_url + "/metrics")
    assert (status == 200) is ready, body
    if not ready:
        assert body["reason"] == "engine posture (posture_action)"
    finding = capacity["posture"]["findings"][0]
    assert finding["id"] == PENDING
    assert finding["accepted"] is (PENDING in settings.get("accept_advisories", []))
    value = "0.0" if finding["accepted"] else "1.0"
    assert f'advisory="{PENDING}",engine="{finding["engines"][0]}"}} {value}' in metrics
    assert "kvproxy_engine_transfer_failures{" in metrics


async def test_a_fixed_engine_leaves_not_ready_ready() -> None:
    async with (
        sim_and_proxy({"engine_version": "0.5.23"}, posture_action="not_ready") as (_, proxy),
        aiohttp.ClientSession() as http,
    ):
        status, _ = await get(http, proxy.admin_url + "/readyz")
    assert status == 200


async def test_acceptances_are_logged_once_at_start(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvproxy.posture")
    async with sim_and_proxy(accept_advisories=[PENDING]):
        pass
    starts = [
        r.getMessage() for r in caplog.records if "accepted by the operator" in r.getMessage()
    ]
    assert len(starts) == 1
    assert PENDING in starts[0]
