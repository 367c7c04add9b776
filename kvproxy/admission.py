"""The admission decision, sans-IO: a prompt count and the current limits in, a verdict out.

Owns invariants I1 (never admit above the limit: only a guaranteed bound or an exact count
may admit), I3 (unknown capacity refuses) and I4 (prompt + requested output must fit the
decode pool). It never tokenizes, never touches a socket and never sees prompt text: the
handler feeds it numbers. `kvproxy check` uses the same function for its boundary verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from kvproxy import errors
from kvproxy.errors import KvproxyError

CountMethod = Literal["bound", "exact", "engine"]


class LimitsView(Protocol):
    """What admission needs from the capacity monitor's `Limits`."""

    @property
    def known(self) -> bool: ...
    @property
    def admission_limit_tokens(self) -> int | None: ...
    @property
    def decode_limit_tokens(self) -> int | None: ...
    @property
    def decode_prompt_limit_tokens(self) -> int | None: ...
    @property
    def source(self) -> str: ...
    @property
    def why(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Policy:
    decode_policy: Literal["reject", "clamp"] = "reject"
    # Output assumed when the request names none: decode must hold at least one new token.
    default_output_tokens: int = 1


@dataclass(frozen=True, slots=True)
class PromptCount:
    tokens: int  # largest per-sequence count used for the decision
    method: CountMethod
    exact: bool  # False: `tokens` is a guaranteed upper bound
    output_tokens: int | None  # requested max output per sequence, None if unset
    n: int  # parallel samples per sequence
    param: str  # request field the prompt came from, for the error body
    # Sum over every sequence of the batch (None: one sequence, == tokens). Not a limit
    # check (engines check each sequence alone); carried for the in-flight budget.
    total_tokens: int | None = None

    @property
    def total(self) -> int:
        return self.tokens if self.total_tokens is None else self.total_tokens


@dataclass(frozen=True, slots=True)
class Admit:
    prompt_tokens: int
    method: CountMethod
    # Set only under decode_policy=clamp when the request asked for more than fits.
    clamped_output_tokens: int | None = None
    # Prompt tokens over every sequence (== prompt_tokens for one); see budget.charge_tokens.
    total_tokens: int | None = None

    @property
    def total(self) -> int:
        return self.prompt_tokens if self.total_tokens is None else self.total_tokens


@dataclass(frozen=True, slots=True)
class Reject:
    error: KvproxyError


Decision = Admit | Reject


def precheck(limits: LimitsView, retry_after_s: int, detail: str) -> Reject | None:
    """I3: before parsing or counting anything, refuse when capacity is unknown."""
    if not limits.known or limits.admission_limit_tokens is None:
        return Reject(errors.capacity_unknown(retry_after_s, detail))
    return None


def decide(count: PromptCount, limits: LimitsView, policy: Policy) -> Decision:
    limit = limits.admission_limit_tokens
    if not limits.known or limit is None:
        return Reject(errors.capacity_unknown(5, "no fresh measurement"))

    if count.tokens > limit:
        why = limits.why
        if not count.exact:
            why += "; counted by a byte bound, configure KVPROXY_TOKENIZER for exact counts"
        return Reject(
            errors.context_length_exceeded(count.tokens, limit, limits.source, count.param, why)
        )

    decode_limit = limits.decode_limit_tokens
    if decode_limit is None:
        return Admit(count.tokens, count.method, total_tokens=count.total)

    # I4: every sample keeps its own output pages on decode; the prompt's pages are held
    # once per sequence. Counting n x output is the conservative reading.
    # `decode_limit` is each engine's own arithmetic (kvproxy/capacity/limits.py): the
    # largest prompt + output it serves in full. SGLang (all versions) never refuses an
    # output its pool cannot hold, it lowers max_new_tokens silently
    # (scheduler.init_req_max_new_tokens), so refusing above this number refuses exactly
    # the requests whose output the engine would cut or, past the context check
    # (tokenizer_manager, >= in older builds, > in current ones: we keep >=), refuse.
    # vLLM refuses prompt + max_tokens > max_model_len itself.
    per_sample = count.output_tokens
    if per_sample is None:
        per_sample = policy.default_output_tokens
    needed_output = per_sample * max(count.n, 1)
    if count.tokens + needed_output <= decode_limit:
        return Admit(count.tokens, count.method, total_tokens=count.total)
    prompt_only = limits.decode_prompt_limit_tokens
    if needed_output == 0 and prompt_only is not None and count.tokens <= prompt_only:
        # No output asked: only the decode engines' input checks apply.
        return Admit(count.tokens, count.method, total_tokens=count.total)

    room = decode_limit - count.tokens
    if policy.decode_policy == "clamp" and room // max(count.n, 1) >= 1:
        clamped = room // max(count.n, 1)
        return Admit(count.tokens, count.method, clamped, total_tokens=count.total)
    return Reject(
        errors.decode_budget_exceeded(count.tokens, needed_output, decode_limit, limits.source)
    )
