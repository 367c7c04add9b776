"""The verified table held against the independent oracles (tests/oracles): for every entry,
on fuzzed bodies that use only that entry's features, kvproxy's exact count equals the
oracle's count for each engine and router the entry claims and an oracle replicates.

An entry that claims a feature kvproxy's replica gets wrong makes `differential` find a
body where kvproxy says `exact` and the oracle disagrees: the meta test below plants such an
entry and checks that it is caught.

Which oracle checks which claim (tests/oracles/versions.py pins the releases):
    sglang 0.5.23 behind none  -> oracles.sglang
    sglang 0.5.23 behind smg   -> oracles.smg (smg 1.13's rewrite, then SGLang)
    vllm 0.34.0 behind none    -> oracles.vllm
Claims for routers no oracle replicates (sglang-router, vllm-router) are only made by
entries that hold behind every router, for bodies of strings only (see the table).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from functools import cache, lru_cache
from typing import Any

import hypothesis.strategies as st
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from oracles import sglang as sglang_oracle
from oracles import smg as smg_oracle
from oracles import versions
from oracles import vllm as vllm_oracle
from oracles.common import Refused, Uncountable, Unmodelled
from oracles.models import FAMILIES, REPRESENTATIVES, load_model, model_dir

from kvproxy.prompt import parse_request
from kvproxy.prompt.fields import FieldPolicy
from kvproxy.tokens.counter import TokenCounter
from kvproxy.tokens.exact.local import load_hf
from kvproxy.tokens.gate.features import request_features
from kvproxy.tokens.gate.verified import TABLE, Entry, Verifier, verified_features
from kvproxy.tokens.replica.templates import ChatTemplate, load_template

# (engine kind, router) -> (oracle, the release it replicates)
ORACLES: dict[tuple[str, str], tuple[Any, str]] = {
    ("sglang", "none"): (sglang_oracle.count, versions.SGLANG),
    ("sglang", "smg"): (smg_oracle.count, versions.SGLANG),
    ("vllm", "none"): (vllm_oracle.count, versions.VLLM),
}


def claims(table: tuple[Entry, ...]) -> Iterator[tuple[str, str, str, frozenset[str]]]:
    """(engine, router, version, features the table verifies there) for every oracle."""
    for (engine, router), (_, version) in ORACLES.items():
        got = verified_features([(engine, version)], router, "replica", table)  # type: ignore[list-item]
        if got:
            yield engine, router, version, got


@cache
def kvproxy_model(name: str) -> tuple[Any, ChatTemplate | None]:
    local = load_hf(model_dir(name))
    return local, load_template(None, local.template)


@lru_cache(maxsize=16)
def kvproxy_counter(
    name: str, engine: str, router: str, version: str, table: tuple[Entry, ...]
) -> TokenCounter:
    """The counter for one (model, engine, router, version, table), built once: a build
    proves the template and makes its frames (~90 ms), and the fast suite's differential
    asked for ~900 of them (30 s). Evicted counters are collected, their threads with them."""
    local, template = kvproxy_model(name)
    verifier = Verifier([engine], router, table=table)  # type: ignore[list-item,arg-type]
    verifier.observe([(engine, version)])  # type: ignore[list-item]
    return TokenCounter(
        bound_rule=local.bound_rule,
        template=template,
        local=local,
        special_tokens=local.special_tokens,
        verifier=verifier,
    )


def kvproxy_count(
    name: str, engine: str, router: str, version: str, route: str, body: bytes, table: Any
) -> Any:
    """kvproxy's count of `body` with the model's tokenizer and template, the normalisation
    of `engine`, and the table read for (engine, version, router); forced past the bound."""
    _, template = kvproxy_model(name)
    if template is not None:
        # The template is shared by every counter of the model: its engine is set per count.
        template.engines = (engine,)  # type: ignore[assignment]
    counter = kvproxy_counter(name, engine, router, version, table)
    # This holds the exact count to the oracles, not the field gate (tests/prompt/
    # test_prompt_fields.py): a field the engine's request model lacks (SGLang 0.5.23 has
    # no add_generation_prompt or documents on chat) is the operator's to declare.
    counter.fields = FieldPolicy(orjson.loads(body))
    counter.early_stop = False  # the whole exact count, not a decision
    # One count at a time, each on its own loop: the counter's semaphore never waits, so
    # it binds to none of them (asyncio primitives bind on their first wait).
    return asyncio.run(counter.count(parse_request(route, body), 0))


def differential(
    table: tuple[Entry, ...], name: str, route: str, body: dict[str, Any]
) -> list[str]:
    """Problems with `table` on one body: an oracle whose claim covers the body's features
    but whose count differs from kvproxy's exact one, or a covered body kvproxy gates."""
    raw = orjson.dumps(body)
    features = request_features(route, orjson.loads(raw))
    problems = []
    model = load_model(name)
    for engine, router, version, verified in claims(table):
        if not features <= verified:
            continue  # the table does not claim this body here
        oracle, _ = ORACLES[(engine, router)]
        try:
            truth = oracle(model, route, raw).tokens
        except (Refused, Unmodelled, Uncountable):
            continue  # the engine serves nothing (or the oracle cannot say): no claim to test
        got = kvproxy_count(name, engine, router, version, route, raw, table)
        where = f"{engine} {version} behind {router} on {name}"
        if got.unverified:
            problems.append(f"{where}: gated {got.unverified} though the table verifies them")
        elif got.kind == "exact" and got.tokens != truth:
            problems.append(f"{where}: kvproxy counts {got.tokens} exactly, the engine {truth}")
    return problems


