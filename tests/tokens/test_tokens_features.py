"""Request features (kvproxy.tokens.gate.features): what a body uses that an engine's
preprocessing may treat its own way. Sans-IO: bodies in, feature sets out."""

from __future__ import annotations

import json
from typing import Any

import hypothesis.strategies as st
import orjson
import pytest
from hypothesis import given, settings

from kvproxy.tokens.gate.features import FEATURES, request_features

PLAIN = {
    "model": "m",
    "max_tokens": 8,
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ],
}


def feats(body: dict[str, Any], route: str = "chat") -> frozenset[str]:
    # Through orjson, as the proxy parses it: huge integers arrive as floats.
    return request_features(route, orjson.loads(json.dumps(body)))


def with_message(msg: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "q"}, msg, {"role": "user", "content": "q"}]}


def test_a_plain_chat_uses_only_plain_features() -> None:
    assert feats(PLAIN) == {
        "route:chat", "role:system", "role:user", "role:assistant", "content:string",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("role", "feature"),
    [
        ("System", "role:case"),
        ("USER", "role:case"),
        ("Assistant", "role:case"),
        ("Developer", "role:case"),
        ("developer", "role:developer"),
        ("function", "role:function"),
        ("ipython", "role:other"),
        ("", "role:other"),
        ("tool", "role:tool"),
    ],
)
def test_role_spelling(role: str, feature: str) -> None:
    got = feats({"messages": [{"role": role, "content": "x"}, {"role": "user", "content": "q"}]})
    assert feature in got
    assert ("role:case" in got) == (feature == "role:case")


def test_a_non_string_role_is_other() -> None:
    got = request_features("chat", {"messages": [{"role": 5, "content": "x"}]})
    assert "role:other" in got


@pytest.mark.parametrize(
    ("last", "feature"),
    [("assistant", "final:assistant"), ("Assistant", "final:assistant"),
     ("tool", "final:tool"), ("system", "final:system"), ("critic", "final:other")],
)  # fmt: skip
def test_the_final_message(last: str, feature: str) -> None:
    body = {"messages": [{"role": "user", "content": "q"}, {"role": last, "content": "a"}]}
    assert feature in feats(body)
    assert not any(f.startswith("final:") for f in feats(PLAIN))


@pytest.mark.parametrize(
    ("top", "expected"),
    [
        ({"add_generation_prompt": False}, {"add_generation_prompt:false"}),
        ({"add_generation_prompt": True}, {"add_generation_prompt:true"}),
        ({"continue_final_message": True}, {"continue_final_message"}),
        ({"continue_final_message": False}, set()),
        ({"reasoning_effort": "none"}, {"reasoning_effort", "reasoning_effort:none"}),
        ({"reasoning_effort": "high"}, {"reasoning_effort"}),
        ({"reasoning": {"effort": "low"}}, {"reasoning"}),
        ({"documents": [{"title": "t", "text": "x"}]}, {"documents"}),
        ({"tool_choice": "auto"}, {"tool_choice"}),
        ({"response_format": {"type": "json_object"}}, {"response_format"}),
        ({"chat_template": "{{ 1 }}"}, {"chat_template"}),
        ({"add_special_tokens": True}, {"add_special_tokens"}),
        ({"mm_processor_kwargs": {}}, {"mm_kwargs"}),
        ({"chat_template_kwargs": {"enable_thinking": False}}, {"kwarg:enable_thinking"}),
        ({"chat_template_kwargs": {"enable_thinking": "no"}}, {"kwarg:other"}),
        ({"chat_template_kwargs": {"thinking": True}}, {"kwarg:thinking"}),
        ({"chat_template_kwargs": {"reasoning_effort": "low"}}, {"kwarg:reasoning_effort"}),
        ({"chat_template_kwargs": {"bos_token": "x"}}, {"kwarg:special_token"}),
        ({"chat_template_kwargs": {"my_var": 1}}, {"kwarg:other"}),
        ({"frobnicate": 1}, {"unknown:body"}),
        # Sampling fields never reach the template.
        ({"temperature": 0.5, "seed": 2**60, "stream": True, "logit_bias": {"1": 2.5}}, set()),
    ],
)
def test_top_level_fields(top: dict[str, Any], expected: set[str]) -> None:
    base = feats(PLAIN)
    assert feats({**PLAIN, **top}) - base == expected


