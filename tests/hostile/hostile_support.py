"""Hostile inputs shared by the fuzz suites: hypothesis strategies and the one property
every answer must satisfy.

The strategies aim where parsers break: wrong types in every known field, numbers past
int32/int64/double, deep nesting, escaped lone surrogates, raw invalid UTF-8, characters
that NFC normalization expands, and gigantic `n` / `max_tokens`. A planted SECRET string
lets a test prove error messages never quote request text (I8).
"""

from __future__ import annotations

import json
import os
from typing import Any

from hypothesis import strategies as st

from kvproxy.policy.errors import KvproxyError
from kvproxy.policy.routes import Route
from kvproxy.prompt import MAX_N, MAX_OUTPUT_TOKENS, PromptShape
from kvproxy.prompt.parse import parse_request

SECRET = "S3CRET-prompt-text"
# Examples per fuzz test: 100 in `make test` (seeded in CI, so the same 100 each run), 1000
# in `make test-slow`, which reruns tests/hostile with KVPROXY_FUZZ_EXAMPLES=1000. The 100
# keep every property checked in the fast suite at a third of the former 300's time.
FUZZ_EXAMPLES = int(os.environ.get("KVPROXY_FUZZ_EXAMPLES", "100"))
ROUTES: tuple[Route, ...] = ("chat", "completions", "generate")
PATHS: dict[Route, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/generate",
}
# U+1D160 grows 1 -> 3 code points under NFC, U+0F73 and U+0344 decompose; U+0301 combines.
NFC_EXPANDERS = ("\U0001d160", "\u0f73", "\u0344", "e\u0301", "\u1e9b\u0323", "\ufb2c")
HUGE_NUMBERS = (
    b"-1",
    b"0",
    b"2147483647",
    b"2147483648",
    b"9223372036854775808",
    b"18446744073709551616",
    b"123456789012345678901234567890",
    b"1e308",
    b"1e400",
    b"-1e400",
    b"3.5",
    b"1.0",
    b"NaN",
    b"Infinity",
    b"true",
    b'"7"',
    b"[]",
    b"{}",
    b"null",
)
REQUEST_KEYS = (
    "model",
    "messages",
    "tools",
    "functions",
    "chat_template_kwargs",
    "documents",
    "add_generation_prompt",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "best_of",
    "stream",
    "prompt",
    "suffix",
    "text",
    "input_ids",
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "sampling_params",
)
NUMBER_KEYS = ("max_tokens", "max_completion_tokens", "n", "best_of")

hostile_text = st.one_of(
    st.text(max_size=24),
    st.just(SECRET),
    st.lists(st.sampled_from(NFC_EXPANDERS), min_size=1, max_size=40).map("".join),
    # Lone surrogates: json.dumps escapes them as \\udXXX, which no UTF-8 engine accepts.
    st.text(alphabet=st.characters(categories=["Cs", "Ll"]), min_size=1, max_size=6),
)
json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    hostile_text,
)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(hostile_text, inner, max_size=4),
    max_leaves=16,
)

