"""The guaranteed bound of a chat-like request: a function of the raw request and the template
only (DESIGN.md, round-3 amendment to I1). Pure.

    g = ChatGuarantee.build(template, rule, special_tokens)   # at start (runs the proof)
    g.quick(raw, body, route)        # O(1) in the body's size: None when it does not apply
    g.tokens(body, route, media)     # the walk over every field (tokens.bound.measure); media:
                                     # the request's media cost (prompt.media), in tokens

The template's proof (`tokens.bound.proof`) bounds its output in bytes by a polynomial over the
measures of what it is handed; this module turns that into factors per input, and a
request's measures (`tokens.bound.measure`) into tokens:

    bytes  <= static + sum over leaves of the worst a*P + b*X (the template's frontier)
              + per value: the loop text printed for it (child / deep factors)
              + depth mass x indent + cross terms (accumulators printed in loops)
              + what engines add (default fields, per object) + special-token values
    tokens <= bytes (byte-level BPE without normaliser), or 3 x bytes under NFC unless every
              string is NFD-normalized or NFC without combining marks (tokens.bound.bounds)
              + the special tokens a post-processor may add + the media's cost (prompt.media).

Every input is position-agnostic within its part of the request: data may sit at whatever
role, key or depth an engine moves it to, so each byte is charged the worst chain of the
template's coefficients (tokens.bound.proof.sizes). The client's `messages` reach the template's
`messages`, its `tools`/`functions` the template's `tools` (both engines pass them so:
SGLang serving_chat.py `_apply_jinja_template`, vLLM chat_utils.py
`apply_hf_chat_template`); everything else in the body (chat_template_kwargs, documents,
reasoning fields, fields nobody models) may reach any of the template's inputs. For
/v1/responses and /v1/messages, converted to chat by the router or the engine, every field
may reach any input, and SGLang's fallback for a conversion it cannot make (plain
"role: content" lines, list content as Python reprs) is bounded too.

kvproxy's normalisation never enters: no role, flag or field name lowers this bound.
Never logs or keeps request text.
"""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvproxy.tokens.bound import measure as ms
from kvproxy.tokens.bound.bounds import NFC_MAX_EXPANSION, BoundRule
from kvproxy.tokens.bound.proof import KW, TemplateProof, Unproven, prove
from kvproxy.tokens.bound.proof import sizes as sz
from kvproxy.tokens.gate import INERT_KEYS

ROUTE_ROOTS: dict[str, dict[str, str]] = {
    # top-level key -> root, per route; every other key is the bag.
    "chat": {"messages": "messages", "tools": "tools", "functions": "tools"},
}
# SGLang's /v1/responses fallback prints each item as a line: the role, ": ", its content
# (lists as Python reprs) and a newline: at most the data's repr plus a label per value.
FALLBACK_PER_VALUE = 38
FALLBACK_CONST = 64
# Substrings the O(1) bound needs absent: media parts (their cost is
# configured per item, so the walk counts them) and exponent numbers ("1e300" is five bytes
# of body and up to 304 digits once an engine prints the integer it may stand for).
_MEDIA_MARKERS = ("image", "video", "audio")
# A number with an exponent (printed longer than sent) is `[0-9][eE][-+0-9]`. With every
# digit read as 0, E as e and + as -, it is exactly one of two substrings: a C translate and
# two substring scans, several times fewer instructions than the regex's per-byte charset.
_EXPONENT_FOLD = bytes.maketrans(b"0123456789E+", b"0000000000e-")
_EXPONENT_FORMS = (b"0e0", b"0e-")
# Top-level keys that never reach a template beyond messages and tools (`variant`).
_NO_KWARGS_KEYS = INERT_KEYS | {"messages", "tools", "functions"}


@dataclass(frozen=True)
class _Root:
    frontier: tuple[tuple[int, int], ...]
    alias: tuple[tuple[int, int], ...]
    levels: tuple[int, ...]
    depth: int

    @property
    def worst(self) -> int:
        """Largest a + b: the most one byte costs here (P <= X)."""
        return max((a + b for a, b in self.frontier), default=0)

    @property
    def worst_alias(self) -> int:
        return max((a + b for a, b in (*self.frontier, *self.alias)), default=0)

    @property
    def any_level(self) -> int:
        """The most one value costs at any depth."""
        return max(self.levels, default=0)

    def at(self, level: int) -> int:
        return self.levels[min(level, len(self.levels) - 1)] if self.levels else 0


