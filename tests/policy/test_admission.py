"""The sans-IO admission decision: I1 (never above the limit), I3 (unknown refuses), I4
(decode budget), the clamp, prompt-only routes, the re-check after queueing, the counter's
ceiling (exactly the largest count `decide` admits), and the error bodies users see."""

from __future__ import annotations

from dataclasses import dataclass

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvproxy.policy import admission
from kvproxy.policy.admission import Admit, Policy, Reject, limits_known, unmeasured
from kvproxy.policy.counts import TokenCount


@dataclass(frozen=True)
class L:
    known: bool = True
    admission_limit_tokens: int | None = 681_273
    decode_limit_tokens: int | None = 1_000_000
    decode_prompt_limit_tokens: int | None = None
    source: str = "measured"
    why: str = "measured prefill KV pool of prefill-0"
    input_limit_tokens: int | None = None
    input_source: str = "measured"
    input_why: str = ""


@dataclass(frozen=True)
class Shape:
    max_output_tokens: int | None = None
    n: int = 1
    prompt_param: str = "messages"
    generates: bool = True


Ask = tuple[TokenCount, Shape]


def count(
    tokens: int,
    *,
    exact: bool = True,
    out: int | None = None,
    n: int = 1,
    generates: bool = True,
) -> Ask:
    method = "exact" if exact else "bound"
    return TokenCount(tokens, method, exact, tokens), Shape(out, n, generates=generates)


def decide(ask: Ask, limits: L, policy: Policy) -> admission.Decision:
    return admission.decide(ask[0], ask[1], limits, policy)


def test_admits_at_the_limit_and_rejects_one_above() -> None:
    assert isinstance(decide(count(681_273), L(), Policy()), Admit)
    verdict = decide(count(681_274), L(), Policy())
    assert isinstance(verdict, Reject)
    err = verdict.error
    assert err.status == 400
    body = orjson.loads(err.body("openai"))["error"]
    assert body["code"] == "context_length_exceeded"
    assert body["type"] == "invalid_request_error"
    assert body["param"] == "messages"
    assert body["prompt_tokens"] == 681_274
    assert body["limit_tokens"] == 681_273
    assert body["limit_source"] == "measured"
    assert "681,274" in body["message"]
    assert "681,273" in body["message"]
    assert "measured prefill KV pool" in body["message"]


def test_sglang_style_body_for_generate() -> None:
    verdict = decide(count(700_000), L(), Policy())
    assert isinstance(verdict, Reject)
    # SGLang's native /generate error, exactly: http_server._create_error_response.
    body = orjson.loads(verdict.error.body("sglang"))
    assert body == {"error": {"message": verdict.error.message}}


def test_a_bound_over_the_limit_says_it_was_a_bound() -> None:
    verdict = decide(count(700_000, exact=False), L(), Policy())
    assert isinstance(verdict, Reject)
    assert "byte bound" in verdict.error.message
    assert "KVPROXY_TOKENIZER" in verdict.error.message


def test_an_upper_count_by_a_tokenizer_names_the_missing_template() -> None:
    # The engine's /tokenize counted the texts, but without the chat template the number is an
    # upper estimate of the render: the advice is the template, not a tokenizer already set.
    ask = (TokenCount(700_000, "engine", False, 700_000), Shape(None, 1))
    verdict = decide(ask, L(), Policy())
    assert isinstance(verdict, Reject)
    assert "byte bound" not in verdict.error.message
    assert "KVPROXY_CHAT_TEMPLATE" in verdict.error.message
    assert orjson.loads(verdict.error.body("openai"))["error"]["prompt_tokens_kind"] == (
        "upper-bound"
    )


@pytest.mark.parametrize("limits", [L(known=False), L(admission_limit_tokens=None)])
def test_unknown_capacity_refuses_with_503(limits: L) -> None:
    assert not limits_known(limits)
    refused = decide(count(1), limits, Policy())
    assert isinstance(refused, Reject)
    assert refused.error.status == 503
    assert refused.error.code == "capacity_unknown"
    assert refused.error.headers["Retry-After"] == "5"
    assert refused.error.body() == unmeasured().error.body()


def test_declared_limits_are_labelled_declared() -> None:
    verdict = decide(count(10_001), L(admission_limit_tokens=10_000, source="declared"), Policy())
    assert isinstance(verdict, Reject)
    assert orjson.loads(verdict.error.body())["error"]["limit_source"] == "declared"


