"""The mutation fuzzer's body strategies (hypothesis), one per class of mutation: role
spellings, final-message position and flags, reasoning fields, numbers, tool shapes,
content-part lists and routes, plus the everyday chat they mutate ("plain").

A strategy draws `(route, engine, body_bytes)`; numbers are written as raw JSON text
(`Raw`), so "1E+2", "-0" or a 30-digit integer reach the engines exactly as a client typed
them. Sizes stay small (a few hundred tokens) so a render takes milliseconds.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from oracles.capture import MODEL

WORDS = [
    "hello",
    "world",
    "the",
    "数据",
    "テスト",
    "émoji 👩‍👩‍👧",
    "x = 1",
    "  ",
    "\n",
    "'q\"",
    "\\",
]
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "\n\n"]
NUMBERS = [
    "123456789012345678901234567890",
    "-9223372036854775809",
    "18446744073709551616",
    "18446744073709551615",
    "1e15",
    "1e16",
    "1E+2",
    "-0",
    "-0.0",
    "1.5e-7",
    "0.1",
    "1.000000000000000000001",
    "7",
]
CHAT_ENGINES = ("sglang", "vllm", "smg+sglang")


class Raw(str):
    """A JSON number exactly as written."""


def encode(v: Any) -> str:
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, dict):
        return "{" + ",".join(json.dumps(k) + ":" + encode(x) for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(encode(x) for x in v) + "]"
    return json.dumps(v, ensure_ascii=False)


def body_bytes(v: Any) -> bytes:
    return encode(v).encode()


# --- building blocks --------------------------------------------------------------------------

text = st.one_of(
    st.lists(st.sampled_from(WORDS + MARKERS), max_size=10).map(" ".join),
    st.integers(20, 120).map(lambda n: "word " * n),
)
short = st.lists(st.sampled_from(WORDS), min_size=1, max_size=4).map(" ".join)
number = st.sampled_from(NUMBERS).map(Raw)


def _json_args(draw: st.DrawFn) -> str:
    """A tool call's `arguments` string: JSON text with raw numbers, sometimes not JSON."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.sampled_from(["", "{}", "[]", "not json", '{"a": 1']))
    fields = {
        f"k{i}": draw(st.one_of(number, short, st.lists(number, max_size=8)))
        for i in range(draw(st.integers(1, 4)))
    }
    return encode(fields)


@st.composite
def tool_call(draw: st.DrawFn, cid: str) -> dict[str, Any]:
    return {
        "id": cid,
        "type": "function",
        "function": {
            "name": draw(st.sampled_from(["get", "search"])),
            "arguments": _json_args(draw),
        },
    }


@st.composite
def conversation(draw: st.DrawFn) -> list[dict[str, Any]]:
    """system?, (user, assistant)*, user: lowercase roles and string content."""
    out: list[dict[str, Any]] = []
    if draw(st.booleans()):
        out.append({"role": "system", "content": draw(text)})
    for _ in range(draw(st.integers(0, 2))):
        out.append({"role": "user", "content": draw(text)})
        out.append({"role": "assistant", "content": draw(text)})
    out.append({"role": "user", "content": draw(text)})
    return out


def chat_body(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, **fields}


# --- the classes ------------------------------------------------------------------------------


@st.composite
def plain(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """The everyday chat: lowercase system/user/assistant, strings, nothing else."""
    return "chat", draw(st.sampled_from(CHAT_ENGINES)), body_bytes(chat_body(draw(conversation())))


ROLE_SPELLINGS = [
    "System", "SYSTEM", "Assistant", "ASSISTANT", "User", "USER", "Tool", "developer",
    "Developer", "function", "latest_reminder", "root", "narrator",
]  # fmt: skip


@st.composite
def roles(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """Role spellings an engine normalises (or maps, or passes through), anywhere."""
    msgs = draw(conversation())
    for _ in range(draw(st.integers(1, 3))):
        r = draw(st.sampled_from(ROLE_SPELLINGS))
        m: dict[str, Any] = {"role": r, "content": draw(text)}
        if r.lower() == "function":
            m["name"] = "f"
        msgs.insert(draw(st.integers(0, len(msgs))), m)
    return "chat", draw(st.sampled_from(CHAT_ENGINES)), body_bytes(chat_body(msgs))


@st.composite
def final(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """A final assistant message (think blocks, reasoning, tool calls) and the flags that
    say what to do with it."""
    msgs = draw(conversation())
    last: dict[str, Any] = {
        "role": "assistant",
        "content": draw(
            st.one_of(text, st.builds(lambda a, b: f"<think>{a}</think>{b}", text, text))
        ),
    }
    if draw(st.booleans()):
        last["reasoning_content"] = draw(text)
    if draw(st.integers(0, 4)) == 0:
        last["content"] = None
        last["tool_calls"] = [draw(tool_call("c1"))]
    msgs.append(last)
    fields: dict[str, Any] = {}
    cfm = draw(st.sampled_from([None, True, False]))
    agp = draw(st.sampled_from([None, True, False]))
    if cfm is not None:
        fields["continue_final_message"] = cfm
    if agp is not None:
        fields["add_generation_prompt"] = agp
    return "chat", draw(st.sampled_from(CHAT_ENGINES)), body_bytes(chat_body(msgs, **fields))


EFFORTS = ["none", "minimal", "low", "medium", "high", "max"]


@st.composite
def reasoning(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """reasoning_effort, SGLang's `reasoning` object, template switches and an assistant
    turn's reasoning under both names."""
    msgs = draw(conversation())
    if len(msgs) > 2 and draw(st.booleans()):
        turn = next(m for m in msgs if m["role"] == "assistant")
        turn[draw(st.sampled_from(["reasoning_content", "reasoning"]))] = draw(text)
    fields: dict[str, Any] = {}
    if draw(st.booleans()):
        fields["reasoning_effort"] = draw(st.sampled_from(EFFORTS))
    if draw(st.booleans()):
        fields["reasoning"] = draw(
            st.sampled_from(
                [{"effort": e} for e in EFFORTS] + [{"enabled": True}, {"enabled": False}]
            )
        )
    if draw(st.booleans()):
        fields["chat_template_kwargs"] = {
            draw(st.sampled_from(["enable_thinking", "thinking"])): draw(st.booleans())
        }
        if draw(st.booleans()):
            fields["chat_template_kwargs"]["reasoning_effort"] = draw(st.sampled_from(EFFORTS))
    return "chat", draw(st.sampled_from(CHAT_ENGINES)), body_bytes(chat_body(msgs, **fields))


def _schema(draw: st.DrawFn) -> dict[str, Any]:
    props = {
        f"p{i}": {
            "type": draw(st.sampled_from(["integer", "number", "string"])),
            draw(st.sampled_from(["maximum", "minimum", "default", "multipleOf"])): draw(number),
            "examples": draw(st.lists(number, max_size=12)),
        }
        for i in range(draw(st.integers(1, 3)))
    }
    return {"type": "object", "properties": props}


@st.composite
def numbers(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """Integers beyond 64 bits, floats that re-serialise longer, -0 and -0.0, in tool
    schemas, tool-call arguments and template kwargs."""
    msgs = draw(conversation())
    msgs.append({"role": "assistant", "content": "", "tool_calls": [draw(tool_call("c1"))]})
    msgs.append({"role": "tool", "content": draw(short), "tool_call_id": "c1"})
    msgs.append({"role": "user", "content": draw(short)})
    fields: dict[str, Any] = {
        "tools": [
            {
                "type": "function",
                "function": {"name": "get", "description": "d", "parameters": _schema(draw)},
            }
        ]
    }
    if draw(st.booleans()):
        fields["chat_template_kwargs"] = {"custom": draw(st.lists(number, max_size=10))}
    return "chat", draw(st.sampled_from(CHAT_ENGINES)), body_bytes(chat_body(msgs, **fields))


@st.composite
def tool(draw: st.DrawFn, name: str) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if draw(st.booleans()):
        fn["description"] = draw(short)
    if draw(st.booleans()):
        fn["parameters"] = {
            "type": "object",
            "properties": {"q": {"type": "string", "description": draw(short)}},
        }
    if draw(st.booleans()):
        fn["strict"] = draw(st.booleans())
    if draw(st.integers(0, 3)) == 0:
        fn["defer_loading"] = True
    if draw(st.integers(0, 3)) == 0:
        fn["response"] = {"type": "string", "description": draw(short)}
    keys = draw(st.permutations(list(fn)))
    out: dict[str, Any] = {"type": "function", "function": {k: fn[k] for k in keys}}
    if draw(st.integers(0, 3)) == 0:
        out["defer_loading"] = True
    return out


@st.composite
def tools(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """Whole tool objects (strict, defer_loading, unknown keys, any key order), tool_choice,
    tool calls and `tool_calls: []`."""
    names = ["get", "search", "calc"][: draw(st.integers(1, 3))]
    msgs = draw(conversation())
    turn: dict[str, Any] = {"role": "assistant", "content": draw(short)}
    shape = draw(st.integers(0, 2))
    if shape == 0:
        turn["tool_calls"] = []
    elif shape == 1:
        turn["tool_calls"] = [draw(tool_call("c1"))]
    msgs.append(turn)
    if shape == 1:
        msgs.append({"role": "tool", "content": draw(text), "tool_call_id": "c1"})
    if draw(st.booleans()):
        msgs.append({"role": "user", "content": draw(short)})
    fields: dict[str, Any] = {"tools": [draw(tool(n)) for n in names]}
    choice = draw(st.sampled_from([None, "none", "auto", "required", "named"]))
    if choice == "named":
        fields["tool_choice"] = {"type": "function", "function": {"name": names[0]}}
    elif choice is not None:
        fields["tool_choice"] = choice
    return "chat", draw(st.sampled_from(CHAT_ENGINES)), body_bytes(chat_body(msgs, **fields))


def _parts(draw: st.DrawFn, role: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(1, 6))):
        k = draw(st.integers(0, 5))
        if k == 0:
            out.append(
                {
                    "type": "text",
                    "text": draw(st.sampled_from(["\n", "<tool_resp", "onse>", "<think", ">"])),
                }
            )
        elif k == 1 and role == "assistant":
            out.append({"type": "thinking", "thinking": draw(text)})
        else:
            out.append({"type": "text", "text": draw(text)})
    return out


@st.composite
def parts(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """Content as part lists on every role, tool results of text parts (joined by the
    engines), parts that form a marker only when joined."""
    msgs = draw(conversation())
    for m in msgs:
        if draw(st.booleans()):
            m["content"] = _parts(draw, m["role"])
    if draw(st.booleans()):
        msgs.insert(
            len(msgs) - 1,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}
                ],
            },
        )
        msgs.insert(
            len(msgs) - 1, {"role": "tool", "tool_call_id": "c1", "content": _parts(draw, "tool")}
        )
    return "chat", draw(st.sampled_from(CHAT_ENGINES)), body_bytes(chat_body(msgs))


@st.composite
def routes(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """The prompt-only routes and /v1/responses, each with the engines that serve it."""
    k = draw(st.integers(0, 5))
    if k == 0:
        prompt = draw(
            st.one_of(
                text,
                st.lists(text, min_size=1, max_size=3),
                st.lists(st.integers(0, 1000), min_size=1, max_size=50),
            )
        )
        return (
            "completions",
            draw(st.sampled_from(CHAT_ENGINES)),
            body_bytes({"model": MODEL, "prompt": prompt}),
        )
    if k == 1:
        body = draw(st.sampled_from(["text", "input_ids"]))
        value = (
            draw(text)
            if body == "text"
            else draw(st.lists(st.integers(0, 1000), min_size=1, max_size=50))
        )
        return (
            "generate",
            draw(st.sampled_from(["sglang", "smg+sglang"])),
            body_bytes({"model": MODEL, body: value}),
        )
    if k in (2, 3):
        first, second = draw(
            st.sampled_from(
                [
                    ("queries", "documents"),
                    ("queries", "items"),
                    ("data_1", "data_2"),
                    ("text_1", "text_2"),
                ]
            )
        )
        b: dict[str, Any] = {
            "model": MODEL,
            first: draw(text),
            second: draw(st.lists(text, min_size=1, max_size=3)),
        }
        if draw(st.booleans()):
            b.update(
                {"query": draw(short), "items": [draw(short)]}
                if first != "queries"
                else {"text_1": draw(text), "text_2": draw(text)}
            )
        route = "score" if k == 2 else "rerank"
        if route == "rerank":
            b = {
                "model": MODEL,
                "query": draw(text),
                "documents": draw(st.lists(text, min_size=1, max_size=3)),
            }
        return route, "vllm", body_bytes(b)
    item = draw(st.one_of(text, st.just(None)))
    inp: Any = (
        draw(text)
        if item is None
        else [{"role": "user", "content": [{"type": "input_text", "text": item}]}]
    )
    rb: dict[str, Any] = {"model": MODEL, "input": inp}
    if draw(st.booleans()):
        rb["instructions"] = draw(short)
    return "responses", draw(st.sampled_from(["sglang", "sglang-0.5.9"])), body_bytes(rb)


CLASSES: dict[str, st.SearchStrategy[tuple[str, str, bytes]]] = {
    "plain": plain(),
    "roles": roles(),
    "final": final(),
    "reasoning": reasoning(),
    "numbers": numbers(),
    "tools": tools(),
    "parts": parts(),
    "routes": routes(),
}
