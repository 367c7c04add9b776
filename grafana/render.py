"""Turn the dashboard's rows into Grafana JSON and into a Markdown list of panels.

Owns: the Grafana JSON model (schema 39: rows as `row` panels, a 24-column grid packed left
to right, the `datasource` / `job` / `instance` template variables) and PANELS.md. Output is
deterministic (fixed ids, sorted keys at write time) so that the committed files can be
checked for drift. Must never invent queries: every expression comes from `grafana.dashboard`.
"""

from __future__ import annotations

from typing import Any

from grafana.model import DATASOURCE, Panel, Query, Row
from grafana.promql import to_promql

GRID_WIDTH = 24
TAGS = ("kvproxy", "kv-cache", "llm-inference")


def dashboard_json(rows: tuple[Row, ...], *, uid: str, title: str, schema: int) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    next_id = 1
    y = 0
    for row in rows:
        panels.append(
            {
                "type": "row",
                "id": next_id,
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id += 1
        y += 1
        x, line_height = 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            grid = {"h": panel.height, "w": panel.width, "x": x, "y": y}
            panels.append(_panel_json(panel, next_id, grid))
            next_id += 1
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": "kvproxy sidecar: measured KV capacity vs declared context, admission "
        "and rejections, deferred cancellation after client disconnects, canary isolation.",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": panels,
        "refresh": "30s",
        "schemaVersion": schema,
        "tags": list(TAGS),
        "templating": {"list": _variables()},
        "time": {"from": "now-3h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }


def _variables() -> list[dict[str, Any]]:
    def label_values(name: str, label: str, query: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DATASOURCE,
            "definition": query,
            "query": {"query": query, "refId": f"{name}-values", "qryType": 1},
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            # Grafana's default "All" is every listed value joined; ".*" stays short and
            # keeps working when a new replica appears between refreshes.
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "options": [],
            "regex": "",
            "sort": 1,
            "hide": 0,
        }

    return [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "options": [],
            "regex": "",
            "refresh": 1,
            "hide": 0,
            "includeAll": False,
            "multi": False,
        },
        label_values("job", "job", "label_values(kvproxy_admission_limit_tokens, job)"),
        label_values(
            "instance",
            "instance",
            'label_values(kvproxy_admission_limit_tokens{job=~"$job"}, instance)',
        ),
        # Configured model names (kvproxy.serve.models); "default" for a single-model proxy.
        label_values(
            "model",
            "model",
            'label_values(kvproxy_admission_limit_tokens{job=~"$job",instance=~"$instance"}, '
            "model)",
        ),
    ]


def _panel_json(panel: Panel, panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    steps = [{"color": color, "value": value} for value, color in panel.thresholds]
    defaults: dict[str, Any] = {
        "unit": panel.unit,
        "thresholds": {"mode": "absolute", "steps": steps},
        "color": {"mode": "thresholds" if panel.color_by_threshold else "palette-classic"},
        "mappings": list(panel.mappings),
    }
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10 if panel.stacked else 0,
            "showPoints": "never",
            "spanNulls": False,
            "axisSoftMin": 0,
            "stacking": {"mode": "normal" if panel.stacked else "none", "group": "A"},
            "thresholdsStyle": {"mode": "line" if panel.threshold_line else "off"},
        }
    return {
        "type": panel.kind,
        "id": panel_id,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": grid,
        "targets": [_target(q, i) for i, q in enumerate(panel.queries)],
        "fieldConfig": {"defaults": defaults, "overrides": list(panel.overrides)},
        "options": _options(panel),
    }


def _target(query: Query, index: int) -> dict[str, Any]:
    return {
        "datasource": DATASOURCE,
        "refId": chr(ord("A") + index),
        "expr": query.expr,
        "legendFormat": query.legend or "__auto",
        "range": True,
        "instant": False,
        "format": "heatmap" if query.heatmap else "time_series",
        "editorMode": "code",
    }


def _options(panel: Panel) -> dict[str, Any]:
    if panel.kind == "stat":
        return {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "none",
            "textMode": "value",
            "justifyMode": "center",
            "orientation": "auto",
        }
    if panel.kind == "heatmap":
        return {
            "calculate": False,
            "yAxis": {"axisPlacement": "left", "unit": panel.unit},
            "rowsFrame": {"layout": "auto"},
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
            "cellGap": 1,
            "tooltip": {"mode": "single", "yHistogram": True},
            "legend": {"show": True},
        }
    return {
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }


def panels_markdown(rows: tuple[Row, ...], *, title: str) -> str:
    out = [
        f"# {title}: panels and queries",
        "",
        "Generated by `python -m grafana.generate` (`make dashboard`) from `grafana/dashboard.py`;",
        "do not edit by hand. Import `grafana/kvproxy.json` into Grafana 10.4+ and pick a",
        "Prometheus data source. `$job` / `$instance` filter replicas and `$model` the "
        "model-labelled series; `$__rate_interval` and",
        "`$__range` are Grafana's. Alert rules: `grafana/alerts.rules.yml`; runbook:",
        "`grafana/RUNBOOK.md`.",
        "",
    ]
    for row in rows:
        out += [f"## {row.title}", ""]
        for panel in row.panels:
            kind = f"*{panel.kind}, unit `{panel.unit}`.*"
            out += [f"### {panel.title}", "", f"{kind} {panel.description}", ""]
            for query in panel.queries:
                legend = query.legend or "(auto)"
                out += [f"- legend `{legend}`:", "", "  ```promql", f"  {query.expr}", "  ```"]
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def all_queries(rows: tuple[Row, ...]) -> list[tuple[str, str]]:
    """(panel title, plain PromQL) for every query, Grafana variables substituted."""
    return [(p.title, to_promql(q.expr)) for row in rows for p in row.panels for q in p.queries]
