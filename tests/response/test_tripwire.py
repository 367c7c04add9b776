"""Canary tripwire (kvproxy/response/tripwire.py): split markers, many tenants, own markers never
trigger, no false positives on random text, bounded per-chunk work."""

from __future__ import annotations

import itertools
import random
import string

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproxy.config import CanaryTenant, ConfigError, Settings
from kvproxy.response.guard import StreamGuard
from kvproxy.response.tripwire import MAX_MARKER_CHARS, CanaryHit, CanaryRules, CanaryScanner

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
    """What the relay does: SSE framing -> every string of each event -> scanner."""
    guard = StreamGuard(scanner)
    hits = []
    for piece in pieces:
        guard.feed(piece)
        hits += guard.hits
    guard.finish()
    return hits + guard.hits


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
    assert len(s.tail_of(0)) <= longest - 1


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


# --- every string a client receives, streamed and not, split and escaped -----------------
# (#15.1: the old scanner read only content / reasoning_content / text.)

MARK = ACME_HIT  # a pattern marker, foreign to "bob"


def _chat(delta: dict[str, object], **choice: object) -> dict[str, object]:
    return {"id": "c", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": delta, **choice}]}  # fmt: skip


def _lp(tok: str) -> dict[str, object]:
    return {"token": tok, "logprob": -0.1, "bytes": list(tok.encode()), "top_logprobs": []}


# Each builds one streamed event carrying `s` in one field a client receives.
STREAM_FIELDS = {
    "chat.content": lambda s: _chat({"content": s}),
    "chat.reasoning": lambda s: _chat({"reasoning": s}),
    "chat.reasoning_content": lambda s: _chat({"reasoning_content": s}),
    "chat.refusal": lambda s: _chat({"refusal": s}),
    "chat.tool_calls.arguments": lambda s: _chat(
        {"tool_calls": [{"index": 0, "function": {"arguments": s}}]}
    ),
    "chat.tool_calls.name": lambda s: _chat(
        {"tool_calls": [{"index": 1, "function": {"name": s}}]}
    ),
    "chat.function_call": lambda s: _chat({"function_call": {"arguments": s}}),
    "chat.logprobs.token": lambda s: _chat({}, logprobs={"content": [_lp(s)]}),
    "chat.top_logprobs.token": lambda s: _chat(
        {}, logprobs={"content": [{**_lp("x"), "top_logprobs": [_lp(s)]}]}
    ),
    "chat.future_field": lambda s: _chat({"engine_added_field": {"deep": [s]}}),
    "chat.root_field": lambda s: {**_chat({}), "system_fingerprint": s},
    "completions.text": lambda s: {"choices": [{"index": 0, "text": s}]},
    "completions.logprobs.tokens": lambda s: {
        "choices": [{"index": 0, "text": "", "logprobs": {"tokens": [s], "token_logprobs": [-1]}}]
    },
    "generate.text": lambda s: {"text": s, "meta_info": {"completion_tokens": 1}},
    "generate.meta_info": lambda s: {
        "text": "",
        "meta_info": {"output_token_logprobs": [[-0.1, 5, s]], "id": "r"},
    },
    "error.message": lambda s: {"error": {"message": s, "code": 500}},
}


def _escaped(obj: object, piece: str) -> bytes:
    """JSON for `obj` with every character of `piece` written as a \\uXXXX escape."""
    text = orjson.dumps(obj).decode()
    return text.replace(piece, "".join(f"\\u{ord(c):04x}" for c in piece)).encode()


@pytest.mark.parametrize("field", sorted(STREAM_FIELDS))
@pytest.mark.parametrize("cut", [1, 9, len(MARK) - 1])
def test_streamed_marker_in_any_field_split_across_events_and_escaped(field: str, cut: int) -> None:
    build = STREAM_FIELDS[field]
    a, b = MARK[:cut], MARK[cut:]
    events = [
        _chat({"role": "assistant", "content": ""}),
        build("lead-in " + a),
        {"choices": [{"index": 3, "delta": {"content": "other choice"}}]},  # not in between
        build(b + " tail"),
    ]
    stream = [b"data: " + _escaped(e, a) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]
    hits = scan_stream(rules().scanner("bob"), stream)
    assert hits == [CanaryHit("acme", "acme#2")], field
    # The viewer who owns the marker is never blocked by it.
    assert scan_stream(rules().scanner("acme"), stream) == []


BODY_FIELDS = {
    "chat.message.content": {"choices": [{"message": {"role": "assistant", "content": MARK}}]},
    "chat.message.reasoning": {"choices": [{"message": {"content": "", "reasoning": MARK}}]},
    "chat.message.refusal": {"choices": [{"message": {"refusal": MARK}}]},
    "chat.message.tool_call_name": {
        "choices": [{"message": {"tool_calls": [{"function": {"name": MARK}}]}}]
    },
    "chat.message.function_call": {"choices": [{"message": {"function_call": {"name": MARK}}}]},
    # Split over logprob tokens: the list is read as one text.
    "chat.logprobs.tokens": {
        "choices": [
            {
                "message": {"content": ""},
                "logprobs": {"content": [_lp(MARK[:5]), _lp(MARK[5:17]), _lp(MARK[17:])]},
            }
        ]
    },
    "completions.text": {"choices": [{"index": 0, "text": MARK}]},
    "completions.top_logprobs.key": {
        "choices": [{"text": "", "logprobs": {"top_logprobs": [{MARK: -0.5}]}}]
    },
    "generate.text": {"text": MARK, "meta_info": {}},
    "generate.batch": [{"text": "a", "meta_info": {}}, {"text": MARK, "meta_info": {}}],
    "generate.meta_info": {"text": "", "meta_info": {"finish_reason": {"matched": MARK}}},
    "usage.extra": {"choices": [], "usage": {"note": MARK}},
}


@pytest.mark.parametrize("field", sorted(BODY_FIELDS))
def test_non_streamed_marker_in_any_field_escaped(field: str) -> None:
    body = _escaped(BODY_FIELDS[field], MARK[:9])
    assert MARK.encode() not in body  # only the decoded text holds the marker
    assert rules().scanner("bob").scan_body(body) == CanaryHit("acme", "acme#2"), field


@pytest.mark.parametrize(
    "body",
    [
        b'{"text": "' + MARK.encode() + b'", "x": NaN}',  # not JSON to orjson, JSON to others
        b'{"text": "\\u004b' + MARK[1:].encode() + b'", "n": 1e400}',  # escaped, undecodable
        b"\xff garbage " + MARK.encode(),
        # An event stream labelled as JSON, its marker split across events.
        b'data: {"choices":[{"index":0,"delta":{"content":"' + MARK[:6].encode() + b'"}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"content":"' + MARK[6:].encode() + b'"}}]}\n\n',
    ],
)
def test_undecodable_bodies_are_scanned_raw_and_unescaped(body: bytes) -> None:
    assert rules().scanner("bob").scan_body(body) == CanaryHit("acme", "acme#2")


def test_sse_comment_and_event_lines_are_scanned() -> None:
    stream = [b": " + MARK.encode() + b"\n\n", b"data: [DONE]\n\n"]
    assert scan_stream(rules().scanner("bob"), stream) == [CanaryHit("acme", "acme#2")]


def test_cumulative_generate_text_is_counted_once_yet_seams_are_scanned() -> None:
    s = rules("observe").scanner("bob")
    texts = ["The ", "The " + MARK, "The " + MARK + " cat", "The " + MARK + " cat sat"]
    stream = [b"data: " + orjson.dumps({"text": t, "meta_info": {}}) + b"\n\n" for t in texts]
    assert scan_stream(s, stream) == [CanaryHit("acme", "acme#2")]
    assert s.hit_count == 1
    # Incremental text that repeats itself: the marker sits on the seam of two copies.
    half = MARK[:15]
    seam = MARK[15:] + " " + half  # "...half" then "seam" again shows half + MARK[15:]
    s2 = rules().scanner("bob")
    events = [seam, seam]
    stream2 = [b"data: " + orjson.dumps({"text": t, "meta_info": {}}) + b"\n\n" for t in events]
    assert scan_stream(s2, stream2) == [CanaryHit("acme", "acme#2")]


def test_patterns_that_look_past_the_match_are_refused() -> None:
    for pattern in ("KVCANARY-[0-9]{8}$", r"\bKVCANARY-[0-9]{8}", "KVC(?=A)ANARY-[0-9]{4}"):
        with pytest.raises(ConfigError, match="anchor or lookaround"):
            CanaryRules.from_tenants([CanaryTenant(tenant="acme", patterns=(pattern,))])


_KEY = st.text(alphabet=string.ascii_letters + "_", min_size=1, max_size=8)
# One step down: a key of an object (with siblings), a one-element list, or a list of
# records numbered by `index` (the choices / tool_calls shape).
_STEP = st.one_of(
    st.tuples(
        st.just("key"),
        _KEY,
        st.dictionaries(_KEY, st.integers(-(2**63), 2**63 - 1) | st.none(), max_size=2),
    ),
    st.tuples(st.just("list"), st.just(""), st.just({})),
    st.tuples(st.just("indexed"), st.integers(0, 3).map(str), st.just({})),
)


def _build(steps: list[tuple[str, str, dict[str, object]]], leaf: str) -> object:
    value: object = leaf
    for kind, name, siblings in reversed(steps):
        if kind == "key":
            value = {**{k: v for k, v in siblings.items() if k != name}, name: value}
        elif kind == "list":
            value = [value]
        else:
            value = [{"index": int(name), "v": value}]
    return value


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(_STEP, min_size=1, max_size=6),
    cut=st.integers(1, len(MARK) - 1),
    escape=st.booleans(),
)
def test_a_marker_anywhere_in_any_shape_split_across_events_is_found(
    steps: list[tuple[str, str, dict[str, object]]], cut: int, escape: bool
) -> None:
    """Whatever key or nesting carries it, and written with escapes or not."""
    a, b = MARK[:cut], MARK[cut:]
    first, second = _build(steps, "x " + a), _build(steps, b + " y")
    stream = [
        b"data: " + (_escaped(first, a) if escape else orjson.dumps(first)) + b"\n\n",
        b"data: " + orjson.dumps(second) + b"\n\n",
    ]
    assert scan_stream(rules().scanner("bob"), stream) == [CanaryHit("acme", "acme#2")]


