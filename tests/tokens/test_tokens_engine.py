"""Engine counting: what is sent to /tokenize for each route and engine kind, the aiohttp
client against a real local server, and the reply parser on multi-megabyte replies."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from ports import free_port

from kvproxy.policy.errors import KvproxyError
from kvproxy.prompt.parse import parse_request
from kvproxy.tokens.counter import TokenCounter
from kvproxy.tokens.exact.engine import (
    EngineTokenizeError,
    EngineTokenizer,
    EngineTokenizeRequest,
    FailoverEngineTokenizer,
    parse_count,
)
from kvproxy.tokens.replica.templates import ChatTemplate

AiohttpServer = Callable[..., Awaitable[TestServer]]


@dataclass
class FakeEngine:
    accepts_messages: bool
    answer: int = 7
    requests: list[EngineTokenizeRequest] = field(default_factory=list)
    fail: bool = False

    async def __call__(self, request: EngineTokenizeRequest) -> int:
        self.requests.append(request)
        if self.fail:
            raise EngineTokenizeError("down")
        return self.answer


def chat_shape() -> Any:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    return parse_request("chat", orjson.dumps(body))


async def _count(engine: FakeEngine, shape: Any, template: ChatTemplate | None = None) -> Any:
    c = TokenCounter(bound_rule="nfc", engine=engine, template=template)
    try:
        return await c.count(shape, 0)
    finally:
        await c.aclose()


async def test_vllm_gets_messages() -> None:
    engine = FakeEngine(accepts_messages=True)
    got = await _count(engine, chat_shape())
    assert (got.tokens, got.method, got.exact) == (7, "engine", True)
    (req,) = engine.requests
    # As the client sent them: the engine applies its own normalisation (tokens.replica.chatnorm),
    # and a field the client did not send stays unsent (the engine's default applies).
    assert req.fields == {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    }
    assert orjson.loads(req.body()) == req.fields


async def test_sglang_gets_the_locally_rendered_template() -> None:
    engine = FakeEngine(accepts_messages=False)
    got = await _count(engine, chat_shape(), ChatTemplate("[{{ messages[0].content }}]"))
    (req,) = engine.requests
    assert (req.prompt, req.add_special_tokens, req.messages) == ("[hi]", False, None)
    assert got.tokens == 7


async def test_sglang_without_template_counts_fields_plus_overhead() -> None:
    engine = FakeEngine(accepts_messages=False)
    got = await _count(engine, chat_shape())
    (req,) = engine.requests
    assert req.prompt == "user\nhi"
    assert got.tokens == 7 + 64 + 8
    assert not got.exact


async def test_completions_ask_for_special_tokens() -> None:
    engine = FakeEngine(accepts_messages=True)
    got = await _count(engine, parse_request("completions", b'{"prompt": ["a", "b"]}'))
    assert [r.prompt for r in engine.requests] == ["a", "b"]
    assert all(r.add_special_tokens for r in engine.requests)
    assert got.tokens == 7


async def test_engine_failure_is_a_503() -> None:
    with pytest.raises(KvproxyError) as info:
        await _count(FakeEngine(accepts_messages=True, fail=True), chat_shape())
    assert info.value.status == 503


SEEN = web.AppKey("seen", list)


async def _tokenize_server(aiohttp_server: AiohttpServer, status: int = 200) -> TestServer:
    seen: list[dict[str, Any]] = []

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        text = body.get("prompt") or "".join(m["content"] for m in body["messages"])
        ids = list(range(len(text)))
        return web.json_response({"tokens": ids, "count": len(ids)}, status=status)

    app = web.Application()
    app[SEEN] = seen
    app.router.add_post("/tokenize", tokenize)
    return await aiohttp_server(app, host="127.0.0.1")


async def test_engine_tokenizer_over_http(aiohttp_server: AiohttpServer) -> None:
    server = await _tokenize_server(aiohttp_server)
    async with aiohttp.ClientSession() as session:
        vllm = EngineTokenizer(session, str(server.make_url("")), "vllm")
        sglang = EngineTokenizer(session, str(server.make_url("")), "sglang")
        assert await vllm(EngineTokenizeRequest(messages=[{"role": "u", "content": "abc"}])) == 3
        assert await sglang(EngineTokenizeRequest(prompt="x" * 100_000)) == 100_000
        with pytest.raises(EngineTokenizeError):
            await sglang(EngineTokenizeRequest(messages=[{"role": "u", "content": "abc"}]))
    assert server.app is not None
    seen = server.app[SEEN]
    assert seen[0]["add_generation_prompt"] is True
    assert seen[1] == {"prompt": "x" * 100_000, "add_special_tokens": True}


async def test_engine_tokenizer_error_status(aiohttp_server: AiohttpServer) -> None:
    server = await _tokenize_server(aiohttp_server, status=500)
    async with aiohttp.ClientSession() as session:
        sglang = EngineTokenizer(session, str(server.make_url("")), "sglang")
        with pytest.raises(EngineTokenizeError, match="HTTP 500"):
            await sglang(EngineTokenizeRequest(prompt="abc"))


async def test_failover_asks_the_next_engine_when_one_cannot_be_reached(
    aiohttp_server: AiohttpServer,
) -> None:
    # Gateway mode: the first engine is one cluster's, stopped; the other cluster's answers.
    server = await _tokenize_server(aiohttp_server)
    live = str(server.make_url(""))
    async with aiohttp.ClientSession() as session:
        dead = EngineTokenizer(session, f"http://127.0.0.1:{free_port()}", "sglang")
        both = FailoverEngineTokenizer([dead, EngineTokenizer(session, live, "sglang")])
        assert await both(EngineTokenizeRequest(prompt="abcd")) == 4
        assert await both(EngineTokenizeRequest(prompt="abcde")) == 5
        lone = FailoverEngineTokenizer([dead])
        with pytest.raises(aiohttp.ClientConnectionError):
            await lone(EngineTokenizeRequest(prompt="abc"))
    assert server.app is not None
    # The live engine answered last, so it is asked first: the dead one was tried once.
    assert len(server.app[SEEN]) == 2


async def test_failover_does_not_hide_an_engine_that_answered_an_error(
    aiohttp_server: AiohttpServer,
) -> None:
    failing = await _tokenize_server(aiohttp_server, status=500)
    good = await _tokenize_server(aiohttp_server)
    async with aiohttp.ClientSession() as session:
        both = FailoverEngineTokenizer(
            [
                EngineTokenizer(session, str(failing.make_url("")), "sglang"),
                EngineTokenizer(session, str(good.make_url("")), "sglang"),
            ]
        )
        with pytest.raises(EngineTokenizeError, match="HTTP 500"):
            await both(EngineTokenizeRequest(prompt="abc"))
    assert good.app is not None
    assert good.app[SEEN] == []


@pytest.mark.parametrize("count_first", [True, False])
def test_parse_count_reads_large_replies_without_parsing_ids(count_first: bool) -> None:
    ids = orjson.dumps(list(range(1_000_000))).decode()
    parts = ['"count": 1000000', f'"tokens": {ids}', '"max_model_len": 2000000']
    if not count_first:
        parts.reverse()
    raw = ("{" + ", ".join(parts) + "}").encode()
    assert len(raw) > 1_000_000
    assert parse_count(raw) == 1_000_000


def test_parse_count_small_replies() -> None:
    assert parse_count(b'{"count": 3, "tokens": [1, 2, 3]}') == 3
    assert parse_count(b'{"count": [2, 3]}') == 5
    assert parse_count(b'{"tokens": [1, 2]}') == 2
    with pytest.raises(EngineTokenizeError):
        parse_count(b"not json")
    with pytest.raises(EngineTokenizeError):
        parse_count(b'{"nothing": 1}')


# --- vLLM's /tokenize gets the client's own chat fields, through the proxy ------------------

VLLM_CACHE_INFO = (
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",'
    'kv_cache_size_tokens="16000"} 1.0\n'
)


async def test_vllm_tokenize_gets_the_clients_fields(aiohttp_server: AiohttpServer) -> None:
    """A fake vLLM engine on loopback records what /tokenize receives: the client's chat
    fields as sent (a capitalised role, an empty tool_calls, a tool with `strict`, kwargs),
    not kvproxy's normalisation of them, and nothing the engine would not render there."""
    from kvtest import FakeUpstream, running_proxy

    seen: list[dict[str, Any]] = []

    async def tokenize(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"count": 900, "max_model_len": 1000, "tokens": []})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=VLLM_CACHE_INFO)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 1000}]})

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.34.0"})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    engine = await aiohttp_server(app, host="127.0.0.1")

    upstream = FakeUpstream()

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"choices": []})

    upstream.route("POST", "/v1/chat/completions", ok)
    await upstream.start()
    fields = {
        "messages": [
            {"role": "System", "content": "be brief " * 600},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "ok", "tool_calls": []},
            {"role": "user", "content": "again"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                     "parameters": {"maximum": 1.5}}}],
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True,
    }  # fmt: skip
    body = {"model": "m", "max_tokens": 1, "temperature": 0.2, **fields}
    try:
        async with running_proxy(
            upstream.url,
            engines=[{"url": str(engine.make_url("")), "kind": "vllm", "role": "unified"}],
            tokenizer="engine",
            router_kind="none",
        ) as proxy:
            async with aiohttp.ClientSession() as http:
                async with http.post(proxy.public_url + "/v1/chat/completions", json=body) as r:
                    status, headers = r.status, dict(r.headers)
            verification = proxy.services.models.first.capacity.verifier
            assert verification is not None
            described = verification.describe()
    finally:
        await upstream.close()
    assert status == 200
    assert (headers["X-Kvproxy-Prompt-Tokens"], headers["X-Kvproxy-Prompt-Tokens-Kind"]) == (
        "900",
        "exact",
    )
    assert seen == [fields]  # exactly the client's fields, nothing of kvproxy's
    assert described == "vllm 0.34.0 behind none"
