"""Measures of a raw request: the numbers the template proof's factors multiply. Pure.

For each part of the request an engine could hand the template (`messages`, `tools`, and a
`bag` of every other top-level field: chat_template_kwargs, documents, reasoning fields,
tool_choice, response_format, fields nobody models), the walk sums, over every string (value
or key), number, boolean and null, the cost of printing it at the template's worst position
(`a * P + b * X` over the proof's frontier, tokens.bound.proof.sizes), and counts its values
and their depths. Measures are taken in their longest printed form:

  * strings: P = UTF-8 bytes; X = a bound on the longest of `json.dumps` (ASCII-escaped or
    not) and `repr`, quotes included, summed per character (`_sizes`). A string an engine may
    parse as JSON (tool-call arguments; any string that parses, wherever it sits) is also
    measured as the parsed value, re-printed;
  * integers: every digit, + 2 for a router that re-serialises them as floats ("5" -> "5.0");
    floats: 24 (the longest `repr` of a float), or every digit of the integer a float stands
    for (orjson turns integers beyond 64 bits into floats; Python's json keeps them whole);
  * booleans and null: 5.

Engines add data the client did not send (default fields of their request models, dumped
with the tool or message: `"strict": false`, `"index": null`, the `{"type": "text"}` wrapper
of string content): they are charged per object of each kind the engines' models dump
(`*_ADDS`, cited at the constants), at the depth they add it.

Long strings are measured in windows (`bounds.WINDOW_CHARS`), so no C call holds the GIL long;
bodies beyond the inline size are walked in the counter's worker threads. Never logs or keeps
any text: the result is numbers.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvproxy.tokens.bound import bounds

# What engines add to the objects they dump for the template, beyond what the client sent
# (bytes, and the values they add, by depth below the object's parent), per kind of object:
#   * a message: vLLM wraps string content as [{"type": "text", "text": ...}] for
#     "openai"-format templates (chat_utils.py `_parse_chat_message_content_parts`);
#   * a tool call: SGLang's ToolCall model dumps `"id": null, "index": null, "type":
#     "function"` (entrypoints/openai/protocol.py `ToolCall`, serving_chat.py `model_dump`);
#   * a content part: SGLang's image part dumps `"modalities": "image"` and
#     `"detail": "auto"` (protocol.py `ChatCompletionMessageContentImagePart`);
#   * a tool: SGLang dumps the function with `"description": null, "parameters": null,
#     "strict": false, "defer_loading": null` (protocol.py `Function`), vLLM wraps it as
#     {"type": "function", "function": {...}} with its FunctionDefinition's defaults.
# Reasoning copied under its alias names (transformers `_alias_reasoning_fields`) adds two
# entries per reasoning field; its bytes are charged by the proof's alias factors.
MESSAGE_ADDS = (32, {2: 1, 3: 2})
TOOL_CALL_ADDS = (48, {3: 3})
PART_ADDS = (40, {3: 1, 4: 1})
TOOL_ADDS = (96, {1: 6, 2: 4})
ALIAS_ADDS = 2
# For the O(1) bound, per object of any kind: the most bytes and values any kind adds (a
# tool's), plus the alias copies of up to three reasoning keys.
QUICK_OBJECT_BYTES = max(a[0] for a in (MESSAGE_ADDS, TOOL_CALL_ADDS, PART_ADDS, TOOL_ADDS))
QUICK_OBJECT_VALUES = sum(TOOL_ADDS[1].values()) + 3 * ALIAS_ADDS
# Keys whose value engines copy under each other's names (transformers
# `_alias_reasoning_fields`, vLLM's reasoning -> reasoning + reasoning_content).
ALIAS_KEYS = frozenset({"reasoning", "reasoning_content", "thinking"})
# Strings up to this long that look like JSON are parsed to measure their re-printed form;
# longer ones are bounded without parsing (a C parse of megabytes would hold the GIL).
PARSE_MAX_CHARS = 65_536
# Per byte of JSON text, the longest re-printed form of what it parses to: a float token
# "1e15" (4 bytes) prints as "1000000000000000.0" (18), 4.5 per byte; a raw 2-byte character
# prints ASCII-escaped in 6 bytes (3 per byte); separators gain a space each.
REPRINT_PER_BYTE = 6
# Longest repr of a float (sign, 17 significant digits, point, exponent).
FLOAT_REPR = 24
# A number printed by a router that re-serialises it as a float gains ".0".
FLOAT_SUFFIX = 2
SCALAR_WORD = 5

_JSONISH = frozenset("{[")


@dataclass
class RootMeasure:
    """The measures of one root's data (see the module docstring)."""

    leaf_cost: int = 0  # sum over leaves of the worst a * P + b * X
    leaves_p: int = 0
    leaves_x: int = 0
    # levels[k]: values whose parent is k levels below the root (levels[0]: its children),
    # with the values engines add (see *_ADDS).
    levels: list[int] = field(default_factory=lambda: [0])
    parsed: int = 0  # values inside strings an engine may parse as JSON (any depth)
    depth: int = 0  # sum of every value's depth (I)
    added_bytes: int = 0  # bytes engines add (charged at the worst position)
    # Per key: [P, X, C, D] of everything under any value of that key (C: the children of
    # those values themselves), for the template's cross terms (tokens.bound.guarantee).
    under: dict[str, list[int]] = field(default_factory=dict)

    def keyed(self, key: str) -> list[int]:
        slot = self.under.get(key)
        if slot is None:
            slot = self.under[key] = [0, 0, 0, 0]
        return slot

    @property
    def values(self) -> int:
        return sum(self.levels) + self.parsed

    @property
    def children(self) -> int:
        return self.levels[0]

    def add(self, level: int, n: int = 1) -> None:
        while len(self.levels) <= level:
            self.levels.append(0)
        self.levels[level] += n


