"""Alert rules pass promtool's checks and unit tests; every alert is tested both ways; the
metrics exposition passes `promtool check metrics` (naming and help-text lint)."""

from __future__ import annotations

from pathlib import Path

import yaml
from obs_support import REPO, exposition, needs_promtool, promtool

from grafana import rules

RULES = REPO / "grafana/alerts.rules.yml"
UNIT_TESTS = REPO / "grafana/alerts.test.yml"
OPERATOR_RULE = REPO / "deploy/monitoring/prometheusrule.yaml"


def test_every_alert_has_a_firing_case_and_a_quiet_case() -> None:
    cases = yaml.safe_load(UNIT_TESTS.read_text(encoding="utf-8"))
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in cases["tests"]:
        for check in case["alert_rule_test"]:
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {a.name for a in rules.ALERTS}
    assert names - fired == set(), "alerts with no firing unit test"
    assert names - quiet == set(), "alerts with no near-miss unit test"
    assert cases["rule_files"] == ["alerts.rules.yml"]


@needs_promtool
def test_promtool_check_rules_on_the_rules_file() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules.ALERTS)} rules found" in done.stdout


@needs_promtool
def test_promtool_check_rules_on_the_prometheus_rule_spec(tmp_path: Path) -> None:
    spec = yaml.safe_load(OPERATOR_RULE.read_text(encoding="utf-8"))["spec"]
    path = tmp_path / "operator.rules.yml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    done = promtool("check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_promtool_unit_tests_for_every_alert() -> None:
    done = promtool("test", "rules", str(UNIT_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


@needs_promtool
def test_promtool_unit_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    # Guards against unit tests that pass whatever the rules say.
    broken = RULES.read_text(encoding="utf-8").replace("kvproxy_capacity_known == 0", "vector(0)")
    (tmp_path / "alerts.rules.yml").write_text(broken, encoding="utf-8")
    (tmp_path / "alerts.test.yml").write_text(UNIT_TESTS.read_text(encoding="utf-8"))
    done = promtool("test", "rules", str(tmp_path / "alerts.test.yml"))
    assert done.returncode != 0
    assert "KvproxyCapacityUnknown" in done.stdout + done.stderr


@needs_promtool
def test_promtool_check_metrics_on_every_series() -> None:
    # Every labelled family touched, so the lint sees samples, not only HELP/TYPE lines.
    done = promtool("check", "metrics", stdin=exposition())
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "", done.stdout


@needs_promtool
def test_promtool_unit_tests_catch_gateway_alerts_on_a_lone_cluster(tmp_path: Path) -> None:
    # The gateway alerts hold only for models with several clusters; counting a lone
    # cluster (the single-upstream forms) must make the unit tests fail on each of them.
    clause = "(kvproxy_upstream_capacity_known) > 1)"
    text = RULES.read_text(encoding="utf-8")
    assert text.count(clause) == 3
    (tmp_path / "alerts.rules.yml").write_text(text.replace(clause, clause[:-3] + "0)"))
    (tmp_path / "alerts.test.yml").write_text(UNIT_TESTS.read_text(encoding="utf-8"))
    done = promtool("test", "rules", str(tmp_path / "alerts.test.yml"))
    assert done.returncode != 0
    for name in (
        "KvproxyUpstreamUnmeasured",
        "KvproxyUpstreamEjected",
        "KvproxyPromptsFitNoCluster",
    ):
        assert f"alertname: {name}" in done.stdout + done.stderr
