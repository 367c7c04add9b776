"""Canary tripwire (kvproxy/canary.py): split markers, many tenants, own markers never
trigger, no false positives on random text, bounded per-chunk work."""

from __future__ import annotations

import itertools
import random
import string

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproxy.canary import MAX_MARKER_CHARS, CanaryHit, CanaryRules, CanaryScanner
from kvproxy.config import CanaryTenant, ConfigError, Settings
from kvproxy.sse import SSEParser, StreamTexts

ACME_LIT = "ACME-CANARY-7f3a9c"
ACME_RE = "KVCANARY-acme-[0-9a-f]{16}"
ACME_HIT = "KVCANARY-acme-0123456789abcdef"
BOB_LIT = "BOB-CANARY-ÿ€😀-42"  # multi-byte UTF-8 on purpose


def rules(action: str = "block") -> CanaryRules:
    return CanaryRules.from_tenants(
        [
            CanaryTenant(tenant="acme", markers=(ACME_LIT,), patterns=(ACME_RE,)),
            CanaryTenant(tenant="bob", markers=(BOB_LIT,)),
        ],
        action,  # type: ignore[arg-type]
    )


def chat_sse(*contents: str) -> bytes:
    return b"".join(
        b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": c}}]}) + b"\n\n"
        for c in contents
    )


def scan_stream(scanner: CanaryScanner, pieces: list[bytes]) -> list[CanaryHit]:
    """What the relay does: SSE framing -> per-index new text -> scanner."""
    parser, texts = SSEParser(), StreamTexts()
    hits = []
    for piece in pieces:
        for payload in parser.feed(piece):
            for index, text in texts.feed(payload).texts:
                hit = scanner.feed_text(index, text)
                if hit is not None:
                    hits.append(hit)
    return hits


@pytest.mark.parametrize(
    ("marker", "owner", "marker_id"),
    [(ACME_LIT, "acme", "acme#1"), (ACME_HIT, "acme", "acme#2"), (BOB_LIT, "bob", "bob#1")],
)
def test_marker_split_at_every_char_offset_across_chunks(
    marker: str, owner: str, marker_id: str
) -> None:
    r = rules()
    viewer = "bob" if owner == "acme" else "acme"
    text = "Sure, here is the context: " + marker + " and the rest."
    for cut in range(len(text) + 1):
        for cut2 in range(cut, len(text) + 1, 5):
            s = r.scanner(viewer)
            hits = [s.feed_text(0, p) for p in (text[:cut], text[cut:cut2], text[cut2:])]
            found = [h for h in hits if h is not None]
            assert found == [CanaryHit(owner, marker_id)], (cut, cut2)


@pytest.mark.parametrize("marker", [ACME_LIT, BOB_LIT])
def test_marker_split_across_events_and_at_every_byte_offset(marker: str) -> None:
    r = rules()
    viewer = "bob" if marker == ACME_LIT else "acme"
    for k in range(len(marker) + 1):
        stream = chat_sse("", "Repeat: " + marker[:k], marker[k:] + " done")
        for cut in range(len(stream) + 1):
            hits = scan_stream(r.scanner(viewer), [stream[:cut], stream[cut:]])
            assert len(hits) == 1, (k, cut)


def test_own_markers_never_trigger() -> None:
    r = rules()
    text = f"{ACME_LIT} {ACME_HIT} {ACME_LIT}{ACME_HIT}"
    s = r.scanner("acme")
    for i in range(0, len(text), 3):
        assert s.feed_text(0, text[i : i + 3]) is None
    assert s.scan_body(orjson.dumps({"choices": [{"message": {"content": text}}]})) is None
    assert s.hit_count == 0


def test_unknown_tenant_sees_every_marker_as_foreign() -> None:
    r = rules()
    for tenant in (None, "carol", "anon-1234abcd"):
        s = r.scanner(tenant)
        assert s.feed_text(0, ACME_HIT) == CanaryHit("acme", "acme#2")
        assert s.feed_text(0, BOB_LIT) == CanaryHit("bob", "bob#1")