@dataclass
class Measures:
    roots: dict[str, RootMeasure] = field(default_factory=dict)
    media: int = 0  # content parts that are images, audio or video
    nfc_safe: bool = True  # every string NFD-normalized, or NFC without combining marks


Frontier = Sequence[tuple[int, int]]


class Walk:
    """One request's walk; `costs` gives each root's frontier (and the alias frontier)."""

    def __init__(self, costs: Mapping[str, tuple[Frontier, Frontier]], rule: str) -> None:
        self.costs = costs
        self.rule = rule
        self.out = Measures()
        self._nfd = True
        self._nfc_plain = True

    def root(self, name: str, value: Any, *, alias: bool = False) -> None:
        m = self.out.roots.setdefault(name, RootMeasure())
        frontier, alias_frontier = self.costs[name]
        self._walk(value, m, frontier, alias_frontier if alias else None, name)

    def done(self) -> Measures:
        self.out.nfc_safe = self._nfd or self._nfc_plain
        return self.out

    def _walk(
        self, value: Any, m: RootMeasure, frontier: Frontier, alias: Frontier | None, root: str
    ) -> None:
        # Iterative: orjson accepts nesting 1,023 deep, past Python's recursion limit.
        # Items: (value, depth, under an alias key, the key it is the value of (or ""), the
        # keys above it).
        stack: list[tuple[Any, int, bool, str, tuple[str, ...]]] = [(value, 0, False, "", ())]
        while stack:
            v, d, in_alias, direct, keys = stack.pop()
            fr = alias if (in_alias and alias is not None) else frontier
            if isinstance(v, str):
                p, x, parsed = self._string(v, m, fr, d)
                for k in keys:
                    slot = m.keyed(k)
                    slot[0] += p
                    slot[1] += x
                    slot[3] += parsed
                if direct and parsed:
                    m.keyed(direct)[2] += parsed
            elif isinstance(v, dict):
                self._engine_adds(v, m, root, d, direct or (keys[-1] if keys else ""))
                if _is_media(v):
                    self.out.media += 1
                for k, item in v.items():
                    m.add(d)
                    m.depth += d + 1
                    self._entity(m, direct, keys)
                    key = str(k)
                    kp, kx = _sizes(key)
                    self._leaf(m, fr, kp, kx)
                    for ak in keys:
                        slot = m.keyed(ak)
                        slot[0] += kp
                        slot[1] += kx
                    self._check_nfc(key)
                    child_alias = in_alias or (root == "messages" and key in ALIAS_KEYS)
                    if root == "messages" and d == 1 and key in ALIAS_KEYS:
                        m.add(d, ALIAS_ADDS)
                    stack.append((item, d + 1, child_alias, key, (*keys, key)))
            elif isinstance(v, list):
                for item in v:
                    m.add(d)
                    m.depth += d + 1
                    self._entity(m, direct, keys)
                    stack.append((item, d + 1, in_alias, "", keys))
            else:
                n = number_size(v)
                self._leaf(m, fr, n, n)
                for k in keys:
                    slot = m.keyed(k)
                    slot[0] += n
                    slot[1] += n

    @staticmethod
    def _entity(m: RootMeasure, direct: str, keys: tuple[str, ...]) -> None:
        """One child of the current container: a descendant of every key above it, and a
        direct child of the key whose value the container is."""
        for k in keys:
            m.keyed(k)[3] += 1
        if direct:
            m.keyed(direct)[2] += 1

    @staticmethod
    def _engine_adds(
        obj: Mapping[str, Any], m: RootMeasure, root: str, depth: int, parent: str
    ) -> None:
        adds: tuple[int, dict[int, int]] | None = None
        if root == "messages" and depth == 1:
            adds = MESSAGE_ADDS
            # vLLM's wrapper: one part (two entries) under `content`.
            slot = m.keyed("content")
            slot[0] += 12
            slot[1] += 28
            slot[2] += 1
            slot[3] += 3
        elif root == "messages" and parent == "tool_calls":
            adds = TOOL_CALL_ADDS
        elif root == "messages" and parent == "content":
            adds = PART_ADDS
        elif root == "tools" and depth == 1:
            adds = TOOL_ADDS
        if adds is None:
            return
        m.added_bytes += adds[0]
        for level, n in adds[1].items():
            m.add(depth - 1 + level, n)
            m.depth += n * (depth + level)
        if parent and adds is not MESSAGE_ADDS:
            # The fields a model's dump adds sit under the key this object sits under.
            slot = m.keyed(parent)
            slot[0] += adds[0]
            slot[1] += adds[0]
            slot[3] += sum(adds[1].values())

    def _leaf(self, m: RootMeasure, frontier: Frontier, p: int, x: int) -> None:
        m.leaves_p += p
        m.leaves_x += x
        m.leaf_cost += max((a * p + b * x for a, b in frontier), default=0)

    def _string(
        self, s: str, m: RootMeasure, frontier: Frontier, depth: int
    ) -> tuple[int, int, int]:
        self._check_nfc(s)
        p, x = _sizes(s)
        parsed = _parsed_measures(s)
        pd = 0
        if parsed is not None:
            pp, px, pd, pi = parsed
            p, x = max(p, pp), max(x, px)
            m.parsed += pd
            m.depth += pi + pd * depth
        self._leaf(m, frontier, p, x)
        return p, x, pd

    def _check_nfc(self, s: str) -> None:
        if s.isascii() or not (self._nfd or self._nfc_plain):
            return
        # Pieces cut where normalization cannot act across the cut (bounds.nfc_pieces); a
        # stretch too long to cut is not checked, and counts as unsafe.
        for piece, checkable in bounds.nfc_pieces(s):
            if not checkable:
                self._nfd = self._nfc_plain = False
                return
            if self._nfd and not unicodedata.is_normalized("NFD", piece):
                self._nfd = False
            if self._nfc_plain and (
                not unicodedata.is_normalized("NFC", piece) or _has_marks(piece)
            ):
                self._nfc_plain = False
            if not (self._nfd or self._nfc_plain):
                return


