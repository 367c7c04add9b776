"""Shared helpers for the observability tests: repository paths, promtool, and what the
metrics registry exports (every sample name and its labels, with every labelled metric
touched once so that labelled series show up)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from prometheus_client import generate_latest
from prometheus_client.metrics import MetricWrapperBase

from kvproxy.observe.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
# Labels Prometheus adds at scrape time.
TARGET_LABELS = frozenset({"job", "instance"})

F = TypeVar("F", bound=Callable[..., object])


def needs_promtool(test: F) -> F:
    """Mark a test `prometheus` and skip it, saying why, only where promtool is absent."""
    skip = pytest.mark.skipif(
        PROMTOOL is None,
        reason="promtool not installed (Debian package `prometheus`; .ci/run installs it)",
    )
    marked: F = pytest.mark.prometheus(skip(test))
    return marked


def needs_prometheus(test: F) -> F:
    """Mark a test `prometheus` and skip it only where the server or promtool is absent."""
    skip = pytest.mark.skipif(
        PROMETHEUS is None or PROMTOOL is None,
        reason="prometheus not installed (Debian package `prometheus`; .ci/run installs it)",
    )
    marked: F = pytest.mark.prometheus(skip(test))
    return marked


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], input=stdin, capture_output=True, text=True, timeout=60, check=False
    )


def touched_metrics() -> Metrics:
    """A Metrics whose every labelled metric has one child, so all sample names appear."""
    metrics = Metrics()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            # _labelnames is private but stable; there is no public accessor.
            names = value._labelnames
            if names:
                value.labels(*("x" for _ in names))
    return metrics


def exported_samples(metrics: Metrics | None = None) -> dict[str, frozenset[str]]:
    """Every sample name the registry exports, with the label names it carries."""
    registry = (metrics or touched_metrics()).registry
    found: dict[str, set[str]] = {}
    for family in registry.collect():
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(labels) for name, labels in found.items()}


def sample_families(metrics: Metrics | None = None) -> dict[str, str]:
    """Sample name -> metric family name (e.g. kvproxy_x_bucket -> kvproxy_x)."""
    registry = (metrics or touched_metrics()).registry
    return {s.name: f.name for f in registry.collect() for s in f.samples}


def exposition(metrics: Metrics | None = None) -> str:
    return generate_latest((metrics or touched_metrics()).registry).decode()


def scraped_samples(text: str) -> set[str]:
    """Sample names present (with a value) in a Prometheus text exposition."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return names
