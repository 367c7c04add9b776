"""What a client receives and what of it is generated output (kvproxy/response/payload.py): the one
definition the tripwire and the drain's first-token detection share (#15.1, #24.4)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproxy.response import payload as output
from kvproxy.response import usage
from kvproxy.response.payload import (
    KEYS_PATH,
    SEP,
    body_texts,
    has_token,
    read_body,
    read_payload,
    token_texts,
    unescape,
)


def chat_chunk(index: int = 0, **delta: object) -> bytes:
    choice = {"index": index, "delta": delta, "finish_reason": None}
    return orjson.dumps({"id": "c", "object": "chat.completion.chunk", "model": "m",
                         "choices": [choice]})  # fmt: skip


@pytest.mark.parametrize(
    ("payload", "output"),
    [
        # Generated output, whatever field carries it.
        (chat_chunk(content="Hi"), True),
        (chat_chunk(reasoning="think"), True),  # vLLM >= 0.16: reasoning only here
        (chat_chunk(reasoning_content="think"), True),  # SGLang
        (chat_chunk(refusal="no"), True),
        (
            chat_chunk(
                tool_calls=[
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "f", "arguments": ""},
                    }
                ]
            ),
            True,
        ),
        (chat_chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"a"'}}]), True),
        (chat_chunk(function_call={"arguments": "{"}), True),
        (chat_chunk(some_future_field="x"), True),
        (b'{"choices":[{"index":0,"delta":{},"logprobs":{"content":[{"token":"a"}]}}]}', True),
        (b'{"choices":[{"index":0,"delta":{},"token_ids":[17]}]}', True),
        (b'{"choices":[{"index":1,"text":"abc"}]}', True),
        (b'{"text":"x","meta_info":{"completion_tokens":1}}', True),
        (b'{"text":"","meta_info":{"completion_tokens":1}}', True),
        (b'{"text":"y","index":3,"meta_info":{}}', True),
        (b'{"output_ids":[5],"meta_info":{"completion_tokens":0}}', True),  # skip_tokenizer_init
        (b'{"type":"response.output_text.delta","delta":"Hi","item_id":"m"}', True),
        (
            b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}',
            True,
        ),
        # Not generated output.
        (chat_chunk(role="assistant"), False),
        (chat_chunk(role="assistant", content=""), False),
        (chat_chunk(content=None, reasoning=None), False),
        (chat_chunk(tool_calls=[{"index": 0, "id": "call_1", "type": "function"}]), False),
        (b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop","stop_reason":7}]}', False),
        (b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}', False),
        (
            b'{"id":"c","model":"m","prompt_token_ids":[1,2],"choices":[{"index":0,'
            b'"delta":{"role":"assistant"}}]}',
            False,
        ),
        (b'{"choices":[{"index":0,"text":""}]}', False),
        (b'{"error":{"message":"boom","code":400}}', False),
        (b'{"object":"error","message":"boom","code":400,"choices":[{"text":"x"}]}', False),
        (
            b'{"type":"response.created","response":{"status":"in_progress","instructions":"x"}}',
            False,
        ),
        (b'{"text":"","meta_info":{"completion_tokens":0,"id":"r","prompt_tokens":9}}', False),
        (b"[DONE]", False),
        (b"not json", False),
        (b"[1, 2]", False),
    ],
)
def test_generated_output_definition(payload: bytes, output: bool) -> None:
    assert read_payload(payload).output is output
    assert has_token(payload) is output


def test_every_string_and_key_is_read_with_a_path() -> None:
    r = read_payload(chat_chunk(index=2, content="\\u0041 raw", role="assistant"))
    got = dict(zip(r.paths, r.texts, strict=True))
    assert got[f"{SEP}choices{SEP}#2{SEP}delta{SEP}content"] == "\\u0041 raw"
    assert got[f"{SEP}choices{SEP}#2{SEP}delta{SEP}role"] == "assistant"
    assert got[f"{SEP}id"] == "c"
    assert "finish_reason" in got[KEYS_PATH]
    escaped = read_payload(b'{"choices":[{"index":0,"delta":{"content":"\\u0041\\n"}}]}')
    assert "A\n" in escaped.texts


def test_a_sequence_of_records_is_one_text_and_repeated_indexes_are_joined() -> None:
    lp = {"content": [{"token": "ab"}, {"token": "cd"}, {"token": "ef"}]}
    r = read_payload(orjson.dumps({"choices": [{"index": 0, "logprobs": lp}]}))
    assert "abcdef" in r.texts
    twice = b'{"choices":[{"index":0,"text":"ab"},{"index":0,"text":"cd"}]}'
    assert "abcd" in read_payload(twice).texts


def test_undecodable_payloads_are_read_raw_and_unescaped() -> None:
    r = read_payload(b'{"text": "\\u004bV", "bad": NaN}')
    assert r.texts[0] == '{"text": "\\u004bV", "bad": NaN}'
    assert '{"text": "KV", "bad": NaN}' in r.texts
    deep = b"[" * 1020 + b'"x"' + b"]" * 1020  # deeper than the interpreter recurses
    assert read_payload(deep).texts  # read raw, not an exception
    assert unescape('\\ud83d\\ude00 \\ud800 \\"') == '\U0001f600 \ufffd "'


def test_usage_prompt_tokens_are_read_once() -> None:
    r = read_payload(b'{"choices":[],"usage":{"prompt_tokens":5}}')
    assert r.prompt_tokens == 5
    assert read_payload(b'{"choices":[],"usage":{"prompt_tokens":"5"}}').prompt_tokens is None


def test_read_body_sse_labelled_as_json_yields_its_events() -> None:
    body = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\ndata: [DONE]'
    readings = read_body(body)
    assert readings[0].paths[0] == f"{SEP}raw"
    assert any("a" in r.texts for r in readings[1:])


@pytest.mark.parametrize(
    ("payload", "texts"),
    [
        (chat_chunk(role="assistant"), []),
        (chat_chunk(content="Hi", index=2), [(2, "Hi")]),
        (chat_chunk(reasoning="think"), [(0, "think")]),
        (
            chat_chunk(tool_calls=[{"index": 0, "function": {"name": "f", "arguments": '{"a"'}}]),
            [(0, "f"), (0, '{"a"')],
        ),
        (b'{"text":"y","index":3,"meta_info":{"id":"r"}}', [(3, "y")]),
        (b'{"error":{"message":"boom"}}', []),
        (b"not json", []),
    ],
)
def test_token_texts_are_the_generated_strings_per_choice(
    payload: bytes, texts: list[tuple[int, str]]
) -> None:
    assert token_texts(payload) == texts


def test_body_texts_shapes() -> None:
    chat = orjson.dumps({"choices": [{"index": 0, "message": {"role": "assistant",
        "content": "hello", "reasoning": "hmm",
        "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}}]})  # fmt: skip
    assert body_texts(chat) == ["hello", "hmm", "f", "{}"]
    assert body_texts(b'{"choices":[{"text":"done"},{"text":""}]}') == ["done"]
    assert body_texts(b'{"text":"gen","meta_info":{}}') == ["gen"]
    assert body_texts(b'[{"text":"a"},{"text":"b"}]') == ["a", "b"]
    assert body_texts(b'{"error":{"message":"x"}}') == []
    assert body_texts(b"plain \xff text") == ["plain \ufffd text"]
    assert body_texts(b"") == []


# --- the one-choice fast path reads exactly what the walk reads -------------------------

_KEYS = ["id", "object", "model", "created", "usage", "error", "system_fingerprint", "text",
         "content", "role", "finish_reason", "index", "delta", "logprobs", "type",
         "meta_info"]  # fmt: skip
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False, width=32)
    | st.sampled_from(["", "tok", "KVCANARY-acme-0123456789abcdef", "\x1f", "role"]),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(_KEYS[8:12]), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip
_CHOICE = st.dictionaries(
    st.sampled_from(_KEYS),
    st.one_of(_JSON, st.dictionaries(st.sampled_from(_KEYS), _JSON, max_size=4)),
    max_size=5,
)
_TOP = st.dictionaries(st.sampled_from(_KEYS), _JSON, max_size=5)


@pytest.mark.no_cover  # CPU-bound (~2x traced); the rest of the suite measures its lines
@settings(max_examples=600, deadline=None)
@given(
    top=_TOP,
    choices=st.lists(
        st.tuples(st.one_of(st.integers(0, 2), st.none(), st.just("0")), _CHOICE), max_size=2
    ),
    where=st.integers(0, 5),
)
def test_the_one_choice_fast_path_reads_what_the_walk_reads(
    top: dict[str, Any], choices: list[tuple[Any, dict[str, Any]]], where: int
) -> None:
    listed = [{"index": i, **c} if i is not None else c for i, c in choices]
    items = list(top.items())
    items.insert(min(where, len(items)), ("choices", listed))  # "choices" anywhere in order
    obj = dict(items)
    fast = output._one_choice_chunk(obj)
    walked = output._read_value(obj, None)
    if fast is None:
        return
    assert (fast.paths, fast.texts) == (walked.paths, walked.texts)
    assert (fast.output, fast.done, fast.error, fast.prompt_tokens) == (
        walked.output, walked.done, walked.error, walked.prompt_tokens
    )  # fmt: skip


def test_the_fast_path_takes_the_benchmark_and_engine_chunks() -> None:
    # The shapes it exists for: SGLang / vLLM token deltas, with a role-only first event,
    # and a non-streamed body with its usage.
    for delta in ({"content": "tok"}, {"role": "assistant", "content": ""}, {"reasoning": "r"}):
        obj = orjson.loads(chat_chunk(0, **delta))
        assert output._one_choice_chunk(obj) is not None
    message = {"role": "assistant", "content": "a"}
    body = {"id": "c", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1}}  # fmt: skip
    fast = output._one_choice_chunk(body)
    assert fast is not None
    assert fast.output
    assert fast.prompt_tokens == 3
    usage = {"choices": [], "usage": {"prompt_tokens": 3}}
    assert output._one_choice_chunk(usage) is None  # no choice: the walk reads it


_FLAT = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from(["", "tok", "KVCANARY-acme-0123456789abcdef", "\x1f", "assistant", "error"])
)


@settings(max_examples=600, deadline=None)
@given(
    top=st.dictionaries(
        st.sampled_from(_KEYS),
        _FLAT | st.dictionaries(st.sampled_from(_KEYS), _FLAT | st.just([1]), max_size=3),
        max_size=5,
    ),
    choice=st.dictionaries(st.sampled_from(_KEYS), _FLAT, max_size=3),
    inner=st.one_of(st.none(), st.tuples(st.sampled_from(_KEYS), st.dictionaries(
        st.sampled_from(_KEYS), _FLAT | st.just({}) | st.just([1]), max_size=4))),
    index=st.integers(0, 3),
    where=st.integers(0, 5),
)  # fmt: skip
def test_chunk_shaped_objects_read_the_same_on_both_paths(
    top: dict[str, Any],
    choice: dict[str, Any],
    inner: tuple[str, dict[str, Any]] | None,
    index: int,
    where: int,
) -> None:
    c = {**choice, "index": index}
    if inner is not None:
        c[inner[0]] = inner[1]
    items = [(k, v) for k, v in top.items() if k != "choices"]
    items.insert(min(where, len(items)), ("choices", [c]))
    obj = dict(items)
    fast = output._one_choice_chunk(obj)
    walked = output._read_value(obj, None)
    if fast is None:
        return
    assert (fast.paths, fast.texts) == (walked.paths, walked.texts)
    assert (fast.output, fast.done, fast.error, fast.prompt_tokens) == (
        walked.output, walked.done, walked.error, walked.prompt_tokens
    )  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    obj=st.recursive(
        st.none() | st.integers(-(2**40), 2**40) | st.text(max_size=6),
        lambda kids: st.lists(kids, max_size=3)
        | st.dictionaries(st.sampled_from(["usage", "prompt_tokens", "input_tokens", "x"]), kids,
                          max_size=3),
        max_leaves=8,
    ),
    escape=st.booleans(),
    spaced=st.booleans(),
)  # fmt: skip
def test_prompt_tokens_in_reads_what_the_full_reading_reads(
    obj: object, escape: bool, spaced: bool
) -> None:
    # json.dumps with indent: white space before every key, the other spelling a body has.
    data = json.dumps(obj, indent=1).encode() if spaced else orjson.dumps(obj)
    if escape:  # the key written with an escape is still the key
        data = data.replace(b'"usage"', b'"\\u0075sage"')
    assert usage.prompt_tokens_in(data) == output.read_payload(data).prompt_tokens


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # Decoded from the last key on: the members after it come along.
        (b'{"id":"x","usage":{"prompt_tokens":7},"kv_transfer_params":null}', 7),
        (b'{"usage":{"prompt_tokens":7},"choices":[{"usage":{"prompt_tokens":9}}]}', 7),
        # The last "usage" is nested (in a member after the top-level one): the whole body.
        (b'{"usage":{"prompt_tokens":7},"x":{"usage":{"prompt_tokens":9}}}', 7),
        (b'{"x":{"usage":{"prompt_tokens":9}}}', None),
        # A value spelled "usage", last, and an escaped quote before it inside a key.
        (b'{"usage":{"prompt_tokens":7},"type":"usage"}', 7),
        (b'{"x\\"usage":{"prompt_tokens":9}}', None),
        (b'{"x\\"usage":{"prompt_tokens":9},"usage":{"prompt_tokens":7}}', 7),
        # Duplicates: the last wins, as in the whole body, escaped or not.
        (b'{"usage":{"prompt_tokens":7},"\\u0075sage":{"prompt_tokens":8}}', 8),
        (b'{"\\u0075sage":{"prompt_tokens":8},"usage":{"prompt_tokens":7}}', 7),
        (b'{"usage":{"prompt_tokens":7},"usage":{"input_tokens":5}}', 5),
        # Text that quotes the key is escaped, so it is never the key.
        (b'{"text":"{\\"usage\\":{\\"prompt_tokens\\":9}}"}', None),
        (b'[{"usage":{"prompt_tokens":9}}]', None),
        (b'{"usage" : {"prompt_tokens" : 7}\n}', 7),
    ],
)
def test_prompt_tokens_in_reads_only_the_top_level_usage(body: bytes, expected: int | None) -> None:
    assert usage.prompt_tokens_in(body) == expected
    assert output.read_payload(body).prompt_tokens == expected
