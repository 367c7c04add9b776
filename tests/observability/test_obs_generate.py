"""The generated dashboard and rules: no drift, a valid Grafana model, and what on-call needs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from obs_support import REPO

from grafana import dashboard, gateway_panels, generate, rules
from grafana.promql import metric_names
from grafana.render import all_queries

OUTPUTS = {
    Path("grafana/kvproxy.json"),
    Path("grafana/PANELS.md"),
    Path("grafana/alerts.rules.yml"),
    Path("deploy/monitoring/prometheusrule.yaml"),
}
ISSUE_ALERTS = {
    "KvproxyCanaryViolation",
    "KvproxyPoolBelowDeclaredContext",
    "KvproxyCapacityUnknown",
    "KvproxyDeferredCancelTimeouts",
    "KvproxyRejectionSpike",
    "KvproxyEventLoopLag",
}


def board() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((REPO / "grafana/kvproxy.json").read_text("utf-8"))
    return data


def panels() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = board()["panels"]
    return found


def test_committed_outputs_match_the_generator() -> None:
    assert set(generate.render_all()) == OUTPUTS
    assert generate.drifted() == [], "run `make dashboard` (python -m grafana.generate)"


def test_check_mode_names_drifted_files(tmp_path: Path) -> None:
    assert set(generate.drifted(tmp_path)) == OUTPUTS
    assert set(generate.write_all(tmp_path)) == OUTPUTS
    assert generate.drifted(tmp_path) == []
    edited = tmp_path / "grafana/alerts.rules.yml"
    edited.write_text(edited.read_text() + "# hand edit\n")
    assert generate.drifted(tmp_path) == [Path("grafana/alerts.rules.yml")]
    assert generate.write_all(tmp_path) == [Path("grafana/alerts.rules.yml")]


def test_runs_as_a_script_and_as_a_module() -> None:
    for argv in (["grafana/generate.py", "--check"], ["-m", "grafana.generate", "--check"]):
        done = subprocess.run(
            [sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_generation_is_deterministic() -> None:
    assert generate.render_all() == generate.render_all()


def test_dashboard_is_an_importable_grafana_model() -> None:
    data = board()
    assert data["uid"] == dashboard.UID
    assert data["id"] is None
    assert data["schemaVersion"] >= 39
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance"} <= set(variables)
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids))


def test_panels_tile_the_grid_without_overlap() -> None:
    cells: set[tuple[int, int]] = set()
    for panel in panels():
        grid = panel["gridPos"]
        assert grid["x"] >= 0
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps at {(x, y)}"
                cells.add((x, y))


def test_every_query_uses_the_datasource_variable_and_the_filters() -> None:
    for panel in panels():
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        targets = panel["targets"]
        assert targets, panel["title"]
        assert len({t["refId"] for t in targets}) == len(targets)
        for target in targets:
            assert target["datasource"]["uid"] == "${datasource}"
            # Every selector honours the replica filter, so one replica can be isolated.
            assert target["expr"].count("{") == target["expr"].count(
                'job=~"$job",instance=~"$instance"'
            ), target["expr"]


def test_rows_the_issue_asks_for_in_on_call_order() -> None:
    titles = [p["title"] for p in panels() if p["type"] == "row"]
    assert titles == [
        "At a glance",
        "Capacity",
        "Rejections",
        "Gateway: upstream clusters",
        "Disconnects and deferred cancellation",
        "Isolation",
        "Engine posture",
        "Proxy health",
    ]


def test_gateway_row_shows_each_cluster() -> None:
    # Routing split, in-flight tokens, limits, ejections and measurement, per `upstream`.
    row = gateway_panels.GATEWAY
    by_metric: dict[str, list[str]] = {}
    for panel in row.panels:
        for query in panel.queries:
            for name in metric_names(query.expr):
                by_metric.setdefault(name, []).append(query.expr)
    for metric in (
        "kvproxy_routing_decisions_total",
        "kvproxy_upstream_inflight_prompt_tokens",
        "kvproxy_upstream_limit_tokens",
        "kvproxy_upstream_ejections_total",
        "kvproxy_upstream_ejected",
        "kvproxy_upstream_capacity_known",
    ):
        assert metric in by_metric, f"the gateway row does not show {metric}"
        assert all("upstream" in expr for expr in by_metric[metric]), metric
    assert any(p.title == "Unmeasured clusters" and p.kind == "stat" for p in row.panels)


def test_capacity_panel_draws_the_incident_gap() -> None:
    panel = next(p for p in dashboard.CAPACITY.panels if p.kind == "timeseries")
    exprs = " ".join(q.expr for q in panel.queries)
    for metric in (
        "kvproxy_pool_capacity_tokens",
        "kvproxy_engine_input_limit_tokens",
        "kvproxy_declared_context_tokens",
        "kvproxy_admission_limit_tokens",
    ):
        assert metric in exprs
    styled = {o["matcher"]["options"] for o in panel.overrides}
    assert {"declared context", "admission limit"} <= styled
    gap = next(p for p in dashboard.AT_A_GLANCE.panels if "above smallest KV pool" in p.title)
    assert gap.thresholds[-1] == (1, "red")


def test_zero_panels_turn_red() -> None:
    for row in (dashboard.AT_A_GLANCE, dashboard.ISOLATION):
        for panel in row.panels:
            if "Canary" in panel.title or "timeouts" in panel.title:
                assert panel.color_by_threshold
                assert panel.thresholds[-1] == (1, "red")
    outcome = next(p for p in dashboard.DISCONNECTS.panels if "by outcome (/s)" in p.title)
    assert any(o["matcher"]["options"] == "timeout" for o in outcome.overrides)


def test_panels_md_lists_every_panel_and_query() -> None:
    text = (REPO / "grafana/PANELS.md").read_text(encoding="utf-8")
    for row in dashboard.ROWS:
        assert f"## {row.title}" in text
        for panel in row.panels:
            assert f"### {panel.title}" in text
            for query in panel.queries:
                assert query.expr in text
    assert len(all_queries(dashboard.ROWS)) == text.count("```promql")


def test_alerts_have_severity_annotations_and_a_runbook_section() -> None:
    names = {a.name for a in rules.ALERTS}
    assert names >= ISSUE_ALERTS
    runbook = (REPO / "grafana/RUNBOOK.md").read_text(encoding="utf-8")
    for alert in rules.ALERTS:
        rule = alert.rule()
        assert rule["labels"]["severity"] == ("page" if "Canary" in alert.name else "warning")
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}
        assert rule["annotations"]["runbook_url"].endswith("#" + alert.name.lower())
        assert f"\n## {alert.name}\n" in runbook, f"RUNBOOK.md lacks a section for {alert.name}"


def test_prometheus_rule_carries_exactly_the_plain_rules() -> None:
    plain = yaml.safe_load((REPO / "grafana/alerts.rules.yml").read_text(encoding="utf-8"))
    crd = yaml.safe_load(
        (REPO / "deploy/monitoring/prometheusrule.yaml").read_text(encoding="utf-8")
    )
    assert crd["apiVersion"] == "monitoring.coreos.com/v1"
    assert crd["kind"] == "PrometheusRule"
    assert crd["metadata"]["name"] == "kvproxy"
    assert crd["spec"] == plain
    assert [r["alert"] for r in plain["groups"][0]["rules"]] == [a.name for a in rules.ALERTS]
