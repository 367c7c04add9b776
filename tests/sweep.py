"""Sweeps over every shipped template or tokenizer: one model of each template family in
`make test`, every other model in `make test-slow`.

A per-template sweep (the differential against transformers, the proofs, the frames,
fastokens against HF) costs seconds per model, and 43 models made them most of the fast
suite's time. The families (tests/oracles/models.py: templates grouped by how they render
roles, tools and reasoning) are what the sweeps tell apart; the fast suite keeps one model
of each, with the tokenizer it is counted with, and the slow suite (CI runs both) every
other one, except HEAVY below (its family's I1 checks stay fast, its other sweeps are slow).
A template no family names runs in the fast suite: a new template is never slow by default.
Tokenizer sweeps (`templates=False`) keep only the fast models' tokenizers: kvproxy's own
start-up check compares fastokens with HF on every tokenizer it loads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from oracles.models import FAMILY_OF, REPRESENTATIVES, SIBLING_TOKENIZER

# The representatives, and the folders whose tokenizer.json they are counted with.
FAST_MODELS = frozenset(REPRESENTATIVES) | {
    SIBLING_TOKENIZER[m] for m in REPRESENTATIVES if m in SIBLING_TOKENIZER
}


# Representatives whose family is covered in `make test` by the I1 checks alone (the chat
# differential against transformers, the oracle corpus, the verified-table differential) and
# whose other sweeps run in `make test-slow`: Qwen-3.5 counts with three tokenizer pipelines,
# and loading them (HF and fastokens) costs 11 s, three to four times any other tokenizer;
# its sweeps were ~70 s of the fast suite's ~1,200 (junit, 2026-12-07).
HEAVY = frozenset({"qwen-3.5"})


# `sweep` as well: CPU-bound and judged on counts, never on time, so `make test-slow` runs
# these on every core before the timing-sensitive rest of the slow suite, one at a time.
SLOW_SWEEP = (pytest.mark.slow, pytest.mark.sweep)


def is_fast(model: str, *, templates: bool = True, heavy: bool = False) -> bool:
    """In `make test`: a representative (not a HEAVY one unless `heavy`: an I1 check), or
    a template no family names."""
    if model in HEAVY and not heavy:
        return False
    return model in FAST_MODELS or (templates and model not in FAMILY_OF)


def ordered(models: Iterable[str], *, templates: bool = True, heavy: bool = False) -> list[str]:
    """The fast suite's models first, each group in its given order."""
    ms = list(models)
    fast = [m for m in ms if is_fast(m, templates=templates, heavy=heavy)]
    return fast + [m for m in ms if m not in fast]


def every(models: Iterable[str], *, templates: bool = True, heavy: bool = False) -> list[Any]:
    """`models` as pytest params named by model, the fast suite's first and the others
    marked slow. `heavy`: the HEAVY representatives stay in the fast suite (the I1 checks)."""
    return [
        pytest.param(
            m, id=m, marks=() if is_fast(m, templates=templates, heavy=heavy) else SLOW_SWEEP
        )
        for m in ordered(models, templates=templates, heavy=heavy)
    ]
