"""Three real `kvproxy serve` processes sharing one Debian `redis-server` budget, in front of
one simulator (vulnerable mode), all on loopback.

Judged on the simulator's ground truth (`peak_prompt_tokens_in_flight` at prefill: prompt
tokens the engines were working on at once) and on Redis's own usage:
- under a few hundred concurrent requests with random client disconnects the engines never
  hold more than the budget B, though each replica alone would let B through (the control
  run with `budget_backend: local` shows the engines then get more than B);
- a replica killed with SIGKILL while holding leases gives its share back after the TTL;
- Redis stopped mid-run: `local_share` keeps serving (200/429 only), `reject` answers 503
  `budget_unavailable` with Retry-After; when Redis returns the budget is whole again and
  ends at zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from e2e_stack import CHAT, COMPLETIONS, body_for, engines_of, poll, sim_cluster, tenant_prompt
from ports import free_port
from redis_server import RedisServer, needs_redis, redis_server

from kvproxy.budget.scripts import BudgetKeys
from kvproxy.sim import SimCluster

pytestmark = [pytest.mark.slow, needs_redis]

BUDGET = 3000
REQUESTS = 300
# Prefill's pool is larger than anything the test sends at once, so its own page queue never
# hides what the budget let through.
SIM: dict[str, Any] = {"mode": "vulnerable", "prefill_pool_tokens": 20000}


class Replica:
    def __init__(self, proc: subprocess.Popen[bytes], public: str, admin: str, log: Path):
        self.proc = proc
        self.public = public
        self.admin = admin
        self.log = log


@contextlib.asynccontextmanager
async def replicas(
    sim: SimCluster, redis: RedisServer, n: int, tmp: Path, **settings: Any
) -> AsyncIterator[list[Replica]]:
    base = {
        "KVPROXY_UPSTREAM": sim.router_url,
        "KVPROXY_ENGINES": json.dumps(engines_of(sim)),
        "KVPROXY_BUDGET_BACKEND": "redis",
        "KVPROXY_REDIS_URL": redis.url,
        "KVPROXY_MAX_INFLIGHT_PROMPT_TOKENS": str(BUDGET),
        "KVPROXY_QUEUE_TIMEOUT_S": "2",
        "KVPROXY_QUEUE_MAX_WAITERS": "400",
        "KVPROXY_BUDGET_EXPECTED_REPLICAS": str(n),
        "KVPROXY_REDIS_TIMEOUT_S": "2",
        "KVPROXY_ACCESS_LOG": "false",
    }
    base.update({f"KVPROXY_{k.upper()}": str(v) for k, v in settings.items()})
    out: list[Replica] = []
    logs = []
    try:
        for i in range(n):
            public, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVPROXY_")}
            env.update(base, KVPROXY_LISTEN=public, KVPROXY_ADMIN_LISTEN=admin)
            log = tmp / f"replica-{i}.log"
            fh = log.open("wb")
            logs.append(fh)
            proc = subprocess.Popen(  # noqa: ASYNC220 (returns at once; readiness polled below)
                [sys.executable, "-m", "kvproxy", "serve"], env=env, stdout=fh, stderr=fh
            )
            out.append(Replica(proc, f"http://{public}", f"http://{admin}", log))
        async with aiohttp.ClientSession() as http:
            for r in out:

                async def ready(r: Replica = r) -> bool:
                    with contextlib.suppress(aiohttp.ClientError, OSError):
                        async with http.get(r.admin + "/readyz") as resp:
                            return resp.status == 200
                    return False

                assert await poll(ready, timeout_s=60, interval_s=0.1), r.log.read_text()
        yield out
    finally:
        for r in out:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for r in out:
            try:
                await asyncio.to_thread(r.proc.wait, 60)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                await asyncio.to_thread(r.proc.wait, 10)
        for fh in logs:
            fh.close()


async def one(
    http: aiohttp.ClientSession, base: str, rng: random.Random, leave: bool = True
) -> str:
    """One request; its outcome: the status, or "left" when the client gave up."""
    path = rng.choice((CHAT, COMPLETIONS))
    prompt = tenant_prompt("tenant-a", rng.randint(150, 500), rng)
    body = body_for(path, prompt, stream=rng.random() < 0.5, max_tokens=rng.randint(50, 200))

    async def go() -> str:
        async with http.post(base + path, json=body) as resp:
            await resp.read()
            if resp.status != 200:
                data = json.loads(await resp.read())
                return f"{resp.status} {data['error']['code']}"
            return "200"

    task = asyncio.ensure_future(go())
    if not leave or rng.random() >= 0.3:
        return await task
    done, _ = await asyncio.wait({task}, timeout=rng.uniform(0.0, 0.6))
    if done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
        await task
    return "left"


async def storm(rs: list[Replica], seed: int, count: int, leave: bool = True) -> Counter[str]:
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        outcomes = await asyncio.gather(
            *(
                one(http, rng.choice(rs).public, random.Random(rng.random()), leave)
                for _ in range(count)
            )
        )
    return Counter(outcomes)


async def metric(http: aiohttp.ClientSession, r: Replica, name: str) -> float:
    async with http.get(r.admin + "/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def settled(rs: list[Replica]) -> None:
    """Every replica has closed every upstream (drains included) and holds nothing."""
    async with aiohttp.ClientSession() as http:

        async def idle() -> bool:
            for r in rs:
                if r.proc.poll() is not None:
                    continue
                if await metric(http, r, "kvproxy_inflight_requests") != 0:
                    return False
                if await metric(http, r, "kvproxy_inflight_prompt_tokens") != 0:
                    return False
            return True

        assert await poll(idle, timeout_s=60, interval_s=0.1)


async def redis_drained(server: RedisServer) -> bool:
    """Bounded wait for Redis to show nothing held: releases are sent after the upstream
    closes, and one that failed is replayed by the replica's renewal loop (~1 s)."""

    async def zero() -> bool:
        return await redis_usage(server) == (0, 0)

    return await poll(zero, timeout_s=15, interval_s=0.05)


