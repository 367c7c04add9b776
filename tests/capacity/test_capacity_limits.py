"""The limit arithmetic and `derive_limits`, without sockets.

The SGLang acceptance rule is restated here from the facts file (refuse when
len >= max_req_input_len) and checked against `sglang_limits`, so the test does not
re-use the code it judges.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvproxy.capacity import EngineMeasurement, held_context, limits_for
from kvproxy.capacity.limits import derive_limits, sglang_limits, static_limits, vllm_limits
from kvproxy.config import Settings


def sglang_accepts(prompt_len: int, *, pool: int, context: int) -> bool:
    max_req_len = min(context - 1, pool - 1)
    max_req_input_len = max_req_len - 5
    return prompt_len < max_req_input_len


def m(
    engine: str,
    role: str,
    limit: int,
    *,
    kind: str = "sglang",
    pool: int | None = None,
    context: int | None = None,
    decode: int | None = None,
    bound_by: str = "pool",
) -> EngineMeasurement:
    return EngineMeasurement(
        engine=engine,
        url=f"http://{engine}",
        role=role,  # type: ignore[arg-type]
        kind=kind,  # type: ignore[arg-type]
        input_limit_tokens=limit,
        input_limit_source="test",
        pool_tokens=pool if pool is not None else limit + 7,
        pool_source="server_info.max_total_num_tokens",
        bound_by="declared" if kind == "static" else bound_by,  # type: ignore[arg-type]
        measured_at=0.0,
        context_length=context,
        decode_limit_tokens=decode if decode is not None else limit,
    )


# --- per-engine arithmetic ---------------------------------------------------------------


def test_sglang_issue_numbers() -> None:
    # The issue's acceptance numbers: pool 5,322 / context 8,192 -> 5,315 (reported 5,316).
    got = sglang_limits(pool_tokens=5322, context_tokens=8192, max_req_input_len=None)
    assert (got.input_limit_tokens, got.bound_by) == (5315, "pool")
    got = sglang_limits(pool_tokens=5322, context_tokens=None, max_req_input_len=5316)
    assert (got.input_limit_tokens, got.from_reported) == (5315, True)
    # The incident's pool.
    got = sglang_limits(pool_tokens=681_280, context_tokens=1_048_576, max_req_input_len=681_274)
    assert got.input_limit_tokens == 681_273
    # Served uncut: max_new <= max_req_len (681,279) - input - 1, so prompt + output
    # <= 681,278 (no page size given: no page term).
    assert got.decode_limit_tokens == 681_278


def test_sglang_context_binds() -> None:
    got = sglang_limits(pool_tokens=163_642, context_tokens=131_072, max_req_input_len=None)
    assert (got.input_limit_tokens, got.bound_by) == (131_065, "context")


def test_sglang_pool_bounds_a_larger_reported_value() -> None:
    # max_req_input_len is rank 0's; a smaller pool elsewhere must still bind.
    got = sglang_limits(pool_tokens=679_936, context_tokens=None, max_req_input_len=681_274)
    assert got.input_limit_tokens == 679_929
    assert not got.from_reported


def test_sglang_needs_context_or_reported_limit() -> None:
    with pytest.raises(ValueError, match="context"):
        sglang_limits(pool_tokens=5322, context_tokens=None, max_req_input_len=None)


@given(pool=st.integers(8, 4_000_000), context=st.integers(8, 4_000_000))
def test_sglang_limit_is_exactly_the_largest_accepted_prompt(pool: int, context: int) -> None:
    limit = sglang_limits(pool_tokens=pool, context_tokens=context, max_req_input_len=None)
    n = limit.input_limit_tokens
    if n >= 1:
        assert sglang_accepts(n, pool=pool, context=context)
    assert not sglang_accepts(n + 1, pool=pool, context=context)
    # And the engine's own report gives the same answer.
    reported = min(context - 1, pool - 1) - 5
    same = sglang_limits(pool_tokens=pool, context_tokens=None, max_req_input_len=reported)
    assert same.input_limit_tokens == n


def test_vllm_limits() -> None:
    got = vllm_limits(pool_tokens=2_042_016, max_model_len=40_960)
    assert (got.input_limit_tokens, got.decode_limit_tokens, got.bound_by) == (
        40_959,
        40_960,
        "context",
    )
    got = vllm_limits(pool_tokens=1000, max_model_len=4096)
    assert (got.input_limit_tokens, got.decode_limit_tokens, got.bound_by) == (999, 1000, "pool")


def test_static_limits() -> None:
    got = static_limits(100_000)
    assert (got.input_limit_tokens, got.decode_limit_tokens, got.bound_by) == (
        100_000,
        100_000,
        "declared",
    )


# --- derive_limits -----------------------------------------------------------------------


def test_measured_pool_binds_below_declared_context() -> None:
    ms = [
        m("p:1", "prefill", 5315, pool=5322, context=8192),
        m("d:2", "decode", 40_000, pool=40_007, context=8192, decode=8185),
    ]
    lim = derive_limits(ms, max_context=8192)
    assert lim.known
    assert lim.admission_limit_tokens == 5315
    assert lim.source == "measured"
    assert lim.binding_engine == "p:1"
    assert lim.why == "measured prefill KV pool of p:1"
    assert lim.decode_limit_tokens == 8185
    assert lim.decode_binding_engine == "d:2"
    assert lim.measured_limit_tokens == 5315
    assert lim.declared_context == 8192
    # The incident's misconfiguration is named with both numbers.
    assert len(lim.warnings) == 1
    assert "8,192" in lim.warnings[0]
    assert "5,315" in lim.warnings[0]


def test_healthy_declared_context_gives_no_warning() -> None:
    # Engine context = declared context, big pool: the 7-token reserve is not a warning.
    ms = [m("p:1", "prefill", 8185, pool=100_000, context=8192, bound_by="context")]
    lim = derive_limits(ms, max_context=8192)
    assert lim.admission_limit_tokens == 8185
    assert lim.warnings == ()


def test_declared_context_below_measured_binds_and_stays_measured() -> None:
    ms = [m("p:1", "prefill", 681_273, pool=681_280)]
    lim = derive_limits(ms, max_context=131_072)
    assert lim.admission_limit_tokens == 131_072
    assert lim.binding_engine is None
    assert "KVPROXY_MAX_CONTEXT" in lim.why
    # A measured engine contributed, so the limit is backed by measurement.
    assert lim.source == "measured"


def test_minimum_over_prefill_and_unified_not_decode() -> None:
    ms = [
        m("p:1", "prefill", 9000),
        m("u:2", "unified", 7000, decode=7000),
        m("d:3", "decode", 100, decode=100),
    ]
    lim = derive_limits(ms, max_context=None)
    # Input only: the smallest admitting engine; the decode engine takes no part.
    assert (lim.input_limit_tokens, lim.input_why) == (7000, "measured unified KV pool of u:2")
    assert lim.decode_limit_tokens == 100
    assert lim.decode_binding_engine == "d:3"
    # Published (with one output token): the decode pool binds, one token is the output's.
    assert (lim.admission_limit_tokens, lim.binding_engine) == (99, "d:3")
    assert lim.why.startswith("measured decode KV pool of d:3")
    assert "99 with one output token" in lim.why


def test_only_declared_values_are_labelled_declared() -> None:
    ms = [m("s:1", "prefill", 100_000, kind="static")]
    lim = derive_limits(ms, max_context=None)
    assert (lim.admission_limit_tokens, lim.source) == (100_000, "declared")
    assert lim.why == "declared prefill capacity of s:1"
    lim = derive_limits([], max_context=4096)
    assert (lim.known, lim.admission_limit_tokens, lim.source) == (True, 4096, "declared")
    assert lim.decode_limit_tokens is None


def test_nothing_configured_is_unknown() -> None:
    lim = derive_limits([], max_context=None)
    assert not lim.known
    assert lim.admission_limit_tokens is None


def test_unknown_engine_fails_closed() -> None:
    ms = [m("p:1", "prefill", 5315)]
    lim = derive_limits(ms, max_context=8192, unknown={"d:2": "decode"})
    assert not lim.known
    assert lim.admission_limit_tokens is None
    assert lim.decode_limit_tokens is None
    assert lim.unknown_engines == ("d:2",)
    assert "d:2" in lim.why


def test_fallback_stands_in_for_unknown_engines_declared() -> None:
    ms = [m("p:1", "prefill", 5315)]
    lim = derive_limits(
        ms, max_context=None, unknown={"p:2": "prefill"}, fallback_limit_tokens=4000
    )
    assert lim.known
    assert lim.fallback_used
    assert (lim.admission_limit_tokens, lim.source) == (4000, "declared")
    assert "FALLBACK" in lim.why
    # Larger fallback: the measured engine still binds, yet the limit is not fully
    # measured while an engine is unknown.
    lim = derive_limits(
        ms, max_context=None, unknown={"p:2": "prefill"}, fallback_limit_tokens=10**6
    )
    assert (lim.admission_limit_tokens, lim.source) == (5315, "declared")


def test_margin_is_subtracted_and_named() -> None:
    ms = [m("p:1", "prefill", 5315), m("d:2", "decode", 9000, decode=9000)]
    lim = derive_limits(ms, max_context=None, margin_tokens=315)
    assert lim.admission_limit_tokens == 5000
    assert lim.decode_limit_tokens == 8685
    assert "315-token safety margin" in lim.why
    lim = derive_limits(ms, max_context=None, margin_tokens=10**6)
    assert lim.admission_limit_tokens == 0


@given(
    limits=st.lists(st.integers(1, 10**7), min_size=1, max_size=6),
    roles=st.lists(st.sampled_from(["prefill", "decode", "unified"]), min_size=6, max_size=6),
    declared=st.none() | st.integers(1, 10**7),
    margin=st.integers(0, 1000),
)
def test_admission_never_exceeds_any_contribution(
    limits: list[int], roles: list[str], declared: int | None, margin: int
) -> None:
    ms = [m(f"e{i}:1", roles[i], v) for i, v in enumerate(limits)]
    lim = derive_limits(ms, max_context=declared, margin_tokens=margin)
    admitting = [x.input_limit_tokens for x in ms if x.role != "decode"]
    if declared is not None:
        admitting.append(declared)
    if not admitting:
        assert not lim.known
        return
    assert lim.known
    assert lim.input_limit_tokens == max(0, min(admitting) - margin)
    decoding = [x.decode_limit_tokens for x in ms if x.role != "prefill"]
    published = lim.input_limit_tokens
    if decoding:
        assert lim.decode_limit_tokens == max(0, min(d for d in decoding if d) - margin)
        published = min(published, max(0, lim.decode_limit_tokens - 1))
    # The published limit leaves one output token on every decode engine.
    assert lim.admission_limit_tokens == published


# --- the engines' own arithmetic (issue #24), restated from SGLang's source -------------------


def sglang_serves_uncut(
    prompt: int, out: int, *, pool: int, context: int, reserve: int, dcp: int, page: int
) -> bool:
    """tokenizer_manager + scheduler, the strictest version of each: the request is neither
    refused nor has its max_new_tokens lowered."""
    max_req_len = min(context - 1, pool * dcp - 1)
    if prompt + reserve >= context or prompt >= max_req_len - 5:
        return False
    if prompt + reserve + out >= context:  # older builds: >=, current: >
        return False
    paged = -(-prompt // page) * page
    return out <= max(0, min(max_req_len - prompt - 1, pool * dcp - paged - page - 1))


@given(
    pool=st.integers(64, 50_000),
    context=st.integers(64, 50_000),
    reserve=st.sampled_from([0, 3, 7, 16, 40]),
    dcp=st.sampled_from([1, 2, 4]),
    page=st.sampled_from([1, 16, 64]),
)
def test_sglang_limits_follow_the_engine_rules(
    pool: int, context: int, reserve: int, dcp: int, page: int
) -> None:
    pool = max(page, pool // page * page)
    mril = min(context - 1, pool * dcp - 1) - 5
    if mril <= 1 + reserve:
        return
    got = sglang_limits(
        pool_tokens=pool,
        context_tokens=context,
        max_req_input_len=mril,
        reserved_tokens=reserve,
        dcp_size=dcp,
        page_size=page,
    )
    kw = {"pool": pool, "context": context, "reserve": reserve, "dcp": dcp, "page": page}
    limit, decode = got.input_limit_tokens, got.decode_limit_tokens
    # The input limit is exact: the largest prompt the engine accepts with no output.
    assert sglang_serves_uncut(limit, 0, **kw)
    assert not sglang_serves_uncut(limit + 1, 0, **kw)
    # Every admitted prompt + output is served in full (I4 strictly safe) ...
    for prompt in {1, limit // 2, limit}:
        if decode - prompt >= 0:
            assert sglang_serves_uncut(prompt, decode - prompt, **kw)
    # ... and with pages of one token, no reserve and no DCP the decode limit is exact too
    # (under DCP kvproxy reads a page as dcp x page_size: up to a page stricter, on purpose).
    if page == 1 and not reserve and dcp == 1 and decode - limit >= 0:
        assert not sglang_serves_uncut(limit, decode - limit + 1, **kw)


def test_unified_pool_5007_reaches_its_published_limit_with_output() -> None:
    # Issue #15.5: pool 5,007 (pages of 1), context 8,192 -> prompt limit 5,000 and
    # prompt + output up to 5,005, so a 5,000-token prompt with max_tokens 1..5 passes.
    got = sglang_limits(pool_tokens=5007, context_tokens=8192, max_req_input_len=5001, page_size=1)
    assert (got.input_limit_tokens, got.decode_limit_tokens) == (5000, 5005)


def test_prefill_context_check_bounds_the_decode_side() -> None:
    # A prefill engine refuses input + reserve + output >= its context: that bounds the
    # decode limit even when the decode engine would hold more.
    prefill = EngineMeasurement(
        engine="p",
        url="http://p",
        role="prefill",
        kind="sglang",
        input_limit_tokens=8175,
        input_limit_source="test",
        pool_tokens=100_000,
        pool_source="test",
        bound_by="context",
        measured_at=0.0,
        decode_limit_tokens=8175,
        request_limit_tokens=8175,
    )
    lim = derive_limits([prefill, m("d", "decode", 99_993, decode=99_000)], max_context=None)
    assert lim.decode_limit_tokens == 8175
    assert lim.decode_binding_engine == "p"
    alone = derive_limits([prefill], max_context=None)
    assert alone.decode_limit_tokens == 8175


# --- limits_for and held_context: the inputs the monitor and the gate share ---------------


def test_limits_for_applies_the_settings_margin_and_fallback() -> None:
    ms = [m("p:1", "prefill", 5315, pool=5322, context=8192)]
    s = Settings(max_context=8192, limit_margin_tokens=15, capacity_fallback_limit_tokens=4000)
    lim = limits_for(s, ms, {"d:2": "decode"})
    # 5,315 measured minus the 15-token margin; the unmeasured decode stands in at 4,000,
    # so with one output token the published limit is 4,000 - 15 - 1, declared.
    assert (lim.known, lim.input_limit_tokens, lim.margin_tokens) == (True, 5300, 15)
    assert lim.fallback_used
    assert lim.decode_limit_tokens == 4000 - 15
    assert (lim.admission_limit_tokens, lim.source) == (4000 - 15 - 1, "declared")
    # The safe value ignores margin and declared context: what the engine holds.
    assert (lim.measured_limit_tokens, lim.measured_why) == (
        5315,
        "measured prefill KV pool of p:1",
    )
    assert lim == derive_limits(
        ms,
        max_context=8192,
        margin_tokens=15,
        unknown={"d:2": "decode"},
        fallback_limit_tokens=4000,
    )


def test_held_context_is_the_smaller_of_pool_and_context_of_measured_admitters() -> None:
    ms = [
        m("p:1", "prefill", 5315, pool=5322, context=8192),
        m("u:2", "unified", 4089, pool=10_000, context=4096),
        m("d:3", "decode", 100, pool=107, context=8192),  # decode admits nothing
        m("s:4", "prefill", 50, kind="static", pool=50),  # declared, not held
    ]
    cap, engine = held_context(ms) or (0, None)
    assert (cap, engine and engine.engine) == (4096, "u:2")
    assert held_context([ms[2], ms[3]]) is None
