"""The request fields that made kvproxy under-count chat prompts (issue #25), each checked
against the engine's own count (the engine's message rewriting + transformers), directly
and through `kvproxy serve` with a static pool set between the old count and the true one.

Families: (1) `reasoning` / `thinking` on an assistant turn; (2) chat_template_kwargs
naming template variables (special tokens; arguments and globals are refused);
(3) list content a template prints as a list; (4) parts that form a marker only when
concatenated; (5) tool-call arguments the engine re-serialises; and tool definitions the
engines dump from their models (None fields printed as null). Plus the everyday switch
`enable_thinking: false` on Qwen-3, which must stay exact.
"""

from __future__ import annotations

import asyncio
import json
from functools import cache
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from chat_reference import Reference, load_reference, model_dir, reference_count
from kvtest import FakeUpstream, running_proxy, static_engines

from kvproxy.policy.errors import KvproxyError
from kvproxy.prompt.parse import parse_request
from kvproxy.tokens.counter import TokenCounter
from kvproxy.tokens.exact.local import HfTokenizer, load_hf
from kvproxy.tokens.replica.chatnorm import ENGINE_KINDS, content_formats

# A proxy or a counter per test with the same `hf:` tokenizer: one load (tests/shared_loads.py).
pytestmark = pytest.mark.usefixtures("shared_tokenizer_loads")

CHAT = "/v1/chat/completions"
W = "word " * 100
BIG_W = "word " * 13_200  # 66 KB: past the placeholder threshold (BIG_CHARS)
ARGS = json.dumps({"numbers": list(range(2000))}, separators=(",", ":"))


def _reasoning(key: str, text: str = W) -> dict[str, Any]:
    # The assistant turn comes last: Qwen-3 and GLM-4.7 print only the reasoning of turns
    # after the last user message.
    return {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", key: text},
        ]
    }


FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # (1) reasoning aliases, on every model whose template prints reasoning_content
    "reasoning/qwen-3": ("qwen-3", _reasoning("reasoning")),
    "thinking/qwen-3": ("qwen-3", _reasoning("thinking")),
    "reasoning-66k/qwen-3": ("qwen-3", _reasoning("reasoning", BIG_W)),
    "reasoning/qwen-3.5": ("qwen-3.5", _reasoning("reasoning")),
    "reasoning/glm-4.7-flash": ("glm-4.7-flash", _reasoning("reasoning")),
    "thinking/minimax-m3": ("minimax-m3", _reasoning("thinking")),
    # (2) special tokens overridden by chat_template_kwargs
    "bos_token/deepseek-v3": (
        "deepseek-v3",
        {"messages": [{"role": "user", "content": "q"}], "chat_template_kwargs": {"bos_token": W}},
    ),
    "bos_token-65k/deepseek-v3.1": (
        "deepseek-v3.1",
        {
            "messages": [{"role": "user", "content": "q"}],
            "chat_template_kwargs": {"bos_token": BIG_W},
        },
    ),
    # printed after every assistant turn: a template-free bound must charge it per message
    "eos_token-per-turn/deepseek-v2": (
        "deepseek-v2",
        {
            "messages": [
                m
                for i in range(10)
                for m in (
                    {"role": "user", "content": f"q{i}"},
                    {"role": "assistant", "content": "a"},
                )
            ],
            "chat_template_kwargs": {"eos_token": W},
        },
    ),
    # (3) a tool message's parts printed as Python dict literals
    "tool-parts/glm-4.7-flash": (
        "glm-4.7-flash",
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "c",
                    "content": [{"type": "text", "text": "\n" * 1000}],
                },
            ]
        },
    ),
    # (4) `<tool_resp` + `onse>` only form the marker when the template concatenates them
    "split-marker/qwen-3.5": (
        "qwen-3.5",
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning_content": W},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "<tool_resp"},
                        {"type": "text", "text": "onse>x</tool_response>"},
                    ],
                },
            ]
        },
    ),
    # (5) compact JSON arguments come out with ", " separators
    "compact-args/qwen-3": (
        "qwen-3",
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": ARGS},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c", "content": "ok"},
            ]
        },
    ),
    # tool definitions the engines dump from their models: nulls and SGLang's `strict`
    "tool-nulls/qwen-3": (
        "qwen-3",
        {
            "messages": [{"role": "user", "content": "q"}],
            "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(50)],
        },
    ),
}


@cache
def _loaded(model: str) -> tuple[Reference, HfTokenizer]:
    directory = model_dir(model)
    return load_reference(directory), load_hf(directory)


def engine_count(model: str, body: dict[str, Any]) -> int:
    """The largest count any engine kind computes for `body` (its rewriting + transformers)."""
    ref, _ = _loaded(model)
    return max(
        reference_count(ref, body, engine, fmt)
        for engine in ENGINE_KINDS
        for fmt in content_formats(ref.template)
    )


