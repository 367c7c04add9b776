"""SSE framing and generated-text extraction (kvproxy/sse.py)."""

from __future__ import annotations

import itertools

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproxy.sse import (
    SSEError,
    SSEParser,
    StreamTexts,
    body_texts,
    has_token,
    token_texts,
)


def chat_chunk(content: str | None = None, index: int = 0, **delta: object) -> bytes:
    d = dict(delta)
    if content is not None:
        d["content"] = content
    return orjson.dumps({"object": "chat.completion.chunk", "choices": [{"index": index,
                         "delta": d, "finish_reason": None}]})  # fmt: skip


def sse(*payloads: bytes, eol: bytes = b"\n") -> bytes:
    return b"".join(b"data: " + p + eol + eol for p in payloads)


STREAM = (
    b": keep-alive\n\n"
    + sse(chat_chunk(role="assistant"), chat_chunk("Hel"), chat_chunk("lo"))
    + b"event: message\nid: 7\ndata: line one\ndata: line two\n\n"
    + b"data:no-space\r\n\r\n"
    + b"data: cr-only\r\r"
    + b"data\n\n"
    + b"data: [DONE]\n\n"
)
EXPECTED = [
    chat_chunk(role="assistant"),
    chat_chunk("Hel"),
    chat_chunk("lo"),
    b"line one\nline two",
    b"no-space",
    b"cr-only",
    b"",
    b"[DONE]",
]


def test_whole_stream_parses_to_payloads() -> None:
    assert SSEParser().feed(STREAM) == EXPECTED


def test_split_at_every_byte_offset_gives_same_payloads() -> None:
    for cut in range(len(STREAM) + 1):
        p = SSEParser()
        got = p.feed(STREAM[:cut]) + p.feed(STREAM[cut:])
        assert got == EXPECTED, cut
        assert p.pending_bytes == 0


def test_byte_by_byte_feed() -> None:
    p = SSEParser()
    got: list[bytes] = []
    for i in range(len(STREAM)):
        got += p.feed(STREAM[i : i + 1])
    assert got == EXPECTED


@settings(max_examples=200, deadline=None)
@given(
    texts=st.lists(st.text(max_size=20), max_size=8),
    eol=st.sampled_from([b"\n", b"\r\n", b"\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=10),
)
def test_random_streams_and_random_splits(texts: list[str], eol: bytes, cuts: list[int]) -> None:
    payloads = [chat_chunk(t) for t in texts]
    stream = sse(*payloads, eol=eol)
    bounds = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    p = SSEParser()
    got: list[bytes] = []
    for a, b in itertools.pairwise(bounds):
        got += p.feed(stream[a:b])
    assert got == payloads


# Whole one-line events (the fast path's shape), mostly, mixed with every kind of line,
# line break and a BOM, so both parsers see the same awkward streams.
_EVENTS = st.sampled_from(
    [b"data: {}\n\n", b"data:b\n\n", b": ping\n\n", b"data\n\n", b"id: 1\n\n"]
)
_NOISE = st.sampled_from(
    [b"data: a", b": c", b"x", b"\n", b"\n\n", b"\r", b"\r\n", b"\xef\xbb\xbf", b"data: a\ndata: b"]
)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.one_of(_EVENTS, _EVENTS, _EVENTS, _NOISE), max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_whole_event_fast_path_agrees_with_the_line_parser(
    pieces: list[bytes], cuts: list[int]
) -> None:
    stream = b"".join(pieces)
    bounds = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    fast, general = SSEParser(), SSEParser()
    for a, b in itertools.pairwise(bounds):
        want = [ev.data for ev in general.feed_events(stream[a:b]) if ev.data is not None]
        assert fast.feed(stream[a:b]) == want
        assert fast.pending_bytes == general.pending_bytes


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(st.one_of(_EVENTS, _EVENTS, _EVENTS, _EVENTS, _NOISE), max_size=30),
    sizes=st.lists(st.integers(min_value=1, max_value=4), min_size=30, max_size=30),
)
def test_chunks_cut_at_event_ends_agree_with_the_line_parser(
    events: list[bytes], sizes: list[int]
) -> None:
    """Engines write whole events per chunk: the fast path's own ground."""
    chunks, i = [], 0
    for size in sizes:
        if i >= len(events):
            break
        chunks.append(b"".join(events[i : i + size]))
        i += size
    fast, general = SSEParser(), SSEParser()
    for chunk in chunks:
        want = [ev.data for ev in general.feed_events(chunk) if ev.data is not None]
        assert fast.feed(chunk) == want
        assert fast.pending_bytes == general.pending_bytes


def test_whole_events_in_one_chunk_take_the_fast_path() -> None:
    p = SSEParser()
    p.feed(b": hello\n\n")
    chunk = b"data: {}\n\n: ping\n\ndata:[DONE]\n\n"
    assert p._feed_whole_events(chunk) == [b"{}", b"[DONE]"]
    assert p._feed_whole_events(b"data: a\ndata: b\n\n") is None  # multi-line: general


def test_crlf_split_between_cr_and_lf_is_one_line_end() -> None:
    p = SSEParser()
    assert p.feed(b"data: a\r") == []
    assert p.feed(b"\n\r") == [b"a"]
    assert p.feed(b"\n") == []  # the \n pairs with the \r: no extra blank line
    assert p.feed(b"data: b\n\n") == [b"b"]


def test_comments_and_dataless_events_are_events_without_data() -> None:
    p = SSEParser()
    events = p.feed_events(b": ping\n\nevent: x\n\ndata: y\n\n")
    assert [e.data for e in events] == [None, None, b"y"]
    assert b"".join(e.raw for e in events) == b": ping\n\nevent: x\n\ndata: y\n\n"


def test_raw_events_reassemble_the_normalised_stream() -> None:
    p = SSEParser()
    raws = [e.raw for i in range(0, len(STREAM), 7) for e in p.feed_events(STREAM[i : i + 7])]
    assert b"".join(raws) == STREAM.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def test_leading_bom_is_dropped_once() -> None:
    p = SSEParser()
    assert p.feed(b"\xef\xbb\xbfdata: a\n\n") == [b"a"]
    assert p.feed(b"data: \xef\xbb\xbfb\n\n") == [b"\xef\xbb\xbfb"]


def test_incomplete_event_stays_pending() -> None:
    p = SSEParser()
    assert p.feed(b"data: a\n\ndata: partial") == [b"a"]
    assert p.pending_bytes == len(b"data: partial")


def test_event_larger_than_max_is_an_error_not_memory() -> None:
    p = SSEParser(max_event_bytes=64)
    assert p.feed(b"data: " + b"x" * 40 + b"\n\n") == [b"x" * 40]
    for _ in range(2):
        p.feed(b"data: " + b"y" * 20 + b"\n")  # one event, never ended: 56 bytes held
    with pytest.raises(SSEError):
        p.feed(b"data: " + b"y" * 20 + b"\n")
    with pytest.raises(SSEError):
        SSEParser(max_event_bytes=64).feed(b"z" * 65)


def test_many_events_in_one_chunk_keep_buffer_small() -> None:
    p = SSEParser(max_event_bytes=128)
    chunk = sse(*[chat_chunk("t") for _ in range(1000)])
    assert len(p.feed(chunk)) == 1000
    assert p.pending_bytes == 0


# --- generated text --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "texts", "token"),
    [
        (chat_chunk(role="assistant"), [], False),
        (chat_chunk("", role="assistant"), [], False),
        (chat_chunk("Hi"), [(0, "Hi")], True),
        (chat_chunk("Hi", index=2), [(2, "Hi")], True),
        (chat_chunk(reasoning_content="think"), [(0, "think")], True),
        (
            chat_chunk(tool_calls=[{"index": 0, "function": {"name": "f", "arguments": '{"a"'}}]),
            [(0, "f"), (0, '{"a"')],
            True,
        ),
        (chat_chunk(content=None), [], False),
        (b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}', [], False),
        (b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}', [], False),
        (b'{"choices":[{"index":1,"text":"abc"}]}', [(1, "abc")], True),
        (b'{"choices":[{"index":0,"text":""}]}', [], False),
        (b'{"error":{"message":"boom","code":400}}', [], False),
        (b'{"object":"error","message":"boom","code":400}', [], False),
        (b"[DONE]", [], False),
        (b"not json", [], False),
        (b"[1, 2]", [], False),
        (b'{"text":"x","meta_info":{"completion_tokens":1}}', [(0, "x")], True),
        (b'{"text":"","meta_info":{"completion_tokens":0}}', [], False),
        (b'{"text":"","meta_info":{"completion_tokens":1}}', [], True),
        (b'{"text":"y","index":3,"meta_info":{}}', [(3, "y")], True),
    ],
)
def test_token_texts_and_has_token(
    payload: bytes, texts: list[tuple[int, str]], token: bool
) -> None:
    assert token_texts(payload) == texts
    assert has_token(payload) is token


