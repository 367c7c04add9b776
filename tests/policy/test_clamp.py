"""`decode_policy: clamp` (kvproxy/policy/clamp.py): every body shape is clamped or refused with a
400 naming the field, never a 500; what is forwarded asks for no more than fits decode.

Ground truth: the body the fake upstream received, re-parsed by kvproxy's own parser and read
field by field. The fuzzing of the pure function lives in tests/hostile/test_hostile_clamp.py.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from kvtest import FakeUpstream, running_proxy, static_engines
from tokenizer_files import real_tokenizer_dir

from kvproxy.prompt.parse import parse_request

# A proxy or a counter per test with the same `hf:` tokenizer: one load (tests/shared_loads.py).
pytestmark = pytest.mark.usefixtures("shared_tokenizer_loads")

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "generate": "/generate"}
BIG = 50_000  # asks for more than the 3,000-token decode pool can hold

GENERATE_SHAPES: dict[str, Any] = {
    "one object": {"max_new_tokens": BIG},
    "a list, one per item": [{"max_new_tokens": BIG}, {"max_new_tokens": 10}],
    "a list with an item that names no cap": [{"max_new_tokens": BIG}, {"temperature": 0}],
    "a list with n": [{"max_new_tokens": BIG, "n": 2}, {"max_new_tokens": BIG}],
}
OPENAI_SHAPES: dict[str, dict[str, Any]] = {
    "max_tokens": {"max_tokens": BIG},
    "max_completion_tokens": {"max_completion_tokens": BIG},
    "both": {"max_tokens": 5, "max_completion_tokens": BIG},
}


def _prompt(route: str, batch: int = 1) -> dict[str, Any]:
    if route == "chat":
        return {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    key = "prompt" if route == "completions" else "text"
    return {key: ["hi"] * batch if batch > 1 else "hi"}


async def _send(
    upstream: FakeUpstream, http: aiohttp.ClientSession, route: str, body: bytes
) -> tuple[aiohttp.ClientResponse, Any]:
    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"id": "ok", "choices": []})

    upstream.route("POST", PATHS[route], ok)
    await upstream.start()
    engines = static_engines(capacity=100_000, decode=3_000)
    async with (
        running_proxy(upstream.url, engines=engines, decode_policy="clamp") as proxy,
        http.post(proxy.public_url + PATHS[route], data=body) as resp,
    ):
        return resp, await resp.json()


@pytest.mark.parametrize("shape", list(GENERATE_SHAPES))
async def test_generate_batches_are_clamped_item_by_item(
    upstream: FakeUpstream, http: aiohttp.ClientSession, shape: str
) -> None:
    sp = GENERATE_SHAPES[shape]
    body = orjson.dumps({**_prompt("generate", batch=2), "sampling_params": sp})
    resp, _ = await _send(upstream, http, "generate", body)
    assert resp.status == 200
    cap = int(resp.headers["X-Kvproxy-Output-Clamped"])
    prompt = int(resp.headers["X-Kvproxy-Prompt-Tokens"])
    sent = orjson.loads(upstream.received[0]["body"])["sampling_params"]
    items = sent if isinstance(sent, list) else [sent]
    n = max(item.get("n", 1) for item in items)
    assert prompt + cap * n <= 3_000
    for before, after in zip(sp if isinstance(sp, list) else [sp], items, strict=True):
        own = before.get("max_new_tokens")
        assert after["max_new_tokens"] == (cap if own is None or own > cap else own)
        assert {k: v for k, v in after.items() if k != "max_new_tokens"} == {
            k: v for k, v in before.items() if k != "max_new_tokens"
        }


@pytest.mark.parametrize("shape", list(OPENAI_SHAPES))
@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_openai_routes_are_clamped_to_one_cap(
    upstream: FakeUpstream, http: aiohttp.ClientSession, route: str, shape: str
) -> None:
    body = orjson.dumps({**_prompt(route, batch=2 if route == "completions" else 1),
                         **OPENAI_SHAPES[shape]})  # fmt: skip
    resp, _ = await _send(upstream, http, route, body)
    if route == "completions" and "max_completion_tokens" in OPENAI_SHAPES[shape]:
        # Neither engine's CompletionRequest has max_completion_tokens (both drop it): the
        # closed field table refuses it rather than forward a field kvproxy cannot classify.
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "max_completion_tokens"
        assert not upstream.received
        return
    assert resp.status == 200
    cap = int(resp.headers["X-Kvproxy-Output-Clamped"])
    sent = parse_request(route, upstream.received[0]["body"])  # type: ignore[arg-type]
    assert sent.max_output_tokens is not None
    assert sent.max_output_tokens <= cap


async def test_a_body_too_deep_to_rewrite_is_400_not_500(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """orjson reads 1,024 levels but writes 254: an unmodelled deep field used to 500."""
    deep = b"[" * 400 + b"1" + b"]" * 400
    body = b'{"text":"hi","sampling_params":{"max_new_tokens":50000},"custom_labels":' + deep + b"}"
    resp, doc = await _send(upstream, http, "generate", body)
    assert resp.status == 400
    assert list(doc) == ["error"]  # SGLang's native shape on /generate
    message = doc["error"]["message"]
    assert "sampling_params" in message or "nested" in message
    assert upstream.received == []


async def test_clamp_tokenizes_a_bound_that_only_a_clamp_could_not_serve(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    # The byte bound of this prompt (~6,000) is over decode - n = 2,999 but its exact count
    # (~2,000) fits with room to spare. The counter's ceiling is the largest count the
    # clamp admits, so the bound is not trusted and the request is counted, then clamped;
    # a ceiling of the prefill limit alone admitted on the bound and then refused it (400).
    model = str(real_tokenizer_dir("qwen-3"))

    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"id": "ok", "choices": []})

    upstream.route("POST", PATHS["chat"], ok)
    await upstream.start()
    body = orjson.dumps(
        {"model": "m", "max_tokens": BIG, "messages": [{"role": "user", "content": "hi " * 2_000}]}
    )
    engines = static_engines(capacity=100_000, decode=3_000)
    async with (
        running_proxy(
            upstream.url, engines=engines, decode_policy="clamp", tokenizer=f"hf:{model}"
        ) as proxy,
        http.post(proxy.public_url + PATHS["chat"], data=body) as resp,
    ):
        assert resp.status == 200, await resp.text()
        prompt = int(resp.headers["X-Kvproxy-Prompt-Tokens"])
        cap = int(resp.headers["X-Kvproxy-Output-Clamped"])
    assert prompt + cap <= 3_000
    assert orjson.loads(upstream.received[0]["body"])["max_tokens"] == cap
