"""The admission decision, sans-IO: a prompt count, the request's shape and the current
limits in, a verdict out.

Owns invariants I1 (never admit above the limit: only a guaranteed bound or an exact count
may admit), I3 (unknown capacity refuses) and I4 (prompt + requested output must fit the
decode pool). It never tokenizes, never touches a socket and never sees prompt text: the
handler feeds it numbers and executes what it returns. `kvproxy check` uses the same rules
for its boundary verdicts.

One request, in the handler's order (h11-style: events in, decisions out):

    limits_known(limits)                          I3 before parsing: asked of each cluster
                                                  (none known: 503 capacity_unknown)
    count_ceiling(shape, limits, policy)          the largest count `decide` admits: the
                                                  counter tokenizes exactly above it
    charge_ceiling(budget_max_tokens, shape)      the largest batch total the budget lends
    decide(count, shape, limits, policy)          Admit (maybe with a clamped output) | Reject
    recheck(admit, limits, policy)                after queueing for budget: the same
                                                  decision on today's limits

`count_ceiling` and `decide` read the same arithmetic (`_decode_room`), so "the bound is
under the ceiling" and "decide admits the bound" cannot drift apart. I1 is checked against
the input-only limit (`input_limit_tokens`: what the admitting engines take with no output);
a prompt refused because not even one output token would fit is refused as too long, naming
the published limit (`admission_limit_tokens`), the number every surface shows.
"""

from __future__ import annotations

from typing import Literal, Protocol

from kvproxy.policy import errors
from kvproxy.policy.counts import CountMethod, TokenCount
from kvproxy.policy.errors import KvproxyError
from kvproxy.policy.records import record


class LimitsView(Protocol):
    """What admission needs from the capacity monitor's `Limits`."""

    @property
    def known(self) -> bool: ...
    @property
    def admission_limit_tokens(self) -> int | None: ...  # published: with one output token
    @property
    def input_limit_tokens(self) -> int | None: ...  # with no output; None: as published
    @property
    def input_source(self) -> str: ...
    @property
    def input_why(self) -> str: ...
    @property
    def decode_limit_tokens(self) -> int | None: ...
    @property
    def decode_prompt_limit_tokens(self) -> int | None: ...
    @property
    def source(self) -> str: ...
    @property
    def why(self) -> str: ...


class ShapeView(Protocol):
    """What admission needs from a parsed request (`prompt.PromptShape`): no text."""

    @property
    def max_output_tokens(self) -> int | None: ...  # per sample; None: the request names none
    @property
    def n(self) -> int: ...  # parallel samples per sequence
    @property
    def prompt_param(self) -> str: ...  # the request field the prompt came from
    @property
    def generates(self) -> bool: ...  # False: embeddings, rerank...: I1 applies, I4 not


@record
class Policy:
    decode_policy: Literal["reject", "clamp"] = "reject"
    # Output assumed when the request names none: decode must hold at least one new token.
    default_output_tokens: int = 1


@record
class Admit:
    count: TokenCount
    shape: ShapeView
    # Set only under decode_policy=clamp when the request asked for more than fits.
    clamped_output_tokens: int | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.count.tokens

    @property
    def method(self) -> CountMethod:
        return self.count.method

    @property
    def total(self) -> int:
        """Prompt tokens over every sequence (== prompt_tokens for one); see
        budget.charge_tokens."""
        return self.count.total_tokens


@record
class Reject:
    error: KvproxyError


Decision = Admit | Reject


def limits_known(limits: LimitsView) -> bool:
    """I3's test: a fresh measurement with a published limit (the handler asks it of each
    cluster before parsing; none known is 503 capacity_unknown)."""
    return limits.known and limits.admission_limit_tokens is not None


@record
class _Room:
    """I4 for one request on one decode pool: which prompts fit, and how."""

    decode_limit: int
    needed_output: int  # per-sample output x samples
    n: int
    prompt_only: int | None  # the decode engines' input-only limit, when no output is asked
    clamp: bool
    # The largest prompt served with all the output it asked for: decode_limit -
    # needed_output (a field, read twice a request; a property is a Python call per read).
    full: int

    @property
    def ceiling(self) -> int:
        """The largest prompt admitted at all (in full, input-only, or clamped)."""
        best = self.full
        if self.needed_output == 0 and self.prompt_only is not None:
            best = max(best, self.prompt_only)
        if self.clamp:
            # A clamped output keeps at least one token per sample.
            best = max(best, self.decode_limit - self.n)
        return best


def _decode_room(shape: ShapeView, limits: LimitsView, policy: Policy) -> _Room | None:
    decode_limit = limits.decode_limit_tokens
    if decode_limit is None or not shape.generates:
        # Prompt-only routes generate nothing: only I1 applies.
        return None
    # I4: every sample keeps its own output pages on decode; the prompt's pages are held
    # once per sequence. Counting n x output is the conservative reading.
    per_sample = shape.max_output_tokens
    if per_sample is None:
        per_sample = policy.default_output_tokens
    n = max(shape.n, 1)
    # Positional, in the fields' order: keyword matching was half the cost of building
    # one, twice a request.
    needed = per_sample * n
    return _Room(
        decode_limit, needed, n, limits.decode_prompt_limit_tokens,
        policy.decode_policy == "clamp", decode_limit - needed,
    )  # fmt: skip


def _input_limit(limits: LimitsView) -> int | None:
    """I1's number: the largest prompt the admitting engines take with no output."""
    if limits.input_limit_tokens is None:
        return limits.admission_limit_tokens
    return limits.input_limit_tokens


