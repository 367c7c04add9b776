"""`orjson.loads` of a large body in bounded steps: the same value, or the same error, with
no single call over more than about `SLICE_BYTES` of the body. Pure: a generator the caller
drives, handing the event loop back between steps (kvproxy.serve.parse).

Why: orjson holds the GIL for a whole document, so a 4 MB body is one multi-millisecond call
during which nothing else on the event loop runs. Nearly all of a large request body is in a
few long string literals (the prompt). So:

  1. a scan over the body's quote characters finds the string literals of at least
     `LONG_LITERAL_BYTES` (a quote ends a literal unless an odd run of backslashes precedes
     it: the JSON lexer's own rule, so it finds the literals the parser would);
  2. the rest of the document, each long literal's content replaced by a marker, is parsed
     in one short call (the skeleton);
  3. each long literal is decoded in slices cut at token boundaries: never inside an escape
     sequence, a surrogate pair's two escapes, or a UTF-8 sequence, so each slice decodes
     to exactly its part of the string;
  4. the joined strings replace the markers (a walk over the skeleton, in steps).

Equal to `orjson.loads(body)`: the skeleton has the body's structure with the long
literals' contents swapped, and a string's decoding depends on nothing outside it. Whenever
a step cannot go on this way (a skeleton that does not parse, a slice that does not decode,
a marker that the body itself contains, a long literal used as an object key, a skeleton
too large to be worth it, a literal with no token boundary to cut at), the answer is one
`orjson.loads(body)`: today's single call, with its own value or error. Malformed and
hostile bodies therefore cost what they cost before; well-formed prompts never do.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import orjson

from kvproxy.policy import invalid_request
from kvproxy.prompt.shape import NOT_AN_OBJECT, not_json

# One orjson call decodes at most about this many bytes of a long literal: 0.2-0.3 ms of
# CPU for ASCII prose, 0.6-0.9 ms for mixed-script text with emoji (measured, 2-core box).
# The join of a literal's pieces is one call too: ~0.2 ms for a 4 MB ASCII string, 3-10 ms
# for one that needs 4 bytes a character (emoji), which is the longest step left.
SLICE_BYTES = 256 * 1024
# Literals at least this long are decoded on their own (a long conversation's messages
# too); shorter ones stay in the skeleton.
LONG_LITERAL_BYTES = 4 * 1024
# A skeleton larger than this is a structure-heavy body (token-id arrays, thousands of
# messages): its parse and the walk over it would be long calls themselves, so such a body
# is parsed whole.
SKELETON_MAX_BYTES = 64 * 1024
# Quotes scanned (or skeleton nodes walked) between two hand-backs: ~0.5 ms of Python.
STEP_ITEMS = 1024
# A slice boundary is searched for over at most this many candidates (each skips past a
# backslash); text made only of escaped backslashes has none, and is decoded whole.
CUT_TRIES = 64
# Marker strings put where the long literals were: the prefix must not occur in the
# skeleton otherwise (checked: a body carrying it is parsed whole).
_MARK = b"kvproxy-sliced-literal-"
_QUOTE = 0x22
_BACKSLASH = 0x5C


class _Whole(Exception):
    """This body is parsed in one call after all."""


def load_json(body: bytes) -> Generator[None, None, dict[str, Any]]:
    """`shape.load_json(body)` in steps: the same object, or the same 400."""
    try:
        data = yield from loads(body)
    except orjson.JSONDecodeError as exc:
        raise not_json(exc) from None
    if not isinstance(data, dict):
        raise invalid_request(NOT_AN_OBJECT, None)
    return data


def loads(body: bytes) -> Generator[None, None, Any]:
    """`orjson.loads(body)`, yielding between bounded steps; raises what it would raise."""
    try:
        return (yield from _sliced(body))
    except _Whole:
        return orjson.loads(body)


def _sliced(body: bytes) -> Generator[None, None, Any]:
    literals = yield from _long_literals(body)
    if not literals:
        raise _Whole
    parts: list[bytes] = []
    pos = 0
    for i, (start, end) in enumerate(literals):
        parts += (body[pos:start], _MARK, str(i).encode())
        pos = end
    parts.append(body[pos:])
    skeleton = b"".join(parts)
    if len(skeleton) > SKELETON_MAX_BYTES or skeleton.count(_MARK) != len(literals):
        raise _Whole
    try:
        tree = orjson.loads(skeleton)
    except orjson.JSONDecodeError:
        raise _Whole from None
    yield
    strings: list[str] = []
    decoded = 0  # bytes decoded since the last hand-back
    for start, end in literals:
        pieces: list[str] = []
        pos = start
        while pos < end:
            cut = end if end - pos <= SLICE_BYTES else _cut(body, pos + SLICE_BYTES, end)
            try:
                pieces.append(orjson.loads(b'"' + body[pos:cut] + b'"'))
            except orjson.JSONDecodeError:
                raise _Whole from None
            decoded += cut - pos
            if decoded >= SLICE_BYTES:
                decoded = 0
                yield
            pos = cut
        strings.append(pieces[0] if len(pieces) == 1 else "".join(pieces))
    return (yield from _substitute(tree, strings))


def _long_literals(body: bytes) -> Generator[None, None, list[tuple[int, int]]]:
    """(start, end) of the content of every string literal of at least LONG_LITERAL_BYTES:
    body[start - 1] and body[end] are its quotes."""
    out: list[tuple[int, int]] = []
    find = body.find
    pos = 0
    quotes = 0
    while True:
        opening = find(b'"', pos)
        if opening < 0:
            return out
        closing = opening
        while True:
            closing = find(b'"', closing + 1)
            if closing < 0:
                raise _Whole  # unterminated: the parser says where
            quotes += 1
            if quotes % STEP_ITEMS == 0:
                yield
            run = 0
            while body[closing - 1 - run] == _BACKSLASH:
                run += 1
                if run > CUT_TRIES:
                    raise _Whole  # a run of escaped backslashes: hostile, parsed whole
            if run % 2 == 0:
                break
        if closing - opening - 1 >= LONG_LITERAL_BYTES:
            out.append((opening + 1, closing))
        pos = closing + 1


def _cut(body: bytes, pos: int, end: int) -> int:
    """The first token boundary of a literal's content at or after `pos` (and before `end`):
    a position no escape sequence, surrogate pair or UTF-8 sequence spans.

    * no backslash in the 6 bytes before it and not a UTF-8 continuation byte: an escape
      spanning it would start in those 6 bytes (`\\uXXXX` is the longest), and so would the
      first half of a surrogate pair ending at it;
    * or a backslash after a non-backslash: a token ends at any non-backslash byte (plain
      text, an escaped character or a hex digit), so a backslash there opens an escape;
      unless the 6 bytes before it are a high-surrogate escape (a pair: never split; an
      escaped backslash before "uD8.." is taken for one too, which only skips a boundary).
    """
    for _ in range(CUT_TRIES):
        if pos >= end:
            return end
        last = body.rfind(b"\\", pos - 6, pos)
        if last < 0:
            if body[pos] & 0xC0 != 0x80:
                return pos
            pos += 1
            continue
        if (
            body[pos] == _BACKSLASH
            and body[pos - 1] != _BACKSLASH
            and not _high_surrogate(body, pos)
        ):
            return pos
        nxt = body.find(b"\\", pos + 1, last + 7)
        pos = nxt if nxt >= 0 else last + 7
    raise _Whole


def _high_surrogate(body: bytes, pos: int) -> bool:
    """Whether the 6 bytes before `pos` read as a `\\uD800`-`\\uDBFF` escape."""
    return (
        body[pos - 6] == _BACKSLASH
        and body[pos - 5] == 0x75  # u
        and body[pos - 4] in b"dD"
        and body[pos - 3] in b"89abAB"
    )


def _substitute(tree: Any, strings: list[str]) -> Generator[None, None, Any]:
    """The skeleton's markers replaced by their strings, in place. Each marker must be met
    exactly once, as a value: a short string of the body that *decodes* to a marker's text
    (written with escapes, so the byte check in `_sliced` cannot see it) would otherwise be
    replaced too, and kvproxy would read another request than the engine. A marker met twice
    or as an object key, or one not met (a duplicate key dropped it), is parsed whole."""
    marks = {f"{_MARK.decode()}{i}": s for i, s in enumerate(strings)}
    if isinstance(tree, str):
        if len(strings) != 1 or tree not in marks:
            raise _Whole
        return marks[tree]
    met: set[str] = set()

    def take(value: str) -> str:
        if value in met:
            raise _Whole
        met.add(value)
        return marks[value]

    stack: list[Any] = [tree]
    walked = 0
    while stack:
        node = stack.pop()
        walked += 1
        if walked % STEP_ITEMS == 0:
            yield
        if isinstance(node, dict):
            for key, value in node.items():
                if key in marks:
                    raise _Whole
                if isinstance(value, str):
                    if value in marks:
                        node[key] = take(value)
                elif isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                if isinstance(value, str):
                    if value in marks:
                        node[i] = take(value)
                elif isinstance(value, (dict, list)):
                    stack.append(value)
    if len(met) != len(strings):
        raise _Whole
    return tree
