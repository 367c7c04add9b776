"""Metric children are bound once per label set (metrics._CachedLabels) and still export
exactly what prometheus_client's own `labels` would."""

from __future__ import annotations

from prometheus_client import generate_latest

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
