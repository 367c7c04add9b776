"""What every oracle returns or raises, shared by the three engine replicas.

An oracle answers one question: how many tokens does this engine prefill for this request
body (the number its own context check compares), or does it refuse the body? It never
imports kvproxy: an oracle written from kvproxy's code would verify nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class Refused(Exception):
    """The engine answers this body with a 4xx (or fails it): nothing is prefilled."""


class Unmodelled(Exception):
    """The body uses a request shape this replica does not model; the caller must not
    draw a conclusion from it (the fuzzer counts these apart)."""


class Uncountable(Exception):
    """The engine serves this body under a server flag kvproxy cannot see (e.g. vLLM's
    --enable-prompt-embeds) and its size is not a function of the body's text: only a
    refusal is safe."""


@dataclass(frozen=True)
class Count:
    """The engine's prompt size for one request.

    `tokens` is the largest sequence (a batch is checked per sequence) on the engine's
    default server configuration; `variants` are the same number under server settings
    kvproxy cannot see (e.g. vLLM's cross-encoder pair encoding vs an LLM reranker), and
    `hi` the largest of all: a body is safely admitted only at or under `hi`."""

    tokens: int
    per_sequence: tuple[int, ...] = ()
    variants: dict[str, int] = field(default_factory=dict)

    @property
    def hi(self) -> int:
        return max([self.tokens, *self.variants.values()])


def one(n: int, **variants: int) -> Count:
    return Count(n, (n,), dict(variants))


def batch(ns: list[int]) -> Count:
    if not ns:
        raise Refused("empty batch")
    return Count(max(ns), tuple(ns))
