"""TokenCounter: bound first, exact only when the bound does not already admit (I1).

For each sequence of a `PromptShape` the counter builds a plan: what the engine will
tokenize (the rendered chat template, or the raw strings), a guaranteed upper bound on its
tokens, and the fixed costs (token ids, configured image/audio costs, special tokens, the
measured template overhead when no template is known). The decision is a ladder of rungs,
declared once in `LADDER` at the end of this module (and rendered into docs/counting.md),
each a method of `Climb` (one request on its way): quick guarantee, walked guarantee,
replica bound, verified gate, plain render, exact count. In short:

  1. a guaranteed bound <= admit_at_most (and the tokenizer family has one): admit on the
     bound; nothing is tokenized. A plain chat's render comes from its shape's proven frame
     (`tokens.replica.frames`: the same string, with no jinja render), so a small chat far below
     the limit costs a dict walk; when that bound does not admit, the template is rendered
     plainly and the decision rests on that render;
  2. otherwise count exactly: fastokens / HF / tiktoken in worker threads that release the
     GIL, or the engine's `/tokenize`. A local count stops as soon as the decision is known
     (`exact.local.HfTokenizer._encode`): once the tokens counted so far exceed `admit_at_most`
     (`at_least`: the number is a lower bound, the prompt is rejected), or once they plus the
     byte bound of the rest fit (an upper bound, admitted). Admission needs the decision,
     not the number; the `X-Kvproxy-Prompt-Tokens-Kind` header says which the number is;
  3. no exact method configured (`bytes`): return the bound; the caller rejects on it.

The exact count admits only where its model is verified: before counting exactly, the
request's features (`tokens.gate.features`) are checked against the verified table for the
engines and router in front (`tokens.gate.verified.Verifier`). A request using any unverified
feature is decided by the guaranteed bound alone; its `TokenCount` names the features, so a
rejection says which one forced the bound. A tokenizer family with no guaranteed bound
cannot decide such a request at all: it is refused (`errors.unverified_unbounded`).

Failure is closed: a count that fails or outlives `count_timeout_s` raises
`count_unavailable` (503), never a guess. At most `count_concurrency` counts use threads or
the engine at once; a timed-out thread keeps its slot until it really ends, so abandoned
work cannot pile up behind the timeout.

The event loop only sees small requests (< INLINE_CHARS characters, few messages), which are
planned inline in well under a millisecond; a large request's rungs run in the worker
threads, consecutive ones in one hop (`tokens.ladder`), in window-sized C calls (`bounds`).
This module never logs prompt text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvproxy.policy import CHAT_ROUTES, CountMethod, KvproxyError, TokenCount, errors, record
from kvproxy.prompt import (
    MODELED_KEYS,
    RERANK_OVERHEAD_TOKENS,
    FieldPolicy,
    MediaPolicy,
    PromptShape,
    SequencePrompt,
    request_template,
)
from kvproxy.tokens import ladder
from kvproxy.tokens.bound import BoundRule, ChatGuarantee, bounds, text_tokens
from kvproxy.tokens.exact import (
    EarlyStopping,
    EngineTokenize,
    EngineTokenizeRequest,
    LocalTokenizer,
    Partial,
    client_chat_fields,
)
from kvproxy.tokens.gate import INERT_KEYS, Method, Verifier, request_features
from kvproxy.tokens.ladder import Rung
from kvproxy.tokens.replica import SPECIAL_TOKEN_KEYS, ChatTemplate, frames_for, reserialised_bytes

T = TypeVar("T")

# Shapes up to this many characters (and messages) are planned on the event loop: the worst
# case (an is_normalized over 16 K hostile characters) is ~2 ms, less than a thread hop.
INLINE_CHARS = 16_384
INLINE_MESSAGES = 64
# Bodies up to this many bytes get the O(1) guarantee on the loop (a few C-speed scans).
QUICK_BYTES = 65_536
# Special tokens a post-processor may add to a text sequence when the tokenizer is unknown
# (GLM-4 adds 2, Llama-3 1), plus one for a ByteLevel prefix space.
UNKNOWN_SPECIAL_TOKENS = 8
# Niceness of the counting threads (only ever raised: needs no privilege).
WORKER_NICE = 10


@record
class _Plan:
    seq: SequencePrompt
    chat: bool
    bound: int
    # Tokenized by an exact count: the rendered template's segments (one text), or the raw
    # strings (each its own text).
    texts: tuple[str, ...]
    # Each further engine normalisation's render (segments), when they differ: the count is
    # the largest (tokens.replica.chatnorm).
    others: tuple[tuple[str, ...], ...]
    rendered: bool
    # Added to any exact count: ids, media, specials, joins.
    fixed: int
    # Whether `count(texts) + fixed` is the engine's exact number.
    exact: bool
    # The render came from a proven frame (tokens.replica.frames), not from jinja: used to admit on
    # the bound only; a decision near the limit renders plainly (`Climb.plain_render`).
    framed: bool = False


@record
class _Verdict:
    """What the guarantee says of one request (TokenCounter._verdict)."""

    bound: int | None  # the guaranteed bound in tokens; None when none can be given
    unverified: tuple[str, ...]  # features the exact count may not admit
    where: str  # the engines and router the verified table was read for


class _WorkerFailed(Exception):
    """A tokenizer raised (or panicked) in a worker thread; carries only the type name."""


class TokenCounter:
    def __init__(
        self,
        *,
        bound_rule: BoundRule | None,
        template: ChatTemplate | None = None,
        local: LocalTokenizer | None = None,
        engine: EngineTokenize | None = None,
        special_tokens: int = UNKNOWN_SPECIAL_TOKENS,
        media: MediaPolicy | None = None,
        count_timeout_s: float = 10.0,
        count_concurrency: int = 2,
        description: str = "",
        backend: str | None = None,
        verifier: Verifier | None = None,
        fields: FieldPolicy | None = None,
    ) -> None:
        if local is not None and engine is not None:
            raise ValueError("a counter uses a local tokenizer or the engine, not both")
        # None: this tokenizer family has no guaranteed byte bound; never admit on it.
        self._trust_bound = bound_rule is not None
        self._rule: BoundRule = bound_rule or "nfc"
        self._template = template
        self._frames = frames_for(template)
        # The guaranteed bound of chat-like requests (tokens.bound.guarantee), proven once per
        # template; a string says why the template could not be proven.
        self._guarantee: ChatGuarantee | str | None = None
        if template is not None:
            self._guarantee = ChatGuarantee.build(
                template.source, bound_rule, special_tokens, template.special_tokens
            )
        self._local = local
        self._engine = engine
        self._specials = special_tokens
        # What media cost (prompt.media); without a processor, media are refused.
        self.media = media or MediaPolicy()
        self._timeout_s = count_timeout_s
        self._concurrency = count_concurrency
        self._sem = asyncio.Semaphore(count_concurrency)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=count_concurrency,
            thread_name_prefix="kvproxy-count",
            initializer=_lower_thread_priority,
        )
        self._description = description
        # None: every request's exact count may admit (tests that build a bare counter).
        self.verifier = verifier
        # Every top-level field classified for the engines in front (prompt.fields).
        self.fields = fields or FieldPolicy()
        self.method: CountMethod = "exact" if local else ("engine" if engine else "bound")
        # Off only in benchmarks that time a whole count (bench/decision_latency.py).
        self.early_stop = True
        # Which library counts (the kvproxy_tokenizer_backend gauge's label).
        self.backend = backend or str(
            getattr(local, "backend", "local") if local else ("engine" if engine else "bytes")
        )

    def describe(self) -> str:
        """One line for the start-up log."""
        template = (self._template.origin or "configured") if self._template else "none"
        head = {
            "bound": self._description
            or "bytes: UTF-8 byte bound only (NFC rule, + template overhead); safe, but "
            "it rejects some legal prompts near the limit. Configure hf:PATH, tiktoken:PATH "
            "or engine for exact counts",
            "exact": f"exact counts with {self._description}",
            "engine": f"exact counts with {self._description}",
        }[self.method]
        g = self._guarantee
        proven = (
            "none" if g is None else (g.describe() if isinstance(g, ChatGuarantee) else
                                      f"unproven ({g})")
        )  # fmt: skip
        return (
            f"{head}; chat template: {template}; admit on bound: {self._trust_bound}; "
            f"chat guarantee: {proven}; "
            f"timeout {self._timeout_s:g} s; concurrency {self._concurrency}"
        )

    async def aclose(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def count(
        self, shape: PromptShape, admit_at_most: int, total_at_most: int | None = None
    ) -> TokenCount:
        """`decide` with the limits spelled out (what the proxy calls)."""
        return await self.decide(shape, Limits(admit_at_most, total_at_most))

    async def decide(self, shape: PromptShape, limits: Limits) -> TokenCount:
        """Decide `shape` against `limits` by climbing LADDER until a rung decides:
        tokenizing only if the largest bound is over `admit_at_most` or the bounds' sum over
        `total_at_most` (the budget's room).

        Raises `invalid_request` (the chat template refuses the messages) or
        `count_unavailable` (timeout, tokenizer or engine failure).
        """
        verifier = self.verifier
        engines = verifier.engines if verifier is not None else ()
        own_template = self.fields.check(shape.route, shape.body, engines)
        if _may_hold_media(shape):
            # A copy: the handler's shape stays as parsed (only media requests pay for it).
            shape = dataclasses.replace(
                shape, media_tokens=self.media.cost(shape.body, shape.route)
            )
        if own_template:
            return await self._count_own_template(shape, limits.admit_at_most)
        return await self.climb(Climb(self, shape, limits))

    async def climb(
        self, attempt: Climb, rungs: Sequence[Rung[Climb, TokenCount]] | None = None
    ) -> TokenCount:
        """Run `rungs` (LADDER) for `attempt` (tokens.ladder: worker stretches in one hop).

        The leading loop rungs run outside the timeout: when one decides, nothing was
        awaited for a timeout to bound (entering one costs ~4 us per request)."""
        rungs = LADDER if rungs is None else rungs
        inline, start = ladder.inline(rungs, attempt)
        if inline is not None:
            return inline
        try:
            async with asyncio.timeout(self._timeout_s):
                decided = await ladder.climb(rungs[start:], attempt, self._offload)
        except TimeoutError:
            raise errors.count_unavailable(f"over {self._timeout_s:g} s") from None
        except _WorkerFailed as exc:
            raise errors.count_unavailable(f"tokenizer failed: {exc}") from None
        # The ladder's last rungs always decide (`bytes` at the replica bound).
        assert decided is not None, "no rung decided"
        return decided

    # --- a request's own chat template (prompt.fields, trust_request_chat_template) ---------

    async def _count_own_template(self, shape: PromptShape, admit_at_most: int) -> TokenCount:
        """A body bringing its own template (allowed by the operator): bounded by the same
        proof run over THAT template, never by the configured one, and decided on that
        bound alone (no replica renders it). Proved in a worker under `count_timeout_s`,
        like every count; a template over MAX_REQUEST_TEMPLATE_BYTES is refused unproven."""
        source = request_template(shape.body)
        assert source is not None
        specials = self._template.special_tokens if self._template is not None else {}
        why: str | None = None
        bound: int | None = None
        if len(source.encode("utf-8", "surrogatepass")) > MAX_REQUEST_TEMPLATE_BYTES:
            why = f"it is over {MAX_REQUEST_TEMPLATE_BYTES:,} bytes"
        else:
            try:
                async with asyncio.timeout(self._timeout_s):
                    bound, why = await self._offload(
                        _own_template_bound,
                        source,
                        self._rule if self._trust_bound else None,
                        self._specials,
                        specials,
                        shape,
                        shape.media_tokens,
                    )
            except TimeoutError:
                raise errors.count_unavailable(f"over {self._timeout_s:g} s") from None
            except _WorkerFailed as exc:
                raise errors.count_unavailable(f"template proof failed: {exc}") from None
        if bound is None:
            raise errors.unverified_unbounded(
                ["chat_template"],
                "the request's own chat template",
                "chat_template",
                because=f"that template could not be proven ({why or 'no byte bound'})",
            )
        return TokenCount(
            bound,
            "bound",
            exact=False,
            total_tokens=bound,
            bound=bound,
            unverified=("chat_template",),
            verified_for="the request's own chat template",
        )

    # --- what the rungs ask of the counter ----------------------------------------------------

    def _guarantee_first(self, shape: PromptShape) -> bool:
        """Whether this request is decided by the guarantee before any replica render: every
        chat-like request when a template is configured, and a prompt-only request with a
        field kvproxy's parser does not model (its text may be prompt text too)."""
        if shape.route in CHAT_ROUTES:
            return self._template is not None
        return bool(unmodeled_keys(shape))

    def _guaranteed_bound(self, shape: PromptShape, admit_at_most: int) -> int | None:
        """The guaranteed bound in tokens (None: none can be given): the O(1) bound when it
        already admits, else the walk over every field."""
        media = shape.media_tokens
        g = self._guarantee
        if shape.route not in CHAT_ROUTES:
            rule = self._rule if self._trust_bound else None
            text = text_tokens(shape.body, rule, self._specials + RERANK_OVERHEAD_TOKENS)
            if text is not None and isinstance(g, ChatGuarantee) and "messages" in shape.body:
                # vLLM's pooling routes render `messages` with the chat template.
                chat = g.tokens(shape.body, "pool", media)
                return None if chat is None else max(text, chat)
            return text
        if not isinstance(g, ChatGuarantee):
            return None
        if len(shape.raw) <= QUICK_BYTES or not shape.body:
            quick = g.quick(shape.raw, shape.body, shape.route) if shape.raw else None
            if quick is not None and quick <= admit_at_most:
                return quick
        return g.tokens(shape.body, shape.route, media)

    def _verdict(self, shape: PromptShape, admit_at_most: int) -> _Verdict:
        """The guaranteed bound, and (unless it admits) the features the exact count is not
        verified for: both read every field, so large requests get them in a worker.

        A chat whose strings alone are longer than the limit skips the walk when its
        features are verified: the bound could not admit it, and the exact count decides
        (the walk over a 400 KB non-ASCII message costs ~15x its count)."""
        skip = self._walk_cannot_admit(shape, admit_at_most)
        g = None if skip else self._guaranteed_bound(shape, admit_at_most)
        if g is not None and g <= admit_at_most and self._trust_bound:
            return _Verdict(g, (), "")
        unverified: tuple[str, ...] = ()
        where = ""
        if self.verifier is not None:
            features = request_features(shape.route, shape.body)
            unverified = tuple(self.verifier.unverified(features, self._count_method(shape)))
            where = self.verifier.describe()
        if shape.route not in CHAT_ROUTES:
            # A field the parser does not model may be prompt text: never exact.
            unverified = (*unverified, "unknown:body")
        if skip and unverified:
            # The bound decides this one after all: it must be the walk's.
            g = self._guaranteed_bound(shape, admit_at_most)
        return _Verdict(g, unverified, where)

    def _walk_cannot_admit(self, shape: PromptShape, admit_at_most: int) -> bool:
        """Whether the guaranteed bound surely exceeds `admit_at_most`, known in O(1): a
        chat's bound charges at least one token per byte (so per character) of the strings
        the shape holds, and an exact count is configured to decide instead.

        Only ever saves work: were it wrong, the exact count would decide a request the
        bound could have admitted, which I1 allows."""
        return (
            self.method != "bound"
            and shape.route in CHAT_ROUTES
            and max((p.text_chars for p in shape.prompts), default=0) > admit_at_most
        )

    def _bound_decision(
        self, plans: list[_Plan], admit_at_most: int, total_at_most: int | None
    ) -> TokenCount | None:
        """The decision on the plans' bounds alone, or None: an exact count is needed."""
        if len(plans) == 1:  # the common case, without two generators
            bound = total = plans[0].bound
        else:
            bound = max(p.bound for p in plans)
            total = sum(p.bound for p in plans)
        fits = bound <= admit_at_most and (total_at_most is None or total <= total_at_most)
        if (self._trust_bound and fits) or self.method == "bound":
            # TokenCount(tokens, method, exact, total_tokens, bound)
            return TokenCount(bound, "bound", False, total, bound)
        return None

    def _count_method(self, shape: PromptShape) -> Method:
        """How an exact count of this shape would be made: vLLM's /tokenize renders a chat
        from the client's own fields; everything else is kvproxy's replica render."""
        engine = self._engine
        if engine is not None and engine.accepts_messages and shape.route == "chat":
            return "engine"
        return "replica"

    def _rendered_plainly(self, plans: list[_Plan]) -> list[_Plan]:
        """The plans with each frame's render replaced by the template's own: near the limit
        the decision rests on it. Their frames' bounds did not admit, so the renders' own
        need not be scanned again (`loose`); a chat plan's fixed part is its media cost."""
        return [
            self._plan_chat(p.seq, framed=False, loose=True, media=p.fixed) if p.framed else p
            for p in plans
        ]

    def _exact_decision(self, plans: list[_Plan], counted: list[Partial]) -> TokenCount:
        """The decision on the exact counts of `plans`' sequences (local or the engine's)."""
        bound = max(p.bound for p in plans)
        over = [c.tokens for c in counted if c.kind == "lower"]
        if over:
            # Some sequence is over the limit: the max is too, whatever the others hold.
            return TokenCount(
                max(over),
                self.method,
                False,
                total_tokens=sum(c.tokens for c in counted),
                bound=bound,
                at_least=True,
            )
        return TokenCount(
            max(c.tokens for c in counted),
            self.method,
            all(c.kind == "exact" for c in counted),
            total_tokens=sum(c.tokens for c in counted),
            bound=bound,
        )

    async def _offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` in a worker; the concurrency slot is held until the thread really ends."""
        await self._sem.acquire()
        loop = asyncio.get_running_loop()
        try:
            cfut = self._executor.submit(_in_worker, fn, *args)
        except BaseException:
            self._sem.release()
            raise
        cfut.add_done_callback(functools.partial(_release_from_thread, loop, self._sem))
        return await asyncio.wrap_future(cfut)

    # --- plans (sync: on the loop for small shapes, else in a worker) -----------------------

    def _plan(self, shape: PromptShape, framed: bool = True, loose: bool = False) -> list[_Plan]:
        chat = shape.route in CHAT_ROUTES
        # Each sequence is charged the request's whole media cost: a batch's sequences share
        # its media (SGLang's image_data), and more is safe.
        media = shape.media_tokens
        return [
            self._plan_chat(s, framed, loose, media) if chat else self._plan_text(s, media)
            for s in shape.prompts
        ]

    def _plan_text(self, seq: SequencePrompt, media: int = 0) -> _Plan:
        specials = self._specials if seq.texts else 0
        fixed = seq.token_ids + media + specials
        # +1 per text: a ByteLevel pre-tokenizer may prepend a space.
        bound = bounds.texts_bound(seq.texts, self._rule) + len(seq.texts) + fixed
        exact = len(seq.texts) <= 1 and not (seq.images or seq.audios)
        return _Plan(seq, False, bound, seq.texts, (), False, fixed, exact)

    def _plan_chat(
        self, seq: SequencePrompt, framed: bool = True, loose: bool = False, media: int = 0
    ) -> _Plan:
        """`loose`: the caller knows the bound cannot admit (an exact count decides), so the
        render's bound is the O(1) `bounds.loose_bound` instead of a scan of every byte.
        `media`: the request's media cost (prompt.media)."""
        segments = self._frames.render(seq) if framed and self._frames is not None else None
        if segments is not None:
            # A plain chat: the frame filled with its contents IS the render
            # (tokens.replica.frames).
            bound = bounds.segments_bound(segments, self._rule) + media
            return _Plan(seq, True, bound, segments, (), True, media, media == 0, framed=True)
        if self._template is not None:
            # One render per distinct engine normalisation; plain role/content chats on a
            # "string"-format template (the common case) have exactly one.
            first, *others = self._template.render_all(seq)
            measure = bounds.loose_bound if loose else bounds.segments_bound
            bound = max(measure(r, self._rule) for r in (first, *others)) + media
            return _Plan(seq, True, bound, first, tuple(others), True, media, media == 0)
        texts = (*seq.texts, seq.template_kwargs_json)
        tools = bounds.text_bound(seq.tools_json, self._rule) if seq.tools else None
        overhead = bounds.chat_overhead_bound(seq.message_count, tools) + _unseen_bytes(seq)
        bound = bounds.texts_bound(texts, self._rule) + overhead + media
        return _Plan(seq, True, bound, texts, (), False, media, False)

    # --- exact counts ---------------------------------------------------------------------

    def _exact_local(self, plans: list[_Plan], admit_at_most: int) -> list[Partial]:
        local = self._local
        assert local is not None
        out: list[Partial] = []
        for p in plans:
            # Tokens added to the tokenizer's count; known up front except for a chat
            # without its template (its overhead depends on the tools' count).
            added: int | None = p.fixed
            if p.chat and not p.rendered:
                added = None
            elif not p.chat and p.texts:
                # The plan charged the unknown-tokenizer specials; use this tokenizer's own.
                added = p.fixed + local.special_tokens - self._specials
            budget = admit_at_most - added if added is not None and self.early_stop else None
            got = self._local_count(local, p, budget)
            n = got.tokens + (p.fixed if added is None else added)
            if added is None:
                tools = local.count((p.seq.tools_json,))[0] if p.seq.tools else None
                n += bounds.chat_overhead_bound(p.seq.message_count, tools)
                n += _unseen_bytes(p.seq)
            exact = p.exact and (p.chat or getattr(local, "special_tokens_exact", True))
            kind = got.kind if exact or got.kind == "lower" else "upper"
            out.append(Partial(n, kind))
            if kind == "lower":
                break  # the request is over the limit: the other sequences cannot change it
        return out

    @staticmethod
    def _local_count(local: LocalTokenizer, p: _Plan, budget: int | None) -> Partial:
        """Count the plan's texts, stopping once over (or surely within) `budget`."""
        early = local if isinstance(local, EarlyStopping) else None
        if p.rendered:
            # Every engine normalisation's render counts; the largest is the engine's.
            parts = []
            for render in (p.texts, *p.others):
                if early is not None and budget is not None:
                    parts.append(early.count_segments_until(render, budget))
                else:
                    n, exact = local.count_segments(render)
                    parts.append(Partial(n, "exact" if exact else "upper"))
            return _largest(parts)
        if early is not None and budget is not None:
            return early.count_until(p.texts, budget)
        n, exact = local.count(p.texts)
        return Partial(n, "exact" if exact else "upper")

    async def _exact_engine(self, plan: _Plan, shape: PromptShape) -> tuple[int, bool]:
        engine = self._engine
        assert engine is not None
        try:
            if plan.chat and self._count_method(shape) == "engine":
                # The engine normalises and renders the chat itself: it gets the client's
                # own fields, so the count is the engine's by construction (tokens.exact.engine).
                req = EngineTokenizeRequest(fields=client_chat_fields(shape.body))
                return await engine(req) + plan.fixed, plan.fixed == 0
            if not plan.chat:
                counts = [
                    await engine(EngineTokenizeRequest(prompt=t, add_special_tokens=True))
                    for t in plan.texts
                ]
                # The engine adds its own special tokens: drop the plan's allowance for them.
                specials = self._specials if plan.texts else 0
                return sum(counts) + plan.fixed - specials, plan.exact
            if plan.rendered:
                counts = []
                for render in (plan.texts, *plan.others):
                    # Joining a multi-megabyte render is a long GIL-holding copy: not on the loop.
                    prompt = await asyncio.to_thread("".join, render)
                    req = EngineTokenizeRequest(prompt=prompt, add_special_tokens=False)
                    counts.append(await engine(req))
                return max(counts) + plan.fixed, plan.exact
            if engine.accepts_messages:
                # The engine normalises the messages itself: send them as the client did.
                seq = plan.seq
                req = EngineTokenizeRequest(
                    messages=list(seq.messages),
                    tools=list(seq.tools) if seq.tools else None,
                    add_generation_prompt=seq.add_generation_prompt,
                    chat_template_kwargs=seq.template_kwargs or None,
                )
                return await engine(req) + plan.fixed, plan.fixed == 0
            return await self._engine_fields(engine, plan), False
        except (KvproxyError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise _WorkerFailed(type(exc).__name__) from None

    async def _engine_fields(self, engine: EngineTokenize, plan: _Plan) -> int:
        """No template and no messages support: fields counted by the engine + overhead."""
        seq = plan.seq
        joined = "\n".join(t for t in plan.texts if t)
        n = await engine(EngineTokenizeRequest(prompt=joined, add_special_tokens=False))
        tools = None
        if seq.tools:
            req = EngineTokenizeRequest(prompt=seq.tools_json, add_special_tokens=False)
            tools = await engine(req)
        return n + bounds.chat_overhead_bound(seq.message_count, tools) + plan.fixed


# A request's own chat template is proven per request (in a worker); the configured one once.
MAX_REQUEST_TEMPLATE_BYTES = 65_536


def _own_template_bound(
    source: str,
    rule: BoundRule | None,
    special_tokens: int,
    specials: dict[str, str],
    shape: PromptShape,
    media_tokens: int,
) -> tuple[int | None, str | None]:
    """The bound of `shape` under its own template: (tokens, None) or (None, why)."""
    g = ChatGuarantee.build(source, rule, special_tokens, specials)
    if isinstance(g, str):
        return None, g
    route = shape.route if shape.route in CHAT_ROUTES else "pool"
    return g.tokens(shape.body, route, media_tokens), None


def unmodeled_keys(shape: PromptShape) -> list[str]:
    """Top-level fields of a prompt-only request that kvproxy's parser neither counts nor
    knows to be inert (vLLM's /v1/score reads text_1/text_2 beside SGLang's query/items)."""
    known = MODELED_KEYS.get(shape.route)
    if known is None:
        return []
    return [k for k in shape.body if k not in known and k not in INERT_KEYS]


# Bytes whose absence shows a body holds no media part and no media setting: every media part
# type and media field names one of them (prompt.media), except the dynamic-patch settings.
_MEDIA_MARKERS = (b"image", b"video", b"audio", b"mm_processor", b"media_io")


# Above this many body bytes the scans cost more than prompt.media's walk of a body with few
# values (5 scans of a 4 MB prompt: ~20 ms of one core, on the event loop; the walk of a chat
# of a few messages: ~10 us).
_SCAN_BYTES = 65_536
_FEW_VALUES = 4_096


def _may_hold_media(shape: PromptShape) -> bool:
    """Whether prompt.media must look at this request (a few C-speed scans otherwise; a
    large body of few values is walked instead, which is cheaper than scanning its bytes)."""
    raw = shape.raw
    if not raw or (len(raw) > _SCAN_BYTES and _few_values(shape.body, _FEW_VALUES)):
        return True
    return any(m in raw for m in _MEDIA_MARKERS) or any(
        k in shape.body for k in ("max_dynamic_patch", "min_dynamic_patch")
    )


def _few_values(body: Any, most: int) -> bool:
    """Whether the parsed body holds at most `most` JSON values (stops counting past it)."""
    pending = [body]
    seen = 0
    while pending:
        value = pending.pop()
        seen += 1
        if seen > most:
            return False
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return True


def _small(shape: PromptShape) -> bool:
    """Planned on the loop: few characters and few messages (INLINE_CHARS, INLINE_MESSAGES)."""
    prompts = shape.prompts
    if len(prompts) == 1:  # the common case, without a generator
        p = prompts[0]
        return p.text_chars <= INLINE_CHARS and p.message_count <= INLINE_MESSAGES
    return shape.text_chars <= INLINE_CHARS and all(
        p.message_count <= INLINE_MESSAGES for p in prompts
    )


def _unseen_bytes(seq: SequencePrompt) -> int:
    """Template-free bound: what the raw strings in `seq.texts` do not cover.

    Special-token overrides in chat_template_kwargs may be printed once per message and once
    around them (transformers lets them replace bos_token and the like); tool-call
    arguments are parsed by both engines and printed re-serialised (", " and ": "
    separators, ASCII escapes or Python's repr of the parsed value), which can be longer
    than the string the client sent (counted once in `texts`)."""
    extra = 0
    for key in SPECIAL_TOKEN_KEYS if seq.template_kwargs else ():
        if key in seq.template_kwargs:
            value = bounds.utf8_len(str(seq.template_kwargs[key]))
            extra += 3 * value * (seq.message_count + 1)
    for m in seq.messages:
        calls = m.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            fn = call.get("function") if isinstance(call, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if isinstance(args, str) and args:
                extra += bounds.TOOLS_INDENT_FACTOR * reserialised_bytes(args)
    return extra


def _in_worker(fn: Callable[..., T], *args: Any) -> T:
    """`fn` in a worker: a tokenizer's failure becomes a _WorkerFailed naming its type."""
    try:
        return fn(*args)
    except KvproxyError:
        raise
    except BaseException as exc:  # tiktoken panics are BaseException, not Exception
        raise _WorkerFailed(type(exc).__name__) from None


def _lower_thread_priority() -> None:
    """Workers yield the CPU to the event loop thread (Linux: nice applies per thread).

    On a 2-core pod a busy count thread otherwise shares a core with the loop and the
    scheduler can hold the loop back for a whole time slice (measured: 15-40 ms ticks).
    """
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)


def _release_from_thread(
    loop: asyncio.AbstractEventLoop, sem: asyncio.Semaphore, _: object
) -> None:
    # A closed loop has nobody waiting any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(sem.release)


def _largest(parts: list[Partial]) -> Partial:
    """The largest of several renders' counts. One over the budget (a lower bound) decides
    alone; otherwise the max, exact only if every count was (an upper bound of one render
    still bounds the largest)."""
    over = [q for q in parts if q.kind == "lower"]
    if over:
        return max(over, key=lambda q: q.tokens)
    exact = all(q.kind == "exact" for q in parts)
    return Partial(max(q.tokens for q in parts), "exact" if exact else "upper")


# --- the ladder ---------------------------------------------------------------------------


@record
class Limits:
    """What a count is decided against: the largest sequence's ceiling, and the room for
    the request's sequences together (the budget's; None: no such bound)."""

    admit_at_most: int
    total_at_most: int | None = None


class Climb:
    """One request on the ladder: the counter deciding it, the request and its limits, and
    what the rungs learn on the way (the plans). Each rung is a method, testable alone;
    LADDER says in which order they run, when each applies and where."""

    __slots__ = (
        "admit_at_most",
        "counter",
        "guarantee_first",
        "plans",
        "shape",
        "small",
        "total_at_most",
    )

    def __init__(self, counter: TokenCounter, shape: PromptShape, limits: Limits) -> None:
        self.counter = counter
        self.shape = shape
        self.admit_at_most = limits.admit_at_most
        self.total_at_most = limits.total_at_most
        # Planned on the loop: few characters and few messages (INLINE_CHARS, INLINE_MESSAGES).
        self.small = _small(shape)
        self.guarantee_first = counter._guarantee_first(shape)
        # Each sequence's plan, once the replica bound has made them.
        self.plans: list[_Plan] = []

    # --- when each rung applies (known before the climb: config and size only) -------------

    def quick_applies(self) -> bool:
        """Sized by the body's bytes, not the shape's characters (summing those was a sixth
        of the quick rung): a string has no more characters than its JSON bytes."""
        c = self.counter
        return (
            c._trust_bound
            and type(c._guarantee) is ChatGuarantee
            and self.shape.route in CHAT_ROUTES
            and 0 < len(self.shape.raw) <= INLINE_CHARS
        )

    def gate_applies(self) -> bool:
        # A request the guarantee saw first had its unverified features withheld there.
        c = self.counter
        return not self.guarantee_first and c.verifier is not None and c.method != "bound"

    def render_applies(self) -> bool:
        return self.counter._frames is not None and self.shape.route in CHAT_ROUTES

    # --- the rungs ---------------------------------------------------------------------------

    def quick_guarantee(self) -> TokenCount | None:
        """The common case: a small chat its O(1) guarantee admits. The walked guarantee
        would answer the same (tests/tokens/test_tokens_counter.py holds the two to it) and
        runs the same O(1) bound first; here it needs none of the walk's set-up."""
        g = self.counter._guarantee
        assert isinstance(g, ChatGuarantee)
        shape = self.shape
        bound = g.quick(shape.raw, shape.body, shape.route)
        total = self.total_at_most
        if bound is None or bound > self.admit_at_most or (total is not None and bound > total):
            return None
        # TokenCount(tokens, method, exact, total_tokens, bound), positionally: this runs for
        # most requests, and matching keywords costs more than the rest of building it.
        return TokenCount(bound, "bound", False, bound, bound)

    def walked_guarantee(self) -> TokenCount | None:
        """Admit on the guarantee when it fits; decide on it alone when the request uses a
        feature the exact count is not verified for; else None: the replica decides."""
        c, shape = self.counter, self.shape
        verdict = c._verdict(shape, self.admit_at_most)
        g = verdict.bound
        total = self.total_at_most
        fits = g is not None and g <= self.admit_at_most and (total is None or g <= total)
        if g is not None and fits and c._trust_bound:
            return TokenCount(g, "bound", exact=False, total_tokens=g, bound=g)
        if not verdict.unverified:
            return None
        if g is None:
            reason = c._guarantee
            because = (
                f"its chat template could not be proven ({reason})"
                if isinstance(reason, str)
                else None
            )
            raise errors.unverified_unbounded(
                list(verdict.unverified),
                verdict.where or "these engines",
                shape.prompt_param,
                because=because,
            )
        return TokenCount(
            g,
            "bound",
            exact=False,
            total_tokens=g,
            bound=g,
            unverified=verdict.unverified,
            verified_for=verdict.where,
        )

    def replica_bound(self) -> TokenCount | None:
        """Plan each sequence (what the engine will tokenize, and its bound) and decide on
        the bounds when they admit, or when no exact method is configured."""
        c = self.counter
        # A large request whose bound cannot admit needs no frame: it is rendered plainly at
        # once, and bounded in O(1) (`loose`).
        framed = self.small or not c._walk_cannot_admit(self.shape, self.admit_at_most)
        self.plans = c._plan(self.shape, framed, not framed)
        return c._bound_decision(self.plans, self.admit_at_most, self.total_at_most)

    def verified_gate(self) -> TokenCount | None:
        """The bound's decision when the request uses a feature outside the verified table
        (the exact count may not admit it), else None: count exactly. On the loop even for
        a large request: reading features is bounded work (tokens.gate.features caps the strings
        it parses and the values it walks), and a thread hop measurably stalled the loop
        more than the read itself."""
        c, shape, plans = self.counter, self.shape, self.plans
        verifier = c.verifier
        assert verifier is not None
        unverified = verifier.unverified(
            request_features(shape.route, shape.body), c._count_method(shape)
        )
        if not unverified:
            return None
        where = verifier.describe()
        if not c._trust_bound:
            raise errors.unverified_unbounded(unverified, where, shape.prompt_param)
        bound = max(p.bound for p in plans)
        total = sum(p.bound for p in plans)
        return TokenCount(
            bound,
            "bound",
            exact=False,
            total_tokens=total,
            bound=bound,
            unverified=tuple(unverified),
            verified_for=where,
        )

    def plain_render(self) -> None:
        """Decides nothing: near the limit the exact count rests on the template's own
        render, not on a frame's."""
        if any(p.framed for p in self.plans):
            self.plans = self.counter._rendered_plainly(self.plans)

    def exact_local(self) -> TokenCount:
        c = self.counter
        return c._exact_decision(self.plans, c._exact_local(self.plans, self.admit_at_most))

    async def exact_engine(self) -> TokenCount:
        c, shape = self.counter, self.shape
        counts = await asyncio.gather(*(c._exact_engine(p, shape) for p in self.plans))
        counted = [Partial(n, "exact" if e else "upper") for n, e in counts]
        return c._exact_decision(self.plans, counted)


def _always(_: Climb) -> bool:
    return True


LADDER: tuple[Rung[Climb, TokenCount], ...] = (
    Rung(
        "quick guarantee",
        "admits on the O(1) guaranteed bound (a few C-speed scans of the raw body)",
        "a chat-like body of at most `INLINE_CHARS` bytes, a proven chat template and a "
        "tokenizer family with a guaranteed bound",
        "loop",
        Climb.quick_applies,
        Climb.quick_guarantee,
    ),
    Rung(
        "walked guarantee",
        "admits on the guaranteed bound walked over every field; decides on it alone (or "
        "refuses, when there is none) if a feature is outside the verified table",
        "a chat-like request with a chat template configured, or a prompt-only request "
        "with a field the parser does not model",
        "loop if small",
        lambda a: a.guarantee_first,
        Climb.walked_guarantee,
    ),
    Rung(
        "replica bound",
        "admits on the bound of what the engine will tokenize: a plain chat's proven frame "
        "(`tokens.replica.frames`), else the template's render, else the raw strings; with no "
        "exact method (`bytes`) it decides every request",
        "every request",
        "loop if small",
        _always,
        Climb.replica_bound,
    ),
    Rung(
        "verified gate",
        "decides on the replica bound alone if a feature is outside the verified table "
        "(refuses when the tokenizer family has no guaranteed bound)",
        "a request the guarantee did not see first, with a verified table and an exact method",
        "loop",
        Climb.gate_applies,
        Climb.verified_gate,
    ),
    Rung(
        "plain render",
        "nothing: a frame's render is replaced by the template's own for the exact count",
        "a chat, when the template has frames",
        "loop if small",
        Climb.render_applies,
        Climb.plain_render,
    ),
    Rung(
        "exact count, local",
        "the exact count (fastokens, HF, tiktoken), stopped once the decision is known "
        "(`at_least` over the limit, or an upper bound within it)",
        "a local tokenizer (`hf:`, `tiktoken:`)",
        "worker",
        lambda a: a.counter._local is not None,
        Climb.exact_local,
    ),
    Rung(
        "exact count, engine",
        "the engine's `/tokenize` count",
        "`tokenizer: engine`",
        "loop",
        lambda a: a.counter._engine is not None,
        Climb.exact_engine,
    ),
)