def count_ceiling(shape: ShapeView, limits: LimitsView, policy: Policy) -> int:
    """The largest per-sequence count `decide` admits for this shape on these limits (0
    when it admits none), so the counter tokenizes exactly whenever its cheap bound would
    fail either check (I1 on prefill, I4 on decode)."""
    limit = _input_limit(limits) or 0
    room = _decode_room(shape, limits, policy)
    if room is not None:
        limit = min(limit, room.ceiling)
    return max(limit, 0)


def charge_ceiling(budget_max_tokens: int | None, shape: ShapeView) -> int | None:
    """The largest batch total the budget could ever lend, so the counter tokenizes exactly
    rather than refuse a batch whose summed bound, not its real size, is over the budget."""
    return None if budget_max_tokens is None else budget_max_tokens // max(shape.n, 1)


def _too_long(count: TokenCount, shape: ShapeView, limits: LimitsView) -> Reject:
    """The prompt alone is over what this request can be served with: the message names the
    published limit (the largest prompt with one output token) for a request that
    generates, the input-only limit for one that does not."""
    published = shape.generates and limits.decode_limit_tokens is not None
    limit = limits.admission_limit_tokens if published else _input_limit(limits)
    assert limit is not None  # decide() refused unknown limits first
    why = limits.why if published else (limits.input_why or limits.why)
    source = limits.source if published else limits.input_source
    if count.unverified:
        # The exact count was withheld (tokens.gate.verified): say which features forced the
        # bound, so the client can send a plain body and the operator can see why.
        why += "; " + errors.unverified_note(count.unverified, count.verified_for)
    elif not count.exact and not count.at_least:
        if count.method == "bound":
            why += "; counted by a byte bound, configure KVPROXY_TOKENIZER for exact counts"
        else:
            # The tokenizer counted, but what it counted was an upper estimate of the render
            # (the engine's /tokenize without the chat template): the template is missing.
            why += (
                "; an upper count: kvproxy does not know this model's chat template, "
                "configure KVPROXY_CHAT_TEMPLATE (or KVPROXY_TOKENIZER=hf:PATH) for exact counts"
            )
    return Reject(
        errors.context_length_exceeded(
            count.tokens,
            limit,
            source,
            shape.prompt_param,
            why,
            at_least=count.at_least,
            kind=count.kind,
            unverified=count.unverified,
        )
    )


def unmeasured() -> Reject:
    """The refusal of a request whose limits are not known when it is decided (they went
    stale while it was counted; I3)."""
    return Reject(errors.capacity_unknown(5, "no fresh measurement"))


def decide(count: TokenCount, shape: ShapeView, limits: LimitsView, policy: Policy) -> Decision:
    limit = _input_limit(limits)
    published = limits.admission_limit_tokens
    if not limits.known or limit is None or published is None:
        return unmeasured()

    if count.tokens > limit:
        return _too_long(count, shape, limits)

    room = _decode_room(shape, limits, policy)
    # `decode_limit` is each engine's own arithmetic (kvproxy/capacity/limits.py): the
    # largest prompt + output it serves in full. SGLang (all versions) never refuses an
    # output its pool cannot hold, it lowers max_new_tokens silently
    # (scheduler.init_req_max_new_tokens), so refusing above this number refuses exactly
    # the requests whose output the engine would cut or, past the context check
    # (tokenizer_manager, >= in older builds, > in current ones: we keep >=), refuse.
    # vLLM refuses prompt + max_tokens > max_model_len itself.
    if room is None or count.tokens <= room.full:
        return Admit(count, shape)
    if count.tokens > room.ceiling:
        if count.tokens > published:
            # Not even one output token fits: shortening the prompt is the only remedy,
            # and the message names the one published limit.
            return _too_long(count, shape, limits)
        return Reject(
            errors.decode_budget_exceeded(
                count.tokens,
                room.needed_output,
                room.decode_limit,
                limits.source,
                kind=count.kind,
                unverified=count.unverified,
            )
        )
    if (
        room.needed_output == 0
        and room.prompt_only is not None
        and count.tokens <= room.prompt_only
    ):
        # No output asked: only the decode engines' input checks apply.
        return Admit(count, shape)
    # Under the ceiling, not in full, not input-only: the clamp policy's share of the room.
    return Admit(count, shape, (room.decode_limit - count.tokens) // room.n)


def recheck(admit: Admit, limits: LimitsView, policy: Policy) -> Decision:
    """I1/I4 at send time: the limits can fall while a request queues for budget (an engine
    restarted onto a smaller pool), so the same decision is taken again on today's limits,
    on the count the first decision had (its exactness included)."""
    return decide(admit.count, admit.shape, limits, policy)


__all__ = [
    "Admit",
    "Decision",
    "LimitsView",
    "Policy",
    "Reject",
    "ShapeView",
    "charge_ceiling",
    "count_ceiling",
    "decide",
    "recheck",
    "unmeasured",
]


@record
class UsageCheck:
    """The engine's own prompt count (`usage.prompt_tokens`) against kvproxy's, after the
    fact. `drift`: engine minus kvproxy, when kvproxy's count was meant to be exact (a
    bound is expected to be above). `bound_exceeded`: the engine counted more than kvproxy
    did, exact or bound: the configured tokenizer does not match the model, an I1 risk."""

    drift: int | None
    bound_exceeded: bool


def check_usage(counted: int, method: str | None, engine_tokens: int) -> UsageCheck:
    drift = engine_tokens - counted if method in ("exact", "engine") else None
    return UsageCheck(drift=drift, bound_exceeded=engine_tokens > counted)