# --- the raw-bytes prefilter (CanaryScanner.skips) ----------------------------------------


def test_skips_only_events_provably_free_of_any_marker_part() -> None:
    s = rules().scanner("bob")  # foreign: acme's markers, starting with "A" and "K"
    clean = b'{"choices":[{"index":0,"delta":{"content":"hello there"}}]}'
    assert s.skips(clean)
    assert not s.skips(clean.replace(b"hello", b"Kello"))  # a start character
    assert not s.skips(clean.replace(b"hello", b"h\\u0065llo"))  # an escape could hide one
    # A tail that holds a start character may be the head of a split marker.
    assert s.feed(["p"], ["lead-in KVCAN"]) is None
    assert not s.skips(clean)
    assert s.feed(["p"], ["ARY-acme-0123456789abcdef"]) == CanaryHit("acme", "acme#2")
    # Once the tails hold none again (the marker's characters scrolled out), it skips.
    assert s.feed(["p"], ["x" * MAX_MARKER_CHARS]) is None
    assert s.skips(clean)


@pytest.mark.parametrize(
    "pattern", ["[A-Z]{3}-leak-[0-9]{4}", "(?i:kvcanary)-[0-9]{8}", "\x00CANARY-x1y2z3"]
)
def test_skips_nothing_when_a_marker_has_no_known_first_character(pattern: str) -> None:
    r = CanaryRules.from_tenants([CanaryTenant(tenant="acme", patterns=(pattern,))])
    assert not r.scanner("bob").skips(b'{"choices":[{"delta":{"content":"hello"}}]}')


