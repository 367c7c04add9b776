"""Gateway mode end to end: one kvproxy in front of two PD clusters with different pools,
each behind its own real smg 1.13.0 (kvproxy -> {smg -> small pair, smg -> large pair}).

The small cluster's prefill pool gives SGLang's own limit 5,315 tokens, the large one's
10,637 (largest prompt = min(context, pool) - 7). Judged on the simulators' ground truth
(which engine saw which request and how many prompt tokens, the engine's own arithmetic),
with prompts whose sizes are exact by construction (the simulator's byte tokenizer: one
ASCII byte, one token), never on kvproxy's own count:
  - a prompt below both limits is spread over both, within 30 % of the weights (1:3) over
    200 requests, and kvproxy's routing counter agrees with where they arrived;
  - prompts between the limits are served and arrive only at the large cluster;
  - a prompt over both gets 400 context_length_exceeded naming the larger limit, and arrives
    nowhere;
  - a client that leaves during prefill, on either cluster, is deferred until a safe point
    and counted under that cluster's `upstream` label;
  - with the small cluster's engines stopped, the large one serves everything that fits it
    and readiness stays true;
  - no prompt above a cluster's limit reached that cluster's engines, ever.
Loopback only; every wait is bounded in tries and time.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from e2e_stack import disconnect_after, leak_counters, poll, sim_quiet, sim_stats
from real_router import MODEL, real_router

from kvproxy.config import load_settings
from kvproxy.observe import Metrics
from kvproxy.serve.app import KvproxyServer
from kvproxy.sim.launcher import SimCluster, SimOptions

pytestmark = [pytest.mark.slow, pytest.mark.router]

COMPLETIONS = "/v1/completions"
# SGLang: max_req_input_len = min(context - 1, pool - 1) - 5, refused at >=, so the largest
# prompt is min(context, pool) - 7 (the simulator's own arithmetic; asserted below).
POOLS = {"small": 5322, "large": 10644}
LIMITS = {"small": 5315, "large": 10637}
WEIGHTS = {"small": 1.0, "large": 3.0}
SPREAD_REQUESTS = 200
SPREAD_TOKENS = 64
AFFINITY = "X-Session-ID"
# Slow enough prefill (0.25 ms per token: ~0.75 s for the 3,000-token victims) that a client
# leaving once prefill has the request is still inside prefill on a loaded machine.
SIM: dict[str, Any] = {
    "port": 0,
    "prefill_port": 0,
    "decode_port": 0,
    "context_length": 16384,
    "decode_pool_tokens": 32768,
    "prefill_us_per_token": 250.0,
    # Vulnerable engines (free on abort, pending-rejection transfers): an over-limit prompt
    # or an early cancel would show as leak counters, not pass silently.
    "mode": "vulnerable",
}


def prompt(tokens: int) -> str:
    return "a" * tokens  # the byte tokenizer: exactly `tokens` tokens


def sample(proxy: KvproxyServer, name: str, **labels: str) -> float:
    return float(proxy.metrics.registry.get_sample_value(name, labels) or 0.0)


def engines(sim: SimCluster, name: str) -> list[dict[str, Any]]:
    return [
        {"url": sim.prefill_url, "role": "prefill", "name": f"{name}-prefill"},
        {"url": sim.decode_url, "role": "decode", "name": f"{name}-decode"},
    ]


@contextlib.asynccontextmanager
async def gateway(clusters: dict[str, tuple[SimCluster, str]]) -> AsyncIterator[KvproxyServer]:
    """kvproxy with one `upstreams` entry per cluster (its smg URL, its sim's engines)."""
    settings = load_settings(
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        access_log=False,
        upstreams=[
            {"name": n, "url": url, "engines": engines(sim, n), "weight": WEIGHTS[n]}
            for n, (sim, url) in clusters.items()
        ],
        affinity_header=AFFINITY,
        capacity_refresh_s=0.5,
        capacity_stale_s=1.5,
        capacity_probe_timeout_s=1.0,
    )
    server = KvproxyServer(settings, Metrics())
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def completion(
    http: aiohttp.ClientSession,
    proxy: KvproxyServer,
    tokens: int,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], dict[str, Any]]:
    body = {"model": MODEL, "prompt": prompt(tokens), "max_tokens": 1}
    async with http.post(
        proxy.public_url + COMPLETIONS,
        json=body,
        headers=headers or {},
        timeout=aiohttp.ClientTimeout(total=120),
    ) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


