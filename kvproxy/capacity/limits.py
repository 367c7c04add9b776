"""The limit arithmetic: per-engine limits from reported numbers, and the admission and
decode limits from all engines. Sans-IO; used by the monitor and by `kvproxy check`, both through
`limits_for(settings, measurements)`, so the gate computes the proxy's limit from the same
inputs (declared context, margin, fallback), not a look-alike.

Every limit is an inclusive token count: the largest prompt (or prompt + output) that
fits. The rules, each with the reason for its off-by-one:

SGLang (behaviour of python/sglang/srt, each rule with the file it follows):
    reserve           = max(eagle_topk * num_steps, num_draft_tokens) under an EAGLE-family
                        algorithm, else 0   (managers/tokenizer_manager.py
                        num_reserved_tokens; managers/utils.py compute_num_reserved_tokens)
    a prompt is refused when len(input_ids) + reserve >= context_len
                                            (tokenizer_manager._validate_one_request)
    and when input + reserve + max_new_tokens > context_len (current builds; >= in older
                        ones, so we use the stricter >=)   (same function)
    max_req_len       = min(context_len - 1, pool x dcp_size - 1)
                        (managers/tp_worker.py get_worker_info; x dcp since PR #33448)
    max_req_input_len = max_req_len - 5, refused when len(input_ids) >= it
                        (managers/utils.py validate_input_length)
so the largest accepted prompt is min(context - 7, context - reserve - 1, pool x dcp - 7)
(pool 5,322 / context 8,192 -> 5,315; pool 681,280 -> 681,273). When the engine reports
`max_req_input_len` we take `it - 1` and still apply the formula to every other report
(DP ranks, metrics), keeping the smallest. DCP scales the pool only when the engine's own
`max_req_input_len` shows that its build does (before PR #33448 it did not): without that
report the per-rank pool is used, which is safe on every build.
Decode side (SGLang): the scheduler never refuses an output; it silently clamps
`max_new_tokens` (managers/scheduler.py init_req_max_new_tokens) to
    min(max_req_len - input - 1, pool x dcp - ceil_page(input) - page_size - 1)
(the second term since PR #25126, x dcp since PR #33448). The decode limit is the largest
prompt + output the engine serves in full, neither refused nor cut:
    min(max_req_len - 1, pool x dcp - 2 x page_size, context - reserve - 1)
(ceil_page(input) <= input + page_size - 1 turns the page term into a bound on the sum;
on builds before #25126 it is up to two pages stricter than needed). So the published
limit stays reachable with a small output: pool 5,007 in pages of 1 admits a 5,000-token
prompt with up to 5 output tokens, exactly what the engine generates without cutting.
A prefill engine generates nothing, but its tokenizer manager runs the same total check on
the same body: it contributes `context - reserve - 1` to the decode limit.

vLLM: a request is accepted while prompt + max_tokens <= max_model_len (entrypoints
renderer, v0.18+ message "requested M output tokens and your prompt contains T input
tokens"), and the whole sequence must fit the KV pool, so the decode limit is
`min(max_model_len, pool)`; the input limit is one less, because at least one output
token must fit. vLLM refuses to start when max_model_len exceeds one engine's pool
(v1/core/kv_cache_utils.py), so on vLLM the context is what binds in practice.

Static engines: the declared `capacity_tokens` is both limits, labelled declared.

The published limit (`Limits.admission_limit_tokens`: the gauge, `/capacity`, the release
gate's boundary probe, the canary harness and every rejection message) is one number: the
largest prompt a client can send and still get at least one output token,
    min(input limit, decode limit - 1)
where the input limit is what the admitting engines (and the declared context) accept with
no output at all (`input_limit_tokens`, kept for routes that generate nothing: embeddings,
classify, rerank). `kvproxy.policy.admission.decide` admits exactly the prompts up to it for a
request with `max_tokens` 1 and `n` 1: the two are held equal by property tests over every
engine kind and role mix. Example: one unified SGLang engine, pool 5,007, page 64: input
limit 5,000, decode limit 4,879 (pool - 2 x page), published 4,878.

Must never: raise a limit above any contributing number, or call a limit "measured" when
only declared numbers produced it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvproxy.capacity.measurement import BoundBy, EngineMeasurement, Role, Source

# The scheduler's offset: without a speculative reserve, min(context, pool x dcp) -
# SGLANG_RESERVED_TOKENS is the largest prompt SGLang accepts (max_req_len is one below
# the smaller, max_req_input_len five below that, refused at >=). A speculative reserve
# is a separate rule (sglang_limits), never folded into this constant.
SGLANG_RESERVED_TOKENS = 7

_ADMISSION_ROLES = ("prefill", "unified")
_DECODE_ROLES = ("decode", "unified")


@dataclass(frozen=True)
class EngineLimits:
    input_limit_tokens: int
    decode_limit_tokens: int
    bound_by: BoundBy
    # True when the engine's own max_req_input_len is the binding number.
    from_reported: bool = False
    # Largest prompt + output the engine's front end accepts (its context check), for
    # engines whose role adds no decode limit of their own (prefill).
    request_limit_tokens: int | None = None
    # True when DCP scaled the pool (the engine's own report showed its build does).
    dcp_scaled: bool = False


def sglang_limits(
    *,
    pool_tokens: int,
    context_tokens: int | None,
    max_req_input_len: int | None,
    reserved_tokens: int = 0,
    dcp_size: int = 1,
    page_size: int | None = None,
) -> EngineLimits:
    """SGLang's inclusive limits; the smallest of every applicable derivation."""
    if context_tokens is None and max_req_input_len is None:
        # The pool alone is not enough: a smaller context would bind below it.
        raise ValueError("SGLang limit needs a context length or max_req_input_len")
    # tp_worker: max_req_len <= pool - 1 without DCP, so a reported max_req_input_len above
    # pool - 6 can only come from a build that scales the pool by dcp_size (PR #33448).
    dcp_scaled = (
        dcp_size > 1 and max_req_input_len is not None and max_req_input_len + 5 > pool_tokens - 1
    )
    pool = pool_tokens * dcp_size if dcp_scaled else pool_tokens
    candidates: list[tuple[int, BoundBy, bool]] = []
    if context_tokens is not None and context_tokens < pool:
        candidates.append((context_tokens - SGLANG_RESERVED_TOKENS, "context", False))
    else:
        # Valid with or without a context: the engine never accepts more than pool - 7.
        # This is what catches a DP rank whose pool is below the one max_req_input_len
        # was computed from (the top-level report is rank 0's).
        candidates.append((pool - SGLANG_RESERVED_TOKENS, "pool", False))
    # The tokenizer manager's context: when no report names it, the smallest context the
    # engine's max_req_input_len allows (max_req_len + 1) keeps the reserve rule safe.
    check_context = context_tokens
    if check_context is None and max_req_input_len is not None:
        check_context = max_req_input_len + 6
    if check_context is not None and reserved_tokens:
        # tokenizer_manager: input + reserve >= context_len is refused.
        candidates.append((check_context - reserved_tokens - 1, "context", False))
    if max_req_input_len is not None:
        reported = max_req_input_len - 1
        bound: BoundBy = "pool" if reported >= pool - SGLANG_RESERVED_TOKENS else "context"
        candidates.append((reported, bound, True))
    # On a tie prefer the engine's own report: it is the more specific source.
    limit, bound_by, reported_binds = min(candidates, key=lambda c: (c[0], not c[2]))

    max_req_len = pool - 1
    if context_tokens is not None:
        max_req_len = min(max_req_len, context_tokens - 1)
    if max_req_input_len is not None:
        max_req_len = min(max_req_len, max_req_input_len + 5)
    decode = max_req_len - 1  # scheduler clamp: max_new <= max_req_len - input - 1
    if page_size is not None:
        # PR #25126: max_new <= pool - ceil_page(input) - page - 1. Builds without page_size
        # in /server_info predate it. Under DCP the allocator's page may span every rank's
        # share (dcp x page_size): the wider page is the safe reading.
        page = page_size * dcp_size if dcp_scaled else page_size
        decode = min(decode, pool - 2 * page)
    request_limit = None
    # Without a reported context the inferred one is only used where a reserve needs it:
    # it could sit far below the real context and would cut outputs needlessly.
    if context_tokens is not None or (check_context is not None and reserved_tokens):
        request_limit = (context_tokens or check_context or 0) - reserved_tokens - 1
        decode = min(decode, request_limit)
    return EngineLimits(
        limit,
        decode,
        bound_by,
        reported_binds,
        request_limit_tokens=request_limit,
        dcp_scaled=dcp_scaled,
    )


