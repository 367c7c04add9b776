"""Each engine's chat normalisation, rule by rule (tokens.replica.chatnorm), and what it costs the
common small chat: nothing beyond the one render it always had."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvproxy.config import load_settings
from kvproxy.policy.errors import KvproxyError
from kvproxy.prompt.parse import parse_request
from kvproxy.tokens import engine_kinds
from kvproxy.tokens.replica.chatnorm import (
    content_formats,
    engine_messages,
    engine_tools,
    normalize,
    reserialised_bytes,
    template_variants,
)
from kvproxy.tokens.replica.templates import ChatTemplate

PLAIN = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a":1,"b":[1,2]}'}}


def test_vllm_keeps_only_the_fields_its_parser_knows() -> None:
    msg = {
        "role": "assistant",
        "content": "a",
        "reasoning": "r",
        "thinking": "t",
        "metadata": {"k": "v"},
        "name": "bob",
        "tool_call_id": "x",
    }
    (out,) = engine_messages([msg], "vllm", "string")
    assert out == {
        "role": "assistant",
        "content": "a",
        "reasoning": "r",
        "reasoning_content": "r",
        "name": "bob",
    }


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_transformers_aliases_reasoning_after_either_engine(engine: Any) -> None:
    msg = {"role": "assistant", "content": "a", "thinking": "deep"}
    (out,) = normalize([msg], engine, "string")
    if engine == "vllm":  # vLLM's parser drops `thinking`; nothing is left to alias
        assert "reasoning_content" not in out
    else:
        assert out["reasoning_content"] == "deep"
        assert out["thinking"] == "deep"
        assert next(iter(out)) == "thinking"  # transformers' key order


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_tool_call_arguments_are_parsed(engine: Any) -> None:
    msg = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    (out,) = normalize([msg], engine, "string")
    assert out["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": [1, 2]}
    assert out["content"] == ""  # None: SGLang sets "", vLLM joins no parts
    # The client's dict is not changed.
    assert CALL["function"]["arguments"] == '{"a":1,"b":[1,2]}'


def test_vllm_turns_empty_arguments_into_an_object_and_keeps_invalid_json() -> None:
    calls = [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": ""}},
        {"id": "2", "type": "function", "function": {"name": "f", "arguments": "not json"}},
    ]
    (out,) = engine_messages([{"role": "assistant", "tool_calls": calls}], "vllm", "string")
    assert [c["function"]["arguments"] for c in out["tool_calls"]] == [{}, "not json"]


def test_content_lists_are_joined_or_kept_per_engine_and_format() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}, "b"]
    msg = [{"role": "user", "content": parts}]
    assert engine_messages(msg, "vllm", "string")[0]["content"] == "a\nb"
    assert engine_messages(msg, "sglang", "string")[0]["content"] == "a b"
    assert engine_messages(msg, "vllm", "openai")[0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "image"},
        {"type": "text", "text": "b"},
    ]
    assert engine_messages(msg, "sglang", "openai")[0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "image"},
        {"type": "text", "text": "b"},
    ]
    # vLLM wraps string content too on an "openai" template; SGLang does not.
    assert engine_messages(PLAIN, "vllm", "openai")[1]["content"] == [{"type": "text", "text": "q"}]
    assert engine_messages(PLAIN, "sglang", "openai")[1]["content"] == "q"


def test_content_format_detection() -> None:
    assert content_formats("{% for m in messages %}{{ m.content }}{% endfor %}") == ("string",)
    loop = "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}"
    assert content_formats(loop) == ("openai",)
    filtered = (
        "{% for m in messages %}{% for p in m.content | selectattr('type') %}x{% endfor %}"
        "{% endfor %}"
    )
    assert content_formats(filtered) == ("openai",)
    via_set = (
        "{% for m in messages %}{% set c = m.content %}{% for p in c %}x{% endfor %}{% endfor %}"
    )
    assert content_formats(via_set) == ("openai",)
    macro = "{% macro r(content) %}{% for i in content %}{{ i }}{% endfor %}{% endmacro %}"
    assert content_formats(macro) == ("string", "openai")
    assert content_formats(
        "{% generation %}x{% endgeneration %}{% for p in m.content %}{% endfor %}"
    ) == ("openai",)
    assert content_formats("{% broken") == ("string",)


def test_plain_chats_have_one_variant_and_lists_one_per_distinct_normalisation() -> None:
    both = ("sglang", "vllm")
    assert len(template_variants(PLAIN, None, both, ("string",))) == 1
    assert len(template_variants(PLAIN, None, both, ("string", "openai"))) == 1
    # vLLM on a definitely-"openai" template wraps the strings: one more render.
    assert len(template_variants(PLAIN, None, both, ("openai",))) == 2
    assert len(template_variants(PLAIN, None, ("sglang",), ("openai",))) == 1
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert (
        len(template_variants(parts, None, both, ("string", "openai"))) == 3
    )  # "a b", "a\nb", list


def test_tools_as_each_engine_dumps_them() -> None:
    tools = [{"type": "function", "function": {"name": "f", "x-extra": 1}}]
    assert engine_tools(tools, "vllm") == [
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": None, "x-extra": 1},
        }
    ]
    assert engine_tools(tools, "sglang") == [
        {"description": None, "name": "f", "parameters": None, "strict": False}
    ]
    assert engine_tools(None, "vllm") is None
    # A tool changes the plain fast path: one variant per engine.
    assert len(template_variants(PLAIN, tools, ("sglang", "vllm"), ("string",))) == 2


def test_special_token_kwargs_override_the_tokenizers() -> None:
    tmpl = ChatTemplate("{{ bos_token }}|{{ pad_token }}|{{ messages[0].content }}", "<s>", "</s>")
    tmpl.special_tokens["pad_token"] = "<pad>"
    plain = parse_request("chat", orjson.dumps({"messages": PLAIN[1:]})).prompts[0]
    assert tmpl.render(plain) == "<s>|<pad>|q"
    body = {"messages": PLAIN[1:], "chat_template_kwargs": {"bos_token": "BOS!", "enable": 1}}
    seq = parse_request("chat", orjson.dumps(body)).prompts[0]
    assert tmpl.render(seq) == "BOS!|<pad>|q"


def test_reasoning_effort_reaches_the_template() -> None:
    tmpl = ChatTemplate("{{ reasoning_effort }}")
    body = {"messages": PLAIN, "reasoning_effort": "high"}
    assert tmpl.render(parse_request("chat", orjson.dumps(body)).prompts[0]) == "high"


def test_reserialised_arguments_cover_separators_escapes_and_repr() -> None:
    compact = '{"a":[1,2,3],"b":"\\u00e9"}'
    assert reserialised_bytes(compact) >= len('{"a": [1, 2, 3], "b": "\\u00e9"}')
    assert reserialised_bytes('{"x":1e15}') >= len("{'x': 1000000000000000.0}")
    assert reserialised_bytes("not json") == len("not json")


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (["sglang"], ("sglang",)),
        (["vllm", "vllm"], ("vllm",)),
        (["sglang", "vllm"], ("sglang", "vllm")),
        (["static"], ("sglang", "vllm")),
    ],
)
def test_engine_kinds_from_settings(kinds: list[str], expected: tuple[str, ...]) -> None:
    engines = [
        {"url": "static://p" if k == "static" else f"http://127.0.0.1:{9000 + i}", "kind": k}
        | ({"capacity_tokens": 1000} if k == "static" else {})
        for i, k in enumerate(kinds)
    ]
    assert engine_kinds(load_settings(engines=engines)) == expected


def test_a_variant_one_engine_cannot_render_does_not_refuse_the_request() -> None:
    # SGLang hands this template bare function dicts: `t.function.name` fails there (SGLang
    # refuses the request, renders nothing); vLLM's wrapped tools render.
    tmpl = ChatTemplate("{% for t in tools %}{{ t.function.name }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    seq = parse_request("chat", orjson.dumps({"messages": PLAIN, "tools": tools})).prompts[0]
    assert tmpl.render_all(seq) == (("lookup",),)
    tmpl.engines = ("sglang",)
    with pytest.raises(KvproxyError):
        tmpl.render_all(seq)