class Truth:
    """Each cluster's prefill ground truth: requests and prompt tokens seen, as deltas."""

    def __init__(self, http: aiohttp.ClientSession, sims: dict[str, SimCluster]) -> None:
        self.http = http
        self.sims = sims

    async def read(self) -> dict[str, tuple[int, int]]:
        out = {}
        for name, sim in self.sims.items():
            prefill = (await sim_stats(self.http, sim))["prefill"]
            out[name] = (sum(prefill["requests_by_route"].values()), prefill["prompt_tokens"])
        return out

    async def around(
        self, action: Callable[[], Awaitable[Any]]
    ) -> tuple[Any, dict[str, tuple[int, int]]]:
        """Run `action`; return its result and each cluster's (requests, tokens) delta."""
        before = await self.read()
        result = await action()
        after = await self.read()
        delta = {n: (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in before}
        return result, delta


async def test_gateway_routes_by_fit_then_weight_behind_real_smg(tmp_path: Path) -> None:
    small_opts = SimOptions(**SIM, prefill_pool_tokens=POOLS["small"])
    large_opts = SimOptions(**SIM, prefill_pool_tokens=POOLS["large"])
    async with (
        SimCluster(small_opts) as small,
        SimCluster(large_opts) as large,
        real_router(small, tmp_path / "smg-small.log") as small_router,
        real_router(large, tmp_path / "smg-large.log") as large_router,
        aiohttp.ClientSession() as http,
    ):
        sims = {"small": small, "large": large}
        clusters = {"small": (small, small_router.url), "large": (large, large_router.url)}
        truth = Truth(http, sims)
        async with gateway(clusters) as proxy:

            async def measured(*names: str, known: float = 1.0) -> bool:
                return all(
                    sample(proxy, "kvproxy_upstream_capacity_known", model="default", upstream=n)
                    == known
                    for n in names
                )

            assert await poll(lambda: measured("small", "large"), timeout_s=30, interval_s=0.05)
            engine_limits = {
                n: (await sim_stats(http, s))["prefill"]["limits"]["largest_prompt"]
                for n, s in sims.items()
            }
            published = {
                n: sample(proxy, "kvproxy_upstream_limit_tokens", model="default", upstream=n)
                for n in sims
            }
            ceiling = sample(proxy, "kvproxy_admission_limit_tokens", model="default")

            # 1. Below both limits: spread by weight (sequential: no load to lean on).
            async def spread() -> list[int]:
                return [
                    (await completion(http, proxy, SPREAD_TOKENS))[0]
                    for _ in range(SPREAD_REQUESTS)
                ]

            spread_status, spread_delta = await truth.around(spread)
            decisions = {
                n: sample(
                    proxy,
                    "kvproxy_routing_decisions_total",
                    model="default",
                    upstream=n,
                    reason="fit",
                )
                for n in sims
            }

            # 2. Between the limits: served, and only by the large cluster.
            between = (LIMITS["small"] + 1, 8000, LIMITS["large"])

            async def between_both() -> list[tuple[int, dict[str, str], dict[str, Any]]]:
                return [await completion(http, proxy, n) for n in between]

            between_replies, between_delta = await truth.around(between_both)

            # 3. Over both: 400 naming the larger limit, nothing arrives anywhere.
            over_reply, over_delta = await truth.around(
                lambda: completion(http, proxy, LIMITS["large"] + 1)
            )

            # 4. A client leaving during prefill on each cluster. The small one is reached
            # through affinity: a session key whose home is the small cluster (found by
            # where a small prompt lands, bounded), and a prompt the small cluster holds.
            homes: dict[str, str] = {}
            for i in range(32):
                key = f"session-{i}"
                (status, _, _), delta = await truth.around(
                    lambda key=key: completion(http, proxy, SPREAD_TOKENS, {AFFINITY: key})
                )
                assert status == 200
                [home] = [n for n, (reqs, _) in delta.items() if reqs == 1]
                homes.setdefault(home, key)
                if len(homes) == 2:
                    break
            assert set(homes) == {"small", "large"}, homes

            async def leave_during_prefill(name: str, tokens: int, headers: dict[str, str]) -> bool:
                sim = sims[name]

                async def in_prefill() -> None:
                    async def running() -> bool:
                        return bool((await sim_stats(http, sim))["prefill"]["running"] >= 1)

                    assert await poll(running, timeout_s=30, interval_s=0.005)

                body = {"model": MODEL, "prompt": prompt(tokens), "max_tokens": 4}
                return await disconnect_after(
                    http, proxy.public_url, body, headers, in_prefill, COMPLETIONS
                )

            cut = {
                "small": await leave_during_prefill("small", 3000, {AFFINITY: homes["small"]}),
                # Only the large cluster holds 6,000 tokens.
                "large": await leave_during_prefill("large", 6000, {}),
            }

            async def drained() -> bool:
                return all(
                    sum(
                        sample(proxy, "kvproxy_deferred_cancellations_total", outcome=o, upstream=n)
                        for o in (
                            "first_token",
                            "completed",
                            "upstream_error",
                            "timeout",
                            "shutdown",
                        )
                    )
                    == 1
                    and sample(proxy, "kvproxy_deferred_cancellations_in_progress", upstream=n) == 0
                    for n in sims
                )

            assert await poll(drained, timeout_s=60, interval_s=0.02)
            deferred = {
                n: {
                    o: sample(proxy, "kvproxy_deferred_cancellations_total", outcome=o, upstream=n)
                    for o in ("first_token", "completed", "upstream_error", "timeout", "shutdown")
                }
                for n in sims
            }
            disconnects = {
                n: {
                    p: sample(proxy, "kvproxy_client_disconnects_total", phase=p, upstream=n)
                    for p in ("before_headers", "before_first_token", "streaming")
                }
                for n in sims
            }
            quiet = {n: await sim_quiet(http, s) for n, s in sims.items()}

            # 5. The small cluster's engines stop: the large one serves what fits it.
            small_truth = await sim_stats(http, small)
            await small.stop_server("prefill")
            await small.stop_server("decode")
            assert await poll(lambda: measured("small", known=0.0), timeout_s=30, interval_s=0.05)

            async def without_small() -> list[tuple[int, dict[str, str], dict[str, Any]]]:
                sizes = (SPREAD_TOKENS,) * 10 + (LIMITS["small"], LIMITS["large"])
                return [await completion(http, proxy, n) for n in sizes]

            alone, alone_delta = await Truth(http, {"large": large}).around(without_small)
            alone_over = await completion(http, proxy, LIMITS["large"] + 1)
            async with http.get(proxy.admin_url + "/readyz") as resp:
                ready = resp.status
            ceiling_alone = sample(proxy, "kvproxy_admission_limit_tokens", model="default")
            large_truth = await sim_stats(http, large)

    # The limits: the engines' own arithmetic, published per cluster, the model's the larger.
    assert engine_limits == LIMITS
    assert published == {n: float(v) for n, v in LIMITS.items()}
    assert ceiling == LIMITS["large"]

    # 1. Spread within 30 % of the weights, and the routing counter says where they went.
    assert spread_status == [200] * SPREAD_REQUESTS
    total = sum(WEIGHTS.values())
    for name, weight in WEIGHTS.items():
        expected = SPREAD_REQUESTS * weight / total
        arrived, tokens = spread_delta[name]
        assert abs(arrived - expected) <= 0.3 * expected, (name, arrived, expected)
        assert tokens == arrived * SPREAD_TOKENS
        assert decisions[name] == arrived
    assert sum(a for a, _ in spread_delta.values()) == SPREAD_REQUESTS

    # 2. Between the limits: every one served, by the large cluster only.
    for n, (status, headers, reply) in zip(between, between_replies, strict=True):
        assert status == 200, (n, reply)
        assert headers["X-Kvproxy-Decision"] == "admitted"
        assert reply["usage"]["prompt_tokens"] == n  # the engine's own count
    assert between_delta == {"small": (0, 0), "large": (len(between), sum(between))}

    # 3. Over both: refused before any engine, naming the largest limit any cluster offers.
    status, headers, reply = over_reply
    assert status == 400, reply
    assert headers["X-Kvproxy-Decision"] == "rejected"
    assert reply["error"]["code"] == "context_length_exceeded"
    assert reply["error"]["limit_tokens"] == LIMITS["large"]
    assert over_delta == {"small": (0, 0), "large": (0, 0)}

    # 4. Each disconnect deferred to a safe point and counted with its own cluster's label.
    assert cut == {"small": True, "large": True}
    for name in sims:
        assert sum(disconnects[name].values()) == 1, disconnects
        assert disconnects[name]["streaming"] == 0, disconnects  # left during prefill
        assert deferred[name]["first_token"] + deferred[name]["completed"] == 1, deferred
        # The engines never saw an abort before decode had the KV, and nothing leaked.
        assert quiet[name]["prefill"]["aborts"] == 0
        assert leak_counters(quiet[name]) == dict.fromkeys(leak_counters(quiet[name]), 0)

    # 5. The small cluster gone: the large one serves all that fits it; still ready.
    assert [s for s, _, _ in alone] == [200] * 12, [r for s, _, r in alone if s != 200]
    served = 10 * SPREAD_TOKENS + LIMITS["small"] + LIMITS["large"]
    assert alone_delta == {"large": (12, served)}
    assert alone_over[0] == 400
    assert alone_over[2]["error"]["limit_tokens"] == LIMITS["large"]
    assert ready == 200
    assert ceiling_alone == LIMITS["large"]

    # Ground truth over the whole run: no engine ever had a prompt above its own limit.
    for stats in (small_truth, large_truth):
        for role in ("prefill", "decode"):
            assert stats[role]["rejections_at_admission"] == 0, (role, stats[role])
            assert stats[role]["pending_rejections"] == 0, (role, stats[role])
        assert leak_counters(stats) == dict.fromkeys(leak_counters(stats), 0)
