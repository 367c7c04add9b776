"""parse_request: what each route yields, and a 400 naming the field for everything else."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvproxy.policy.errors import KvproxyError
from kvproxy.policy.routes import route_for_path
from kvproxy.prompt import MAX_OUTPUT_TOKENS
from kvproxy.prompt.parse import parse_request


def parse(route: str, body: Any) -> Any:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return parse_request(route, raw)  # type: ignore[arg-type]


def rejects(route: str, body: Any) -> KvproxyError:
    with pytest.raises(KvproxyError) as info:
        parse(route, body)
    err = info.value
    assert err.status == 400
    assert err.code == "invalid_request"
    return err


@pytest.mark.parametrize(
    ("path", "route"),
    [
        ("/v1/chat/completions", "chat"),
        ("/v1/chat/completions/", "chat"),
        ("/v1/completions", "completions"),
        ("/generate", "generate"),
        ("/v1/models", None),
        ("/health", None),
        ("/", None),
    ],
)
def test_route_for_path(path: str, route: str | None) -> None:
    assert route_for_path(path) == route


def test_chat_collects_every_string_a_template_can_print() -> None:
    shape = parse(
        "chat",
        {
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "developer", "content": "dev", "name": "boss"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        {"type": "input_audio", "input_audio": {"data": "AAAA"}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "think",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get", "arguments": '{"q": 1}'},
                        },
                        {
                            "id": "c2",
                            "type": "function",
                            "function": {"name": "put", "arguments": {"a": 2}},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "result", "metadata": "m"},
            ],
            "tools": [{"type": "function", "function": {"name": "get", "parameters": {}}}],
            "max_tokens": 10,
            "max_completion_tokens": 20,
            "n": 2,
            "stream": True,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert shape.route == "chat"
    assert shape.prompt_param == "messages"
    assert (shape.max_output_tokens, shape.n, shape.stream) == (20, 2, True)
    (seq,) = shape.prompts
    for s in (
        "sys",
        "dev",
        "boss",
        "look",
        "think",
        "get",
        '{"q": 1}',
        '{"a":2}',
        "result",
        "c1",
        "m",
    ):
        assert s in seq.texts
    assert not any("base64" in t for t in seq.texts)  # media are a configured cost, not text
    assert (seq.images, seq.audios, seq.message_count) == (1, 1, 5)
    assert seq.tools is not None
    assert seq.tools_json.startswith('[{"type":"function"')
    assert seq.template_kwargs == {"enable_thinking": False}
    assert seq.template_kwargs_json == '{"enable_thinking":false}'
    assert (seq.token_ids, seq.add_generation_prompt) == (0, True)
    assert shape.body_bytes > 0
    assert shape.generates
    assert shape.raw[:1] == b"{"
    assert shape.body["n"] == 2


def test_chat_fields_land_where_they_are_named() -> None:
    """The chat parser builds its records positionally (a hot path): each value must land
    in its own field, told apart here by values no two fields share."""
    body = {
        "messages": [
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "u"}},
                {"type": "image_url", "image_url": {"url": "v"}},
                {"type": "input_audio", "input_audio": {"data": "a"}},
            ]},
        ],
        "max_tokens": 7,
        "n": 3,
        "stream": False,
        "add_generation_prompt": False,
        "tools": [{"type": "function", "function": {"name": "t"}}],
        "chat_template_kwargs": {"k": 1},
    }  # fmt: skip
    raw = orjson.dumps(body)
    shape = parse_request("chat", raw)
    (seq,) = shape.prompts
    assert (seq.images, seq.audios, seq.token_ids) == (2, 1, 0)
    assert (seq.tools_json, seq.template_kwargs_json) == (
        '[{"type":"function","function":{"name":"t"}}]',
        '{"k":1}',
    )
    assert seq.tools == tuple(body["tools"])  # type: ignore[arg-type]
    assert seq.template_kwargs == {"k": 1}
    assert seq.add_generation_prompt is False
    assert seq.messages == tuple(body["messages"])  # type: ignore[arg-type]
    assert (shape.route, shape.prompt_param, shape.max_output_tokens, shape.n) == (
        "chat", "messages", 7, 3,
    )  # fmt: skip
    assert (shape.stream, shape.generates, shape.body_bytes) == (False, True, len(raw))
    assert shape.body == body
    assert shape.raw == raw


def test_completions_shapes() -> None:
    one = parse("completions", {"prompt": "hi", "max_tokens": 5, "best_of": 3})
    assert [p.texts for p in one.prompts] == [("hi",)]
    assert (one.max_output_tokens, one.n) == (5, 3)
    many = parse("completions", {"prompt": ["a", "b"], "suffix": "s"})
    assert [p.texts for p in many.prompts] == [("a", "s"), ("b", "s")]
    ids = parse("completions", {"prompt": [1, 2, 3]})
    assert [p.token_ids for p in ids.prompts] == [3]
    batch = parse("completions", {"prompt": [[1], [2, 3]]})
    assert [p.token_ids for p in batch.prompts] == [1, 2]
    assert batch.max_output_tokens is None


def test_generate_shapes() -> None:
    g = parse(
        "generate",
        {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 7, "n": 2}, "image_data": ["x"]},
    )
    assert [p.texts for p in g.prompts] == [("a",), ("b",)]
    assert (g.max_output_tokens, g.n, g.prompt_param) == (7, 2, "text")
    assert all(p.images == 1 for p in g.prompts)
    ids = parse(
        "generate", {"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 1}, {}]}
    )
    assert [p.token_ids for p in ids.prompts] == [2, 1]
    assert ids.prompt_param == "input_ids"
    assert ids.max_output_tokens == 1


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("chat", b"{not json", None),
        ("chat", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
        ("chat", b"[" * 5000 + b"]" * 5000, None),
        ("chat", b'"a string"', None),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": "hi"}, "messages"),
        ("chat", {"messages": [{"content": "x"}]}, "messages[0].role"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "x"}]}]},
            "messages[0].content[0].type",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
        # Unhashable part types (found by tests/hostile/test_hostile_live.py as a 500).
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": []}]}]},
            "messages[0].content[0].type",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": {"a": 1}, "text": "x"}]}]},
            "messages[0].content[0].type",
        ),
        ("generate", {"text": "a", "sampling_params": []}, "sampling_params"),
        ("chat", {"messages": [{"role": "user", "content": "x", "name": 1}]}, "messages[0].name"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": {}}, "tools"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}, "max_tokens"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, "max_tokens"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": True},
            "max_tokens",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": MAX_OUTPUT_TOKENS + 1},
            "max_tokens",
        ),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 1000}, "n"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": "y"},
            "continue_final_message",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}},
            "chat_template_kwargs.tools",
        ),
        ("completions", {}, "prompt"),
        ("completions", {"prompt": []}, "prompt"),
        ("completions", {"prompt": ["a", 1]}, "prompt"),
        ("completions", {"prompt": [1, -2]}, "prompt"),
        ("completions", {"prompt": [1, True]}, "prompt"),
        ("completions", {"prompt": [[1], []]}, "prompt[1]"),
        ("generate", {}, "text"),
        ("generate", {"text": "a", "input_ids": [1]}, "text"),
        ("generate", {"text": 5}, "text"),
        ("generate", {"input_embeds": [[0.1]]}, "input_embeds"),
        (
            "generate",
            {"text": "a", "sampling_params": {"max_new_tokens": -5}},
            "sampling_params.max_new_tokens",
        ),
        ("generate", {"text": "a", "sampling_params": [{"n": 0}]}, "sampling_params[0].n"),
    ],
)
def test_invalid_requests_name_the_field(route: str, body: Any, param: str | None) -> None:
    err = rejects(route, body)
    assert err.param == param


def test_template_kwargs_gather_documents_and_reasoning_effort() -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"enable_thinking": False, "bos_token": "<b>"},
        "documents": [{"title": "t", "text": "d"}],
        "reasoning_effort": "high",
    }
    seq = parse_request("chat", orjson.dumps(body)).prompts[0]
    # Special-token names stay (the template renders them as transformers does).
    assert seq.template_kwargs == {
        "enable_thinking": False,
        "bos_token": "<b>",
        "documents": [{"title": "t", "text": "d"}],
        "reasoning_effort": "high",
    }


def test_deep_tools_are_refused_not_crashed() -> None:
    # orjson reads 600 levels but will not write them back: a 400, never a crash.
    deep = b'{"a":' * 600 + b"1" + b"}" * 600
    body = b'{"messages": [{"role": "user", "content": "x"}], "tools": [' + deep + b"]}"
    err = rejects("chat", body)
    assert err.param == "tools"


def test_errors_never_quote_the_prompt() -> None:
    secret = "SECRET-PROMPT-TEXT"
    bodies = [
        b'{"messages": [{"role": "user", "content": "' + secret.encode() + b'"}]',
        orjson.dumps({"messages": [{"role": "user", "content": [{"type": secret}]}]}),
        orjson.dumps({"prompt": [secret, 1]}),
    ]
    for body in bodies:
        with pytest.raises(KvproxyError) as info:
            parse_request("chat" if b"messages" in body else "completions", body)
        assert secret not in info.value.message
        assert secret not in (info.value.param or "")
