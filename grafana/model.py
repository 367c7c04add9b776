"""The dashboard's vocabulary: queries, panels, rows, and helpers that write common PromQL.

Owns: the frozen data types `grafana.dashboard` fills and `grafana.render` turns into
Grafana JSON and Markdown. Holds no panel of its own and never touches files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from grafana.promql import sel

PanelKind = Literal["timeseries", "stat", "heatmap"]

RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

GREEN_ONLY: tuple[tuple[float | None, str], ...] = ((None, "green"),)
RED_FROM_ONE: tuple[tuple[float | None, str], ...] = ((None, "green"), (1, "red"))


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    heatmap: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    kind: PanelKind
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    width: int = 8
    height: int = 8
    thresholds: tuple[tuple[float | None, str], ...] = GREEN_ONLY
    # Threshold colours drive the line/background colour instead of the palette.
    color_by_threshold: bool = False
    threshold_line: bool = False
    overrides: tuple[dict[str, Any], ...] = ()
    mappings: tuple[dict[str, Any], ...] = ()
    stacked: bool = False


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def zero_if_absent(expr: str, label: str) -> str:
    """`expr`, or one series `{label="none"}` at 0 when the metric was never touched."""
    return f'{expr} or on() label_replace(vector(0), "{label}", "none", "", "")'


def quantiles(metric: str, by: str, qs: tuple[float, ...], legend: str) -> tuple[Query, ...]:
    """histogram_quantile queries over `metric`_bucket for each q, grouped by `by`."""
    group = f"le, {by}" if by else "le"
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by ({group}) (rate({sel(metric + '_bucket')}[{RATE}])))",
            f"p{round(q * 100)} {legend}".strip(),
        )
        for q in qs
    )


def styled(name: str, color: str, *, width: int = 2, dashed: bool = False) -> dict[str, Any]:
    props: list[dict[str, Any]] = [
        {"id": "color", "value": {"mode": "fixed", "fixedColor": color}},
        {"id": "custom.lineWidth", "value": width},
    ]
    if dashed:
        props.append({"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 6]}})
    return {"matcher": {"id": "byName", "options": name}, "properties": props}


def right_axis(name: str, unit: str) -> dict[str, Any]:
    return {
        "matcher": {"id": "byName", "options": name},
        "properties": [
            {"id": "custom.axisPlacement", "value": "right"},
            {"id": "unit", "value": unit},
        ],
    }