class _Variant:
    """The factors of one proof of the template (see `prove`'s tools/kwargs variants)."""

    def __init__(self, proof: TemplateProof, specials: Mapping[str, str]) -> None:
        out = proof.out
        roots: dict[str, _Root] = {}
        for root in {v[1][0] for m in out for v in m} | {KW + k for k in proof.kwargs}:
            f = sz.root_factors(out, root)
            roots[root] = _Root(tuple(sorted(f.px)), tuple(sorted(f.px_alias)), f.levels, f.depth)
        empty = _Root((), (), (0,), 0)
        self.messages = roots.get("messages", empty)
        self.tools = roots.get("tools", empty)
        # Whatever may reach any input is charged the worst of all of them, at any depth.
        # Every such field is charged once at least: an engine may take it as prompt text
        # without any template (SGLang's chat `input_ids`, vLLM's kv_transfer_params).
        self.bag = _Root(
            tuple(sorted(sz.pareto({(1, 0), *(p for r in roots.values() for p in r.frontier)}))),
            (),
            (max((r.any_level for r in roots.values()), default=0),),
            max((r.depth for r in roots.values()), default=0),
        )
        # On a route the router or engine converts to chat (responses, messages), any field may
        # also become reasoning an engine copies under its alias names.
        self.converted = _Root(
            tuple(sorted(sz.pareto({*self.bag.frontier, *self.messages.alias}))),
            (),
            self.bag.levels,
            self.bag.depth,
        )
        # The O(1) bound prices every byte and value at the worst of any input (the value's
        # price read once here: `any_level` is a max over the levels, per request in `quick`).
        self.quick_value = self.bag.any_level
        self.quick_byte = max([1, *(r.worst for r in roots.values())])
        self.quick_byte_alias = max([1, *(r.worst_alias for r in roots.values())])
        # The tokenizer's special tokens are template inputs a request may also override:
        # their own text is charged as a constant, any override as bag data.
        self.static = sz.constant(out) + sum(
            _string_cost(roots[KW + k], text) for k, text in specials.items() if KW + k in roots
        )
        self.cross = sz.nonlinear(out)
        self.bases = {KW + k: text for k, text in specials.items()}
        self.case_mapped = proof.case_mapped

    def cross_terms(self, value_of: Any) -> int:
        """Cross terms (a product of measures, e.g. a message's content printed once per tool
        call): each variable at `value_of(measure, path)`, plus a special token's own text
        where one is the input."""
        out = 0
        for coef, mono in self.cross:
            term = coef
            for measure, path in mono:
                value = value_of(measure, path)
                base = self.bases.get(path[0])
                if base is not None and measure in "PX":
                    value += sz.utf8(base) if measure == "P" else sz.longest(base)
                term *= value
            out += term
        return out