def test_message_fields_and_unknown_keys() -> None:
    msg = {
        "role": "assistant", "content": "a", "name": "n", "reasoning_content": "r",
        "reasoning": "r", "thinking": "t", "refusal": "no", "metadata": {"k": 1},
    }  # fmt: skip
    got = feats(with_message(msg))
    assert {
        "message:name", "message:reasoning_content", "message:reasoning", "message:thinking",
        "message:refusal", "unknown:message",
    } <= got  # fmt: skip
    # A null value is still a key the client sent.
    assert "message:name" in feats(with_message({"role": "user", "content": "a", "name": None}))


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, {"content:null"}),
        ([{"type": "text", "text": "a"}], {"content:parts", "part:text"}),
        (
            [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            {"content:parts", "part:text", "content:multi_text"},
        ),
        (["a"], {"content:parts", "part:string"}),
        ([{"type": "image_url", "image_url": {"url": "u"}}], {"content:parts", "part:image"}),
        ([{"type": "input_audio", "input_audio": {}}], {"content:parts", "part:audio"}),
        ([{"type": "video_url", "video_url": {}}], {"content:parts", "part:video"}),
        ([{"type": "refusal", "refusal": "no"}], {"content:parts", "part:refusal"}),
        ([{"type": "text", "text": "a", "cache_control": {}}], {"content:parts", "part:text",
                                                                "unknown:part"}),
        ([{"type": ["weird"]}], {"content:parts", "part:other"}),
        ([7], {"content:parts", "part:other"}),
        (7, {"content:other"}),
    ],
)  # fmt: skip
def test_content_shapes(content: Any, expected: set[str]) -> None:
    got = feats(with_message({"role": "user", "content": content}))
    assert got - feats(PLAIN) - {"content:string"} == expected - {"content:string"}