def number_size(v: Any) -> int:
    """Longest printed form of a JSON scalar that is not a string."""
    if v is None or isinstance(v, bool):
        return SCALAR_WORD
    if isinstance(v, int):
        digits = len(str(v)) if abs(v) < 10**4000 else 4300
        if digits >= 16:
            return max(digits, FLOAT_REPR) + FLOAT_SUFFIX
        return digits + FLOAT_SUFFIX
    if isinstance(v, float):
        # A float from orjson may stand for an integer literal beyond 64 bits, which an
        # engine parsing with Python's json prints with every digit.
        whole = abs(v)
        digits = len(str(int(whole))) + 1 if whole >= 1e16 and whole == whole else 0
        return max(FLOAT_REPR, digits + 3)
    return FLOAT_REPR


# The printed forms a string is measured by are made of per-character escapes, so their
# longest is bounded by the sum, over the characters, of each character's longest form
# (bytes; the forms: json.dumps ASCII-escaped, json.dumps with ensure_ascii=False, repr):
#   1  printable ASCII;
#   2  `"` `\\` `\n` `\r` `\t` (escaped by both), and `'` when the string also holds a `"`
#      (repr then quotes with `'` and escapes it; otherwise it picks the quote it does not
#      hold);
#   6  other ASCII controls (JSON's `\u00XX`; repr's `\xNN` is 4) and DEL (repr's `\x7f`);
#   6  a non-ASCII character of the BMP, lone surrogates included (`\uXXXX`; its UTF-8 form
#      is 2-3 bytes, repr's escapes at most 6);
#   12 a character beyond the BMP (a surrogate pair of escapes; UTF-8 and repr's `\U` form
#      are 4 and 10).
# Counted on the UTF-8 bytes with C calls that never print anything: a deleting translate
# counts the members of a byte class (continuation and lead bytes are >= 0x80, so the ASCII
# classes see only ASCII characters; one lead byte >= 0xC0 per non-ASCII character, >= 0xF0
# beyond the BMP). For a 4 MB string this is ~4x faster than printing it three ways.
_ESCAPED = b'"\\\n\r\t'
_ESCAPED_WITH_SQ = _ESCAPED + b"'"
_CONTROLS = bytes(c for c in range(0x20) if c not in b"\t\n\r") + b"\x7f"
_BELOW_LEAD = bytes(range(0xC0))
_BELOW_ASTRAL_LEAD = bytes(range(0xF0))


