"""One pass of the differential suites over a set of models, model by model: each model
(and its kvproxy counters, ~5 s to build) is loaded once, every corpus case and every fuzz
class runs on it, then it is released. The corpus and fuzz tests read the result.

    result = run(models, fuzz_examples=6, derandomize=True)
    result.corpus[(case, engine)] -> [(model, Outcome)]
    result.fuzz[klass] -> [Violation], result.fuzz_checked[klass] -> count

`run_in_processes` is the same pass with the models spread over worker processes (the slow
pass over every shipped template is CPU-bound, one model after another; models share nothing),
merged in model order, so its result equals `run`'s.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from oracles import corpus, fuzz
from oracles.check import KVPROXY_ENGINE, Outcome, check
from oracles.kvproxy_side import KvproxySide, config_key
from oracles.models import REPRESENTATIVES, Model, load_model
from oracles.report import REPORT, Tally


@dataclass(frozen=True)
class Violation:
    klass: str
    model: str
    engine: str
    route: str
    problem: str
    body: bytes


@dataclass
class Result:
    corpus: dict[tuple[str, str], list[tuple[str, Outcome]]] = field(default_factory=dict)
    fuzz: dict[str, list[Violation]] = field(default_factory=lambda: defaultdict(list))
    fuzz_checked: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: float = 0.0


def run(
    models: tuple[str, ...],
    fuzz_examples: int,
    *,
    derandomize: bool,
    suite: str,
    every_model: bool = False,
) -> Result:
    """`every_model`: every corpus case on every model of the run (the slow form), else on
    its own models (one per family) among those of the run."""
    t0 = time.monotonic()
    result = Result()
    for name in models:
        model = load_model(name)
        # The fast pass counts with HF tokenizers (`tokenizer_backend: hf`): what it holds to
        # the engines is the replica and its normalisation, the same with either backend, and
        # fastokens' load and start-up check were two thirds of its time (24 of 62 s on one
        # core). fastokens is held to HF by its own sweeps (tests/tokens/test_tokens_fast.py,
        # the chat differential's `-fast` cases); the slow pass runs the default backend.
        side = _Sides(model, {"tokenizer_backend": "hf"} if suite == "fast" else {})
        try:
            for case in corpus.CASES:
                if not every_model and name not in (case.models or REPRESENTATIVES):
                    continue
                for engine in case.engines:
                    out = check(side(engine), engine, model, case.route, case.bytes())
                    REPORT.add(f"{suite}-corpus", name, engine, out)
                    result.corpus.setdefault((case.name, engine), []).append((name, out))
            if fuzz_examples:
                for klass, strategy in fuzz.CLASSES.items():
                    _fuzz(result, suite, klass, strategy, model, side, fuzz_examples, derandomize)
        finally:
            side.close()
    result.seconds = time.monotonic() - t0
    return result


def _one_model(
    name: str, fuzz_examples: int, derandomize: bool, suite: str, every_model: bool
) -> tuple[Result, dict[tuple[str, str, str], Tally]]:
    """In a worker process: one model's pass and its report tallies (only this model's)."""
    REPORT.tallies = {}
    result = run(
        (name,), fuzz_examples, derandomize=derandomize, suite=suite, every_model=every_model
    )
    return result, REPORT.tallies


def run_in_processes(
    models: tuple[str, ...],
    fuzz_examples: int,
    *,
    derandomize: bool,
    suite: str,
    every_model: bool = False,
    workers: int,
) -> Result:
    """`run`, with the models spread over `workers` processes (spawned: the parent holds
    tokenizer threads), merged in model order into one Result and the parent's REPORT."""
    t0 = time.monotonic()
    merged = Result()
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=spawn) as pool:
        futures = [
            pool.submit(_one_model, name, fuzz_examples, derandomize, suite, every_model)
            for name in models
        ]
        for future in futures:  # model order: the lists read as `run`'s would
            one, tallies = future.result()
            for key, outcomes in one.corpus.items():
                merged.corpus.setdefault(key, []).extend(outcomes)
            for klass, violations in one.fuzz.items():
                merged.fuzz[klass].extend(violations)
            for klass, n in one.fuzz_checked.items():
                merged.fuzz_checked[klass] += n
            REPORT.tallies.update(tallies)
    merged.seconds = time.monotonic() - t0
    return merged


class _Sides:
    """kvproxy counters for one model, one per kvproxy configuration, built on demand."""

    def __init__(self, model: Model, extra: dict[str, Any]) -> None:
        self.model = model
        self.extra = extra  # settings on top of the engine's (oracles.kvproxy_side.settings_for)
        self.sides: dict[str, KvproxySide] = {}

    def __call__(self, engine: str) -> KvproxySide:
        key = config_key(KVPROXY_ENGINE[engine])
        if key not in self.sides:
            self.sides[key] = KvproxySide(self.model.directory, key, **self.extra)
        return self.sides[key]

    def close(self) -> None:
        for s in self.sides.values():
            s.close()


def _fuzz(result, suite, klass, strategy, model, side, examples, derandomize):  # type: ignore[no-untyped-def]
    @settings(
        max_examples=examples,
        derandomize=derandomize,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def one(data: st.DataObject) -> None:
        route, engine, body = data.draw(strategy)
        out = check(side(engine), engine, model, route, body)
        REPORT.add(suite, model.name, engine, out)
        result.fuzz_checked[klass] += 1
        for p in out.problems:
            result.fuzz[klass].append(Violation(klass, model.name, engine, route, p, body))

    one()
