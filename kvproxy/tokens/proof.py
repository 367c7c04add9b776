"""The template proof: how many bytes a chat template can print, as a function of the data it is
handed, whatever that data is. Pure, no I/O; runs once per template at start-up.

`prove(source)` interprets the template's jinja2 AST abstractly (the algebra is
`tokens.sizes`): every expression evaluates to upper bounds on its measures, every output
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
for that template, the guarantee falls back to no shortcut (tokens.guarantee).

Never renders the template, never sees a request.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jinja2
import jinja2.nodes as nodes

from kvproxy.tokens import sizes as sz
from kvproxy.tokens.proof_ops import Ops
from kvproxy.tokens.sandbox import Sandbox, environment
from kvproxy.tokens.sizes import (
    ANY,
    BOOL,
    DICT,
    LIST,
    NONE,
    NUM,
    STR,
    UNDEF,
    Poly,
    Unproven,
    Value,
)

# Roots whose shape the engines fix: `messages` is a list, `tools`/`documents` a list or None.
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


@dataclass(frozen=True)
class TemplateProof:
    """The proven output size: `out` is a polynomial over the roots' measures bounding the
    bytes of any render. `kwargs` are the names the template reads that a request or the
    tokenizer may supply; `case_mapped` is set when a case mapping of request text can reach
    the output (NFC may then compose it differently, tokens.guarantee)."""

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


class _Analyzer:
    def __init__(self, ast: nodes.Template) -> None:
        self.ast = ast
        self.kwargs: set[str] = set()
        self.case_mapped = False
        self._ids = itertools.count()
        self.macros: dict[int, nodes.Macro] = {}
        self.stack: list[int] = []
        self.recursive: set[int] = set()
        self.summaries: dict[int, tuple[Value, tuple[str, ...]]] = {}
        self.ops = Ops(self)
        self.with_tools = True
        self.with_kwargs = True
        self.specials: frozenset[str] = frozenset()

    def new_id(self) -> int:
        return next(self._ids)

    def run(self) -> Value:
        st = State({}, {})
        out = self.block(self.ast.body, st)
        return sz.EMPTY if out.dead else out

    # --- statements -----------------------------------------------------------------------

    def block(self, body: Sequence[nodes.Node], st: State) -> Value:
        """The output of a statement list; DEAD when some statement certainly raises (the
        render fails, so whatever was printed before is never sent either)."""
        out = sz.EMPTY
        for node in body:
            got = self.stmt(node, st)
            if got.dead:
                return sz.DEAD
            out = _concat(out, got)
        return out

    def stmt(self, node: nodes.Node, st: State) -> Value:
        if isinstance(node, nodes.Output):
            out = sz.EMPTY
            for child in node.nodes:
                if isinstance(child, nodes.TemplateData):
                    out = _concat(out, sz.text(child.data))
                    continue
                value = self.expr(child, st)
                if value.dead:
                    return sz.DEAD
                out = _concat(out, self.print(value))
            return out
        if isinstance(node, nodes.If):
            return self.if_(node, st)
        if isinstance(node, nodes.For):
            return self.for_(node, st)
        if isinstance(node, nodes.Assign):
            value = self.expr(node.node, st)
            if value.dead:
                return sz.DEAD
            self.assign(node.target, value, st)
            return sz.EMPTY
        if isinstance(node, nodes.AssignBlock):
            inner = st.copy()
            value = self.block(node.body, inner)
            st.ns = inner.ns
            if node.filter is not None and not value.dead:
                value = self.ops.filter_node(node.filter, value, st)
            if value.dead:
                return sz.DEAD
            self.assign(node.target, value, st)
            return sz.EMPTY
        if isinstance(node, nodes.Macro):
            self.macros[id(node)] = node
            st.names[node.name] = Value(kinds=frozenset(), obj=("macro", id(node)))
            return sz.EMPTY
        if isinstance(node, nodes.With):
            inner = st.copy()
            for target, source in zip(node.targets, node.values, strict=True):
                self.assign(target, self.expr(source, st), inner)
            out = self.block(node.body, inner)
            st.ns = inner.ns
            return out
        if isinstance(node, nodes.FilterBlock):
            inner = st.copy()
            out = self.block(node.body, inner)
            st.ns = inner.ns
            return self.ops.filter_node(node.filter, out, st)
        if isinstance(node, (nodes.Scope, nodes.Block)):
            return self.block(node.body, st)
        if isinstance(node, nodes.ExprStmt):
            return sz.DEAD if self.expr(node.node, st).dead else sz.EMPTY
        if isinstance(node, (nodes.Break, nodes.Continue)):
            return sz.EMPTY  # stopping early only prints less
        raise Unproven(f"the statement {type(node).__name__} is not modelled")

    def print(self, v: Value) -> Value:
        if v.obj is not None and v.obj[0] not in ("method",):
            # Printing a macro, the loop or a namespace prints a short repr.
            return sz.text("<" + "x" * 60 + ">")
        p, x = sz.printed(v)
        if v.case_mapped:
            self.case_mapped = True
        return sz.as_string(p, x, v.case_mapped)

    def if_(self, node: nodes.If, st: State) -> Value:
        branches: list[tuple[list[tuple[nodes.Node, bool]], Sequence[nodes.Node]]] = []
        before: list[tuple[nodes.Node, bool]] = []
        arms: list[tuple[nodes.Node, Sequence[nodes.Node]]] = [(node.test, node.body)]
        arms += [(e.test, e.body) for e in node.elif_]
        for test, arm in arms:
            branches.append(([*before, (test, True)], arm))
            before = [*before, (test, False)]
        branches.append((before, node.else_))
        outs: list[Value] = []
        states: list[State] = []
        for conds, body in branches:
            inner = st.copy()
            dead = False
            for test, truth in conds:
                if self.expr(test, inner).dead:
                    dead = True
                    break
                self.refine(test, truth, inner)
            if dead or inner.infeasible:
                continue
            out = self.block(body, inner)
            if out.dead:
                continue
            outs.append(out)
            states.append(inner)
        if not outs:
            return sz.DEAD
        self.join_states(st, states)
        return _join_all(outs)

    def join_states(self, st: State, states: list[State]) -> None:
        undefined = Value(kinds=frozenset({UNDEF}))
        names: dict[str, Value] = {}
        for name in set().union(*(s.names for s in states)):
            vals = [s.names.get(name, st.names.get(name, undefined)) for s in states]
            names[name] = _join_all(vals)
        ns: dict[int, dict[str, Value]] = {}
        for s in states:
            for k, attrs in s.ns.items():
                slot = ns.setdefault(k, {})
                for a, v in attrs.items():
                    slot[a] = sz.join_values(slot[a], v) if a in slot else v
        for k, slot in ns.items():
            for a in list(slot):
                if any(a not in s.ns.get(k, {}) for s in states):
                    slot[a] = sz.join_values(slot[a], undefined)
        if st.top is None:
            st.names.clear()
            st.names.update(names)
        else:
            st.names = names
        st.ns = ns

    def assign(self, target: nodes.Node, value: Value, st: State) -> None:
        if isinstance(target, nodes.Name):
            st.names[target.name] = value
            self._forget(target.name, st)
        elif isinstance(target, nodes.NSRef):
            ref = self.lookup(target.name, st)
            if ref.obj is None or ref.obj[0] != "ns":
                raise Unproven("an attribute is set on something that is not a namespace")
            ids = ref.obj[1]
            for k in ids:
                attrs = st.ns.setdefault(k, {})
                if len(ids) == 1 or target.attr not in attrs:
                    attrs[target.attr] = value
                else:
                    attrs[target.attr] = sz.join_values(attrs[target.attr], value)
        elif isinstance(target, (nodes.Tuple, nodes.List)):
            for item in target.items:
                self.assign(item, sz.sub_part(value, ("*",)), st)
        else:
            raise Unproven(f"assignment to {type(target).__name__}")

    def _forget(self, name: str, st: State) -> None:
        for table in (st.refine, st.facts):
            for key in [k for k in table if k == name or k.startswith(name + ".")]:
                del table[key]

    # --- loops ----------------------------------------------------------------------------

    def for_(self, node: nodes.For, st: State) -> Value:
        if node.recursive:
            raise Unproven("recursive loops are not modelled")
        it = self.expr(node.iter, st)
        if it.dead:
            return sz.DEAD
        # A value that may be a string or a container is one or the other: its characters
        # and its elements are two loops, of which the render runs one.
        # A value of unknown kind is a string, a list or a dict: its characters, its elements
        # and its keys are three loops, of which the render runs one.
        variants = []
        if it.obj is None and it.elem is None:
            for kind in (STR, LIST, DICT):
                if kind in it.kinds:
                    variants.append(replace(it, kinds=frozenset({kind})))
        if len(variants) <= 1:
            return self._loop(node, st, variants[0] if variants else it)
        outs: list[Value] = []
        states: list[State] = []
        for variant in variants:
            inner = st.copy()
            outs.append(self._loop(node, inner, variant))
            states.append(inner)
        self.join_states(st, states)
        return _join_all(outs)

    def _loop(self, node: nodes.For, st: State, it: Value) -> Value:
        loop = self.iteration(it)
        k = self.new_id()
        # Pass 1: namespace attributes as symbols, to see how an iteration changes them.
        symbols = {
            (nid, a): _symbol(f"S{k}:{nid}:{a}", v) for nid, attrs in st.ns.items()
            for a, v in attrs.items() if v.obj is None
        }  # fmt: skip
        first = self._body(node, st, loop, symbols, None)
        if first.out.dead:
            # Every iteration raises: the loop prints (and changes) something only when it
            # runs no iteration at all.
            return self.block(node.else_, st.copy()) if node.else_ else sz.EMPTY
        bounds = self._loop_invariants(st, first.ns, symbols, loop)
        second = self._body(node, st, loop, None, bounds)
        out = self.sum_over(second.out, loop)
        if node.else_:
            other = self.block(node.else_, st.copy())
            if not other.dead:
                out = _concat(out, other)
        # After the loop: the attributes' invariants (they bound every iteration's values).
        for (nid, a), v in bounds.items():
            st.ns.setdefault(nid, {})[a] = v
        for nid, attrs in second.ns.items():
            if nid in st.ns:
                for a, v in attrs.items():
                    if (nid, a) not in bounds and a not in st.ns[nid]:
                        st.ns[nid][a] = self.lift(v, loop)
        return out

    @dataclass
    class _Pass:
        out: Value
        ns: dict[int, dict[str, Value]]

    def _body(
        self,
        node: nodes.For,
        st: State,
        loop: Loop,
        symbols: dict[tuple[int, str], Value] | None,
        bounds: dict[tuple[int, str], Value] | None,
    ) -> _Analyzer._Pass:
        inner = State(
            dict(st.names),
            {k: dict(v) for k, v in st.ns.items()},
            dict(st.refine),
            st.template_names(),
            False,
            dict(st.facts),
        )
        for (nid, a), v in (symbols or bounds or {}).items():
            inner.ns[nid][a] = v
        elem = sz.data((loop.symbol,), loop.kinds)
        if loop.items:
            self._bind_items(node.target, loop, inner)
        else:
            self.assign(node.target, elem, inner)
        inner.names["loop"] = Value(kinds=frozenset(), obj=("loop", loop))
        if node.test is not None:
            self.expr(node.test, inner)
            self.refine(node.test, True, inner)
        if inner.infeasible:
            return _Analyzer._Pass(sz.EMPTY, inner.ns)
        # Trace partitioning: a body that branches on one attribute of the element against
        # constants (`message.role == "user"`, then `== "assistant"`...) is analysed once per
        # constant (and once for any other value), so that mutually exclusive branches in
        # separate `if`s are not added up.
        key, consts = _partition_key(node)
        if key is None:
            return _Analyzer._Pass(self.block(node.body, inner), inner.ns)
        outs: list[Value] = []
        states: list[State] = []
        for fact in [*((frozenset({c}), frozenset()) for c in consts), (None, consts)]:
            part = inner.copy()
            part.facts[key] = fact
            out = self.block(node.body, part)
            if not out.dead:
                outs.append(out)
                states.append(part)
        if not outs:
            return _Analyzer._Pass(sz.DEAD, inner.ns)
        self.join_states(inner, states)
        return _Analyzer._Pass(_join_all(outs), inner.ns)

    def _bind_items(self, target: nodes.Node, loop: Loop, st: State) -> None:
        key = sz.data((loop.symbol, "#"), frozenset({STR, NUM}))
        val = sz.data((loop.symbol,))
        if isinstance(target, nodes.Tuple) and len(target.items) == 2:
            self.assign(target.items[0], key, st)
            self.assign(target.items[1], val, st)
        else:
            self.assign(target, sz.sum_values(key, val, kinds=frozenset({LIST})), st)

    def _loop_invariants(
        self,
        st: State,
        after: dict[int, dict[str, Value]],
        symbols: dict[tuple[int, str], Value],
        loop: Loop,
    ) -> dict[tuple[int, str], Value]:
        """A bound on each namespace attribute valid at every iteration (see the module
        docstring): start + the sum of its increments, or the largest value it takes."""
        by_root = {_sym_name(v): key for key, v in symbols.items()}
        pending: dict[tuple[int, str], Value] = {}
        # Attributes the body leaves alone keep their value (and others may read it).
        done: dict[tuple[int, str], Value] = {}
        for key, sym in symbols.items():
            new = after.get(key[0], {}).get(key[1])
            if new is sym:
                done[key] = st.ns[key[0]][key[1]]
            elif new is not None:
                pending[key] = new
        changed: dict[tuple[int, str], Value] = {}
        for _ in range(len(pending) + 1):
            progress = False
            for key, new in list(pending.items()):
                deps = {by_root[r] for r in _value_roots(new) if r in by_root} - {key}
                if deps - done.keys():
                    continue
                start = st.ns[key[0]][key[1]]
                done[key] = changed[key] = self._invariant(key, start, new, by_root, done, loop)
                del pending[key]
                progress = True
            if not pending:
                break
            if not progress:
                raise Unproven("namespace attributes depend on each other across iterations")
        return changed

    def _invariant(
        self,
        key: tuple[int, str],
        start: Value,
        new: Value,
        by_root: dict[str, tuple[int, str]],
        done: dict[tuple[int, str], Value],
        loop: Loop,
    ) -> Value:
        own = next(r for r, k in by_root.items() if k == key)

        def resolve(v: sz.Var) -> Poly | None:
            root = v[1][0]
            if root == own:
                return None
            if root in by_root:
                return done[by_root[root]].measure(v[0])
            return None

        measures: dict[str, Poly] = {}
        for m in sz.MEASURES:
            poly = sz.substitute(new.measure(m), resolve)
            self_terms = {mono: c for mono, c in poly.items() if any(v[1][0] == own for v in mono)}
            rest = {mono: c for mono, c in poly.items() if mono not in self_terms}
            if not self_terms:
                measures[m] = sz.join(start.measure(m), self.lift_poly(rest, loop))
                continue
            if len(self_terms) != 1:
                raise Unproven("a namespace attribute grows faster than a sum in a loop")
            ((mono, c),) = self_terms.items()
            if c != 1 or len(mono) != 1 or mono[0][0] != m:
                raise Unproven("a namespace attribute grows faster than a sum in a loop")
            measures[m] = sz.add(start.measure(m), self.sum_poly(rest, loop))
        n = None
        if start.n is not None and new.n is not None:
            n_new = sz.substitute(new.n, resolve)
            mine = {mo: c for mo, c in n_new.items() if any(v[1][0] == own for v in mo)}
            grown = {mo: c for mo, c in n_new.items() if mo not in mine}
            if not mine:
                n = sz.join(start.n, self.lift_poly(n_new, loop))
            elif list(mine.values()) == [1] and all(len(mo) == 1 for mo in mine):
                n = sz.add(start.n, self.sum_poly(grown, loop))
        return Value(
            P=measures["P"],
            X=measures["X"],
            C=measures["C"],
            D=measures["D"],
            I=measures["I"],
            kinds=start.kinds | new.kinds,
            elem=None if start.elem is None or new.elem is None else start.elem | new.elem,
            n=n,
            case_mapped=start.case_mapped or new.case_mapped,
        )

    def iteration(self, it: Value) -> Loop:
        """How a `for` iterates `it`."""
        symbol = f"L{self.new_id()}"
        if it.obj is not None:
            kind = it.obj[0]
            if kind == "items":
                base: Value = it.obj[1]
                return Loop(symbol, _mapper(symbol, base, items=True), base.C, ANY, items=True)
            if kind == "range":
                count: Poly | None = it.obj[1]

                def each(v: sz.Var) -> Poly:
                    if count is None:
                        raise Unproven("output repeats over a range of unbounded length")
                    return sz.scale(count, 24) if v[0] in ("P", "X") else {}

                return Loop(symbol, each, count, frozenset({NUM}))
            raise Unproven(f"iteration over a {kind}")
        if it.kinds <= {STR}:
            # A string iterates its characters: as many as its bytes at most.
            return Loop(symbol, _mapper(symbol, it, items=False), dict(it.P), frozenset({STR}))
        if it.kinds <= {DICT} and it.elem is None:
            # A dict iterates its keys.
            return Loop(symbol, _mapper(symbol, it, items=False), dict(it.C), frozenset({STR}))
        kinds = it.elem if it.elem is not None else ANY
        return Loop(symbol, _mapper(symbol, it, items=False), dict(it.C), kinds)

    def sum_over(self, v: Value, loop: Loop) -> Value:
        return Value(
            P=self.sum_poly(v.P, loop),
            X=self.sum_poly(v.X, loop),
            C=self.sum_poly(v.C, loop),
            D=self.sum_poly(v.D, loop),
            I=self.sum_poly(v.I, loop),
            kinds=v.kinds,
            case_mapped=v.case_mapped,
        )

    def sum_poly(self, poly: Poly, loop: Loop) -> Poly:
        """The sum of `poly` over every iteration of `loop`."""
        out: dict[sz.Mono, int] = {}
        for mono, c in poly.items():
            mine = [v for v in mono if v[1][0] == loop.symbol]
            rest = [v for v in mono if v[1][0] != loop.symbol]
            term: Poly = {tuple(rest): c}
            if not mine:
                if loop.count is None:
                    raise Unproven("output repeats over a loop of unbounded length")
                term = sz.mul(term, loop.count)
            for v in mine:
                term = sz.mul(term, loop.elem(v))
            for mo, cc in term.items():
                out[mo] = out.get(mo, 0) + cc
        return out

    def lift(self, v: Value, loop: Loop) -> Value:
        return Value(
            P=self.lift_poly(v.P, loop),
            X=self.lift_poly(v.X, loop),
            C=self.lift_poly(v.C, loop),
            D=self.lift_poly(v.D, loop),
            I=self.lift_poly(v.I, loop),
            kinds=v.kinds,
            elem=v.elem,
            n=None if v.n is None else self.lift_poly(v.n, loop),
            obj=v.obj,
            case_mapped=v.case_mapped,
        )

    def lift_poly(self, poly: Poly, loop: Loop) -> Poly:
        """One iteration's value, bounded outside the loop: an element is at most the sum of
        all elements; nothing else depends on the iteration."""
        return sz.substitute(poly, lambda v: loop.elem(v) if v[1][0] == loop.symbol else None)

    # --- refinement -----------------------------------------------------------------------

    _TESTS: dict[str, tuple[frozenset[str], bool]] = {  # noqa: RUF012
        # test -> (kinds it is true for, exact: false means none of them)
        "string": (frozenset({STR}), True),
        "mapping": (frozenset({DICT}), True),
        "sequence": (frozenset({STR, LIST, DICT}), True),
        "iterable": (frozenset({STR, LIST, DICT}), True),
        "none": (frozenset({NONE}), True),
        "defined": (ANY - {UNDEF}, True),
        "undefined": (frozenset({UNDEF}), True),
        "number": (frozenset({NUM, BOOL}), True),
        "integer": (frozenset({NUM, BOOL}), False),
        "float": (frozenset({NUM}), False),
        "boolean": (frozenset({BOOL}), True),
        "true": (frozenset({BOOL}), False),
        "false": (frozenset({BOOL}), False),
    }

    def refine(self, test: nodes.Node, truth: bool, st: State) -> None:
        """Narrow the kinds of the names and attributes `test` speaks about, on the side where
        it is `truth`; a side no value can take is infeasible."""
        same = _kinds_of(test, truth, self._TESTS)
        if same is not None:
            self._narrow_key(same[0], same[1], st, test)
            return
        if truth and isinstance(test, (nodes.Name, nodes.Getattr, nodes.Getitem)):
            # Certainly empty (no measure, a string, container, None or Undefined): falsy.
            v = self.expr(test, st)
            if v.obj is None and not v.dead and _empty(v):
                st.infeasible = True
            return
        if isinstance(test, nodes.Not):
            self.refine(test.node, not truth, st)
        elif isinstance(test, nodes.And) and truth:
            self.refine(test.left, True, st)
            self.refine(test.right, True, st)
        elif isinstance(test, nodes.Or) and not truth:
            self.refine(test.left, False, st)
            self.refine(test.right, False, st)
        elif isinstance(test, nodes.Compare) and len(test.ops) == 1:
            op = test.ops[0]
            left, right = test.expr, op.expr
            if isinstance(left, nodes.Const) and op.op in ("eq", "ne"):
                left, right = right, left
            if op.op in ("eq", "ne") and isinstance(right, nodes.Const):
                equal = truth if op.op == "eq" else not truth
                self._fact(left, frozenset({right.value}), equal, st)
                if equal:
                    self._narrow(left, _const_kinds(right.value), st)
            elif op.op in ("in", "notin") and isinstance(right, (nodes.List, nodes.Tuple)):
                consts = [i.value for i in right.items if isinstance(i, nodes.Const)]
                if len(consts) == len(right.items):
                    inside = truth if op.op == "in" else not truth
                    self._fact(left, frozenset(consts), inside, st)
                    if inside:
                        kinds = frozenset().union(*(_const_kinds(c) for c in consts))
                        self._narrow(left, kinds, st)

    def _fact(self, node: nodes.Node, consts: frozenset[Any], equal: bool, st: State) -> None:
        """Record that `node` equals one of `consts` (or none of them); a contradiction with
        what is already known makes the path infeasible."""
        key = _key(node)
        if key is None or not all(isinstance(c, str) for c in consts):
            return
        pos, neg = st.facts.get(key, (None, frozenset()))
        if equal:
            pos = (consts if pos is None else pos & consts) - neg
            if not pos:
                st.infeasible = True
        else:
            neg = neg | consts
            if pos is not None:
                pos = pos - consts
                if not pos:
                    st.infeasible = True
        st.facts[key] = (pos, neg)

    def _narrow(self, node: nodes.Node, kinds: frozenset[str], st: State) -> None:
        key = _key(node)
        if key is not None:
            self._narrow_key(key, kinds, st, node)

    def _narrow_key(self, key: str, kinds: frozenset[str], st: State, node: nodes.Node) -> None:
        have = st.refine.get(key, ANY) & kinds
        st.refine[key] = have
        subject = _subject(node)
        if subject is None:
            return
        value = self.expr(subject, st)
        if value.obj is None and not value.dead and not value.kinds:
            st.infeasible = True

    # --- expressions ----------------------------------------------------------------------

    def expr(self, node: nodes.Node, st: State) -> Value:
        v = self.ops.expr(node, st)
        key = _key(node)
        if key is not None and key in st.refine and v.obj is None:
            v = sz.narrow(v, st.refine[key])
        return v

    def lookup(self, name: str, st: State) -> Value:
        if name in st.names:
            return st.names[name]
        if st.top is not None and name in st.top:
            return st.top[name]
        if name in GLOBALS:
            return Value(kinds=frozenset(), obj=("global", name))
        if name == "add_generation_prompt":
            return sz.scalar_word()
        if name == "tools" and not self.with_tools:
            return Value(kinds=frozenset({LIST, NONE, UNDEF}), n={})  # None or []: empty
        if name == "documents" and not self.with_kwargs:
            return sz.UNDEFINED
        if name in FIXED_ROOTS:
            return sz.data((name,), FIXED_ROOTS[name])
        if not self.with_kwargs and name not in self.specials:
            return sz.UNDEFINED
        self.kwargs.add(name)
        return sz.data((KW + name,))

    # --- macros ---------------------------------------------------------------------------

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


def _concat(a: Value, b: Value) -> Value:
    return sz.as_string(sz.add(a.P, b.P), sz.add(a.X, b.X), a.case_mapped or b.case_mapped)


def _join_all(vals: list[Value]) -> Value:
    out = vals[0]
    for v in vals[1:]:
        out = sz.join_values(out, v)
    return out


def _kinds_of(
    test: nodes.Node, truth: bool, tests: dict[str, tuple[frozenset[str], bool]]
) -> tuple[str, frozenset[str]] | None:
    """(key, kinds) when `test` (on side `truth`) speaks of one name only, through `is`
    tests combined by not/and/or: `x is iterable and x is not string` false means x is not
    iterable or is a string."""
    if isinstance(test, nodes.Test) and test.name in tests:
        key = _key(test.node)
        if key is None:
            return None
        kinds, exact = tests[test.name]
        if truth:
            return key, kinds
        return (key, ANY - kinds) if exact else (key, ANY)
    if isinstance(test, nodes.Not):
        return _kinds_of(test.node, not truth, tests)
    if isinstance(test, (nodes.And, nodes.Or)):
        a = _kinds_of(test.left, truth, tests)
        b = _kinds_of(test.right, truth, tests)
        if a is None or b is None or a[0] != b[0]:
            return None
        conj = isinstance(test, nodes.And) == truth  # both hold, or either holds
        return a[0], (a[1] & b[1]) if conj else (a[1] | b[1])
    return None


def _subject(node: nodes.Node) -> nodes.Node | None:
    """The expression a kind test speaks about (for the feasibility check)."""
    if isinstance(node, nodes.Test):
        return node.node
    if isinstance(node, nodes.Not):
        return _subject(node.node)
    if isinstance(node, (nodes.And, nodes.Or)):
        return _subject(node.left)
    if isinstance(node, (nodes.Name, nodes.Getattr, nodes.Getitem)):
        return node
    return None


def _empty(v: Value) -> bool:
    return v.kinds <= {STR, LIST, DICT, NONE, UNDEF} and not any(v.measure(m) for m in sz.MEASURES)


def _const_kinds(value: Any) -> frozenset[str]:
    """The kinds a value equal to this constant can have."""
    if isinstance(value, str):
        return frozenset({STR})
    if value is None:
        return frozenset({NONE})
    if isinstance(value, (bool, int, float)):
        return frozenset({NUM, BOOL})
    return ANY


def _symbol(root: str, like: Value) -> Value:
    v = sz.data((root,), like.kinds)
    return replace(v, elem=like.elem, n=None if like.n is None else sz.var("P", (root, "#n")))


def _sym_name(v: Value) -> str:
    (mono,) = v.P
    return mono[0][1][0]


def _value_roots(v: Value) -> set[str]:
    out: set[str] = set()
    for m in sz.MEASURES:
        out |= sz.roots_of(v.measure(m))
    if v.n is not None:
        out |= sz.roots_of(v.n)
    return out


def _key(node: nodes.Node) -> str | None:
    """A stable name for a Name/attribute/constant-index chain, for type refinement."""
    if isinstance(node, nodes.Name):
        return node.name
    if isinstance(node, nodes.Getattr):
        base = _key(node.node)
        return None if base is None else f"{base}.{node.attr}"
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        base = _key(node.node)
        return None if base is None else f"{base}.{node.arg.value}"
    return None


def _partition_key(node: nodes.For) -> tuple[str | None, frozenset[Any]]:
    """The attribute of the loop's element that the body compares to the most string
    constants, and those constants."""
    target = node.target
    names = [target, *target.find_all(nodes.Name)]
    targets = {n.name for n in names if isinstance(n, nodes.Name)}
    seen: dict[str, set[str]] = {}
    for cmp in itertools.chain.from_iterable(n.find_all(nodes.Compare) for n in node.body):
        if len(cmp.ops) != 1:
            continue
        op = cmp.ops[0]
        sides = [(cmp.expr, op.expr), (op.expr, cmp.expr)]
        for subject, other in sides:
            key = _key(subject)
            if key is None or key.split(".")[0] not in targets or "." not in key:
                continue
            if op.op in ("eq", "ne") and isinstance(other, nodes.Const):
                if isinstance(other.value, str):
                    seen.setdefault(key, set()).add(other.value)
            elif op.op in ("in", "notin") and isinstance(other, (nodes.List, nodes.Tuple)):
                for item in other.items:
                    if isinstance(item, nodes.Const) and isinstance(item.value, str):
                        seen.setdefault(key, set()).add(item.value)
    if not seen:
        return None, frozenset()
    key = max(sorted(seen), key=lambda k: len(seen[k]))
    if len(seen[key]) < 2:
        return None, frozenset()
    return key, frozenset(seen[key])


def _mapper(symbol: str, it: Value, *, items: bool) -> Callable[[sz.Var], Poly]:
    """Sum over the iterations of one variable of the element: it follows the iterable's data
    into `*` (list elements, dict values) or `#` (dict keys); a string's characters sum to
    the string."""

    def elem(v: sz.Var) -> Poly:
        measure, path = v
        sfx = path[1:]
        if items:
            if sfx[:1] == ("#",):
                return sz.sub_part(it, sfx).measure(measure)
            return sz.sub_part(it, ("*", *sfx)).measure(measure)
        if it.kinds <= {STR}:
            return it.measure(measure) if not sfx and measure in ("P", "X") else {}
        if it.kinds <= {DICT} and it.elem is None:
            return sz.sub_part(it, ("#", *sfx)).measure(measure)
        return sz.sub_part(it, ("*", *sfx)).measure(measure)

    return elem


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


_ = (math, BOOL, NONE)
