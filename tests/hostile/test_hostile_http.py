"""Hostile HTTP over raw sockets: slow uploads, request smuggling, oversized bodies.

Nothing here trusts a client library to form the request: the bytes are written by hand,
the way an attacker would. Ground truth is the fake upstream's record (what was forwarded),
the proxy's in-flight count (handlers freed) and tracemalloc (memory actually allocated).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import re
import shutil
import tracemalloc
import zlib
from pathlib import Path

import orjson
import pytest
from aiohttp import web
from kvtest import FakeUpstream, running_proxy, wait_until

CHAT = "/v1/chat/completions"
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
MIB = 1024 * 1024


def _ok_upstream(upstream: FakeUpstream) -> None:
    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"id": "ok", "choices": []})

    upstream.route("*", "/{tail:.*}", ok)


async def _read_answer(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """Everything the proxy sends until it closes or goes quiet (bounded)."""
    out = b""
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(timeout_s):
            while chunk := await reader.read(65536):
                out += chunk
    return out


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def _read_response(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """One response (head and Content-Length body), without waiting for the close."""
    async with asyncio.timeout(timeout_s):
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return head + await reader.readexactly(length)


# --- slowloris ---------------------------------------------------------------------------


async def _trickle(port: int, head: bytes, piece: bytes, max_pieces: int = 500) -> bytes:
    """Send `head`, then `piece` every 20 ms until the proxy answers or closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        for _ in range(max_pieces):  # bounded: ~10 s of trickling at most
            try:
                writer.write(piece)
                await writer.drain()
            except ConnectionError:
                return b"<closed>"
            try:
                got = await asyncio.wait_for(reader.read(65536), 0.02)
            except TimeoutError:
                continue
            except ConnectionError:
                # A close with bytes still unread on the proxy's side is a reset, not a FIN:
                # cut off all the same.
                return b"<closed>"
            return got or b"<closed>"
        return b""
    finally:
        await _close(writer)


SLOW_UPLOADS = {
    "content-length": (
        b"POST %s HTTP/1.1\r\nHost: a\r\nContent-Length: 100000\r\n\r\n{" % CHAT.encode(),
        b" ",
    ),
    "chunked": (
        b"POST %s HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
        % CHAT.encode(),
        b"1\r\n \r\n",
    ),
}


@pytest.mark.parametrize("kind", list(SLOW_UPLOADS))
async def test_slowloris_body_gets_408_and_frees_the_handler(
    upstream: FakeUpstream, kind: str
) -> None:
    _ok_upstream(upstream)
    await upstream.start()
    head, piece = SLOW_UPLOADS[kind]
    async with running_proxy(upstream.url, body_read_timeout_s=0.3) as proxy:
        answers = await asyncio.gather(
            *(_trickle(proxy.public_port, head, piece) for _ in range(8))
        )
        for answer in answers:
            assert answer, "the proxy never answered nor closed"
            if answer != b"<closed>":
                head_, _, body = answer.partition(b"\r\n\r\n")
                assert head_.startswith(b"HTTP/1.1 408"), answer[:200]
                assert orjson.loads(body)["error"]["code"] == "request_timeout"
        assert await wait_until(lambda: proxy.state.inflight == 0)
        assert proxy.metrics.rejections.labels("body_read_timeout", "default")._value.get() == 8
        # Still serving.
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.public_port)
        writer.write(
            b"POST %s HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % (CHAT.encode(), len(BODY))
            + BODY
        )
        assert (await _read_answer(reader, 10)).startswith(b"HTTP/1.1 200")
        await _close(writer)
    assert [r["body"] for r in upstream.received] == [BODY]


