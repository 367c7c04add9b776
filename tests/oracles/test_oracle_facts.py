"""The oracles reproduce what is known of each engine (issue #30 and the engines' source),
checked on the oracles alone, before anything is compared with kvproxy."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from oracles import sglang, smg, vllm
from oracles.common import Refused
from oracles.corpus import MODEL, W, chat, user
from oracles.models import FAMILIES, REPRESENTATIVES, load_model, template_models
from oracles.versions import ARTIFACTS, ENGINE_VERSIONS


def _b(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def test_every_shipped_template_has_a_family_and_nine_families_are_represented() -> None:
    assert sorted(m for ms in FAMILIES.values() for m in ms) == sorted(template_models())
    assert len(REPRESENTATIVES) == 9


def test_every_release_is_pinned() -> None:
    assert ENGINE_VERSIONS == {"sglang": "0.5.23", "vllm": "0.34.0", "smg": "1.13.0"}
    assert all(len(sha) == 64 for _, sha in ARTIFACTS.values())


def test_sglang_lower_cases_roles_so_system_renders_about_215_tokens_on_qwen3() -> None:
    """The issue's body: one "System" message of ~200 tokens renders as a system turn."""
    m = load_model("qwen-3")
    capital = sglang.count(m, "chat", _b(chat({"role": "System", "content": W}, user())))
    lower = sglang.count(m, "chat", _b(chat({"role": "system", "content": W}, user())))
    assert capital.tokens == lower.tokens == 215
    # vLLM passes the role as sent: Qwen-3's template drops a role it does not know.
    assert vllm.count(m, "chat", _b(chat({"role": "System", "content": W}, user()))).tokens < 20


def test_sglang_accepts_user_only_in_lower_case() -> None:
    """protocol.py: "user" has its own model with a Literal role; the lower-casing
    validator belongs to the other roles' model."""
    m = load_model("qwen-3")
    with pytest.raises(Refused):
        sglang.count(m, "chat", _b(chat({"role": "User", "content": "x"})))


def test_sglang_ignores_add_generation_prompt_and_turns_a_final_assistant_into_a_user() -> None:
    m = load_model("qwen-2.5")
    plain = sglang.count(m, "chat", _b(chat(user(W))))
    assert sglang.count(m, "chat", _b(chat(user(W), add_generation_prompt=False))) == plain
    as_user = sglang.count(m, "chat", _b(chat(user("hi"), user(W))))
    as_assistant = sglang.count(
        m, "chat", _b(chat(user("hi"), {"role": "assistant", "content": W}))
    )
    assert as_assistant == as_user


def test_reasoning_effort_none_switches_thinking_off_on_both_engines() -> None:
    """Qwen-3 with enable_thinking false prints an empty think block: 4 more tokens."""
    m = load_model("qwen-3")
    base = sglang.count(m, "chat", _b(chat(user(W)))).tokens
    for engine in (sglang, vllm):
        assert (
            engine.count(m, "chat", _b(chat(user(W), reasoning_effort="none"))).tokens == base + 4
        )
    # Only SGLang reads the `reasoning` object.
    assert (
        sglang.count(m, "chat", _b(chat(user(W), reasoning={"effort": "none"}))).tokens == base + 4
    )
    assert vllm.count(m, "chat", _b(chat(user(W), reasoning={"effort": "none"}))).tokens == base


def test_vllm_drops_empty_tool_calls_and_sglang_keeps_them() -> None:
    messages = [user(), {"role": "assistant", "content": "a", "tool_calls": []}]
    m = load_model("qwen-3")
    conv = vllm.conversation(m, messages, "string")
    assert "tool_calls" not in conv[1]
    assert sglang.message(messages[1])["tool_calls"] == []


def test_tool_text_parts_join_with_a_space_in_sglang_and_a_newline_in_vllm() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    m = load_model("qwen-3")
    assert (
        vllm.conversation(m, [{"role": "tool", "content": parts}], "openai")[0]["content"] == "a\nb"
    )
    assert sglang._tool_content("tool", parts) == "a b"


def test_vllm_maps_developer_to_system_for_templates_that_never_name_it() -> None:
    m = load_model("qwen-3")
    assert not vllm.names_developer(m.template)
    dev = vllm.count(m, "chat", _b(chat({"role": "developer", "content": W}, user())))
    system = vllm.count(m, "chat", _b(chat({"role": "system", "content": W}, user())))
    assert dev == system
    # SGLang passes "developer" to the template, which skips it on Qwen-3.
    assert (
        sglang.count(m, "chat", _b(chat({"role": "developer", "content": W}, user()))).tokens < 20
    )


def test_sglang_dumps_the_whole_tool_object() -> None:
    """protocol.py Tool/Function: null description and parameters, defer_loading at both
    levels, the client's key order, unknown keys dropped."""
    dumped = sglang._tool(
        {
            "type": "function",
            "function": {"parameters": {"type": "object"}, "strict": False, "name": "t", "x": 1},
            "defer_loading": True,
        }
    )
    assert list(dumped) == ["type", "function", "defer_loading"]
    assert dumped["function"] == {
        "parameters": {"type": "object"},
        "strict": False,
        "name": "t",
        "description": None,
        "defer_loading": True,
    }
    assert list(dumped["function"]) == [
        "parameters",
        "strict",
        "name",
        "description",
        "defer_loading",
    ]


