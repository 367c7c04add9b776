"""Which corpus checks fail today because of kvproxy bugs (issue #30), by (case, engine).

Each entry makes the matching corpus test `xfail(strict=True)`: the branch stays green, the
failures stay visible, and a fix makes the test pass, which fails the run until its entry
is removed here. The texts say the class of the issue, how far kvproxy is under (for
admissions) and on which families' models (measured at the commit that wrote them).

UNDER_TODAY: kvproxy admits the body at a limit one token under the engine's count
(property (a), I1). EXACT_MISMATCH_TODAY: kvproxy reports an `exact` count that is not the
engine's (property (b); an over-count is safe but must not be called exact).
"""

from __future__ import annotations

# Closed by the guaranteed bound (tokens.bound.guarantee): every corpus body kvproxy admits is
# within the engine's count (roles, score fields, prompt_embeds, chat input_ids and
# kv_transfer_params bodies are decided by a bound over every field, or refused).
UNDER_TODAY: dict[tuple[str, str], str] = {}
EXACT_MISMATCH_TODAY: dict[tuple[str, str], str] = {}

# The corpus on every shipped template (slow): the representatives' entries above and these.
SLOW_UNDER_TODAY: dict[tuple[str, str], str] = {}

# Fuzz classes (oracles/fuzz.py) with violations today, fast form (4 examples per class on
# one model per family) and slow form (20 per class on every shipped template).
FUZZ_FAST_TODAY: dict[str, str] = {}
# The GPT2Tokenizer-class MiniMax checkpoints counted under before kvproxy built the pipeline
# transformers 5 builds (tokens.replica.hfbuild): closed.
FUZZ_SLOW_TODAY: dict[str, str] = {}