async def test_headers_then_silence_gets_408(upstream: FakeUpstream) -> None:
    _ok_upstream(upstream)
    await upstream.start()
    async with running_proxy(upstream.url, body_read_timeout_s=0.3) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.public_port)
        writer.write(b"POST %s HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\n" % CHAT.encode())
        answer = await _read_response(reader, 10)
        assert answer.startswith(b"HTTP/1.1 408")
        assert b'"code":"request_timeout"' in answer
        # The rest of this body can never frame a request: the connection is not reused
        # (aiohttp still lingers up to 10 s discarding what arrives, then closes).
        assert b"Connection: close" in answer
        await _close(writer)
        assert await wait_until(lambda: proxy.state.inflight == 0)
    assert upstream.received == []


async def test_slow_headers_are_cut_off(upstream: FakeUpstream) -> None:
    # aiohttp has no header-read timeout of its own; kvproxy closes connections whose first
    # request head is not complete within header_read_timeout_s.
    await upstream.start()
    async with running_proxy(upstream.url, header_read_timeout_s=0.3) as proxy:
        # One header value growing a byte at a time stays under every size limit.
        head = b"POST %s HTTP/1.1\r\nHost: a\r\nX-A: " % CHAT.encode()
        answer = await _trickle(proxy.public_port, head, b"a", 150)
        assert proxy.state.inflight == 0
    assert answer  # an answer or a close within ~3 s (15 x the body timeout)


# --- request smuggling ---------------------------------------------------------------------

SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n"
_P = b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: a\r\n"
SMUGGLING = {
    "cl_and_te": _P
    + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    + SMUGGLED,
    "te_and_cl": _P
    + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n"
    + SMUGGLED,
    "two_lengths": _P + b"Content-Length: %d\r\nContent-Length: 0\r\n\r\n" % len(BODY) + BODY,
    "length_list": _P + b"Content-Length: %d, 0\r\n\r\n" % len(BODY) + BODY,
    "length_plus": _P + b"Content-Length: +%d\r\n\r\n" % len(BODY) + BODY,
    "obs_fold": _P + b"X-A: a\r\n b\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY,
    "obs_fold_te": _P
    + b"Transfer-Encoding:\r\n chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n"
    + SMUGGLED,
    "te_unknown": _P + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "te_chunked_not_last": _P + b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "te_twice": _P + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n0\r\n\r\n",
    "space_before_colon": _P + b"Transfer-Encoding : chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
    "chunk_size_0x": _P + b"Transfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
    "chunk_size_huge": _P + b"Transfer-Encoding: chunked\r\n\r\nfffffffffffffffffffff\r\nhi\r\n",
    "chunk_size_negative": _P + b"Transfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n",
    "bare_lf": b"POST %s HTTP/1.1\nHost: a\nContent-Length: %d\n\n" % (CHAT.encode(), len(BODY))
    + BODY,
    "nul_in_header": _P + b"X-A: a\x00b\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY,
    "cr_in_header": _P + b"X-A: a\rb\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY,
    "userinfo_target": b"POST @evil.invalid%s HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n"
    % (CHAT.encode(), len(BODY))
    + BODY,
    "header_too_long": b"GET /x HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
}


@pytest.mark.parametrize("name", list(SMUGGLING))
async def test_smuggling_attempts_are_400_and_never_forwarded(
    upstream: FakeUpstream, name: str
) -> None:
    _ok_upstream(upstream)
    await upstream.start()
    async with running_proxy(upstream.url) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.public_port)
        writer.write(SMUGGLING[name])
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        answer = await _read_answer(reader, 3)
        await _close(writer)
        statuses = re.findall(rb"(?:^|\r\n)(HTTP/1\.[01] \d{3})", answer)
        # One 400 and nothing after it: no second (smuggled) request was answered. (aiohttp's
        # 400 text quotes the offending line; the pattern only matches real status lines.)
        assert statuses in ([b"HTTP/1.0 400"], [b"HTTP/1.1 400"]), answer[:300]
        assert await wait_until(lambda: proxy.state.inflight == 0)
    assert upstream.received == []