def vllm_limits(*, pool_tokens: int, max_model_len: int) -> EngineLimits:
    """vLLM's inclusive limits: prompt <= min(len, pool) - 1, prompt + output <= min."""
    decode = min(max_model_len, pool_tokens)
    bound: BoundBy = "pool" if pool_tokens < max_model_len else "context"
    return EngineLimits(decode - 1, decode, bound, request_limit_tokens=max_model_len)


def static_limits(capacity_tokens: int) -> EngineLimits:
    return EngineLimits(capacity_tokens, capacity_tokens, "declared")


@dataclass(frozen=True)
class Limits:
    """What admission enforces right now, and why. Cheap to copy; never mutated.

    `admission_limit_tokens` is the published limit: the largest prompt admitted with one
    output token (module docstring); `source`, `why` and `binding_engine` describe it.
    `input_limit_tokens` is the largest prompt admitted with no output at all (routes that
    generate nothing, `max_tokens` 0), with its own `input_source` and `input_why`."""

    admission_limit_tokens: int | None
    decode_limit_tokens: int | None
    source: Source
    known: bool
    why: str
    binding_engine: str | None = None
    # None: as admission_limit_tokens (no decode engine, or the limits are unknown).
    input_limit_tokens: int | None = None
    input_source: Source = "measured"
    input_why: str = ""
    declared_context: int | None = None
    decode_source: Source = "measured"
    decode_why: str = ""
    decode_binding_engine: str | None = None
    # Largest prompt every decode-side engine accepts with no output at all. A prompt this
    # long with max_tokens 0 is served even where the decode limit (a bound on prompt +
    # output, linear in both) sits below it: SGLang's page-aware clamp makes the pool term
    # up to 2 x page_size stricter than the input check.
    decode_prompt_limit_tokens: int | None = None
    # Smallest measured (not declared) prefill/unified input limit, before margin: the
    # largest safe declared context `kvproxy check` names. Independent of the declared
    # context, the margin and unmeasured engines; `measured_why` says which engine binds.
    measured_limit_tokens: int | None = None
    measured_why: str = ""
    margin_tokens: int = 0
    unknown_engines: tuple[str, ...] = ()
    fallback_used: bool = False
    warnings: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "known": self.known,
            "admission_limit_tokens": self.admission_limit_tokens,
            "source": self.source,
            "why": self.why,
            "binding_engine": self.binding_engine,
            "input_limit_tokens": self.input_limit_tokens,
            "input_source": self.input_source,
            "input_why": self.input_why or self.why,
            "decode_limit_tokens": self.decode_limit_tokens,
            "decode_source": self.decode_source,
            "decode_why": self.decode_why,
            "decode_binding_engine": self.decode_binding_engine,
            "decode_prompt_limit_tokens": self.decode_prompt_limit_tokens,
            "declared_context": self.declared_context,
            "measured_limit_tokens": self.measured_limit_tokens,
            "measured_why": self.measured_why,
            "margin_tokens": self.margin_tokens,
            "unknown_engines": list(self.unknown_engines),
            "fallback_used": self.fallback_used,
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True)
class _Candidate:
    tokens: int
    phrase: str
    engine: str | None
    declared: bool
    fallback: bool = False