# --- bodies made of the claimed features ---------------------------------------------------

TEXT = st.sampled_from(
    ["hi", "", " ", "word " * 40, "line one\nline two\n\n", "naïve café 中文 👩‍👩‍👧", "<|im_end|>",
     "</think>", "{{ x }}", "\t tabs \r\n", "A" * 300]
)  # fmt: skip


@st.composite
def plain_chats(draw: st.DrawFn) -> dict[str, Any]:
    """Lowercase system/user/assistant turns with string content, ending on a user turn."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXT)})
    for _ in range(draw(st.integers(0, 3))):
        messages.append({"role": "user", "content": draw(TEXT)})
        messages.append({"role": "assistant", "content": draw(TEXT)})
    messages.append({"role": "user", "content": draw(TEXT)})
    return {"model": "m", "messages": messages}


WORD = st.sampled_from(["Paris", "get", "weather", "x", "naïve", "中文"])
ARGS = st.dictionaries(WORD, WORD | st.integers(-1000, 1000), max_size=3)
TOOL = st.builds(
    lambda name, desc, props: {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {"type": "object", "properties": {p: {"type": "string"} for p in props}},
        },
    },
    WORD,
    TEXT,
    st.lists(WORD, max_size=3, unique=True),
)


@st.composite
def chats(draw: st.DrawFn) -> dict[str, Any]:
    """A plain chat with some of the features the table verifies somewhere applied: each
    body is checked only against the claims that cover all of its features."""
    body = draw(plain_chats())
    messages: list[dict[str, Any]] = body["messages"]
    for mutation in draw(st.sets(st.sampled_from(MUTATIONS), max_size=3)):
        if mutation == "flag":
            body["add_generation_prompt"] = draw(st.booleans())
        elif mutation == "thinking":
            body["chat_template_kwargs"] = {"enable_thinking": draw(st.booleans())}
        elif mutation == "effort":
            body["reasoning_effort"] = draw(st.sampled_from(["low", "medium", "high"]))
        elif mutation == "name":
            messages[-1] = {**messages[-1], "name": draw(WORD)}
        elif mutation == "parts":
            text = messages[-1]["content"]
            messages[-1] = {"role": "user", "content": [{"type": "text", "text": text}]}
        elif mutation == "tool_round":
            cid = "call_" + draw(st.sampled_from(["1", "abc"]))
            args = orjson.dumps(draw(ARGS)).decode()
            call = {
                "id": cid,
                "type": "function",
                "function": {"name": draw(WORD), "arguments": args},
            }
            content = draw(st.sampled_from([None, "", "checking"]))
            messages[-1:-1] = [
                {"role": "assistant", "content": content, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": cid, "content": draw(TEXT)},
            ]
        elif mutation == "tools":
            body["tools"] = draw(st.lists(TOOL, min_size=1, max_size=2))
            if draw(st.booleans()):
                body["tool_choice"] = draw(st.sampled_from(["auto", "none", "required"]))
        elif mutation == "final_assistant":
            messages.append({"role": "assistant", "content": draw(TEXT)})
        elif mutation == "developer":
            messages.insert(0, {"role": "developer", "content": draw(TEXT)})
        elif mutation == "reasoning":
            messages[-1:-1] = [
                {"role": "assistant", "content": draw(TEXT), "reasoning_content": draw(TEXT)},
                {"role": "user", "content": draw(TEXT)},
            ]
        elif mutation == "documents":
            body["documents"] = [{"title": draw(WORD), "text": draw(TEXT)}]
    return body


MUTATIONS = (
    "flag", "thinking", "effort", "name", "parts", "tool_round", "tools", "final_assistant",
    "developer", "reasoning", "documents",
)  # fmt: skip


@st.composite
def plain_prompts(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    route = draw(st.sampled_from(["completions", "generate"]))
    if route == "completions":
        prompt: Any = draw(
            TEXT | st.lists(TEXT, min_size=2, max_size=3) | st.lists(st.integers(0, 99), min_size=1)
        )
        return route, {"model": "m", "prompt": prompt}
    text: Any = draw(TEXT | st.lists(TEXT, min_size=1, max_size=3))
    return route, {"text": text}


BODIES = st.one_of(
    chats().map(lambda b: ("chat", b)),
    plain_prompts(),
)


@pytest.mark.no_cover  # CPU-bound (~2x traced); the rest of the suite measures its lines
@settings(
    max_examples=20,  # 20 x 3 oracles on the representatives; the slow suite ~400 on every template
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.sampled_from(REPRESENTATIVES), BODIES)
def test_every_claim_of_the_table_equals_its_oracle(name: str, case: tuple[str, Any]) -> None:
    route, body = case
    assert differential(TABLE, name, route, body) == []


def test_every_oracle_is_asked_about_a_plain_chat() -> None:
    """The table claims a plain chat for every engine and router an oracle replicates."""
    assert {(e, r) for e, r, _, _ in claims(TABLE)} == set(ORACLES)


# --- a wrong entry is caught ---------------------------------------------------------------

WRONG = (
    *TABLE,
    # A false claim: that kvproxy's replica renders a capitalised role as SGLang does.
    Entry(
        "sglang",
        (versions.SGLANG, versions.SGLANG),
        frozenset({"none"}),
        frozenset({"role:case"}),
        "planted by the test",
    ),
)
SYSTEM_BODY = {
    "model": "m",
    "messages": [{"role": "System", "content": "word " * 200}, {"role": "user", "content": "hi"}],
}


def test_a_wrong_entry_makes_the_differential_fail() -> None:
    assert differential(TABLE, "qwen-3", "chat", SYSTEM_BODY) == []  # not claimed: no problem
    problems = differential(WRONG, "qwen-3", "chat", SYSTEM_BODY)
    assert len(problems) == 1
    assert problems[0].startswith(f"sglang {versions.SGLANG} behind none on qwen-3: kvproxy counts")


# transformers 5.24 (what the engines tokenize with) rebuilds these models' GPT2Tokenizer
# from its own defaults instead of tokenizer.json (`MiniMax-M2` -> `-`, `M` where the file
# keeps `-M`; no NFC): the file alone counted 36 tokens on PROBE where the engine counts 40.
# kvproxy now counts with both pipelines and takes the larger, as an upper bound
# (tokens.replica.hfbuild; every shipped tokenizer is held to transformers in test_tokens_hfbuild).
REBUILT = frozenset({"minimax", "minimax-m1-40k", "minimax-text-01"})
PROBE = "You are MiniMax-M2.7, built 2026-12-03 by A-Team. x-y z-Z 3.5-7B naïve 中文 it's"


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.parametrize("name", sorted(REBUILT))
def test_kvproxy_never_counts_text_below_the_engines_tokenizer(name: str) -> None:
    local, _ = kvproxy_model(name)
    ours, exact = local.count((PROBE,))
    assert ours == len(load_model(name).encode(PROBE, add_special_tokens=False))
    assert not exact  # the engine may also load the file as it is: never called exact


# One test per template family (45 examples each, ~400 in all): the sweep phase of
# `make test-slow` spreads them over the cores (one test of 400 was 253 s on one core).
@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=45, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_claim_on_every_shipped_template(family: str, data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(FAMILIES[family]), label="model")
    route, body = data.draw(BODIES, label="body")
    assert differential(TABLE, name, route, body) == []