async def test_absolute_form_targets_go_to_the_upstream_only(upstream: FakeUpstream) -> None:
    """`POST http://evil/...` and `//evil/...` must not become requests to another host:
    the first is counted and reaches our upstream as a path on it; the second (an empty
    segment, not a route) is refused by the route allowlist and reaches nothing."""
    _ok_upstream(upstream)
    await upstream.start()
    answers = []
    async with running_proxy(upstream.url) as proxy:
        for target in (b"http://evil.invalid" + CHAT.encode(), b"//evil.invalid/x"):
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.public_port)
            writer.write(
                b"POST %s HTTP/1.1\r\nHost: evil.invalid\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n" % (target, len(BODY)) + BODY
            )
            answers.append(await _read_answer(reader, 10))
            await _close(writer)
    assert answers[0].startswith(b"HTTP/1.1 200"), answers[0][:200]
    assert answers[1].startswith(b"HTTP/1.1 404"), answers[1][:200]
    assert b"route_not_found" in answers[1]
    assert [r["path"] for r in upstream.received] == [CHAT]


# --- memory ----------------------------------------------------------------------------------

CURL = shutil.which("curl")


async def _curl_upload(url: str, path: Path, chunked: bool) -> tuple[str, bytes]:
    assert CURL is not None
    args = [CURL, "-sS", "--max-time", "60", "-o", "-", "-w", "\n%{http_code}", "-H", "Expect:"]
    if chunked:
        args += ["-H", "Transfer-Encoding: chunked"]
    args += ["-H", "Content-Type: application/json", "--data-binary", f"@{path}", url]
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 90)
    body, _, code = out.rpartition(b"\n")
    return code.decode(), body


@pytest.mark.skipif(CURL is None, reason="curl is not installed")
@pytest.mark.parametrize(
    ("chunked", "limit_mib", "peak_bound_mib"),
    [
        # Declared 40 MiB over a 32 MiB limit: refused on the header, the body is never read.
        (False, 32, 4),
        # Chunked: counted as it arrives and refused once past the limit, 8 of 40 MiB held.
        (True, 8, 24),
    ],
)
async def test_oversized_body_is_413_without_buffering_it(
    upstream: FakeUpstream, tmp_path: Path, chunked: bool, limit_mib: int, peak_bound_mib: int
) -> None:
    _ok_upstream(upstream)
    await upstream.start()
    path = tmp_path / "big.json"
    with path.open("wb") as f:
        f.write(b'{"model":"m","messages":[{"role":"user","content":"')
        for _ in range(40):
            f.write(b"a" * MIB)
        f.write(b'"}]}')
    async with running_proxy(upstream.url, max_body_bytes=limit_mib * MIB) as proxy:
        was_tracing = tracemalloc.is_tracing()
        if not was_tracing:
            tracemalloc.start()
        tracemalloc.reset_peak()
        try:
            code, body = await _curl_upload(proxy.public_url + CHAT, path, chunked)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            if not was_tracing:
                tracemalloc.stop()
        assert code == "413", body[:300]
        assert orjson.loads(body)["error"]["code"] == "request_too_large"
        # The curl upload runs in another process: the peak is the proxy's (and the test's).
        assert peak < peak_bound_mib * MIB, f"peak {peak / MIB:.1f} MiB"
        assert await wait_until(lambda: proxy.state.inflight == 0)
    assert upstream.received == []


