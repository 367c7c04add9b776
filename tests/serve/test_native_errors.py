"""SGLang's own error shape on SGLang's native routes (issue #33.3), read the way SGLang's
own clients read it.

SGLang's HTTP server (python/sglang/srt/entrypoints/http_server.py) answers a refused
`/generate`, `/encode` or `/classify` with HTTP 400 and `{"error": {"message": str(e)}}`
(`_create_error_response`), and ends a refused `/generate` stream with the event
`data: {"error": {"message": str(e)}}` followed by `data: [DONE]` (`generate_request`'s
`stream_results`). Its clients (sglang.lang.backend.runtime_endpoint, the native API docs)
read a stream line by line: `data:` lines up to `data: [DONE]`, each `json.loads(line[5:])`;
a non-200 body is raised as it is. The reader below restates that, and looks for the error
where SGLang puts it: `event["error"]["message"]`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from kvtest import FakeUpstream, canary_settings, running_proxy, static_engines

from kvproxy.policy import errors

GENERATE = "/generate"
FOREIGN = "KVCANARY-canary-a-0123456789abcdef"  # canary-a's marker; the client is canary-b
B_TENANT = {"X-Tenant-ID": "canary-b"}


class SGLangServerError(RuntimeError):
    """What an SGLang client raises on the server's error."""


def read_generate_stream(raw: bytes) -> str:
    """The text of a /generate stream as SGLang's clients read it; raises on an error event.

    runtime_endpoint.generate_stream: for each line, `data:` lines only; `data: [DONE]`
    ends the stream; `json.loads(chunk[5:].strip("\\n"))`; `text` is cumulative."""
    text = ""
    done = False
    for line in raw.decode("utf-8").splitlines():
        if not line.startswith("data:"):
            continue
        if line == "data: [DONE]":
            done = True
            break
        data = json.loads(line[5:].strip("\n"))
        if "error" in data:
            raise SGLangServerError(data["error"]["message"])
        text = data["text"]
    assert done, "the stream ended without data: [DONE]"
    return text


def assert_success(status: int, body: bytes) -> Any:
    """runtime_endpoint._assert_success: a non-200 answer is raised with its JSON content."""
    if status != 200:
        raise SGLangServerError(json.loads(body)["error"]["message"])
    return json.loads(body)


def native_shape(body: bytes) -> str:
    """Exactly SGLang's shape, nothing more: `{"error": {"message": str}}`; its message."""
    data = orjson.loads(body)
    assert list(data) == ["error"], data
    assert list(data["error"]) == ["message"], data
    message = data["error"]["message"]
    assert isinstance(message, str)
    assert message
    return message


def event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def streaming(chunks: list[bytes]) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in chunks:
            await resp.write(c)
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    return handler


def generate_body(text: str = "hi", stream: bool = True) -> bytes:
    return orjson.dumps({"text": text, "stream": stream, "sampling_params": {"max_new_tokens": 8}})


def error_events(raw: bytes) -> list[bytes]:
    return [
        line[6:]
        for line in raw.split(b"\n")
        if line.startswith(b"data: ") and line != b"data: [DONE]" and b'"error"' in line
    ]


async def test_a_canary_cut_on_generate_reaches_an_sglang_client_as_its_error(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    chunks = [
        event({"text": "a", "meta_info": {"completion_tokens": 1}}),
        event({"text": "ab", "meta_info": {"completion_tokens": 2}}),
        event({"text": "ab " + FOREIGN, "meta_info": {"completion_tokens": 3}}),
        event({"text": "ab " + FOREIGN + " never", "meta_info": {"completion_tokens": 4}}),
        b"data: [DONE]\n\n",
    ]
    upstream.route("POST", GENERATE, streaming(chunks))
    await upstream.start()
    async with running_proxy(upstream.url, **canary_settings()) as proxy:
        async with http.post(
            proxy.public_url + GENERATE, data=generate_body(), headers=B_TENANT
        ) as r:
            status, raw = r.status, await r.read()
        assert proxy.metrics.canary_violations.labels("canary-b")._value.get() == 1
    assert FOREIGN.encode() not in raw
    if status == 200:
        # Headers were out: the stream ends with SGLang's error event, then [DONE].
        (err,) = error_events(raw)
        assert native_shape(err) == errors.canary_violation().message
        # An SGLang client raises the server's error: the cut is never read as complete.
        with pytest.raises(SGLangServerError) as seen:
            read_generate_stream(raw)
        assert str(seen.value) == errors.canary_violation().message
    else:
        # The cut came before anything was relayed: a whole 502 body, the same shape.
        assert status == 502
        assert native_shape(raw) == errors.canary_violation().message


async def test_an_upstream_cut_mid_stream_reaches_an_sglang_client_as_its_error(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(event({"text": "a", "meta_info": {"completion_tokens": 1}}))
        await resp.write(b'data: {"text": "ab", "meta')  # cut inside an event
        request.transport.abort()
        return resp

    upstream.route("POST", GENERATE, handler)
    await upstream.start()
    # With a tripwire the stream is relayed in whole events, so the half event never left
    # and the error event starts at an event boundary.
    async with running_proxy(upstream.url, **canary_settings()) as proxy:
        async with http.post(proxy.public_url + GENERATE, data=generate_body()) as r:
            status, raw = r.status, await r.read()
    assert b'"ab", "meta' not in raw
    if status == 200:
        (err,) = error_events(raw)
        message = native_shape(err)
        # aiohttp reports a cut chunked body as a payload error, a cut plain one as a reset.
        assert message == errors.upstream_failure("reset").message or message.startswith(
            errors.upstream_failure("protocol").message
        )
        with pytest.raises(SGLangServerError):
            read_generate_stream(raw)
    else:
        assert status == 502
        native_shape(raw)


async def test_rejections_on_native_routes_are_sglangs_body_with_the_code_in_a_header(
    http: aiohttp.ClientSession,
) -> None:
    long_text = "x" * 400
    bodies = {
        GENERATE: generate_body(long_text, stream=False),
        "/encode": orjson.dumps({"text": long_text}),
        "/classify": orjson.dumps({"text": long_text}),
    }
    # A 100-token static pool: the byte bound of 400 characters cannot be admitted.
    async with running_proxy("http://127.0.0.1:9", engines=static_engines(100)) as proxy:
        for path, body in bodies.items():
            async with http.post(proxy.public_url + path, data=body) as r:
                status, raw = r.status, await r.read()
                assert r.headers["X-Kvproxy-Error-Code"] == "context_length_exceeded", path
                assert r.headers["X-Kvproxy-Decision"] == "rejected"
            assert status == 400, path
            message = native_shape(raw)
            assert "accepts at most 100" in message
            with pytest.raises(SGLangServerError) as seen:
                assert_success(status, raw)
            assert str(seen.value) == message
        # The OpenAI routes keep OpenAI's shape, with the code in the body as well.
        chat = {"model": "m", "messages": [{"role": "user", "content": long_text}]}
        async with http.post(proxy.public_url + "/v1/chat/completions", json=chat) as r:
            assert r.status == 400
            assert r.headers["X-Kvproxy-Error-Code"] == "context_length_exceeded"
            assert (await r.json())["error"]["code"] == "context_length_exceeded"
