"""Helpers for the real-client suites: kvproxy in front of the PD simulator on free ports.

The simulator is the oracle: its `/sim/stats` counters say what reached the router and the
engines, so a test can prove that a rejection sent nothing upstream (I7).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from kvtest import running_proxy
from ports import free_port

from kvproxy.serve.app import KvproxyServer
from kvproxy.sim.launcher import SimCluster, SimOptions

MODEL = "kvproxy-sim"
# ~12 k bytes: over the demo simulator's ~5.3 k-token prefill limit under the byte bound
# and under any real tokenizer. Tests read the limit from the proxy, never hard-code it.
OVER_LIMIT_TEXT = "over the limit " * 800


def sim_engines(sim: SimCluster) -> list[dict[str, Any]]:
    return [
        {"url": sim.prefill_url, "role": "prefill", "kind": "sglang", "name": "prefill-0"},
        {"url": sim.decode_url, "role": "decode", "kind": "sglang", "name": "decode-0"},
    ]


@contextlib.asynccontextmanager
async def proxy_before_sim(
    sim_options: dict[str, Any] | None = None, **settings: Any
) -> AsyncIterator[tuple[KvproxyServer, SimCluster]]:
    """kvproxy -> simulated PD router -> simulated prefill/decode, all on 127.0.0.1."""
    sim = SimCluster(
        SimOptions(port=0, prefill_port=0, decode_port=0, mode="vulnerable", **(sim_options or {}))
    )
    await sim.start()
    try:
        settings.setdefault("engines", sim_engines(sim))
        async with running_proxy(sim.router_url, **settings) as proxy:
            yield proxy, sim
    finally:
        await sim.close()


async def sim_stats(http: aiohttp.ClientSession, sim: SimCluster) -> dict[str, Any]:
    async with http.get(sim.router_url + "/sim/stats") as resp:
        assert resp.status == 200
        data: dict[str, Any] = await resp.json()
        return data


def routed(stats: dict[str, Any]) -> int:
    """Requests the simulated router received on any inference route."""
    return sum(stats["router"]["requests_by_route"].values())


def dead_port() -> int:
    """A loopback port nothing listens on (bound then released)."""
    return free_port()
