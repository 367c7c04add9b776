"""In-flight budget (kvproxy/budget/local.py): FIFO, timeouts, cancellation, no leaks.

Timeouts are tiny and the assertions are on outcomes and counters, never on durations.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
from aiohttp import web
from kvtest import FakeUpstream, running_proxy, wait_until
from prometheus_client import CollectorRegistry

from grafana.promql import MODEL_LABELLED
from kvproxy.budget.local import InflightBudget, Lease, charge_tokens
from kvproxy.observe.metrics import Metrics
from kvproxy.policy.errors import KvproxyError

LONG = 60.0  # a queue timeout no test reaches: waits end by grant or cancellation


def make(
    max_tokens: int | None = 100,
    max_requests: int | None = None,
    queue_timeout_s: float = LONG,
    queue_max_waiters: int = 100,
) -> tuple[InflightBudget, Metrics]:
    metrics = Metrics(CollectorRegistry())
    return InflightBudget(max_tokens, max_requests, queue_timeout_s, queue_max_waiters,
                          metrics), metrics  # fmt: skip


def sample(m: Metrics, name: str) -> float:
    # The budget gauges carry a `model` label; these budgets are the single-model form's.
    labels = {"model": "default"} if name in MODEL_LABELLED else {}
    value = m.registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_fast_path_and_release_is_idempotent() -> None:
    b, m = make()
    lease = await b.acquire(60)
    assert (b.tokens_in_use, b.requests_in_use, b.queue_depth) == (60, 1, 0)
    assert sample(m, "kvproxy_inflight_prompt_tokens") == 60
    assert sample(m, "kvproxy_inflight_prompt_tokens_limit") == 100
    lease.release()
    lease.release()
    assert (b.tokens_in_use, b.requests_in_use) == (0, 0)
    assert sample(m, "kvproxy_inflight_prompt_tokens") == 0
    assert sample(m, "kvproxy_queue_wait_seconds_count") == 1


async def test_lease_as_context_manager() -> None:
    b, _ = make()
    with await b.acquire(10) as lease:
        assert isinstance(lease, Lease)
        assert b.tokens_in_use == 10
    assert b.tokens_in_use == 0


async def test_never_fits_is_rejected_at_once_with_its_own_detail() -> None:
    b, m = make(max_tokens=100)
    with pytest.raises(KvproxyError) as info:
        await b.acquire(101)
    err = info.value
    assert err.status == 429
    assert err.code == "inflight_budget_exceeded"
    assert "never fit" in err.message
    assert int(err.headers["Retry-After"]) >= 1
    assert b.queue_depth == 0
    assert sample(m, "kvproxy_queue_depth") == 0


async def test_strict_fifo_no_overtaking() -> None:
    b, _ = make(max_tokens=100)
    first = await b.acquire(90)
    order: list[str] = []

    async def want(name: str, tokens: int) -> Lease:
        lease = await b.acquire(tokens)
        order.append(name)
        return lease

    big = asyncio.create_task(want("big", 50))
    await settle()
    small = asyncio.create_task(want("small", 5))  # fits now, but must not overtake
    await settle()
    assert order == []
    assert b.queue_depth == 2
    first.release()
    leases = await asyncio.gather(big, small)
    assert order == ["big", "small"]
    assert b.tokens_in_use == 55
    for lease in leases:
        lease.release()
    assert (b.tokens_in_use, b.requests_in_use, b.queue_depth) == (0, 0, 0)


async def test_newcomer_queues_behind_waiters_even_if_it_fits() -> None:
    b, _ = make(max_tokens=100)
    held = await b.acquire(60)
    waiter = asyncio.create_task(b.acquire(50))
    await settle()
    late = asyncio.create_task(b.acquire(10))
    await settle()
    assert not late.done()
    held.release()
    (await waiter).release()
    (await late).release()
    assert b.tokens_in_use == 0


async def test_request_count_limit() -> None:
    b, _ = make(max_tokens=None, max_requests=2)
    a, c = await b.acquire(1_000_000), await b.acquire(5)
    third = asyncio.create_task(b.acquire(0))
    await settle()
    assert not third.done()
    a.release()
    (await third).release()
    c.release()
    assert (b.tokens_in_use, b.requests_in_use) == (0, 0)


async def test_queue_timeout_gives_429_and_leaves_no_trace() -> None:
    b, m = make(max_tokens=10, queue_timeout_s=0.01)
    held = await b.acquire(10)
    with pytest.raises(KvproxyError) as info:
        await b.acquire(5)
    assert info.value.status == 429
    assert "queue timeout" in info.value.message
    assert "Retry-After" in info.value.headers
    assert b.queue_depth == 0
    assert sample(m, "kvproxy_queue_depth") == 0
    held.release()
    assert b.tokens_in_use == 0


async def test_queue_full_and_zero_timeout_reject_at_once() -> None:
    b, _ = make(max_tokens=10, queue_max_waiters=1)
    held = await b.acquire(10)
    queued = asyncio.create_task(b.acquire(1))
    await settle()
    with pytest.raises(KvproxyError, match="queue is full"):
        await b.acquire(1)
    held.release()
    (await queued).release()

    b0, _ = make(max_tokens=10, queue_timeout_s=0)
    held = await b0.acquire(10)
    with pytest.raises(KvproxyError, match="queue is full"):
        await b0.acquire(1)
    held.release()


async def test_cancelled_head_waiter_leaves_no_trace_and_unblocks_queue() -> None:
    b, _ = make(max_tokens=100)
    held = await b.acquire(60)
    head = asyncio.create_task(b.acquire(90))  # blocks everyone behind it
    await settle()
    behind = asyncio.create_task(b.acquire(30))
    await settle()
    assert not behind.done()
    head.cancel()
    lease = await behind  # the head's cancellation let it through without any release
    assert b.tokens_in_use == 90
    assert head.cancelled()
    lease.release()
    held.release()
    assert (b.tokens_in_use, b.requests_in_use, b.queue_depth) == (0, 0, 0)


async def test_cancel_racing_a_grant_returns_the_tokens() -> None:
    b, _ = make(max_tokens=10)
    held = await b.acquire(10)
    waiter = asyncio.create_task(b.acquire(10))
    await settle()
    held.release()  # grants the waiter: its future is resolved, its task not yet resumed
    assert b.tokens_in_use == 10
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (b.tokens_in_use, b.requests_in_use, b.queue_depth) == (0, 0, 0)


async def test_reject_waiting_on_shutdown() -> None:
    b, _ = make(max_tokens=10)
    held = await b.acquire(10)
    waiters = [asyncio.create_task(b.acquire(5)) for _ in range(3)]
    await settle()
    assert b.reject_waiting() == 3
    for w in waiters:
        with pytest.raises(KvproxyError, match="shutting down"):
            await w
    assert b.queue_depth == 0
    held.release()
    assert b.tokens_in_use == 0


async def test_unlimited_budget_counts_but_never_waits() -> None:
    b, m = make(max_tokens=None)
    leases = [await b.acquire(10**6) for _ in range(5)]
    assert b.tokens_in_use == 5 * 10**6
    assert sample(m, "kvproxy_inflight_prompt_tokens_limit") == 0
    for lease in leases:
        lease.release()
    assert b.tokens_in_use == 0


async def test_200_concurrent_with_cancellations_and_timeouts_leave_nothing_in_use() -> None:
    b, m = make(max_tokens=1000, max_requests=20, queue_timeout_s=LONG, queue_max_waiters=150)
    rng = random.Random(1234)
    outcomes = {"ok": 0, "rejected": 0, "cancelled": 0}
    peak = {"tokens": 0, "requests": 0}

    async def one(i: int) -> None:
        try:
            lease = await b.acquire(rng.randint(1, 300))
        except KvproxyError:
            outcomes["rejected"] += 1
            return
        with lease:
            peak["tokens"] = max(peak["tokens"], b.tokens_in_use)
            peak["requests"] = max(peak["requests"], b.requests_in_use)
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
        outcomes["ok"] += 1

    tasks = [asyncio.create_task(one(i)) for i in range(200)]
    await asyncio.sleep(0)
    # Cancel a random tenth of them (clients that left while queued or mid-request).
    for t in rng.sample(tasks, 20):
        t.cancel()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    outcomes["cancelled"] = sum(isinstance(r, asyncio.CancelledError) for r in results)
    assert sum(outcomes.values()) == 200
    assert outcomes["ok"] > 100
    assert outcomes["rejected"] > 0  # more than 150 queued at some point: queue full
    assert peak["tokens"] <= 1000
    assert peak["requests"] <= 20
    assert (b.tokens_in_use, b.requests_in_use, b.queue_depth) == (0, 0, 0)
    assert sample(m, "kvproxy_inflight_prompt_tokens") == 0
    assert sample(m, "kvproxy_queue_depth") == 0
    # Every granted request observed its wait once; a cancelled one may or may not have
    # been granted before its cancellation.
    waits = sample(m, "kvproxy_queue_wait_seconds_count")
    assert outcomes["ok"] <= waits <= outcomes["ok"] + outcomes["cancelled"]


def test_constructor_validates() -> None:
    m = Metrics(CollectorRegistry())
    with pytest.raises(ValueError, match="max_tokens"):
        InflightBudget(0, None, 1, 1, m)
    with pytest.raises(ValueError, match="max_requests"):
        InflightBudget(None, 0, 1, 1, m)
    with pytest.raises(ValueError, match="queue"):
        InflightBudget(None, None, -1, 1, m)


async def test_negative_tokens_is_a_caller_bug() -> None:
    b, _ = make()
    with pytest.raises(ValueError, match="tokens"):
        await b.acquire(-1)


# --- what a request is charged, through the proxy ------------------------------------------
# The admission limit is per sequence; the budget must hold what the engines hold: every
# sequence of a batch, every sample (n / best_of). Ground truth: the budget's own gauge while
# the upstream holds the request, and the 429 a batch that can never fit gets.

TEXT = "a" * 4_990  # ~5,000 tokens by the byte bound: one fits a 6,000 budget, two do not
IDS = list(range(5_000))

BATCHES: dict[str, tuple[str, dict[str, object]]] = {
    "generate text batch": ("/generate", {"text": [TEXT, TEXT]}),
    "generate input_ids batch": ("/generate", {"input_ids": [IDS, IDS]}),
    "generate n=2": ("/generate", {"text": TEXT, "sampling_params": {"n": 2}}),
    "generate per-item n": (
        "/generate",
        {"text": [TEXT], "sampling_params": [{"n": 2, "max_new_tokens": 4}]},
    ),
    "completions prompt list": ("/v1/completions", {"model": "m", "prompt": [TEXT, TEXT]}),
    "completions token-id arrays": ("/v1/completions", {"model": "m", "prompt": [IDS, IDS]}),
    "completions n=2": ("/v1/completions", {"model": "m", "prompt": TEXT, "n": 2}),
    "completions best_of=2": ("/v1/completions", {"model": "m", "prompt": TEXT, "best_of": 2}),
    "chat n=2": (
        "/v1/chat/completions",
        {"model": "m", "n": 2, "messages": [{"role": "user", "content": TEXT}]},
    ),
}


def _single(path: str, body: dict[str, object]) -> dict[str, object]:
    """The same request with one sequence and one sample."""
    one = dict(body)
    one.pop("n", None)
    one.pop("best_of", None)
    one.pop("sampling_params", None)
    for key in ("text", "input_ids", "prompt"):
        value = one.get(key)
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            one[key] = value[0]
    return one


@pytest.mark.parametrize("case", list(BATCHES))
async def test_a_batch_that_can_never_fit_the_budget_is_429(
    upstream: FakeUpstream, http: aiohttp.ClientSession, case: str
) -> None:
    path, body = BATCHES[case]

    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"id": "ok", "choices": []})

    upstream.route("POST", path, ok)
    await upstream.start()
    async with running_proxy(upstream.url, max_inflight_prompt_tokens=6_000) as proxy:
        # One sequence, one sample of the same prompt fits: the limit is not what refuses.
        async with http.post(proxy.public_url + path, json=_single(path, body)) as resp:
            assert resp.status == 200, await resp.text()
        async with http.post(proxy.public_url + path, json=body) as resp:
            assert resp.status == 429
            doc = await resp.json()
            text = doc["error"]["message"]  # SGLang's native shape on /generate: message only
            assert "never fit" in text
        assert proxy.services.models.first.budget.tokens_in_use == 0
    assert len(upstream.received) == 1


@pytest.mark.parametrize("case", list(BATCHES))
async def test_the_budget_holds_every_sequence_and_sample_until_the_upstream_closes(
    upstream: FakeUpstream, http: aiohttp.ClientSession, case: str
) -> None:
    path, body = BATCHES[case]
    release = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        if len(upstream.received) > 1:
            await asyncio.wait_for(release.wait(), 30)
        return web.json_response({"id": "ok", "choices": []})

    upstream.route("POST", path, held)
    await upstream.start()
    async with running_proxy(upstream.url, max_inflight_prompt_tokens=100_000) as proxy:
        async with http.post(proxy.public_url + path, json=_single(path, body)) as resp:
            assert resp.status == 200
            single = int(resp.headers["X-Kvproxy-Prompt-Tokens"])
        pending = asyncio.ensure_future(http.post(proxy.public_url + path, json=body))
        budget = proxy.services.models.first.budget
        assert await wait_until(lambda: len(upstream.received) == 2)
        # Two sequences of one sample, or one sequence of two samples: twice the single.
        assert budget.tokens_in_use == 2 * single
        release.set()
        async with await pending as resp:
            assert resp.status == 200
            assert int(resp.headers["X-Kvproxy-Prompt-Tokens"]) == single
        assert await wait_until(lambda: budget.tokens_in_use == 0)


def test_charge_is_the_sum_once_per_sample() -> None:
    assert charge_tokens(10_000, 1) == 10_000
    assert charge_tokens(10_000, 3) == 30_000
    assert charge_tokens(7, 0) == 7
