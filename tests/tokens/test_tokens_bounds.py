"""The byte bound's building blocks, checked against Unicode itself (no tokenizer)."""

from __future__ import annotations

import itertools
import sys
import unicodedata

import pytest

from kvproxy.tokens.bound import bounds


def _second_halves() -> set[int]:
    """Code points that can compose with what precedes them (NFC_Quick_Check=Maybe)."""
    out = set(range(0x1161, 0x1176)) | set(range(0x11A8, 0x11C3))  # Hangul V and T jamo
    for cp in range(sys.maxunicode + 1):
        d = unicodedata.decomposition(chr(cp))
        if d and not d.startswith("<"):
            parts = d.split()
            if len(parts) == 2:
                out.add(int(parts[1], 16))
    return out


def test_nfc_boundary_class_is_safe_to_cut_before() -> None:
    # Every character NFC_BOUNDARY matches must be a starter, NFC on its own, and never the
    # second half of a composition: only then is NFC(a + b) == NFC(a) + NFC(b).
    second = _second_halves()
    matched = [
        chr(cp) for cp in range(0x10000) if bounds.NFC_BOUNDARY.fullmatch(chr(cp)) is not None
    ]
    assert len(matched) > 30_000
    bad = [
        hex(ord(c))
        for c in matched
        if unicodedata.combining(c) != 0
        or not unicodedata.is_normalized("NFC", c)
        or ord(c) in second
    ]
    assert bad == []


def test_nfc_concatenation_at_boundaries() -> None:
    # The property the windows rely on, on text where composition would cross a bad cut.
    a = "e\u0301" * 10 + "\u1100"
    b = "\u1161" + "x"
    assert unicodedata.normalize("NFC", a + b) != unicodedata.normalize(
        "NFC", a
    ) + unicodedata.normalize("NFC", b)
    assert bounds.NFC_BOUNDARY.match(b) is None  # so the bound never cuts there


@pytest.mark.parametrize(
    "text",
    [
        "",
        "plain ascii",
        "x" * 100_000,
        "Café" * 10_000,
        "\U0001d160" * 50_000,
        "中" * 70_000,
        "a\u0301" * 40_000,
        "\ud800 lone surrogate",
    ],
)
def test_utf8_len_matches_encode(text: str) -> None:
    assert bounds.utf8_len(text) == len(text.encode("utf-8", "surrogatepass"))


def test_nfc_rule_charges_three_times_only_when_not_normalized() -> None:
    assert bounds.text_bound("hello", "nfc") == 5
    assert bounds.text_bound("Café", "nfc") == 5  # precomposed: normalized
    assert bounds.text_bound("Cafe\u0301", "nfc") == 3 * 6
    assert bounds.text_bound("Cafe\u0301", "bytes") == 6


def test_windows_keep_normalized_text_at_one_byte_per_byte() -> None:
    # A long normalized non-ASCII text is checked window by window, not charged 3x.
    text = ("naïve café " * 20_000) + "中文" * 20_000
    assert bounds.text_bound(text, "nfc") == len(text.encode())


def test_one_bad_window_costs_only_that_window() -> None:
    clean = "résumé " * 10_000
    text = clean + "e\u0301" + clean
    got = bounds.text_bound(text, "nfc")
    assert len(text.encode()) < got < 2 * len(text.encode())
    assert got >= len(unicodedata.normalize("NFC", text).encode())


@pytest.mark.parametrize(
    "text",
    [
        "\U0001d160" * 100_000,  # NFC expands 4 -> 12 bytes
        "\u0f73" * 200_000,  # quadratic for unicodedata.normalize
        "\u1100\u1161" * 50_000,  # Hangul jamo compose
        "a" + "\u0301" * 100_000,  # one starter, a long run of marks: no boundary at all
    ],
)
def test_hostile_text_bound_covers_nfc_bytes_without_normalize(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = len(unicodedata.normalize("NFC", text[:20_000]).encode()) * len(text) // 20_000
    with monkeypatch.context() as m:
        m.setattr(unicodedata, "normalize", _forbidden)
        got = bounds.text_bound(text, "nfc")
    assert got >= len(text.encode())
    assert got >= expected * 0.99


def _forbidden(*_: object) -> str:
    raise AssertionError("unicodedata.normalize must never run on untrusted text")


@pytest.mark.parametrize(
    "text",
    [
        "word " * 100_000,
        "line of text\nNext line\n" * 20_000,
        " " * 1_000_000,
        "中文" * 100_000,
        "",
        "x",
    ],
)
def test_exact_chunks_reassemble_and_cut_only_at_safe_places(text: str) -> None:
    chunks = list(bounds.exact_chunks(text, chunk_chars=4096))
    assert "".join(chunks) == text
    assert all(chunks)
    for left, right in itertools.pairwise(chunks):
        newline_cut = left.endswith("\n") and not left[-2:-1].isspace()
        space_cut = left[-1].isascii() and left[-1].isalpha() and right[:1] == " "
        assert right[:1].isascii()
        assert newline_cut or space_cut
        assert newline_cut or (right[1:2].isascii() and right[1:2].isalpha())


def test_exact_chunks_are_bounded_when_cuts_exist() -> None:
    chunks = list(bounds.exact_chunks("word " * 200_000, chunk_chars=65_536))
    assert len(chunks) >= 15
    assert max(len(c) for c in chunks) < 65_536 + 16


def test_chat_overhead_formula() -> None:
    assert bounds.chat_overhead_bound(1, None) == 64 + 8
    assert bounds.chat_overhead_bound(3, 100) == 64 + 24 + 512 + 200
