"""The combining-mark test the guaranteed bound's NFC rule rests on (tokens.bound.measure):
`_has_marks` answers exactly what a per-character `unicodedata.combining` scan answers, for
BMP and astral marks, in any position and between astral characters of every kind."""

from __future__ import annotations

import unicodedata

from hypothesis import given, settings
from hypothesis import strategies as st

from kvproxy.tokens.bound import measure


def _reference(s: str) -> bool:
    return any(unicodedata.combining(c) for c in s)


def test_no_range_of_marks_straddles_the_bmp() -> None:
    # The BMP/astral split of the pattern relies on it.
    assert not unicodedata.combining("\uffff")
    assert not unicodedata.combining("\U00010000")


def test_marks_found_in_both_planes_and_anywhere() -> None:
    cases = [
        "",
        "plain ascii",
        "caf\u0065\u0301",  # BMP combining acute
        "\U0001f600" * 50 + "\U0001d165",  # astral mark after astral runs
        "x\U0001d165y",
        "\U0001f469\u200d\U0001f4bb",  # ZWJ emoji: no mark
        "中文文本 日本語の 한국어",
        "\U0001f600\u0301\U0001f600",  # BMP mark between astral characters
        "\U000e0100",  # variation selector supplement: ccc 0
        "\U0001e94a",  # Adlam nukta: the last astral mark range
    ]
    for s in cases:
        assert measure._has_marks(s) is _reference(s), ascii(s)


_chars = st.one_of(
    st.characters(codec="utf-8"),
    st.integers(0x300, 0x36F).map(chr),
    st.integers(0x1D165, 0x1D1AD).map(chr),
    st.integers(0x1E000, 0x1E94F).map(chr),
    st.integers(0x1F300, 0x1F64F).map(chr),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_chars, max_size=12).map("".join))
def test_marks_match_the_per_character_reference(s: str) -> None:
    assert measure._has_marks(s) is _reference(s)
