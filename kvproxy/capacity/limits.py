"""The limit arithmetic: per-engine limits from reported numbers, and the admission and
decode limits from all engines. Sans-IO; used by the monitor and by `kvproxy check`.

Every limit is an inclusive token count: the largest prompt (or prompt + output) that
fits. The rules, each with the reason for its off-by-one:

SGLang (scheduler arithmetic, facts/ENGINES.md):
    max_req_len       = min(context_len - 1, pool - 1)
    max_req_input_len = max_req_len - 5
    a prompt is refused when len(input_ids) >= max_req_input_len
so the largest accepted prompt is `max_req_input_len - 1 = min(context, pool) - 7`
(pool 5,322 / context 8,192 -> 5,315; pool 681,280 -> 681,273). When the engine reports
`max_req_input_len` we take `it - 1` and still apply the formula to every other report
(DP ranks, metrics), keeping the smallest.
Decode side (SGLang): the decode engine runs the same input check on the same body and
must hold prompt + output in its pool. We use the *same* number for prompt + output,
`min(context, pool) - 7`: it satisfies the input check for any output >= 1 and keeps 6
tokens of the pool spare. Conservative by design: it never admits a pair the engine
could not hold.

vLLM: a request is accepted while prompt + max_tokens <= max_model_len, and the whole
sequence must fit the KV pool, so the decode limit is `min(max_model_len, pool)`; the
input limit is one less, because at least one output token must fit.

Static engines: the declared `capacity_tokens` is both limits, labelled declared.

Must never: raise a limit above any contributing number, or call a limit "measured" when
only declared numbers produced it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvproxy.capacity.measurement import BoundBy, EngineMeasurement, Role, Source

# min(context, pool) - SGLANG_RESERVED_TOKENS is the largest prompt SGLang accepts.
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


def sglang_limits(
    *, pool_tokens: int, context_tokens: int | None, max_req_input_len: int | None
) -> EngineLimits:
    """SGLang's inclusive input limit; the smallest of every applicable derivation."""
    if context_tokens is None and max_req_input_len is None:
        # The pool alone is not enough: a smaller context would bind below it.
        raise ValueError("SGLang limit needs a context length or max_req_input_len")
    candidates: list[tuple[int, BoundBy, bool]] = []
    if context_tokens is not None and context_tokens < pool_tokens:
        candidates.append((context_tokens - SGLANG_RESERVED_TOKENS, "context", False))
    else:
        # Valid with or without a context: the engine never accepts more than pool - 7.
        # This is what catches a DP rank whose pool is below the one max_req_input_len
        # was computed from (the top-level report is rank 0's).
        candidates.append((pool_tokens - SGLANG_RESERVED_TOKENS, "pool", False))
    if max_req_input_len is not None:
        reported = max_req_input_len - 1
        bound: BoundBy = "pool" if reported >= pool_tokens - SGLANG_RESERVED_TOKENS else "context"
        candidates.append((reported, bound, True))
    # On a tie prefer the engine's own report: it is the more specific source.
    limit, bound_by, reported_binds = min(candidates, key=lambda c: (c[0], not c[2]))
    return EngineLimits(limit, limit, bound_by, reported_binds)


def vllm_limits(*, pool_tokens: int, max_model_len: int) -> EngineLimits:
    """vLLM's inclusive limits: prompt <= min(len, pool) - 1, prompt + output <= min."""
    decode = min(max_model_len, pool_tokens)
    bound: BoundBy = "pool" if pool_tokens < max_model_len else "context"
    return EngineLimits(decode - 1, decode, bound)


def static_limits(capacity_tokens: int) -> EngineLimits:
    return EngineLimits(capacity_tokens, capacity_tokens, "declared")