class ChatGuarantee:
    """The proven bound for one template (see the module docstring)."""

    def __init__(
        self,
        variants: dict[tuple[bool, bool], _Variant],
        rule: BoundRule | None,
        special_tokens: int,
        template_nfc_safe: bool,
    ) -> None:
        self.rule = rule
        self.special_tokens = special_tokens
        self.variants = variants
        # NFC may reshape the render's text only where template text or request text has
        # characters it can act on: the template's own text is checked once here.
        self.template_nfc_safe = template_nfc_safe and not any(
            v.case_mapped for v in variants.values()
        )

    @classmethod
    def build(
        cls,
        source: str,
        rule: BoundRule | None,
        special_tokens: int,
        specials: Mapping[str, str],
    ) -> ChatGuarantee | str:
        """The guarantee for `source`, or why the template could not be proven. Four proofs:
        with and without tools, with and without fields that may reach the template beyond
        messages and tools (most requests have neither, and a template's tool preamble or a
        kwarg's branch then never prints)."""
        # Immutable once built, and the proofs are the expensive part (four abstract runs
        # over the AST): counters for the same template (a model behind several clusters,
        # a reload) share one.
        return _build(source, rule, special_tokens, tuple(sorted(specials.items())))

    def variant(self, body: Mapping[str, Any], route: str) -> _Variant:
        """The proof that covers this request: tools when it sends any; other fields when
        any top-level field but messages and tools may reach the template (every field of
        /v1/responses and /v1/messages may: the conversion maps them)."""
        if route != "chat":
            return self.variants[(True, True)]
        tools = bool(body.get("tools")) or bool(body.get("functions"))
        kwargs = not _NO_KWARGS_KEYS.issuperset(body)
        return self.variants[(tools, kwargs)]

    # --- O(1) -----------------------------------------------------------------------------

    def quick(self, raw: bytes, body: Mapping[str, Any], route: str) -> int | None:
        """A bound from the body's length and a few byte counts (C speed): every measure of
        any field is at most REPRINT_PER_BYTE per body byte, every value follows a comma or
        an opening bracket. None when the body holds media or exponent numbers (the walk
        prices those) or the tokenizer has no byte bound."""
        if self.rule is None:
            return None
        # The ASCII markers are looked for in the text: `in` on a str is a plain substring
        # scan, while on bytes it first tries the needle as an integer and formats the
        # TypeError it swallows, and bytes.find parses its arguments (each ~2x a str `in`).
        # UTF-8 never puts an ASCII byte inside a multi-byte character, and an undecodable
        # byte becomes a lone surrogate: an ASCII needle is in the text iff it is in `raw`.
        text = raw.decode("utf-8", "surrogateescape")
        for marker in _MEDIA_MARKERS:
            if marker in text:
                return None
        folded = raw.translate(_EXPONENT_FOLD)
        for form in _EXPONENT_FORMS:
            if folded.find(form) >= 0:
                return None
        v = self.variant(body, route)
        objects = raw.count(b"{")
        brackets = objects + raw.count(b"[")
        values = raw.count(b",") + brackets + ms.QUICK_OBJECT_VALUES * objects
        data = ms.REPRINT_PER_BYTE * len(raw) + ms.QUICK_OBJECT_BYTES * objects
        byte = v.quick_byte
        if "reasoning" in text or "thinking" in text:
            byte = v.quick_byte_alias
        size = v.static + byte * data + v.quick_value * values
        depth = v.bag.depth
        if depth:
            size += depth * values * brackets
        if v.cross:
            size += v.cross_terms(
                lambda m, _: data if m in "PX" else (values * brackets if m == "I" else values)
            )
        if route == "responses":
            size = max(size, _fallback(data, values))
        ascii_text = raw.isascii() and "\\u" not in text
        return self._tokens(size, ascii_text, 0)

    # --- the walk ---------------------------------------------------------------------------

    def tokens(self, body: Mapping[str, Any], route: str, media_tokens: int) -> int | None:
        """The bound from every field of the parsed body (tokens.bound.measure), plus
        `media_tokens`, what the request's media become (prompt.media, summed over every
        item); None when the tokenizer has no byte bound."""
        if self.rule is None:
            return None
        v = self.variant(body, route)
        roots = ROUTE_ROOTS.get(route, {})
        parts: list[tuple[str, Any, bool]] = []
        bag: dict[str, Any] = {}
        for key, value in body.items():
            target = roots.get(key)
            if target is None:
                bag[key] = value
            else:
                parts.append((target, value, target == "messages"))
        parts.append(("bag", bag, False))
        costs = {
            "messages": (v.messages.frontier, v.messages.alias),
            "tools": (v.tools.frontier, ()),
            "bag": (v.bag.frontier if route == "chat" else v.converted.frontier, ()),
        }
        m = ms.measure(parts, costs, self.rule)
        size = v.static
        totals = {"P": 0, "X": 0, "C": 0, "D": 0, "I": 0}
        bag_root = v.bag if route == "chat" else v.converted
        for name, root in (("messages", v.messages), ("tools", v.tools), ("bag", bag_root)):
            rm = m.roots.get(name)
            if rm is None:
                continue
            if name == "messages" and route == "chat":
                # Both engines keep a chat's messages where the client put them (adding the
                # values counted in measure's *_ADDS): each value is priced at its depth.
                values = sum(n * root.at(k) for k, n in enumerate(rm.levels))
            else:
                values = sum(rm.levels) * root.any_level
            values += rm.parsed * root.any_level
            size += rm.leaf_cost + root.worst * rm.added_bytes + values + root.depth * rm.depth
            if name == "messages" and root.worst < 1:
                # SGLang appends a continued final message's text after the render.
                size += rm.leaves_p
            totals["P"] += rm.leaves_p + rm.added_bytes
            totals["X"] += rm.leaves_x + rm.added_bytes
            totals["D"] += rm.values
            totals["C"] += rm.values
            totals["I"] += rm.depth
        size += v.cross_terms(functools.partial(_cross_value, m, totals, route))
        if route == "responses":
            size = max(size, _fallback(totals["X"], totals["D"]))
        return self._tokens(size, m.nfc_safe, media_tokens)

    # --- shared -----------------------------------------------------------------------------

    def _tokens(self, size: int, text_nfc_safe: bool, media: int) -> int:
        factor = 1
        if self.rule == "nfc" and not (text_nfc_safe and self.template_nfc_safe):
            factor = NFC_MAX_EXPANSION
        return factor * size + self.special_tokens + media

    def describe(self) -> str:
        v = self.variants[(True, True)]
        plain = self.variants[(False, False)]
        m, t, b = v.messages, v.tools, v.bag
        return (
            f"messages x{m.worst} (+{m.at(0)}/message), tools x{t.worst}, other fields "
            f"x{b.worst}, static {v.static} bytes ({plain.static} without tools or kwargs)"
        )


