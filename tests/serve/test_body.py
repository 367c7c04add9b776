"""Compressed request bodies: what is counted is what is forwarded, and the headers say so.

Ground truth is the fake upstream, started with auto_decompress=False so it records the
bytes exactly as kvproxy put them on the wire, next to the headers that travelled with them.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import zlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import aiohttp
import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtest import FakeUpstream, canary_settings, running_proxy, static_engines

from kvproxy.policy.errors import KvproxyError
from kvproxy.serve import body
from kvproxy.serve.body import read_arrived, read_raw

PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/generate",
}
PROMPTS: dict[str, dict[str, object]] = {
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hello"}]},
    "completions": {"model": "m", "prompt": "hello"},
    "generate": {"text": "hello"},
}


def raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-15)
    return c.compress(data) + c.flush()


@pytest.fixture
async def wire() -> AsyncIterator[FakeUpstream]:
    up = FakeUpstream(auto_decompress=False)

    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"id": "ok", "choices": []})

    up.route("*", "/{tail:.*}", ok)
    await up.start()
    yield up
    await up.close()


def _consistent(headers: dict[str, str], sent: bytes) -> bytes:
    """The body the upstream can read, decoding it the way its own headers say."""
    coding = headers.get("Content-Encoding", "").lower()
    if coding in ("gzip", "x-gzip"):
        return gzip.decompress(sent)
    if coding == "deflate":
        return zlib.decompress(sent, -15 if sent[:1] != b"\x78" else 15)
    assert coding in ("", "identity"), coding
    if "Content-Length" in headers:
        assert int(headers["Content-Length"]) == len(sent)
    return sent


# --- through the proxy ---------------------------------------------------------------------

ENCODERS = {
    "gzip": gzip.compress,
    "GZip": gzip.compress,
    "x-gzip": gzip.compress,
    "deflate": zlib.compress,
    "Deflate": raw_deflate,
    "identity": lambda b: b,
    "gzip, identity": gzip.compress,
    "identity, deflate": zlib.compress,
}


@pytest.mark.parametrize("route", list(PATHS))
@pytest.mark.parametrize("label", list(ENCODERS))
async def test_decodable_bodies_are_forwarded_decoded_with_the_header_removed(
    wire: FakeUpstream, http: aiohttp.ClientSession, route: str, label: str
) -> None:
    plain = orjson.dumps(PROMPTS[route])
    sent = ENCODERS[label](plain)
    headers = {"Content-Encoding": label, "Content-Type": "application/json"}
    async with (
        running_proxy(wire.url) as proxy,
        http.post(proxy.public_url + PATHS[route], data=sent, headers=headers) as resp,
    ):
        assert resp.status == 200, await resp.text()
    got = wire.received[0]
    # `identity` alone is left as sent: it is true of the bytes forwarded.
    assert got["headers"].get("Content-Encoding", "identity") == "identity"
    assert got["body"] == plain
    assert got["headers"]["Content-Length"] == str(len(plain))


async def test_the_decoded_prompt_is_what_is_counted(
    wire: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """20,000 characters compress to ~60 bytes: the count must be of the 20,000."""
    big = orjson.dumps({"model": "m", "prompt": "a" * 20_000})
    engines = static_engines(capacity=5_000)
    async with (
        running_proxy(wire.url, engines=engines) as proxy,
        http.post(
            proxy.public_url + PATHS["completions"],
            data=gzip.compress(big),
            headers={"Content-Encoding": "gzip"},
        ) as resp,
    ):
        assert resp.status == 400
        err = (await resp.json())["error"]
        assert err["code"] == "context_length_exceeded"
        assert err["prompt_tokens"] > 20_000
    assert wire.received == []


BROKEN = {
    "not gzip at all": b'{"prompt": "hello"}',
    "truncated": gzip.compress(b'{"prompt": "hello"}')[:-6],
    "garbage after the member": gzip.compress(b'{"prompt": "hello"}') + b"junk",
    "empty": b"",
}


@pytest.mark.parametrize("case", list(BROKEN))
@pytest.mark.parametrize("route", list(PATHS))
async def test_undecodable_bodies_are_400_naming_content_encoding(
    wire: FakeUpstream, http: aiohttp.ClientSession, case: str, route: str
) -> None:
    async with (
        running_proxy(wire.url) as proxy,
        http.post(
            proxy.public_url + PATHS[route],
            data=BROKEN[case],
            headers={"Content-Encoding": "gzip"},
        ) as resp,
    ):
        assert resp.status == 400
        doc = await resp.json()
    if route == "generate":
        assert list(doc) == ["error"]  # SGLang's native shape
        assert "Content-Encoding" in doc["error"]["message"]
    else:
        assert doc["error"]["param"] == "Content-Encoding"
    assert wire.received == []


@pytest.mark.parametrize(
    "label", ["br", "zstd", "compress", "x-compress", "snappy", "gzip, gzip", "deflate, gzip"]
)
async def test_codings_kvproxy_cannot_decode_are_415(
    wire: FakeUpstream, http: aiohttp.ClientSession, label: str
) -> None:
    async with (
        running_proxy(wire.url) as proxy,
        http.post(
            proxy.public_url + PATHS["chat"],
            data=gzip.compress(orjson.dumps(PROMPTS["chat"])),
            headers={"Content-Encoding": label},
        ) as resp,
    ):
        assert resp.status == 415
        assert resp.headers["Accept-Encoding"] == body.ACCEPT_ENCODING
        err = (await resp.json())["error"]
        assert err["code"] == "unsupported_content_encoding"
        assert err["param"] == "Content-Encoding"
    assert wire.received == []


async def test_a_zip_bomb_is_413_without_inflating_past_the_limit(
    wire: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    limit = 1024 * 1024
    bomb = gzip.compress(b'{"prompt": "' + b"a" * (8 * limit) + b'"}')
    assert len(bomb) < limit // 32
    async with (
        running_proxy(wire.url, max_body_bytes=limit) as proxy,
        http.post(
            proxy.public_url + PATHS["completions"],
            data=bomb,
            headers={"Content-Encoding": "gzip"},
        ) as resp,
    ):
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"
    assert wire.received == []


@pytest.mark.parametrize("path", ["/some/passthrough", "/v1/models", *PATHS.values()])
@pytest.mark.parametrize("label", ["gzip", "deflate", "identity"])
async def test_whatever_reaches_the_upstream_matches_its_headers(
    wire: FakeUpstream, http: aiohttp.ClientSession, path: str, label: str
) -> None:
    """Every path, counted or not: a forwarded body decodes the way its headers say. (A
    route kvproxy refuses, e.g. an unknown one answered 404, forwards nothing.)"""
    plain = orjson.dumps(PROMPTS["chat"] | PROMPTS["completions"] | {"text": "hi"})
    sent = ENCODERS[label](plain)
    async with (
        running_proxy(wire.url) as proxy,
        http.post(proxy.public_url + path, data=sent, headers={"Content-Encoding": label}) as resp,
    ):
        await resp.read()
    for got in wire.received:
        assert _consistent(got["headers"], got["body"]) == plain


# --- the decoder itself --------------------------------------------------------------------


def test_content_coding_names() -> None:
    assert body.content_coding([]) is None
    assert body.content_coding(["identity"]) is None
    assert body.content_coding([" GZIP "]) == "gzip"
    assert body.content_coding(["x-gzip"]) == "gzip"
    assert body.content_coding(["identity", "deflate"]) == "deflate"
    for bad in (["br"], ["gzip", "gzip"], ["gzip,br"], ["\u00e9"]):
        with pytest.raises(KvproxyError) as info:
            body.content_coding(bad)
        assert info.value.status == 415


@given(st.binary(max_size=4096), st.integers(min_value=1, max_value=4))
def test_gzip_members_round_trip(data: bytes, members: int) -> None:
    blob = b"".join(gzip.compress(data) for _ in range(members))
    assert body.inflate(blob, "gzip", 10**6) == data * members


@given(st.binary(max_size=4096))
def test_both_deflate_wrappers_round_trip(data: bytes) -> None:
    assert body.inflate(zlib.compress(data), "deflate", 10**6) == data
    assert body.inflate(raw_deflate(data), "deflate", 10**6) == data


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=512),
        st.binary(max_size=2048)
        .map(gzip.compress)
        .flatmap(lambda g: st.integers(0, len(g)).map(lambda k: g[:k] + b"\x00" * (k % 3))),
    ),
    st.sampled_from(["gzip", "deflate"]),
    st.integers(min_value=1, max_value=4096),
)
def test_any_bytes_decode_or_fail_with_4xx_within_the_limit(
    data: bytes, coding: str, limit: int
) -> None:
    status = 200
    try:
        out = body.inflate(data, coding, limit)
    except KvproxyError as err:
        status = err.status
    else:
        assert len(out) <= limit
    assert status in (200, 400, 413)


def test_inflating_stops_at_the_limit() -> None:
    with pytest.raises(KvproxyError) as info:
        body.inflate(gzip.compress(b"\0" * 100_001), "gzip", 100_000)
    assert info.value.status == 413
    assert body.inflate(gzip.compress(b"\0" * 100_000), "gzip", 100_000) == b"\0" * 100_000


# --- the answer's encoding: what the tripwire reads must be plain -------------------------


async def test_counted_routes_ask_the_upstream_for_an_uncompressed_answer(
    http: aiohttp.ClientSession,
) -> None:
    """An upstream that honours Accept-Encoding would gzip the answer, and the tripwire would
    scan compressed bytes: a foreign tenant's marker would reach the client unseen."""
    marker = "KVCANARY-canary-a-0123456789abcdef"
    up = FakeUpstream()

    async def compressing(request: web.Request) -> web.StreamResponse:
        payload = orjson.dumps({"id": "c", "choices": [{"message": {"content": marker}}]})
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            return web.Response(
                body=gzip.compress(payload),
                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
            )
        return web.Response(body=payload, content_type="application/json")

    up.route("POST", "/{tail:.*}", compressing)
    await up.start()
    try:
        async with (
            running_proxy(up.url, **canary_settings()) as proxy,
            http.post(
                proxy.public_url + PATHS["chat"],
                data=orjson.dumps(PROMPTS["chat"]),
                headers={"Accept-Encoding": "gzip, br", "X-Tenant-ID": "canary-b"},
            ) as resp,
        ):
            assert resp.status == 502
            assert marker.encode() not in await resp.read()
        assert up.received[0]["headers"]["Accept-Encoding"] == "identity"
    finally:
        await up.close()