def _pick(cands: Sequence[_Candidate]) -> _Candidate:
    # On a tie name the measured number: "the prefill pool" explains more than "config".
    return min(cands, key=lambda c: (c.tokens, c.declared))


def _margin_phrase(margin: int) -> str:
    return f", minus a {margin:,}-token safety margin" if margin else ""


def held_context(
    measurements: Iterable[EngineMeasurement],
) -> tuple[int, EngineMeasurement] | None:
    """The smallest context a measured admitting engine holds, in tokens of context
    (min(context, pool): the unit a declared context is in), and that engine; None when no
    prefill/unified engine was measured (declared numbers do not count)."""
    holds = [
        (m.pool_tokens if m.context_length is None else min(m.pool_tokens, m.context_length), m)
        for m in measurements
        if m.role in _ADMISSION_ROLES and m.source != "declared"
    ]
    return min(holds, key=lambda h: h[0]) if holds else None


@dataclass
class _Candidates:
    """Every number that bounds each limit: `admission` (a prompt with no output),
    `decode` (prompt + output) and `decode_prompt` (the decode side's own input limits)."""

    admission: list[_Candidate] = field(default_factory=list)
    decode: list[_Candidate] = field(default_factory=list)
    decode_prompt: list[int] = field(default_factory=list)

    def add_measurement(self, m: EngineMeasurement) -> None:
        declared = m.source == "declared"
        if m.role in _ADMISSION_ROLES:
            self.admission.append(
                _Candidate(m.input_limit_tokens, m.limit_phrase(), m.engine, declared)
            )
        if m.role in _DECODE_ROLES and m.decode_limit_tokens is not None:
            self.decode.append(
                _Candidate(m.decode_limit_tokens, m.limit_phrase(), m.engine, declared)
            )
            self.decode_prompt.append(m.input_limit_tokens)
        elif m.role == "prefill" and m.request_limit_tokens is not None:
            # Prefill's front end checks input + output against its context too.
            self.decode.append(
                _Candidate(
                    m.request_limit_tokens, f"context check of {m.engine}", m.engine, declared
                )
            )

    def add_fallbacks(self, unknown: Mapping[str, Role], fallback_limit_tokens: int) -> None:
        """The configured fallback stands in, declared, for each unmeasured engine."""
        phrase = "configured fallback limit (KVPROXY_CAPACITY_FALLBACK_LIMIT_TOKENS)"
        for label, role in unknown.items():
            fb = _Candidate(
                fallback_limit_tokens, f"{phrase} for unmeasured {label}", label, True, True
            )
            if role in _ADMISSION_ROLES:
                self.admission.append(fb)
            if role in _DECODE_ROLES:
                self.decode.append(fb)
                self.decode_prompt.append(fallback_limit_tokens)


