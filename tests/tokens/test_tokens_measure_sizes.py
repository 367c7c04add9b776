"""The string measure the guaranteed bound multiplies (tokens.bound.measure `_sizes`): P is the
string's UTF-8 length, and X is never below any printed form an engine or a template may
give it — `json.dumps` ASCII-escaped, `json.dumps(ensure_ascii=False)` and `repr`, each of
the whole string, quotes included — while staying exact where the ASCII-escaped JSON form
is the longest. References are the standard library's own printers, not kvproxy's code."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvproxy.tokens.bound import bounds, measure


def _utf8(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def _printed(s: str) -> tuple[int, int, int]:
    return len(json.dumps(s)), _utf8(json.dumps(s, ensure_ascii=False)), _utf8(repr(s))


# Every kind of character the per-character table distinguishes: printable ASCII, both quotes
# and the backslash, the escapes JSON shortens (\b \f \n \r \t), other controls and DEL,
# Latin-1, the rest of the BMP, lone surrogates, beyond the BMP, and unprintable non-ASCII.
_SPECIAL = st.sampled_from(
    ['"', "'", "\\", "\b", "\f", "\n", "\r", "\t", "\x00", "\x1f", "\x7f", "\x85", "\xa0",
     "\u00e9", "\u4e2d", "\u2028", "\ud800", "\udfff", "\U0001f600", "\U000e0001", "\U0010ffff"]
)  # fmt: skip
_CHARS = st.one_of(st.characters(codec=None, exclude_categories=()), _SPECIAL)


@settings(max_examples=400)
@given(st.text(alphabet=_CHARS, max_size=80))
def test_x_is_never_below_any_printed_form(s: str) -> None:
    p, x = measure._sizes(s)
    assert p == _utf8(s)
    assert x >= max(_printed(s)), ascii(s)
    assert x <= 12 * len(s) + 2


@settings(max_examples=200)
@given(st.text(alphabet=st.characters(exclude_characters="'\x7f\b\f", codec="utf-8"), max_size=80))
def test_x_is_the_escaped_json_where_that_form_is_the_longest(s: str) -> None:
    # No single quote, no DEL, no control JSON prints shorter than repr: the ASCII-escaped
    # JSON form is the longest for each character, and the bound is that form exactly.
    if any(c < " " and c not in "\n\r\t" for c in s):
        return
    assert measure._sizes(s)[1] == len(json.dumps(s)) == max(_printed(s))


def test_long_strings_are_measured_whole_across_windows() -> None:
    w = bounds.WINDOW_CHARS
    cases = [
        # repr picks its quote for the whole string: a `"` in the first window makes it
        # escape every `'` of the later ones (measured per window, those would read as 1).
        '"' + "a" * (w - 1) + "'" * (3 * w),
        "\u4e2d" * (w + 7) + "\U0001f600" * (w // 2) + "\n" * 5,
        "\x00" * (2 * w + 1),
        "x" * (5 * w),
    ]
    for s in cases:
        p, x = measure._sizes(s)
        assert p == _utf8(s)
        assert x >= max(_printed(s)), ascii(s[:40])
