"""The counting ladder (tokens.ladder, `LADDER` in tokens.counter): its rungs one at a time,
the executor's grouping of worker rungs into one thread hop (submits counted on the
counter's real executor), and its table in docs/counting.md."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvproxy.config import doctables
from kvproxy.policy import KvproxyError, TokenCount
from kvproxy.prompt import PromptShape
from kvproxy.prompt.parse import parse_request
from kvproxy.tokens import ladder
from kvproxy.tokens.counter import LADDER, Climb, Limits, TokenCounter
from kvproxy.tokens.gate.verified import Verifier
from kvproxy.tokens.ladder import Rung
from kvproxy.tokens.replica.templates import ChatTemplate

SIMPLE_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass
class WordCounter:
    """One token per whitespace-separated word; records the threads it counted in."""

    special_tokens: int = 1
    threads: list[int] = field(default_factory=list)

    def count(self, texts: Sequence[str]) -> tuple[int, bool]:
        self.threads.append(threading.get_ident())
        return sum(len(t.split()) for t in texts), True

    def count_segments(self, segments: Sequence[str]) -> tuple[int, bool]:
        return self.count(("".join(segments),))

    def describe(self) -> str:
        return "words"


class CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """The counter's thread pool, counting what is submitted to it (one submit = one hop)."""

    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.submits = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        self.submits += 1
        return super().submit(fn, *args, **kwargs)


def counting(c: TokenCounter) -> CountingExecutor:
    c._executor.shutdown()
    c._executor = executor = CountingExecutor()
    return executor


def chat(*contents: str) -> PromptShape:
    msgs = [{"role": "user", "content": t} for t in contents]
    return parse_request("chat", orjson.dumps({"messages": msgs}))


def completion(prompt: str) -> PromptShape:
    return parse_request("completions", orjson.dumps({"prompt": prompt}))


def words(n: int) -> str:
    return " ".join(["word"] * n)


def test_the_ladder_climbs_in_its_declared_order() -> None:
    assert [r.name for r in LADDER] == [
        "quick guarantee",
        "walked guarantee",
        "replica bound",
        "verified gate",
        "plain render",
        "exact count, local",
        "exact count, engine",
    ]
    assert [r.where for r in LADDER] == [
        "loop", "loop if small", "loop if small", "loop", "loop if small", "worker", "loop",
    ]  # fmt: skip
    assert [r.awaits for r in LADDER] == [False] * 6 + [True]


# --- the executor, on a ladder of its own ----------------------------------------------------


@dataclass
class Toy:
    small: bool = False
    skip: bool = True
    ran: list[tuple[str, bool]] = field(default_factory=list)

    def step(self, name: str, decision: str | None = None) -> str | None:
        self.ran.append((name, threading.current_thread() is threading.main_thread()))
        return decision


def toy(name: str, where: ladder.Where, decision: str | None = None) -> Rung[Toy, str]:
    return Rung(name, "", "", where, lambda t: True, lambda t: t.step(name, decision))


def toy_ladder() -> tuple[Rung[Toy, str], ...]:
    return (
        toy("loop", "loop"),
        toy("worker 1", "worker"),
        Rung("skipped", "", "", "loop", lambda t: not t.skip, lambda t: t.step("skipped")),
        toy("by size", "loop if small"),
        toy("worker 2", "worker", "decided"),
        toy("never", "loop", "too late"),
    )


async def climb_counting(rungs: Sequence[Rung[Toy, str]], t: Toy) -> tuple[str | None, int]:
    hops = 0

    async def offload(fn: Callable[..., str | None], *args: Any) -> str | None:
        nonlocal hops
        hops += 1
        result = threading.Thread(target=lambda: box.append(fn(*args)))
        box: list[str | None] = []
        result.start()
        result.join()
        return box[0]

    return await ladder.climb(rungs, t, offload), hops


async def test_consecutive_worker_rungs_are_one_hop_and_a_skipped_loop_rung_splits_nothing() -> (
    None
):
    t = Toy(small=False, skip=True)
    decided, hops = await climb_counting(toy_ladder(), t)
    assert decided == "decided"
    assert hops == 1
    assert t.ran == [("loop", True), ("worker 1", False), ("by size", False), ("worker 2", False)]


