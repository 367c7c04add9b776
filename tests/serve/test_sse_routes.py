"""The tripwire and the drain read /v1/responses and /v1/messages output too: generated text
in their stream events and whole bodies is found (a canary there would otherwise pass
unseen, and a first token after a disconnect would never be recognised)."""

from __future__ import annotations

import orjson
import pytest

from kvproxy.response.payload import has_token, read_body, read_payload


@pytest.mark.parametrize(
    ("event", "text"),
    [
        ({"type": "response.output_text.delta", "output_index": 0, "delta": "leak"}, "leak"),
        ({"type": "response.refusal.delta", "delta": "no"}, "no"),
        ({"type": "response.function_call_arguments.delta", "delta": '{"a"'}, '{"a"'),
        ({"type": "content_block_delta", "index": 1, "delta": {"text": "t"}}, "t"),
        ({"type": "content_block_delta", "delta": {"thinking": "h"}}, "h"),
        ({"type": "content_block_delta", "delta": {"partial_json": "{"}}, "{"),
    ],
)  # fmt: skip
def test_stream_events_carry_text_and_a_token(event: dict[str, object], text: str) -> None:
    reading = read_payload(orjson.dumps(event))
    assert text in reading.texts  # the tripwire scans it
    assert reading.output  # and it is a generated token for the drain


@pytest.mark.parametrize(
    "event",
    [
        {"type": "response.created", "response": {"id": "r"}},
        {"type": "response.output_text.delta", "delta": ""},
        {"type": "message_start", "message": {"content": []}},
        {"type": "error", "error": {"type": "overloaded_error", "message": "m"}},
    ],
)
def test_lifecycle_and_error_events_are_not_tokens(event: dict[str, object]) -> None:
    assert not has_token(orjson.dumps(event))


def test_whole_bodies_are_scanned() -> None:
    responses = {
        "object": "response",
        "output": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
            {"type": "message", "content": [{"type": "output_text", "text": "leak"}]},
            {"type": "function_call", "name": "f", "arguments": '{"x":1}'},
        ],
    }
    scanned = [t for r in read_body(orjson.dumps(responses)) for t in r.texts]
    assert {"f", '{"x":1}', "s", "leak"} <= set(scanned)
    messages = {
        "type": "message",
        "content": [
            {"type": "thinking", "thinking": "th"},
            {"type": "text", "text": "leak"},
            {"type": "tool_use", "name": "g", "input": {"k": "v"}},
        ],
    }
    scanned = [t for r in read_body(orjson.dumps(messages)) for t in r.texts]
    assert {"th", "leak", "g", "v"} <= set(scanned)
