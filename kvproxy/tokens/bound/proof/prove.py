"""The template proof: how many bytes a chat template can print, as a function of the data it is
handed, whatever that data is. Pure, no I/O; runs once per template at start-up.

`prove(source)` interprets the template's jinja2 AST abstractly (the algebra is
`proof.sizes`): every expression evaluates to upper bounds on its measures, every output
node adds the printed size of what it prints, and the result is a polynomial over the
measures of the template's inputs (`messages`, `tools`, `documents`, and every name the
template reads without setting it: the request's chat_template_kwargs and the tokenizer's
special tokens can supply any of them). The proof is path-insensitive: both sides of every
`if` are taken (their maximum), every loop runs over all of its iterable, so what a role
spelling, a flag or a content type selects never lowers the bound.

Loops are where multiplicity comes from, and the proof sums them exactly:
  * output that reads the loop's element (`message.content` in `for message in messages`)
    sums, over the iterations, to the measure of the iterable (`messages[*].content`);
  * output that does not (static text, `messages[0].content`) is multiplied by the
    iteration count (the iterable's children);
  * namespace attributes carry state across iterations: an attribute that only grows by a
    sum (`ns.text = ns.text + m.content`) is bounded by its start plus that sum over all
    iterations, one that is overwritten by the largest value it takes; any other update
    (`ns.x = ns.x + ns.x`, mutual recursion) is refused.
Recursive macros get a summary proven by a fixpoint (each call costs at most a polynomial of
its arguments' measures; the body under that hypothesis must stay within it).

Anything whose output size the proof cannot bound (an unknown filter or method, string
repetition by a request value, `{% include %}`, autoescape...) raises `Unproven` naming it:
for that template, the guarantee falls back to no shortcut (tokens.bound.guarantee).

Never renders the template, never sees a request.
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2
import jinja2.nodes as nodes

import kvproxy.tokens.bound.proof.sizes as sz
from kvproxy.tokens.bound.proof.loops import Loops
from kvproxy.tokens.bound.proof.sizes import (
    DICT,
    LIST,
    STR,
    UNDEF,
    Poly,
    Unproven,
    Value,
)
from kvproxy.tokens.bound.proof.state import FIXED_ROOTS, GLOBALS, KW, MAX_FIXPOINT, State
from kvproxy.tokens.replica import Sandbox, environment

__all__ = ["FIXED_ROOTS", "GLOBALS", "KW", "TemplateProof", "prove"]


@dataclass(frozen=True)
class TemplateProof:
    """The proven output size: `out` is a polynomial over the roots' measures bounding the
    bytes of any render. `kwargs` are the names the template reads that a request or the
    tokenizer may supply; `case_mapped` is set when a case mapping of request text can reach
    the output (NFC may then compose it differently, tokens.bound.guarantee)."""

    out: Poly
    kwargs: frozenset[str]
    case_mapped: bool


def prove(
    source: str, *, tools: bool = True, kwargs: bool = True, specials: frozenset[str] = frozenset()
) -> TemplateProof:
    """The proof for one template source; raises Unproven naming what could not be bounded.

    `tools=False` proves it for requests without tools (the template's `tools` is None or
    empty, so `{% if tools %}` is not taken); `kwargs=False` for requests whose every other
    field is one no engine hands the template (then only `specials`, the tokenizer's
    special tokens, are defined among the names the template reads)."""
    try:
        ast = environment(Sandbox).parse(source)
    except jinja2.TemplateError as exc:
        raise Unproven(f"the template does not parse: {exc.message}") from None
    analyzer = _Analyzer(ast)
    analyzer.with_tools = tools
    analyzer.with_kwargs = kwargs
    analyzer.specials = specials
    out = analyzer.run()
    return TemplateProof(out.P, frozenset(analyzer.kwargs), analyzer.case_mapped or out.case_mapped)


class _Analyzer(Loops):
    """The whole analysis: statements and names (Core), loops (Loops), macros (here)."""

    def call_macro(self, mid: int, args: list[Value], kwargs: dict[str, Value], st: State) -> Value:
        macro = self.macros[mid]
        if any(
            isinstance(n, nodes.Name) and n.name == "caller" for n in macro.find_all(nodes.Name)
        ):
            raise Unproven("macros called with a caller block are not modelled")
        if mid in self.stack:
            self.recursive.add(mid)
            if mid not in self.summaries:
                raise _Recursion(mid)
            summary, params = self.summaries[mid]
            bound = self._bind(macro, args, kwargs, st)
            return self._instantiate(mid, summary, params, bound)
        if self._calls_itself(macro):
            return self._call_recursive(mid, macro, args, kwargs, st)
        bound = self._bind(macro, args, kwargs, st)
        inner = State(dict(bound), st.ns, {}, st.template_names())
        self.stack.append(mid)
        try:
            out = self.block(macro.body, inner)
        finally:
            self.stack.pop()
        if not out.dead:
            st.ns = inner.ns
        return out

    def _calls_itself(self, macro: nodes.Macro) -> bool:
        return any(
            isinstance(c.node, nodes.Name) and c.node.name == macro.name
            for c in macro.find_all(nodes.Call)
        )

    def _bind(
        self, macro: nodes.Macro, args: list[Value], kwargs: dict[str, Value], st: State
    ) -> dict[str, Value]:
        names = [a.name for a in macro.args]
        defaults = dict(zip(names[len(names) - len(macro.defaults) :], macro.defaults, strict=True))
        bound: dict[str, Value] = {}
        for i, name in enumerate(names):
            if i < len(args):
                bound[name] = args[i]
            elif name in kwargs:
                bound[name] = kwargs.pop(name)
            elif name in defaults:
                bound[name] = self.expr(defaults[name], st)
            else:
                bound[name] = Value(kinds=frozenset({UNDEF}))
        extra = args[len(names) :]
        bound["varargs"] = sz.sum_values(*extra, kinds=frozenset({LIST})) if extra else sz.EMPTY
        bound["kwargs"] = sz.sum_values(*kwargs.values(), kinds=frozenset({DICT}))
        return bound

    def _call_recursive(
        self, mid: int, macro: nodes.Macro, args: list[Value], kwargs: dict[str, Value],
        st: State,
    ) -> Value:  # fmt: skip
        if mid not in self.summaries:
            params = (*(a.name for a in macro.args), "varargs", "kwargs")
            symbolic = {p: sz.data((f"M{mid}:{p}",)) for p in params}
            summary = sz.EMPTY
            for _ in range(MAX_FIXPOINT):
                self.summaries[mid] = (summary, params)
                inner = State(dict(symbolic), {k: dict(v) for k, v in st.ns.items()}, {},
                              st.template_names())  # fmt: skip
                self.stack.append(mid)
                try:
                    out = self.block(macro.body, inner)
                finally:
                    self.stack.pop()
                if inner.ns != st.ns:
                    raise Unproven("a recursive macro sets namespace attributes")
                widened = _widen(out, [f"M{mid}:{p}" for p in params])
                if _value_leq(widened, summary):
                    break
                summary = widened
            else:
                raise Unproven(f"no bound found for the recursive macro {macro.name}")
            self.summaries[mid] = (summary, params)
        summary, params = self.summaries[mid]
        bound = self._bind(macro, args, kwargs, st)
        return self._instantiate(mid, summary, params, bound)

    def _instantiate(
        self, mid: int, summary: Value, params: tuple[str, ...], bound: dict[str, Value]
    ) -> Value:
        roots = {f"M{mid}:{p}": bound.get(p, sz.EMPTY) for p in params}

        def rep(v: sz.Var) -> Poly | None:
            arg = roots.get(v[1][0])
            return None if arg is None else arg.measure(v[0])

        return Value(
            P=sz.substitute(summary.P, rep),
            X=sz.substitute(summary.X, rep),
            kinds=frozenset({STR}),
            case_mapped=summary.case_mapped or any(b.case_mapped for b in bound.values()),
        )


class _Recursion(Unproven):
    def __init__(self, mid: int) -> None:
        super().__init__(f"macro {mid} recursion before its summary")


# --- helpers ------------------------------------------------------------------------------------


def _widen(v: Value, roots: list[str]) -> Value:
    """A summary at the parameters' top level: every variable below a parameter is replaced
    by the parameter's own, with the per-root factors of `sizes` (so a fixpoint over a
    recursion through sub-parts can close). Terms are grouped by their factors outside the
    parameter, so `C(val[*]) * D(ns)` widens with the same entity count as `C(val[*])`."""

    def widen_root(poly: Poly, root: str) -> Poly:
        out: dict[sz.Mono, int] = {}
        groups: dict[sz.Mono, dict[sz.Mono, int]] = {}
        for mono, c in poly.items():
            mine = [x for x in mono if x[1][0] == root]
            rest = tuple(x for x in mono if x[1][0] != root)
            if len(mine) == 1:
                groups.setdefault(rest, {})[(mine[0],)] = c
                continue
            mono2 = tuple(sorted((*rest, *(_top_var(x, roots) for x in mine))))
            out[mono2] = out.get(mono2, 0) + c
        for rest, terms in groups.items():
            for meas, coef in _root_linear(terms, root):
                key = tuple(sorted((*rest, (meas, (root,)))))
                out[key] = out.get(key, 0) + coef
        return out

    def widen_poly(poly: Poly) -> Poly:
        for root in roots:
            poly = widen_root(poly, root)
        return poly

    return sz.as_string(widen_poly(v.P), widen_poly(v.X), v.case_mapped)


def _root_linear(terms: Poly, root: str) -> list[tuple[str, int]]:
    """Linear terms over one root's variables as the fewest root-level terms above them."""
    f = sz.root_factors(terms, root)
    x = max((b for _, b in f.px), default=0)
    p = max((a + b for a, b in f.px), default=0) - x
    child_only = max(f.child - f.deep, 0)
    pairs = (("P", p), ("X", x), ("I", f.depth), ("C", child_only), ("D", f.deep))
    return [(m, c) for m, c in pairs if c]


def _top_var(v: sz.Var, roots: list[str]) -> sz.Var:
    measure, path = v
    if path[0] in roots and len(path) > 1:
        return ("D" if measure == "C" else measure, path[:1])
    return v


def _value_leq(a: Value, b: Value) -> bool:
    return sz.leq(a.P, b.P) and sz.leq(a.X, b.X)
