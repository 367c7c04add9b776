"""The counting ladder's machinery: a rung, and the one executor that climbs a tuple of them.

A rung says what it decides, when it applies and where it runs: on the event loop, in a
worker thread, or on the loop for a small request and in a worker for a large one. The
executor skips the rungs that do not apply, runs the rest in order until one decides, and
runs each stretch of consecutive worker rungs in ONE thread hop (each hop costs the loop a
wake-up and the request ~0.1 ms). Which rungs apply and where they run is known before
the climb starts (from the counter's configuration and the request's size), so the hops are
planned up front; whether a rung *decides* is known only when it has run.

The ladder itself (the rungs of `TokenCounter`) is declared in `tokens.counter`; `table`
renders a ladder for docs/counting.md (`python -m kvproxy.tokens`, run by `make docs`;
`--check` fails on drift). Knows nothing of prompts or tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

# loop: sync and bounded work, or an await (an engine's /tokenize); worker: a thread.
Where = Literal["loop", "worker", "loop if small"]

A = TypeVar("A", bound="Climber")
# Covariant: rungs deciding a TokenCount are rungs deciding a TokenCount or None.
R = TypeVar("R", covariant=True)


class Climber(Protocol):
    """What the executor needs of the request climbing the ladder."""

    @property
    def small(self) -> bool:
        """Small enough for the rungs that run "loop if small" to run on the loop."""


@dataclass(frozen=True)
class Rung(Generic[A, R]):
    name: str
    decides: str  # what it answers when it decides (the docs' words)
    applies: str  # when it applies (the docs' words for `when`)
    where: Where
    # Whether it applies to this request: known before the climb (config and size only).
    when: Callable[[A], bool]
    # The decision, or None: the next rung decides. Sync, or (on the loop only) async.
    run: Callable[[A], R | None] | Callable[[A], Awaitable[R | None]]
    awaits: bool = field(init=False)

    def __post_init__(self) -> None:
        awaits = inspect.iscoroutinefunction(self.run)
        if awaits and self.where != "loop":
            raise ValueError(f"rung {self.name!r}: an async rung runs on the loop")
        object.__setattr__(self, "awaits", awaits)

    def on_loop(self, climber: A) -> bool:
        return self.where == "loop" or (self.where == "loop if small" and climber.small)


def inline(ladder: Sequence[Rung[A, R]], climber: A) -> tuple[R | None, int]:
    """Run the leading rungs that need no await (sync, on the loop) until one decides or a
    rung needs an await: (the decision or None, the index of the first rung not run)."""
    for i, rung in enumerate(ladder):
        if not rung.when(climber):
            continue
        if rung.awaits or not rung.on_loop(climber):
            return None, i
        decided = rung.run(climber)
        assert not inspect.isawaitable(decided)
        if decided is not None:
            return decided, i + 1
    return None, len(ladder)


def stretch(ladder: Sequence[Rung[A, R]], climber: A, start: int) -> tuple[list[Rung[A, R]], int]:
    """The worker rungs that apply from `start` on, up to the next loop rung that applies:
    one thread hop. Returns them and the index after them."""
    group: list[Rung[A, R]] = []
    i = start
    while i < len(ladder):
        rung = ladder[i]
        if rung.when(climber):
            if rung.on_loop(climber):
                break
            group.append(rung)
        i += 1
    return group, i


def run_sync(rungs: Sequence[Rung[A, R]], climber: A) -> R | None:
    """A worker step: its rungs in order until one decides (called in the thread)."""
    for rung in rungs:
        decided = rung.run(climber)
        assert not inspect.isawaitable(decided)
        if decided is not None:
            return decided
    return None


async def climb(
    ladder: Sequence[Rung[A, R]],
    climber: A,
    offload: Callable[..., Awaitable[R | None]],
) -> R | None:
    """Run the rungs that apply, in order, until one decides; None when none did. Each
    stretch of worker rungs is one `offload(run_sync, rungs, climber)`."""
    i = 0
    while i < len(ladder):
        rung = ladder[i]
        if not rung.when(climber):
            i += 1
            continue
        if rung.on_loop(climber):
            result = rung.run(climber)
            decided = await result if inspect.isawaitable(result) else result
            i += 1
        else:
            group, i = stretch(ladder, climber, i)
            decided = await offload(run_sync, group, climber)
        if decided is not None:
            return decided
    return None


# --- the ladder in docs/counting.md ---------------------------------------------------------

WHERE_WORDS: dict[Where, str] = {
    "loop": "event loop",
    "worker": "worker thread",
    "loop if small": "event loop if small, else worker thread",
}


def table(ladder: Sequence[Rung[A, R]], source: str) -> str:
    """The ladder as a markdown table, in climbing order."""
    lines = [
        f"Made by `make docs` from the `LADDER` tuple in `{source}`; edit that, not this table.",
        "",
        "| # | rung | decides | applies when | runs on |",
        "|---|---|---|---|---|",
    ]
    for i, rung in enumerate(ladder, 1):
        where = WHERE_WORDS[rung.where] + (" (awaited)" if rung.awaits else "")
        lines.append(f"| {i} | {rung.name} | {rung.decides} | {rung.applies} | {where} |")
    return "\n".join(lines)
