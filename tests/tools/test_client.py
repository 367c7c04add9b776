"""kvproxy.tools.client: the probe client shared by the gate and the isolation harness. Prompts of
an exact engine length, the model a target serves, what counts as a refusal."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kvtest import serving

from kvproxy.tools.client import (
    EngineTokenizer,
    ModelUnknown,
    ProbeClient,
    Reply,
    TargetRefused,
    boundary_counts,
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
    async with serving(app) as url:
        yield url


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


@contextlib.asynccontextmanager
async def fake_sim(reaches_engine: bool) -> AsyncIterator[str]:
    """A router with ground truth: /sim/stats counts completions that reached prefill."""
    seen = {"n": 0}

    async def stats(_: web.Request) -> web.Response:
        routes = {"/v1/completions": seen["n"]}
        return web.json_response({"prefill": {"requests_by_route": routes}, "decode": {}})

    async def complete(_: web.Request) -> web.Response:
        if reaches_engine:
            seen["n"] += 1
            return web.json_response({"choices": [{"index": 0, "text": "ok"}]})
        err = {"code": "context_length_exceeded", "message": "too long"}
        return web.json_response({"error": err}, status=400)

    async def faults(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/sim/stats", stats)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/sim/faults", faults)
    async with serving(app) as url:
        yield url


@pytest.mark.parametrize(("reaches", "arrived"), [(True, "prefill +1"), (False, "")])
async def test_observe_reads_ground_truth_around_the_request(reaches: bool, arrived: str) -> None:
    async with fake_sim(reaches) as sim, aiohttp.ClientSession() as http:
        client = ProbeClient(http, sim)
        seen = await client.observe(sim + "/v1/completions", {"prompt": "x"}, {})
        assert await client.sim_faults({"transfer_failure_probability": 0.0})
    assert seen.arrived == arrived
    assert seen.reply.status == (200 if reaches else 400)
    assert seen.reply.context_length_exceeded is not reaches
    assert seen.reply.texts == (["ok"] if reaches else [])


async def test_without_a_simulator_or_a_target_the_client_says_so() -> None:
    async with aiohttp.ClientSession() as http:
        client = ProbeClient(http, None)
        seen = await client.observe("http://127.0.0.1:9/v1/completions", {}, {})
        assert not await client.sim_faults({})
        assert not await ProbeClient(http, "http://127.0.0.1:9").sim_faults({})
    # No ground truth (None, not ""), and the transport failure left through the seam as
    # a reply naming the exception type, never raised.
    assert seen.arrived is None
    assert (seen.reply.status, seen.reply.error) == (0, "ClientConnectorError")
    assert seen.reply.refused()


def test_every_boundary_probe_sends_limit_minus_one_limit_and_limit_plus_one() -> None:
    assert boundary_counts(5315) == [5314, 5315, 5316]