def text_tokens(body: Mapping[str, Any], rule: BoundRule | None, overhead: int) -> int | None:
    """A bound on any one sequence an engine can prefill from a prompt-only request, whatever
    field it reads its text from: every string and number in the body (one sequence never
    holds more than all of them), plus `overhead` (a reranker's or cross-encoder's wrapper,
    the post-processor's special tokens). Token ids count as their digits + 2 each, which is
    at least one token each. None: the tokenizer has no byte bound."""
    if rule is None:
        return None
    walk = ms.Walk({"bag": (((1, 0),), ())}, rule)
    walk.root("bag", dict(body))
    m = walk.done()
    size = m.roots["bag"].leaf_cost
    factor = 1 if rule == "bytes" or m.nfc_safe else NFC_MAX_EXPANSION
    return factor * size + overhead


def _fallback(data: int, values: int) -> int:
    """SGLang's /v1/responses fallback: every item's role and content on a line, list
    content as Python reprs: at most the data's longest form plus a label per value."""
    return data + FALLBACK_PER_VALUE * values + FALLBACK_CONST


_MEASURE_INDEX = {"P": 0, "X": 1, "C": 2, "D": 3}


def _cross_value(
    m: ms.Measures, totals: Mapping[str, int], route: str, measure: str, path: tuple[str, ...]
) -> int:
    """A cross term's variable for this request. On a chat, a variable under a key of the
    client's messages or tools (`messages[*].tool_calls`) is that key's own measure: the
    engines keep a chat's fields under their names (the reasoning aliases summed, as they
    are copied under each other's); otherwise the measure of its part of the request
    (messages, tools, or every other field for the template's other inputs). Other routes
    are converted by the router or engine: every variable is the request's total."""
    root = path[0]
    part = {"messages": "messages", "tools": "tools"}.get(root)
    if root.startswith(KW):
        part = "bag"
    keys = [step[1:] for step in path[1:] if step.startswith(".")]
    rm = m.roots.get(part) if part else None
    if route != "chat" or part is None:
        return totals[measure]
    if rm is None:
        return 0  # nothing of the request reaches this input
    if part == "bag" or measure == "I" or not keys:
        return _root_total(rm, measure)
    key = keys[-1]
    index = _MEASURE_INDEX[measure]
    if key in ms.ALIAS_KEYS:
        return 3 * sum(rm.under.get(k, [0, 0, 0, 0])[index] for k in ms.ALIAS_KEYS)
    return rm.under.get(key, [0, 0, 0, 0])[index]


def _root_total(rm: ms.RootMeasure, measure: str) -> int:
    return {
        "P": rm.leaves_p + rm.added_bytes,
        "X": rm.leaves_x + rm.added_bytes,
        "C": rm.values,
        "D": rm.values,
        "I": rm.depth,
    }[measure]


def _string_cost(root: _Root, text: str) -> int:
    p, x = sz.utf8(text), sz.longest(text)
    return max((a * p + b * x for a, b in root.frontier), default=0)


def _nfc_safe(text: str) -> bool:
    if text.isascii():
        return True
    if unicodedata.is_normalized("NFD", text):
        return True
    return unicodedata.is_normalized("NFC", text) and not ms._has_marks(text)


@functools.lru_cache(maxsize=64)
def _proof(source: str, tools: bool, kwargs: bool, names: frozenset[str]) -> TemplateProof:
    """One variant's proof: it bounds bytes, whatever the rule, so a template bounded under
    two rules or special-token counts (the byte bound beside a tokenizer's, two tokenizers
    sharing a template) is proven once (~2 s for Qwen-3.5's four variants). Unproven is
    raised again each time (lru_cache keeps no exception)."""
    return prove(source, tools=tools, kwargs=kwargs, specials=names)


@functools.lru_cache(maxsize=16)
def _build(
    source: str, rule: BoundRule | None, special_tokens: int, specials: tuple[tuple[str, str], ...]
) -> ChatGuarantee | str:
    names = frozenset(name for name, _ in specials)
    variants: dict[tuple[bool, bool], _Variant] = {}
    try:
        for tools in (True, False):
            for kwargs in (True, False):
                proof = _proof(source, tools, kwargs, names)
                variants[(tools, kwargs)] = _Variant(proof, dict(specials))
    except Unproven as exc:
        return str(exc)
    except RecursionError:
        return "the template is nested too deeply to analyse"
    if rule == "nfc":
        ms.prepare()
    return ChatGuarantee(variants, rule, special_tokens, _nfc_safe(source))


__all__ = ["ChatGuarantee", "text_tokens"]