class _NoSkip(CanaryScanner):
    __slots__ = ()

    def skips(self, payload: bytes) -> bool:
        return False


def _no_skip(scanner: CanaryScanner) -> CanaryScanner:
    return _NoSkip(scanner._compiled, scanner.tenant)


_PIECES = st.sampled_from(
    ["the ", "KV", "CANARY", "-acme-", "0123456789abcdef", "ACME-", "CANARY-7f3a9c", "é😀",
     "K", "A", "x", "\n", "{", "\"", "BOB-"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    texts=st.lists(st.lists(_PIECES, max_size=6).map("".join), min_size=1, max_size=12),
    escapes=st.lists(st.booleans(), min_size=12, max_size=12),
    fields=st.lists(st.sampled_from(["content", "reasoning_content", "text"]), min_size=12,
                    max_size=12),
    cuts=st.lists(st.integers(1, 4000), max_size=6),
    viewer=st.sampled_from(["bob", "acme", "nobody"]),
)  # fmt: skip
def test_the_prefilter_never_changes_what_is_found(
    texts: list[str], escapes: list[bool], fields: list[str], cuts: list[int], viewer: str
) -> None:
    """Hits with the prefilter equal hits without it, for streams built from marker pieces
    spread over events, fields and choices, some written with JSON escapes, cut anywhere."""
    events = [_chat({"role": "assistant", "content": ""})]
    for i, text in enumerate(texts):
        events.append(
            {"choices": [{"index": i % 2, "delta": {fields[i]: text}}]}
            if i % 3
            else _chat({fields[i]: text})
        )
    raw = b""
    for i, e in enumerate(events):
        body = orjson.dumps(e)
        if i and escapes[(i - 1) % 12] and texts[i - 1]:
            body = _escaped(e, texts[i - 1])  # every character of it
        raw += b"data: " + body + b"\n\n"
    raw += b"data: [DONE]\n\n"
    at = sorted({c % len(raw) for c in cuts} - {0})
    pieces = [raw[a:b] for a, b in itertools.pairwise([0, *at, len(raw)])]
    expect = scan_stream(_no_skip(rules().scanner(viewer)), pieces)
    assert scan_stream(rules().scanner(viewer), pieces) == expect
