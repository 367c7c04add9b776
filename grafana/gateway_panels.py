"""The dashboard's "Gateway: upstream clusters" row (gateway mode, `upstreams`): where
requests went and why, each cluster's in-flight prompt tokens against its published limit,
passive ejections, and clusters without a fresh measurement (which receive nothing).

`upstream` is a configured cluster's name (the single-cluster forms: `default`), so every
series here is bounded by the config. Kept apart from grafana/dashboard.py, like the posture
row; dashboard.ROWS includes it.
"""

from __future__ import annotations

from typing import Any

from grafana.model import RATE, RED_FROM_ONE, Panel, Query, Row, styled, zero_if_absent
from grafana.promql import sel

DECISIONS = sel("kvproxy_routing_decisions_total")
INFLIGHT = sel("kvproxy_upstream_inflight_prompt_tokens")
LIMIT = sel("kvproxy_upstream_limit_tokens")
CEILING = sel("kvproxy_admission_limit_tokens")
EJECTIONS = sel("kvproxy_upstream_ejections_total")
EJECTED = sel("kvproxy_upstream_ejected")
RESTORES = sel("kvproxy_upstream_restores_total")
CAPPED = sel("kvproxy_upstream_ejections_capped_total")
OUTCOMES = sel("kvproxy_upstream_outcomes_total")
SPILLS = sel("kvproxy_affinity_spills_total")
KNOWN = sel("kvproxy_upstream_capacity_known")
DEFERRED = sel("kvproxy_deferred_cancellations_total")
DISCONNECTS = sel("kvproxy_client_disconnects_total")

# The model's limit drawn dashed over its clusters' (one series per model, named "... largest").
LARGEST_DASHED: dict[str, Any] = {
    **styled("", "text", dashed=True),
    "matcher": {"id": "byRegexp", "options": ".* largest$"},
}

GATEWAY = Row(
    "Gateway: upstream clusters",
    (
        Panel(
            "Routing split by cluster (/s)",
            "timeseries",
            "Requests sent to each cluster and why it was picked: fit (least in-flight prompt "
            "tokens relative to its pool among the clusters whose limits hold the prompt, "
            "honouring weights), affinity (the affinity header's cluster), retry (moved after "
            "a connect failure, before any byte was sent). A cluster missing here is ejected, "
            "unmeasured, or smaller than every prompt.",
            (
                Query(
                    f"sum by (model, upstream, reason) (rate({DECISIONS}[{RATE}]))",
                    "{{model}} {{upstream}} {{reason}}",
                ),
            ),
            unit="reqps",
            width=12,
            stacked=True,
        ),
        Panel(
            "In-flight prompt tokens per cluster",
            "timeseries",
            "Prompt tokens of requests whose upstream is open, per cluster (deferred "
            "cancellations keep theirs until the upstream closes, I6). Routing by load "
            "compares this relative to each cluster's pool.",
            (
                Query(
                    f"sum by (model, upstream) ({INFLIGHT})",
                    "{{model}} {{upstream}}",
                ),
            ),
            unit="locale",
            width=12,
        ),
        Panel(
            "Cluster limits (tokens)",
            "timeseries",
            "Each measured cluster's published limit (the largest prompt it admits with one "
            "output token; absent while unmeasured) and, dashed, the model's: the largest any "
            "measured cluster offers. A prompt between two clusters' limits goes only to the "
            "larger; above the model's, 400 context_length_exceeded.",
            (
                Query(f"max by (model, upstream) ({LIMIT})", "{{model}} {{upstream}}"),
                Query(f"max by (model) ({CEILING})", "{{model}} largest"),
            ),
            unit="locale",
            width=8,
            overrides=(LARGEST_DASHED,),
        ),
        Panel(
            "Ejections by cluster and cause",
            "timeseries",
            "Outlier detection: five failures in a row (connect, reset before the head, head "
            "timeout, a 5xx the request did not cause, once per tenant), or a success rate "
            "far below the siblings', eject the cluster for a back-off (upstream_eject_s, "
            "doubling per level, the level decaying with health). Ejections per interval "
            "by cause; 1 in the lower series while ejected.",
            (
                Query(
                    zero_if_absent(
                        f"sum by (model, upstream, cause) (increase({EJECTIONS}[{RATE}]))",
                        "cause",
                    ),
                    "{{model}} {{upstream}} {{cause}}",
                ),
                Query(
                    zero_if_absent(f"max by (model, upstream) ({EJECTED})", "upstream"),
                    "ejected {{model}} {{upstream}}",
                ),
            ),
            unit="none",
            width=8,
            thresholds=RED_FROM_ONE,
        ),
        Panel(
            "Router outcomes, restores, capped ejections, affinity spills",
            "timeseries",
            "What outlier detection saw of each cluster's router per interval (success, "
            "connect, reset, timeout, status_5xx; request_5xx is a 5xx the request caused and "
            "never counts), restores by the cause they were ejected for, ejections the share "
            "cap refused, and sticky requests that left their home cluster by reason "
            "(unmeasured, ejected, limit, budget_full).",
            (
                Query(
                    f"sum by (model, upstream, outcome) (increase({OUTCOMES}[{RATE}]))",
                    "{{model}} {{upstream}} {{outcome}}",
                ),
                Query(
                    f"sum by (model, upstream, cause) (increase({RESTORES}[{RATE}]))",
                    "restored {{model}} {{upstream}} {{cause}}",
                ),
                Query(
                    f"sum by (model, upstream, cause) (increase({CAPPED}[{RATE}]))",
                    "capped {{model}} {{upstream}} {{cause}}",
                ),
                Query(
                    f"sum by (model, upstream, reason) (increase({SPILLS}[{RATE}]))",
                    "spilled from {{model}} {{upstream}} {{reason}}",
                ),
            ),
            unit="none",
            width=8,
        ),
        Panel(
            "Unmeasured clusters",
            "stat",
            "Clusters with no fresh capacity measurement: they receive nothing (fail closed "
            "per cluster) while the others serve; a prompt only such a cluster could hold is "
            "refused. Must be 0.",
            (
                Query(
                    f"count(max by (job, instance, model, upstream) ({KNOWN}) == 0) "
                    "or on() vector(0)",
                    "unmeasured",
                ),
            ),
            unit="none",
            width=4,
            height=8,
            thresholds=RED_FROM_ONE,
            color_by_threshold=True,
        ),
        Panel(
            "Measured per cluster",
            "timeseries",
            "1 while every engine of the cluster has a fresh measurement, per replica's view "
            "(the minimum over replicas).",
            (Query(f"min by (model, upstream) ({KNOWN})", "{{model}} {{upstream}}"),),
            unit="none",
            width=4,
            height=8,
        ),
        Panel(
            "Deferred cancellations and disconnects by cluster",
            "timeseries",
            "Client disconnects per cluster and phase, and deferred upstream closes per "
            "cluster and outcome: a deferral keeps its own cluster's budget share until its "
            "upstream closes.",
            (
                Query(
                    f"sum by (upstream, outcome) (increase({DEFERRED}[{RATE}]))",
                    "deferred {{upstream}} {{outcome}}",
                ),
                Query(
                    f"sum by (upstream, phase) (increase({DISCONNECTS}[{RATE}]))",
                    "disconnect {{upstream}} {{phase}}",
                ),
            ),
            unit="none",
            width=24,
        ),
    ),
)
