"""kvproxy_overhead_seconds: what the sidecar itself adds, observed once per request before it
goes upstream (or is refused) and once per response for its relayed chunks; the budget's
queue is not counted as kvproxy's own time."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import orjson
from kvtest import FakeUpstream, running_proxy, static_engines

from kvproxy.serve.context import RequestContext

CHAT = "/v1/chat/completions"


def _sse(n: int) -> list[bytes]:
    out = [b'data: {"choices":[{"index":0,"delta":{"content":"t"}}]}\n\n' for _ in range(n)]
    return [*out, b"data: [DONE]\n\n"]


def _count(proxy: Any, decision: str, phase: str) -> float:
    value = proxy.metrics.registry.get_sample_value(
        "kvproxy_overhead_seconds_count",
        {"route": "chat", "decision": decision, "phase": phase},
    )
    return value or 0.0


async def test_overhead_observed_before_upstream_per_response_and_on_refusal(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    from test_handler import sse_handler

    upstream.route("POST", CHAT, sse_handler(_sse(20)))
    await upstream.start()
    async with running_proxy(upstream.url, engines=static_engines(capacity=2_000)) as proxy:
        ok = orjson.dumps(
            {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        )
        async with http.post(proxy.public_url + CHAT, data=ok) as resp:
            assert resp.status == 200
            await resp.read()
        big = orjson.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "word " * 20_000}]}
        )
        async with http.post(proxy.public_url + CHAT, data=big) as resp:
            assert resp.status == 400
            await resp.read()
        assert _count(proxy, "admitted", "request") == 1
        assert _count(proxy, "admitted", "chunk") == 1  # once per response, not per chunk
        assert _count(proxy, "rejected", "request") == 1
        assert _count(proxy, "rejected", "chunk") == 0
        assert len(upstream.received) == 1  # the refused one never went upstream (I7)


def test_overhead_excludes_the_budget_queue() -> None:
    lease = SimpleNamespace(waited_s=2.0)
    ctx = cast(Any, RequestContext.__new__(RequestContext))
    ctx.started, ctx.body_at, ctx.lease = 100.0, 100.5, lease
    # 3 s since the body arrived, 2 of them queued for budget: kvproxy's own time is 1 s.
    assert RequestContext.overhead_s(ctx, 103.5) == 1.0
    ctx.lease, ctx.body_at = None, 0.0  # refused before the body was read: since the head
    assert RequestContext.overhead_s(ctx, 100.25) == 0.25
    assert time.monotonic() > 0
