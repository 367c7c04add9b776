"""The relay through the real app with fake upstreams (kvproxy/serve/relay.py): the tripwire on
fields beyond content (#15.1), the drain and TTFT on a reasoning-only stream (#24.4), and
the error shape of every upstream failure on `/generate` (#15.7; SGLang's native shape,
#33.3)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from kvtest import FakeUpstream, canary_settings, running_proxy, wait_until
from ports import free_port

from kvproxy.policy import errors
from kvproxy.response import inspector, sse

CHAT = "/v1/chat/completions"
GENERATE = "/generate"
FOREIGN = "KVCANARY-canary-a-0123456789abcdef"  # canary-a's marker; the client is canary-b
B_TENANT = {"X-Tenant-ID": "canary-b"}


def event(obj: Any, escape: str = "") -> bytes:
    """One SSE event; the characters of `escape` written as \\uXXXX escapes."""
    text = orjson.dumps(obj).decode()
    if escape:
        text = text.replace(escape, "".join(f"\\u{ord(c):04x}" for c in escape))
    return b"data: " + text.encode() + b"\n\n"


def ended_with(status: int, body: bytes) -> dict[str, Any]:
    """The error a response ended in: a JSON error (nothing had been relayed yet) or the
    stream's last event (it had started). Which one depends on how reads coalesce."""
    if status != 200:
        data: dict[str, Any] = orjson.loads(body)
    else:
        data = orjson.loads(body.split(b"data: ")[-2])
    return data


def reasoning(text: str, **delta: Any) -> dict[str, Any]:
    return {"id": "c", "choices": [{"index": 0, "delta": {"reasoning": text, **delta}}]}


