"""Hostile bodies through a live proxy: the whole admission path, not just the parser.

Property for every answer: a 4xx with a JSON error naming a problem, or a correct
admission decision (admitted only with a bound within the limit); never a 5xx, and the
proxy keeps serving. Ground truth from the upstream: it received exactly the admitted
requests, byte for byte, and every body it received parses (no invalid body forwarded).
Hypothesis runs in a worker thread with a blocking client so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import http.client
import threading
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from hostile_support import NFC_EXPANDERS, PATHS, ROUTES, SECRET, hostile_body, nested
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtest import FakeUpstream, running_proxy, static_engines, wait_until
from tokenizer_files import real_tokenizer_dir

from kvproxy.policy.routes import Route, route_for_path
from kvproxy.prompt.parse import parse_request
from kvproxy.sim.launcher import SimCluster, SimOptions

LIMIT = 4096  # static prefill capacity; the admission limit equals it
DECODE = 8192
# Path spellings the router treats as the same route; each must meet the same admission.
PATH_VARIANTS = ("", "/", "?x=1")


@dataclass
class Tally:
    admitted: list[tuple[str, bytes]] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _post(port: int, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def check_answer(route: Route, status: int, headers: dict[str, str], data: bytes) -> None:
    """One answer of the proxy to one hostile request, judged on its own."""
    assert status < 500, (status, data[:300])
    if status == 200:
        assert headers["x-kvproxy-decision"] == "admitted"
        assert 0 <= int(headers["x-kvproxy-prompt-tokens"]) <= LIMIT
        return
    assert 400 <= status < 500
    assert headers["x-kvproxy-decision"] == "rejected"
    assert headers["content-type"].startswith("application/json")
    body = orjson.loads(data)
    if route == "generate":
        # SGLang's native shape: the message only; the code travels in a header.
        assert list(body) == ["error"]
        assert list(body["error"]) == ["message"]
        code, message = headers["x-kvproxy-error-code"], body["error"]["message"]
        extra = {}
        if code == "context_length_exceeded":
            # Its numbers are in the headers and the message.
            extra["prompt_tokens"] = int(headers["x-kvproxy-prompt-tokens"])
            if "plus requested output" not in message:
                assert f"at most {LIMIT:,} " in message, message
                extra["limit_tokens"] = LIMIT
    else:
        err = body["error"]
        code, message, extra = err["code"], err["message"], err
    assert code
    assert message
    assert SECRET not in message
    if code == "context_length_exceeded":
        assert status == 400
        if "output_tokens" in extra:  # decode budget (I4)
            assert extra["prompt_tokens"] + extra["output_tokens"] > extra["limit_tokens"]
        elif "limit_tokens" not in extra:  # decode budget, in SGLang's native shape
            assert "plus requested output" in message
        else:
            assert extra["prompt_tokens"] > extra["limit_tokens"] == LIMIT
    else:
        assert (status, code) in {
            (400, "invalid_request"),
            (400, "unsupported_field"),  # a field outside the engines' tables (prompt.fields)
            (413, "request_too_large"),
        }, code


def _json_upstream(upstream: FakeUpstream) -> None:
    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"id": "ok", "choices": []})

    for path in PATHS.values():
        upstream.route("POST", path, ok)
        upstream.route("POST", path + "/", ok)


def _check_upstream(upstream: FakeUpstream, tally: Tally) -> None:
    """Ground truth: the upstream saw exactly the admitted bodies, each one valid."""
    got = sorted((r["path"], r["body"]) for r in upstream.received)
    want = sorted((path.split("?")[0], body) for path, body in tally.admitted)
    assert got == want
    for path, body in got:
        route = route_for_path(path)
        assert route is not None
        parse_request(route, body)  # raises on anything the engines could not read


async def test_fuzz_through_the_proxy(upstream: FakeUpstream) -> None:
    _json_upstream(upstream)
    await upstream.start()
    tally = Tally()
    async with running_proxy(upstream.url, engines=static_engines(LIMIT, DECODE)) as proxy:
        port = proxy.public_port

        @settings(
            max_examples=150,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(
            route=st.sampled_from(ROUTES),
            variant=st.sampled_from(PATH_VARIANTS),
            body=hostile_body,
        )
        def run(route: Route, variant: str, body: bytes) -> None:
            path = PATHS[route] + variant
            status, headers, data = _post(port, path, body)
            check_answer(route, status, headers, data)
            with tally.lock:
                tally.statuses[status] = tally.statuses.get(status, 0) + 1
                if status == 200:
                    tally.admitted.append((path, body))

        await asyncio.to_thread(run)
        assert await wait_until(lambda: proxy.state.inflight == 0)
        # Still serving after all of it.
        status, _, _ = await asyncio.to_thread(
            _post, port, PATHS["chat"], b'{"messages":[{"role":"user","content":"hi"}]}'
        )
        assert status == 200
        tally.admitted.append((PATHS["chat"], b'{"messages":[{"role":"user","content":"hi"}]}'))
        assert proxy.metrics.responses_total.labels("chat", "500")._value.get() == 0
    _check_upstream(upstream, tally)
    assert tally.statuses.get(400, 0) > 0  # the strategies do reach the rejection paths


HOSTILE_CASES: list[tuple[Route, bytes]] = [
    ("generate", b'{"text":"hi","image_data":%s}' % nested(900)),
    ("chat", b'{"messages":[{"role":"user","content":"hi","meta":%s}]}' % nested(300, kind="d")),
    ("chat", b'{"messages":[{"role":"user","content":"hi"}],"tools":[%s]}' % nested(600)),
    ("chat", b"[" * 1100 + b"]" * 1100),
    ("chat", b'{"messages":[{"role":"user","content":"\\ud800"}]}'),
    ("completions", b'{"prompt":"caf\xc3"}'),
    ("completions", b'{"prompt":"hi","n":1e400}'),
    ("completions", b'{"prompt":"hi","max_tokens":18446744073709551616}'),
    ("completions", b'{"prompt":[0,1,18446744073709551615]}'),
    ("generate", b'{"input_ids":[[1,2],[3,-4]]}'),
    ("chat", b'{"messages":[{"role":"user","content":"hi"}],"n":128,"max_tokens":2147483647}'),
    ("generate", b'{"text":"hi","sampling_params":[{"max_new_tokens":5},7]}'),
]


@pytest.mark.parametrize(("route", "body"), HOSTILE_CASES)
async def test_named_hostile_bodies_are_4xx_or_a_decision(
    upstream: FakeUpstream, http: aiohttp.ClientSession, route: Route, body: bytes
) -> None:
    _json_upstream(upstream)
    await upstream.start()
    tally = Tally()
    async with running_proxy(upstream.url, engines=static_engines(LIMIT, DECODE)) as proxy:
        async with http.post(proxy.public_url + PATHS[route], data=body) as resp:
            data = await resp.read()
            check_answer(route, resp.status, {k.lower(): v for k, v in resp.headers.items()}, data)
            if resp.status == 200:
                tally.admitted.append((PATHS[route], body))
    _check_upstream(upstream, tally)


async def test_gigantic_output_requests_never_reach_upstream(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    _json_upstream(upstream)
    await upstream.start()
    asks: list[tuple[Route, dict[str, Any]]] = [
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2**31 - 1}),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 128, "max_tokens": 64}),
        ("completions", {"prompt": "hi", "best_of": 128, "max_tokens": 100}),
        ("generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**9}}),
        ("generate", {"text": ["a"] * 64, "sampling_params": {"n": 128, "max_new_tokens": 99}}),
    ]
    async with running_proxy(upstream.url, engines=static_engines(LIMIT, DECODE)) as proxy:
        for route, ask in asks:
            async with http.post(proxy.public_url + PATHS[route], json=ask) as resp:
                data = await resp.read()
                headers = {k.lower(): v for k, v in resp.headers.items()}
                check_answer(route, resp.status, headers, data)
                assert resp.status == 400, data
    assert upstream.received == []


@pytest.mark.slow
async def test_nfc_expanders_against_a_normalizing_tokenizer(
    http: aiohttp.ClientSession,
) -> None:
    """Ground truth from the simulator running Qwen-3's real tokenizer (NFC normalizer):
    prompts of U+1D160 (4 bytes, 3 code points after NFC) swept across the limit. Under a
    plain byte bound some would be admitted and then refused inside the engine; with the
    NFC rule every admitted one fits and the boundary is still reached from both sides."""
    sim = SimCluster(
        SimOptions(
            port=0,
            prefill_port=0,
            decode_port=0,
            mode="vulnerable",
            tokenizer=str(real_tokenizer_dir("qwen-3")),
        )
    )
    await sim.start()
    try:
        engines = [
            {"url": sim.prefill_url, "role": "prefill", "kind": "sglang"},
            {"url": sim.decode_url, "role": "decode", "kind": "sglang"},
        ]
        async with running_proxy(sim.router_url, engines=engines, tokenizer="bytes") as proxy:
            decisions: dict[str, int] = {"admitted": 0, "rejected": 0}
            for chars in range(100, 1700, 100):
                for expander in (NFC_EXPANDERS[0], NFC_EXPANDERS[1]):
                    body = {"text": expander * chars, "sampling_params": {"max_new_tokens": 1}}
                    async with http.post(proxy.public_url + "/generate", json=body) as resp:
                        await resp.read()
                        decisions[resp.headers["X-Kvproxy-Decision"]] += 1
                        assert resp.status in (200, 400)
            async with http.get(sim.router_url + "/sim/stats") as resp:
                stats = await resp.json()
        assert decisions["admitted"] > 0
        assert decisions["rejected"] > 0
        for role in ("prefill", "decode"):
            assert stats[role]["rejections_at_admission"] == 0, stats[role]
            assert stats[role]["pending_rejections"] == 0, stats[role]
            assert stats[role]["stale_page_reads"] == 0, stats[role]
    finally:
        await sim.close()
