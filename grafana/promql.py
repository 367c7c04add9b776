"""Small PromQL helpers shared by the dashboard, the rules and their tests.

Owns: building selectors with the dashboard's filter variables, turning a Grafana query into
plain PromQL (so promtool and Prometheus can run it), and listing which metric names and
label names an expression reads. The last is a lexical scan, not a parser: it is exact for
the expressions this package writes (promtool does the real parsing in tests) and must never
be used to judge PromQL it did not write.
"""

from __future__ import annotations

import re

# Grafana multi-value variables expand to a regex alternation, hence `=~`.
DASHBOARD_FILTER = 'job=~"$job",instance=~"$instance"'

# What Grafana would substitute; the values only need to be valid PromQL.
GRAFANA_DEFAULTS: dict[str, str] = {
    "$__rate_interval": "1m",
    "$__interval": "30s",
    "$__range": "1h",
    "$job": ".*",
    "$instance": ".*",
    "$model": ".*",
}

_KEYWORDS = frozenset(
    {
        "and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
        "group_right", "bool", "offset", "inf", "nan", "atan2", "start", "end",
    }
)  # fmt: skip
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")


# Families with a `model` label (kvproxy.observe.metrics: limits, decisions, counts); the
# dashboard's `$model` variable filters only these, so a chosen model never hides the
# replica-wide series (event loop, drains) that have no model.
MODEL_LABELLED = frozenset({
    "kvproxy_requests_total",
    "kvproxy_rejections_total",
    "kvproxy_admission_limit_tokens",
    "kvproxy_decode_limit_tokens",
    "kvproxy_declared_context_tokens",
    "kvproxy_capacity_known",
    "kvproxy_pool_capacity_tokens",
    "kvproxy_engine_input_limit_tokens",
    "kvproxy_inflight_prompt_tokens",
    "kvproxy_inflight_prompt_tokens_limit",
    "kvproxy_queue_depth",
    "kvproxy_budget_cluster_prompt_tokens",
    "kvproxy_prompt_tokens_bucket",
    "kvproxy_prompt_tokens",
    "kvproxy_token_bound_exceeded_total",
    "kvproxy_unverified_features_total",
    "kvproxy_routing_decisions_total",
    "kvproxy_upstream_ejections_total",
    "kvproxy_upstream_ejected",
    "kvproxy_upstream_restores_total",
    "kvproxy_upstream_ejections_capped_total",
    "kvproxy_upstream_outcomes_total",
    "kvproxy_affinity_spills_total",
    "kvproxy_upstream_inflight_prompt_tokens",
    "kvproxy_upstream_limit_tokens",
    "kvproxy_upstream_capacity_known",
})  # fmt: skip
MODEL_FILTER = 'model=~"$model"'


def sel(metric: str, matchers: str = "") -> str:
    """`metric{<dashboard filter>,matchers}` for dashboard queries (plus `$model` for the
    model-labelled families)."""
    inner = DASHBOARD_FILTER
    if metric in MODEL_LABELLED:
        inner += "," + MODEL_FILTER
    if matchers:
        inner += "," + matchers
    return f"{metric}{{{inner}}}"


def to_promql(expr: str, overrides: dict[str, str] | None = None) -> str:
    """Replace Grafana's variables with fixed values (longest names first)."""
    values = {**GRAFANA_DEFAULTS, **(overrides or {})}
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(name, values[name])
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (functions, keywords and labels excluded)."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery durations
    text = re.sub(r"\boffset\s+\w+", " ", text)
    names: set[str] = set()
    for match in _IDENT.finditer(text):
        word = match.group(0)
        rest = text[match.end() :].lstrip()
        if rest.startswith("("):  # a function call
            continue
        if word.lower() in _KEYWORDS or _is_number(text, match.start()):
            continue
        names.add(word)
    return names


def selector_labels(expr: str) -> dict[str, set[str]]:
    """Label names used in matchers, per metric name (`m{a="x"}` -> {"m": {"a"}})."""
    found: dict[str, set[str]] = {}
    for metric, body in _SELECTOR.findall(_STRING.sub('""', expr)):
        found.setdefault(metric, set()).update(_MATCHER_LABEL.findall(body))
    return found


def grouping_labels(expr: str) -> set[str]:
    """Label names in by/without/on/ignoring/group_* clauses."""
    labels: set[str] = set()
    for _, body in _GROUPING.findall(_STRING.sub('""', expr)):
        labels.update(part.strip() for part in body.split(",") if part.strip())
    return labels


def _is_number(text: str, start: int) -> bool:
    # Exponents such as 1e3 look like identifiers after a digit.
    return start > 0 and (text[start - 1].isdigit() or text[start - 1] == ".")