def _source_of(cands: Sequence[_Candidate]) -> Source:
    # A fallback standing in for a missing measurement makes the whole limit declared: it
    # is no longer backed by what every engine reported.
    if any(c.fallback for c in cands) or all(c.declared for c in cands):
        return "declared"
    return "measured"


def _overpromise_warnings(
    measurements: Iterable[EngineMeasurement], max_context: int | None, measured_limit: int | None
) -> list[str]:
    held = held_context(measurements)
    if max_context is None or held is None or max_context <= held[0]:
        return []
    cap, m = held
    # The incident's misconfiguration: the declared context promises more than the pool
    # holds. Both numbers, so operators can act on the line alone.
    return [
        f"declared context {max_context:,} (KVPROXY_MAX_CONTEXT) exceeds what "
        f"{m.engine} holds ({cap:,} tokens: {m.pool_source}); admission uses the "
        f"measured limit {measured_limit:,}"
    ]


def _published(
    input_best: _Candidate,
    input_limit: int,
    decode_best: _Candidate | None,
    decode_limit: int | None,
    cands: _Candidates,
    margin_tokens: int,
) -> tuple[int, Source, str, str | None]:
    """The published limit (module docstring), its source, why and binding engine."""
    if decode_best is None or decode_limit is None or decode_limit - 1 >= input_limit:
        why = input_best.phrase + _margin_phrase(margin_tokens)
        return input_limit, _source_of(cands.admission), why, input_best.engine
    # The decode side binds: its limit is on prompt + output, and a client needs at least
    # one output token, so one token of it is the output's.
    published = max(0, decode_limit - 1)
    why = (
        f"{decode_best.phrase}{_margin_phrase(margin_tokens)}, which serves prompt + "
        f"output up to {decode_limit:,}: {published:,} with one output token"
    )
    return published, _source_of(cands.decode), why, decode_best.engine