def test_decode_budget_rejects_prompt_plus_output() -> None:
    limits = L(admission_limit_tokens=5_000, decode_limit_tokens=6_000)
    assert isinstance(decide(count(5_000, out=1_000), limits, Policy()), Admit)
    verdict = decide(count(5_000, out=1_001), limits, Policy())
    assert isinstance(verdict, Reject)
    assert verdict.error.reason == "decode_budget"
    assert verdict.error.param == "max_tokens"
    assert verdict.error.code == "context_length_exceeded"


def test_decode_budget_counts_every_sample_and_a_default_output() -> None:
    limits = L(admission_limit_tokens=5_000, decode_limit_tokens=6_000)
    assert isinstance(decide(count(4_000, out=600, n=4), limits, Policy()), Reject)
    assert isinstance(decide(count(4_000, out=500, n=4), limits, Policy()), Admit)
    # No max_tokens: the policy's default output must still fit.
    assert isinstance(decide(count(5_999), L(True, 6_000, 6_000), Policy()), Admit)
    assert isinstance(decide(count(6_000), L(True, 6_000, 6_000), Policy()), Reject)


def test_clamp_lowers_the_output_instead_of_rejecting() -> None:
    limits = L(admission_limit_tokens=5_000, decode_limit_tokens=6_000)
    verdict = decide(count(5_000, out=4_000, n=2), limits, Policy(decode_policy="clamp"))
    assert isinstance(verdict, Admit)
    assert verdict.clamped_output_tokens == 500
    # Nothing left to clamp to: still a rejection.
    full = L(admission_limit_tokens=6_000, decode_limit_tokens=6_000)
    assert isinstance(decide(count(6_000, out=10), full, Policy(decode_policy="clamp")), Reject)


@given(
    tokens=st.integers(0, 2_000_000),
    limit=st.integers(1, 2_000_000),
    decode=st.integers(1, 3_000_000),
    out=st.one_of(st.none(), st.integers(1, 100_000)),
    n=st.integers(1, 8),
    exact=st.booleans(),
)
def test_never_admits_above_either_limit(
    tokens: int, limit: int, decode: int, out: int | None, n: int, exact: bool
) -> None:
    limits = L(admission_limit_tokens=limit, decode_limit_tokens=decode)
    verdict = decide(count(tokens, exact=exact, out=out, n=n), limits, Policy())
    if isinstance(verdict, Admit):
        assert tokens <= limit
        assert tokens + (out if out is not None else 1) * n <= decode


def test_unified_pool_5007_limit_is_reachable_with_output() -> None:
    # Issue #15.5: SGLang's uncut prompt + output on a 5,007-token pool (pages of 1) is
    # 5,005 while the largest prompt is 5,000 (kvproxy/capacity/limits.py).
    limits = L(admission_limit_tokens=5_000, decode_limit_tokens=5_005)
    for out in (0, 1, 5):
        assert isinstance(decide(count(5_000, out=out), limits, Policy()), Admit)
    verdict = decide(count(5_000, out=6), limits, Policy())
    assert isinstance(verdict, Reject)
    assert orjson.loads(verdict.error.body("openai"))["error"]["param"] == "max_tokens"


def test_no_output_needs_only_the_decode_engines_input_limit() -> None:
    # Pages of 16 on a unified 5,312 pool: prompt limit 5,305, but the page-aware output
    # bound makes prompt + output <= 5,280. A prompt asking for no output is served by the
    # engine up to its input limit, so the published limit stays reachable.
    limits = L(
        admission_limit_tokens=5_305, decode_limit_tokens=5_280, decode_prompt_limit_tokens=5_305
    )
    assert isinstance(decide(count(5_305, out=0), limits, Policy()), Admit)
    assert isinstance(decide(count(5_290, out=1), limits, Policy()), Reject)
    # Without the decode engines' input limit the sum alone decides (never more lenient).
    strict = L(admission_limit_tokens=5_305, decode_limit_tokens=5_280)
    assert isinstance(decide(count(5_305, out=0), strict, Policy()), Reject)


def test_prompt_only_routes_ignore_the_decode_pool() -> None:
    # Embeddings generate nothing: I1 decides, I4 does not (a full decode pool is no reason).
    limits = L(admission_limit_tokens=5_000, decode_limit_tokens=100)
    assert isinstance(decide(count(5_000, generates=False), limits, Policy()), Admit)
    assert isinstance(decide(count(5_001, generates=False), limits, Policy()), Reject)
    assert isinstance(decide(count(5_000), limits, Policy()), Reject)
    shape = Shape(generates=False)
    assert admission.count_ceiling(shape, limits, Policy()) == 5_000


