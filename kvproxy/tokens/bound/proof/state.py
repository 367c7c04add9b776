"""What the template proof knows at one point of a template (`State`), a loop's iteration
(`Loop`), the roots and globals a template reads, and the `Analyzer` face the expression
operations (`ops`, `filters`) call back into. Pure; the lowest floor of `tokens.bound.proof`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import jinja2.nodes as nodes

from kvproxy.tokens.bound.proof import sizes as sz
from kvproxy.tokens.bound.proof.sizes import LIST, NONE, UNDEF, Poly, Value

FIXED_ROOTS: dict[str, frozenset[str]] = {
    "messages": frozenset({LIST}),
    "tools": frozenset({LIST, NONE, UNDEF}),
    "documents": frozenset({LIST, NONE, UNDEF}),
}
# jinja2's and transformers' globals (templates.py / sandbox.py set up the same ones).
GLOBALS = frozenset(
    {"range", "dict", "namespace", "lipsum", "cycler", "joiner", "raise_exception",
     "strftime_now"}
)  # fmt: skip
KW = "kw:"  # root prefix of the names a request or the tokenizer may supply
MAX_FIXPOINT = 12


@dataclass
class State:
    """What the analysis knows at one point: names in scope, namespace attributes (shared by
    every frame), type refinements from enclosing `is` tests, and the template-level names a
    macro sees (`top`; None when this frame is the template level itself)."""

    names: dict[str, Value]
    ns: dict[int, dict[str, Value]]
    refine: dict[str, frozenset[str]] = field(default_factory=dict)
    top: dict[str, Value] | None = None
    # The conditions leading here contradict what the values can be: the path never runs.
    infeasible: bool = False
    # Equality facts from enclosing `==` tests against constants: key -> (the constants it
    # may equal, None for any; the constants it certainly does not equal).
    facts: dict[str, tuple[frozenset[Any] | None, frozenset[Any]]] = field(default_factory=dict)

    def copy(self) -> State:
        return State(
            dict(self.names),
            {k: dict(v) for k, v in self.ns.items()},
            dict(self.refine),
            self.top,
            self.infeasible,
            dict(self.facts),
        )

    def template_names(self) -> dict[str, Value]:
        return self.names if self.top is None else self.top


@dataclass(frozen=True)
class Loop:
    """The iteration a `for` makes: `elem(var)` maps a variable of the element (its root is
    the loop's symbol) to the sum of that variable over every iteration; `count` bounds the
    number of iterations (None: unbounded)."""

    symbol: str
    elem: Callable[[sz.Var], Poly]
    count: Poly | None
    kinds: frozenset[str]
    items: bool = False


class Analyzer(Protocol):
    """The statements' side of the proof, as the expression operations see it: evaluate a
    sub-expression, call a macro, mint an id for a namespace."""

    def expr(self, node: nodes.Node, st: State) -> Value: ...

    def call_macro(
        self, mid: int, args: list[Value], kwargs: dict[str, Value], st: State
    ) -> Value: ...

    def new_id(self) -> int: ...

    def lookup(self, name: str, st: State) -> Value: ...

    def refine(self, test: nodes.Node, truth: bool, st: State) -> None: ...


def concat(a: Value, b: Value) -> Value:
    return sz.as_string(sz.add(a.P, b.P), sz.add(a.X, b.X), a.case_mapped or b.case_mapped)


def join_all(vals: list[Value]) -> Value:
    out = vals[0]
    for v in vals[1:]:
        out = sz.join_values(out, v)
    return out


def key_of(node: nodes.Node) -> str | None:
    """A stable name for a Name/attribute/constant-index chain, for type refinement."""
    if isinstance(node, nodes.Name):
        return node.name
    if isinstance(node, nodes.Getattr):
        base = key_of(node.node)
        return None if base is None else f"{base}.{node.attr}"
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        base = key_of(node.node)
        return None if base is None else f"{base}.{node.arg.value}"
    return None