def test_parts_in_a_tool_message() -> None:
    msg = {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a"}]}
    assert {"tool:parts", "message:tool_call_id", "role:tool"} <= feats(with_message(msg))


@pytest.mark.parametrize(
    ("calls", "expected"),
    [
        ([], {"tool_calls", "tool_calls:empty"}),
        (
            [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            {"tool_calls", "tool_calls:args_string"},
        ),
        (
            [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
            {"tool_calls", "tool_calls:args_object"},
        ),
        (
            [{"id": "c", "function": {"name": "f", "arguments": "{not json"}}],
            {"tool_calls", "tool_calls:args_string", "tool_calls:args_invalid"},
        ),
        (
            [{"id": "c", "function": {"name": "f", "arguments": '{"n": 1e15}'}}],
            {"tool_calls", "tool_calls:args_string", "number:float"},
        ),
        (
            [{"id": "c", "function": {"name": "f", "arguments": '{"n": 123456789012345678901}'}}],
            {"tool_calls", "tool_calls:args_string", "number:big_int"},
        ),
        (
            [{"id": "c", "extra": 1, "function": {"name": "f", "arguments": "{}", "x": 2}}],
            {"tool_calls", "tool_calls:args_string", "unknown:tool_call",
             "unknown:tool_call_function"},
        ),
    ],
)  # fmt: skip
def test_tool_calls(calls: list[Any], expected: set[str]) -> None:
    msg = {"role": "assistant", "content": None, "tool_calls": calls}
    got = feats(with_message(msg)) - feats(PLAIN) - {"content:null"}
    assert got == expected


def test_tool_calls_on_a_user_turn() -> None:
    msg = {"role": "user", "content": "x", "tool_calls": []}
    assert "tool_calls:non_assistant" in feats(with_message(msg))


def test_tools_and_their_shape() -> None:
    fn = {"name": "f", "description": "d", "parameters": {"type": "object"}}
    plain = feats({**PLAIN, "tools": [{"type": "function", "function": fn}]})
    assert plain - feats(PLAIN) == {"tools"}
    whole = {"type": "function", "function": {**fn, "strict": True}, "defer_loading": True}
    assert feats({**PLAIN, "tools": [whole]}) - feats(PLAIN) == {
        "tools", "tools:strict", "tools:defer_loading",
    }  # fmt: skip
    odd = {"type": "custom", "function": {**fn, "x_extra": 1}, "cache": {}}
    assert feats({**PLAIN, "tools": [odd]}) - feats(PLAIN) == {
        "tools", "tools:non_function", "unknown:tool", "unknown:tool_function",
    }  # fmt: skip
    assert "functions" in feats({**PLAIN, "functions": [fn]})


@pytest.mark.parametrize(
    "number",
    ["123456789012345678901234567890", "18446744073709551615", "-9007199254740993"],
)
def test_integers_past_the_float64_range_anywhere(number: str) -> None:
    schema = '{"type": "object", "properties": {"n": {"maximum": ' + number + "}}}"
    body = (
        '{"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function", '
        '"function": {"name": "f", "parameters": ' + schema + "}}]}"
    )
    got = request_features("chat", orjson.loads(body))
    # orjson turns integers past 64 bits into floats: they are still big integers.
    assert "number:big_int" in got
    small = body.replace(number, "9007199254740992")
    assert not request_features("chat", orjson.loads(small)) & {"number:big_int", "number:float"}


@pytest.mark.parametrize("number", ["1e15", "-0.0", "1E+2", "0.1"])
def test_floats_in_kwargs_documents_and_unknown_fields(number: str) -> None:
    for body in (
        '{"messages": [{"role": "user", "content": "q"}], "chat_template_kwargs": {"x": N}}',
        '{"messages": [{"role": "user", "content": "q"}], "documents": [{"n": N}]}',
        '{"messages": [{"role": "user", "content": "q", "meta": [N]}]}',
    ):
        assert "number:float" in request_features("chat", orjson.loads(body.replace("N", number)))


def test_deep_nesting_does_not_recurse() -> None:
    deep = "[" * 1000 + "1.5" + "]" * 1000
    body = '{"messages": [{"role": "user", "content": "q"}], "documents": ' + deep + "}"
    assert "number:float" in request_features("chat", orjson.loads(body))


@pytest.mark.parametrize(
    ("route", "body", "expected"),
    [
        ("completions", {"prompt": "x"}, {"route:completions", "prompt:text"}),
        ("completions", {"prompt": [1, 2]}, {"route:completions", "prompt:ids"}),
        ("completions", {"prompt": [[1], [2]]}, {"route:completions", "prompt:ids",
                                                 "prompt:batch"}),
        ("completions", {"prompt": ["a", "b"]}, {"route:completions", "prompt:text",
                                                 "prompt:batch"}),
        ("completions", {"prompt": "x", "suffix": "y", "echo": True},
         {"route:completions", "prompt:text", "suffix", "echo"}),
        ("completions", {"prompt": "x", "prompt_embeds": "..."},
         {"route:completions", "prompt:text", "unknown:body"}),
        ("generate", {"text": "x"}, {"route:generate", "generate:text"}),
        ("generate", {"input_ids": [1]}, {"route:generate", "generate:input_ids"}),
        ("generate", {"text": ["a"], "image_data": "u"},
         {"route:generate", "generate:text", "generate:batch", "generate:media"}),
        ("responses", {"input": "x"}, {"route:responses"}),
        ("score", {"text_1": "a", "text_2": "b"}, {"route:score"}),
    ],
)  # fmt: skip
def test_other_routes(route: str, body: dict[str, Any], expected: set[str]) -> None:
    assert feats(body, route) == expected


KEYS = st.sampled_from(
    ["role", "content", "name", "tool_calls", "function", "arguments", "type", "text",
     "tools", "messages", "chat_template_kwargs", "reasoning_effort", "x"]
)  # fmt: skip
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


@settings(max_examples=200)
@given(
    st.dictionaries(KEYS, JSON | st.lists(st.dictionaries(KEYS, JSON, max_size=3), max_size=3)),
    st.sampled_from(["chat", "completions", "generate", "responses"]),
)
def test_any_json_gets_features_from_the_closed_vocabulary(
    body: dict[str, Any], route: str
) -> None:
    got = request_features(route, body)
    assert got <= FEATURES
    assert f"route:{route}" in got


def test_the_read_is_bounded_and_fails_towards_unverified() -> None:
    """Past the parse and walk caps the numbers are assumed, never ignored."""
    from kvproxy.tokens.gate.features import MAX_PARSED_ARGS_CHARS, MAX_WALKED_VALUES

    big_args = '{"s": "' + "x" * MAX_PARSED_ARGS_CHARS + '"}'
    call = {"id": "c", "function": {"name": "f", "arguments": big_args}}
    got = feats(with_message({"role": "assistant", "content": None, "tool_calls": [call]}))
    assert {"number:float", "number:big_int"} <= got
    wide = {**PLAIN, "documents": [{"n": 1}] * (MAX_WALKED_VALUES + 1)}
    assert {"number:float", "number:big_int"} <= feats(wide)
    assert not {"number:float", "number:big_int"} & feats({**PLAIN, "documents": [{"n": 1}]})
