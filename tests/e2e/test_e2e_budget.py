"""The in-flight budget under 200 concurrent requests with random disconnects, end to end
(kvproxy -> the sim's PD router -> prefill/decode, vulnerable mode).

Shows: the budget is never exceeded while the storm runs; everything it lent comes back
(tokens, request slots, queue) once the run is over, deferred drains included; requests
that waited past the queue timeout get 429 with Retry-After and an OpenAI-style body; every
disconnect is accounted as a drain; and nothing leaks: no task, no upstream connection, no
file descriptor, no foreign marker.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
from collections import Counter
from typing import Any

import aiohttp
from e2e_stack import (
    CHAT,
    COMPLETIONS,
    TENANT_A,
    TENANT_B,
    Reply,
    abandoned,
    body_for,
    deferred_by_outcome,
    disconnect_after,
    disconnects_by_phase,
    drains_over,
    leak_counters,
    open_fds,
    parse_reply,
    poll,
    post,
    proxy_for,
    sample,
    sim_cluster,
    sim_quiet,
    sim_stats,
    tenant_headers,
    tenant_prompt,
)

from kvproxy.serve.app import KvproxyServer

REQUESTS = 200
MAX_REQUESTS = 16
MAX_TOKENS = 6000
BUDGET: dict[str, Any] = {
    "max_inflight_requests": MAX_REQUESTS,
    "max_inflight_prompt_tokens": MAX_TOKENS,
    # Every request holds its slot for >= 0.1 s of decode (1 ms per echoed token), so 16
    # slots serve at most ~160 requests per second: 200 at once overflow a 100-deep queue
    # at once, and the tail of the queue waits past 1 s. Both paths end in 429.
    "queue_max_waiters": 100,
    "queue_timeout_s": 1.0,
}


async def _one(
    http: aiohttp.ClientSession, base: str, rng: random.Random
) -> tuple[str, Reply | None]:
    tenant = rng.choice((TENANT_A, TENANT_B))
    path = rng.choice((CHAT, COMPLETIONS))
    prompt = tenant_prompt(tenant, rng.randint(150, 500), rng)
    body = body_for(path, prompt, stream=rng.random() < 0.5, max_tokens=rng.randint(100, 300))
    leave_after = rng.uniform(0.0, 0.6) if rng.random() < 0.3 else None

    async def go() -> Reply:
        async with http.post(base + path, json=body, headers=tenant_headers(tenant)) as resp:
            raw = await resp.read()
            return parse_reply(resp.status, dict(resp.headers), raw, path)

    task = asyncio.ensure_future(go())
    if leave_after is None:
        return tenant, await task
    done, _ = await asyncio.wait({task}, timeout=leave_after)
    if task in done:
        return tenant, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return tenant, None


async def _watch_budget(proxy: KvproxyServer, peaks: Counter[str], stop: asyncio.Event) -> None:
    budget = proxy.services.models.first.budget
    while not stop.is_set():
        peaks["tokens"] = max(peaks["tokens"], budget.tokens_in_use)
        peaks["requests"] = max(peaks["requests"], budget.requests_in_use)
        peaks["queued"] = max(peaks["queued"], budget.queue_depth)
        await asyncio.sleep(0.002)


async def test_budget_holds_and_returns_to_zero_under_200_concurrent_with_disconnects() -> None:
    gc.collect()
    fds_before = open_fds()
    tasks_before = len(asyncio.all_tasks())
    rng = random.Random(2024)
    peaks: Counter[str] = Counter()
    async with sim_cluster(mode="vulnerable") as sim, proxy_for(sim, **BUDGET) as proxy:
        stop = asyncio.Event()
        watcher = asyncio.ensure_future(_watch_budget(proxy, peaks, stop))
        connector = aiohttp.TCPConnector(limit=0)  # the client must not queue requests itself
        async with aiohttp.ClientSession(connector=connector) as http:
            results = await asyncio.gather(
                *(
                    _one(http, proxy.public_url, random.Random(rng.random()))
                    for _ in range(REQUESTS)
                )
            )
            stop.set()
            await watcher
            left = sum(1 for _, reply in results if reply is None)
            seen_gone = sum(disconnects_by_phase(proxy).values())
            await drains_over(proxy, seen_gone)
            truth = await sim_quiet(http, sim)
        state, services = proxy.state, proxy.services
        budget = services.models.first.budget

        # Never above the budget while the storm ran.
        assert 0 < peaks["requests"] <= MAX_REQUESTS, peaks
        assert 0 < peaks["tokens"] <= MAX_TOKENS, peaks
        assert peaks["queued"] > 0, peaks
        # Everything lent came back once the last upstream closed (I6).
        assert (budget.tokens_in_use, budget.requests_in_use, budget.queue_depth) == (0, 0, 0)
        assert sample(proxy, "kvproxy_inflight_prompt_tokens") == 0
        assert sample(proxy, "kvproxy_queue_depth") == 0
        assert sample(proxy, "kvproxy_inflight_requests") == 0
        assert sample(proxy, "kvproxy_deferred_cancellations_in_progress") == 0
        assert state.inflight == 0
        assert services.watcher.watched == 0
        # No upstream connection is still checked out of the pool (aiohttp keeps no public
        # count; `_acquired` is the set of connections handed to requests).
        assert not services.session.connector._acquired  # type: ignore[union-attr]

        _check_replies(results)
        _check_accounting(proxy, results, left)
        leaks = leak_counters(truth)
        assert leaks == dict.fromkeys(leaks, 0), leaks

    await _no_leftovers(fds_before, tasks_before)


def _check_replies(results: list[tuple[str, Reply | None]]) -> None:
    statuses = Counter(reply.status for _, reply in results if reply is not None)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[200] > 0, statuses
    assert statuses[429] > 0, statuses
    kinds: Counter[str] = Counter()
    for tenant, reply in results:
        if reply is None:
            continue
        assert not reply.foreign(tenant), (tenant, reply.status)
        if reply.status == 200:
            assert reply.headers["X-Kvproxy-Decision"] == "admitted"
            continue
        # What an OpenAI client parses: a 429 with Retry-After and error.{message,type,code}.
        assert int(reply.headers["Retry-After"]) >= 1
        assert reply.headers["X-Kvproxy-Decision"] == "rejected"
        assert reply.error is not None
        err: dict[str, Any] = reply.error["error"]
        assert err["type"] == "rate_limit_error"
        assert err["code"] == "inflight_budget_exceeded"
        assert isinstance(err["message"], str)
        assert "param" in err
        kinds["queue_timeout" if "queue timeout" in err["message"] else "queue_full"] += 1
    assert kinds["queue_timeout"] > 0, kinds


def _check_accounting(
    proxy: KvproxyServer, results: list[tuple[str, Reply | None]], left: int
) -> None:
    outcomes = deferred_by_outcome(proxy)
    phases = disconnects_by_phase(proxy)
    # Each disconnect the proxy saw became exactly one drain, ended at a safe point. Those
    # that left before anything was forwarded are abandoned requests, not disconnects.
    assert sum(outcomes.values()) == sum(phases.values()), (outcomes, phases)
    assert outcomes["timeout"] == outcomes["upstream_error"] == outcomes["shutdown"] == 0
    assert sum(phases.values()) + abandoned(proxy) <= left
    answered = Counter(reply.status for _, reply in results if reply is not None)
    admitted = sum(
        sample(proxy, "kvproxy_requests_total", route=r, decision="admitted")
        for r in ("chat", "completions")
    )
    rejected = sample(proxy, "kvproxy_rejections_total", reason="over_budget")
    assert admitted >= answered[200]
    assert rejected >= answered[429]
    # A client that left before its request line was read is never seen at all.
    assert REQUESTS - left <= admitted + rejected + abandoned(proxy) <= REQUESTS


async def _no_leftovers(fds_before: int, tasks_before: int) -> None:
    async def settled() -> bool:
        gc.collect()
        return open_fds() <= fds_before and len(asyncio.all_tasks()) <= tasks_before

    assert await poll(settled, timeout_s=10.0, interval_s=0.05), (
        open_fds(),
        fds_before,
        [t.get_name() for t in asyncio.all_tasks()],
    )


async def test_a_client_that_left_while_queued_is_not_forwarded() -> None:
    """One request slot: A holds it with a long stream, B queues behind it and gives up.
    When A ends and the slot passes to B, nothing must be sent upstream for B: its client
    is gone, so forwarding would spend a prefill and a KV transfer on nobody."""
    rng = random.Random(3)
    async with (
        sim_cluster(mode="vulnerable") as sim,
        proxy_for(sim, max_inflight_requests=1, queue_timeout_s=60.0) as proxy,
        aiohttp.ClientSession() as http,
    ):
        holder_body = body_for(CHAT, tenant_prompt(TENANT_A, 600, rng), stream=True, max_tokens=600)
        holder = asyncio.ensure_future(
            post(http, proxy.public_url, CHAT, holder_body, tenant_headers(TENANT_A))
        )
        budget = proxy.services.models.first.budget

        async def holding() -> bool:
            return budget.requests_in_use == 1

        assert await poll(holding)

        async def queued() -> None:
            async def waiting() -> bool:
                return budget.queue_depth == 1

            assert await poll(waiting)

        body = body_for(CHAT, tenant_prompt(TENANT_B, 300, rng), stream=True, max_tokens=64)
        assert await disconnect_after(
            http, proxy.public_url, body, tenant_headers(TENANT_B), queued
        )
        reply = await holder
        assert reply.status == 200

        async def idle() -> bool:
            return proxy.state.inflight == 0 and budget.requests_in_use == 0

        assert await poll(idle)
        truth = await sim_stats(http, sim)
    assert truth["router"]["requests_by_route"] == {CHAT: 1}, truth["router"]["requests_by_route"]
    assert abandoned(proxy) == 1
    assert sum(disconnects_by_phase(proxy).values()) == 0
    assert sum(deferred_by_outcome(proxy).values()) == 0


async def test_a_decision_is_not_forwarded_after_the_pool_shrank_while_it_queued() -> None:
    """One request slot. A holds it with a slow stream; X, a prompt that fits the prefill
    pool of the moment, queues behind it. Meanwhile prefill restarts onto a smaller pool
    that X does not fit, and kvproxy measures it. When A ends, X must not be forwarded on
    the strength of the old measurement: the vulnerable engine would run the incident."""
    rng = random.Random(4)
    async with (
        sim_cluster(mode="vulnerable", decode_ms_per_token=10.0) as sim,
        proxy_for(
            sim,
            max_inflight_requests=1,
            queue_timeout_s=60.0,
            capacity_refresh_s=0.2,
            capacity_stale_s=0.5,
        ) as proxy,
        aiohttp.ClientSession() as http,
    ):
        budget, capacity = proxy.services.models.first.budget, proxy.services.models.first.capacity
        old_limit = int(sample(proxy, "kvproxy_admission_limit_tokens"))
        holder_body = body_for(CHAT, tenant_prompt(TENANT_A, 600, rng), stream=True, max_tokens=600)
        holder = asyncio.ensure_future(
            post(http, proxy.public_url, CHAT, holder_body, tenant_headers(TENANT_A))
        )

        async def holding() -> bool:
            return budget.requests_in_use == 1 and (
                (await sim_stats(http, sim))["decode"]["transfers_completed"] == 1
            )

        assert await poll(holding)
        size = old_limit - 200
        queued_body = body_for(CHAT, tenant_prompt(TENANT_B, size, rng), stream=False, max_tokens=8)
        queued = asyncio.ensure_future(
            post(http, proxy.public_url, CHAT, queued_body, tenant_headers(TENANT_B))
        )

        async def waiting() -> bool:
            return budget.queue_depth == 1

        assert await poll(waiting)
        await sim.stop_server("prefill")

        async def unknown() -> bool:
            return not capacity.ready()

        assert await poll(unknown)
        await sim.start_server("prefill", pool_tokens=2000)

        async def remeasured() -> bool:
            return capacity.ready()

        assert await poll(remeasured)
        new_limit = int(sample(proxy, "kvproxy_admission_limit_tokens"))
        assert new_limit < size < old_limit
        assert budget.queue_depth == 1, "the holder ended before the pool changed"
        assert (await holder).status == 200
        reply = await queued
        truth = await sim_stats(http, sim)
    assert truth["prefill"]["pending_rejections"] == 0, "an over-pool prompt reached prefill"
    assert truth["prefill"]["requests_by_route"] == {}, truth["prefill"]["requests_by_route"]
    assert reply.status == 400, reply.status
    assert reply.error is not None
    assert reply.error["error"]["code"] == "context_length_exceeded"
