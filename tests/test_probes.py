"""kvproxy.probes: the probe client shared by the gate and the isolation harness. Prompts of
an exact engine length, the model a target serves, what counts as a refusal."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvproxy.probes import (
    EngineTokenizer,
    ModelUnknown,
    Reply,
    TargetRefused,
    boundary_prompts,
    discover_model,
    exact_text,
)

# A tokenizer unlike kvproxy's byte counter: words, single spaces and punctuation are one
# token each, plus one BOS (the engine adds special tokens to a completions prompt).
WORDS = re.compile(r"\w+|\s|[^\w\s]")


def word_tokens(text: str) -> list[int]:
    return [1] + [len(m.group(0)) for m in WORDS.finditer(text)]


@contextlib.asynccontextmanager
async def fake(models: list[str] | None, tokenize: bool = True) -> AsyncIterator[str]:
    async def list_models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m} for m in models or []]})

    async def tok(request: web.Request) -> web.Response:
        body: dict[str, Any] = await request.json()
        ids = word_tokens(body["prompt"])
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 8192})

    app = web.Application()
    if models is not None:
        app.router.add_get("/v1/models", list_models)
    if tokenize:
        app.router.add_post("/tokenize", tok)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("n", [1, 2, 17, 500, 5315])
async def test_exact_text_has_the_engine_length(n: int) -> None:
    async with fake(None) as url, aiohttp.ClientSession() as http:
        text = await exact_text(EngineTokenizer(http, url), "KVCANARY-x probe. the fox ", n)
    assert text is not None
    assert len(word_tokens(text)) == n


async def test_boundary_prompts_are_text_when_a_tokenizer_answers() -> None:
    async with fake(None) as url, aiohttp.ClientSession() as http:
        probes = await boundary_prompts(http, ["http://127.0.0.1:9", url], "a b c. ", [99, 100])
    assert probes.kind == "text"
    assert url in probes.note
    assert {n: len(word_tokens(str(p))) for n, p in probes.prompts.items()} == {99: 99, 100: 100}


async def test_boundary_prompts_fall_back_to_token_ids_and_say_so() -> None:
    async with aiohttp.ClientSession() as http:
        probes = await boundary_prompts(http, ["http://127.0.0.1:9"], "abc", [4, 5])
    assert probes.kind == "token_ids"
    assert "byte values" in probes.note
    assert probes.prompts == {4: [97, 98, 99, 97], 5: [97, 98, 99, 97, 98]}


async def test_the_model_is_the_one_the_target_lists() -> None:
    async with fake(["kvproxy-sim"]) as url, aiohttp.ClientSession() as http:
        assert await discover_model(http, [url], {}) == ("kvproxy-sim", url + "/v1/models")


async def test_several_models_require_a_choice_and_are_listed() -> None:
    async with fake(["a-model", "b-model"]) as url, aiohttp.ClientSession() as http:
        with pytest.raises(ModelUnknown, match=r"2 models \(a-model, b-model\).*--model"):
            await discover_model(http, [url], {})


async def test_no_model_listing_is_an_error_not_a_guess() -> None:
    async with fake(None) as url, aiohttp.ClientSession() as http:
        with pytest.raises(ModelUnknown, match="pass --model"):
            await discover_model(http, [url], {})


def test_what_a_refusal_is_and_what_it_says() -> None:
    ok = Reply(400, "context_length_exceeded", [], False, "rejected")
    assert not ok.refused()
    assert not Reply(200, None, [], False, None).refused()
    assert not Reply(200, "canary_violation", [], True, None).refused()
    workers = Reply(503, "no_available_workers", [], False, None)
    assert workers.refused()
    assert str(TargetRefused("probe", workers)) == (
        "target refused the probe: 503 no_available_workers — is --model right?"
    )
    shape = Reply(400, "invalid_type", [], False, None)
    assert "refuses this prompt shape" in str(TargetRefused("probe", shape))
    gone = Reply(0, None, [], False, None, error="ClientConnectorError")
    assert str(TargetRefused("probe", gone)).endswith(
        "ClientConnectorError — is the target reachable?"
    )
