"""Every field an engine reads as prompt text is counted or the body refused (#30 class 10 and
its siblings), on every route: tensors and stored context are refused by name; a prompt-only
request with a field kvproxy's parser does not model is bounded by all of its text and never
counted exactly; chat-like routes are bounded over every field (tokens.bound.guarantee).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from kvtest import FakeUpstream, running_proxy, static_engines
from tokenizer_files import real_tokenizer_dir

from kvproxy.policy.errors import KvproxyError
from kvproxy.prompt import parse_request
from kvproxy.tokens.counter import TokenCounter, unmodeled_keys
from kvproxy.tokens.exact.local import load_hf

# A proxy or a counter per test with the same `hf:` tokenizer: one load (tests/shared_loads.py).
pytestmark = pytest.mark.usefixtures("shared_tokenizer_loads")

W = "word " * 400  # ~400 tokens of text


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("completions", {"prompt": "hi", "prompt_embeds": "AAAA"}, "prompt_embeds"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "hi"}], "prompt_embeds": "A"},
            "prompt_embeds",
        ),
        ("generate", {"text": "hi", "input_embeds": [[0.0]]}, "input_embeds"),
        ("embeddings", {"input": "hi", "input_embeds": [[0.0]]}, "input_embeds"),
        ("generate", {"text": "hi", "session_params": {"id": "s"}}, "session_params"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "hi"}], "session_params": {"id": "s"}},
            "session_params",
        ),
        (
            "completions",
            {"prompt": "hi", "session_params": {"id": "s", "rid": "r"}},
            "session_params",
        ),
    ],
)
def test_uncountable_fields_are_refused_by_name(
    route: str, body: dict[str, Any], field: str
) -> None:
    with pytest.raises(KvproxyError) as info:
        parse_request(route, orjson.dumps(body))  # type: ignore[arg-type]
    assert info.value.status == 400
    assert info.value.param == field
    assert field in info.value.message


async def test_completions_with_a_field_nobody_classifies_are_refused_naming_it() -> None:
    """A field no engine version's table classifies may be prompt text to some engine: since
    the closed world (kvproxy.prompt.fields) it is refused, naming it, never bounded by the
    `prompt` alone; the same body without it is counted."""
    c = TokenCounter(bound_rule="bytes")
    try:
        with pytest.raises(KvproxyError) as refused:
            await c.count(parse_request("completions", orjson.dumps({"prompt": "hi", "x": W})), 100)
        plain = await c.count(parse_request("completions", orjson.dumps({"prompt": "hi"})), 100)
    finally:
        await c.aclose()
    assert (refused.value.status, refused.value.code, refused.value.param) == (
        400,
        "unsupported_field",
        "x",
    )
    assert plain.tokens < 20


def test_fields_the_parser_does_not_model_are_named() -> None:
    score = parse_request(
        "score", orjson.dumps({"query": "q", "items": ["a"], "text_1": W, "text_2": "b"})
    )
    assert sorted(unmodeled_keys(score)) == ["text_1", "text_2"]
    plain = parse_request("score", orjson.dumps({"query": "q", "items": ["a"], "model": "m"}))
    assert unmodeled_keys(plain) == []


@pytest.fixture(scope="module")
def qwen3() -> Any:
    return load_hf(real_tokenizer_dir("qwen-3"))


async def test_score_text_beside_query_items_is_bounded_by_all_of_its_text(qwen3: Any) -> None:
    """vLLM's /v1/score reads text_1/text_2: kvproxy's count of query/items alone (a few
    tokens) must not decide; the bound over every field does, and it is never exact."""
    body = {"query": "q", "items": ["a"], "text_1": W, "text_2": W}
    shape = parse_request("score", orjson.dumps(body))
    c = TokenCounter(bound_rule=qwen3.bound_rule, template=qwen3.template, local=qwen3)
    try:
        small = await c.count(shape, 100)
        large = await c.count(shape, 100_000)
    finally:
        await c.aclose()
    assert small.kind == "upper-bound"
    assert small.tokens > 2 * len(W.split())  # every word of text_1 and text_2
    assert "unknown:body" in small.unverified
    assert large.method == "bound"  # admitted, on the bound: it fits
    assert large.tokens == small.tokens


async def _answering(upstream: FakeUpstream, path: str) -> None:
    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"data": []})

    upstream.route("POST", path, ok)
    await upstream.start()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/score", {"model": "m", "query": "q", "items": ["a"], "text_1": W, "text_2": W}),
        (
            "/v1/completions",
            {"model": "m", "prompt": "hi", "max_tokens": 1, "prompt_embeds": "AAAA"},
        ),
    ],
)
async def test_serve_refuses_and_forwards_nothing(
    path: str, body: dict[str, Any], upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    await _answering(upstream, path)
    async with running_proxy(
        upstream.url,
        engines=static_engines(capacity=200),
        tokenizer=f"hf:{real_tokenizer_dir('qwen-3')}",
    ) as proxy:
        async with http.post(proxy.public_url + path, data=orjson.dumps(body)) as resp:
            status, reply = resp.status, await resp.json()
    assert status == 400, reply
    assert reply["error"]["code"] in ("context_length_exceeded", "invalid_request")
    assert not upstream.received  # I7: nothing left kvproxy


# The body: one "System" message of ~200 tokens; SGLang lower-cases the role and
# renders ~215 tokens with Qwen-3. kvproxy's old bound was its replica's render: 51 tokens,
# which admitted the body on pools of 100 and 214.
SYSTEM_BODY = {
    "model": "m",
    "max_tokens": 1,
    "messages": [{"role": "System", "content": "word " * 200}, {"role": "user", "content": "hi"}],
}


@pytest.mark.parametrize("capacity", [50, 100, 214])
async def test_serve_refuses_the_system_role_body_on_every_pool_below_its_render(
    capacity: int, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    await _answering(upstream, "/v1/chat/completions")
    async with running_proxy(
        upstream.url,
        engines=static_engines(capacity=capacity),
        tokenizer=f"hf:{real_tokenizer_dir('qwen-3')}",
    ) as proxy:
        async with http.post(
            proxy.public_url + "/v1/chat/completions", data=orjson.dumps(SYSTEM_BODY)
        ) as resp:
            status, reply = resp.status, await resp.json()
            kind = resp.headers.get("X-Kvproxy-Prompt-Tokens-Kind")
    assert status == 400, reply
    assert reply["error"]["code"] == "context_length_exceeded"
    assert reply["error"]["prompt_tokens"] >= 215  # at least what SGLang renders
    assert kind == "upper-bound"
    assert "role:case" in reply["error"]["unverified_features"]
    assert not upstream.received
