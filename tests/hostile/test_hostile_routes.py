"""Fuzzing the parsers of /v1/responses, /v1/messages and the prompt-only routes: any body
is a well-formed shape or a 400 naming a problem (`hostile_support.check_parse`), never
another exception (a 500 in the proxy)."""

from __future__ import annotations

from typing import Any

import pytest
from hostile_support import (
    FUZZ_EXAMPLES,
    check_parse,
    dump,
    hostile_body,
    hostile_text,
    json_value,
    number,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproxy.policy.routes import Route

FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
NEW_ROUTES: tuple[Route, ...] = (
    "responses", "messages", "embeddings", "classify", "rerank", "score", "encode",
    "native_classify",
)  # fmt: skip

text_or_any = hostile_text | json_value
part = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "refusal", "input_image",
                              "input_file", "text", "image", "tool_result", "tool_use",
                              "thinking", "redacted_thinking", "document"]) | json_value},
    optional={"text": text_or_any, "refusal": text_or_any, "thinking": text_or_any,
              "tool_use_id": text_or_any, "id": text_or_any, "name": text_or_any,
              "input": json_value, "content": text_or_any | st.lists(json_value, max_size=2)},
)  # fmt: skip
item = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output",
                                 "reasoning", "item_reference"]) | json_value,
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"])
        | json_value,
        "content": text_or_any | st.lists(part | json_value, max_size=3),
        "call_id": text_or_any, "name": text_or_any, "arguments": text_or_any,
        "output": text_or_any | st.lists(part, max_size=2), "summary": json_value,
        "encrypted_content": json_value,
    },
)  # fmt: skip
near_valid: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
    {"model": st.just("m")},
    optional={
        "input": hostile_text | st.lists(item | hostile_text, max_size=3)
        | st.lists(st.integers(-5, 2**64), max_size=4) | json_value,
        "instructions": text_or_any, "system": text_or_any | st.lists(part, max_size=2),
        "messages": st.lists(item, max_size=3) | json_value,
        "tools": st.lists(json_value | st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "custom", "mcp"]) | json_value},
            optional={"name": text_or_any, "input_schema": json_value,
                      "parameters": json_value}), max_size=2) | json_value,
        "max_output_tokens": number, "max_tokens": number, "stream": json_value,
        "reasoning": json_value, "thinking": json_value, "previous_response_id": json_value,
        "background": json_value, "query": text_or_any | st.lists(st.integers(-2, 99)),
        "documents": st.lists(text_or_any, max_size=3) | json_value,
        "items": text_or_any | st.lists(text_or_any, max_size=3), "instruct": json_value,
        "text": text_or_any | st.lists(st.lists(hostile_text, max_size=3), max_size=2),
        "input_ids": json_value, "image_data": json_value,
    },
)  # fmt: skip


@pytest.mark.no_cover  # CPU-bound (~2x traced); the rest of the suite measures its lines
@FUZZ
@given(route=st.sampled_from(NEW_ROUTES), body=near_valid.map(dump) | hostile_body)
def test_any_body_is_a_shape_or_a_400(route: Route, body: bytes) -> None:
    shape = check_parse(route, body)
    if shape is not None and route not in ("responses", "messages"):
        assert not shape.generates  # prompt-only routes never ask for a decode budget
