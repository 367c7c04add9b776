"""Loops in the template proof (see `tokens.bound.proof`): how a `for` sums its body's output over
its iterations, and the invariants namespace attributes keep across them. Pure.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jinja2.nodes as nodes

import kvproxy.tokens.bound.proof.sizes as sz
from kvproxy.tokens.bound.proof.core import Core
from kvproxy.tokens.bound.proof.sizes import (
    ANY,
    DICT,
    LIST,
    NUM,
    STR,
    Poly,
    Unproven,
    Value,
)
from kvproxy.tokens.bound.proof.state import Loop, State, concat, join_all, key_of


class Loops(Core):
    """`for` statements (mixed into the analyzer)."""

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
        return join_all(outs)

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
                out = concat(out, other)
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
    ) -> Loops._Pass:
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
            return Loops._Pass(sz.EMPTY, inner.ns)
        # Trace partitioning: a body that branches on one attribute of the element against
        # constants (`message.role == "user"`, then `== "assistant"`...) is analysed once per
        # constant (and once for any other value), so that mutually exclusive branches in
        # separate `if`s are not added up.
        key, consts = _partition_key(node)
        if key is None:
            return Loops._Pass(self.block(node.body, inner), inner.ns)
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
            return Loops._Pass(sz.DEAD, inner.ns)
        self.join_states(inner, states)
        return Loops._Pass(join_all(outs), inner.ns)

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
            key = key_of(subject)
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