async def redis_usage(server: RedisServer) -> tuple[int, int]:
    client = aioredis.Redis.from_url(server.url)
    try:
        key = BudgetKeys.for_pool("kvproxy:budget", "default").prefix + ":usage"
        raw = await client.hgetall(key)
    finally:
        await client.aclose()
    return int(raw.get(b"tokens", 0)), int(raw.get(b"requests", 0))


async def prefill_truth(sim: SimCluster) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(sim.prefill_url + "/sim/stats") as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def test_three_replicas_never_let_more_than_the_budget_through(tmp_path: Path) -> None:
    async with redis_server(tmp_path) as redis, sim_cluster(**SIM) as sim:
        async with replicas(sim, redis, 3, tmp_path) as rs:
            outcomes = await storm(rs, seed=1, count=REQUESTS)
            await settled(rs)
            truth = await prefill_truth(sim)
            assert await redis_drained(redis), await redis_usage(redis)
        # Every request got an answer: admitted, queued out (429), or its client left.
        assert set(outcomes) <= {"200", "429 inflight_budget_exceeded", "left"}, outcomes
        assert outcomes["200"] > 0, outcomes
        peak = truth["peak_prompt_tokens_in_flight"]
        assert peak <= BUDGET, (peak, outcomes)
        assert peak > BUDGET // 2, (peak, outcomes)  # the budget was really contended
        assert truth["prompt_tokens_in_flight"] == 0


async def test_control_three_local_budgets_let_more_through(tmp_path: Path) -> None:
    """The same load with a local budget of B on each replica: the engines get more than B
    at once, which is what the shared budget prevents (and shows the check can fail)."""
    async with redis_server(tmp_path) as redis, sim_cluster(**SIM) as sim:
        async with replicas(sim, redis, 3, tmp_path, budget_backend="local") as rs:
            await storm(rs, seed=1, count=REQUESTS, leave=False)
            await settled(rs)
            truth = await prefill_truth(sim)
    assert truth["peak_prompt_tokens_in_flight"] > BUDGET, truth


async def test_a_killed_replica_gives_its_share_back_after_the_ttl(tmp_path: Path) -> None:
    async with redis_server(tmp_path) as redis, sim_cluster(**SIM) as sim:
        async with replicas(sim, redis, 2, tmp_path, redis_lease_ttl_s=2, queue_timeout_s=20) as (
            doomed,
            survivor,
        ):
            rng = random.Random(3)
            # A long reply holding most of the budget on the doomed replica.
            hog = body_for(CHAT, tenant_prompt("t", 2500, rng), stream=True, max_tokens=4000)
            async with aiohttp.ClientSession() as http:
                held = asyncio.ensure_future(http.post(doomed.public + CHAT, json=hog))

                async def leased() -> bool:
                    return (await redis_usage(redis))[0] >= 2500

                assert await poll(leased, timeout_s=30, interval_s=0.05)
                doomed.proc.send_signal(signal.SIGKILL)
                await asyncio.to_thread(doomed.proc.wait, 10)
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    (await held).close()
                # The dead replica's lease still counts: 2,500 + 2,500 > 3,000 until it expires.
                second = body_for(CHAT, tenant_prompt("t", 2500, rng), stream=False, max_tokens=8)
                async with http.post(survivor.public + CHAT, json=second) as resp:
                    assert resp.status == 200, await resp.text()
                assert await metric(http, survivor, "kvproxy_budget_lease_expiries_total") >= 1
            await settled([survivor])
            assert await redis_drained(redis), await redis_usage(redis)


@pytest.mark.parametrize("policy", ["local_share", "reject"])
async def test_redis_stopped_mid_run(tmp_path: Path, policy: str) -> None:
    async with redis_server(tmp_path) as redis, sim_cluster(**SIM) as sim:
        async with replicas(sim, redis, 2, tmp_path, redis_unavailable=policy) as rs:
            before = await storm(rs, seed=4, count=60)
            # Nothing held when Redis goes: the local shares then add up to B at most.
            await settled(rs)
            await redis.stop()
            during = await storm(rs, seed=5, count=60, leave=False)
            await redis.start()  # back empty (no persistence)
            async with aiohttp.ClientSession() as http:

                async def recovered() -> bool:
                    for r in rs:
                        async with http.get(r.admin + "/capacity") as resp:
                            if (await resp.json())["budget"]["state"] != "ok":
                                return False
                    return True

                assert await poll(recovered, timeout_s=30, interval_s=0.1)
                fallbacks = [
                    await metric(http, r, "kvproxy_budget_backend_fallbacks_total") for r in rs
                ]
            after = await storm(rs, seed=6, count=60)
            await settled(rs)
            assert await redis_drained(redis), await redis_usage(redis)
            truth = await prefill_truth(sim)
    allowed = {"200", "429 inflight_budget_exceeded", "left"}
    assert set(before) <= allowed, before
    assert set(after) <= allowed, after
    assert after["200"] > 0
    if policy == "local_share":
        assert set(during) <= allowed, during
        assert during["200"] > 0, during
    else:
        assert set(during) <= allowed | {"503 budget_unavailable"}, during
        assert during["503 budget_unavailable"] > 0, during
    assert all(f >= 1 for f in fallbacks), fallbacks
    # While Redis was down each replica enforced B / 2 on its own: still at most B in all.
    assert truth["peak_prompt_tokens_in_flight"] <= BUDGET, truth
