"""kvproxy's Prometheus alert rules, one source for the rules file and the PrometheusRule.

Owns: each alert's expression, hold time, severity, summary and description, and the two
documents built from them (`grafana/alerts.rules.yml` for plain Prometheus and
`deploy/monitoring/prometheusrule.yaml` for the Prometheus Operator). Every alert has a
section of the same name in grafana/RUNBOOK.md and unit tests in grafana/alerts.test.yml.
Annotations carry sizes, engines and tenants, never prompt text (I8).

Expressions aggregate `by (job, instance)` so one alert names one kvproxy replica; engine,
tenant and model labels are kept where they say what to fix: capacity, pool and rejection
alerts are per model (kvproxy.serve.models), so one model's outage or limit is named as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GROUP = "kvproxy"
# Where alert notifications link to; the section anchor is the alert name in lower case.
# Point it at your own copy (e.g. a repository URL) when deploying.
RUNBOOK = "grafana/RUNBOOK.md"
# p99 event-loop lag that makes every request on a replica wait (the dashboard draws it).
LOOP_LAG_SECONDS = 0.1
# Share of requests rejected, and a minimum rate so that three rejected requests out of ten
# at 3 a.m. do not page anyone.
REJECTED_SHARE = 0.10
REJECTED_MIN_PER_S = 0.05
# increase() extrapolates to the window's edges (1 event can read 1.07); say "about N".
ROUNDED_VALUE = '{{ $value | printf "%.0f" }}'


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    severity: str
    summary: str
    description: str
    hold: str = "0m"

    def rule(self) -> dict[str, Any]:
        rule: dict[str, Any] = {"alert": self.name, "expr": self.expr}
        if self.hold != "0m":
            rule["for"] = self.hold
        rule["labels"] = {"severity": self.severity}
        rule["annotations"] = {
            "summary": self.summary,
            "description": self.description,
            "runbook_url": f"{RUNBOOK}#{self.name.lower()}",
        }
        return rule


CORE_ALERTS: tuple[Alert, ...] = (
    Alert(
        "KvproxyCanaryViolation",
        # The second clause catches a tenant's first violation: its series is born at 1,
        # which increase() cannot see (it needs two samples).
        "sum by (job, instance, tenant) (increase(kvproxy_canary_violations_total[10m])) > 0\n"
        "or\n"
        "sum by (job, instance, tenant) (\n"
        "  kvproxy_canary_violations_total unless kvproxy_canary_violations_total offset 10m\n"
        ") > 0\n",
        "page",
        "Tenant {{ $labels.tenant }} received another tenant's canary marker",
        "kvproxy {{ $labels.instance }} saw a response to tenant {{ $labels.tenant }} carrying "
        "another tenant's canary marker in the last 10 minutes. Treat it as a cross-tenant "
        "data leak: stop rollouts, keep the engines' logs, follow the runbook.",
    ),
    Alert(
        "KvproxyPoolBelowDeclaredContext",
        "kvproxy_pool_capacity_tokens\n"
        "  < on (job, instance, model) group_left ()\n"
        "kvproxy_declared_context_tokens\n",
        "warning",
        "Engine {{ $labels.engine }} KV pool is smaller than the declared context",
        "Engine {{ $labels.engine }} ({{ $labels.role }}, {{ $labels.source }}) of model "
        "{{ $labels.model }} reports a KV pool of " + ROUNDED_VALUE + " tokens, below the "
        "context declared for that model to kvproxy {{ $labels.instance }}. kvproxy rejects "
        "prompts above the pool with 400 "
        "context_length_exceeded; clients promised the declared context will hit them.",
        hold="5m",
    ),
    Alert(
        "KvproxyCapacityUnknown",
        "kvproxy_capacity_known == 0\n",
        "warning",
        "kvproxy {{ $labels.instance }} has no fresh KV capacity measurement for model "
        "{{ $labels.model }}",
        "kvproxy {{ $labels.instance }} could not measure every engine of model "
        "{{ $labels.model }} within its stale limit. It refuses that model's inference with "
        "503 capacity_unknown (unless a fallback limit is configured); with several models, "
        "/readyz follows the `readiness` setting.",
        hold="2m",
    ),
    Alert(
        "KvproxyDeferredCancelTimeouts",
        "sum by (job, instance) (\n"
        '  increase(kvproxy_deferred_cancellations_total{outcome="timeout"}[15m])\n'
        ") > 0\n",
        "warning",
        "Deferred cancellations on {{ $labels.instance }} ended by timeout",
        "kvproxy {{ $labels.instance }} closed about " + ROUNDED_VALUE + " upstream(s) in the "
        "last 15 minutes because the drain timeout passed, not because the KV transfer was "
        "seen to finish. A timeout does not prove that writes into decode pages stopped.",
    ),
    Alert(
        "KvproxyRejectionSpike",
        "(\n"
        "  sum by (job, instance, model) (rate(kvproxy_rejections_total[5m]))\n"
        "/\n"
        "  sum by (job, instance, model) (rate(kvproxy_requests_total[5m]))\n"
        f") > {REJECTED_SHARE}\n"
        "and\n"
        "sum by (job, instance, model) (rate(kvproxy_rejections_total[5m]))"
        f" > {REJECTED_MIN_PER_S}\n",
        "warning",
        "kvproxy {{ $labels.instance }} rejects many requests for model {{ $labels.model }}",
        "{{ $value | humanizePercentage }} of requests for model {{ $labels.model }} "
        "(_unknown: names no configured model) to kvproxy {{ $labels.instance }} were "
        "rejected over the last 5 minutes. See the rejections-by-reason panel: "
        "context_length means prompts above the measured limit, capacity_unknown means no "
        "measurement, over_budget means the in-flight budget is full.",
        hold="10m",
    ),
    Alert(
        "KvproxyEventLoopLag",
        f"histogram_quantile(0.99,\n"
        f"  sum by (job, instance, le) (rate(kvproxy_event_loop_lag_seconds_bucket[5m]))\n"
        f") > {LOOP_LAG_SECONDS}\n",
        "warning",
        "kvproxy {{ $labels.instance }} event loop is stalling",
        "The p99 event-loop lag of kvproxy {{ $labels.instance }} is {{ $value | humanize }}s. "
        "Every request and every deferred cancellation on this replica waits that long.",
        hold="10m",
    ),
    Alert(
        "KvproxyTokenBoundExceeded",
        "sum by (job, instance, model) (\n"
        "  increase(kvproxy_token_bound_exceeded_total[30m])\n"
        ") > 0\n",
        "warning",
        "Engine counted more prompt tokens than kvproxy on {{ $labels.instance }} for model "
        "{{ $labels.model }}",
        "An engine reported usage.prompt_tokens above kvproxy's count or bound about "
        + ROUNDED_VALUE
        + " time(s) in the last 30 minutes on {{ $labels.instance }} for model "
        "{{ $labels.model }}: that model's configured tokenizer does not match it, so its "
        "prompts near the limit may be admitted above it (I1).",
    ),
    Alert(
        "KvproxyBudgetRedisUnavailable",
        "max by (job, instance) (kvproxy_budget_backend_degraded) > 0\n",
        "warning",
        "kvproxy {{ $labels.instance }} cannot reach the cluster budget's Redis",
        "kvproxy {{ $labels.instance }} has been without Redis for 2 minutes: its "
        "redis_unavailable policy applies (local_share: it enforces its share of the budget "
        "on its own; reject: new requests get 503 budget_unavailable).",
        hold="2m",
    ),
    Alert(
        "KvproxyBudgetLeasesExpired",
        "sum by (job, instance) (increase(kvproxy_budget_lease_expiries_total[15m])) > 0\n",
        "warning",
        "Budget leases expired (a kvproxy replica died holding them)",
        "kvproxy {{ $labels.instance }} reclaimed about "
        + ROUNDED_VALUE
        + " expired budget lease(s) in the last 15 minutes: a replica died (or lost Redis "
        "longer than the lease TTL) while its requests held budget. The budget healed; find "
        "out why the replica died.",
    ),
    Alert(
        "KvproxyEngineAdvisory",
        "max by (job, instance, engine, advisory) (\n"
        '  kvproxy_engine_advisory{advisory!="kv-checksum-one-sided"}\n'
        ") == 1\n",
        "warning",
        "Engine {{ $labels.engine }} matches advisory {{ $labels.advisory }}",
        "kvproxy {{ $labels.instance }} measured engine {{ $labels.engine }} at a version, "
        "transfer backend and mode that advisory {{ $labels.advisory }} lists as affected, "
        "and the operator has not accepted it. `kvproxy check` fails on it when its severity "
        "is high. /capacity (posture.findings) names the fixed version and the source.",
        hold="5m",
    ),
    Alert(
        "KvproxyKvChecksumOneSided",
        "max by (job, instance, engine) (\n"
        '  kvproxy_engine_advisory{advisory="kv-checksum-one-sided"}\n'
        ") == 1\n",
        "warning",
        "KV checksum enabled on one side only of {{ $labels.engine }}'s PD pair",
        "Engine {{ $labels.engine }} is in a prefill/decode pair where "
        "--disaggregation-enable-kv-checksum is on for one side only (kvproxy "
        "{{ $labels.instance }}). The flag exists but the protection is not in effect: "
        "transferred KV is not verified until both sides enable it.",
        hold="5m",
    ),
    Alert(
        "KvproxyEngineTransferFailures",
        # The mirror of the engine's own counter: increase() also handles an engine restart.
        "sum by (job, instance, engine, kind) (\n"
        "  increase(kvproxy_engine_transfer_failures[10m])\n"
        ") > 0\n",
        "warning",
        "Engine {{ $labels.engine }} reports {{ $labels.kind }} failures",
        "Engine {{ $labels.engine }} counted about " + ROUNDED_VALUE + " KV {{ $labels.kind }} "
        "failure(s) in the last 10 minutes (sglang:num_{{ $labels.kind }}_failed_reqs_total, "
        "probed by kvproxy {{ $labels.instance }}). A KV checksum mismatch counts here too. "
        "Failed transfers are where pages get freed or read while writes are in flight.",
    ),
)


# Gateway mode: the share of a model's requests refused because no measured cluster holds
# them, and a floor so a handful of over-long prompts does not wake anyone (as above).
FIT_NONE_SHARE = 0.05
FIT_NONE_MIN_PER_S = 0.02
# Only models served by several clusters: with one, a cluster's outage is the model's
# (KvproxyCapacityUnknown) and an over-long prompt is the client's business.
SEVERAL_CLUSTERS = "count by (job, instance, model) (kvproxy_upstream_capacity_known) > 1"
FIT_NONE_RATE = (
    "sum by (job, instance, model) (\n"
    '    rate(kvproxy_rejections_total{reason="context_length"}[10m])\n'
    "  )"
)

GATEWAY_ALERTS: tuple[Alert, ...] = (
    Alert(
        "KvproxyUpstreamUnmeasured",
        "(\n"
        "  max by (job, instance, model, upstream) (kvproxy_upstream_capacity_known) == 0\n"
        ")\n"
        "and on (job, instance, model)\n"
        f"({SEVERAL_CLUSTERS})\n",
        "warning",
        "Cluster {{ $labels.upstream }} of model {{ $labels.model }} is not measured",
        "kvproxy {{ $labels.instance }} has no fresh capacity measurement for cluster "
        "{{ $labels.upstream }} of model {{ $labels.model }}. The cluster receives nothing "
        "(fail closed per cluster) and the others take its share; prompts that only it could "
        "hold are refused with 400 context_length_exceeded. /capacity (clusters.<cluster>; "
        "with several models, models.<model>.clusters.<cluster>) shows each engine's last error.",
        hold="2m",
    ),
    Alert(
        "KvproxyUpstreamEjected",
        # The fraction of scrapes it spent ejected: one back-off (10 s by default) is at
        # most a sample or two of a 5-minute window; a router that keeps refusing or
        # answering 5xx is re-ejected with a doubling back-off and stays near 1.
        "avg_over_time(kvproxy_upstream_ejected[5m]) > 0.5\n"
        "and on (job, instance, model)\n"
        f"({SEVERAL_CLUSTERS})\n",
        "warning",
        "Cluster {{ $labels.upstream }} of model {{ $labels.model }} keeps being ejected",
        "kvproxy {{ $labels.instance }} kept cluster {{ $labels.upstream }} of model "
        "{{ $labels.model }} ejected for "
        + "{{ $value | humanizePercentage }}"
        + " of the last 5 minutes: its router refuses connections or answers 5xx. Requests "
        "go to the other clusters that hold them; a prompt only this cluster holds still "
        "tries it. Its engines may be measured fine: look at the router.",
        hold="5m",
    ),
    Alert(
        "KvproxyPromptsFitNoCluster",
        "(\n"
        f"  {FIT_NONE_RATE}\n"
        "/\n"
        "  sum by (job, instance, model) (rate(kvproxy_requests_total[10m]))\n"
        f") > {FIT_NONE_SHARE}\n"
        "and\n"
        f"{FIT_NONE_RATE.replace(chr(10) + '  ', chr(10))} > {FIT_NONE_MIN_PER_S}\n"
        "and on (job, instance, model)\n"
        f"({SEVERAL_CLUSTERS})\n",
        "warning",
        "Prompts for model {{ $labels.model }} fit no measured cluster",
        "{{ $value | humanizePercentage }} of the requests for model {{ $labels.model }} to "
        "kvproxy {{ $labels.instance }} over the last 10 minutes were refused with 400 "
        "context_length_exceeded: no measured cluster's limits hold them. If the cluster "
        "with the largest pool is unmeasured (KvproxyUpstreamUnmeasured), its prompts are "
        "being refused; else clients send prompts above the largest limit any cluster "
        "offers (the Gateway row's cluster limits).",
        hold="10m",
    ),
)

# Every alert, in the order of the rules file (each has a RUNBOOK.md section and unit tests).
ALERTS: tuple[Alert, ...] = (*CORE_ALERTS, *GATEWAY_ALERTS)


def rules_document() -> dict[str, Any]:
    return {"groups": [{"name": GROUP, "rules": [a.rule() for a in ALERTS]}]}


def prometheus_rule_document() -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "kvproxy",
            "labels": {
                "app.kubernetes.io/name": "kvproxy",
                "app.kubernetes.io/component": "alerting-rules",
                "app.kubernetes.io/part-of": "kvproxy",
            },
        },
        "spec": rules_document(),
    }