def test_many_tenants_each_sees_only_the_others() -> None:
    rng = random.Random(7)
    n = 40
    tenants = [f"t{i:02d}" for i in range(n)]
    lits = {t: f"LIT-{t}-{rng.getrandbits(64):016x}" for t in tenants}
    r = CanaryRules.from_tenants(
        CanaryTenant(tenant=t, markers=(lits[t],), patterns=(f"KVCANARY-{t}-[0-9a-f]{{16}}",))
        for t in tenants
    )
    assert len(r.marker_ids) == 2 * n
    for viewer in rng.sample(tenants, 8):
        s = r.scanner(viewer)
        assert s.feed_text(0, lits[viewer] + f"KVCANARY-{viewer}-{'a' * 16}") is None
        for other in tenants:
            if other == viewer:
                continue
            hit = s.feed_text(1, f"xx {lits[other]} yy")
            assert hit == CanaryHit(other, f"{other}#1")
            hit = s.feed_text(2, f"KVCANARY-{other}-{rng.getrandbits(64):016x}")
            assert hit == CanaryHit(other, f"{other}#2")


def test_choice_indexes_keep_separate_tails() -> None:
    s = rules().scanner("bob")
    half = len(ACME_LIT) // 2
    assert s.feed_text(0, ACME_LIT[:half]) is None
    assert s.feed_text(1, ACME_LIT[half:]) is None  # another choice: not a marker
    assert s.feed_text(0, ACME_LIT[half:]) == CanaryHit("acme", "acme#1")


def test_every_hit_is_counted_and_reported_once() -> None:
    s = rules("observe").scanner("bob")
    assert s.feed_text(0, f"{ACME_LIT} and {ACME_HIT}") == CanaryHit("acme", "acme#1")
    assert s.feed_text(0, " more text") is None  # the tail does not re-report
    assert s.hit_count == 2
    assert [h.marker_id for h in s.hits] == ["acme#1", "acme#2"]


def test_hits_carry_ids_never_text() -> None:
    hit = rules().scanner("bob").feed_text(0, "secret context " + ACME_HIT)
    assert hit is not None
    assert ACME_HIT not in repr(hit)
    assert "secret" not in repr(hit)


def test_work_per_chunk_is_bounded_by_the_longest_marker() -> None:
    r = rules()
    s = r.scanner("bob")
    rng = random.Random(3)
    for _ in range(2000):
        s.feed_text(0, "".join(rng.choices(string.ascii_letters + " -", k=rng.randint(1, 40))))
    longest = max(len(ACME_LIT), len(ACME_HIT), len(BOB_LIT))
    assert len(s._tails[0]) <= longest - 1


def test_scan_body_non_streamed() -> None:
    s = rules().scanner("acme")
    call = {"function": {"name": "f", "arguments": orjson.dumps({"q": BOB_LIT}).decode()}}
    body = orjson.dumps({"choices": [{"message": {"content": "hi", "tool_calls": [call]}}]})
    assert s.scan_body(body) == CanaryHit("bob", "bob#1")
    assert s.scan_body(b'{"text": "clean"}') is None
    assert s.scan_body(b"not json " + BOB_LIT.encode()) == CanaryHit("bob", "bob#1")


def test_no_markers_means_inactive() -> None:
    r = CanaryRules.from_tenants([])
    assert not r.active
    s = r.scanner("acme")
    assert not s.active
    assert s.feed_text(0, ACME_LIT) is None
    only_own = CanaryRules.from_tenants([CanaryTenant(tenant="acme", markers=(ACME_LIT,))])
    assert only_own.active
    assert not only_own.scanner("acme").active
    assert only_own.scanner("bob").active


def test_from_settings_and_numbering_across_entries() -> None:
    s = Settings(
        canaries=(  # type: ignore[arg-type]
            {"tenant": "acme", "markers": [ACME_LIT]},
            {"tenant": "acme", "patterns": [ACME_RE]},
        ),
        canary_action="observe",
    )
    r = CanaryRules.from_settings(s)
    assert r.action == "observe"
    assert r.marker_ids == ("acme#1", "acme#2")
    assert r.tenants == ("acme",)


