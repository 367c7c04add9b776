"""Parsers of /v1/responses, /v1/messages and the prompt-only routes: what reaches the
template, and a 400 naming the field for every shape that cannot be counted."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvproxy.policy.clamp import clamp_output
from kvproxy.policy.errors import KvproxyError
from kvproxy.prompt import PromptShape
from kvproxy.prompt.parse import parse_request
from kvproxy.prompt.prompt_only import RERANK_OVERHEAD_TOKENS


def parse(route: Any, body: Any) -> PromptShape:
    return parse_request(route, orjson.dumps(body))


def refused(route: Any, body: Any) -> KvproxyError:
    with pytest.raises(KvproxyError) as info:
        parse(route, body)
    err = info.value
    assert err.status == 400
    assert err.code == "invalid_request"
    return err


# --- /v1/responses ---------------------------------------------------------------------------


def test_responses_become_the_chat_messages_smg_builds() -> None:
    shape = parse(
        "responses",
        {
            "instructions": "be brief",
            "input": [
                {"role": "developer", "content": "dev"},
                {"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "x"},
                ]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
                {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}],
                 "summary": [{"type": "summary_text", "text": "sum"}]},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "max_output_tokens": 7,
            "reasoning": {"effort": "low"},
            "stream": True,
        },
    )  # fmt: skip
    (seq,) = shape.prompts
    assert [m["role"] for m in seq.messages] == [
        "system", "user", "user", "assistant", "tool", "assistant",
    ]  # fmt: skip
    assert seq.messages[3]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert seq.messages[4] == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    assert seq.messages[5]["reasoning_content"] == "hmm\nsum"  # the summary is counted too
    assert seq.images == 1
    assert seq.tools == (
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    )
    assert seq.template_kwargs == {"reasoning_effort": "low"}
    assert (shape.route, shape.max_output_tokens, shape.stream, shape.generates) == (
        "responses", 7, True, True,
    )  # fmt: skip
    assert shape.prompt_param == "input"
    assert {"be brief", "dev", "a", "hmm\nsum", "42", "f", "{}"} <= set(seq.texts)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": "x", "instructions": 3}, "instructions"),
        ({"input": ["x"]}, "input[0]"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
         "input[0].content[0].text"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
         "input[0].arguments"),
        ({"input": [{"type": "reasoning", "encrypted_content": "opaque"}]},
         "input[0].encrypted_content"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "tools": {"type": "function"}}, "tools"),
        ({"input": "x", "tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "mcp", "server_url": "u"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "x", "max_output_tokens": "9"}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "x", "reasoning": "high"}, "reasoning"),
        ({"input": "x", "stream": "yes"}, "stream"),
    ],
)  # fmt: skip
def test_responses_refuse_what_cannot_be_counted(body: dict[str, Any], param: str) -> None:
    assert refused("responses", body).param == param


# --- /v1/messages ----------------------------------------------------------------------------


def test_messages_become_the_chat_messages_smg_builds() -> None:
    shape = parse(
        "messages",
        {
            "system": [{"type": "text", "text": "s1"}, {"type": "text", "text": "s2"}],
            "max_tokens": 9,
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "q"},
                    {"type": "image", "source": {"type": "base64", "data": "AAAA"}},
                    {"type": "tool_result", "tool_use_id": "t1", "content": [
                        {"type": "text", "text": "r1"}, {"type": "image", "source": {}},
                    ]},
                ]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "th", "signature": "sig"},
                    {"type": "text", "text": "a"},
                    {"type": "tool_use", "id": "t2", "name": "g", "input": {"k": 1}},
                ]},
            ],
            "tools": [{"name": "g", "description": "d", "input_schema": {"type": "object"}}],
            "thinking": {"type": "disabled"},
        },
    )  # fmt: skip
    (seq,) = shape.prompts
    assert [m["role"] for m in seq.messages] == ["system", "user", "tool", "assistant"]
    assert seq.messages[0]["content"] == "s1\ns2"  # smg joins system blocks with "\n"
    assert seq.messages[2]["content"] == [{"type": "text", "text": "r1"}, {"type": "image"}]
    assert seq.messages[3]["tool_calls"][0]["function"] == {"name": "g", "arguments": '{"k":1}'}
    assert seq.messages[3]["reasoning_content"] == "th"
    assert seq.images == 2
    fn = {"name": "g", "parameters": {"type": "object"}, "description": "d"}
    assert seq.tools == ({"type": "function", "function": fn},)
    assert seq.template_kwargs == {"enable_thinking": False, "thinking": False}
    assert (shape.max_output_tokens, shape.prompt_param) == (9, "messages")


def test_a_text_only_tool_result_is_the_string_smg_builds() -> None:
    blocks = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    result = {"type": "tool_result", "tool_use_id": "t", "content": blocks}
    body = {"max_tokens": 1, "messages": [{"role": "user", "content": [result]}]}
    (seq,) = parse("messages", body).prompts
    assert seq.messages == ({"role": "tool", "tool_call_id": "t", "content": "a\nb"},)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": "1", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 1}, "messages"),
        ({"max_tokens": 1, "messages": {}}, "messages"),
        ({"max_tokens": 1, "messages": [3]}, "messages[0]"),
        ({"max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": [3]}]},
         "messages[0].content[0]"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
         "messages[0].content[0].type"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0].text"),
        ({"max_tokens": 1, "messages": [{"role": "assistant", "content": [
            {"type": "redacted_thinking", "data": "x"}]}]}, "messages[0].content[0].type"),
        ({"max_tokens": 1, "messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "i", "name": "n", "input": "x"}]}]},
         "messages[0].content[0].input"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "i", "content": [{"type": "document"}]}]}]},
         "messages[0].content[0].content[0].type"),
        ({"max_tokens": 1, "system": 5, "messages": [{"role": "user", "content": "x"}]},
         "system"),
        ({"max_tokens": 1, "system": [{"type": "image"}], "messages": [
            {"role": "user", "content": "x"}]}, "system[0].type"),
        ({"max_tokens": 1, "tools": [{"type": "bash_20250124", "name": "bash"}], "messages": [
            {"role": "user", "content": "x"}]}, "tools[0].type"),
        ({"max_tokens": 1, "tools": [{"name": "t"}], "messages": [
            {"role": "user", "content": "x"}]}, "tools[0].input_schema"),
        ({"max_tokens": 1, "mcp_servers": [{}], "messages": [{"role": "user", "content": "x"}]},
         "mcp_servers"),
        ({"max_tokens": 1, "thinking": {"type": "on"}, "messages": [
            {"role": "user", "content": "x"}]}, "thinking.type"),
    ],
)  # fmt: skip
def test_messages_refuse_what_cannot_be_counted(body: dict[str, Any], param: str) -> None:
    assert refused("messages", body).param == param


# --- prompt-only routes ----------------------------------------------------------------------


def test_embeddings_each_input_is_a_sequence_and_nothing_is_generated() -> None:
    shape = parse("embeddings", {"input": ["a", "bb"]})
    assert [p.texts for p in shape.prompts] == [("a",), ("bb",)]
    assert shape.generates is False
    assert shape.max_output_tokens is None
    assert [p.token_ids for p in parse("classify", {"input": [[1, 2], [3]]}).prompts] == [2, 1]
    assert parse("embeddings", {"input": [5, 6, 7]}).prompts[0].token_ids == 3


def test_rerank_score_and_encode_sequences() -> None:
    rerank = parse("rerank", {"query": "q", "documents": ["d1", "d2"], "instruct": "i"})
    assert [p.texts for p in rerank.prompts] == [("q", "d1", "i"), ("q", "d2", "i")]
    assert all(p.token_ids == RERANK_OVERHEAD_TOKENS for p in rerank.prompts)
    score = parse("score", {"query": [1, 2], "items": [[3], [4, 5]]})
    assert [p.token_ids for p in score.prompts] == [3, 4]
    assert [p.texts for p in parse("score", {"query": "q", "items": "i"}).prompts] == [("q", "i")]
    enc = parse("encode", {"text": [["a", "b"], ["c", "d"]], "image_data": ["x"]})
    assert [p.texts for p in enc.prompts] == [("a", "b"), ("c", "d")]
    assert [p.images for p in enc.prompts] == [1, 1]
    assert parse("native_classify", {"input_ids": [[1], [2, 3]]}).prompts[1].token_ids == 2
    # vLLM's /classify takes OpenAI's `input`.
    assert [p.texts for p in parse("native_classify", {"input": ["a", "b"]}).prompts] == [
        ("a",),
        ("b",),
    ]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("embeddings", {}, "input"),
        ("embeddings", {"input": []}, "input"),
        ("embeddings", {"input": ["a", 1]}, "input"),
        ("embeddings", {"input": [{"text": "a", "image": "x"}]}, "input"),
        ("embeddings", {"input": [[1], "a"]}, "input[1]"),
        ("embeddings", {"input": [-1]}, "input"),
        ("classify", {"input": 3}, "input"),
        ("rerank", {"documents": ["d"]}, "query"),
        ("rerank", {"query": "q", "documents": []}, "documents"),
        ("rerank", {"query": "q", "documents": ["d", 2]}, "documents[1]"),
        ("rerank", {"query": "q", "documents": ["d"], "instruct": 1}, "instruct"),
        ("score", {"query": "q"}, "items"),
        ("score", {"query": "q", "items": [[1]]}, "items"),
        ("score", {"query": 5, "items": ["a"]}, "query"),
        ("score", {"query": [1], "items": ["a"]}, "items[0]"),
        ("encode", {}, "text"),
        ("encode", {"text": "a", "input_ids": [1]}, "text"),
        ("encode", {"text": [["a"]]}, "text"),
        ("encode", {"input_ids": [[1], []]}, "input_ids[1]"),
        ("encode", {"text": "a", "input_embeds": [[0.1]]}, "input_embeds"),
        ("native_classify", {"text": "a", "image_data": 5}, "image_data"),
    ],
)
def test_prompt_only_routes_refuse_what_cannot_be_counted(
    route: str, body: dict[str, Any], param: str
) -> None:
    assert refused(route, body).param == param


@pytest.mark.parametrize(
    ("route", "field"),
    [("responses", "max_output_tokens"), ("messages", "max_tokens"), ("chat", "max_tokens")],
)
def test_clamp_writes_the_field_the_route_reads(route: Any, field: str) -> None:
    body = orjson.dumps({"max_output_tokens": 900, "max_tokens": 900})
    assert orjson.loads(clamp_output(body, route, 5))[field] == 5
