"""One differential check: an oracle's count for a body against kvproxy's decision at the
limits that matter (one token under the engine's count, and exactly at it).

(a) Never admitted above the limit: at `limit = engine - 1` kvproxy must refuse.
(b) Exact means exact: when kvproxy reports an `exact` count, it is the engine's.
And, for legal prompts near the limit: when kvproxy refuses at `limit = engine`, how far
its number is over (the over-refusal the summary reports per template).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from oracles import sglang, smg, vllm
from oracles.common import Count, Refused, Uncountable, Unmodelled
from oracles.models import Model

ORACLES: dict[str, Callable[[Model, str, bytes], Count]] = {
    "sglang": sglang.count,
    "vllm": vllm.count,
    "smg+sglang": smg.count,
    "sglang-0.5.9": lambda m, route, body: sglang.responses_legacy(m, body),
}
# The kvproxy configuration each oracle is compared with (see kvproxy_side.ENGINE_KIND).
KVPROXY_ENGINE = {
    "sglang": "sglang",
    "vllm": "vllm",
    "smg+sglang": "smg+sglang",
    "sglang-0.5.9": "sglang",
}
# Uncountable bodies are decided at this limit: any admission is a violation.
HUGE_LIMIT = 2**31 - 1


class DecisionLike(Protocol):
    admitted: bool
    tokens: int | None
    kind: str | None


class Side(Protocol):
    def decide(self, route: str, body: bytes, limit_tokens: int) -> Any: ...


@dataclass
class Outcome:
    """What one (body, model, engine) check found."""

    status: str  # compared | engine-refused | unmodelled | uncountable
    engine_tokens: int | None = None
    problems: list[str] = field(default_factory=list)
    under: int = 0  # how many tokens over the limit a body was admitted
    over_refusal: int | None = None  # kvproxy's number minus the engine's, refused at it
    exact: bool = False  # kvproxy reported an exact count at the engine's limit


def engine_count(engine: str, model: Model, route: str, body: bytes) -> Count | str:
    """The oracle's count, or why there is none ("engine-refused", "unmodelled",
    "uncountable")."""
    try:
        return ORACLES[engine](model, route, body)
    except Refused:
        return "engine-refused"
    except Unmodelled:
        return "unmodelled"
    except Uncountable:
        return "uncountable"


def check(side: Side, engine: str, model: Model, route: str, body: bytes) -> Outcome:
    got = engine_count(engine, model, route, body)
    if got == "uncountable":
        d = side.decide(route, body, HUGE_LIMIT)
        out = Outcome("uncountable")
        if d.admitted:
            out.problems.append(
                f"admitted a body whose size the engine takes from a tensor "
                f"(kvproxy {d.tokens} {d.kind})"
            )
            out.under = HUGE_LIMIT
        return out
    if isinstance(got, str):
        return Outcome(got)
    hi = got.hi
    out = Outcome("compared", engine_tokens=hi)
    if hi >= 1:
        below = side.decide(route, body, hi - 1)
        if below.admitted:
            out.under = hi - (below.tokens or 0)
            out.problems.append(
                f"admitted at limit {hi - 1}: kvproxy {below.tokens} ({below.kind}) < engine {hi}"
            )
    at = side.decide(route, body, hi)
    if at.kind == "exact":
        out.exact = True
        if at.tokens != got.tokens:
            out.problems.append(f"kvproxy says exact {at.tokens}, the engine counts {got.tokens}")
    if not at.admitted and at.tokens is not None:
        out.over_refusal = at.tokens - hi
    return out
