"""Guaranteed upper bounds on token counts, and safe places to cut text. Pure, no I/O.

The bound (facts/TOKENS_AND_AIOHTTP.md, 9 tokenizers x 23 adversarial inputs):
  * byte-level BPE without a normalizer: tokens <= UTF-8 bytes (+ special tokens);
  * with an NFC normalizer: tokens <= bytes of the NFC text, and NFC grows UTF-8 at most 3x
    (UAX #15), so: bytes when `unicodedata.is_normalized('NFC', s)`, else 3 x bytes.
`unicodedata.normalize` is never called: it is quadratic on hostile input ('\\u0F73' * 40000
took 4.4 s). `is_normalized` is linear but still a C call that holds the GIL (up to ~15 ms per
128 K characters on hostile text), so long strings are cut into windows of `WINDOW_CHARS` at
*normalization boundaries*: before a character that is a starter (combining class 0), is
NFC on its own and never composes with what precedes it. There NFC(a + b) = NFC(a) + NFC(b),
so per-window answers add up. A stretch with no such boundary is charged 3 x bytes without
asking. Every C call here is bounded by a window, so a worker thread running these functions
gives the GIL back to the event loop every few milliseconds.

`exact_chunks` cuts text for exact counting where every byte-level pre-tokenizer regex we
know (GPT-2, Llama-3, Qwen, GLM, DeepSeek) ends a piece anyway: after a newline that follows
a non-space and precedes an ASCII letter, and between an ASCII letter and a single space
followed by an ASCII letter (" word" is always one piece). Chunked counts then equal
whole-text counts (tests/tokens/test_tokens_properties.py checks this per tokenizer, and
`local` re-checks each tokenizer when it loads).

This module must never log or return any part of the text it measures.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

BoundRule = Literal["bytes", "nfc"]

# Characters before which NFC may cut: Latin-1 and Latin Extended (< U+0300), Cyrillic
# letters, kana, CJK unified ideographs, Hangul syllables. test_tokens_bounds.py proves each
# one is a combining-class-0, NFC-stable character that is never the second half of a
# canonical composition (nor a Hangul V/T jamo).
NFC_BOUNDARY = re.compile(
    "[\x00-\u02ff\u0400-\u0482\u3041-\u3096\u30a1-\u30fa\u4e00-\u9fff\uac00-\ud7a3]"
)
# Window for one C call: is_normalized on 32 K hostile characters takes <= ~4 ms.
WINDOW_CHARS = 16_384
# NFC grows UTF-8 by at most this factor (UAX #15, "Stability of normalization forms").
NFC_MAX_EXPANSION = 3

EXACT_CUT = re.compile(r"(?<=\S\n)(?=[A-Za-z])|(?<=[A-Za-z])(?= [A-Za-z])")
EXACT_CHUNK_CHARS = 32_768

# Without the model's chat template (facts file: covers every measured model with >= 1.6x
# margin): a fixed frame plus a per-message frame, and a tools preamble.
CHAT_BASE_TOKENS = 64
CHAT_PER_MESSAGE_TOKENS = 8
CHAT_TOOLS_TOKENS = 512
# Templates print tools with tojson, some with indent=4 (GLM-4): each output line costs at
# most one whitespace token on top of the compact JSON's bytes, and there are no more lines
# than compact bytes, hence the factor 2.
TOOLS_INDENT_FACTOR = 2


def utf8_len(s: str) -> int:
    """UTF-8 length of `s`, in window-sized C calls (lone surrogates count 3 bytes)."""
    if s.isascii():  # O(1) in CPython: a flag on the string object
        return len(s)
    n = len(s)
    return sum(
        len(s[i : i + WINDOW_CHARS].encode("utf-8", "surrogatepass"))
        for i in range(0, n, WINDOW_CHARS)
    )


def text_bound(s: str, rule: BoundRule) -> int:
    """Upper bound on the bytes a byte-level tokenizer with `rule` normalization sees."""
    if s.isascii():
        return len(s)
    if rule == "bytes":
        return utf8_len(s)
    total = 0
    for piece, safe in nfc_pieces(s):
        size = utf8_len(piece)
        if safe and (piece.isascii() or unicodedata.is_normalized("NFC", piece)):
            total += size
        else:
            total += NFC_MAX_EXPANSION * size
    return total


# Texts up to this many characters in all are tested for ASCII joined (a copy this small is
# cheaper than a call per text); longer ones one at a time, without a copy.
JOIN_CHARS = 65_536


def texts_bound(texts: Iterable[str], rule: BoundRule) -> int:
    texts = tuple(texts)
    chars = sum(map(len, texts))
    if chars <= JOIN_CHARS and "".join(texts).isascii():
        return chars  # what text_bound gives each of them, summed, in two C calls
    return sum(text_bound(t, rule) for t in texts)


def nfc_pieces(s: str) -> Iterator[tuple[str, bool]]:
    """Cut `s` at NFC boundaries into pieces of about WINDOW_CHARS.

    Yields (piece, checkable): a piece longer than two windows had no boundary to cut at and
    is not worth an `is_normalized` call that would hold the GIL too long.
    """
    n, pos = len(s), 0
    while pos < n:
        end = pos + WINDOW_CHARS
        end = n if end >= n else _next_match_start(NFC_BOUNDARY, s, end, n)
        yield s[pos:end], end - pos <= 2 * WINDOW_CHARS
        pos = end


def _next_match_start(pattern: re.Pattern[str], s: str, start: int, n: int) -> int:
    """Start of the first match at or after `start`, searched one window at a time."""
    pos = start
    while pos < n:
        m = pattern.search(s, pos, min(pos + WINDOW_CHARS, n))
        if m is not None:
            return m.start()
        pos += WINDOW_CHARS
    return n


def exact_chunks(s: str, chunk_chars: int = EXACT_CHUNK_CHARS) -> Iterator[str]:
    """Cut `s` where a byte-level pre-tokenizer would cut anyway (see module docstring).

    A stretch without such a place stays whole: correctness first, the tokenizer then just
    works longer on one piece (without the GIL).
    """
    n, pos = len(s), 0
    while pos < n:
        end = pos + chunk_chars
        if end >= n:
            yield s[pos:]
            return
        end = _next_match_start(EXACT_CUT, s, end, n)
        yield s[pos:end]
        pos = end


def chat_overhead_bound(messages: int, tools_bound: int | None) -> int:
    """Tokens a chat template adds around the strings, when the template is unknown."""
    extra = 0
    if tools_bound is not None:
        extra = CHAT_TOOLS_TOKENS + TOOLS_INDENT_FACTOR * tools_bound
    return CHAT_BASE_TOKENS + CHAT_PER_MESSAGE_TOKENS * messages + extra


def segments_bound(segments: Sequence[str], rule: BoundRule) -> int:
    """Bound of the concatenation of `segments`, without building it.

    Where a segment does not begin at an NFC boundary, NFC may act across the join, so the
    segments on both sides are grouped and the group is charged 3 x bytes: a safe bound for
    any string, whatever NFC does inside it.
    """
    if rule == "bytes":
        return sum(utf8_len(s) for s in segments)
    total = 0
    group: list[str] = []
    for seg in segments:
        if not seg:
            continue
        if group and NFC_BOUNDARY.match(seg) is None:
            group.append(seg)
            continue
        total += _group_bound(group, rule)
        group = [seg]
    return total + _group_bound(group, rule)


def _group_bound(group: list[str], rule: BoundRule) -> int:
    if len(group) == 1:
        return text_bound(group[0], rule)
    return NFC_MAX_EXPANSION * sum(utf8_len(s) for s in group)


def loose_bound(segments: Sequence[str], rule: BoundRule) -> int:
    """An upper bound of `segments_bound` in O(1) per segment: 4 UTF-8 bytes per character,
    times the NFC factor. For a decision an exact count makes anyway (the bound cannot
    admit): it only has to stay a bound."""
    chars = sum(len(s) for s in segments)
    return 4 * chars * (NFC_MAX_EXPANSION if rule == "nfc" else 1)


def segment_chunks(segments: Sequence[str], chunk_chars: int = EXACT_CHUNK_CHARS) -> Iterator[str]:
    """`exact_chunks` of the concatenation of `segments`, never building it whole.

    Cuts are made only inside a segment, at least two characters in, so that the cut rule's
    look-behind sees that segment's own text; short segments ride along with their
    neighbours in a carried piece.
    """
    carry: list[str] = []
    carried = 0
    for seg in segments:
        n = len(seg)
        pos = 0
        cut = _next_match_start(EXACT_CUT, seg, max(2, chunk_chars - carried), n) if n > 2 else n
        while cut < n:
            carry.append(seg[pos:cut])
            yield "".join(carry)
            carry, carried, pos = [], 0, cut
            cut = _next_match_start(EXACT_CUT, seg, pos + chunk_chars, n)
        carry.append(seg[pos:])
        carried += n - pos
    if carried:
        yield "".join(carry)
