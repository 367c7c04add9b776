"""The field gate (kvproxy/prompt/fields.py): every top-level field of a counted route is in
the table for the engines in front, or refused with 400 unsupported_field naming it; and the
SGLang tables held to SGLang's own OpenAI request models (protocol.py of the release, as the
oracle test loads it: `make test` sets KVPROXY_SGLANG_PROTOCOL). vLLM's are held to its models
in tests/engine_models (`make test-real`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from typing import Any
from unittest import mock

import orjson
import pytest

from kvproxy.policy.errors import KvproxyError
from kvproxy.prompt import fields, parse_request
from kvproxy.prompt.fields import FieldPolicy
from kvproxy.tokens.counter import TokenCounter

VLLM = (("vllm", "0.32.0"),)
SGLANG = (("sglang", "0.5.23"),)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refused(policy: FieldPolicy, route: str, body: dict[str, Any], engines: Any) -> KvproxyError:
    with pytest.raises(KvproxyError) as info:
        policy.check(route, body, engines)
    return info.value


def test_an_unknown_field_is_refused_naming_it() -> None:
    err = refused(FieldPolicy(), "chat", {**CHAT, "brand_new_field": 1}, VLLM)
    assert (err.status, err.code, err.param) == (400, "unsupported_field", "brand_new_field")
    assert "brand_new_field" in err.message
    assert "vllm 0.32.0" in err.message


def test_known_fields_pass_and_the_table_is_per_engine_version() -> None:
    body = {**CHAT, "temperature": 0.5, "add_generation_prompt": True, "documents": []}
    assert FieldPolicy().check("chat", body, VLLM) is False
    # SGLang 0.5.23's ChatCompletionRequest has no add_generation_prompt (it ignores it):
    # behind it, the field is refused rather than trusted to be dropped.
    assert refused(FieldPolicy(), "chat", body, SGLANG).param == "add_generation_prompt"
    # SGLang-only fields are refused behind vLLM, and the reverse.
    assert refused(FieldPolicy(), "chat", {**CHAT, "images_config": {}}, VLLM).param
    assert refused(FieldPolicy(), "chat", {**CHAT, "vllm_xargs": {}}, SGLANG).param


def test_unknown_versions_and_static_pools_get_the_union_at_its_strictest() -> None:
    union = fields.table_for((("static", None),))
    for engines in ((("vllm", "0.99.0"),), (("vllm", None),), (("sglang", "0.5.24rc1"),)):
        table = fields.table_for(engines)
        assert set(table["chat"]) <= set(union["chat"])
    # Both kinds' fields are known for a static pool.
    assert {"images_config", "vllm_xargs"} <= set(union["chat"])
    # A new release's field is refused until a table names it.
    refused(FieldPolicy(), "chat", {**CHAT, "brand_new_field": 1}, (("vllm", "0.99.0"),))
    # A refused class wins over a lenient one across tables.
    assert union["completions"]["prompt_embeds"] == "refused"


@pytest.mark.parametrize(
    ("route", "field"),
    [
        ("chat", "chat_template"),
        ("responses", "previous_response_id"),
        ("responses", "prompt"),
        ("completions", "prompt_embeds"),
        ("embeddings", "padding"),
        ("chat", "ec_transfer_params"),
    ],
)
def test_refused_fields(route: str, field: str) -> None:
    err = refused(FieldPolicy(), route, {"model": "m", field: "x"}, VLLM)
    assert (err.code, err.param) == ("unsupported_field", field)


def test_a_request_template_is_refused_unless_trusted() -> None:
    body = {**CHAT, "chat_template": "{{ messages[0]['content'] }}"}
    assert refused(FieldPolicy(), "chat", body, VLLM).param == "chat_template"
    kwargs = {**CHAT, "chat_template_kwargs": {"chat_template": "x"}}
    assert refused(FieldPolicy(), "chat", kwargs, VLLM).param == (
        "chat_template_kwargs.chat_template"
    )
    trusted = FieldPolicy(trust_request_template=True)
    assert trusted.check("chat", body, VLLM) is True
    assert trusted.check("chat", kwargs, VLLM) is True


def test_extra_neutral_fields_widen_only_by_name() -> None:
    policy = FieldPolicy(["x_trace"])
    assert policy.check("chat", {**CHAT, "x_trace": "abc"}, VLLM) is False
    # It never turns a refused field into an accepted one.
    assert refused(FieldPolicy(["chat_template"]), "chat", {**CHAT, "chat_template": "t"}, VLLM)


async def test_the_counter_refuses_before_counting() -> None:
    c = TokenCounter(bound_rule="bytes")
    try:
        shape = parse_request("chat", orjson.dumps({**CHAT, "brand_new_field": 1}))
        with pytest.raises(KvproxyError) as info:
            await c.count(shape, 10**6)
    finally:
        await c.aclose()
    assert info.value.code == "unsupported_field"


async def test_a_trusted_request_template_is_bounded_by_its_own_proof() -> None:
    template = "{% for i in range(3000) %}x {% endfor %}{{ messages[0]['content'] }}"
    c = TokenCounter(bound_rule="bytes", fields=FieldPolicy(trust_request_template=True))
    try:
        shape = parse_request("chat", orjson.dumps({**CHAT, "chat_template": template}))
        got = await c.count(shape, 10**6)
    finally:
        await c.aclose()
    # The template prints 3,000 "x " before the message: 6,000 bytes at least.
    assert got.tokens >= 6000
    assert not got.exact
    assert got.unverified == ("chat_template",)


# --- SGLang's OpenAI request models (protocol.py) ------------------------------------------

PROTOCOL = os.environ.get("KVPROXY_SGLANG_PROTOCOL")
SGLANG_MODELS = {
    "chat": "ChatCompletionRequest",
    "completions": "CompletionRequest",
    "embeddings": "EmbeddingRequest",
    "classify": "ClassifyRequest",
    "score": "ScoringRequest",
    "rerank": "V1RerankReqInput",
    "responses": "ResponsesRequest",
}


def _protocol_fields() -> dict[str, set[str]]:
    assert PROTOCOL
    stubs = {"sglang": types.ModuleType("sglang"), "sglang.utils": types.ModuleType("sglang.utils")}
    stubs["sglang"].__path__ = []  # type: ignore[attr-defined]
    stubs["sglang.utils"].convert_json_schema_to_str = json.dumps  # type: ignore[attr-defined]
    with mock.patch.dict(sys.modules, {**stubs, "msgspec": mock.MagicMock()}):
        spec = importlib.util.spec_from_file_location("sglang_protocol_fields", PROTOCOL)
        assert spec is not None
        assert spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return {
        route: {f.alias or k for k, f in getattr(mod, cls).model_fields.items()}
        for route, cls in SGLANG_MODELS.items()
    }


def _diff(table: dict[str, dict[str, Any]], engine: dict[str, set[str]]) -> dict[str, Any]:
    return {
        r: (sorted(names - set(table[r])), sorted(set(table[r]) - names))
        for r, names in engine.items()
        if names != set(table[r])
    }


@pytest.mark.skipif(not PROTOCOL, reason="KVPROXY_SGLANG_PROTOCOL names no protocol.py")
def test_sglang_table_is_sglangs_request_models() -> None:
    engine = _protocol_fields()
    assert _diff(fields.SGLANG_0_5_23, engine) == {}
    # The check's own mutation: one entry removed from the table fails it.
    mutated = {r: dict(t) for r, t in fields.SGLANG_0_5_23.items()}
    del mutated["chat"]["mm_processor_kwargs"]
    assert _diff(mutated, engine) == {"chat": (["mm_processor_kwargs"], [])}
