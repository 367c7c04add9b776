"""The template proof's analysis state and statements (see `tokens.bound.proof`): the names and
namespace attributes known at each point, the type refinements `is` and `==` tests give,
and how output, branches and assignments combine. Loops are in `loops`, macros and the
entry point in `prove`, expressions in `ops`. Pure; never renders a template.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jinja2.nodes as nodes

import kvproxy.tokens.bound.proof.sizes as sz
from kvproxy.tokens.bound.proof.ops import Ops
from kvproxy.tokens.bound.proof.sizes import (
    ANY,
    BOOL,
    DICT,
    LIST,
    NONE,
    NUM,
    STR,
    UNDEF,
    Unproven,
    Value,
)
from kvproxy.tokens.bound.proof.state import (
    FIXED_ROOTS,
    GLOBALS,
    KW,
    State,
    concat,
    join_all,
    key_of,
)


class Core:
    """Statements, refinement and names; `for_` and `call_macro` come from subclasses."""

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
            out = concat(out, got)
        return out

    def stmt(self, node: nodes.Node, st: State) -> Value:
        if isinstance(node, nodes.Output):
            out = sz.EMPTY
            for child in node.nodes:
                if isinstance(child, nodes.TemplateData):
                    out = concat(out, sz.text(child.data))
                    continue
                value = self.expr(child, st)
                if value.dead:
                    return sz.DEAD
                out = concat(out, self.print(value))
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
        return join_all(outs)

    def join_states(self, st: State, states: list[State]) -> None:
        undefined = Value(kinds=frozenset({UNDEF}))
        names: dict[str, Value] = {}
        for name in set().union(*(s.names for s in states)):
            vals = [s.names.get(name, st.names.get(name, undefined)) for s in states]
            names[name] = join_all(vals)
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
        key = key_of(node)
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
        key = key_of(node)
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
        key = key_of(node)
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

    # --- provided by the subclasses (loops, prove) ------------------------------------

    def for_(self, node: nodes.For, st: State) -> Value:
        raise NotImplementedError

    def call_macro(self, mid: int, args: list[Value], kwargs: dict[str, Value], st: State) -> Value:
        raise NotImplementedError


# --- helpers ------------------------------------------------------------------------------------


def _kinds_of(
    test: nodes.Node, truth: bool, tests: dict[str, tuple[frozenset[str], bool]]
) -> tuple[str, frozenset[str]] | None:
    """(key, kinds) when `test` (on side `truth`) speaks of one name only, through `is`
    tests combined by not/and/or: `x is iterable and x is not string` false means x is not
    iterable or is a string."""
    if isinstance(test, nodes.Test) and test.name in tests:
        key = key_of(test.node)
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
