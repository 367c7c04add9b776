"""The mutation fuzzer: bodies drawn per class of mutation (`fuzz.CLASSES`) on one model of
every template family, each through the oracle of the engine it was drawn for and through
kvproxy's decision (`check.check`: (a) refused one token under the engine's count, (b) an
exact count is the engine's). Seeded (derandomized); `KVPROXY_ORACLE_FAST_EXAMPLES` per class
and model in `make test`, `KVPROXY_ORACLE_SLOW_EXAMPLES` on every shipped template in the slow
suite. The per-template largest over-refusal is in the terminal summary.

A class that fails today because of a kvproxy bug is xfail(strict=True) (`known_failures.py`).
"""

from __future__ import annotations

import pytest

from oracles.fuzz import CLASSES
from oracles.known_failures import FUZZ_FAST_TODAY, FUZZ_SLOW_TODAY
from oracles.run import Result, Violation

# The first test to ask for a run builds it (a model at a time: ~1-2 min of CPU for the fast
# form, far more for the slow one), so the per-test timeout must cover that.
pytestmark = pytest.mark.timeout(1800)
SLOW_TIMEOUT_S = 6 * 3600


def _params(known: dict[str, str]) -> list[object]:
    return [
        pytest.param(
            k,
            marks=[pytest.mark.xfail(strict=True, reason=f"#30 {known[k]}")] if k in known else [],
        )
        for k in CLASSES
    ]


def _summary(violations: list[Violation]) -> str:
    worst: dict[tuple[str, str], Violation] = {}
    for v in violations:
        worst.setdefault((v.model, v.engine), v)
    return "\n".join(
        f"{v.model} [{v.engine}] {v.route}: {v.problem}\n    body: {v.body[:400]!r}"
        for v in worst.values()
    )


@pytest.mark.parametrize("klass", _params(FUZZ_FAST_TODAY))
def test_fuzzed_bodies_are_never_admitted_over_and_exact_is_exact(
    klass: str, fast_run: Result
) -> None:
    assert fast_run.fuzz_checked[klass] > 0
    violations = fast_run.fuzz.get(klass, [])
    assert not violations, f"{len(violations)} violations\n" + _summary(violations)


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.timeout(SLOW_TIMEOUT_S)
@pytest.mark.parametrize("klass", _params(FUZZ_SLOW_TODAY))
def test_fuzzed_bodies_on_every_template(klass: str, slow_run: Result) -> None:
    assert slow_run.fuzz_checked[klass] > 0
    violations = slow_run.fuzz.get(klass, [])
    assert not violations, f"{len(violations)} violations\n" + _summary(violations)