def _known_limits(cands: _Candidates, margin_tokens: int, **common: Any) -> Limits:
    """The limits once every engine has a number (measured, declared or the fallback)."""
    best = _pick(cands.admission)
    input_limit = max(0, best.tokens - margin_tokens)
    decode_best = _pick(cands.decode) if cands.decode else None
    if decode_best is None:
        decode_limit = None
        decode_why = "no decode or unified engine is configured: the decode budget is not checked"
    else:
        decode_limit = max(0, decode_best.tokens - margin_tokens)
        decode_why = decode_best.phrase + _margin_phrase(margin_tokens)
    published, source, why, binding = _published(
        best, input_limit, decode_best, decode_limit, cands, margin_tokens
    )
    return Limits(
        admission_limit_tokens=published,
        decode_limit_tokens=decode_limit,
        source=source,
        known=True,
        why=why,
        binding_engine=binding,
        input_limit_tokens=input_limit,
        input_source=_source_of(cands.admission),
        input_why=best.phrase + _margin_phrase(margin_tokens),
        decode_source=_source_of(cands.decode) if cands.decode else "measured",
        decode_why=decode_why,
        decode_binding_engine=decode_best.engine if decode_best is not None else None,
        decode_prompt_limit_tokens=(
            max(0, min(cands.decode_prompt) - margin_tokens)
            if cands.decode_prompt and decode_best
            else None
        ),
        margin_tokens=margin_tokens,
        **common,
    )


def derive_limits(
    measurements: Iterable[EngineMeasurement],
    *,
    max_context: int | None,
    margin_tokens: int = 0,
    unknown: Mapping[str, Role] | None = None,
    fallback_limit_tokens: int | None = None,
) -> Limits:
    """The one limit computation.

    `measurements` are the fresh ones; `unknown` maps each configured engine without a
    fresh measurement to its role. Unknown engines make the limits unknown (I3) unless
    `fallback_limit_tokens` is set, which then stands in for each of them, declared.
    """
    unknown = dict(unknown or {})
    measurements = list(measurements)
    cands = _Candidates()
    for m in measurements:
        cands.add_measurement(m)
    measured = [c for c in cands.admission if not c.declared]
    measured_best = _pick(measured) if measured else None
    measured_limit = measured_best.tokens if measured_best is not None else None
    common: dict[str, Any] = {
        "declared_context": max_context,
        "measured_limit_tokens": measured_limit,
        "measured_why": measured_best.phrase if measured_best is not None else "",
        "unknown_engines": tuple(sorted(unknown)),
        "warnings": tuple(_overpromise_warnings(measurements, max_context, measured_limit)),
    }
    if unknown and fallback_limit_tokens is None:
        why = f"no fresh capacity measurement of {', '.join(common['unknown_engines'])}"
        return Limits(None, None, "measured", False, why, margin_tokens=margin_tokens, **common)
    if fallback_limit_tokens is not None:
        cands.add_fallbacks(unknown, fallback_limit_tokens)
    if max_context is not None:
        cands.admission.append(
            _Candidate(max_context, "declared context (KVPROXY_MAX_CONTEXT)", None, True)
        )
    if not cands.admission:
        why = "no prefill or unified engine is configured and KVPROXY_MAX_CONTEXT is unset"
        return Limits(None, None, "measured", False, why, margin_tokens=margin_tokens, **common)
    return _known_limits(cands, margin_tokens, fallback_used=bool(unknown), **common)


class LimitSettings(Protocol):
    """The settings the limits depend on (kvproxy.config.settings.Settings has them; so do the
    release gate's options, copied from the same settings)."""

    @property
    def max_context(self) -> int | None: ...

    @property
    def limit_margin_tokens(self) -> int: ...

    @property
    def capacity_fallback_limit_tokens(self) -> int | None: ...


def limits_for(
    settings: LimitSettings,
    measurements: Iterable[EngineMeasurement],
    unknown: Mapping[str, Role] | None = None,
) -> Limits:
    """The limits the proxy enforces for these measurements under these settings: the one
    call the capacity monitor (fresh measurements, unknown = the rest) and `kvproxy check`
    (what it measured, unknown = what it could not) both make."""
    return derive_limits(
        measurements,
        max_context=settings.max_context,
        margin_tokens=settings.limit_margin_tokens,
        unknown=unknown,
        fallback_limit_tokens=settings.capacity_fallback_limit_tokens,
    )
