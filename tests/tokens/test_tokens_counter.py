"""TokenCounter behaviour with fake tokenizers: when it tokenizes, what it adds, how it
fails closed (timeouts, panics, template errors), and how it bounds its own concurrency."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from kvproxy.policy.errors import KvproxyError
from kvproxy.prompt import PromptShape
from kvproxy.prompt.media import ImageProcessor, MediaPolicy
from kvproxy.prompt.parse import parse_request
from kvproxy.tokens.bound.bounds import BoundRule
from kvproxy.tokens.bound.guarantee import ChatGuarantee
from kvproxy.tokens.counter import LADDER, UNKNOWN_SPECIAL_TOKENS, Climb, Limits, TokenCounter
from kvproxy.tokens.replica.templates import ChatTemplate

SIMPLE_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass
class FakeTokenizer:
    """One token per whitespace-separated word; records every call."""

    bound_rule: BoundRule | None = "bytes"
    special_tokens: int = 1
    template: ChatTemplate | None = None
    calls: list[tuple[str, ...]] = field(default_factory=list)
    gate: threading.Event | None = None
    fail: BaseException | None = None
    active: int = 0
    max_active: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, texts: Sequence[str]) -> tuple[int, bool]:
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            self.calls.append(tuple(texts))
            if self.gate is not None:
                assert self.gate.wait(10)
            if self.fail is not None:
                raise self.fail
            return sum(len(t.split()) for t in texts), True
        finally:
            with self.lock:
                self.active -= 1

    def count_segments(self, segments: Sequence[str]) -> tuple[int, bool]:
        return self.count(("".join(segments),))

    def describe(self) -> str:
        return "fake"


class FakePanic(BaseException):  # like pyo3_runtime.PanicException
    pass


def chat(*contents: str, **extra: object) -> PromptShape:
    msgs = [{"role": "user", "content": c} for c in contents]
    return parse_request("chat", orjson.dumps({"messages": msgs, **extra}))


def completion(prompt: object) -> PromptShape:
    return parse_request("completions", orjson.dumps({"prompt": prompt}))


def counter_with(tok: FakeTokenizer, **kwargs: object) -> TokenCounter:
    return TokenCounter(
        bound_rule=tok.bound_rule,
        template=tok.template,
        local=tok,
        special_tokens=tok.special_tokens,
        **kwargs,  # type: ignore[arg-type]
    )


async def test_bound_within_limit_admits_without_tokenizing() -> None:
    tok = FakeTokenizer()
    c = counter_with(tok)
    try:
        got = await c.count(completion("hello world"), 1000)
    finally:
        await c.aclose()
    assert got.method == "bound"
    assert not got.exact
    assert got.tokens == got.bound == len("hello world") + 1 + 1  # + prefix space + special
    assert tok.calls == []


async def test_bound_over_limit_counts_exactly() -> None:
    tok = FakeTokenizer()
    c = counter_with(tok)
    try:
        got = await c.count(completion("hello big world"), 5)
    finally:
        await c.aclose()
    assert (got.tokens, got.method, got.exact) == (3 + 1, "exact", True)
    assert tok.calls == [("hello big world",)]


async def test_untrusted_family_never_admits_on_bound() -> None:
    tok = FakeTokenizer(bound_rule=None)
    c = counter_with(tok)
    try:
        got = await c.count(completion("hi"), 10**9)
    finally:
        await c.aclose()
    assert got.method == "exact"
    assert tok.calls


async def test_bytes_mode_returns_the_bound_even_over_the_limit() -> None:
    c = TokenCounter(bound_rule="nfc")
    try:
        got = await c.count(completion("x" * 100), 10)
    finally:
        await c.aclose()
    assert got.method == "bound"
    assert got.tokens == 100 + 1 + UNKNOWN_SPECIAL_TOKENS
    assert "rejects some legal prompts" in c.describe()


async def test_token_ids_media_and_batches() -> None:
    tok = FakeTokenizer()
    processor = ImageProcessor()
    c = counter_with(tok, media=MediaPolicy(processor, image_tokens=1000))
    try:
        ids = await c.count(completion([[1, 2, 3], [4] * 50]), 10**9)
        gen = parse_request(
            "generate", orjson.dumps({"text": "a b", "image_data": ["img1", "img2"]})
        )
        media = await c.count(gen, 0)
    finally:
        await c.aclose()
    assert ids.tokens == 50  # the largest sequence; ids are never tokenized
    assert tok.calls == [("a b",)]
    # "img1" is no image header kvproxy can read: each is charged the processor's ceiling.
    assert media.tokens == 2 + 1 + 2 * max(1000, processor.ceiling())
    assert not media.exact  # a computed cost, not a count


async def test_chat_with_template_counts_the_rendered_prompt() -> None:
    tok = FakeTokenizer(template=ChatTemplate(SIMPLE_TEMPLATE))
    c = counter_with(tok)
    try:
        got = await c.count(chat("one two", "three"), 0)
    finally:
        await c.aclose()
    assert tok.calls == [("<|user|>one two<|end|><|user|>three<|end|><|assistant|>",)]
    assert got.tokens == 2  # the fake splits on whitespace only
    assert got.exact


async def test_chat_without_template_uses_the_overhead_formula() -> None:
    tok = FakeTokenizer()
    c = counter_with(tok)
    try:
        got = await c.count(chat("one two", "three"), 0)
    finally:
        await c.aclose()
    assert got.tokens == 2 + 2 + 1 + 64 + 8 * 2  # roles + words + formula
    assert not got.exact


async def test_template_errors_are_a_400_without_text() -> None:
    tmpl = ChatTemplate("{{ raise_exception('secret ' + messages[0].content) }}")
    c = counter_with(FakeTokenizer(template=tmpl))
    try:
        with pytest.raises(KvproxyError) as info:
            # A limit below any bound: the render decides (a template that always raises is
            # proven to print nothing, so its guaranteed bound alone would admit the request
            # and the engine would refuse it).
            await c.count(chat("PRIVATE-PROMPT"), 0)
    finally:
        await c.aclose()
    assert info.value.status == 400
    assert info.value.param == "messages"
    assert "PRIVATE" not in info.value.message


async def test_timeout_is_a_503_and_the_slot_stays_held_until_the_thread_ends() -> None:
    gate = threading.Event()
    tok = FakeTokenizer(gate=gate)
    c = counter_with(tok, count_timeout_s=0.2, count_concurrency=1)
    try:
        with pytest.raises(KvproxyError) as first:
            await c.count(completion("a b c"), 0)
        assert first.value.status == 503
        assert first.value.code == "token_count_unavailable"
        # The abandoned thread still runs: the next count cannot start, so it times out too.
        with pytest.raises(KvproxyError):
            await c.count(completion("d e"), 0)
        assert len(tok.calls) == 1
        gate.set()
        for _ in range(100):  # the slot comes back once the thread really ends
            if tok.active == 0:
                break
            await asyncio.sleep(0.01)
        got = await c.count(completion("d e"), 0)
    finally:
        gate.set()
        await c.aclose()
    assert got.tokens == 2 + 1


@pytest.mark.parametrize("failure", [FakePanic("boom"), RuntimeError("boom")])
async def test_tokenizer_failures_and_panics_are_a_503(failure: BaseException) -> None:
    c = counter_with(FakeTokenizer(fail=failure))
    try:
        with pytest.raises(KvproxyError) as info:
            await c.count(completion("a b"), 0)
    finally:
        await c.aclose()
    assert info.value.status == 503


async def test_concurrency_is_bounded() -> None:
    tok = FakeTokenizer()
    original = tok.count

    def slow(texts: Sequence[str]) -> tuple[int, bool]:
        time.sleep(0.02)
        return original(texts)

    tok.count = slow  # type: ignore[method-assign]
    c = counter_with(tok, count_concurrency=2)
    try:
        results = await asyncio.gather(*(c.count(completion("a b"), 0) for _ in range(8)))
    finally:
        await c.aclose()
    assert all(r.tokens == 3 for r in results)
    assert len(tok.calls) == 8
    assert tok.max_active <= 2


async def test_large_shapes_are_planned_off_the_loop() -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []
    # `trim` looks inside the content: no proven frame (tokens.replica.frames), so both chats
    # render.
    tmpl = ChatTemplate("{{ messages[0].content|trim }}")
    original = tmpl.render_all

    def spy(seq: object) -> tuple[tuple[str, ...], ...]:
        seen.append(threading.get_ident())
        return original(seq)  # type: ignore[arg-type]

    tmpl.render_all = spy  # type: ignore[method-assign]
    c = TokenCounter(bound_rule="nfc", template=tmpl)
    guarantee = c._guarantee
    assert isinstance(guarantee, ChatGuarantee)
    walked: list[int] = []
    walk = guarantee.tokens

    def spy_walk(*args: Any) -> int | None:
        walked.append(threading.get_ident())
        return walk(*args)

    guarantee.tokens = spy_walk  # type: ignore[method-assign]
    try:
        # A limit no bound meets: the guarantee, then the template's render, decide.
        await c.count(chat("small"), 0)
        await c.count(chat("x" * 100_000), 0)
    finally:
        await c.aclose()
    assert seen[0] == loop_thread
    assert seen[1] != loop_thread
    assert walked[0] == loop_thread
    assert walked[1] != loop_thread


async def test_a_batch_carries_its_total_next_to_the_largest_sequence() -> None:
    """The budget charges the total; the limit is checked on the largest sequence."""
    tok = FakeTokenizer()
    c = counter_with(tok)
    try:
        bound = await c.count(completion(["hello world", "a b c d e f"]), 1000)
        # The bounds fit the limit but their sum is over the budget's room: count exactly.
        exact = await c.count(completion(["hello world", "a b c d e f"]), 1000, 20)
    finally:
        await c.aclose()
    assert bound.method == "bound"
    assert bound.tokens == len("a b c d e f") + 2
    assert bound.total_tokens == len("hello world") + 2 + len("a b c d e f") + 2
    assert exact.method == "exact"
    assert (exact.tokens, exact.total_tokens) == (6 + 1, 2 + 1 + 6 + 1)


# --- the quick admission is the general path's answer ------------------------------------


def _raw(body: dict[str, object]) -> bytes:
    return orjson.dumps(body)


# (body, whether the shortcut may decide it): only a small chat the O(1) bound can price.
_QUICK_BODIES: tuple[tuple[bytes, bool], ...] = (
    (_raw({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}), True),
    (
        _raw(
            {
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": 'caf\u00e9 \\u00ff \u4f60\u597d "quoted"'},
                ],
                "stream": True,
            }
        ),
        True,
    ),
    (b'{"messages":[{"role":"user","content":"x","name":"reasoning"}],"temperature":1E-5}', False),
    (
        _raw(
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}
        ),
        False,
    ),
    (
        _raw(
            {
                "messages": [{"role": "user", "content": "call it"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                "chat_template_kwargs": {"enable_thinking": False},
            }
        ),
        True,
    ),
    (_raw({"messages": [{"role": "user", "content": "y" * 20_000}]}), False),
    # Many messages in a small body: the O(1) bound costs no more per message.
    (_raw({"messages": [{"role": "user", "content": "z"}] * 70}), True),
)


@pytest.mark.parametrize("body", _QUICK_BODIES)
@pytest.mark.parametrize("rule", ["bytes", "nfc", None])
@pytest.mark.parametrize("exact", [True, False])
async def test_quick_admission_answers_what_the_general_path_answers(
    body: tuple[bytes, bool], rule: BoundRule | None, exact: bool
) -> None:
    """`count`'s shortcut for a small chat its O(1) guarantee admits returns exactly what
    the rest of the ladder (the walked guarantee on) returns, at every ceiling around the
    bound, and steps aside (None) wherever the general path would do anything else."""
    tok = FakeTokenizer(bound_rule=rule, template=ChatTemplate(SIMPLE_TEMPLATE))
    media = MediaPolicy(ImageProcessor())  # the image body is priced, not refused
    c = (
        counter_with(tok, media=media)
        if exact
        else TokenCounter(bound_rule=rule, template=tok.template, media=media)
    )
    raw, plain = body
    shape = parse_request("chat", raw)
    # `count` prices the media before either path; the paths called directly get it here.
    shape = dataclasses.replace(shape, media_tokens=media.cost(shape.body, "chat"))
    guarantee = c._guarantee
    assert isinstance(guarantee, ChatGuarantee)
    quick = guarantee.quick(shape.raw, shape.body, "chat")
    ceilings = {0, 1, 10**9}
    if quick is not None:
        ceilings |= {quick - 1, quick, quick + 1}
    shortcuts = 0
    try:
        for admit in sorted(ceilings):
            for total in (None, admit, max(admit - 1, 0)):
                limits = Limits(admit, total)
                alone = Climb(c, shape, limits)
                short = alone.quick_guarantee() if alone.quick_applies() else None
                # The ladder without its first rung: the walked guarantee on.
                general = await c.climb(Climb(c, shape, limits), LADDER[1:])
                if short is not None:
                    shortcuts += 1
                    assert short == general
                assert await c.count(shape, admit, total) == general
    finally:
        await c.aclose()
    # The plain bodies (no media, no exponent, small) do take the shortcut when trusted.
    assert (shortcuts > 0) == (plain and rule is not None)