def test_sglang_parses_tool_arguments_with_orjson_and_vllm_with_json() -> None:
    args = '{"n": 123456789012345678901234567890}'
    msg = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]}  # fmt: skip
    s = sglang.message(msg)
    sglang._parse_arguments(s)
    assert isinstance(s["tool_calls"][0]["function"]["arguments"]["n"], float)
    conv = vllm.conversation(load_model("qwen-3"), [msg], "string")
    assert conv[0]["tool_calls"][0]["function"]["arguments"]["n"] == 123456789012345678901234567890


def test_smg_refuses_capitalised_roles_and_rewrites_what_it_forwards() -> None:
    with pytest.raises(Refused):
        smg.forward("chat", _b(chat({"role": "System", "content": "x"}, user())))
    body = chat(
        user(name="bob"),
        {"role": "assistant", "content": "a", "reasoning": "r"},
        {"role": "tool", "content": "t", "tool_call_id": "c", "name": "f"},
        tools=[
            {
                "type": "function",
                "defer_loading": True,
                "function": {"parameters": {"a": 1}, "name": "f", "x": 2},
            }
        ],
        max_tokens=5,
    )
    fwd = smg.forward("chat", _b(body))
    assert fwd["messages"][1] == {"role": "assistant", "content": "a", "reasoning_content": "r"}
    assert fwd["messages"][2] == {"role": "tool", "content": "t", "tool_call_id": "c"}
    assert fwd["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"a": 1}, "x": 2}}
    ]
    assert list(fwd["tools"][0]["function"]) == ["name", "parameters", "x"]
    assert fwd["max_tokens"] == 5
    assert fwd["tool_choice"] == "auto"


@pytest.mark.parametrize(
    ("text", "printed"),
    [
        ("123456789012345678901234567890", "1.2345678901234568e+29"),
        ("-9223372036854775809", "-9.223372036854776e+18"),
        ("18446744073709551615", "18446744073709551615"),
        ("-0", "-0.0"),
        ("-0.0", "-0.0"),
        ("1E+2", "100.0"),
        ("1e15", "1000000000000000.0"),
        ("1e16", "1e+16"),
        ("1.5e-7", "1.5e-7"),
        ("0.001234", "0.001234"),
    ],
)
def test_smg_prints_numbers_as_its_serde_json_does(text: str, printed: str) -> None:
    """As the 1.13.0 binary printed them (test_oracle_smg_real.py checks the binary)."""
    v = smg.load(f"[{text}]".encode())[0]
    assert (smg.ryu(v) if isinstance(v, float) else str(v)) == printed


def test_sglang_legacy_responses_falls_back_to_role_lines_with_python_reprs() -> None:
    m = load_model("qwen-3")
    body = {
        "model": MODEL,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "a\nb"}]}],
    }
    text = "user: [{'text': 'a\\nb', 'type': 'input_text'}]\n"
    assert sglang.responses_legacy(m, _b(body)).tokens == len(m.tokenizer.encode(text))
    # 0.5.23 converts the same input to a chat turn instead.
    assert (
        sglang.responses(m, _b(body)).tokens
        == sglang.count(m, "chat", _b(chat(user("a\nb")))).tokens
    )


def test_vllm_score_reads_the_first_complete_pair_of_fields() -> None:
    """pooling/scoring/protocol.py ScoreRequest: queries/documents, queries/items,
    data_1/data_2, text_1/text_2, in that order; `query` is no score field."""
    m = load_model("qwen-3")
    small = vllm.count(m, "score", _b({"queries": "q", "items": ["a"], "text_1": W, "text_2": W}))
    big = vllm.count(m, "score", _b({"query": "q", "items": ["a"], "text_1": W, "text_2": W}))
    assert small.hi < 10 < 300 < big.tokens


def test_prompt_embeds_are_uncountable_and_input_embeds_refused_by_default() -> None:
    from oracles.common import Uncountable

    m = load_model("qwen-3")
    with pytest.raises(Uncountable):
        vllm.count(m, "completions", _b({"prompt": "x", "prompt_embeds": "AAAA"}))
    with pytest.raises(Refused):
        sglang.count(m, "generate", _b({"input_embeds": [[0.0]]}))


def test_orjson_turns_integers_beyond_64_bits_into_floats() -> None:
    """What SGLang's parse does with them in this venv (versions.ORJSON_VERSION)."""
    assert orjson.loads(b"18446744073709551616") == 1.8446744073709552e19


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        (
            "{% for m in messages %}{% for p in m['content'] %}{{ p }}{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
        (
            "{% macro show(parts) %}{% for p in parts %}{{ p.type }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
            "openai",
        ),
        (
            "{% macro show(role, parts) %}{% for p in parts %}{{ p.type }}{% endfor %}"
            "{% endmacro %}"
            "{% for m in messages %}{{ show(role=m.role, parts=m['content']) }}{% endfor %}",
            "openai",
        ),
        (
            "{% macro show(parts) %}{% for p in parts %}{{ p }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(parts=['fixed']) }}{% endfor %}",
            "string",
        ),
        (
            "{% set ns = namespace(todo=messages) %}"
            "{% for m in ns.todo %}{% for p in m.content %}{{ p.type }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set ns = namespace(todo=[]) %}{% set ns.todo = messages %}"
            "{% for m in ns.todo %}{% for p in m.content %}{{ p.type }}{% endfor %}{% endfor %}",
            "openai",
        ),
    ],
)
def test_vllm_content_format_follows_messages_through_macros_and_aliases(
    template: str, fmt: str
) -> None:
    """renderers/hf.py _detect_content_format: the shapes vLLM's own tests pin (the replica
    also agrees with vLLM's expectations for the 18 example templates of its sdist)."""
    assert vllm.content_format(template) == fmt
