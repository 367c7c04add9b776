"""Size algebra for the template proof (`tokens.bound.proof`): polynomials over measures of the data
a chat template receives, and the values a template computes. Pure, no I/O.

A *measure* of the data at a *path* is one of:

    P  plain bytes: UTF-8 bytes of every string (values and keys) and the printed length of
       every number, boolean and null, as `{{ x }}` prints a string leaf;
    X  longest printed bytes of the same leaves in any form an engine or template prints
       them (`json.dumps` with and without `ensure_ascii`, Python's `repr`, each with its
       quotes; numbers as Python prints them after any re-serialisation);
    C  children: elements of the lists and entries of the dicts at the path;
    D  descendants: every value below the path (a leaf 0, `[1, [2]]` 3);
    I  depth mass: the sum of those descendants' depths (what `tojson(indent=k)` indents).

A path starts at a root (`messages`, `tools`, `kw:<name>`, a loop element `L<k>`, a macro
parameter) and goes down by steps: `.key` (a constant key), `[i]` (a constant index: all
constant indices are one step, they may alias), `*` (any element or value) and `#` (any key).
For every measure, disjoint paths hold disjoint data (`.a` and `.b`, `*` and `#`), and a path
holds all the data of the paths below it (`*` overlaps every constant key and index).

A `Poly` is a polynomial with non-negative integer coefficients over variables
(measure, path); its constant term is `()`. Every size the proof computes is an upper bound
built only from sums, products and coefficient-wise maxima of such polynomials, so each
bound stays monotone in every measure. `multipliers` turns a polynomial over the roots'
variables into per-root factors that a request's measures (tokens.bound.measure) are multiplied
by: the largest number of times one byte (or one value) can be printed, over every
position the data could occupy (a normalisation may move data anywhere inside its root).

Never logs; holds no request data (measures are numbers, paths name template variables).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Var = tuple[str, tuple[str, ...]]  # (measure, path)
Mono = tuple[Var, ...]  # sorted; () is the constant term
Poly = Mapping[Mono, int]

MEASURES = ("P", "X", "C", "D", "I")
ZERO: Poly = {}

# Kinds of Python value a template expression can hold.
STR, NUM, BOOL, NONE, LIST, DICT, UNDEF = "str", "num", "bool", "none", "list", "dict", "undef"
ANY: frozenset[str] = frozenset({STR, NUM, BOOL, NONE, LIST, DICT, UNDEF})
SCALARS: frozenset[str] = frozenset({STR, NUM, BOOL, NONE, UNDEF})
CONTAINERS: frozenset[str] = frozenset({LIST, DICT})
# The printed length of `True`, `False`, `None`, `null`, `true`, `false` at most.
SCALAR_WORD = 5
# Repr/JSON of a container beyond its leaves: brackets 2 per container, and per descendant
# a separator ", " plus ": " when it is an entry value, plus its own brackets if it is a
# container: at most 6 per descendant and 2 for the outermost (a 1-tuple's trailing comma
# adds 1 more: 4 covers it).
STRUCT_PER_VALUE = 6
STRUCT_OUTER = 4


class Unproven(Exception):
    """The template does something whose output size the proof cannot bound."""


def const(n: int) -> Poly:
    return {(): n} if n else {}


def var(measure: str, path: tuple[str, ...]) -> Poly:
    return {((measure, path),): 1}


def add(*polys: Poly) -> Poly:
    out: dict[Mono, int] = {}
    for p in polys:
        for m, c in p.items():
            out[m] = out.get(m, 0) + c
    return out


def scale(p: Poly, k: int) -> Poly:
    if k <= 0:
        return {}
    return {m: c * k for m, c in p.items()}


def mul(a: Poly, b: Poly) -> Poly:
    out: dict[Mono, int] = {}
    for ma, ca in a.items():
        for mb, cb in b.items():
            m = tuple(sorted(ma + mb))
            out[m] = out.get(m, 0) + ca * cb
    return out


def join(a: Poly, b: Poly) -> Poly:
    """An upper bound of both (each is a bound of one branch's size).

    Coefficient-wise maximum, tightened two ways. A part of a string never outweighs the
    string: a branch printing `x` and one printing a piece of it (`x.split(...)[-1]`) need
    `x` once, not both (`_absorb`). And P <= X at every path: a branch printing P(x) and one
    printing X(x) together need X(x), not P(x) + X(x); for each path the pair (p, x) of
    linear coefficients becomes (max(p1 + x1, p2 + x2) - max(x1, x2), max(x1, x2)), the least
    linear form above both on 0 <= P <= X."""
    b = _absorb(b, a)
    a = _absorb(a, b)
    out: dict[Mono, int] = {}
    pairs: dict[tuple[str, ...], list[int]] = {}
    for src, i in ((a, 0), (b, 1)):
        for m, c in src.items():
            if len(m) == 1 and m[0][0] in ("P", "X"):
                slot = pairs.setdefault(m[0][1], [0, 0, 0, 0])
                slot[2 * i + (m[0][0] == "X")] += c
            else:
                out[m] = max(out.get(m, 0), c)
    for path, (p1, x1, p2, x2) in pairs.items():
        x = max(x1, x2)
        p = max(p1 + x1, p2 + x2) - x
        if x:
            out[(("X", path),)] = x
        if p:
            out[(("P", path),)] = p
    return out


def _absorb(b: Poly, a: Poly) -> Poly:
    """`b` without the P/X terms that a term of `a` at a proper prefix of their paths already
    covers in a join. Sound when `b` has nothing at that prefix itself and every chain of
    `b`'s terms below it sums to at most `a`'s coefficient there: for any byte below the
    prefix, the join then counts `a`'s term, which is at least what `b` counted there."""
    terms = [(m[0][0], m[0][1], c) for m, c in b.items() if len(m) == 1 and m[0][0] in "PX"]
    if not terms:
        return b
    drop: set[Mono] = set()
    for m, c in a.items():
        if len(m) != 1 or m[0][0] not in "PX":
            continue
        measure, prefix = m[0]
        n = len(prefix)
        below = [t for t in terms if len(t[1]) > n and t[1][:n] == prefix]
        if not below or any(t[1] == prefix for t in terms):
            continue
        # An X term covers P and X below it; a P term covers only P.
        if measure == "P" and any(t[0] == "X" for t in below):
            continue
        tree = _Tree()
        for _, path, coef in below:
            tree.at(path[n:]).coeff[0] += coef
        if _chain_max(tree) <= c:
            drop.update((((meas, path),)) for meas, path, _ in below)
    return {m: c for m, c in b.items() if m not in drop} if drop else b


def join_all(polys: Iterable[Poly]) -> Poly:
    out: Poly = {}
    for p in polys:
        out = join(out, p)
    return out


def leq(a: Poly, b: Poly) -> bool:
    """a <= b coefficient-wise (a sufficient test for a fixpoint)."""
    return all(c <= b.get(m, 0) for m, c in a.items())


def roots_of(p: Poly) -> set[str]:
    return {v[1][0] for m in p for v in m}


def substitute(p: Poly, fn: Any) -> Poly:
    """Replace every variable v by the polynomial fn(v) (or keep it when fn returns None)."""
    out: dict[Mono, int] = {}
    for m, c in p.items():
        term: Poly = {(): c}
        for v in m:
            rep = fn(v)
            term = mul(term, {(v,): 1} if rep is None else rep)
        for mm, cc in term.items():
            out[mm] = out.get(mm, 0) + cc
    return out


# --- values ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Value:
    """Upper bounds on the measures of what an expression evaluates to.

    `kinds` are the Python types it may have; `elem` the kinds of its elements when known
    (a split() result holds strings); `n` bounds its magnitude when it is a count the
    template computed (loop indices, lengths), None when unknown; `obj` marks the template's
    own objects (namespaces, the loop, macros, methods awaiting a call)."""

    P: Poly = field(default_factory=dict)
    X: Poly = field(default_factory=dict)
    C: Poly = field(default_factory=dict)
    D: Poly = field(default_factory=dict)
    I: Poly = field(default_factory=dict)  # noqa: E741 (the measure's name)
    kinds: frozenset[str] = ANY
    elem: frozenset[str] | None = None
    n: Poly | None = None
    obj: Any = None
    # A case mapping (lower, upper, ...) of client text flowed in: it may create combining
    # characters NFC then composes differently (tokens.bound.guarantee charges NFC's factor).
    case_mapped: bool = False
    # Evaluating it certainly raises (an attribute of Undefined, `+` with Undefined,
    # raise_exception): the render fails and nothing is sent, so the path prints nothing.
    dead: bool = False
    # Bounds on any one element, when tighter than the whole's (a piece of `s.split()` is at
    # most `s`, while the list prints quotes and separators around every piece).
    item: Value | None = None

    def measure(self, m: str) -> Poly:
        return getattr(self, m)  # type: ignore[no-any-return]


def data(path: tuple[str, ...], kinds: frozenset[str] = ANY) -> Value:
    """The data at `path`, of unknown shape."""
    return Value(
        P=var("P", path),
        X=var("X", path),
        C=var("C", path),
        D=var("D", path),
        I=var("I", path),
        kinds=kinds,
    )


def text(s: str) -> Value:
    """A constant string the template wrote."""
    return Value(P=const(utf8(s)), X=const(longest(s)), kinds=frozenset({STR}))


def number(n: int | None = None, mag: Poly | None = None) -> Value:
    """A number the template computed: printed in at most 24 bytes (a float's repr; any
    count of a request's values fits in 20 digits)."""
    return Value(P=const(24), X=const(24), kinds=frozenset({NUM}), n=mag)


def scalar_word() -> Value:
    return Value(P=const(SCALAR_WORD), X=const(SCALAR_WORD), kinds=frozenset({BOOL, NONE, UNDEF}))


EMPTY = Value(kinds=frozenset({STR}))
DEAD = Value(kinds=frozenset(), dead=True)
UNDEFINED = Value(kinds=frozenset({UNDEF}))


def undefined_only(v: Value) -> bool:
    """Certainly jinja2's Undefined (any attribute, item or `+` of it raises)."""
    return v.obj is None and bool(v.kinds) and v.kinds <= {UNDEF}


def join_values(a: Value, b: Value) -> Value:
    if a.dead:
        return b
    if b.dead:
        return a
    if a.obj is not None or b.obj is not None:
        if a.obj is None and _is_empty(a):
            return b
        if b.obj is None and _is_empty(b):
            return a
        if a.obj != b.obj:
            raise Unproven("two kinds of template object meet in one variable")
    n = None if a.n is None or b.n is None else join(a.n, b.n)
    elem = None if a.elem is None or b.elem is None else a.elem | b.elem
    item = None if a.item is None or b.item is None else join_values(a.item, b.item)
    return Value(
        P=join(a.P, b.P),
        X=join(a.X, b.X),
        C=join(a.C, b.C),
        D=join(a.D, b.D),
        I=join(a.I, b.I),
        kinds=a.kinds | b.kinds,
        elem=elem,
        n=n,
        obj=a.obj if a.obj is not None else b.obj,
        case_mapped=a.case_mapped or b.case_mapped,
        item=item,
    )


def _is_empty(v: Value) -> bool:
    return not (v.P or v.X or v.C or v.D or v.I)


def narrow(v: Value, kinds: frozenset[str]) -> Value:
    """`v` known to have one of `kinds`: a scalar has no children (C = D = I = 0), and a
    boolean, None or Undefined prints in a few bytes, whatever path it came from."""
    kinds = v.kinds & kinds
    if v.obj is not None or v.dead:
        return v
    if kinds <= {BOOL, NONE, UNDEF}:
        return Value(P=const(SCALAR_WORD), X=const(SCALAR_WORD), kinds=kinds)
    if kinds <= SCALARS:
        # A scalar's bytes are the leaf at its path, never data below it: the `$` step says
        # so, and `multipliers` then does not add this term to any deeper chain (a template
        # printing `content` when it is a string and its parts when it is a list prints each
        # byte once).
        return dataclasses.replace(
            v, P=_leaf(v.P, "P"), X=_leaf(v.X, "X"), C={}, D={}, I={}, kinds=kinds, elem=None
        )
    return dataclasses.replace(v, kinds=kinds)


def _leaf(poly: Poly, m: str) -> Poly:
    out: dict[Mono, int] = {}
    for mono, c in poly.items():
        if len(mono) == 1 and mono[0][0] == m and mono[0][1][-1] != "$":
            mono = ((m, (*mono[0][1], "$")),)
        out[mono] = out.get(mono, 0) + c
    return out


def replace_obj(v: Value, obj: Any) -> Value:
    return dataclasses.replace(v, obj=obj)


def replace_kinds(v: Value, kinds: frozenset[str]) -> Value:
    return dataclasses.replace(v, kinds=kinds, obj=None)


def sum_values(*vs: Value, kinds: frozenset[str] | None = None) -> Value:
    return Value(
        P=add(*(v.P for v in vs)),
        X=add(*(v.X for v in vs)),
        C=add(*(v.C for v in vs)),
        D=add(*(v.D for v in vs)),
        I=add(*(v.I for v in vs)),
        kinds=kinds if kinds is not None else frozenset().union(*(v.kinds for v in vs)),
        case_mapped=any(v.case_mapped for v in vs),
    )


def sub_part(v: Value, steps: tuple[str, ...], kinds: frozenset[str] | None = None) -> Value:
    """A part of `v` reached by `steps` (a key, an element, a slice...).

    Data terms follow the steps (the measure of x.content is P(x.content)); every other term
    is kept whole, since a part is never larger than the whole. A part's children are the
    whole's descendants."""
    if v.item is not None and steps and (steps[0] == "*" or steps[0].startswith("[")):
        return sub_part(v.item, steps[1:], kinds)

    def extend(poly: Poly, m: str) -> Poly:
        out: dict[Mono, int] = {}
        for mono, c in poly.items():
            if len(mono) == 1 and mono[0][0] == m:
                mono = ((m, mono[0][1] + steps),)
            out[mono] = out.get(mono, 0) + c
        return out

    def nonpath(poly: Poly, m: str) -> Poly:
        return {mono: c for mono, c in poly.items() if not (len(mono) == 1 and mono[0][0] == m)}

    def path_terms(poly: Poly, m: str) -> Poly:
        return {mono: c for mono, c in poly.items() if len(mono) == 1 and mono[0][0] == m}

    # Children of a data part are C(path + steps); any other value's part has at most the
    # whole's descendants as children.
    c_part = add(extend(path_terms(v.C, "C"), "C"), nonpath(v.D, "D"))
    return Value(
        P=extend(v.P, "P"),
        X=extend(v.X, "X"),
        C=c_part,
        D=extend(v.D, "D"),
        I=extend(v.I, "I"),
        kinds=kinds if kinds is not None else (v.elem if v.elem is not None else ANY),
        case_mapped=v.case_mapped,
    )


def printed(v: Value) -> tuple[Poly, Poly]:
    """(P, X) of `str(v)`: a string or scalar prints itself, a container its repr."""
    if v.kinds <= SCALARS:
        return v.P, v.X
    rep = add(v.X, scale(v.D, STRUCT_PER_VALUE), const(STRUCT_OUTER))
    # Which branch the value takes is unknown: a string prints P, a container its repr.
    return join(v.P, rep), rep


def as_string(p: Poly, x: Poly, case_mapped: bool = False) -> Value:
    return Value(P=p, X=x, kinds=frozenset({STR}), case_mapped=case_mapped)


def json_text(v: Value, indent: int | None, item_sep: int, key_sep: int) -> Value:
    """`json.dumps(v, indent=..., separators=...)`: leaves in their longest form, each value
    its separators, and with `indent` one line per value indented by its depth (two lines per
    container: opening and closing)."""
    per_value = item_sep + key_sep + 2
    size = add(v.X, scale(v.D, per_value), const(STRUCT_OUTER))
    if indent is not None:
        size = add(size, scale(v.D, 2 + 2 * indent), const(2), scale(v.I, 2 * indent))
    # Escaping the JSON text again (tojson of tojson) grows it at most 3x (a 2-byte
    # character to \\uXXXX); tracked only as X.
    return as_string(size, add(scale(size, 3), const(2)), v.case_mapped)


# --- from the template's constants ------------------------------------------------------------


def utf8(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def longest(s: str) -> int:
    """Longest printed form of a constant string (see `tokens.bound.measure.string_forms`)."""
    import json

    return max(
        len(json.dumps(s)),
        utf8(json.dumps(s, ensure_ascii=False)),
        utf8(repr(s)),
    )


# --- from a polynomial over the roots to per-root multipliers ----------------------------------


@dataclass
class _Tree:
    """Coefficients of one measure's linear terms, arranged by path."""

    coeff: list[int] = field(default_factory=lambda: [0, 0])  # (P or C/D/I..., X)
    kids: dict[str, _Tree] = field(default_factory=dict)

    def at(self, steps: tuple[str, ...]) -> _Tree:
        node = self
        for s in steps:
            node = node.kids.setdefault(s, _Tree())
        return node


def _merge(trees: list[_Tree]) -> _Tree:
    out = _Tree()
    for t in trees:
        out.coeff = [a + b for a, b in zip(out.coeff, t.coeff, strict=True)]
        for k, sub in t.kids.items():
            out.kids[k] = _merge([out.kids[k], sub]) if k in out.kids else _merge([sub])
    return out


def _groups(t: _Tree) -> list[_Tree]:
    """The child subtrees whose data may overlap, merged: each constant key with `*`; all
    constant indices with `*`; `*` alone (values no constant names); `#` (keys) alone."""
    star = [t.kids["*"]] if "*" in t.kids else []
    idx = [s for k, s in t.kids.items() if k.startswith("[")]
    out = [_merge([*idx, *star])] if idx or star else []
    for k, s in t.kids.items():
        if k.startswith("."):
            out.append(_merge([s, *star, *idx]))
    for k in ("#", "$"):
        if k in t.kids:
            out.append(t.kids[k])
    return out


def _frontier(t: _Tree, above: tuple[int, int]) -> set[tuple[int, int]]:
    """(P, X) coefficient sums along every chain from the root through `t`."""
    here = (above[0] + t.coeff[0], above[1] + t.coeff[1])
    out = {here}
    for g in _groups(t):
        out |= _frontier(g, here)
    return pareto(out)


def pareto(pairs: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Drop pairs another one dominates on 0 <= P <= X (x' >= x and p' + x' >= p + x)."""
    return {
        (p, x)
        for p, x in pairs
        if not any((x2 >= x and p2 + x2 >= p + x) and (p2, x2) != (p, x) for p2, x2 in pairs)
    }


def _chain_max(t: _Tree) -> int:
    return t.coeff[0] + max((_chain_max(g) for g in _groups(t)), default=0)


def _levels(c: _Tree | None, d: _Tree | None) -> list[int]:
    """levels[k]: the largest multiplicity of a value whose parent is at depth k. A value is
    counted by C at its parent's position and by D at every ancestor position; below the
    deepest position a tree names, only the D coefficients above count (a tail that holds
    for every deeper level)."""
    explicit: dict[int, int] = {}
    tails: list[tuple[int, int]] = []

    def visit(cn: _Tree | None, dn: _Tree | None, depth: int, chain: int) -> None:
        here = chain + (dn.coeff[0] if dn else 0)
        explicit[depth] = max(explicit.get(depth, 0), here + (cn.coeff[0] if cn else 0))
        tails.append((depth + 1, here))
        for sc, sd in _paired_groups(cn, dn):
            visit(sc, sd, depth + 1, here)

    visit(c, d, 0, 0)
    top = max(explicit) + 1
    return [
        max(explicit.get(k, 0), max((v for start, v in tails if start <= k), default=0))
        for k in range(top + 1)
    ]


def _paired_groups(c: _Tree | None, d: _Tree | None) -> list[tuple[_Tree | None, _Tree | None]]:
    empty = _Tree()
    c = c or empty
    d = d or empty
    keys = set(c.kids) | set(d.kids)
    star_c = [c.kids["*"]] if "*" in c.kids else []
    star_d = [d.kids["*"]] if "*" in d.kids else []
    idx_c = [s for k, s in c.kids.items() if k.startswith("[")]
    idx_d = [s for k, s in d.kids.items() if k.startswith("[")]
    out: list[tuple[_Tree | None, _Tree | None]] = []
    if star_c or star_d or idx_c or idx_d:
        out.append((_merge([*idx_c, *star_c]), _merge([*idx_d, *star_d])))
    for k in keys:
        if k.startswith("."):
            sc = [c.kids[k]] if k in c.kids else []
            sd = [d.kids[k]] if k in d.kids else []
            out.append((_merge([*sc, *star_c, *idx_c]), _merge([*sd, *star_d, *idx_d])))
    for k in ("#", "$"):
        if k in keys:
            out.append((c.kids.get(k), d.kids.get(k)))
    return out


@dataclass(frozen=True)
class RootFactors:
    """How often one root's data can be printed, whatever position it occupies.

    `px`: (P, X) coefficient pairs, one per kind of position (a byte at such a position is
    printed at most p * P + x * X of its measures); `px_alias`: the same for data under
    the reasoning keys an engine copies (`reasoning`, `reasoning_content`, `thinking` are
    one datum printed through each name); `levels[k]`: the largest multiplicity of one
    value whose parent is k levels below the root (per-value costs: separators, the text a
    loop prints per element), the last entry holding for every deeper level; `child`,
    `deep`: levels[0] and the largest of the rest; `depth`: multiplier of the depth mass."""

    px: frozenset[tuple[int, int]]
    px_alias: frozenset[tuple[int, int]]
    child: int
    deep: int
    depth: int
    levels: tuple[int, ...] = (0,)


ALIAS_KEYS = (".reasoning", ".reasoning_content", ".thinking")


def _frontier_alias(t: _Tree, above: tuple[int, int]) -> set[tuple[int, int]]:
    """Like `_frontier`, for one datum an engine copies under every alias name of the message
    at each position: three copies under the positions above it, and one under each name."""
    here = (above[0] + t.coeff[0], above[1] + t.coeff[1])
    star = [t.kids["*"]] if "*" in t.kids else []
    sums = {(len(ALIAS_KEYS) * here[0], len(ALIAS_KEYS) * here[1])}
    for k in ALIAS_KEYS:
        parts = ([t.kids[k]] if k in t.kids else []) + star
        if parts:
            below = _frontier(_merge(parts), (0, 0))
            sums = pareto({(p + q, x + y) for p, x in sums for q, y in below})
    out = set(sums)
    for g in _groups(t):
        out |= _frontier_alias(g, here)
    return pareto(out)


def root_factors(poly: Poly, root: str) -> RootFactors:
    """Per-root factors of the linear terms of `poly` over `root`'s variables."""
    trees: dict[str, _Tree] = {m: _Tree() for m in MEASURES}
    for mono, c in poly.items():
        if len(mono) != 1:
            continue
        measure, path = mono[0]
        if path[0] != root:
            continue
        tree = trees["P" if measure == "X" else measure].at(path[1:])
        if measure == "X":
            tree.coeff[1] += c
        else:
            tree.coeff[0] += c
    px = _frontier(trees["P"], (0, 0))
    alias = _frontier_alias(trees["P"], (0, 0))
    levels = _levels(trees["C"], trees["D"])
    return RootFactors(
        px=frozenset(px),
        px_alias=frozenset(pareto(alias)),
        child=levels[0],
        deep=max(levels[1:], default=0),
        depth=_chain_max(trees["I"]),
        levels=tuple(levels),
    )


def nonlinear(poly: Poly) -> list[tuple[int, tuple[Var, ...]]]:
    return [(c, m) for m, c in poly.items() if len(m) > 1]


def constant(poly: Poly) -> int:
    return poly.get((), 0)
