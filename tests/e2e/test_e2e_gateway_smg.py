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

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from e2e_stack import disconnect_after, leak_counters, poll, sim_quiet, sim_stats
from real_router import MODEL, real_router

from kvproxy.config import load_settings
from kvproxy.observe import Metrics
from kvproxy.policy.routing import rendezvous
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
async def gateway(
    clusters: dict[str, tuple[SimCluster, str]], **overrides: Any
) -> AsyncIterator[KvproxyServer]:
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
        **overrides,
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


# --- hostile tenants and failing routers (issue 49) ------------------------------------------


class ResettingFront:
    """A TCP front for one cluster's smg: while `broken`, it reads each request (head and
    body) and resets the connection (SO_LINGER 0) without an answer; otherwise it pipes the
    connection to smg. Counts the requests it reset."""

    def __init__(self, target: str) -> None:
        host, _, port = target.removeprefix("http://").rpartition(":")
        self.target = (host, int(port))
        self.broken = False
        self.resets = 0
        self.server: asyncio.Server | None = None
        self.piped: list[asyncio.StreamWriter] = []

    async def break_now(self) -> None:
        """Broken from the next connection on; the kept-alive ones are cut now (kvproxy
        opens new ones, which are reset)."""
        self.broken = True
        for w in self.piped:
            w.transport.abort()
        self.piped.clear()
        await asyncio.sleep(0.2)  # kvproxy's pool sees them closed

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.broken:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, ValueError):
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":", 1)[1]))
            self.resets += 1
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.piped.append(writer)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def __aenter__(self) -> ResettingFront:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.server.wait_closed(), 5)


async def test_gateway_hostile_tenant_resetting_router_and_full_budget_behind_real_smg(
    tmp_path: Path,
) -> None:
    """Two clusters behind real smg 1.13, the small one through a front that can reset every
    request. Judged on the simulators' ground truth (which cluster's engines saw what):
      1. a hostile tenant whose requests smg answers 503 (a model no worker serves), ten of
         them pinned to the small cluster by a session key: the cluster is not ejected, and
         another tenant's traffic keeps its weighted share there (5 of 20 at 1:3);
      2. a sticky key whose home's budget is full (one request in flight, the limit one) is
         served at once by the idle cluster: no 429, counted as a budget_full spill;
      3. a router that resets every request after reading it is ejected after exactly five
         resets (the threshold), and back once it answers again and its back-off passed.
    """
    small_opts = SimOptions(**SIM, prefill_pool_tokens=POOLS["small"])
    large_opts = SimOptions(**SIM, prefill_pool_tokens=POOLS["large"])
    async with (
        SimCluster(small_opts) as small,
        SimCluster(large_opts) as large,
        real_router(small, tmp_path / "smg-small.log") as small_router,
        real_router(large, tmp_path / "smg-large.log") as large_router,
        ResettingFront(small_router.url) as front,
        aiohttp.ClientSession() as http,
    ):
        sims = {"small": small, "large": large}
        clusters = {"small": (small, front.url), "large": (large, large_router.url)}
        truth = Truth(http, sims)
        async with gateway(
            clusters, max_inflight_requests=1, queue_timeout_s=30, upstream_eject_s=1.0
        ) as proxy:

            async def measured() -> bool:
                return all(
                    sample(proxy, "kvproxy_upstream_capacity_known", model="default", upstream=n)
                    == 1
                    for n in sims
                )

            assert await poll(measured, timeout_s=30, interval_s=0.05)
            homes = {
                f"session-{i}": rendezvous(f"session-{i}", proxy.services.models.first.clusters)
                for i in range(64)
            }
            small_key = next(k for k, c in homes.items() if c is not None and c.name == "small")

            # 1. The hostile tenant: smg answers 503 no_available_workers (its model).
            async def hostile() -> list[int]:
                out = []
                for _ in range(10):
                    body = {"model": "no-such-model", "prompt": prompt(64), "max_tokens": 1}
                    async with http.post(
                        proxy.public_url + COMPLETIONS,
                        json=body,
                        headers={AFFINITY: small_key, "Authorization": "Bearer hostile"},
                    ) as resp:
                        out.append(resp.status)
                return out

            hostile_status = await hostile()
            hostile_ejections = sample(
                proxy,
                "kvproxy_upstream_ejections_total",
                model="default",
                upstream="small",
                cause="status_5xx",
            )

            async def other_tenant() -> list[int]:
                return [
                    (await completion(http, proxy, SPREAD_TOKENS, {"Authorization": "Bearer b"}))[0]
                    for _ in range(20)
                ]

            other_status, other_delta = await truth.around(other_tenant)

            # 2. A sticky key whose home's budget is full.
            before = await truth.read()
            held = asyncio.ensure_future(
                completion(http, proxy, 5000, {AFFINITY: small_key, "Authorization": "Bearer b"})
            )

            async def small_busy() -> bool:
                return bool((await sim_stats(http, small))["prefill"]["running"] >= 1)

            assert await poll(small_busy, timeout_s=30, interval_s=0.005)
            spill_status, _, _ = await completion(
                http, proxy, SPREAD_TOKENS, {AFFINITY: small_key, "Authorization": "Bearer b"}
            )
            spill_while_held = not held.done()
            held_status, _, _ = await held
            after = await truth.read()
            spills = sample(
                proxy,
                "kvproxy_affinity_spills_total",
                model="default",
                upstream="small",
                reason="budget_full",
            )

            # 3. The small cluster's router resets every request after reading it.
            await front.break_now()
            resets_at_ejection = -1
            broken_status = []
            for _ in range(20):  # bounded: round-robin sends it one request in four
                broken_status.append((await completion(http, proxy, SPREAD_TOKENS))[0])
                if sample(proxy, "kvproxy_upstream_ejected", model="default", upstream="small"):
                    resets_at_ejection = front.resets
                    break
            reset_ejections = sample(
                proxy,
                "kvproxy_upstream_ejections_total",
                model="default",
                upstream="small",
                cause="reset",
            )
            front.broken = False
            await asyncio.sleep(1.1)  # the back-off (1 s) passes

            async def back() -> list[int]:
                return [(await completion(http, proxy, SPREAD_TOKENS))[0] for _ in range(8)]

            back_status, back_delta = await truth.around(back)
            restores = sample(
                proxy,
                "kvproxy_upstream_restores_total",
                model="default",
                upstream="small",
                cause="reset",
            )

    # 1. Ten 503s of one tenant: no ejection; the other tenant's share on the small cluster
    # is its weight's (round-robin over idle clusters: exactly 1 in 4).
    assert hostile_status == [503] * 10
    assert hostile_ejections == 0
    assert other_status == [200] * 20
    assert other_delta["small"][0] == 5, other_delta
    assert other_delta["large"][0] == 15, other_delta

    # 2. Served at once by the idle cluster while the home's one slot was held.
    assert spill_status == 200
    assert spill_while_held
    assert held_status == 200
    assert after["large"][0] - before["large"][0] == 1
    assert after["small"][0] - before["small"][0] == 1  # the held one only
    assert spills == 1

    # 3. Ejected at the threshold, back once healed.
    assert resets_at_ejection == 5, (front.resets, broken_status)
    assert broken_status.count(502) == 5
    assert reset_ejections == 1
    assert back_status == [200] * 8
    assert back_delta["small"][0] == 2, back_delta  # its share again: 1 in 4
    assert restores == 1
