"""kvproxy.prompt.sliced: a body parsed in steps is `orjson.loads` of it, value or error.

Ground truth is orjson itself, one call on the whole body. The slice sizes are shrunk so that
bodies of a few kilobytes are cut in many places (inside and around escapes, surrogate pairs
and multi-byte characters), and each test also checks the sliced path really ran (not its
one-call fallback) where it should.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproxy.policy import KvproxyError
from kvproxy.prompt import load_json, load_json_in_steps, parse_request, sliced


@pytest.fixture(autouse=True)
def small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sliced, "SLICE_BYTES", 23)
    monkeypatch.setattr(sliced, "LONG_LITERAL_BYTES", 16)
    monkeypatch.setattr(sliced, "STEP_ITEMS", 3)


def run(steps: Any) -> tuple[Any, int]:
    """Drive a generator of steps to its value; (value, number of hand-backs)."""
    n = 0
    try:
        while True:
            next(steps)
            n += 1
    except StopIteration as done:
        return done.value, n


def outcome(fn: Any, body: bytes) -> tuple[str, Any]:
    try:
        return "value", fn(body)
    except orjson.JSONDecodeError as exc:
        return "error", (str(exc), exc.pos)


def sliced_only(body: bytes) -> Any:
    """The sliced path alone: raises AssertionError if it would fall back to one call."""
    try:
        return run(sliced._sliced(body))[0]
    except sliced._Whole:
        raise AssertionError("fell back to one call") from None


def same(body: bytes) -> None:
    assert outcome(lambda b: run(sliced.loads(b))[0], body) == outcome(orjson.loads, body)


TEXTS = [
    "plain ascii prose, " * 20,
    'line\nbreaks\tand "quotes" and back\\slashes\\\\ ' * 10,
    "中文文本 日本語の 한국어 naïve café " * 10,
    "emoji 👩‍💻✨😀 and astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 " * 10,
    ("\\" * 5 + "x" + "\\" * 2 + '"') * 20,
    "\u2028\u2029\x00\x01\x1f controls " * 10,
    "".join(chr(c) for c in range(0x20, 0x3000, 7)),
]


@pytest.mark.parametrize("ensure_ascii", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_chat_bodies_decode_in_slices_to_orjsons_value(text: str, ensure_ascii: bool) -> None:
    doc = {
        "model": "m",
        "max_tokens": 3,
        "messages": [
            {"role": "system", "content": text[::-1]},
            {"role": "user", "content": [{"type": "text", "text": text}]},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "description": text}}],
    }
    # json.dumps with ensure_ascii writes every non-ASCII character as \uXXXX (surrogate
    # pairs for astral ones): text with an escape every six bytes.
    body = json.dumps(doc, ensure_ascii=ensure_ascii).encode()
    assert sliced_only(body) == orjson.loads(body) == doc
    value, handbacks = run(sliced.loads(body))
    assert value == doc
    assert handbacks > 3  # it was cut, and the loop had its turns


def test_the_loop_gets_a_turn_at_least_every_slice() -> None:
    body = orjson.dumps({"messages": [{"role": "user", "content": "abc def " * 1000}]})
    _, handbacks = run(sliced.loads(body))
    assert handbacks >= len(body) // sliced.SLICE_BYTES - 1


@pytest.mark.parametrize(
    "body",
    [
        b'{"messages": [{"role": "user", "content": "' + b"a" * 100 + b'"}]',  # truncated
        b'{"a": "' + b"a" * 50 + b"\xff" + b"b" * 50 + b'"}',  # invalid UTF-8 in a literal
        b'{"a": "' + b"a" * 50 + b"\xe4\xb8" + b'"}',  # a UTF-8 sequence cut short
        b'{"a": "' + b"a" * 50 + b"\\ud83d" + b"b" * 50 + b'"}',  # a lone surrogate
        b'{"a": "' + b"a" * 50 + b"\\x41" + b"b" * 50 + b'"}',  # not an escape
        b'{"a": "' + b"a" * 50 + b"\x01" + b"b" * 50 + b'"}',  # a raw control character
        b'{"a": "' + b"a" * 50 + b'" "b": 1}',  # a missing comma after a long literal
        b'{"' + b"k" * 60 + b'": 1}',  # a long key
        b'["' + b"a" * 60 + b'", 2]',  # not an object
        b'"' + b"a" * 60 + b'"',
        b'{"a": "' + b"a" * 60 + b'", "a": "' + b"b" * 60 + b'"}',  # a duplicate key
        b'{"a": "' + b"a" * 60 + b'", "b": "kvproxy-sliced-literal-0"}',  # the marker itself
        b'{"a": "' + b"a" * 60 + b'"} trailing',
        b'{"a": "' + b"\\\\" * 80 + b'"}',  # only escaped backslashes: no boundary to cut at
        b'{"a": "' + b"a" * 60,  # unterminated
        b"",
    ],
)
def test_malformed_and_odd_bodies_give_orjsons_own_answer(body: bytes) -> None:
    same(body)


def test_the_marker_in_a_body_is_never_taken_for_a_literal() -> None:
    body = orjson.dumps({"a": "x" * 60, "b": "kvproxy-sliced-literal-0"})
    assert run(sliced.loads(body))[0] == {"a": "x" * 60, "b": "kvproxy-sliced-literal-0"}


# The marker's text reached through escapes: the byte check cannot see it, the parsed
# skeleton holds it. As a value, a key, twice, and a long literal a duplicate key drops.
ESCAPED_MARK = b'"kvproxy-sliced-literal\\u002d0"'
LONG = b'"' + b"x" * 60 + b'"'


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": ' + ESCAPED_MARK + b', "a": ' + LONG + b"}",
        b'{"a": ' + LONG + b', "model": ' + ESCAPED_MARK + b"}",
        b'{"a": ' + LONG + b", " + ESCAPED_MARK + b": 1}",
        b"[" + LONG + b", " + ESCAPED_MARK + b", " + ESCAPED_MARK + b"]",
        b'{"a": ' + LONG + b', "a": "short"}',
        b'{"a": ' + LONG + b', "b": {"c": [' + ESCAPED_MARK + b"]}}",
    ],
    ids=["value-before", "value-after", "key", "twice", "dropped-by-duplicate", "nested"],
)
def test_a_string_that_decodes_to_a_marker_is_parsed_as_one_call_would(
    body: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The escaped marker (31 bytes) must be a short literal, kept in the skeleton.
    monkeypatch.setattr(sliced, "LONG_LITERAL_BYTES", 40)
    same(body)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(value=json_values, ensure_ascii=st.booleans(), cut=st.integers(0, 10_000))
def test_any_json_and_any_corruption_of_it_parse_as_one_call_would(
    value: Any, ensure_ascii: bool, cut: int
) -> None:
    body = json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
    same(body)
    if body:
        i = cut % len(body)
        same(body[:i] + b'"\\\x80'[cut % 3 : cut % 3 + 1] + body[i + 1 :])
        same(body[:i])


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_shape_from_the_stepped_parse_is_the_shape_of_the_body(route: str) -> None:
    text = 'Résumé 😀 "quoted"\n' * 40
    doc: dict[str, Any] = {"model": "m", "max_tokens": 7, "n": 2}
    if route == "chat":
        doc["messages"] = [
            {"role": "user", "content": text},
            {"role": "assistant", "content": text},
        ]
    else:
        doc["prompt"] = [text, text[::-1]]
    body = orjson.dumps(doc)
    data, _ = run(load_json_in_steps(body))
    assert parse_request(route, body, data) == parse_request(route, body)  # type: ignore[arg-type]


@pytest.mark.parametrize("body", [b'{"a": "' + b"a" * 60 + b'"', b'["' + b"a" * 60 + b'"]', b"{"])
def test_the_stepped_parse_refuses_with_load_jsons_400(body: bytes) -> None:
    with pytest.raises(KvproxyError) as one:
        load_json(body)
    with pytest.raises(KvproxyError) as stepped:
        run(load_json_in_steps(body))
    assert (stepped.value.status, stepped.value.message, stepped.value.param) == (
        one.value.status,
        one.value.message,
        one.value.param,
    )