async def test_shutting_down_answer_really_closes_the_connection(upstream: FakeUpstream) -> None:
    """A keep-alive client that sends during the drain gets 503 `Connection: close`, and the
    connection is closed, so it reconnects to a replica that is not going away."""
    release = asyncio.Event()

    async def stall(request: web.Request) -> web.StreamResponse:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(release.wait(), 20)
        return web.json_response({"id": "late", "choices": []})

    upstream.route("POST", CHAT, stall)
    upstream.route("GET", "/v1/models", lambda request: _models())
    await upstream.start()
    async with running_proxy(upstream.url, shutdown_grace_s=30) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.public_port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: a\r\n\r\n")
        assert (await _read_response(reader, 10)).startswith(b"HTTP/1.1 200")
        held = asyncio.ensure_future(_exchange(proxy.public_port, _post_head()))
        assert await wait_until(lambda: len(upstream.received) == 2)
        stopping = asyncio.ensure_future(proxy.stop())
        try:
            assert await wait_until(lambda: proxy.state.stopping)
            writer.write(_post_head())
            answer = await _read_response(reader, 10)
            assert answer.startswith(b"HTTP/1.1 503")
            assert b'"code":"shutting_down"' in answer
            assert b"Connection: close" in answer
            assert await asyncio.wait_for(reader.read(), 25) == b""
            # Closed by the answer itself, not by the hard stop at the end of the grace period.
            assert not proxy.state.hard_stop.done()
        finally:
            release.set()
            await asyncio.wait_for(stopping, 30)
            await _close(writer)
        # The request in flight when the drain began was let finish.
        assert (await asyncio.wait_for(held, 10)).startswith(b"HTTP/1.1 200")
    assert len(upstream.received) == 2


async def _models() -> web.StreamResponse:
    return web.json_response({"data": []})


async def _exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await _read_response(reader, 30)
    finally:
        await _close(writer)


def _post_head() -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n"
        % (
            CHAT.encode(),
            len(BODY),
        )
        + BODY
    )


# --- compressed bodies, written by hand ------------------------------------------------------


def _chunked(data: bytes, size: int = 4096) -> bytes:
    out = b"".join(
        b"%x\r\n%s\r\n" % (len(data[i : i + size]), data[i : i + size])
        for i in range(0, len(data), size)
    )
    return out + b"0\r\n\r\n"


async def test_a_chunked_gzip_upload_is_counted_and_forwarded_decoded(
    upstream: FakeUpstream,
) -> None:
    _ok_upstream(upstream)
    await upstream.start()
    body = gzip.compress(BODY)
    async with running_proxy(upstream.url) as proxy:
        answer = await _exchange(
            proxy.public_port,
            b"POST %s HTTP/1.1\r\nHost: a\r\ncontent-encoding: GZip\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" % CHAT.encode() + _chunked(body, 7),
        )
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    (got,) = upstream.received
    assert got["body"] == BODY
    assert "Content-Encoding" not in got["headers"]


async def test_a_zip_bomb_is_413_and_memory_stays_near_the_limit(upstream: FakeUpstream) -> None:
    """64 MiB of zeros in ~64 KiB of gzip, uploaded chunked under a 4 MiB body limit: the
    proxy inflates at most the limit, never the bomb."""
    _ok_upstream(upstream)
    await upstream.start()
    limit = 4 * MIB
    zeros = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = b"".join(zeros.compress(b"\0" * MIB) for _ in range(64)) + zeros.flush()
    assert len(bomb) < limit // 16
    async with running_proxy(upstream.url, max_body_bytes=limit) as proxy:
        was_tracing = tracemalloc.is_tracing()
        if not was_tracing:
            tracemalloc.start()
        tracemalloc.reset_peak()
        try:
            answer = await _exchange(
                proxy.public_port,
                b"POST %s HTTP/1.1\r\nHost: a\r\nContent-Encoding: gzip\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" % CHAT.encode() + _chunked(bomb),
            )
            _, peak = tracemalloc.get_traced_memory()
        finally:
            if not was_tracing:
                tracemalloc.stop()
        assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
        assert b'"code":"request_too_large"' in answer
        assert peak < 4 * limit, f"peak {peak / MIB:.1f} MiB"
    assert upstream.received == []


# --- the request head (#31.6) and the client's address (#31.5) ------------------------------


def _head_with(fields: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n" % (CHAT.encode(), len(BODY))
        + fields
        + b"\r\n"
        + BODY
    )


HEADS = {
    # The case: under aiohttp's per-line (8,190) and count (128) limits, 939 KiB.
    "120 fields of 8 KB": b"".join(b"X-Big-%d: %s\r\n" % (i, b"v" * 8000) for i in range(120)),
    "101 small fields": b"".join(b"X-Small-%d: 1\r\n" % i for i in range(99)),
    "61 KiB in 8 fields": b"".join(b"X-Mid-%d: %s\r\n" % (i, b"v" * 7900) for i in range(8)),
}


