"""SSE framing and generated-text extraction (kvproxy/response/sse.py)."""

from __future__ import annotations

import itertools

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproxy.response.sse import SSEError, SSEParser


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
    other: list[bytes] = []
    assert p._feed_whole_events(chunk, other) == [b"{}", b"[DONE]"]
    assert other == [b": ping"]
    assert p._feed_whole_events(b"data: a\ndata: b\n\n", other) is None  # multi-line
    assert other == []


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


# --- what may be forwarded, and the lines a client sees besides data --------------------


def test_forward_holds_an_event_until_it_is_whole() -> None:
    """A marker in the first half of an event must not reach the client before the event
    has been scanned: only whole events are forwardable."""
    p = SSEParser()
    first = p.feed_chunk(b'data: {"a": "KVCAN')
    assert (first.payloads, first.forward) == ([], b"")
    second = p.feed_chunk(b'ARY"}\n\ndata: {"b"')
    assert second.payloads == [b'{"a": "KVCANARY"}']
    assert second.forward == b'data: {"a": "KVCANARY"}\n\n'
    assert p.take_pending() == b'data: {"b"'
    assert p.pending_bytes == 0


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.one_of(_EVENTS, _EVENTS, _NOISE), max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_forwarded_bytes_are_the_whole_events_of_the_normalised_stream(
    pieces: list[bytes], cuts: list[int]
) -> None:
    stream = b"".join(pieces)
    bounds = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    p, reference = SSEParser(), SSEParser()
    for a, b in itertools.pairwise(bounds):
        want = b"".join(e.raw for e in reference.feed_events(stream[a:b]))
        assert p.feed_chunk(stream[a:b]).forward == want


def test_comments_and_other_fields_are_reported_for_scanning() -> None:
    for chunks in ([b": c1\n\nevent: e\nid: 7\ndata: x\n\n"], [b": c1\n", b"\nevent: e\n"]):
        p = SSEParser()
        p.feed(b"data: start\n\n")
        other = [line for c in chunks for line in p.feed_chunk(c).other]
        assert other[:2] == [b": c1", b"event: e"]