def kvproxy_count(model: str, body: dict[str, Any], *, template: bool = True) -> tuple[int, int]:
    """kvproxy's (count, bound): exact with the model's tokenizer and template, or (template
    False) the template-free byte bound of the `bytes` tokenizer, twice."""
    _, local = _loaded(model)
    shape = parse_request("chat", orjson.dumps(body))

    async def run() -> tuple[int, int]:
        if template:
            c = TokenCounter(bound_rule=local.bound_rule, template=local.template, local=local)
        else:
            c = TokenCounter(bound_rule="nfc")
        try:
            got = await c.count(shape, 0)
        finally:
            await c.aclose()
        assert got.bound is not None
        return got.tokens, got.bound

    return asyncio.run(run())


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_family_is_counted_at_least_as_the_engine(case: str) -> None:
    model, body = FAMILIES[case]
    truth = engine_count(model, body)
    exact, bound = kvproxy_count(model, body)
    assert exact >= truth, f"{case}: kvproxy {exact} < engine {truth}"
    assert bound >= truth
    # Exactly the engine's count (no slack was added to get there).
    assert exact == truth


@pytest.mark.parametrize(
    "case",
    [
        "reasoning/qwen-3",
        "thinking/qwen-3",
        "bos_token/deepseek-v3",
        "eos_token-per-turn/deepseek-v2",
        "compact-args/qwen-3",
    ],
)
def test_template_free_bound_covers_the_family(case: str) -> None:
    model, body = FAMILIES[case]
    _, bound = kvproxy_count(model, body, template=False)
    assert bound >= engine_count(model, body)


def test_enable_thinking_false_on_qwen3_is_exact() -> None:
    body = {
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    truth = engine_count("qwen-3", body)
    exact, _ = kvproxy_count("qwen-3", body)
    assert exact == truth
    thinking, _ = kvproxy_count("qwen-3", {"messages": body["messages"]})
    assert thinking < exact  # the switch really reached the template (empty think block)


@pytest.mark.parametrize(
    "key", ["messages", "tools", "add_generation_prompt", "documents", "raise_exception", "_x"]
)
def test_kwargs_that_name_template_arguments_or_globals_are_refused(key: str) -> None:
    body = {"messages": [{"role": "user", "content": "q"}], "chat_template_kwargs": {key: W}}
    with pytest.raises(KvproxyError) as info:
        parse_request("chat", orjson.dumps(body))
    assert info.value.status == 400
    assert info.value.param == f"chat_template_kwargs.{key}"


# --- through kvproxy serve -----------------------------------------------------------------


async def _answering(upstream: FakeUpstream) -> None:
    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": []})

    upstream.route("POST", CHAT, ok)
    await upstream.start()


# Each case starts a kvproxy serve with its tokenizer (8-40 s): make test keeps one, the
# slow suite runs the others (the in-process counts above cover every family in make test).
SERVE_CASES = [
    pytest.param("reasoning/qwen-3", id="reasoning/qwen-3"),
    *(
        pytest.param(case, id=case, marks=(pytest.mark.slow, pytest.mark.sweep))
        for case in (
            "thinking/minimax-m3",
            "bos_token/deepseek-v3",
            "tool-parts/glm-4.7-flash",
            "split-marker/qwen-3.5",
        )
    ),
]


@pytest.mark.parametrize("case", SERVE_CASES)
async def test_serve_rejects_the_family_with_a_pool_below_the_engine_count(
    case: str, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """Pool below the engine's count: rejected, nothing forwarded. Each family uses a feature
    the verified table does not list for a static pool (tokens.gate.verified), so the decision is
    the bound's and the rejection names the feature; a pool that holds that bound admits."""
    model, body = FAMILIES[case]
    truth = engine_count(model, body)
    body = {**body, "model": "m", "max_tokens": 1}
    await _answering(upstream)
    replies: list[tuple[int, Any, int]] = []
    for capacity in (truth - 1, None):
        async with running_proxy(
            upstream.url,
            engines=static_engines(capacity=capacity or replies[0][1]["error"]["prompt_tokens"]),
            tokenizer=f"hf:{model_dir(model)}",
        ) as proxy:
            async with http.post(proxy.public_url + CHAT, data=orjson.dumps(body)) as resp:
                replies.append((resp.status, await resp.json(), len(upstream.received)))
    (status, reply, forwarded), (ok_status, _, ok_forwarded) = replies
    assert status == 400, reply
    error = reply["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["prompt_tokens"] >= truth
    assert error["count_reason"] == "unverified_feature"
    assert error["unverified_features"]
    assert forwarded == 0  # I7: the rejected request never left kvproxy
    assert ok_status == 200
    assert ok_forwarded == 1


async def test_serve_refuses_kwargs_naming_template_arguments(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "q"}],
        "chat_template_kwargs": {"messages": [{"role": "user", "content": W}]},
    }
    await _answering(upstream)
    async with running_proxy(
        upstream.url, engines=static_engines(), tokenizer=f"hf:{model_dir('qwen-3')}"
    ) as proxy:
        async with http.post(proxy.public_url + CHAT, data=orjson.dumps(body)) as resp:
            status, reply = resp.status, await resp.json()
    assert status == 400
    assert reply["error"]["param"] == "chat_template_kwargs.messages"
    assert upstream.received == []
