"""The official `openai` SDK, sync and async, against kvproxy in front of the PD simulator.

What a real client library must see: normal replies parse into its models, and every
kvproxy rejection lands in the SDK's own error class with our machine `code` and the
extra fields of the body (`prompt_tokens`, `limit_tokens`, `limit_source`) intact. The
sync client runs in a worker thread so the event loop keeps serving proxy and simulator.
`max_retries=0` everywhere: the SDK retries 429/5xx by default, which would hide the
first answer and multiply upstream traffic.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
from clients_support import (
    MODEL,
    OVER_LIMIT_TEXT,
    dead_port,
    proxy_before_sim,
    routed,
    sim_stats,
)
from kvtest import wait_until

from kvproxy.serve.app import KvproxyServer

USER = [{"role": "user", "content": "hello from the openai sdk"}]
OVER = [{"role": "user", "content": OVER_LIMIT_TEXT}]


def _sync_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0, timeout=30)


def _async_client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0, timeout=30)


def _limit(proxy: KvproxyServer) -> int:
    limit = proxy.services.models.first.capacity.limits().admission_limit_tokens
    assert limit is not None
    return limit


def _check_context_error(err: openai.BadRequestError, param: str, limit: int) -> None:
    assert err.status_code == 400
    assert err.code == "context_length_exceeded"
    assert err.type == "invalid_request_error"
    assert err.param == param
    body: Any = err.body
    assert isinstance(body, dict)
    assert body["limit_tokens"] == limit
    assert body["prompt_tokens"] > body["limit_tokens"]
    assert body["limit_source"] == "measured"
    assert err.response.headers["x-kvproxy-decision"] == "rejected"
    # I8: the message names sizes and limits, never the prompt.
    assert "over the limit" not in err.message


# --- normal traffic parses ---------------------------------------------------------------


async def test_async_sdk_chat_and_completions_parse(http: aiohttp.ClientSession) -> None:
    async with proxy_before_sim() as (proxy, sim):
        async with _async_client(proxy.public_url) as client:
            chat = await client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8)  # type: ignore[arg-type]
            assert chat.object == "chat.completion"
            assert isinstance(chat.choices[0].message.content, str)
            assert chat.choices[0].message.content
            assert chat.usage is not None
            assert chat.usage.prompt_tokens > 0

            stream = await client.chat.completions.create(
                model=MODEL,
                messages=USER,  # type: ignore[arg-type]
                max_tokens=8,
                stream=True,
            )
            pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            assert "".join(pieces)

            comp = await client.completions.create(model=MODEL, prompt="once upon", max_tokens=8)
            assert comp.choices[0].text

            cstream = await client.completions.create(
                model=MODEL, prompt="once upon", max_tokens=8, stream=True
            )
            texts = [c.choices[0].text async for c in cstream if c.choices]
            assert "".join(texts)

            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=USER,  # type: ignore[arg-type]
                max_tokens=4,
            )
            assert raw.headers["x-kvproxy-decision"] == "admitted"
            assert 0 < int(raw.headers["x-kvproxy-prompt-tokens"]) <= _limit(proxy)
        stats = await sim_stats(http, sim)
        assert routed(stats) == 5
        assert stats["prefill"]["pending_rejections"] == 0


def _sync_session(base: str) -> dict[str, Any]:
    with _sync_client(base) as client:
        chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8)  # type: ignore[arg-type]
        with client.chat.completions.create(
            model=MODEL,
            messages=USER,  # type: ignore[arg-type]
            max_tokens=8,
            stream=True,
        ) as stream:
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        comp = client.completions.create(model=MODEL, prompt="once upon", max_tokens=8)
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL, messages=OVER)  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError) as exc_stream:
            client.chat.completions.create(model=MODEL, messages=OVER, stream=True)  # type: ignore[arg-type]
        return {
            "chat": chat.choices[0].message.content,
            "streamed": streamed,
            "completion": comp.choices[0].text,
            "error": exc.value,
            "stream_error": exc_stream.value,
        }


async def test_sync_sdk_in_a_thread(http: aiohttp.ClientSession) -> None:
    async with proxy_before_sim() as (proxy, sim):
        got = await asyncio.to_thread(_sync_session, proxy.public_url)
        assert got["chat"]
        assert got["streamed"]
        assert got["completion"]
        _check_context_error(got["error"], "messages", _limit(proxy))
        _check_context_error(got["stream_error"], "messages", _limit(proxy))
        stats = await sim_stats(http, sim)
        assert routed(stats) == 3  # the two rejections never reached the router (I7)


# --- rejections land in the SDK's error classes --------------------------------------------


async def test_over_limit_is_bad_request_with_our_code(http: aiohttp.ClientSession) -> None:
    async with proxy_before_sim() as (proxy, sim):
        async with _async_client(proxy.public_url) as client:
            with pytest.raises(openai.BadRequestError) as chat_err:
                await client.chat.completions.create(model=MODEL, messages=OVER)  # type: ignore[arg-type]
            _check_context_error(chat_err.value, "messages", _limit(proxy))

            with pytest.raises(openai.BadRequestError) as stream_err:
                await client.chat.completions.create(model=MODEL, messages=OVER, stream=True)  # type: ignore[arg-type]
            _check_context_error(stream_err.value, "messages", _limit(proxy))

            with pytest.raises(openai.BadRequestError) as comp_err:
                await client.completions.create(model=MODEL, prompt=OVER_LIMIT_TEXT)
            _check_context_error(comp_err.value, "prompt", _limit(proxy))

            # I4: prompt fits, but prompt + max_tokens does not fit decode.
            with pytest.raises(openai.BadRequestError) as decode_err:
                await client.chat.completions.create(
                    model=MODEL,
                    messages=USER,  # type: ignore[arg-type]
                    max_tokens=100_000,
                )
            err = decode_err.value
            assert err.code == "context_length_exceeded"
            assert err.param == "max_tokens"
            assert isinstance(err.body, dict)
            assert err.body["output_tokens"] == 100_000

            # Malformed, not big: our invalid_request code, naming the field.
            with pytest.raises(openai.BadRequestError) as n_err:
                await client.chat.completions.create(model=MODEL, messages=USER, n=1_000_000)  # type: ignore[arg-type]
            assert n_err.value.code == "invalid_request"
            assert n_err.value.param == "n"
        stats = await sim_stats(http, sim)
        assert routed(stats) == 0
        assert proxy.metrics.rejections.labels("context_length", "default")._value.get() == 3
        assert proxy.metrics.rejections.labels("decode_budget", "default")._value.get() == 1


async def test_capacity_unknown_is_the_sdks_503() -> None:
    dead = dead_port()
    engines = [{"url": f"http://127.0.0.1:{dead}", "role": "prefill", "kind": "sglang"}]
    async with proxy_before_sim(engines=engines) as (proxy, _sim):
        assert not proxy.services.models.first.capacity.ready()
        async with _async_client(proxy.public_url) as client:
            with pytest.raises(openai.InternalServerError) as exc:
                await client.chat.completions.create(model=MODEL, messages=USER)  # type: ignore[arg-type]
        err = exc.value
        assert err.status_code == 503
        assert err.code == "capacity_unknown"
        assert int(err.response.headers["retry-after"]) >= 1
        # The sync SDK maps it the same way.
        with pytest.raises(openai.InternalServerError) as sync_exc:
            await asyncio.to_thread(_sync_chat, proxy.public_url)
        assert sync_exc.value.code == "capacity_unknown"


def _sync_chat(base: str) -> str | None:
    with _sync_client(base) as client:
        reply = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4)  # type: ignore[arg-type]
        return reply.choices[0].message.content


async def test_inflight_budget_is_the_sdks_rate_limit(http: aiohttp.ClientSession) -> None:
    # A slow decode keeps the first stream upstream (and holding the only slot) for minutes
    # unless the client leaves; the test never depends on how slow.
    async with proxy_before_sim(
        sim_options={"decode_ms_per_token": 50.0},
        max_inflight_requests=1,
        queue_timeout_s=0,
    ) as (proxy, sim):
        body = {"model": MODEL, "messages": USER, "max_tokens": 4000, "stream": True}
        held = await http.post(proxy.public_url + "/v1/chat/completions", json=body)
        try:
            assert held.status == 200
            first = await asyncio.wait_for(held.content.readline(), 30)
            assert first.startswith(b"data: ")
            async with _async_client(proxy.public_url) as client:
                with pytest.raises(openai.RateLimitError) as exc:
                    await client.chat.completions.create(model=MODEL, messages=USER)  # type: ignore[arg-type]
            assert exc.value.code == "inflight_budget_exceeded"
            assert int(exc.value.response.headers["retry-after"]) >= 1
            with pytest.raises(openai.RateLimitError):
                await asyncio.to_thread(_sync_chat, proxy.public_url)
        finally:
            held.close()  # the client leaves; the slot comes back when upstream closes (I6)
        assert await wait_until(lambda: proxy.state.inflight == 0, 30)
        assert await asyncio.to_thread(_sync_chat, proxy.public_url)
        assert proxy.metrics.rejections.labels("over_budget", "default")._value.get() == 2
        stats = await sim_stats(http, sim)
        assert routed(stats) == 2
