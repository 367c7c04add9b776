"""The verified table and the gate (kvproxy.tokens.gate.verified, TokenCounter): the exact count
admits only requests whose every feature is verified for the engines and router in front;
anything else is decided by the guaranteed bound, and a rejection says which feature forced
it. Sans-IO for the table and the counter; one run through `kvproxy serve` at the end."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from functools import cache
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from chat_reference import Reference, load_reference, model_dir
from kvtest import FakeUpstream, static_engines
from ports import free_port

from kvproxy.policy.errors import KvproxyError
from kvproxy.prompt import parse_request
from kvproxy.tokens import build_counter
from kvproxy.tokens.counter import TokenCounter
from kvproxy.tokens.exact.local import load_hf
from kvproxy.tokens.gate.features import FEATURES, request_features
from kvproxy.tokens.gate.verified import (
    ALL_ROUTERS,
    PLAIN_CHAT,
    TABLE,
    Entry,
    Verifier,
    parse_version,
    verified_features,
)
from kvproxy.tokens.replica.templates import load_template

W = "word " * 200  # ~200 tokens of content, ~1,000 bytes


# --- the table -----------------------------------------------------------------------------


def test_every_entry_names_only_known_features_and_evidence() -> None:
    for entry in TABLE:
        assert entry.features <= FEATURES, entry.evidence
        assert entry.evidence
        assert entry.routers <= ALL_ROUTERS
        if entry.versions is not None:
            assert all(parse_version(v) is not None for v in entry.versions)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("0.5.9", (0, 5, 9)),
        ("v0.11.0", (0, 11, 0)),
        ("0.5.9.post1", (0, 5, 9)),
        ("0.11.0+cu128", (0, 11, 0)),
        ("0.5.10rc1", None),
        ("0.5.9.dev3+g1234", None),
        ("0.5.21-sim", None),
        ("", None),
        (None, None),
    ],
)
def test_only_plain_releases_have_a_version(text: str | None, parsed: Any) -> None:
    assert parse_version(text) == parsed


SYNTHETIC = (
    Entry("*", None, ALL_ROUTERS, frozenset({"route:chat"}), "floor"),
    Entry("sglang", ("0.5.9", "0.5.9"), frozenset({"none"}), frozenset({"role:case"}), "s"),
    Entry("sglang", ("0.5.0", "0.5.9"), frozenset({"smg", "none"}), frozenset({"tools"}), "r"),
    Entry("vllm", None, frozenset({"none"}), frozenset({"documents"}), "v"),
)


@pytest.mark.parametrize(
    ("engines", "router", "expected"),
    [
        ([("sglang", "0.5.9")], "none", {"route:chat", "role:case", "tools"}),
        ([("sglang", "0.5.9.post2")], "none", {"route:chat", "role:case", "tools"}),
        ([("sglang", "0.5.9")], "smg", {"route:chat", "tools"}),
        ([("sglang", "0.5.3")], "none", {"route:chat", "tools"}),
        ([("sglang", "0.5.10")], "none", {"route:chat"}),
        ([("sglang", "0.4.9")], "none", {"route:chat"}),
        # Unknown version: only entries for every version.
        ([("sglang", None)], "none", {"route:chat"}),
        ([("sglang", "0.5.9rc1")], "none", {"route:chat"}),
        # Unknown router: only entries for every router.
        ([("sglang", "0.5.9")], None, {"route:chat"}),
        ([("vllm", "0.11.0")], "none", {"route:chat", "documents"}),
        ([("vllm", None)], "none", {"route:chat", "documents"}),
        # Several engines: what holds for all of them.
        ([("sglang", "0.5.9"), ("sglang", "0.5.3")], "none", {"route:chat", "tools"}),
        ([("sglang", "0.5.9"), ("vllm", "0.11.0")], "none", {"route:chat"}),
        # A static pool could be either engine, at any version.
        ([("static", None)], "none", {"route:chat"}),
        ([], "none", set()),
    ],
)
def test_lookup(engines: list[Any], router: Any, expected: set[str]) -> None:
    assert verified_features(engines, router, "replica", SYNTHETIC) == expected


def test_the_shipped_floor_is_a_plain_chat_for_any_engine_behind_any_router() -> None:
    for kind in ("sglang", "vllm", "static"):
        for router in (*ALL_ROUTERS, None):
            assert verified_features([(kind, None)], router) >= PLAIN_CHAT  # type: ignore[list-item]


def test_the_verifier_follows_versions_and_the_detected_router() -> None:
    v = Verifier(["sglang"], "auto", table=SYNTHETIC)
    assert v.verified() == {"route:chat"}
    assert v.describe() == "sglang version unknown behind an undetected router"
    assert v.observe([("sglang", "0.5.9")], ("none", "GET /server_info ..."))
    assert v.verified() == {"route:chat", "role:case", "tools"}
    assert v.unverified({"route:chat", "role:case", "number:float"}) == ["number:float"]
    assert not v.observe([("sglang", "0.5.9")], ("none", "again"))  # nothing changed
    assert v.observe(None, (None, "the router stopped answering"))
    assert v.verified() == {"route:chat"}
    assert v.to_json()["router_evidence"] == "the router stopped answering"


def test_a_configured_router_is_not_overridden_by_detection() -> None:
    v = Verifier(["sglang"], "smg", table=SYNTHETIC)
    v.observe([("sglang", "0.5.9")], ("none", "looks direct"))
    assert v.router == "smg"
    assert v.verified() == {"route:chat", "tools"}


# --- the gate, in the counter --------------------------------------------------------------


@cache
def qwen3() -> tuple[Any, Any]:
    d = model_dir("qwen-3")
    local = load_hf(d)
    template = load_template(None, local.template)
    return local, template


@cache
def reference() -> Reference:
    return load_reference(model_dir("qwen-3"))


def transformers_count(body: dict[str, Any]) -> int:
    """What any engine renders for a plain chat: transformers' own apply_chat_template."""
    ref = reference()
    ids = ref.tokenizer.apply_chat_template(
        body["messages"], chat_template=ref.template, add_generation_prompt=True,
        tokenize=True, return_dict=False,
    )  # fmt: skip
    return len(ids)