@dataclass(frozen=True)
class Limits:
    """What admission enforces right now, and why. Cheap to copy; never mutated."""

    admission_limit_tokens: int | None
    decode_limit_tokens: int | None
    source: Source
    known: bool
    why: str
    binding_engine: str | None = None
    declared_context: int | None = None
    decode_source: Source = "measured"
    decode_why: str = ""
    decode_binding_engine: str | None = None
    # Smallest measured (not declared) prefill/unified input limit, before margin.
    measured_limit_tokens: int | None = None
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
            "decode_limit_tokens": self.decode_limit_tokens,
            "decode_source": self.decode_source,
            "decode_why": self.decode_why,
            "decode_binding_engine": self.decode_binding_engine,
            "declared_context": self.declared_context,
            "measured_limit_tokens": self.measured_limit_tokens,
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
    adm: list[_Candidate] = []
    dec: list[_Candidate] = []
    capacities: list[tuple[int, EngineMeasurement]] = []
    for m in measurements:
        declared = m.source == "declared"
        if m.role in _ADMISSION_ROLES:
            adm.append(_Candidate(m.input_limit_tokens, m.limit_phrase(), m.engine, declared))
            if not declared:
                cap = (
                    m.pool_tokens
                    if m.context_length is None
                    else min(m.pool_tokens, m.context_length)
                )
                capacities.append((cap, m))
        if m.role in _DECODE_ROLES and m.decode_limit_tokens is not None:
            dec.append(_Candidate(m.decode_limit_tokens, m.limit_phrase(), m.engine, declared))

    measured = [c.tokens for c in adm if not c.declared]
    measured_limit = min(measured) if measured else None
    warnings: list[str] = []
    if max_context is not None and capacities:
        cap, m = min(capacities, key=lambda x: x[0])
        if max_context > cap:
            # The incident's misconfiguration: the declared context promises more than
            # the pool holds. Both numbers, so operators can act on the line alone.
            warnings.append(
                f"declared context {max_context:,} (KVPROXY_MAX_CONTEXT) exceeds what "
                f"{m.engine} holds ({cap:,} tokens: {m.pool_source}); admission uses the "
                f"measured limit {measured_limit:,}"
            )

    unknown_labels = tuple(sorted(unknown))
    if unknown and fallback_limit_tokens is None:
        return Limits(
            None,
            None,
            "measured",
            False,
            f"no fresh capacity measurement of {', '.join(unknown_labels)}",
            declared_context=max_context,
            measured_limit_tokens=measured_limit,
            margin_tokens=margin_tokens,
            unknown_engines=unknown_labels,
            warnings=tuple(warnings),
        )
    fallback_used = bool(unknown)
    if fallback_limit_tokens is not None:
        phrase = "configured fallback limit (KVPROXY_CAPACITY_FALLBACK_LIMIT_TOKENS)"
        for label, role in unknown.items():
            fb = _Candidate(
                fallback_limit_tokens, f"{phrase} for unmeasured {label}", label, True, True
            )
            if role in _ADMISSION_ROLES:
                adm.append(fb)
            if role in _DECODE_ROLES:
                dec.append(fb)
    if max_context is not None:
        adm.append(_Candidate(max_context, "declared context (KVPROXY_MAX_CONTEXT)", None, True))

    if not adm:
        return Limits(
            None,
            None,
            "measured",
            False,
            "no prefill or unified engine is configured and KVPROXY_MAX_CONTEXT is unset",
            declared_context=max_context,
            margin_tokens=margin_tokens,
            unknown_engines=unknown_labels,
            warnings=tuple(warnings),
        )

    def source_of(cands: Sequence[_Candidate]) -> Source:
        # A fallback standing in for a missing measurement makes the whole limit
        # declared: it is no longer backed by what every engine reported.
        if any(c.fallback for c in cands) or all(c.declared for c in cands):
            return "declared"
        return "measured"

    best = _pick(adm)
    decode_best = _pick(dec) if dec else None
    return Limits(
        admission_limit_tokens=max(0, best.tokens - margin_tokens),
        decode_limit_tokens=(
            max(0, decode_best.tokens - margin_tokens) if decode_best is not None else None
        ),
        source=source_of(adm),
        known=True,
        why=best.phrase + _margin_phrase(margin_tokens),
        binding_engine=best.engine,
        declared_context=max_context,
        decode_source=source_of(dec) if dec else "measured",
        decode_why=(
            decode_best.phrase + _margin_phrase(margin_tokens)
            if decode_best is not None
            else "no decode or unified engine is configured: the decode budget is not checked"
        ),
        decode_binding_engine=decode_best.engine if decode_best is not None else None,
        measured_limit_tokens=measured_limit,
        margin_tokens=margin_tokens,
        unknown_engines=unknown_labels,
        fallback_used=fallback_used,
        warnings=tuple(warnings),
    )