async def test_a_loop_rung_that_applies_splits_the_hop() -> None:
    t = Toy(small=False, skip=False)
    decided, hops = await climb_counting(toy_ladder(), t)
    assert decided == "decided"
    assert hops == 2
    assert ("skipped", True) in t.ran


async def test_a_small_climber_runs_its_by_size_rungs_on_the_loop() -> None:
    t = Toy(small=True)
    _, hops = await climb_counting(toy_ladder(), t)
    assert hops == 2  # worker 1, then worker 2: "by size" ran on the loop between them
    assert ("by size", True) in t.ran


def test_inline_runs_loop_rungs_until_the_first_that_would_await() -> None:
    t = Toy(small=False)
    assert ladder.inline(toy_ladder(), t) == (None, 1)
    assert t.ran == [("loop", True)]
    loop_only = (toy("a", "loop"), toy("b", "loop", "b decides"), toy("c", "loop", "c"))
    assert ladder.inline(loop_only, Toy()) == ("b decides", 2)


def test_an_async_rung_runs_on_the_loop_only() -> None:
    async def run(t: Toy) -> str:
        return "x"

    with pytest.raises(ValueError, match="runs on the loop"):
        Rung("engine", "", "", "worker", lambda t: True, run)


# --- the counter's ladder: hops counted on its real executor ---------------------------------


async def test_a_small_chat_the_quick_guarantee_admits_never_leaves_the_loop() -> None:
    tok = WordCounter()
    c = TokenCounter(bound_rule="bytes", template=ChatTemplate(SIMPLE_TEMPLATE), local=tok)
    executor = counting(c)
    try:
        got = await c.count(chat("hello there"), 1000)
    finally:
        await c.aclose()
    assert (got.method, executor.submits, tok.threads) == ("bound", 0, [])


async def test_a_large_chat_is_decided_in_one_hop() -> None:
    """Walked guarantee, replica bound, plain render and the exact count: one worker call."""
    tok = WordCounter()
    c = TokenCounter(bound_rule="bytes", template=ChatTemplate(SIMPLE_TEMPLATE), local=tok)
    executor = counting(c)
    try:
        got = await c.count(chat(words(10_000)), 20_000)
    finally:
        await c.aclose()
    assert got.method == "exact"
    assert got.tokens == 10_000  # `<|user|>word` and `word<|end|><|assistant|>` are words
    assert executor.submits == 1
    assert tok.threads
    assert threading.get_ident() not in tok.threads


@pytest.mark.parametrize(("verifier", "hops"), [(None, 1), (Verifier(["static"], "auto"), 2)])
async def test_the_verified_gate_on_the_loop_splits_a_large_prompt_into_two_hops(
    verifier: Verifier | None, hops: int
) -> None:
    """A large completion: the replica bound in a worker, the gate on the loop (reading
    features is bounded), the exact count in a worker. Without a verifier there is no gate,
    and the two worker rungs share one hop."""
    tok = WordCounter()
    c = TokenCounter(bound_rule="bytes", local=tok, verifier=verifier)
    executor = counting(c)
    try:
        got = await c.count(completion(words(10_000)), 10_001)
    finally:
        await c.aclose()
    assert (got.method, got.exact, got.tokens) == ("exact", True, 10_001)  # + 1 special
    assert executor.submits == hops


# --- single rungs --------------------------------------------------------------------------


def climb(c: TokenCounter, shape: PromptShape, admit: int, total: int | None = None) -> Climb:
    return Climb(c, shape, Limits(admit, total))


async def test_the_quick_guarantee_admits_within_the_limits_and_steps_aside_over_them() -> None:
    c = TokenCounter(bound_rule="bytes", template=ChatTemplate(SIMPLE_TEMPLATE))
    try:
        # The O(1) bound is loose (~1.2 K tokens for this chat): it admits far below the limit.
        a = climb(c, chat("hi"), 10_000)
        assert a.quick_applies()
        got = a.quick_guarantee()
        assert isinstance(got, TokenCount)
        assert got.method == "bound"
        assert got.tokens == got.bound
        assert climb(c, chat("hi"), got.tokens).quick_guarantee() == got
        assert climb(c, chat("hi"), got.tokens - 1).quick_guarantee() is None
        assert climb(c, chat("hi"), 10_000, got.tokens - 1).quick_guarantee() is None
        # No guaranteed bound for the family: the rung does not apply.
        untrusted = TokenCounter(bound_rule=None, template=ChatTemplate(SIMPLE_TEMPLATE))
        assert not climb(untrusted, chat("hi"), 10_000).quick_applies()
        await untrusted.aclose()
    finally:
        await c.aclose()