content_part = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            ["text", "input_text", "refusal", "image_url", "input_audio", "video", "bogus"]
        )
        | json_value
    },
    optional={"text": hostile_text | json_value, "refusal": hostile_text | json_value},
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | json_value},
    optional={
        "content": hostile_text | st.lists(content_part | hostile_text, max_size=3) | json_value,
        "name": hostile_text | json_value,
        "reasoning_content": hostile_text | json_value,
        "tool_call_id": hostile_text | json_value,
        "metadata": json_value,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "id": hostile_text | json_value,
                    "type": st.just("function") | json_value,
                    "function": st.fixed_dictionaries(
                        {}, optional={"name": hostile_text, "arguments": hostile_text | json_value}
                    )
                    | json_value,
                },
            ),
            max_size=2,
        )
        | json_value,
    },
)
number = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, MAX_N, MAX_N + 1, MAX_OUTPUT_TOKENS, MAX_OUTPUT_TOKENS + 1, 10**12]),
    st.floats(allow_nan=False, allow_infinity=False),
    json_value,
)
# Requests shaped like the real thing, with any field possibly wrong.
near_valid = st.fixed_dictionaries(
    {"model": st.just("m")},
    optional={
        "messages": st.lists(message, min_size=0, max_size=3) | json_value,
        "prompt": hostile_text
        | st.lists(hostile_text, max_size=3)
        | st.lists(st.integers(-5, 2**64), max_size=5)
        | st.lists(st.lists(st.integers(-5, 200), max_size=3), max_size=3)
        | json_value,
        "text": hostile_text | st.lists(hostile_text, max_size=3) | json_value,
        "input_ids": st.lists(st.integers(-5, 2**64), max_size=5) | json_value,
        "image_data": json_value,
        "audio_data": json_value,
        "sampling_params": st.fixed_dictionaries(
            {}, optional={"max_new_tokens": number, "n": number}
        )
        | st.lists(st.fixed_dictionaries({}, optional={"max_new_tokens": number}), max_size=3)
        | json_value,
        "tools": st.lists(json_value, max_size=3) | json_value,
        "chat_template_kwargs": json_value,
        "documents": json_value,
        "add_generation_prompt": json_value,
        "stream": st.booleans() | json_value,
        "max_tokens": number,
        "max_completion_tokens": number,
        "n": number,
        "best_of": number,
        "suffix": hostile_text | json_value,
        "input_embeds": json_value,
    },
)
any_object = st.dictionaries(st.sampled_from(REQUEST_KEYS) | hostile_text, json_value, max_size=6)


def dump(obj: Any) -> bytes:
    """JSON with big ints intact and lone surrogates escaped (orjson refuses both)."""
    return json.dumps(obj, ensure_ascii=True).encode("ascii")


@st.composite
def corrupted(draw: st.DrawFn, base: st.SearchStrategy[Any]) -> bytes:
    """A body that starts valid-looking and is damaged at the byte level."""
    body = bytearray(dump(draw(base)))
    how = draw(st.sampled_from(["truncate", "invalid_utf8", "raw_surrogate", "number", "flip"]))
    pos = draw(st.integers(0, len(body)))
    if how == "truncate":
        del body[pos:]
    elif how == "invalid_utf8":
        body[pos:pos] = draw(st.sampled_from([b"\xff", b"\xc3", b"\xc0\xaf", b"\xf8\x88\x80"]))
    elif how == "raw_surrogate":
        body[pos:pos] = b"\xed\xa0\x80"  # a UTF-8-encoded surrogate: invalid UTF-8
    elif how == "number":
        key = draw(st.sampled_from(NUMBER_KEYS))
        value = draw(st.sampled_from(HUGE_NUMBERS))
        return b'{"model":"m","messages":[{"role":"user","content":"hi"}],"prompt":"hi",' + (
            b'"text":"hi","sampling_params":{"max_new_tokens":%s},"%s":%s}'
            % (value, key.encode(), value)
        )
    elif body:
        i = min(pos, len(body) - 1)
        body[i] = draw(st.integers(0, 255))
    return bytes(body)


hostile_body = st.one_of(
    near_valid.map(dump),
    any_object.map(dump),
    json_value.map(dump),
    corrupted(near_valid),
    st.binary(max_size=64),
)


def nested(depth: int, leaf: bytes = b'"x"', kind: str = "list") -> bytes:
    if kind == "list":
        return b"[" * depth + leaf + b"]" * depth
    return b'{"a":' * depth + leaf + b"}" * depth


def check_invalid_request(err: KvproxyError) -> None:
    assert err.status == 400, err
    assert err.code == "invalid_request", err
    assert err.message
    assert SECRET not in err.message
    assert err.param is None or SECRET not in err.param
    err.body("openai")  # serialisable in both shapes
    err.body("sglang")


def check_parse(route: Route, body: bytes) -> PromptShape | None:
    """The parser's contract: a well-formed shape or a 400 naming a problem, nothing else."""
    try:
        shape = parse_request(route, body)
    except KvproxyError as exc:
        check_invalid_request(exc)
        return None
    assert shape.route == route
    assert shape.prompts
    assert 1 <= shape.n <= MAX_N
    assert shape.max_output_tokens is None or 0 <= shape.max_output_tokens <= MAX_OUTPUT_TOKENS
    assert shape.body_bytes == len(body)
    for seq in shape.prompts:
        assert seq.token_ids >= 0
        for text in seq.texts:
            text.encode("utf-8")  # strict: nothing an engine could not decode got through
    return shape
