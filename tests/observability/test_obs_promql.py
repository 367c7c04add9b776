"""Every PromQL expression (dashboard and alerts) parses and reads only what kvproxy exports.

"Exports" is taken from the one registry (`kvproxy.observe.metrics.Metrics`) with every labelled
metric touched once: a fresh process shows labelled families only as HELP/TYPE lines until
a first request, reason or engine creates a child, so an untouched registry would hide
them. The end-to-end test (test_obs_e2e.py) checks the same names against a live scrape
after real traffic.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from obs_support import TARGET_LABELS, exported_samples, needs_promtool, promtool, sample_families

from grafana import dashboard, rules
from grafana.promql import grouping_labels, metric_names, selector_labels, to_promql
from grafana.render import all_queries

# Metrics deliberately left off the dashboard; keep this empty unless there is a reason.
NOT_ON_DASHBOARD: frozenset[str] = frozenset()


def every_expression() -> list[tuple[str, str]]:
    found = [(f"panel {title!r}", expr) for title, expr in all_queries(dashboard.ROWS)]
    found += [(f"alert {a.name}", a.expr) for a in rules.ALERTS]
    return found


def test_metric_names_skips_functions_keywords_labels_and_durations() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, method) (rate(a_bucket{job=~"x",b="c"}[5m])))'
        ' / on (job) group_left () b_total offset 10m or on() label_replace(vector(0), "t",'
        ' "none", "", "") and c > 1e3 unless d'
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "d"}
    assert selector_labels(expr) == {"a_bucket": {"job", "b"}}
    assert grouping_labels(expr) == {"le", "method", "job"}


def test_grafana_variables_become_plain_promql() -> None:
    expr = 'sum(rate(m{job=~"$job",instance=~"$instance"}[$__rate_interval])) + x[$__range]'
    assert to_promql(expr) == 'sum(rate(m{job=~".*",instance=~".*"}[1m])) + x[1h]'


@pytest.mark.parametrize(("where", "expr"), every_expression())
def test_expression_reads_only_exported_samples_and_their_labels(where: str, expr: str) -> None:
    exported = exported_samples()
    names = metric_names(expr)
    assert names, f"{where}: no metric found in {expr}"
    missing = sorted(n for n in names if n not in exported)
    assert not missing, f"{where}: kvproxy does not export {missing}"
    for metric, labels in selector_labels(expr).items():
        unknown = labels - exported[metric] - TARGET_LABELS
        assert not unknown, f"{where}: {metric} has no label(s) {sorted(unknown)}"
    known = set(TARGET_LABELS).union(*(exported[n] for n in names))
    unknown = grouping_labels(expr) - known
    assert not unknown, f"{where}: grouping by label(s) no selected metric has: {unknown}"


def test_every_exported_family_is_on_the_dashboard() -> None:
    family = sample_families()
    shown = {family[n] for _, e in all_queries(dashboard.ROWS) for n in metric_names(e)}
    families = set(family.values())
    missing = sorted(families - shown - NOT_ON_DASHBOARD)
    assert not missing, f"add a panel in grafana/dashboard.py for {missing}"


@needs_promtool
def test_promtool_parses_every_expression(tmp_path: Path) -> None:
    exprs = every_expression()
    group = {
        "name": "parse-only",
        "rules": [
            {"record": f"kvproxy_parse_check_{i}", "expr": expr}
            for i, (_, expr) in enumerate(exprs)
        ],
    }
    path = tmp_path / "parse.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [group]}), encoding="utf-8")
    done = promtool("check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in done.stdout