async def test_the_walked_guarantee_decides_an_unverified_feature_on_its_bound() -> None:
    c = TokenCounter(
        bound_rule="bytes",
        template=ChatTemplate(SIMPLE_TEMPLATE),
        local=WordCounter(),
        verifier=Verifier(["static"], "auto"),
    )
    body = {"messages": [{"role": "System", "content": "x"}, {"role": "user", "content": "hi"}]}
    try:
        got = climb(c, parse_request("chat", orjson.dumps(body)), 1).walked_guarantee()
        assert got is not None
        assert got.unverified == ("role:case",)
        assert got.method == "bound"
        # A plain chat is verified: the rung leaves it to the replica.
        assert climb(c, chat("hi"), 1).walked_guarantee() is None
    finally:
        await c.aclose()


async def test_the_walked_guarantee_refuses_an_unverified_feature_it_cannot_bound() -> None:
    c = TokenCounter(
        bound_rule=None,
        template=ChatTemplate(SIMPLE_TEMPLATE),
        local=WordCounter(),
        verifier=Verifier(["static"], "auto"),
    )
    body = {"messages": [{"role": "System", "content": "x"}, {"role": "user", "content": "hi"}]}
    try:
        with pytest.raises(KvproxyError) as err:
            climb(c, parse_request("chat", orjson.dumps(body)), 1).walked_guarantee()
        assert "role:case" in str(err.value.message)
    finally:
        await c.aclose()


async def test_the_replica_bound_plans_and_admits_or_leaves_it_to_the_count() -> None:
    c = TokenCounter(
        bound_rule="bytes", template=ChatTemplate(SIMPLE_TEMPLATE), local=WordCounter()
    )
    try:
        a = climb(c, chat("hi"), 1000)
        got = a.replica_bound()
        assert got is not None
        assert got.method == "bound"
        assert [p.framed for p in a.plans] == [True]  # a plain chat: its proven frame
        near = climb(c, chat("hi"), 1)
        assert near.replica_bound() is None
        # Near the limit the plain render replaces the frame; its text is the same string.
        framed = near.plans[0].texts
        assert near.render_applies()
        assert near.plain_render() is None
        assert [p.framed for p in near.plans] == [False]
        assert "".join(near.plans[0].texts) == "".join(framed)
        exact = near.exact_local()
        # `<|user|>hi<|end|><|assistant|>`: one word.
        assert (exact.method, exact.exact, exact.tokens) == ("exact", True, 1)
    finally:
        await c.aclose()


async def test_the_verified_gate_decides_only_unverified_requests_on_the_replica_bound() -> None:
    c = TokenCounter(bound_rule="bytes", local=WordCounter(), verifier=Verifier(["static"], "auto"))
    try:
        plain = climb(c, completion("hello"), 1)
        assert plain.gate_applies()
        assert plain.replica_bound() is None
        assert plain.verified_gate() is None
        # An unmodeled field makes a prompt-only request the guarantee's, never the gate's.
        odd = parse_request("completions", orjson.dumps({"prompt": "hi", "mystery": "x"}))
        assert not climb(c, odd, 1).gate_applies()
    finally:
        await c.aclose()


# --- the table in docs/counting.md ----------------------------------------------------------


def test_committed_counting_md_is_what_make_docs_makes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvproxy.tokens", "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_a_rung_changed_in_the_code_makes_the_table_stale(tmp_path: Path) -> None:
    doc = tmp_path / "counting.md"
    begin, end = "<!-- BEGIN ladder (make docs) -->", "<!-- END ladder -->"
    text = f"# x\n{begin}\n{ladder.table(LADDER, 'x')}\n{end}\n"
    fresh = doctables.Table(doc, "ladder", lambda: ladder.table(LADDER, "x"))
    assert doctables.rendered(text, fresh) == text
    last = LADDER[-1]
    renamed = (*LADDER[:-1], Rung("engine count", "", "", "loop", last.when, last.run))
    drifted = doctables.Table(doc, "ladder", lambda: ladder.table(renamed, "x"))
    assert doctables.rendered(text, drifted) != text
    assert "| 7 | engine count |" in doctables.rendered(text, drifted)
