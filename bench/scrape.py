"""Reads kvproxy's own /metrics before and after a run and turns deltas into figures.

Owns: scraping (stdlib HTTP), histogram deltas, quantiles the way Prometheus'
`histogram_quantile` computes them (linear inside the bucket), and mean durations per
label. Must never: reset or write anything on the proxy.
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]


def scrape(admin_url: str) -> Samples:
    with urllib.request.urlopen(admin_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@dataclass(frozen=True)
class HistDelta:
    """What one histogram (one label set) observed between two scrapes."""

    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), +Inf last
    count: float
    total: float

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """Prometheus' estimate: linear within the bucket holding rank q; the last finite
        bound when the rank falls in +Inf (an under-estimate then, said in the report)."""
        if not self.count:
            return math.nan
        rank = q * self.count
        prev_bound, prev_count = 0.0, 0.0
        for bound, cum in self.buckets:
            if cum >= rank:
                if math.isinf(bound):
                    return prev_bound
                width = cum - prev_count
                frac = (rank - prev_count) / width if width else 1.0
                return prev_bound + (bound - prev_bound) * frac
            prev_bound, prev_count = bound, cum
        return prev_bound

    def at_most(self, q: float) -> float:
        """The upper bound of the bucket holding rank q: a guaranteed ceiling for p(q)."""
        if not self.count:
            return math.nan
        rank = q * self.count
        for bound, cum in self.buckets:
            if cum >= rank:
                return bound
        return math.inf


def hist_delta(before: Samples, after: Samples, name: str, **labels: str) -> HistDelta:
    key_labels = tuple(sorted(labels.items()))
    bounds: dict[float, float] = {}
    for (sample, lbls), v in after.items():
        if sample != f"{name}_bucket":
            continue
        rest = tuple(kv for kv in lbls if kv[0] != "le")
        if rest != key_labels:
            continue
        le = dict(lbls)["le"]
        bounds[float(le)] = v - before.get((sample, lbls), 0.0)
    count = value(after, f"{name}_count", **labels) - value(before, f"{name}_count", **labels)
    total = value(after, f"{name}_sum", **labels) - value(before, f"{name}_sum", **labels)
    return HistDelta(tuple(sorted(bounds.items())), count, total)


def label_values(samples: Samples, name: str, label: str) -> list[str]:
    """Every value `label` takes on the samples of `name` (e.g. counting methods)."""
    seen: list[str] = []
    for sample, lbls in samples:
        if sample == name:
            v = dict(lbls).get(label)
            if v is not None and v not in seen:
                seen.append(v)
    return seen
