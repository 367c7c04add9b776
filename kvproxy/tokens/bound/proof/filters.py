"""Filters for the template proof (see `tokens.bound.proof.ops`): jinja2's filters and
transformers' `tojson`, each mapping bounds on its input to bounds on its output. Pure.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jinja2.nodes as nodes

import kvproxy.tokens.bound.proof.sizes as sz
from kvproxy.tokens.bound.proof.sizes import (
    ANY,
    BOOL,
    LIST,
    NUM,
    SCALARS,
    STR,
    Poly,
    Unproven,
    Value,
)

if TYPE_CHECKING:
    from kvproxy.tokens.bound.proof.state import Analyzer as _Analyzer
    from kvproxy.tokens.bound.proof.state import State

# str.lower/upper/title/capitalize/swapcase/casefold grow a character's UTF-8 bytes at most
# 3x ('ΐ' -> 'Ϊ́', 2 -> 6 bytes); tests/tokens/test_tokens_proof.py checks every code point.
CASE_GROWTH = 3
# HTML escaping (`e`, `escape`): '&' -> '&amp;', '"' -> '&#34;', "'" -> '&#39;': 5x at most.
ESCAPE_GROWTH = 5

_SAME = frozenset(
    {"safe", "selectattr", "rejectattr", "select", "reject", "unique", "sort", "reverse",
     "slice", "list"}
)  # fmt: skip


def _bool() -> Value:
    return Value(P=sz.const(sz.SCALAR_WORD), X=sz.const(sz.SCALAR_WORD), kinds=frozenset({BOOL}))


def _num(value: Value | None = None, mag: Poly | None = None) -> Value:
    """A number computed from `value`. With a known magnitude (a polynomial of counts, each
    below 10^12 since a request holds fewer values than bytes) it prints in at most 12 digits
    per degree plus 12 (sign, point, a float's exponent); otherwise in its operands' digits
    plus a float's 24."""
    if mag is not None:
        degree = max((len(m) for m in mag), default=0)
        p: Poly = sz.const(12 * degree + 12)
    elif value is not None:
        p = sz.add(value.P, sz.const(24))
    else:
        p = sz.const(24)
    return Value(P=p, X=p, kinds=frozenset({NUM}), n=mag)


def _count(v: Value) -> Poly:
    """How many elements (or characters) `v` has at most."""
    out: Poly = dict(v.C)
    if STR in v.kinds:
        out = sz.add(out, v.P)
    return out


def _string(v: Value) -> Value:
    p, x = sz.printed(v)
    return sz.as_string(p, x, v.case_mapped)


class Filters:
    """The filters (and string joins) of `Ops`, which subclasses it."""

    a: _Analyzer

    def join_with(self, items: Value, sep: Value) -> Value:
        """`sep.join(items)` / `items|join(sep)`: each element printed, one separator each."""
        each = _string(sz.sub_part(items, ("*",)))
        count = _count(items)
        return sz.as_string(
            sz.add(each.P, sz.mul(sep.P, count)),
            sz.add(each.X, sz.mul(sep.X, count)),
            items.case_mapped,
        )

    # --- filters ----------------------------------------------------------------------------------

    def filter_node(self, node: nodes.Filter, base: Value, st: State) -> Value:
        if node.dyn_args is not None or node.dyn_kwargs is not None:
            raise Unproven("filters with *args or **kwargs")
        args = [self.a.expr(x, st) for x in node.args]
        kwargs = {str(k.key): self.a.expr(k.value, st) for k in node.kwargs}
        if any(v.dead for v in (*args, *kwargs.values())):
            return sz.DEAD
        return self.filter(node.name, base, args, kwargs, node)

    def filter(
        self,
        name: str,
        base: Value,
        args: list[Value],
        kwargs: dict[str, Value],
        node: nodes.Filter,
    ) -> Value:
        if name == "tojson":
            return self.tojson(base, node)
        if name in _SAME:
            if base.obj is not None:
                raise Unproven(f"|{name} of a {base.obj[0]}")
            return base
        if name == "trim":
            return sz.replace_kinds(sz.sub_part(_string(base), ()), frozenset({STR}))
        if name in ("length", "count", "wordcount"):
            return _num(None, _count(base))
        if name in ("lower", "upper", "capitalize", "title"):
            return _case(_string(base))
        if name == "replace":
            return _replace(_string(base), node.args[0] if node.args else None,
                            node.args[1] if len(node.args) > 1 else None)  # fmt: skip
        if name == "items":
            return Value(kinds=frozenset({LIST}), obj=("items", base))
        if name == "dictsort":
            return Value(kinds=frozenset({LIST}), obj=("items", base))
        if name == "string":
            return _string(base)
        if name in ("e", "escape", "forceescape"):
            s = _string(base)
            return sz.as_string(sz.scale(s.P, ESCAPE_GROWTH), sz.scale(s.X, ESCAPE_GROWTH))
        if name in ("default", "d"):
            default = args[0] if args else kwargs.get("default_value", sz.EMPTY)
            return sz.join_values(base, default)
        if name in ("int", "float", "abs", "round", "sum"):
            return _num(base)
        if name in ("first", "last", "random", "min", "max"):
            return sz.join_values(sz.sub_part(base, ("*",)), _chars(base))
        if name == "join":
            sep = args[0] if args else kwargs.get("d", sz.EMPTY)
            attr = kwargs.get("attribute")
            if attr is not None or len(args) > 1:
                raise Unproven("join(attribute=...)")
            return self.join_with(base, sep)
        if name == "map":
            attr_node = next((k.value for k in node.kwargs if k.key == "attribute"), None)
            if not (isinstance(attr_node, nodes.Const) and isinstance(attr_node.value, str)):
                raise Unproven("map() other than map(attribute='...')")
            return _listed(sz.sub_part(base, ("*", "." + attr_node.value)), base.C)
        if name == "attr":
            key = node.args[0] if node.args else None
            if not (isinstance(key, nodes.Const) and isinstance(key.value, str)):
                raise Unproven("attr() with a computed name")
            return sz.sub_part(base, ("." + key.value,))
        if name == "indent":
            width_node = (
                node.args[0]
                if node.args
                else next((k.value for k in node.kwargs if k.key == "width"), None)
            )
            width = 4 if width_node is None else self._const_int(width_node)
            if width is None:
                raise Unproven("indent() with a computed width")
            s = _string(base)
            # One indent per line; a text has at most one line per byte, plus one.
            return sz.as_string(
                sz.add(sz.scale(s.P, 1 + width), sz.const(width)),
                sz.add(sz.scale(s.X, 1 + width), sz.const(width)),
            )
        if name in ("truncate", "striptags"):
            s = _string(base)
            return sz.as_string(sz.add(s.P, sz.const(3)), sz.add(s.X, sz.const(3)))
        if name == "center":
            width = self._const_int(node.args[0]) if node.args else 80
            if width is None:
                raise Unproven("center() with a computed width")
            s = _string(base)
            return sz.as_string(sz.add(s.P, sz.const(width)), sz.add(s.X, sz.const(width)))
        if name == "batch":
            return Value(
                P=base.P,
                X=base.X,
                C=base.C,
                D=sz.add(base.D, base.C),
                I=sz.add(base.I, base.D, base.C),
                kinds=frozenset({LIST}),
            )
        raise Unproven(f"the filter {name}")

    def tojson(self, base: Value, node: nodes.Filter) -> Value:
        """transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None,
        separators=None, sort_keys=False) (utils/chat_template_utils.py)."""
        names = ("ensure_ascii", "indent", "separators", "sort_keys")
        given: dict[str, nodes.Node] = dict(zip(names, node.args, strict=False))
        given.update({str(k.key): k.value for k in node.kwargs})
        indent: int | None = None
        item_sep, key_sep = 2, 2
        if "indent" in given:
            ind = given["indent"]
            if isinstance(ind, nodes.Const) and ind.value is None:
                indent = None
            elif isinstance(ind, nodes.Const) and type(ind.value) is int:
                indent = max(ind.value, 0)
            elif isinstance(ind, nodes.Const) and isinstance(ind.value, str):
                indent = sz.utf8(ind.value)
            else:
                raise Unproven("tojson with a computed indent")
            if indent is not None:
                item_sep = 1  # json.dumps' default separators with an indent: (",", ": ")
        if "separators" in given:
            seps = given["separators"]
            items = getattr(seps, "items", None)
            if isinstance(seps, nodes.Const) and isinstance(seps.value, tuple):
                values = list(seps.value)
            elif items is not None and all(isinstance(i, nodes.Const) for i in items):
                values = [i.value for i in items]
            else:
                raise Unproven("tojson with computed separators")
            if len(values) != 2 or not all(isinstance(v, str) for v in values):
                raise Unproven("tojson with unusual separators")
            item_sep, key_sep = sz.utf8(values[0]), sz.utf8(values[1])
        if base.obj is not None:
            raise Unproven(f"tojson of a {base.obj[0]}")
        if sz.undefined_only(base):
            return sz.DEAD  # json.dumps(Undefined) raises TypeError
        return sz.json_text(base, indent, item_sep, key_sep)

    @staticmethod
    def _const_int(node: nodes.Node) -> int | None:
        if isinstance(node, nodes.Const) and type(node.value) is int and node.value >= 0:
            return int(node.value)
        return None


def _split(base: Value) -> Value:
    """str.split(): pieces of the string (their bytes at most the string's), at most one piece
    per byte plus one; each piece printed in a list adds its quotes and separator."""
    s = sz.replace_kinds(sz.sub_part(base, ()), frozenset({STR}))
    pieces = sz.add(s.P, sz.const(1))
    return Value(
        P=s.P,
        X=sz.add(s.X, sz.scale(pieces, 4)),
        C=pieces,
        D=pieces,
        I=pieces,
        kinds=frozenset({LIST}),
        elem=frozenset({STR}),
        case_mapped=base.case_mapped,
        item=s,
    )


def _case(s: Value) -> Value:
    return Value(
        P=sz.scale(s.P, CASE_GROWTH),
        X=sz.scale(s.X, CASE_GROWTH),
        kinds=frozenset({STR}),
        case_mapped=True,
    )


def _replace(s: Value, old: nodes.Node | None, new: nodes.Node | None) -> Value:
    if not (isinstance(old, nodes.Const) and isinstance(old.value, str)):
        raise Unproven("replace() of a computed string")
    if not (isinstance(new, nodes.Const) and isinstance(new.value, str)):
        raise Unproven("replace() by a computed string")
    o, n = sz.utf8(old.value), sz.utf8(new.value)
    nx = sz.longest(new.value)
    if o == 0:
        # "" matches before every character and at the end.
        p = sz.add(s.P, sz.scale(sz.add(s.P, sz.const(1)), n))
        x = sz.add(s.X, sz.scale(sz.add(s.P, sz.const(1)), nx))
        return sz.as_string(p, x, s.case_mapped)
    grow_p = max(1, math.ceil(n / o))
    grow_x = max(1, math.ceil(nx / o))
    return sz.as_string(sz.scale(s.P, grow_p), sz.scale(s.X, grow_x), s.case_mapped)


def _listed(elems: Value, count: Poly) -> Value:
    return Value(
        P=elems.P,
        X=sz.add(elems.X, sz.scale(count, 4)),
        C=count,
        D=sz.add(count, elems.D),
        I=sz.add(count, elems.D, elems.I),
        kinds=frozenset({LIST}),
        elem=elems.kinds,
    )


def _chars(v: Value) -> Value:
    if STR not in v.kinds:
        return Value(kinds=frozenset())
    return sz.as_string(v.P, v.X)


_ = (ANY, SCALARS)
