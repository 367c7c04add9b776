"""Expressions, filters, methods and calls for the template proof (`tokens.bound.proof`). Pure.

Each operation maps upper bounds on its operands' measures to upper bounds on its result's
(`tokens.bound.proof.sizes`). Growth factors are argued where they are defined; an operation with no
proven bound raises `Unproven` naming it. Never renders anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jinja2.nodes as nodes

import kvproxy.tokens.bound.proof.sizes as sz
from kvproxy.tokens.bound.proof.filters import (
    Filters,
    _bool,
    _case,
    _count,
    _listed,
    _num,
    _replace,
    _split,
    _string,
)
from kvproxy.tokens.bound.proof.sizes import (
    BOOL,
    DICT,
    LIST,
    NUM,
    STR,
    UNDEF,
    Poly,
    Unproven,
    Value,
)

if TYPE_CHECKING:
    from kvproxy.tokens.bound.proof.state import Analyzer as _Analyzer
    from kvproxy.tokens.bound.proof.state import State

# strftime: the longest expansion of one directive in the C locale is %c (24 characters).
STRFTIME_DIRECTIVE = 32

_STR_METHODS = frozenset(
    {"split", "rsplit", "splitlines", "strip", "lstrip", "rstrip", "lower", "upper", "title",
     "capitalize", "swapcase", "casefold", "replace", "startswith", "endswith", "find",
     "rfind", "index", "rindex", "count", "isspace", "isdigit", "isalpha", "isalnum",
     "isupper", "islower", "isnumeric", "isdecimal", "istitle", "join", "removeprefix",
     "removesuffix", "center", "ljust", "rjust", "zfill", "partition", "rpartition"}
)  # fmt: skip
_DICT_METHODS = frozenset({"items", "keys", "values", "get"})
_CASE = frozenset({"lower", "upper", "title", "capitalize", "swapcase", "casefold"})
_PREDICATES = frozenset(
    {"startswith", "endswith", "isspace", "isdigit", "isalpha", "isalnum", "isupper",
     "islower", "isnumeric", "isdecimal", "istitle"}
)  # fmt: skip


class Ops(Filters):
    def __init__(self, analyzer: _Analyzer) -> None:
        self.a = analyzer

    # --- expressions --------------------------------------------------------------------------

    def expr(self, node: nodes.Node, st: State) -> Value:
        a = self.a
        if isinstance(node, nodes.Const):
            return self.const(node.value)
        if isinstance(node, nodes.TemplateData):
            return sz.text(node.data)
        if isinstance(node, nodes.Name):
            return a.lookup(node.name, st)
        if isinstance(node, nodes.Getattr):
            base = a.expr(node.node, st)
            if base.dead or sz.undefined_only(base):
                return sz.DEAD  # an attribute of Undefined raises
            return self.getattr(base, node.attr, st)
        if isinstance(node, nodes.Getitem):
            return self.getitem(node, st)
        if isinstance(node, nodes.Call):
            return self.call(node, st)
        if isinstance(node, nodes.Filter):
            base = a.expr(node.node, st) if node.node is not None else sz.EMPTY
            if base.dead:
                return sz.DEAD
            return self.filter_node(node, base, st)
        if isinstance(node, (nodes.Test, nodes.Compare, nodes.Not)):
            return sz.DEAD if self._visit(node, st) else _bool()
        if isinstance(node, (nodes.And, nodes.Or)):
            left = a.expr(node.left, st)
            if left.dead:
                return sz.DEAD
            return sz.join_values(left, a.expr(node.right, st))
        if isinstance(node, nodes.CondExpr):
            if a.expr(node.test, st).dead:
                return sz.DEAD
            yes, no = st.copy(), st.copy()
            a.refine(node.test, True, yes)
            a.refine(node.test, False, no)
            first = sz.DEAD if yes.infeasible else a.expr(node.expr1, yes)
            other = sz.EMPTY if node.expr2 is None else a.expr(node.expr2, no)
            if no.infeasible:
                other = sz.DEAD
            return sz.join_values(first, other)
        if isinstance(node, nodes.Concat):
            values = [a.expr(n, st) for n in node.nodes]
            if any(v.dead for v in values):
                return sz.DEAD
            parts = [_string(v) for v in values]
            return sz.as_string(
                sz.add(*(p.P for p in parts)),
                sz.add(*(p.X for p in parts)),
                any(p.case_mapped for p in parts),
            )
        if isinstance(node, nodes.BinExpr):
            return self.binop(node, st)
        if isinstance(node, (nodes.Neg, nodes.Pos)):
            inner = a.expr(node.node, st)
            if inner.dead or sz.undefined_only(inner):
                return sz.DEAD
            return _num(inner, inner.n)
        if isinstance(node, (nodes.List, nodes.Tuple)):
            items = [a.expr(i, st) for i in node.items]
            return sz.DEAD if any(i.dead for i in items) else self.sequence(items)
        if isinstance(node, nodes.Dict):
            pairs = [(a.expr(p.key, st), a.expr(p.value, st)) for p in node.items]
            if any(k.dead or v.dead for k, v in pairs):
                return sz.DEAD
            return self.mapping(pairs)
        if isinstance(node, (nodes.MarkSafe, nodes.MarkSafeIfAutoescape)):
            return a.expr(node.expr, st)
        raise Unproven(f"the expression {type(node).__name__} is not modelled")

    def _visit(self, node: nodes.Node, st: State) -> bool:
        """Evaluate the operands of a test or comparison (a macro call there may set
        namespace attributes); their values only decide a branch. True: one certainly
        raises."""
        dead = False
        for child in node.iter_child_nodes():
            if isinstance(child, nodes.Operand):
                child = child.expr
            elif isinstance(child, nodes.Keyword):
                child = child.value
            if isinstance(child, nodes.Expr):
                dead = self.a.expr(child, st).dead or dead
        return dead

    def const(self, value: Any) -> Value:
        if isinstance(value, str):
            return sz.text(value)
        if isinstance(value, bool) or value is None:
            return sz.scalar_word()
        if isinstance(value, int):
            return Value(
                P=sz.const(len(str(value))),
                X=sz.const(len(str(value))),
                kinds=frozenset({NUM}),
                n=sz.const(abs(value)),
            )
        if isinstance(value, float):
            return _num()
        if isinstance(value, tuple):
            return self.sequence([self.const(v) for v in value])
        raise Unproven(f"a constant of type {type(value).__name__}")

    def sequence(self, items: list[Value]) -> Value:
        n = len(items)
        return Value(
            P=sz.add(*(i.P for i in items)),
            X=sz.add(*(i.X for i in items)),
            C=sz.const(n),
            D=sz.add(sz.const(n), *(i.D for i in items)),
            I=sz.add(sz.const(n), *(i.D for i in items), *(i.I for i in items)),
            kinds=frozenset({LIST}),
            elem=frozenset().union(*(i.kinds for i in items)) if items else frozenset(),
        )

    def mapping(self, pairs: list[tuple[Value, Value]]) -> Value:
        n = len(pairs)
        keys = [k for k, _ in pairs]
        vals = [v for _, v in pairs]
        return Value(
            P=sz.add(*(i.P for i in keys + vals)),
            X=sz.add(*(i.X for i in keys + vals)),
            C=sz.const(n),
            D=sz.add(sz.const(n), *(i.D for i in vals)),
            I=sz.add(sz.const(n), *(i.D for i in vals), *(i.I for i in vals)),
            kinds=frozenset({DICT}),
        )

    # --- attributes and items ---------------------------------------------------------------------

    def getattr(self, base: Value, attr: str, st: State) -> Value:
        obj = base.obj
        if obj is not None:
            kind = obj[0]
            if kind == "ns":
                return self.ns_attr(obj[1], attr, st)
            if kind == "loop":
                return self.loop_attr(obj[1], attr)
            raise Unproven(f"the attribute {attr} of a {kind}")
        # jinja2 looks the attribute up, then the item of that name: only a dict has one; a
        # string, list, number or None gives Undefined (Undefined itself raises, see expr).
        # Any attribute Python's str, dict or list has is a method here (the sandbox lets a
        # template call the safe ones: `str.format` among them, whose width a request could
        # set); `method` bounds the ones it knows and refuses the others.
        method = (
            (STR in base.kinds and hasattr(str, attr))
            or (DICT in base.kinds and hasattr(dict, attr))
            or (LIST in base.kinds and hasattr(list, attr))
        ) and not attr.startswith("_")
        if DICT in base.kinds:
            part = sz.sub_part(base, ("." + attr,))
            if base.kinds - {DICT, UNDEF}:
                part = sz.join_values(part, sz.UNDEFINED)
        else:
            part = sz.UNDEFINED
        if method:
            # A string's method, a dict's method, or (a dict without it) the key of that name.
            return sz.replace_obj(part, ("method", attr, base))
        return part

    def ns_attr(self, ids: frozenset[int], attr: str, st: State) -> Value:
        found = [st.ns.get(i, {}).get(attr) for i in ids]
        vals = [v for v in found if v is not None]
        if len(vals) < len(found):
            vals.append(Value(kinds=frozenset({UNDEF})))
        out = vals[0]
        for v in vals[1:]:
            out = sz.join_values(out, v)
        return out

    def loop_attr(self, loop: Any, attr: str) -> Value:
        if attr in ("index", "index0", "revindex", "revindex0", "length", "depth", "depth0"):
            return _num(None, loop.count)
        if attr in ("first", "last"):
            return _bool()
        if attr in ("previtem", "nextitem"):
            return sz.data((loop.symbol,), loop.kinds)
        if attr in ("cycle", "changed"):
            return Value(kinds=frozenset(), obj=("loopfn", attr))
        raise Unproven(f"loop.{attr}")

    def getitem(self, node: nodes.Getitem, st: State) -> Value:
        base = self.a.expr(node.node, st)
        if base.dead or sz.undefined_only(base):
            return sz.DEAD  # an item of Undefined raises
        arg = node.arg
        if base.obj is not None:
            if base.obj[0] == "ns" and isinstance(arg, nodes.Const):
                return self.ns_attr(base.obj[1], str(arg.value), st)
            raise Unproven(f"indexing a {base.obj[0]}")
        if isinstance(arg, nodes.Slice):
            for bound in (arg.start, arg.stop, arg.step):
                if bound is not None:
                    self.a.expr(bound, st)
            return sz.replace_obj(base, None)
        if isinstance(arg, nodes.Const) and isinstance(arg.value, str):
            # Only a dict has items by name.
            if DICT not in base.kinds:
                return sz.UNDEFINED
            part = sz.sub_part(base, ("." + arg.value,))
            return sz.join_values(part, sz.UNDEFINED) if base.kinds - {DICT, UNDEF} else part
        if isinstance(arg, nodes.Const) and isinstance(arg.value, int):
            step: tuple[str, ...] = (f"[{arg.value}]",)
        else:
            if self.a.expr(arg, st).dead:
                return sz.DEAD
            step = ("*",)
        out: Value | None = None
        if base.kinds & {LIST, DICT}:
            out = sz.sub_part(base, step)
        if STR in base.kinds:
            char = sz.replace_kinds(sz.sub_part(base, ()), frozenset({STR}))
            out = char if out is None else sz.join_values(out, char)
        if base.kinds - {LIST, DICT, STR, UNDEF}:
            out = sz.UNDEFINED if out is None else sz.join_values(out, sz.UNDEFINED)
        return out if out is not None else sz.UNDEFINED

    # --- operators ------------------------------------------------------------------------------

    def binop(self, node: nodes.BinExpr, st: State) -> Value:
        left = self.a.expr(node.left, st)
        right = self.a.expr(node.right, st)
        if left.dead or right.dead or sz.undefined_only(left) or sz.undefined_only(right):
            return sz.DEAD  # arithmetic on Undefined raises
        numeric = left.kinds <= {NUM, BOOL} and right.kinds <= {NUM, BOOL}
        if isinstance(node, nodes.Add):
            if numeric:
                return _num(sz.sum_values(left, right), _add_n(left.n, right.n))
            # `+` only succeeds on two strings, two lists or two numbers (anything else
            # raises): the sum of the operands' measures bounds each.
            kinds = frozenset(
                k for k, ok in ((STR, {STR}), (LIST, {LIST}), (NUM, {NUM, BOOL}))
                if left.kinds & ok and right.kinds & ok
            )  # fmt: skip
            if not kinds:
                return sz.DEAD
            out = sz.sum_values(left, right)
            extra = sz.const(24) if NUM in kinds else {}
            return Value(
                P=sz.add(out.P, extra),
                X=sz.add(out.X, extra),
                C=out.C,
                D=out.D,
                I=out.I,
                kinds=kinds,
                case_mapped=out.case_mapped,
            )
        if isinstance(node, nodes.Sub):
            return _num(sz.sum_values(left, right), _add_n(left.n, right.n))
        if isinstance(node, nodes.Mul):
            if numeric:
                n = None if left.n is None or right.n is None else sz.mul(left.n, right.n)
                return _num(sz.sum_values(left, right), n)
            # Repetition: only by a constant count.
            times = self._const_int(node.right) or self._const_int(node.left)
            if times is None:
                raise Unproven("a string or list repeated by a computed count")
            seq = left if self._const_int(node.right) is not None else right
            return Value(
                P=sz.scale(seq.P, times),
                X=sz.scale(seq.X, times),
                C=sz.scale(seq.C, times),
                D=sz.scale(seq.D, times),
                I=sz.scale(seq.I, times),
                kinds=seq.kinds,
                elem=seq.elem,
            )
        if isinstance(node, (nodes.Div, nodes.FloorDiv)):
            divisor = self._const_int(node.right)
            n = left.n if divisor is not None and divisor >= 1 else None
            return _num(sz.sum_values(left, right), n)
        if isinstance(node, nodes.Mod):
            if STR in left.kinds:
                raise Unproven("%-formatting")
            return _num(sz.sum_values(left, right), right.n)
        raise Unproven(f"the operator {node.operator}")

    # --- calls ------------------------------------------------------------------------------------

    def call(self, node: nodes.Call, st: State) -> Value:
        if node.dyn_args is not None or node.dyn_kwargs is not None:
            raise Unproven("calls with *args or **kwargs")
        callee = self.a.expr(node.node, st)
        args = [self.a.expr(x, st) for x in node.args]
        kwargs = {str(k.key): self.a.expr(k.value, st) for k in node.kwargs}
        if callee.dead or any(v.dead for v in (*args, *kwargs.values())):
            return sz.DEAD
        obj = callee.obj
        if obj is None:
            return sz.DEAD  # request data is never callable (nor is Undefined): this raises
        kind = obj[0]
        if kind == "macro":
            return self.a.call_macro(obj[1], args, kwargs, st)
        if kind == "method":
            return self.method(obj[1], obj[2], args, kwargs, node)
        if kind == "loopfn":
            out = _bool()
            for arg in args:
                out = sz.join_values(out, arg)
            return out
        if kind == "global":
            return self.global_call(obj[1], args, kwargs, node, st)
        raise Unproven(f"a call of a {kind}")

    def global_call(
        self, name: str, args: list[Value], kwargs: dict[str, Value], node: nodes.Call, st: State
    ) -> Value:
        if name == "raise_exception":
            return sz.DEAD  # the render fails: nothing is sent
        if name == "namespace":
            nid = self.a.new_id()
            attrs = dict(kwargs)
            for pos in args:
                if pos.kinds - {DICT}:
                    raise Unproven("namespace() from a value that may not be a dict")
            st.ns[nid] = attrs
            return Value(kinds=frozenset(), obj=("ns", frozenset({nid})))
        if name == "dict":
            return self.mapping([(sz.text(k), v) for k, v in kwargs.items()])
        if name == "range":
            mags = [a.n for a in args]
            count = None if any(m is None for m in mags) else sz.add(*(m for m in mags if m))
            step = self._const_int(node.args[2]) if len(node.args) == 3 else None
            del step  # a step of magnitude >= 1 only shortens the range
            return Value(kinds=frozenset({LIST}), obj=("range", count))
        if name == "strftime_now":
            fmt = node.args[0] if node.args else None
            if not (isinstance(fmt, nodes.Const) and isinstance(fmt.value, str)):
                raise Unproven("strftime_now with a computed format")
            size = len(fmt.value) + STRFTIME_DIRECTIVE * fmt.value.count("%")
            return sz.as_string(sz.const(size), sz.const(6 * size + 2))
        raise Unproven(f"the global {name}")

    def method(
        self, name: str, base: Value, args: list[Value], kwargs: dict[str, Value], node: nodes.Call
    ) -> Value:
        if name in ("split", "rsplit", "splitlines"):
            return _split(base)
        if name in ("strip", "lstrip", "rstrip", "removeprefix", "removesuffix"):
            return sz.replace_kinds(sz.sub_part(base, ()), frozenset({STR}))
        if name in ("partition", "rpartition"):
            part = sz.replace_kinds(sz.sub_part(base, ()), frozenset({STR}))
            return Value(
                P=sz.add(part.P, *(a.P for a in args)),
                X=sz.add(part.X, *(a.X for a in args), sz.const(12)),
                C=sz.const(3),
                D=sz.const(3),
                I=sz.const(3),
                kinds=frozenset({LIST}),
                elem=frozenset({STR}),
            )
        if name in _CASE:
            return _case(base)
        if name == "replace":
            return _replace(base, node.args[0] if node.args else None,
                            node.args[1] if len(node.args) > 1 else None)  # fmt: skip
        if name in _PREDICATES:
            return _bool()
        if name in ("find", "rfind", "index", "rindex", "count"):
            return _num(None, _count(base))
        if name == "join":
            if not args:
                raise Unproven("join() without an argument")
            return self.join_with(args[0], base)
        if name in ("center", "ljust", "rjust", "zfill"):
            width = self._const_int(node.args[0]) if node.args else None
            if width is None:
                raise Unproven(f"{name}() with a computed width")
            return sz.as_string(sz.add(base.P, sz.const(width)), sz.add(base.X, sz.const(width)))
        if name == "items":
            return Value(kinds=frozenset({LIST}), obj=("items", base))
        if name == "keys":
            keys = sz.sub_part(base, ("#",), frozenset({STR}))
            return _listed(keys, base.C)
        if name == "values":
            return _listed(sz.sub_part(base, ("*",)), base.C)
        if name == "get":
            key = node.args[0] if node.args else None
            if isinstance(key, nodes.Const) and isinstance(key.value, str):
                got = sz.sub_part(base, ("." + key.value,))
            else:
                got = sz.sub_part(base, ("*",))
            default = args[1] if len(args) > 1 else kwargs.get("default", sz.scalar_word())
            return sz.join_values(got, default)
        raise Unproven(f"the method {name}()")


# --- shared helpers ------------------------------------------------------------------------------


def _add_n(a: Poly | None, b: Poly | None) -> Poly | None:
    return None if a is None or b is None else sz.add(a, b)