def counter(verifier: Verifier | None) -> TokenCounter:
    local, template = qwen3()
    return TokenCounter(
        bound_rule=local.bound_rule,
        template=template,
        local=local,
        special_tokens=local.special_tokens,
        verifier=verifier,
    )


def shape(body: dict[str, Any]) -> Any:
    return parse_request("chat", orjson.dumps(body))


def plain_at(tokens: int) -> dict[str, Any]:
    """A lowercase user/system chat whose transformers count is exactly `tokens`."""
    for k in range(1, 400):
        body = {"messages": [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": ("word " * k).strip()}]}  # fmt: skip
        n = transformers_count(body)
        if n == tokens:
            return body
        if n > tokens:
            break
    raise AssertionError(f"no plain chat of exactly {tokens} tokens")


# The issue's body: kvproxy's replica drops the capitalised turn (exact count 9, bound 52 on
# Qwen-3), SGLang lower-cases the role and renders ~215 tokens.
SYSTEM_BODY = {"messages": [{"role": "System", "content": W}, {"role": "user", "content": "hi"}]}


async def test_an_unverified_feature_is_decided_by_the_bound() -> None:
    c = counter(Verifier(["static"], "auto"))
    try:
        got = await c.count(shape(SYSTEM_BODY), 50)
    finally:
        await c.aclose()
    assert got.unverified == ("role:case",)
    assert (got.method, got.exact, got.kind) == ("bound", False, "upper-bound")
    assert got.tokens == got.bound
    assert got.verified_for == "static version unknown behind an undetected router"


async def test_without_a_verifier_the_old_exact_count_admits_the_system_body() -> None:
    """The hole this closes: kvproxy's replica drops the capitalised role's message, and its
    exact count (9 tokens) admitted a body the engine renders at ~215."""
    c = counter(None)
    try:
        got = await c.count(shape(SYSTEM_BODY), 50)
    finally:
        await c.aclose()
    assert got.exact
    assert got.tokens < 50
    lowered = [{**m, "role": m["role"].lower()} for m in SYSTEM_BODY["messages"]]
    assert transformers_count({"messages": lowered}) > 200


async def test_a_verified_plain_chat_at_exactly_the_limit_is_counted_exactly() -> None:
    body = plain_at(50)
    c = counter(Verifier(["static"], "auto"))
    try:
        got = await c.count(shape(body), 50)
        over = await c.count(shape(plain_at(51)), 50)
    finally:
        await c.aclose()
    assert (got.tokens, got.kind, got.unverified) == (50, "exact", ())
    assert over.tokens > 50
    assert over.kind in ("exact", "lower-bound")
    assert not over.unverified


async def test_a_bound_that_admits_needs_no_verification() -> None:
    """Far below the limit the bound admits whatever the features: nothing is gated."""
    c = counter(Verifier(["static"], "auto"))
    try:
        got = await c.count(shape(SYSTEM_BODY), 100_000)
    finally:
        await c.aclose()
    assert got.method == "bound"
    assert not got.unverified


async def test_a_tokenizer_without_a_guaranteed_bound_refuses_unverified_requests() -> None:
    local, template = qwen3()
    c = TokenCounter(
        bound_rule=None, template=template, local=local, verifier=Verifier(["static"], "auto")
    )
    try:
        with pytest.raises(KvproxyError) as info:
            await c.count(shape(SYSTEM_BODY), 100_000)
        plain = await c.count(shape(plain_at(40)), 100_000)
    finally:
        await c.aclose()
    assert info.value.status == 400
    assert info.value.extra["unverified_features"] == ["role:case"]
    assert plain.kind == "exact"


async def test_the_engine_path_reads_the_engine_truth_entry() -> None:
    """vLLM's /tokenize renders the client's fields: behind no router the capitalised role
    is the engine's own business, so the engine's count may admit it."""

    class Engine:
        accepts_messages = True
        seen: list[Any] = []

        async def __call__(self, request: Any) -> int:
            self.seen.append(request.fields)
            return 215

    engine = Engine()
    v = Verifier(["vllm"], "none")
    c = TokenCounter(bound_rule="nfc", engine=engine, verifier=v)
    try:
        got = await c.count(shape(SYSTEM_BODY), 300)
        gated = await c.count(shape({**SYSTEM_BODY, "documents": [{"text": "x"}]}), 300)
    finally:
        await c.aclose()
    assert (got.tokens, got.method, got.unverified) == (215, "engine", ())
    assert engine.seen == [SYSTEM_BODY]
    assert gated.unverified == ("documents",)
    # Behind an undetected router the chat body may change on its way: only the floor.
    assert "role:case" not in Verifier(["vllm"], "auto").verified("engine")


def test_build_counter_gives_every_counter_a_verifier() -> None:
    from kvproxy.config import load_settings

    s = load_settings(engines=static_engines(50), router_kind="smg")
    c = build_counter(s)
    assert c.verifier is not None
    assert c.verifier.router == "smg"
    assert c.verifier.describe() == "static version unknown behind smg"


def test_features_of_the_issue_body() -> None:
    assert "role:case" in request_features("chat", SYSTEM_BODY)


# --- through kvproxy serve -------------------------------------------------------------------


async def _serve(upstream: FakeUpstream, capacity: int) -> tuple[Any, str, str]:
    port, admin = free_port(), free_port()
    env = {
        **os.environ,
        "KVPROXY_LISTEN": f"127.0.0.1:{port}",
        "KVPROXY_ADMIN_LISTEN": f"127.0.0.1:{admin}",
        "KVPROXY_UPSTREAM": upstream.url,
        "KVPROXY_ENGINES": json.dumps(static_engines(capacity=capacity)),
        "KVPROXY_TOKENIZER": f"hf:{model_dir('qwen-3')}",
        "KVPROXY_ACCESS_LOG": "false",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvproxy", "serve", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    async with aiohttp.ClientSession() as http:
        for _ in range(1200):  # bounded: the tokenizer loads and is verified at start
            if proc.returncode is not None:
                raise AssertionError(f"kvproxy serve exited with {proc.returncode}")
            try:
                async with http.get(f"http://127.0.0.1:{admin}/readyz") as r:
                    if r.status == 200:
                        return proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
    proc.kill()
    await proc.wait()
    raise AssertionError("kvproxy serve never became ready")


async def test_serve_refuses_the_system_role_body_and_admits_a_plain_chat_at_the_limit(
    upstream: FakeUpstream,
) -> None:
    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": []})

    upstream.route("POST", "/v1/chat/completions", ok)
    await upstream.start()
    plain = {**plain_at(50), "model": "m"}
    proc, url, admin = await _serve(upstream, capacity=50)
    try:
        async with aiohttp.ClientSession() as http:
            body = {**SYSTEM_BODY, "model": "m"}
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                refused = (resp.status, dict(resp.headers), await resp.json())
            assert upstream.received == []  # I7: it never reached the upstream
            async with http.post(url + "/v1/chat/completions", json=plain) as resp:
                admitted = (resp.status, dict(resp.headers))
            async with http.get(admin + "/metrics") as resp:
                scraped = await resp.text()
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
    status, headers, reply = refused
    assert status == 400, reply
    assert headers["X-Kvproxy-Prompt-Tokens-Kind"] == "upper-bound"
    error = reply["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["count_reason"] == "unverified_feature"
    assert error["unverified_features"] == ["role:case"]
    assert error["prompt_tokens_kind"] == "upper-bound"
    assert "role:case" in error["message"]
    assert error["prompt_tokens"] > error["limit_tokens"] == 50
    status, headers = admitted
    assert status == 200
    assert (headers["X-Kvproxy-Prompt-Tokens"], headers["X-Kvproxy-Prompt-Tokens-Kind"]) == (
        "50",
        "exact",
    )
    assert len(upstream.received) == 1
    # The operator's view: one withheld exact count, labelled by the feature (never content).
    assert 'kvproxy_unverified_features_total{feature="role:case",model="default"} 1.0' in scraped


async def test_a_large_body_is_gated_off_the_loop_too() -> None:
    """Past the inline size the plan (and the feature read) runs in a worker: same gate."""
    big = {"messages": [{"role": "System", "content": "word " * 5000}, SYSTEM_BODY["messages"][1]]}
    c = counter(Verifier(["static"], "auto"))
    try:
        got = await c.count(shape(big), 40)
    finally:
        await c.aclose()
    assert got.unverified == ("role:case",)
    assert got.kind == "upper-bound"
    assert got.tokens > 40


async def test_a_text_prompt_whose_special_tokens_are_in_doubt_is_an_upper_bound() -> None:
    """DeepSeek-V3's tokenizer_config asks for a BOS its tokenizer.json does not add, and
    transformers 5 (the engines) follows tokenizer.json: kvproxy counts the larger, so the
    count is an upper bound, never reported exact. Qwen-3 has no such doubt."""
    deepseek = load_hf(model_dir("deepseek-v3"))
    assert not deepseek.special_tokens_exact
    assert qwen3()[0].special_tokens_exact
    body = b'{"model": "m", "prompt": "hi"}'
    for local, kind in ((deepseek, "upper-bound"), (qwen3()[0], "exact")):
        c = TokenCounter(
            bound_rule=local.bound_rule,
            local=local,
            special_tokens=local.special_tokens,
            verifier=Verifier(["sglang"], "none"),
        )
        try:
            got = await c.count(parse_request("completions", body), 0)
        finally:
            await c.aclose()
        assert got.kind == kind