async def test_bodies_that_could_inflate_far_are_decoded_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 64 KiB bomb inflating to 32 MiB took ~150 ms: on the loop it would stall every
    request. Only bodies of at most INLINE_INFLATE_BYTES (<= ~1 MiB of output) stay inline."""
    threads: list[int] = []
    real = body.inflate

    def recording(raw: bytes, coding: str, limit: int) -> bytes:
        threads.append(threading.get_ident())
        return real(raw, coding, limit)

    monkeypatch.setattr(body, "inflate", recording)
    small = gzip.compress(b"x" * 100)
    large = gzip.compress(bytes(range(256)) * 64, 0)  # stored blocks: > 1 KiB on the wire
    assert len(small) <= body.INLINE_INFLATE_BYTES < len(large)
    assert (await body.decode(small, "gzip", 10**6)).data == b"x" * 100
    assert (await body.decode(large, "gzip", 10**6)).data == bytes(range(256)) * 64
    loop_thread = threading.get_ident()
    assert threads[0] == loop_thread
    assert threads[1] != loop_thread


def _stream(*parts: bytes, eof: bool) -> Any:
    """A request whose body stream holds `parts` (and has ended, if `eof`)."""
    reader = aiohttp.StreamReader(mock.Mock(), 2**16, loop=asyncio.get_running_loop())
    for part in parts:
        reader.feed_data(part)
    if eof:
        reader.feed_eof()
    return SimpleNamespace(content=reader)


async def test_a_body_that_arrived_with_its_head_is_taken_without_waiting() -> None:
    assert read_arrived(_stream(b'{"prompt": ', b'"hi"}', eof=True), 100) == (
        b'{"prompt": "hi"}',
        True,
    )
    assert read_arrived(_stream(eof=True), 100) == (b"", True)  # no body at all
    with pytest.raises(KvproxyError) as exc:
        read_arrived(_stream(b"x" * 101, eof=True), 100)
    assert exc.value.status == 413


async def test_a_body_still_arriving_is_read_on_after_what_arrived() -> None:
    request = _stream(b'{"prompt": ', eof=False)
    first, whole = read_arrived(request, 100)
    assert (first, whole) == (b'{"prompt": ', False)
    request.content.feed_data(b'"hi"}')
    request.content.feed_eof()
    assert await read_raw(request, 100, first) == b'{"prompt": "hi"}'
    request = _stream(b"x" * 60, eof=False)
    first, _ = read_arrived(request, 100)
    request.content.feed_data(b"y" * 60)
    request.content.feed_eof()
    with pytest.raises(KvproxyError) as exc:
        await read_raw(request, 100, first)  # the limit counts what arrived first too
    assert exc.value.status == 413
