"""The one count type: what the token counter returns and admission decides on, sans-IO.

`tokens/counter.py` builds `TokenCount`s (it runs threads and asyncio, so admission must not
import it); `admission.py` decides on them; `metrics.py` derives its `method` label values
from `CountMethod`. Pure data: never tokenizes, never sees prompt text.
"""

from __future__ import annotations

from typing import Literal

from kvproxy.policy.records import record

# How a count was made: the UTF-8 byte bound, a local tokenizer, or the engine's /tokenize.
CountMethod = Literal["bound", "exact", "engine"]
# What `TokenCount.tokens` is: the exact count, a guaranteed upper bound, or a lower bound
# (counting stopped once it was over the limit). The X-Kvproxy-Prompt-Tokens-Kind header.
CountKind = Literal["exact", "upper-bound", "lower-bound"]


@record
class TokenCount:
    """`tokens` is the largest per-sequence count used for the decision (bound or exact);
    `total_tokens` is the sum over every sequence of the same counts: what the engine holds
    for the batch, which the in-flight budget charges (the limit is checked per sequence)."""

    tokens: int
    method: CountMethod
    exact: bool  # False: `tokens` is a guaranteed upper bound (or, with at_least, a lower one)
    total_tokens: int
    # The guaranteed bound computed first (== tokens when method is "bound").
    bound: int | None = None
    # Counting stopped once over admit_at_most: the prompt has at least `tokens` tokens
    # (the decision, not the number, is what admission needs).
    at_least: bool = False
    # Features of the request outside the verified table (tokens.gate.verified): the exact count
    # was withheld and `tokens` is the guaranteed bound; `verified_for` names the engines
    # and router the table was read for ("sglang 0.5.9 behind smg").
    unverified: tuple[str, ...] = ()
    verified_for: str = ""

    @property
    def kind(self) -> CountKind:
        if self.at_least:
            return "lower-bound"
        return "exact" if self.exact else "upper-bound"


__all__ = ["CountKind", "CountMethod", "TokenCount"]