@pytest.mark.parametrize("name", list(HEADS))
async def test_a_request_head_past_its_bounds_is_431_and_never_forwarded(
    upstream: FakeUpstream, name: str
) -> None:
    _ok_upstream(upstream)
    await upstream.start()
    async with running_proxy(upstream.url) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.public_port)
        writer.write(_head_with(HEADS[name]))
        await writer.drain()
        answer = await _read_response(reader, 10)
        await _close(writer)
        assert proxy.metrics.rejections.labels("request_head", "default")._value.get() == 1
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), head
    error = orjson.loads(body)["error"]
    assert error["code"] == "request_header_fields_too_large"
    assert "KVPROXY_MAX_REQUEST_HEAD" in error["message"]
    assert upstream.received == []


async def test_a_request_head_within_its_bounds_is_forwarded(upstream: FakeUpstream) -> None:
    _ok_upstream(upstream)
    await upstream.start()
    fields = b"".join(b"X-F-%d: %s\r\n" % (i, b"v" * 500) for i in range(97))  # 100 fields
    async with running_proxy(upstream.url) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.public_port)
        writer.write(_head_with(fields))
        await writer.drain()
        answer = await _read_response(reader, 10)
        await _close(writer)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert len(upstream.received) == 1


SPOOFED = (
    b"X-Forwarded-For: 6.6.6.6, 1.2.3.4\r\nForwarded: for=6.6.6.6\r\nX-Real-IP: 6.6.6.6\r\n"
    b"X-Forwarded-Proto: https\r\n"
)


@pytest.mark.parametrize(
    ("hops", "sent_for"),
    [(None, "6.6.6.6, 1.2.3.4, 127.0.0.1"), (0, "127.0.0.1"), (1, "1.2.3.4, 127.0.0.1")],
)
async def test_x_forwarded_for_names_the_peer_after_the_trusted_hops(
    upstream: FakeUpstream, hops: int | None, sent_for: str
) -> None:
    _ok_upstream(upstream)
    await upstream.start()
    async with running_proxy(upstream.url, forwarded_trusted_hops=hops) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.public_port)
        writer.write(_head_with(SPOOFED))
        await writer.drain()
        assert (await _read_response(reader, 10)).startswith(b"HTTP/1.1 200")
        await _close(writer)
    seen = {k.lower(): v for k, v in upstream.received[0]["headers"].items()}
    assert seen["x-forwarded-for"] == sent_for
    others = {"forwarded", "x-real-ip", "x-forwarded-proto"}
    assert others.isdisjoint(seen) if hops == 0 else others <= set(seen)


PARSER_REFUSALS = {
    "300 fields": b"".join(b"X-F-%d: 1\r\n" % i for i in range(300)),
    "a 20 KB field": b"Authorization: Bearer S3CRET-" + b"t" * 20000 + b"\r\n",
    "a field without a colon": b"X-No-Colon S3CRET\r\n",
}


@pytest.mark.parametrize("name", list(PARSER_REFUSALS))
async def test_what_aiohttp_cannot_parse_is_a_json_400_that_quotes_nothing(
    upstream: FakeUpstream, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    _ok_upstream(upstream)
    await upstream.start()
    caplog.set_level(logging.DEBUG)
    async with running_proxy(upstream.url) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.public_port)
        writer.write(_head_with(PARSER_REFUSALS[name]))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        answer = await _read_answer(reader, 5)
        await _close(writer)
    head, _, body = answer.partition(b"\r\n\r\n")
    # HTTP/1.0: aiohttp answers in the oldest version when the request line did not parse.
    assert head.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")), answer[:300]
    assert b"application/json" in head
    assert orjson.loads(body)["error"]["code"] == "malformed_request"
    assert b"S3CRET" not in answer
    assert "S3CRET" not in caplog.text
    assert upstream.received == []