def streaming(chunks: list[bytes], gate: asyncio.Event | None = None, after: int = 1) -> Any:
    """A handler that writes `chunks`, waiting for `gate` before chunk number `after`."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, c in enumerate(chunks):
            if gate is not None and i == after:
                await asyncio.wait_for(gate.wait(), 10)
            await resp.write(c)
        await resp.write_eof()
        return resp

    return handler


def chat_body(stream: bool = True) -> bytes:
    return orjson.dumps({"model": "m", "stream": stream, "messages": [{"role": "user",
                         "content": "hi"}]})  # fmt: skip


def generate_body(stream: bool = True) -> bytes:
    return orjson.dumps({"text": "hi", "stream": stream, "sampling_params": {"max_new_tokens": 4}})


# --- tripwire -------------------------------------------------------------------------


async def test_marker_in_reasoning_split_and_escaped_is_withheld(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    head, rest = FOREIGN[:12], FOREIGN[12:]
    chunks = [
        event(reasoning("", role="assistant")),
        event(reasoning("thinking " + head), escape=head),
        event(reasoning(rest + " more")),
        event(reasoning("never sent")),
        b"data: [DONE]\n\n",
    ]
    upstream.route("POST", CHAT, streaming(chunks))
    await upstream.start()
    async with running_proxy(upstream.url, **canary_settings()) as proxy:
        async with http.post(proxy.public_url + CHAT, data=chat_body(), headers=B_TENANT) as r:
            got = await r.read()
        assert proxy.metrics.canary_violations.labels("canary-b")._value.get() == 1
    assert b"never sent" not in got
    assert rest.encode() not in got  # the event that completed the marker never left
    assert ended_with(r.status, got)["error"]["code"] == "canary_violation"


async def test_marker_in_the_reasoning_of_a_body_is_a_502(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    message = {"content": "fine", "reasoning": "recalling " + FOREIGN}  # vLLM's name for it
    body = {"choices": [{"index": 0, "message": message}]}
    text = orjson.dumps(body).decode().replace("KVC", "\\u004bVC").encode()

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=text, content_type="application/json")

    upstream.route("POST", CHAT, handler)
    await upstream.start()
    async with running_proxy(upstream.url, **canary_settings()) as proxy:
        async with http.post(
            proxy.public_url + CHAT, data=chat_body(stream=False), headers=B_TENANT
        ) as r:
            assert r.status == 502
            assert (await r.json())["error"]["code"] == "canary_violation"


async def test_generate_meta_info_marker_ends_the_stream_in_sglang_shape(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    meta = {"completion_tokens": 1, "output_token_logprobs": [[-0.1, 7, FOREIGN]]}
    chunks = [
        event({"text": "a", "meta_info": {"completion_tokens": 1}}),
        event({"text": "ab", "meta_info": meta}),
        b"data: [DONE]\n\n",
    ]
    upstream.route("POST", GENERATE, streaming(chunks))
    await upstream.start()
    async with running_proxy(upstream.url, **canary_settings()) as proxy:
        async with http.post(
            proxy.public_url + GENERATE, data=generate_body(), headers=B_TENANT
        ) as r:
            got = await r.read()
    assert FOREIGN.encode() not in got
    last = ended_with(r.status, got)
    assert sglang_code(last) == "canary_violation"


# --- drain and TTFT on a reasoning-only stream ----------------------------------------


async def test_reasoning_only_stream_ends_a_deferred_drain_at_its_first_token(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """vLLM >= 0.16 streams reasoning only in delta.reasoning: the first of those is the
    first generated token (the safe point), long before any content."""
    first_token = asyncio.Event()
    content = asyncio.Event()  # never set: content would come "thousands of tokens later"
    chunks = [
        event(reasoning("", role="assistant")),  # role only: not a token
        event(reasoning("Let me think")),
        event({"choices": [{"index": 0, "delta": {"content": "answer"}}]}),
    ]

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunks[0])
        await asyncio.wait_for(first_token.wait(), 10)
        await resp.write(chunks[1])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(content.wait(), 10)
        await resp.write(chunks[2])
        return resp

    upstream.route("POST", CHAT, handler)
    await upstream.start()
    async with running_proxy(upstream.url) as proxy:
        m = proxy.metrics
        resp = await http.post(proxy.public_url + CHAT, data=chat_body())
        assert await resp.content.readuntil(b"\n\n") == chunks[0].rstrip(b"\n") + b"\n\n"
        assert m.upstream_ttft._sum.get() == 0  # a role chunk is no first token
        resp.close()  # the client leaves before the first token
        assert await wait_until(lambda: m.deferred_in_progress.labels("default")._value.get() == 1)
        first_token.set()
        assert await wait_until(
            lambda: m.deferred_total.labels("first_token", "default")._value.get() == 1
        )
        assert m.deferred_total.labels("timeout", "default")._value.get() == 0
        assert m.deferred_in_progress.labels("default")._value.get() == 0
        ttft = [s for s in m.upstream_ttft.collect()[0].samples if s.name.endswith("_count")]
        assert ttft[0].value == 1  # observed once, at the reasoning token
        assert await wait_until(lambda: proxy.state.inflight == 0)
    content.set()


# --- error style on /generate, every upstream failure path ------------------------------


# Each outcome's message: SGLang's native shape carries nothing else to tell them apart.
MESSAGES = {
    "upstream_unreachable": errors.upstream_failure("connect").message,
    "upstream_reset": errors.upstream_failure("reset").message,
    "upstream_timeout": errors.upstream_failure("timeout").message,
    "upstream_bad_response": errors.upstream_failure("protocol").message,  # + " (detail)"
    "canary_violation": errors.canary_violation().message,
}


def sglang_code(data: dict[str, Any]) -> str:
    """The outcome of an error in SGLang's native shape, `{"error": {"message": ...}}`
    exactly, from its message."""
    assert list(data) == ["error"], data
    assert list(data["error"]) == ["message"], data
    message = data["error"]["message"]
    return next(code for code, text in MESSAGES.items() if message.startswith(text))


def sglang_shaped(body: bytes, code: str) -> None:
    assert sglang_code(orjson.loads(body)) == code


@contextlib.asynccontextmanager
async def garbage_server() -> AsyncIterator[str]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(b"\x16\x03\x01 this is not HTTP\r\n\r\n\x00\xff")
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def _post(http: aiohttp.ClientSession, url: str, stream: bool) -> tuple[int, bytes]:
    async with http.post(url + GENERATE, data=generate_body(stream)) as r:
        try:
            return r.status, await r.read()
        except aiohttp.ClientPayloadError:
            return r.status, b""


@pytest.mark.parametrize("stream", [False, True])
async def test_generate_refused_and_garbage_upstreams_answer_in_sglang_shape(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    async with running_proxy(f"http://127.0.0.1:{free_port()}") as proxy:
        status, body = await _post(http, proxy.public_url, stream)
    assert status == 502
    sglang_shaped(body, "upstream_unreachable")
    async with garbage_server() as url, running_proxy(url) as proxy:
        status, body = await _post(http, proxy.public_url, stream)
    assert status == 502
    sglang_shaped(body, "upstream_bad_response")


async def test_generate_stall_and_reset_answer_in_sglang_shape(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    release = asyncio.Event()
    mode = {"now": "stall"}

    async def handler(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        if mode["now"] == "stall":
            await asyncio.wait_for(release.wait(), 10)
            return web.Response(text="late")
        if mode["now"] == "reset":
            request.transport.abort()
            return web.Response()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(event({"text": "a", "meta_info": {"completion_tokens": 1}}))
        await resp.write(b'data: {"text": "ab", "meta')  # cut inside an event
        request.transport.abort()
        return resp

    upstream.route("POST", GENERATE, handler)
    await upstream.start()
    try:
        async with running_proxy(
            upstream.url, upstream_read_timeout_s=0.3, **canary_settings()
        ) as proxy:
            status, body = await _post(http, proxy.public_url, True)
            assert status == 504
            sglang_shaped(body, "upstream_timeout")
            release.set()
            mode["now"] = "reset"
            status, body = await _post(http, proxy.public_url, False)
            assert status == 502
            sglang_shaped(body, "upstream_reset")
            mode["now"] = "cut"
            status, body = await _post(http, proxy.public_url, True)
    finally:
        release.set()
    assert b'"ab", "meta' not in body  # the half event was never forwarded (scanned stream)
    assert status in (200, 502)
    data = ended_with(status, body)
    # aiohttp reports a cut chunked body as a payload error, a cut plain one as a reset.
    assert sglang_code(data) in ("upstream_reset", "upstream_bad_response")


async def test_generate_scan_overflows_answer_in_sglang_shape(
    upstream: FakeUpstream, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inspector, "SCAN_BODY_BYTES", 4096)  # what block mode holds to scan
    monkeypatch.setattr(sse, "DEFAULT_MAX_EVENT_BYTES", 4096)
    big_body = orjson.dumps({"text": "x" * 8192, "meta_info": {}})
    big_event = event({"text": "y" * 8192, "meta_info": {}})  # forwarded whole if it came whole

    async def handler(request: web.Request) -> web.StreamResponse:
        if not orjson.loads(await request.read()).get("stream"):
            return web.Response(body=big_body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(event({"text": "a", "meta_info": {"completion_tokens": 1}}))
        # Over the bound and never ended: the proxy holds it, overflows and hangs up.
        await resp.write(big_event[:6000])
        with contextlib.suppress(TimeoutError, ConnectionError):
            await asyncio.wait_for(hung_up.wait(), 10)
        return resp

    hung_up = asyncio.Event()
    upstream.route("POST", GENERATE, handler)
    await upstream.start()
    async with running_proxy(upstream.url, **canary_settings()) as proxy:
        status, body = await _post(http, proxy.public_url, False)
        assert status == 502
        sglang_shaped(body, "upstream_bad_response")
        status, body = await _post(http, proxy.public_url, True)
        hung_up.set()
    assert status in (200, 502)
    sglang_shaped(orjson.dumps(ended_with(status, body)), "upstream_bad_response")


async def test_observe_mode_scans_a_body_past_its_first_megabytes(
    upstream: FakeUpstream, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 256 KiB stands for the 8 MiB usage buffer, 2 MiB for the 64 MiB scan bound; a 1 MiB
    # body arrives in several reads.
    monkeypatch.setattr(inspector, "KEEP_BODY_BYTES", 256 * 1024)
    monkeypatch.setattr(inspector, "SCAN_BODY_BYTES", 2 * 1024 * 1024)
    body = orjson.dumps({"choices": [{"index": 0, "text": "x" * 2**20 + " " + FOREIGN}]})

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=body, content_type="application/json")

    upstream.route("POST", "/v1/completions", handler)
    await upstream.start()
    settings = {**canary_settings(), "canary_action": "observe"}
    async with running_proxy(upstream.url, **settings) as proxy:
        req = orjson.dumps({"model": "m", "prompt": "hi"})
        async with http.post(proxy.public_url + "/v1/completions", data=req, headers=B_TENANT) as r:
            assert await r.read() == body  # observe: relayed as it came
        assert proxy.metrics.canary_violations.labels("canary-b")._value.get() == 1


@pytest.mark.parametrize("first_event", [True, False])
async def test_an_endless_sse_line_ends_the_stream_with_the_error_event_and_a_close(
    upstream: FakeUpstream, monkeypatch: pytest.MonkeyPatch, first_event: bool
) -> None:
    """An upstream that streams one line without end: past the event bound the client gets
    the documented error event and its connection closed, not a stream that goes quiet."""
    monkeypatch.setattr(sse, "DEFAULT_MAX_EVENT_BYTES", 64 * 1024)
    stop = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if first_event:
            await resp.write(event({"choices": [{"index": 0, "text": "a"}]}))
        with contextlib.suppress(ConnectionError):
            await resp.write(b'data: {"choices":[{"text":"')
            for _ in range(2_000):  # 16 MiB at most, bounded
                if stop.is_set():
                    break
                await resp.write(b"x" * 8192)
                await asyncio.sleep(0)
        return resp

    upstream.route("POST", CHAT, endless)
    await upstream.start()
    async with running_proxy(upstream.url) as proxy:
        host, port = proxy.public_url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = orjson.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        )
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        got = b""
        with contextlib.suppress(ConnectionError):
            while chunk := await asyncio.wait_for(reader.read(65536), 20):
                got += chunk
        stop.set()
        writer.close()
    assert b'"code":"upstream_bad_response"' in got, got[-400:]
    if first_event:
        assert b"data: {" in got.split(b"\r\n\r\n", 1)[1]
    assert b"x" * 8192 not in got  # nothing of the endless line was forwarded