def test_recheck_on_shrunk_limits_rejects_and_keeps_the_counts_exactness() -> None:
    first = decide(count(4_000, exact=False), L(admission_limit_tokens=5_000), Policy())
    assert isinstance(first, Admit)
    shrunk = L(admission_limit_tokens=3_000, decode_limit_tokens=None)
    again = admission.recheck(first, shrunk, Policy())
    assert isinstance(again, Reject)
    assert again.error.reason != "decode_budget"
    # The verdict carries the count: a bound stays a bound (the hint names the tokenizer).
    assert "byte bound" in again.error.message
    exact = decide(count(4_000), L(admission_limit_tokens=5_000), Policy())
    assert isinstance(exact, Admit)
    again = admission.recheck(exact, shrunk, Policy())
    assert isinstance(again, Reject)
    assert "byte bound" not in again.error.message


def test_recheck_clamps_to_the_decode_pool_that_holds_at_send_time() -> None:
    policy = Policy(decode_policy="clamp")
    ask = count(1_000, out=2_000)
    first = decide(ask, L(admission_limit_tokens=5_000, decode_limit_tokens=10_000), policy)
    assert isinstance(first, Admit)
    assert first.clamped_output_tokens is None
    again = admission.recheck(
        first, L(admission_limit_tokens=5_000, decode_limit_tokens=2_000), policy
    )
    assert isinstance(again, Admit)
    assert again.clamped_output_tokens == 1_000


def test_charge_ceiling_is_the_budget_per_sample() -> None:
    assert admission.charge_ceiling(None, Shape(n=4)) is None
    assert admission.charge_ceiling(10_001, Shape(n=4)) == 2_500
    assert admission.charge_ceiling(10_001, Shape(n=0)) == 10_001


def test_clamp_ceiling_admits_what_a_clamp_can_serve() -> None:
    # Under clamp a prompt up to decode - n is served (one token per sample at least): the
    # counter must not admit a larger bound, nor tokenize below that size.
    limits = L(admission_limit_tokens=5_000, decode_limit_tokens=3_000)
    shape = Shape(max_output_tokens=2_000, n=2)
    policy = Policy(decode_policy="clamp")
    assert admission.count_ceiling(shape, limits, policy) == 2_998
    assert admission.count_ceiling(shape, limits, Policy()) == 0


@given(
    limit=st.integers(0, 20_000),
    decode=st.one_of(st.none(), st.integers(0, 20_000)),
    prompt_only=st.one_of(st.none(), st.integers(0, 20_000)),
    out=st.one_of(st.none(), st.integers(0, 5_000)),
    n=st.integers(0, 8),
    generates=st.booleans(),
    clamp=st.booleans(),
    default_out=st.integers(0, 16),
)
def test_the_ceiling_is_exactly_the_largest_admitted_count(
    limit: int,
    decode: int | None,
    prompt_only: int | None,
    out: int | None,
    n: int,
    generates: bool,
    clamp: bool,
    default_out: int,
) -> None:
    limits = L(
        admission_limit_tokens=limit,
        decode_limit_tokens=decode,
        decode_prompt_limit_tokens=prompt_only,
    )
    policy = Policy("clamp" if clamp else "reject", default_out)
    shape = Shape(out, n, generates=generates)
    ceiling = admission.count_ceiling(shape, limits, policy)

    def admits(tokens: int) -> bool:
        got = admission.decide(TokenCount(tokens, "exact", True, tokens), shape, limits, policy)
        return isinstance(got, Admit)

    if admits(0):
        # Everything up to the ceiling is admitted, nothing above it: the counter admits on
        # a bound exactly when decide would.
        assert admits(ceiling)
        assert not admits(ceiling + 1)
        for tokens in {ceiling // 2, max(ceiling - 1, 0)}:
            assert admits(tokens)
    else:
        assert ceiling == 0  # nothing is admitted: any count is tokenized, then refused


@pytest.mark.parametrize(
    ("counted", "method", "engine", "drift", "exceeded"),
    [
        (100, "exact", 100, 0, False),
        (100, "exact", 103, 3, True),  # an exact count under the engine's: wrong tokenizer
        (100, "engine", 98, -2, False),
        (500, "bound", 100, None, False),  # a bound is meant to be above: no drift
        (100, "bound", 101, None, True),  # a bound below the engine's count: an I1 risk
        (100, None, 100, None, False),
    ],
)
def test_usage_check_compares_the_engines_count_with_ours(
    counted: int, method: str | None, engine: int, drift: int | None, exceeded: bool
) -> None:
    got = admission.check_usage(counted, method, engine)
    assert got == admission.UsageCheck(drift=drift, bound_exceeded=exceeded)