def _sizes(s: str) -> tuple[int, int]:
    """(P, X) of a string: its UTF-8 bytes (lone surrogates 3) and the bound above on its
    longest printed form, quotes included. Per window (`bounds.WINDOW_CHARS`): no C call
    holds the GIL long; the quote repr picks is the whole string's, never a window's."""
    escaped = _ESCAPED_WITH_SQ if '"' in s else _ESCAPED
    n = len(s)
    p = x = 0
    for i in range(0, n, bounds.WINDOW_CHARS):
        w = s if n <= bounds.WINDOW_CHARS else s[i : i + bounds.WINDOW_CHARS]
        e = w.encode("utf-8", "surrogatepass")
        b = len(e)
        p += b
        x += len(w) + b - len(e.translate(None, escaped))
        x += 5 * (b - len(e.translate(None, _CONTROLS)))
        if b != len(w):
            x += 5 * len(e.translate(None, _BELOW_LEAD))
            x += 6 * len(e.translate(None, _BELOW_ASTRAL_LEAD))
    return p, x + 2


def _parsed_measures(s: str) -> tuple[int, int, int, int] | None:
    """(P, X, D, I) of what `s` parses to as JSON, re-printed, if it may be JSON text."""
    head = s[:64].lstrip()
    if not head or (head[0] not in _JSONISH and not _NUMBER.match(head)):
        return None
    if len(s) > PARSE_MAX_CHARS:
        # Not parsed: every byte re-printed at most REPRINT_PER_BYTE bytes; every value
        # follows a bracket or a comma; depth at most the number of brackets.
        size = bounds.utf8_len(s)
        values = s.count(",") + s.count("[") + s.count("{")
        brackets = s.count("[") + s.count("{")
        return REPRINT_PER_BYTE * size, REPRINT_PER_BYTE * size, values, values * brackets
    try:
        parsed = json.loads(s)
    except (ValueError, RecursionError):
        return None
    p = x = d = i = 0
    stack: list[tuple[Any, int]] = [(parsed, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            vp, vx = _sizes(v)
            p, x = p + vp, x + vx
        elif isinstance(v, dict):
            for k, item in v.items():
                d += 1
                i += depth + 1
                kp, kx = _sizes(str(k))
                p, x = p + kp, x + kx
                stack.append((item, depth + 1))
        elif isinstance(v, list):
            for item in v:
                d += 1
                i += depth + 1
                stack.append((item, depth + 1))
        else:
            n = number_size(v)
            p += n
            x += n
    return p, x, d, i


_NUMBER = re.compile(r"-?[0-9]")
_MEDIA = frozenset(
    {"image_url", "input_image", "image", "image_pil", "video_url", "video", "input_audio",
     "audio_url", "audio", "image_embeds", "audio_embeds"}
)  # fmt: skip


def _is_media(obj: Mapping[str, Any]) -> bool:
    kind = obj.get("type")
    return isinstance(kind, str) and kind in _MEDIA


# Combining marks, split at the BMP: sre matches a class of BMP ranges with a bitmap, but a
# class holding any astral range tests every range in turn (188 of them: ~140 ms per 400 K
# characters, the walk's whole cost on non-ASCII text); the astral class is tried only on
# runs of astral characters (`_ASTRAL`: one range).
_MARKS: tuple[re.Pattern[str], re.Pattern[str]] | None = None
_ASTRAL = re.compile("[\U00010000-\U0010ffff]+")


def prepare() -> None:
    """Build the combining-mark patterns once (~0.3 s over every code point): at start-up,
    never on the event loop with a request waiting."""
    global _MARKS
    if _MARKS is None:
        _MARKS = _marks_patterns()


def _has_marks(s: str) -> bool:
    """Any character of non-zero canonical combining class (a non-starter)."""
    prepare()
    assert _MARKS is not None
    bmp, astral = _MARKS
    if bmp.search(s) is not None:
        return True
    return any(astral.search(run.group()) is not None for run in _ASTRAL.finditer(s))


def _marks_patterns() -> tuple[re.Pattern[str], re.Pattern[str]]:
    ranges: list[tuple[int, int]] = []
    for cp in range(0x110000):
        if unicodedata.combining(chr(cp)):
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1] = (ranges[-1][0], cp)
            else:
                ranges.append((cp, cp))

    def charset(rs: list[tuple[int, int]]) -> re.Pattern[str]:
        parts = "".join(
            re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"
            for a, b in rs
        )
        return re.compile(f"[{parts}]")

    # No range of combining marks straddles U+FFFF/U+10000 (asserted in the tests).
    return (
        charset([r for r in ranges if r[1] < 0x10000]),
        charset([r for r in ranges if r[0] >= 0x10000]),
    )


def measure(
    parts: Iterable[tuple[str, Any, bool]],
    costs: Mapping[str, tuple[Frontier, Frontier]],
    rule: str,
) -> Measures:
    """Walk `parts`: (root name, value, whether alias keys copy under it)."""
    walk = Walk(costs, rule)
    for name, value, alias in parts:
        walk.root(name, value, alias=alias)
    return walk.done()


__all__ = ["Measures", "RootMeasure", "measure", "number_size", "prepare"]
