"""The SGLang replica's request model held against SGLang's own pydantic models, from the
release's `protocol.py` (`KVPROXY_SGLANG_PROTOCOL=/path/to/sglang/srt/entrypoints/openai/
protocol.py`: `make test` takes it from the sglang 0.5.23 wheel on PyPI, Makefile
SGLANG_PROTOCOL; a bare `pytest` without it skips this module: the engine is not a test
dependency and its code is never committed here).

protocol.py imports only pydantic, openai's types, msgspec and `sglang.utils` at module
level, so it loads on its own with those two stubbed. For fuzzed chat bodies, the replica
and SGLang must agree on refusal, on every message's `model_dump()`, every tool's, the
template kwargs, the reasoning effort and the tool choice.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from oracles import sglang
from oracles.common import Refused, Unmodelled
from oracles.corpus import CASES
from oracles.fuzz import CLASSES

PROTOCOL = os.environ.get("KVPROXY_SGLANG_PROTOCOL")
pytestmark = pytest.mark.skipif(
    not PROTOCOL, reason="KVPROXY_SGLANG_PROTOCOL names no copy of SGLang's protocol.py"
)


def _load() -> Any:
    assert PROTOCOL
    stubs = {"sglang": types.ModuleType("sglang"), "sglang.utils": types.ModuleType("sglang.utils")}
    stubs["sglang"].__path__ = []  # type: ignore[attr-defined]
    stubs["sglang.utils"].convert_json_schema_to_str = json.dumps  # type: ignore[attr-defined]
    with mock.patch.dict(sys.modules, {**stubs, "msgspec": mock.MagicMock()}):
        spec = importlib.util.spec_from_file_location("sglang_protocol_under_test", PROTOCOL)
        assert spec is not None
        assert spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses and pydantic resolve names through it
        spec.loader.exec_module(mod)
    sys.modules[spec.name] = mod
    return mod


def _theirs(protocol: Any, data: dict[str, Any]) -> Any:
    try:
        r = protocol.ChatCompletionRequest(**json.loads(json.dumps(data)))
    except Exception:
        return "refused"
    choice = r.tool_choice if isinstance(r.tool_choice, str) else r.tool_choice.model_dump()
    return {
        "messages": [m.model_dump() for m in r.messages],
        "tools": [t.model_dump() for t in r.tools] if r.tools is not None else None,
        "ctk": r.chat_template_kwargs,
        "effort": r.reasoning_effort,
        "choice": choice,
    }


def _ours(data: dict[str, Any]) -> Any:
    try:
        r = sglang.ChatRequest(json.loads(json.dumps(data)))
    except Refused:
        return "refused"
    choice = (
        r.tool_choice
        if isinstance(r.tool_choice, str)
        else {"function": r.tool_choice["function"], "type": "function"}
    )
    return {
        "messages": r.messages,
        "tools": r.tools,
        "ctk": r.chat_template_kwargs,
        "effort": r.reasoning_effort,
        "choice": choice,
    }


def _ordered(v: Any) -> Any:
    if isinstance(v, dict):
        return [(k, _ordered(x)) for k, x in v.items()]
    if isinstance(v, list):
        return [_ordered(x) for x in v]
    return v


def test_the_replica_validates_and_dumps_as_sglang_does() -> None:
    protocol = _load()
    mismatches: list[str] = []
    compared = 0

    @settings(
        max_examples=400,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def one(data: st.DataObject) -> None:
        nonlocal compared
        klass = data.draw(st.sampled_from([k for k in CLASSES if k != "routes"]))
        _route, _engine, body = data.draw(CLASSES[klass])
        parsed = sglang.parse(body)
        try:
            ours = _ours(parsed)
        except Unmodelled:
            return
        theirs = _theirs(protocol, parsed)
        compared += 1
        if _ordered(ours) != _ordered(theirs):
            mismatches.append(f"{body[:300]!r}\n  ours   {ours}\n  theirs {theirs}")

    one()
    for case in CASES:
        if case.route != "chat":
            continue
        parsed = sglang.parse(case.bytes())
        try:
            ours = _ours(parsed)
        except Unmodelled:
            continue
        compared += 1
        if _ordered(ours) != _ordered(_theirs(protocol, parsed)):
            mismatches.append(f"corpus {case.name}")
    assert compared > 200
    assert not mismatches, f"{len(mismatches)} of {compared}:\n" + "\n".join(
        m[:2000] for m in mismatches[:3]
    )
