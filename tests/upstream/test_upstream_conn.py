"""One upstream connection (kvproxy/upstream/connection.py) fed bytes by hand on a transport double
(tests/upstream/upstream_doubles.py), the way uvicorn tests its protocols: every framing
case, the bounds on a response head and its trailers, interim responses, and a response that
comes while the request body is still going out. No sockets; the real-socket cases (pool
limits, keep-alive sweeps, timeouts, connect errors) are in test_upstream.py."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Iterator

import pytest
from multidict import CIMultiDict
from upstream_doubles import URL, Wire, make_pool

from kvproxy.upstream import UpstreamProtocolError
from kvproxy.upstream.boundary import classify
from kvproxy.upstream.pool import DEFAULT_MAX_HEAD_BYTES

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Up: 1\r\n\r\nok"


def pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)] or [b""]


SPLITS = [0, 1, 3, 7]  # 0: one read; else reads of that many bytes


def feed(wire: Wire, data: bytes, split: int) -> None:
    wire.feed(*(pieces(data, split) if split else [data]))


# --- framing -------------------------------------------------------------------------------


@pytest.mark.parametrize("split", SPLITS)
async def test_a_length_framed_response_is_read_whole_and_the_connection_reused(
    split: int,
) -> None:
    pool = make_pool()
    wire = Wire(pool)
    head = wire.send("POST", "/v1/chat?x=1", b"{}", X_Request_ID="r1")
    assert bytes(wire.transport.written) == (
        b"POST /v1/chat?x=1 HTTP/1.1\r\nHost: upstream.test\r\nX_Request_ID: r1\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )
    feed(wire, OK, split)
    got = wire.outcome(head)
    assert (got.status, got.reason, got.body, got.complete) == (200, b"OK", b"ok", True)
    assert (b"x-up", b"1") in got.headers
    assert wire.release(head)
    await pool.close()


@pytest.mark.parametrize("split", SPLITS)
async def test_chunked_body_and_its_trailers(split: int) -> None:
    pool = make_pool()
    wire = Wire(pool)
    head = wire.send()
    feed(
        wire,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n"
        b"6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n",
        split,
    )
    got = wire.outcome(head)
    assert (got.body, got.complete) == (b"hello world", True)
    assert b"x-trailer" not in dict(got.headers)  # read and dropped, never relayed
    assert wire.release(head)
    await pool.close()


async def test_a_close_delimited_body_ends_at_the_close_and_a_reset_is_no_end() -> None:
    pool = make_pool()
    wire = Wire(pool)
    head = wire.send()
    wire.feed(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil ", b"the end")
    assert not wire.outcome(head).complete
    wire.fin()
    got = wire.outcome(head)
    assert (got.body, got.complete) == (b"until the end", True)
    assert not wire.release(head)

    wire = Wire(pool)
    head = wire.send()
    wire.feed(b"HTTP/1.1 200 OK\r\n\r\ncut")
    wire.reset()
    got = wire.outcome(head)
    assert isinstance(got.error, ConnectionResetError)
    await pool.close()


async def test_head_ends_at_its_headers_and_204_has_no_body() -> None:
    pool = make_pool()
    wire = Wire(pool)
    head = wire.send("HEAD")
    wire.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
    got = wire.outcome(head)
    assert (got.body, got.complete, dict(got.headers)[b"content-length"]) == (b"", True, b"1000")
    assert not wire.release(head)  # a HEAD's connection is not trusted again

    wire = Wire(pool)
    head = wire.send("DELETE", "/x")
    wire.feed(b"HTTP/1.1 204 No Content\r\n\r\n")
    got = wire.outcome(head)
    assert (got.status, got.body, got.complete) == (204, b"", True)
    assert wire.release(head)
    await pool.close()


@pytest.mark.parametrize("split", SPLITS)
async def test_interim_responses_are_skipped(split: int) -> None:
    pool = make_pool()
    wire = Wire(pool)
    head = wire.send("POST", body=b"x")
    feed(
        wire,
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 102 Processing\r\nContent-Length: 0\r\n\r\n" + OK,
        split,
    )
    got = wire.outcome(head)
    assert (got.status, got.body) == (200, b"ok")
    assert b"link" not in dict(got.headers)
    assert wire.release(head)
    await pool.close()


INTERIM_BODIES = {
    # llhttp reads a body for 104-199 (the case): it would reach the client first.
    "199 with a length": b"HTTP/1.1 199 Odd\r\nContent-Length: 24\r\n\r\n"
    b"the interim body, 24 byt" + OK,
    "150 chunked": b"HTTP/1.1 150 Odd\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    + OK,
    # llhttp reads no body for 100-103, h11 none for any 1xx: the next bytes would be read
    # as a response by one and as a body by the other.
    "103 with a length": b"HTTP/1.1 103 Hints\r\nContent-Length: 5\r\n\r\n" + OK,
}


@pytest.mark.parametrize("name", list(INTERIM_BODIES))
@pytest.mark.parametrize("split", SPLITS)
async def test_an_interim_response_that_frames_a_body_is_refused(name: str, split: int) -> None:
    pool = make_pool()
    wire = Wire(pool)
    head = wire.send()
    feed(wire, INTERIM_BODIES[name], split)
    got = wire.outcome(head)
    assert isinstance(got.error, UpstreamProtocolError), got
    assert "interim" in str(got.error)
    assert got.body == b""  # no byte of either response is handed on
    assert wire.transport.aborted
    await pool.close()


UNREADABLE = {
    "garbage": b"garbage\r\n\r\n",
    "bad length": b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
    "switching protocols": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\n\r\n",
    "two lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
    "length and chunked": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    # Transfer codings llhttp reads (or frames as close-delimited) and h11 refuses: the body
    # would reach the client still coded, past the tripwire.
    "gzip then chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
    b"2\r\nok\r\n0\r\n\r\n",
    "chunked then gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\nok",
    "gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nok",
    "chunked twice": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "chunked and a comma": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked,\r\n\r\n"
    b"2\r\nok\r\n0\r\n\r\n",
    "status 099": b"HTTP/1.1 099 Low\r\nContent-Length: 0\r\n\r\n",
    "status 600": b"HTTP/1.1 600 High\r\nContent-Length: 0\r\n\r\n",
    "NUL in the reason": b"HTTP/1.1 200 O\x00K\r\nContent-Length: 0\r\n\r\n",
    "not UTF-8": b"HTTP/1.1 200 OK\r\nX-Name: caf\xe9\r\nContent-Length: 0\r\n\r\n",
    "folded": b"HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\nContent-Length: 0\r\n\r\n",
    "bare LF": b"HTTP/1.1 200 OK\nContent-Length: 0\n\n",
    "chunk size overflow": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"fffffffffffffffffffff\r\nhi\r\n",
}


@pytest.mark.parametrize("name", list(UNREADABLE))
async def test_unreadable_responses_are_protocol_errors_and_drop_the_connection(
    name: str,
) -> None:
    pool = make_pool()
    wire = Wire(pool)
    head = wire.send()
    wire.feed(UNREADABLE[name])
    got = wire.outcome(head)
    assert isinstance(got.error, UpstreamProtocolError), got
    assert classify(got.error) == "protocol"
    assert wire.transport.aborted
    await asyncio.sleep(0)
    assert pool.open_connections == 0
    await pool.close()


async def test_header_values_lose_trailing_whitespace_and_keep_utf8() -> None:
    pool = make_pool()
    wire = Wire(pool)
    head = wire.send()
    wire.feed(b"HTTP/1.1 200 OK\r\nX-A: a b \t\r\nX-B: caf\xc3\xa9\r\nContent-Length: 0\r\n\r\n")
    got = wire.outcome(head)
    assert dict(got.headers)[b"x-a"] == b"a b"
    assert head.result().headers["X-B"] == "café"
    await pool.close()


async def test_a_second_response_to_one_request_drops_the_connection() -> None:
    pool = make_pool()
    wire = Wire(pool)
    head = wire.send()
    wire.feed(OK + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nextra")
    got = wire.outcome(head)
    assert (got.body, got.complete) == (b"ok", True)  # whole; the rest is not its body
    assert wire.transport.aborted
    assert not wire.release(head)
    await pool.close()


async def test_bytes_with_no_request_outstanding_drop_an_idle_connection() -> None:
    pool = make_pool()
    wire = Wire(pool)
    head = wire.send()
    wire.feed(OK)
    assert wire.release(head)
    wire.feed(b"HTTP/1.1 200 OK\r\n")
    await asyncio.sleep(0)
    assert wire.transport.aborted
    assert pool.idle_connections == 0
    await pool.close()


async def test_a_close_mid_body_or_before_the_head_is_a_reset() -> None:
    pool = make_pool()
    wire = Wire(pool)
    head = wire.send()
    wire.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten..")
    wire.fin()
    got = wire.outcome(head)
    assert got.body == b"only ten.."
    assert isinstance(got.error, ConnectionResetError)
    assert classify(got.error) == "reset"

    wire = Wire(pool)
    head = wire.send()
    wire.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n")
    wire.fin()  # the last CRLF never came
    assert isinstance(wire.outcome(head).error, ConnectionResetError)

    wire = Wire(pool)
    head = wire.send()
    wire.fin()
    assert isinstance(wire.outcome(head).error, ConnectionResetError)
    await pool.close()


# --- the head's bound (#31.3) ---------------------------------------------------------------


def head_of(size: int) -> bytes:
    """A response head of exactly `size` bytes (status line, padding field, blank line)."""
    start = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Pad: "
    return start + b"p" * (size - len(start) - 4) + b"\r\n\r\n"


@pytest.mark.parametrize("split", [0, 1, 5, 1000])
async def test_a_head_of_exactly_the_bound_is_read_and_one_byte_more_is_refused(
    split: int,
) -> None:
    pool = make_pool(max_head_bytes=2048)
    wire = Wire(pool)
    head = wire.send()
    feed(wire, head_of(2048) + b"ok", split)
    assert wire.outcome(head).body == b"ok"

    wire = Wire(pool)
    head = wire.send()
    feed(wire, head_of(2049) + b"ok", split)
    got = wire.outcome(head)
    assert isinstance(got.error, UpstreamProtocolError)
    assert "head over 2048 bytes" in str(got.error)
    await pool.close()


async def test_interim_heads_count_towards_the_bound() -> None:
    pool = make_pool(max_head_bytes=2048)
    wire = Wire(pool)
    head = wire.send()
    interim = b"HTTP/1.1 103 Early Hints\r\nLink: </" + b"a" * 1000 + b">\r\n\r\n"  # 1,035 bytes
    wire.feed(interim, interim, OK)
    assert "head over" in str(wire.outcome(head).error)
    await pool.close()


def endless(piece: bytes, total: int) -> Iterator[bytes]:
    for _ in range(total // len(piece)):
        yield piece


HUGE_HEADS = {
    # The three: 10,000 header lines (1.1 MB), a 1 MiB reason, a 16 MiB head.
    "10,000 header lines": (b"HTTP/1.1 200 OK\r\n", b"X-Header-Line: 123456789012\r\n" * 1000, 10),
    "a 1 MiB reason": (b"HTTP/1.1 200 ", b"r" * 65536, 16),
    "a 16 MiB head": (b"HTTP/1.1 200 OK\r\nX-Big: ", b"v" * 65536, 256),
}


@pytest.mark.parametrize("name", list(HUGE_HEADS))
async def test_a_huge_head_is_refused_with_memory_flat(name: str) -> None:
    start, piece, count = HUGE_HEADS[name]
    pool = make_pool()
    wire = Wire(pool)
    head = wire.send()
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    try:
        wire.feed(start)
        fed = 0
        for chunk in endless(piece, len(piece) * count):
            if wire.conn.closed:
                break
            wire.feed(chunk)
            fed += len(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        if not was_tracing:
            tracemalloc.stop()
    got = wire.outcome(head)
    assert isinstance(got.error, UpstreamProtocolError), got
    # Refused within one read past the bound, holding about the bound at most.
    assert fed <= DEFAULT_MAX_HEAD_BYTES + len(piece)
    assert peak - base < 4 * DEFAULT_MAX_HEAD_BYTES + 2 * len(piece), peak - base
    await pool.close()


async def test_header_fields_past_the_count_are_refused() -> None:
    pool = make_pool(max_headers=100)
    for count, ok in ((100, True), (101, False)):
        wire = Wire(pool)
        head = wire.send()
        wire.feed(
            b"HTTP/1.1 200 OK\r\n" + b"X-A: 1\r\n" * (count - 1) + b"Content-Length: 0\r\n\r\n"
        )
        got = wire.outcome(head)
        assert got.failed is not ok, got
    await pool.close()


@pytest.mark.parametrize("split", [0, 1, 4096])
async def test_trailers_are_bounded_like_a_head(split: int) -> None:
    pool = make_pool(max_head_bytes=2048)
    body = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"
    wire = Wire(pool)
    head = wire.send()
    feed(wire, body + b"X-T: " + b"t" * 1500 + b"\r\n\r\n", split)
    assert wire.outcome(head).complete

    wire = Wire(pool)
    head = wire.send()
    # The size line ends one read; the endless trailer comes in the reads after it.
    wire.feed(body)
    trailer = b"X-T: " + b"t" * 100_000
    feed(wire, trailer, split or len(trailer))
    got = wire.outcome(head)
    assert isinstance(got.error, UpstreamProtocolError), got
    assert "trailers over 2048 bytes" in str(got.error)

    wire = Wire(pool)
    head = wire.send()
    feed(wire, body + b"X-T: 1\r\n" * 101 + b"\r\n", split)
    assert "trailer fields" in str(wire.outcome(head).error)
    await pool.close()


async def test_a_chunk_size_line_ending_a_read_is_not_taken_for_trailers() -> None:
    pool = make_pool(max_head_bytes=1024)
    wire = Wire(pool)
    head = wire.send()
    big = b"d" * 5000
    wire.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1388\r\n", big)
    wire.feed(b"\r\n1388\r\n", big + b"\r\n", b"0\r\n\r\n")
    got = wire.outcome(head)
    assert (got.body, got.complete) == (big * 2, True)
    await pool.close()


# --- a response while the body is going out (#31.4) -----------------------------------------


async def test_an_early_answer_stops_the_upload_and_the_connection_is_not_reused() -> None:
    pool = make_pool()
    wire = Wire(pool, idle=True)
    wire.transport.full_after = 300 * 1024  # the socket fills during the second piece
    body = b"b" * (12 * 1024 * 1024)
    sending = asyncio.ensure_future(pool.request(URL, "POST", "/", CIMultiDict(), body))
    await asyncio.sleep(0)
    assert not sending.done()  # waiting for the socket to drain
    wire.feed(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 7\r\n\r\ntoo big")
    resp = await asyncio.wait_for(sending, 5)
    assert resp.status == 413
    assert await resp.readany() == b"too big"
    assert len(wire.transport.written) < len(body)  # the rest was never sent
    resp.release()
    await asyncio.sleep(0)
    assert pool.idle_connections == 0
    assert wire.transport.aborted
    await pool.close()


async def test_an_upload_the_upstream_stops_taking_times_out() -> None:
    pool = make_pool(send_timeout_s=0.05)
    wire = Wire(pool, idle=True)
    wire.transport.full_after = 1
    with pytest.raises(TimeoutError, match="took no request bytes") as info:
        await asyncio.wait_for(
            pool.request(URL, "POST", "/", CIMultiDict(), b"b" * (1024 * 1024)), 10
        )
    assert classify(info.value) == "timeout"
    await asyncio.sleep(0)
    assert wire.transport.aborted
    await pool.close()


async def test_an_upload_that_drains_goes_out_whole() -> None:
    pool = make_pool()
    wire = Wire(pool, idle=True)
    wire.transport.full_after = 1
    body = bytes(range(256)) * 4096  # 1 MiB: four pieces
    sending = asyncio.ensure_future(pool.request(URL, "POST", "/", CIMultiDict(), body))
    for _ in range(10):
        await asyncio.sleep(0)
        wire.transport.buffered = 0
        wire.conn.resume_writing()
    wire.feed(OK)
    resp = await asyncio.wait_for(sending, 5)
    assert bytes(wire.transport.written).endswith(body)
    assert await resp.readany() == b"ok"
    resp.release()
    assert pool.idle_connections == 1
    await pool.close()


async def test_request_bytes_the_upstream_never_took_keep_the_connection_out_of_the_pool() -> None:
    pool = make_pool()
    wire = Wire(pool)
    head = wire.send("POST", body=b"x" * 1000)
    wire.transport.buffered = 600  # still in the kernel's hands when the answer came
    wire.feed(OK)
    assert not wire.release(head)
    await pool.close()
