"""TokenCounter: bound first, exact only when the bound does not already admit (I1).

For each sequence of a `PromptShape` the counter builds a plan: what the engine will
tokenize (the rendered chat template, or the raw strings), a guaranteed upper bound on its
tokens, and the fixed costs (token ids, configured image/audio costs, special tokens, the
measured template overhead when no template is known). Then:

  1. bound <= admit_at_most (and the tokenizer family has a guaranteed bound): admit on the
     bound; nothing is tokenized;
  2. otherwise count exactly: HF / tiktoken in worker threads that release the GIL, or the
     engine's `/tokenize`;
  3. no exact method configured (`bytes`): return the bound; the caller rejects on it.

Failure is closed: a count that fails or outlives `count_timeout_s` raises
`count_unavailable` (503), never a guess. At most `count_concurrency` counts use threads or
the engine at once; a timed-out thread keeps its slot until it really ends, so abandoned
work cannot pile up behind the timeout.

The event loop only sees small requests (< INLINE_CHARS characters, few messages), which are
planned inline in well under a millisecond; everything else runs in the worker threads,
in window-sized C calls (see `bounds`). This module never logs prompt text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from kvproxy import errors
from kvproxy.errors import KvproxyError
from kvproxy.prompt import CHAT_ROUTES, PromptShape, SequencePrompt
from kvproxy.tokens import bounds
from kvproxy.tokens.bounds import BoundRule
from kvproxy.tokens.engine import EngineTokenize, EngineTokenizeRequest
from kvproxy.tokens.local import LocalTokenizer
from kvproxy.tokens.templates import ChatTemplate, flattened_messages, joined_parts

CountMethod = Literal["bound", "exact", "engine"]
T = TypeVar("T")

# Shapes up to this many characters (and messages) are planned on the event loop: the worst
# case (an is_normalized over 16 K hostile characters) is ~2 ms, less than a thread hop.
INLINE_CHARS = 16_384
INLINE_MESSAGES = 64
# Special tokens a post-processor may add to a text sequence when the tokenizer is unknown
# (GLM-4 adds 2, Llama-3 1), plus one for a ByteLevel prefix space.
UNKNOWN_SPECIAL_TOKENS = 8
# Niceness of the counting threads (only ever raised: needs no privilege).
WORKER_NICE = 10


@dataclass(frozen=True, slots=True)
class TokenCount:
    """`tokens` is the largest per-sequence count used for the decision (bound or exact);
    `total_tokens` is the sum over every sequence of the same counts: what the engine holds
    for the batch, which the in-flight budget charges (the limit is checked per sequence)."""

    tokens: int
    method: CountMethod
    exact: bool
    total_tokens: int
    # The guaranteed bound computed first (== tokens when method is "bound").
    bound: int | None = None


@dataclass(frozen=True, slots=True)
class _Plan:
    seq: SequencePrompt
    chat: bool
    bound: int
    # Tokenized by an exact count: the rendered template's segments (one text), or the raw
    # strings (each its own text).
    texts: tuple[str, ...]
    rendered: bool
    # Added to any exact count: ids, media, specials, joins.
    fixed: int
    # Whether `count(texts) + fixed` is the engine's exact number.
    exact: bool


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
        image_tokens: int = 16384,
        audio_tokens: int = 16384,
        count_timeout_s: float = 10.0,
        count_concurrency: int = 2,
        description: str = "",
    ) -> None:
        if local is not None and engine is not None:
            raise ValueError("a counter uses a local tokenizer or the engine, not both")
        # None: this tokenizer family has no guaranteed byte bound; never admit on it.
        self._trust_bound = bound_rule is not None
        self._rule: BoundRule = bound_rule or "nfc"
        self._template = template
        self._local = local
        self._engine = engine
        self._specials = special_tokens
        self._image_tokens = image_tokens
        self._audio_tokens = audio_tokens
        self._timeout_s = count_timeout_s
        self._concurrency = count_concurrency
        self._sem = asyncio.Semaphore(count_concurrency)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=count_concurrency,
            thread_name_prefix="kvproxy-count",
            initializer=_lower_thread_priority,
        )
        self._description = description
        self.method: CountMethod = "exact" if local else ("engine" if engine else "bound")

    def describe(self) -> str:
        """One line for the start-up log."""
        template = (self._template.origin or "configured") if self._template else "none"
        head = {
            "bound": "bytes: UTF-8 byte bound only (NFC rule, + template overhead); safe, but "
            "it rejects some legal prompts near the limit. Configure hf:PATH, tiktoken:PATH "
            "or engine for exact counts",
            "exact": f"exact counts with {self._description}",
            "engine": f"exact counts with {self._description}",
        }[self.method]
        return (
            f"{head}; chat template: {template}; admit on bound: {self._trust_bound}; "
            f"timeout {self._timeout_s:g} s; concurrency {self._concurrency}"
        )

    async def aclose(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def count(
        self, shape: PromptShape, admit_at_most: int, total_at_most: int | None = None
    ) -> TokenCount:
        """Count `shape`'s sequences, tokenizing only if the largest bound is over
        `admit_at_most` or the bounds' sum over `total_at_most` (the budget's room).

        Raises `invalid_request` (the chat template refuses the messages) or
        `count_unavailable` (timeout, tokenizer or engine failure).
        """
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._count(shape, admit_at_most, total_at_most)
        except TimeoutError:
            raise errors.count_unavailable(f"over {self._timeout_s:g} s") from None
        except _WorkerFailed as exc:
            raise errors.count_unavailable(f"tokenizer failed: {exc}") from None

    async def _count(
        self, shape: PromptShape, admit_at_most: int, total_at_most: int | None
    ) -> TokenCount:
        small = shape.text_chars <= INLINE_CHARS and all(
            p.message_count <= INLINE_MESSAGES for p in shape.prompts
        )
        if small:
            plans = self._plan(shape)
        else:
            plans = await self._offload(self._plan, shape)
        bound = max(p.bound for p in plans)
        total = sum(p.bound for p in plans)
        fits = bound <= admit_at_most and (total_at_most is None or total <= total_at_most)
        if (self._trust_bound and fits) or self.method == "bound":
            return TokenCount(bound, "bound", exact=False, total_tokens=total, bound=bound)
        if self._local is not None:
            counts = await self._offload(self._exact_local, plans)
        else:
            counts = list(await asyncio.gather(*(self._exact_engine(p) for p in plans)))
        return TokenCount(
            max(c for c, _ in counts),
            self.method,
            all(e for _, e in counts),
            total_tokens=sum(c for c, _ in counts),
            bound=bound,
        )

    async def _offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` in a worker; the concurrency slot is held until the thread really ends."""
        await self._sem.acquire()
        loop = asyncio.get_running_loop()
        try:
            cfut = self._executor.submit(_guarded, fn, *args)
        except BaseException:
            self._sem.release()
            raise
        cfut.add_done_callback(functools.partial(_release_from_thread, loop, self._sem))
        return await asyncio.wrap_future(cfut)

    # --- plans (sync: on the loop for small shapes, else in a worker) -----------------------

    def _plan(self, shape: PromptShape) -> list[_Plan]:
        chat = shape.route in CHAT_ROUTES
        return [self._plan_chat(s) if chat else self._plan_text(s) for s in shape.prompts]

    def _media(self, seq: SequencePrompt) -> int:
        return seq.images * self._image_tokens + seq.audios * self._audio_tokens

    def _plan_text(self, seq: SequencePrompt) -> _Plan:
        specials = self._specials if seq.texts else 0
        fixed = seq.token_ids + self._media(seq) + specials
        # +1 per text: a ByteLevel pre-tokenizer may prepend a space.
        bound = bounds.texts_bound(seq.texts, self._rule) + len(seq.texts) + fixed
        exact = len(seq.texts) <= 1 and not (seq.images or seq.audios)
        return _Plan(seq, False, bound, seq.texts, False, fixed, exact)

    def _plan_chat(self, seq: SequencePrompt) -> _Plan:
        media = self._media(seq)
        if self._template is not None:
            segments = self._template.render_segments(seq)
            joins = joined_parts(seq)
            fixed = media + joins
            bound = bounds.segments_bound(segments, self._rule) + fixed
            exact = joins == 0 and media == 0
            return _Plan(seq, True, bound, segments, True, fixed, exact)
        texts = (*seq.texts, seq.template_kwargs_json)
        tools = bounds.text_bound(seq.tools_json, self._rule) if seq.tools else None
        overhead = bounds.chat_overhead_bound(seq.message_count, tools)
        bound = bounds.texts_bound(texts, self._rule) + overhead + media
        return _Plan(seq, True, bound, texts, False, media, False)

    # --- exact counts ---------------------------------------------------------------------

    def _exact_local(self, plans: list[_Plan]) -> list[tuple[int, bool]]:
        assert self._local is not None
        out = []
        for p in plans:
            if p.rendered:
                n, exact = self._local.count_segments(p.texts)
            else:
                n, exact = self._local.count(p.texts)
            n += p.fixed
            if p.chat and not p.rendered:
                tools = self._local.count((p.seq.tools_json,))[0] if p.seq.tools else None
                n += bounds.chat_overhead_bound(p.seq.message_count, tools)
            elif not p.chat and p.texts:
                # The plan charged the unknown-tokenizer specials; use this tokenizer's own.
                n += self._local.special_tokens - self._specials
            out.append((n, p.exact and exact))
        return out

    async def _exact_engine(self, plan: _Plan) -> tuple[int, bool]:
        engine = self._engine
        assert engine is not None
        try:
            if not plan.chat:
                counts = [
                    await engine(EngineTokenizeRequest(prompt=t, add_special_tokens=True))
                    for t in plan.texts
                ]
                # The engine adds its own special tokens: drop the plan's allowance for them.
                specials = self._specials if plan.texts else 0
                return sum(counts) + plan.fixed - specials, plan.exact
            if plan.rendered:
                # Joining a multi-megabyte render is a long GIL-holding copy: not on the loop.
                prompt = await asyncio.to_thread("".join, plan.texts)
                req = EngineTokenizeRequest(prompt=prompt, add_special_tokens=False)
                return await engine(req) + plan.fixed, plan.exact
            if engine.accepts_messages:
                seq = plan.seq
                req = EngineTokenizeRequest(
                    messages=flattened_messages(seq),
                    tools=list(seq.tools) if seq.tools else None,
                    add_generation_prompt=seq.add_generation_prompt,
                    chat_template_kwargs=seq.template_kwargs or None,
                )
                joins = joined_parts(seq)
                return await engine(req) + plan.fixed + joins, joins == 0 and plan.fixed == 0
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


def _guarded(fn: Callable[..., T], *args: Any) -> T:
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
