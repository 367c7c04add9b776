"""The simulator's own conversion of /v1/responses and /v1/messages into chat: the engine
prefills exactly what the equivalent chat request would, and over-long prompts are refused
by its own context check (the ground truth kvproxy is judged against)."""

from __future__ import annotations

from typing import Any

import pytest

from kvproxy.sim.converse import ROUTE_MESSAGES, ROUTE_RESPONSES
from kvproxy.sim.limits import EngineError
from kvproxy.sim.protocol import ROUTE_CHAT, full_reply, parse_request
from kvproxy.sim.tokenizer import BYTE_CHAT_TEMPLATE, ByteTokenizer, ChatRenderer

TOK = ByteTokenizer()
RENDER = ChatRenderer(BYTE_CHAT_TEMPLATE, {})


def ids(route: str, body: dict[str, Any]) -> list[int]:
    return parse_request(route, body, TOK, RENDER, "m").input_ids


CHAT = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c", "content": "42"},
]  # fmt: skip


def test_responses_prefill_what_the_chat_request_would() -> None:
    body = {
        "instructions": "sys",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "42"},
        ],
        "max_output_tokens": 3,
    }
    assert ids(ROUTE_RESPONSES, body) == ids(ROUTE_CHAT, {"messages": CHAT})
    assert parse_request(ROUTE_RESPONSES, body, TOK, RENDER, "m").max_new_tokens == 3


def test_messages_prefill_what_the_chat_request_would() -> None:
    use = {"type": "tool_use", "id": "c", "name": "f", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "c", "content": "42"}
    body = {
        "system": "sys",
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [result]},
        ],
    }
    assert ids(ROUTE_MESSAGES, body) == ids(ROUTE_CHAT, {"messages": CHAT})


@pytest.mark.parametrize(
    ("route", "body"),
    [
        (ROUTE_RESPONSES, {"input": "x", "previous_response_id": "r"}),
        (ROUTE_RESPONSES, {"input": [{"type": "item_reference", "id": "i"}]}),
        (ROUTE_RESPONSES, {"input": 3}),
        (ROUTE_MESSAGES, {"messages": [{"role": "user", "content": "x"}]}),  # no max_tokens
        (ROUTE_MESSAGES, {"max_tokens": 1, "messages": []}),
    ],
)
def test_what_the_serving_stack_refuses(route: str, body: dict[str, Any]) -> None:
    with pytest.raises(EngineError):
        ids(route, body)


def test_replies_carry_usage_in_the_routes_own_names() -> None:
    req = parse_request(ROUTE_MESSAGES, {"max_tokens": 1, "messages": CHAT[1:2]}, TOK, RENDER, "m")
    reply = full_reply(req, "hi", 7, [1, 2], "length")
    assert reply["usage"] == {"input_tokens": 7, "output_tokens": 2}
    assert reply["stop_reason"] == "max_tokens"
    req.route = ROUTE_RESPONSES
    assert full_reply(req, "hi", 7, [1], "stop")["usage"]["input_tokens"] == 7