def test_done_and_error_flags() -> None:
    st_ = StreamTexts()
    assert st_.feed(b" [DONE] ").done
    assert st_.feed(b'{"error":{"message":"x"}}').error
    assert not st_.feed(chat_chunk("a")).error


def test_generate_cumulative_text_yields_only_the_new_part() -> None:
    st_ = StreamTexts()
    seq = ["The", "The cat", "The cat sat", "The cat sat"]
    got = [st_.feed(orjson.dumps({"text": t, "meta_info": {"completion_tokens": i + 1}}))
           for i, t in enumerate(seq)]  # fmt: skip
    assert [g.texts for g in got] == [[(0, "The")], [(0, " cat")], [(0, " sat")], []]
    assert [g.has_token for g in got] == [True, True, True, True]


def test_generate_incremental_text_is_taken_whole() -> None:
    st_ = StreamTexts()
    seq = ["ab", "cd", "abef", "g"]
    got = [st_.feed(orjson.dumps({"text": t, "meta_info": {}})).texts for t in seq]
    assert got == [[(0, "ab")], [(0, "cd")], [(0, "abef")], [(0, "g")]]


def test_generate_indexes_are_tracked_apart() -> None:
    st_ = StreamTexts()
    out = [
        st_.feed(orjson.dumps({"text": t, "index": i, "meta_info": {}})).texts
        for i, t in [(0, "a"), (1, "x"), (0, "ab"), (1, "xy")]
    ]
    assert out == [[(0, "a")], [(1, "x")], [(0, "b")], [(1, "y")]]


def test_body_texts_shapes() -> None:
    chat = orjson.dumps({"choices": [{"index": 0, "message": {"role": "assistant",
        "content": "hello", "reasoning_content": "hmm",
        "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}}]})  # fmt: skip
    assert body_texts(chat) == ["hello", "hmm", "f", "{}"]
    assert body_texts(b'{"choices":[{"text":"done"},{"text":""}]}') == ["done"]
    assert body_texts(b'{"text":"gen","meta_info":{}}') == ["gen"]
    assert body_texts(b'[{"text":"a"},{"text":"b"}]') == ["a", "b"]
    assert body_texts(b'{"error":{"message":"x"}}') == []
    assert body_texts(b"plain \xff text") == ["plain \ufffd text"]
    assert body_texts(b"") == []
    parts = b'{"choices":[{"message":{"content":[{"type":"text","text":"p1"}]}}]}'
    assert body_texts(parts) == ["p1"]
