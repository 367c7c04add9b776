"""The corpus (one or more named bodies per class of issue #30, and their siblings) through
every oracle it applies to, on one model of each template family (slow: on every shipped
template), against kvproxy's decision.

(a) `test_never_admitted_over_the_engine_count`: at a limit one token under the engine's
count kvproxy refuses (refusals are always safe). (b) `test_exact_is_the_engine_count`:
where kvproxy reports an exact count at the engine's limit, it is the engine's count.
Known kvproxy failures are xfail(strict=True) from `known_failures.py`.
"""

from __future__ import annotations

import pytest

from oracles.check import Outcome
from oracles.corpus import CASES
from oracles.known_failures import EXACT_MISMATCH_TODAY, SLOW_UNDER_TODAY, UNDER_TODAY
from oracles.run import Result

# The first test to ask for a run builds it (a model at a time: ~1-2 min of CPU for the fast
# form, far more for the slow one), so the per-test timeout must cover that.
pytestmark = pytest.mark.timeout(1800)
SLOW_TIMEOUT_S = 6 * 3600


def _params(known: dict[tuple[str, str], str]) -> list[object]:
    out: list[object] = []
    for case in CASES:
        for engine in case.engines:
            why = known.get((case.name, engine))
            marks = [pytest.mark.xfail(strict=True, reason=f"#30 {why}")] if why else []
            out.append(pytest.param(case.name, engine, marks=marks, id=f"{case.name}-{engine}"))
    return out


def _admitted_over(results: list[tuple[str, Outcome]]) -> list[str]:
    assert results, "no model of the run could judge this case"
    return [f"{m}: {p}" for m, o in results for p in o.problems if not p.startswith("kvproxy says")]


def _inexact(results: list[tuple[str, Outcome]]) -> list[str]:
    return [f"{m}: {p}" for m, o in results for p in o.problems if p.startswith("kvproxy says")]


@pytest.mark.parametrize(("name", "engine"), _params(UNDER_TODAY))
def test_never_admitted_over_the_engine_count(name: str, engine: str, fast_run: Result) -> None:
    bad = _admitted_over(fast_run.corpus.get((name, engine), []))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("name", "engine"), _params(EXACT_MISMATCH_TODAY))
def test_exact_is_the_engine_count(name: str, engine: str, fast_run: Result) -> None:
    bad = _inexact(fast_run.corpus.get((name, engine), []))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("engine", ["sglang", "vllm", "smg+sglang"])
def test_plain_chat_is_exact_and_admitted_at_exactly_the_limit(
    engine: str, fast_run: Result
) -> None:
    """Legal prompts stay admissible: the everyday chat (system/user/assistant, lowercase,
    no tools) is counted exactly and admitted with the limit at the engine's count, on one
    model of every family."""
    results = fast_run.corpus[("plain-chat", engine)]
    assert len(results) == 9
    for m, out in results:
        assert out.status == "compared", (m, out.status)
        assert out.exact, (m, out)
        assert out.over_refusal is None, (m, out)
        assert not out.problems, (m, out)


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.timeout(SLOW_TIMEOUT_S)
@pytest.mark.parametrize(("name", "engine"), _params(SLOW_UNDER_TODAY))
def test_never_admitted_over_the_engine_count_on_every_template(
    name: str, engine: str, slow_run: Result
) -> None:
    bad = _admitted_over(slow_run.corpus.get((name, engine), []))
    assert not bad, "\n".join(bad)
