"""The run's tally, per template and engine, for the terminal summary: bodies compared,
under-limit admissions (and the worst, in tokens), exact-count mismatches, and the largest
over-refusal near the limit (kvproxy's number minus the engine's, when kvproxy refuses a
body the engine says fits)."""

from __future__ import annotations

from dataclasses import dataclass, field

from oracles.check import Outcome


@dataclass
class Tally:
    compared: int = 0
    engine_refused: int = 0
    unmodelled: int = 0
    uncountable: int = 0
    exact: int = 0
    admitted_over: int = 0
    worst_under: int = 0
    exact_mismatch: int = 0
    over_refusals: list[int] = field(default_factory=list)

    def add(self, out: Outcome) -> None:
        if out.status == "compared":
            self.compared += 1
        elif out.status == "engine-refused":
            self.engine_refused += 1
        elif out.status == "unmodelled":
            self.unmodelled += 1
        else:
            self.uncountable += 1
        self.exact += out.exact
        if out.under:
            self.admitted_over += 1
            self.worst_under = max(self.worst_under, out.under)
        self.exact_mismatch += any("exact" in p for p in out.problems)
        if out.over_refusal is not None:
            self.over_refusals.append(out.over_refusal)


class Report:
    def __init__(self) -> None:
        self.tallies: dict[tuple[str, str, str], Tally] = {}

    def add(self, suite: str, model: str, engine: str, out: Outcome) -> None:
        self.tallies.setdefault((suite, model, engine), Tally()).add(out)

    def lines(self) -> list[str]:
        out = []
        for (suite, model, engine), t in sorted(self.tallies.items()):
            over = max(t.over_refusals) if t.over_refusals else 0
            out.append(
                f"{suite} {model} [{engine}]: {t.compared} compared ({t.exact} exact at the "
                f"limit), admitted over the limit {t.admitted_over} (worst by {t.worst_under}), "
                f"exact mismatches {t.exact_mismatch}, largest over-refusal {over} "
                f"({len(t.over_refusals)} refused at the engine's count); engine refused "
                f"{t.engine_refused}, unmodelled {t.unmodelled}, uncountable {t.uncountable}"
            )
        return out


REPORT = Report()
