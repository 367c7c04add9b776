"""Metric children are bound once per label set (metrics._CachedLabels) and still export
exactly what prometheus_client's own `labels` would."""

from __future__ import annotations

import math
from pathlib import Path

import prometheus_client
import pytest
from metric_contract import contract_text
from prometheus_client import CollectorRegistry, generate_latest

from kvproxy.observe import metrics
from kvproxy.observe.metrics import Metrics


def test_labels_returns_the_registered_child_every_time() -> None:
    m = Metrics()
    first = m.responses_total.labels("chat", "200")
    assert m.responses_total.labels("chat", "200") is first
    # The same child prometheus_client itself keeps: keyword lookups reach it too.
    assert m.responses_total.labels(route="chat", status="200") is first
    first.inc()
    m.responses_total.labels("chat", "200").inc()
    m.request_duration.labels("chat").observe(0.5)
    text = generate_latest(m.registry).decode()
    assert 'kvproxy_responses_total{route="chat",status="200"} 2.0' in text
    assert 'kvproxy_request_duration_seconds_count{route="chat"} 1.0' in text


def test_past_the_cache_bound_labels_still_work() -> None:
    m = Metrics()
    for i in range(metrics.MAX_CACHED_CHILDREN + 5):
        m.rejections.labels(f"r{i}", "default").inc()
    assert len(m.rejections._kv_children) == metrics.MAX_CACHED_CHILDREN  # type: ignore[attr-defined]
    last = f"r{metrics.MAX_CACHED_CHILDREN + 4}"
    m.rejections.labels(last, "default").inc()
    exported = generate_latest(m.registry).decode()
    assert f'kvproxy_rejections_total{{model="default",reason="{last}"}} 2.0' in exported


def test_observe_lands_where_the_librarys_own_observe_does() -> None:
    # The bisecting observe against prometheus_client's loop, on the bounds themselves,
    # either side of them, negatives, infinities and NaN: the same bucket counts and sum.
    bounds = (0.001, 0.01, 0.1, 1.0, 10.0)
    ours = metrics.Histogram("h", "h", ["r"], buckets=bounds, registry=CollectorRegistry())
    ref = prometheus_client.Histogram("h", "h", ["r"], buckets=bounds, registry=CollectorRegistry())
    values = [-1.0, 0.0, math.inf, -math.inf, math.nan, 1e-9, 1e9]
    for b in bounds:
        values += [b, math.nextafter(b, -math.inf), math.nextafter(b, math.inf)]
    for v in values:
        ours.labels("x").observe(v)
        ref.labels("x").observe(v)

    def samples(h: prometheus_client.Histogram) -> list[tuple[str, dict[str, str], float]]:
        return [
            (s.name, sorted(s.labels.items()), s.value)
            for m in h.collect()
            for s in m.samples
            if not s.name.endswith("_created")
        ]

    got, want = samples(ours), samples(ref)
    assert [s[:2] for s in got] == [s[:2] for s in want]
    for (_, _, a), (_, _, b) in zip(got, want, strict=True):
        assert a == b or (math.isnan(a) and math.isnan(b))
    # A labelled parent without a child is refused, as by the library.
    with pytest.raises(ValueError):
        ours.observe(1.0)


def test_values_are_lock_free_and_export_what_the_library_would() -> None:
    """kvproxy's values take no lock (metrics.LoopValue: written on the loop only); the same
    operations on prometheus_client's own classes export the same samples."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    built = []
    for reg, mod in ((ours, metrics), (theirs, prometheus_client)):
        c = mod.Counter("c", "h", ["a"], registry=reg)
        h = mod.Histogram("h", "h", ["a"], buckets=(0.1, 1.0), registry=reg)
        g = mod.Gauge("g", "h", registry=reg)
        plain = mod.Counter("p", "h", registry=reg)
        c.labels("x").inc()
        c.labels("x").inc(2.5)
        for v in (0.05, 0.1, 0.5, 7.0):
            h.labels("y").observe(v)
        g.inc(3)
        g.dec(1)
        g.set(g._value.get() + 4)
        plain.inc()
        built.append((c, h, g, plain))

    def samples(reg: CollectorRegistry) -> list[tuple[str, list[tuple[str, str]], float]]:
        return sorted(
            (s.name, sorted(s.labels.items()), s.value)
            for fam in reg.collect()
            for s in fam.samples
            if not s.name.endswith("_created")
        )

    assert samples(ours) == samples(theirs)
    c, h, g, plain = built[0]
    assert type(c.labels("x")._value) is metrics.LoopValue
    assert type(g._value) is metrics.LoopValue
    assert all(type(b) is metrics.LoopValue for b in h.labels("y")._buckets)
    # The library's checks still hold on the fast paths.
    with pytest.raises(ValueError, match="non-negative"):
        c.labels("x").inc(-1)
    with pytest.raises(ValueError, match="missing label values"):
        c.inc()
    with pytest.raises(ValueError, match="missing label values"):
        h.observe(1.0)


def test_the_exported_families_are_the_contract_fixture() -> None:
    # Names, types, label names, buckets, help and the pre-created series of a fresh proxy,
    # byte for byte as before the families became a table (metric_contract.py rewrites it).
    expected = (Path(__file__).parent / "fixtures" / "metric_families.txt").read_text()
    assert contract_text() == expected


def test_every_family_is_a_typed_attribute_of_its_class() -> None:
    # The class annotations are what callers (and mypy) see; the table is what is built.
    annotations = dict(Metrics.__annotations__)
    assert list(annotations) == [f.attr for f in metrics.FAMILIES]
    classes = {
        ("counter", True): ("Counter", metrics.Counter),
        ("gauge", True): ("Gauge", metrics.Gauge),
        ("histogram", True): ("Histogram", metrics.Histogram),
        ("gauge", False): ("prometheus_client.Gauge", prometheus_client.Gauge),
    }
    m = Metrics()
    for family in metrics.FAMILIES:
        annotation, cls = classes[family.kind, family.cached]
        assert annotations[family.attr] == annotation
        built = getattr(m, family.attr)
        assert type(built) is cls
        assert built._labelnames == family.labels