def test_tenant_names_are_sanitised_like_resolved_ids() -> None:
    r = CanaryRules.from_tenants([CanaryTenant(tenant="Acme Corp", markers=(ACME_LIT,))])
    (owner,) = r.tenants
    assert owner.startswith("Acme_Corp-")
    assert r.scanner(owner).feed_text(0, ACME_LIT) is None


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("KVCANARY-.*", "unboundedly"),
        ("KVCANARY-[0-9a-f]+", "unboundedly"),
        ("X{1,5000}ABCDEFGH", "unboundedly"),
        ("(ab)?", "shorter than"),
        ("[0-9]", "shorter than"),
        ("(KVCANARY)-\\1", "backreferences"),
        ("(?P<x>KVCANARY)-(?P=x)", "backreferences"),
        ("abc(?i)defghijk", "not a valid"),
        ("KVCANARY-[", "not a valid"),
    ],
)
def test_bad_patterns_are_refused_at_start(pattern: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        CanaryRules.from_tenants([CanaryTenant(tenant="acme", patterns=(pattern,))])
    assert "acme#1" in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_literals_are_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="acme#1"):
        CanaryRules.from_tenants([CanaryTenant(tenant="acme", markers=("short",))])
    with pytest.raises(ConfigError, match="acme#2"):
        CanaryRules.from_tenants(
            [CanaryTenant(tenant="acme", markers=(ACME_LIT, "x" * (MAX_MARKER_CHARS + 1)))]
        )


def test_scoped_flags_and_inner_groups_work() -> None:
    r = CanaryRules.from_tenants(
        [
            CanaryTenant(tenant="acme", patterns=("(?i:kvcanary)-(acme|ACME)-[0-9]{8}",)),
            CanaryTenant(tenant="bob", patterns=("(?P<inner>BOBMARK)-[a-z]{4}",)),
        ]
    )
    s = r.scanner(None)
    assert s.feed_text(0, "KvCanary-acme-12345678") == CanaryHit("acme", "acme#1")
    assert s.feed_text(0, "BOBMARK-abcd") == CanaryHit("bob", "bob#1")


# --- no false positives -----------------------------------------------------------------

_NEAR_MISSES = [
    ACME_LIT[:-1],
    ACME_LIT[1:],
    ACME_LIT.lower(),
    "KVCANARY-acme-0123456789abcde",  # 15 hex
    "KVCANARY-acme-0123456789abcdeg",
    "KVCANARY-acmf-0123456789abcdef",
    BOB_LIT.replace("€", "e"),
    "KVCANARY-",
    "BOB-CANARY-",
]


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.one_of(st.text(max_size=60), st.sampled_from(_NEAR_MISSES)), max_size=12),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_no_false_positive_on_random_text_and_near_misses(pieces: list[str], seed: int) -> None:
    text = " ".join(pieces)
    rng = random.Random(seed)
    s = rules().scanner(None)
    i = 0
    while i < len(text):
        j = i + rng.randint(1, 17)
        assert s.feed_text(0, text[i:j]) is None, text
        i = j
    assert s.hit_count == 0


def test_overlapping_keys_of_different_markers_are_all_found() -> None:
    # "AABXXXXX" and "ABXYYYYY" share text at an offset of one: a search that resumed
    # after the first key would miss the second.
    r = CanaryRules.from_tenants(
        [
            CanaryTenant(tenant="a", markers=("AABXXXXX",)),
            CanaryTenant(tenant="b", patterns=("ABXY{5}",)),
        ]
    )
    s = r.scanner(None)
    assert s.feed_text(0, "zAABXXXXX") == CanaryHit("a", "a#1")
    assert s.feed_text(1, "zAABXYYYYY") == CanaryHit("b", "b#1")


def test_markers_sharing_a_prefix_with_own_markers() -> None:
    r = CanaryRules.from_tenants(
        [
            CanaryTenant(tenant="acme", markers=("KVCANARY-acme-LITERAL",), patterns=(ACME_RE,)),
            CanaryTenant(tenant="bob", patterns=("KVCANARY-(bob|BOB)-[0-9]{8}",)),
        ]
    )
    s = r.scanner("acme")
    assert s.feed_text(0, "KVCANARY-acme-LITERAL " + ACME_HIT) is None
    assert s.feed_text(0, " KVCANARY-BOB-1234") is None  # incomplete: kept in the tail
    assert s.feed_text(0, "5678 ") == CanaryHit("bob", "bob#1")


@settings(max_examples=100, deadline=None)
@given(
    prefix=st.text(max_size=30),
    suffix=st.text(max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=6),
)
def test_embedded_foreign_marker_is_always_found(prefix: str, suffix: str, cuts: list[int]) -> None:
    text = prefix + ACME_HIT + suffix
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    s = rules().scanner("bob")
    hits = [s.feed_text(0, text[a:b]) for a, b in itertools.pairwise(bounds)]
    assert CanaryHit("acme", "acme#2") in hits
