"""Fuzzing the request parser: every route, every field, hostile bytes.

Property (see `hostile_support.check_parse`): `parse_request` returns a well-formed
`PromptShape` or raises a 400 `invalid_request` naming a problem without quoting the
request. Any other exception would be a 500 in the proxy, so hypothesis fails on it.
"""

from __future__ import annotations

import json

import pytest
from hostile_support import (
    FUZZ_EXAMPLES,
    HUGE_NUMBERS,
    NFC_EXPANDERS,
    ROUTES,
    SECRET,
    check_parse,
    dump,
    hostile_body,
    nested,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproxy.policy.errors import KvproxyError
from kvproxy.policy.routes import Route
from kvproxy.prompt import MAX_OUTPUT_TOKENS
from kvproxy.prompt.parse import parse_request

FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,  # no .hypothesis/ directory left behind in a shared checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(route=st.sampled_from(ROUTES), body=hostile_body)
def test_any_body_is_a_shape_or_a_400(route: Route, body: bytes) -> None:
    check_parse(route, body)


# --- targeted classes, each on every route -----------------------------------------------

WHERE = {
    # route -> JSON templates with one hole (%s) where a hostile value goes
    "chat": [
        b'{"messages":[{"role":"user","content":%s}]}',
        b'{"messages":[{"role":"user","content":"hi","metadata":%s}]}',
        b'{"messages":[{"role":"user","content":"hi","tool_calls":[{"function":{"arguments":%s}}]}]}',
        b'{"messages":[{"role":"user","content":"hi"}],"tools":[%s]}',
        b'{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"k":%s}}',
        b'{"messages":[{"role":"user","content":"hi"}],"documents":%s}',
        b'{"messages":%s}',
    ],
    "completions": [
        b'{"prompt":%s}',
        b'{"prompt":[%s]}',
        b'{"prompt":"hi","suffix":%s}',
    ],
    "generate": [
        b'{"text":%s}',
        b'{"input_ids":%s}',
        b'{"text":"hi","image_data":%s}',
        b'{"text":"hi","audio_data":%s}',
        b'{"text":"hi","video_data":%s}',
        b'{"text":"hi","sampling_params":%s}',
        b'{"text":"hi","sampling_params":{"max_new_tokens":%s}}',
    ],
}
CASES = [(route, hole) for route, holes in WHERE.items() for hole in holes]


@pytest.mark.parametrize(("route", "hole"), CASES)
@pytest.mark.parametrize("depth", [64, 253, 255, 500, 1000, 1023, 1024, 5000])
@pytest.mark.parametrize("kind", ["list", "dict"])
def test_deep_nesting_anywhere(route: Route, hole: bytes, depth: int, kind: str) -> None:
    # Python's recursion limit is 1000 frames; orjson stops parsing at 1024 and serialising
    # at 255: each depth around those edges must end in a shape or a 400.
    check_parse(route, hole % nested(depth, kind=kind))


@pytest.mark.parametrize(("route", "hole"), CASES)
@pytest.mark.parametrize("number", HUGE_NUMBERS)
def test_huge_and_odd_numbers_anywhere(route: Route, hole: bytes, number: bytes) -> None:
    check_parse(route, hole % number)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "field",
    [b"max_tokens", b"max_completion_tokens", b"n", b"best_of"],
)
@pytest.mark.parametrize("number", HUGE_NUMBERS)
def test_huge_numbers_in_the_size_fields(route: Route, field: bytes, number: bytes) -> None:
    body = (
        b'{"messages":[{"role":"user","content":"hi"}],"prompt":"hi","text":"hi",'
        b'"sampling_params":{"%s":%s},"%s":%s}' % (field.replace(b"max_tokens", b"max_new_tokens"),
                                                    number, field, number)
    )  # fmt: skip
    shape = check_parse(route, body)
    if shape is not None:
        assert shape.n <= 128


@pytest.mark.parametrize("route", ROUTES)
def test_gigantic_n_and_max_tokens_are_named(route: Route) -> None:
    for field, value, param in (
        ("n", 10**12, "n"),
        ("max_tokens", MAX_OUTPUT_TOKENS + 1, "max_tokens"),
        ("max_tokens", -1, "max_tokens"),
    ):
        if route == "generate":
            key = "max_new_tokens" if field == "max_tokens" else field
            body = dump({"text": "hi", "sampling_params": {key: value}})
            param = f"sampling_params.{key}"
        else:
            body = dump(
                {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", field: value}
            )
        with pytest.raises(KvproxyError) as exc:
            parse_request(route, body)
        assert exc.value.status == 400
        assert exc.value.param == param
    # The largest legal max_tokens parses; admission (not the parser) judges whether it fits.
    ok = dump({"messages": [{"role": "user", "content": "hi"}], "prompt": "hi",
               "text": "hi", "max_tokens": MAX_OUTPUT_TOKENS,
               "sampling_params": {"max_new_tokens": MAX_OUTPUT_TOKENS}})  # fmt: skip
    shape = check_parse(route, ok)
    assert shape is not None
    assert shape.max_output_tokens == MAX_OUTPUT_TOKENS


@pytest.mark.parametrize(("route", "hole"), CASES)
@pytest.mark.parametrize(
    "value",
    [
        b'"\\ud800"',  # lone high surrogate, escaped
        b'"\\udfff tail"',  # lone low surrogate, escaped
        b'"\xed\xa0\x80"',  # a surrogate encoded as UTF-8 bytes
        b'"\xff\xfe"',  # not UTF-8 at all
        b'"\xc0\xaf"',  # overlong encoding of "/"
        b'"caf\xc3"',  # truncated sequence
    ],
)
def test_surrogates_and_invalid_utf8_are_400(route: Route, hole: bytes, value: bytes) -> None:
    assert check_parse(route, hole % value) is None


@pytest.mark.parametrize("route", ROUTES)
def test_nfc_expanders_parse_as_text(route: Route) -> None:
    text = "".join(NFC_EXPANDERS) * 100 + SECRET
    body = dump({"messages": [{"role": "user", "content": text}], "prompt": text, "text": text})
    shape = check_parse(route, body)
    assert shape is not None
    assert any(text in seq.texts for seq in shape.prompts)


@pytest.mark.parametrize("route", ROUTES)
def test_non_object_bodies_are_400(route: Route) -> None:
    for body in (b"", b" ", b"null", b"[]", b'"x"', b"1", b"\x00", b"\xef\xbb\xbf{}", b"{" * 2000):
        assert check_parse(route, body) is None
    # A duplicated key is legal JSON: orjson keeps the last one, like the engines' parsers.
    shape = check_parse(route, b'{"n":1,"n":2,' + json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "text": "hi",
        "sampling_params": {"n": 2}}).encode()[1:])  # fmt: skip
    assert shape is not None
