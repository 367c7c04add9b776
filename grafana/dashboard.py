"""The kvproxy Grafana dashboard as data: rows of panels, each with its PromQL.

Owns: what an on-call engineer sees, in order (at a glance, capacity, rejections,
gateway clusters, disconnects, isolation, posture, proxy health), and the Grafana JSON for
it (schema 39, Grafana 10.4+ / 11, a `datasource` variable and `job` / `instance` filters).
Must never name a metric that `kvproxy/observe/metrics.py` does not define: tests compare
every query against the registry and a live scrape.

Counters that exist only after a fault (probe errors, canary violations, upstream errors)
fall back to an explicit 0 series, so "nothing happened" reads as a flat zero rather than
"No data" (which also is what a broken scrape looks like).
"""

from __future__ import annotations

from grafana.gateway_panels import GATEWAY
from grafana.model import (
    RATE,
    RED_FROM_ONE,
    Panel,
    Query,
    Row,
    quantiles,
    right_axis,
    styled,
    zero_if_absent,
)
from grafana.posture_panels import POSTURE
from grafana.promql import sel
from grafana.rules import LOOP_LAG_SECONDS

UID = "kvproxy-overview"
TITLE = "kvproxy: KV capacity, admission, deferred cancellation"
SCHEMA_VERSION = 39
# Seconds; the default of KVPROXY_CAPACITY_STALE_S (a measurement older than this is unknown).
STALE_S = 60
# Seconds of p99 event-loop lag the alert fires on (grafana/rules.py, KvproxyEventLoopLag).
LOOP_LAG_ALERT_S = LOOP_LAG_SECONDS

TIMEOUTS = sel("kvproxy_deferred_cancellations_total", 'outcome="timeout"')
ERROR_RESPONSES = sel("kvproxy_responses_total", 'status=~"[45].."')
CANARY_IN_RANGE = Query(
    # max_over_time, not increase(): a tenant's series is born at 1 on its first violation,
    # and increase() cannot see that first step.
    f"sum(max_over_time({sel('kvproxy_canary_violations_total')}[$__range])) or on() vector(0)",
    "violations",
)

AT_A_GLANCE = Row(
    "At a glance",
    (
        Panel(
            "Capacity measurement",
            "stat",
            "1 when every engine has a fresh capacity measurement. UNKNOWN means kvproxy is "
            "refusing inference with 503 capacity_unknown and /readyz is false (I3).",
            (Query(f"min({sel('kvproxy_capacity_known')})", "known"),),
            unit="none",
            width=4,
            height=4,
            thresholds=((None, "red"), (1, "green")),
            color_by_threshold=True,
            mappings=(
                {
                    "type": "value",
                    "options": {
                        "0": {"text": "UNKNOWN", "color": "red", "index": 0},
                        "1": {"text": "MEASURED", "color": "green", "index": 1},
                    },
                },
            ),
        ),
        Panel(
            "Admission limit (tokens)",
            "stat",
            "Largest prompt admitted now (inclusive), the minimum over every engine's runtime "
            "report and the declared context. 0 while capacity is unknown.",
            (Query(f"min({sel('kvproxy_admission_limit_tokens')})", "limit"),),
            unit="locale",
            width=4,
            height=4,
        ),
        Panel(
            "Declared context above smallest KV pool",
            "stat",
            "Tokens by which the declared context (KVPROXY_MAX_CONTEXT) exceeds the smallest "
            "KV pool any engine reports. Anything above 0 is the incident's gap: clients are "
            "promised prompts that the engines cannot hold (kvproxy rejects them).",
            (
                Query(
                    f"clamp_min(max({sel('kvproxy_declared_context_tokens')}) - "
                    f"min({sel('kvproxy_pool_capacity_tokens')}), 0)",
                    "gap",
                ),
            ),
            unit="locale",
            width=4,
            height=4,
            thresholds=RED_FROM_ONE,
            color_by_threshold=True,
        ),
        Panel(
            "Canary violations (time range)",
            "stat",
            "Responses that carried another tenant's canary marker, as counted by the kvproxy "
            "processes alive in the time range. Must be 0; anything else is a data leak: page.",
            (CANARY_IN_RANGE,),
            unit="none",
            width=4,
            height=4,
            thresholds=RED_FROM_ONE,
            color_by_threshold=True,
        ),
        Panel(
            "Deferred-cancel timeouts (time range)",
            "stat",
            "Upstreams closed because the drain timeout passed, not because the KV transfer "
            "was seen to finish. A timeout proves nothing about stopped writes (I5).",
            (
                Query(
                    f"round(sum(increase({TIMEOUTS}[$__range])))",
                    "timeouts",
                ),
            ),
            unit="none",
            width=4,
            height=4,
            thresholds=RED_FROM_ONE,
            color_by_threshold=True,
        ),
        Panel(
            "Rejected share (5m)",
            "stat",
            "Requests refused by kvproxy (any reason) over all requests, last 5 minutes.",
            (
                Query(
                    f"sum(rate({sel('kvproxy_rejections_total')}[5m])) / "
                    f"sum(rate({sel('kvproxy_requests_total')}[5m]))",
                    "rejected",
                ),
            ),
            unit="percentunit",
            width=4,
            height=4,
            thresholds=((None, "green"), (0.05, "orange"), (0.1, "red")),
            color_by_threshold=True,
        ),
    ),
)

CAPACITY = Row(
    "Capacity",
    (
        Panel(
            "KV pools and limits per engine vs declared context (tokens)",
            "timeseries",
            "Each engine's reported KV pool and input limit (source=measured, or declared for "
            "static engines), the declared context (red, dashed) and the admission limit kvproxy "
            "enforces (green). A declared line above the pools is the incident's gap.",
            (
                Query(
                    f"max by (engine, role, source) ({sel('kvproxy_pool_capacity_tokens')})",
                    "pool {{engine}} ({{role}}, {{source}})",
                ),
                Query(
                    f"max by (engine, role, source) ({sel('kvproxy_engine_input_limit_tokens')})",
                    "input limit {{engine}} ({{role}}, {{source}})",
                ),
                Query(f"max({sel('kvproxy_declared_context_tokens')}) > 0", "declared context"),
                Query(f"min({sel('kvproxy_admission_limit_tokens')})", "admission limit"),
                Query(
                    f"min({sel('kvproxy_decode_limit_tokens')}) > 0",
                    "decode limit (prompt + output)",
                ),
            ),
            unit="locale",
            width=16,
            height=10,
            overrides=(
                styled("declared context", "red", width=3, dashed=True),
                styled("admission limit", "green", width=3),
            ),
        ),
        Panel(
            "Smallest KV pool / declared context",
            "stat",
            "Below 100 % the declared context promises more than the engines allocated "
            "(681,280 / 1,048,576 = 65 % in the incident).",
            (
                Query(
                    f"min({sel('kvproxy_pool_capacity_tokens')}) / "
                    f"max({sel('kvproxy_declared_context_tokens')} > 0)",
                    "pool / declared",
                ),
            ),
            unit="percentunit",
            width=8,
            height=5,
            thresholds=((None, "red"), (1, "green")),
            color_by_threshold=True,
        ),
        Panel(
            "Age of last successful measurement (s)",
            "timeseries",
            f"Seconds since each engine's last successful capacity probe. Past "
            f"KVPROXY_CAPACITY_STALE_S (default {STALE_S} s, red line) capacity is unknown.",
            (
                Query(
                    "time() - max by (engine) "
                    f"({sel('kvproxy_capacity_last_success_timestamp_seconds')})",
                    "{{engine}}",
                ),
            ),
            unit="s",
            width=8,
            height=5,
            thresholds=((None, "green"), (STALE_S, "red")),
            threshold_line=True,
        ),
        Panel(
            "Capacity probe errors (/s)",
            "timeseries",
            "Failed capacity probes by engine and reason. Persistent errors end in "
            "capacity_unknown once the last success is older than the stale limit.",
            (
                Query(
                    zero_if_absent(
                        "sum by (engine, reason) "
                        f"(rate({sel('kvproxy_capacity_probe_errors_total')}[{RATE}]))",
                        "engine",
                    ),
                    "{{engine}} {{reason}}",
                ),
            ),
            unit="reqps",
            width=8,
            height=5,
        ),
        Panel(
            "Capacity known per instance",
            "timeseries",
            "1 = every engine measured and fresh; 0 = this instance refuses inference (503).",
            (Query(f"min by (instance) ({sel('kvproxy_capacity_known')})", "{{instance}}"),),
            unit="none",
            width=8,
            height=5,
            thresholds=((None, "red"), (1, "green")),
            color_by_threshold=True,
        ),
    ),
)

REJECTIONS = Row(
    "Rejections",
    (
        Panel(
            "Admitted vs rejected (req/s)",
            "timeseries",
            "Requests by admission decision (admitted, rejected, passthrough, abandoned).",
            (
                Query(
                    f"sum by (decision) (rate({sel('kvproxy_requests_total')}[{RATE}]))",
                    "{{decision}}",
                ),
            ),
            unit="reqps",
            overrides=(styled("rejected", "orange"),),
        ),
        Panel(
            "Rejections by reason (req/s)",
            "timeseries",
            "Why kvproxy refused requests; none of them reached the router (I7).",
            (
                Query(
                    f"sum by (reason) (rate({sel('kvproxy_rejections_total')}[{RATE}]))",
                    "{{reason}}",
                ),
            ),
            unit="reqps",
            stacked=True,
        ),
        Panel(
            "Prompt tokens per request (distribution)",
            "heatmap",
            "Prompt tokens used for each decision (a guaranteed bound or an exact count).",
            (
                Query(
                    f"sum by (le) (increase({sel('kvproxy_prompt_tokens_bucket')}[{RATE}]))",
                    "{{le}}",
                    heatmap=True,
                ),
            ),
            unit="short",
        ),
        Panel(
            "Prompt tokens p50 / p99 vs admission limit",
            "timeseries",
            "How close prompts come to the limit, by counting method.",
            (
                *quantiles("kvproxy_prompt_tokens", "method", (0.5, 0.99), "{{method}}"),
                Query(f"min({sel('kvproxy_admission_limit_tokens')})", "admission limit"),
            ),
            unit="locale",
            overrides=(styled("admission limit", "green", dashed=True),),
        ),
        Panel(
            "Admission latency by method (s)",
            "timeseries",
            "Time to decide admit/reject: bound (bytes), exact (local tokenizer), engine.",
            quantiles("kvproxy_admission_duration_seconds", "method", (0.5, 0.99), "{{method}}"),
            unit="s",
        ),
        Panel(
            "kvproxy's own time: before upstream, per relayed chunk (s)",
            "timeseries",
            "What the sidecar adds (kvproxy_overhead_seconds): request = from the body's arrival "
            "to the request handed upstream (or refused), budget queueing excluded; chunk = "
            "mean time from a response chunk's arrival to its hand-over to the client.",
            quantiles("kvproxy_overhead_seconds", "phase", (0.5, 0.99), "{{phase}}"),
            unit="s",
        ),
        Panel(
            "Token-count drift (engine usage - kvproxy count)",
            "timeseries",
            "Engine usage.prompt_tokens minus kvproxy's exact count. Positive drift means the "
            "configured tokenizer under-counts (an under-count can admit above the limit); "
            "'over bound' counts responses that exceeded kvproxy's count or bound.",
            (
                *quantiles("kvproxy_token_count_drift", "", (0.01, 0.5, 0.99), ""),
                Query(
                    f"sum(rate({sel('kvproxy_token_bound_exceeded_total')}[{RATE}]))",
                    "over bound (/s)",
                ),
            ),
            unit="short",
            overrides=(right_axis("over bound (/s)", "reqps"), styled("over bound (/s)", "red")),
        ),
        Panel(
            "Exact count withheld: unverified request features (/s)",
            "timeseries",
            "Requests decided by the guaranteed bound because they use a feature kvproxy's exact "
            "count is not verified for on the engines and router in front (docs/counting.md: "
            "where the exact count is verified), by feature. Near the limit such requests are "
            "refused where an exact count might have admitted them.",
            (
                Query(
                    f"sum by (feature) (rate({sel('kvproxy_unverified_features_total')}[{RATE}]))",
                    "{{feature}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Tokenizer backend in use (pods)",
            "timeseries",
            "Pods counting exactly with each library. fastokens counts only after it agreed "
            "with HF tokenizers on the start-up probe corpus; a pod showing hf where fastokens "
            "was expected logged one warning line saying why (disagreement or load failure).",
            (
                Query(
                    f"sum by (backend) ({sel('kvproxy_tokenizer_backend')})",
                    "{{backend}}",
                ),
            ),
            unit="short",
        ),
    ),
)

DISCONNECTS = Row(
    "Disconnects and deferred cancellation",
    (
        Panel(
            "Client disconnects by phase (/s)",
            "timeseries",
            "Clients that left before their response ended. before_headers and "
            "before_first_token are the dangerous window: the KV transfer may be in flight.",
            (
                Query(
                    f"sum by (phase) (rate({sel('kvproxy_client_disconnects_total')}[{RATE}]))",
                    "{{phase}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Deferred cancellations by outcome (/s)",
            "timeseries",
            "How each deferred upstream ended: first_token (transfer done), completed, "
            "upstream_error, shutdown, or timeout (red: proves nothing about stopped writes).",
            (
                Query(
                    "sum by (outcome) "
                    f"(rate({sel('kvproxy_deferred_cancellations_total')}[{RATE}]))",
                    "{{outcome}}",
                ),
            ),
            unit="reqps",
            overrides=(styled("timeout", "red", width=4),),
        ),
        Panel(
            "Deferral duration by outcome (s)",
            "timeseries",
            "How long upstreams were kept open after their client left.",
            quantiles(
                "kvproxy_deferred_cancellation_duration_seconds",
                "outcome",
                (0.5, 0.99),
                "{{outcome}}",
            ),
            unit="s",
        ),
        Panel(
            "Deferred cancellations in progress",
            "timeseries",
            "Upstreams currently held open for clients that have gone (they keep their budget).",
            (
                Query(
                    f"sum by (instance) ({sel('kvproxy_deferred_cancellations_in_progress')})",
                    "{{instance}}",
                ),
            ),
            unit="none",
        ),
        Panel(
            "In-flight prompt-token budget",
            "timeseries",
            "Prompt tokens held by requests whose upstream is still open, and the configured "
            "budget (KVPROXY_MAX_INFLIGHT_PROMPT_TOKENS; 0 = unlimited).",
            (
                Query(f"sum({sel('kvproxy_inflight_prompt_tokens')})", "held"),
                Query(f"sum({sel('kvproxy_inflight_prompt_tokens_limit')})", "limit"),
            ),
            unit="locale",
            overrides=(styled("limit", "red", dashed=True),),
        ),
        Panel(
            "Budget queue",
            "timeseries",
            "Requests waiting for in-flight budget, and how long admitted ones waited.",
            (
                Query(f"sum({sel('kvproxy_queue_depth')})", "waiting"),
                *quantiles("kvproxy_queue_wait_seconds", "", (0.99,), "wait"),
            ),
            unit="none",
            overrides=(right_axis("p99 wait", "s"),),
        ),
        Panel(
            "Cluster budget on Redis",
            "timeseries",
            "budget_backend: redis. Prompt tokens held by every replica together (as each "
            "replica last saw it), and 1 while a replica is without Redis (its "
            "redis_unavailable policy applies).",
            (
                Query(f"max({sel('kvproxy_budget_cluster_prompt_tokens')})", "cluster held"),
                Query(
                    f"sum({sel('kvproxy_inflight_prompt_tokens_limit')}) / count("
                    f"{sel('kvproxy_inflight_prompt_tokens_limit')})",
                    "limit",
                ),
                Query(f"sum({sel('kvproxy_budget_backend_degraded')})", "replicas degraded"),
            ),
            unit="none",
            overrides=(
                styled("limit", "red", dashed=True),
                right_axis("replicas degraded", "none"),
            ),
        ),
        Panel(
            "Redis budget: round trips, renewals, expiries",
            "timeseries",
            "p99 Redis round trip of the budget's calls; per second: lease renewals, expired "
            "leases reclaimed (a replica died holding budget), leases put back after Redis lost "
            "them, and switches to the redis_unavailable policy.",
            (
                *quantiles("kvproxy_budget_redis_rtt_seconds", "", (0.99,), "redis rtt"),
                Query(
                    f"sum(rate({sel('kvproxy_budget_lease_renewals_total')}[{RATE}]))", "renewals"
                ),
                Query(
                    f"sum(rate({sel('kvproxy_budget_lease_expiries_total')}[{RATE}]))", "expiries"
                ),
                Query(
                    f"sum(rate({sel('kvproxy_budget_leases_reasserted_total')}[{RATE}]))",
                    "put back",
                ),
                Query(
                    f"sum(rate({sel('kvproxy_budget_backend_fallbacks_total')}[{RATE}]))",
                    "fallbacks",
                ),
            ),
            unit="s",
            overrides=tuple(
                right_axis(name, "short")
                for name in ("renewals", "expiries", "put back", "fallbacks")
            ),
        ),
        Panel(
            "Token chunks discarded after disconnect (/s)",
            "timeseries",
            "Generated chunks read from upstream and dropped while draining (the cost of I5).",
            (
                Query(
                    f"sum(rate({sel('kvproxy_discarded_tokens_total')}[{RATE}]))",
                    "discarded",
                ),
            ),
            unit="short",
            width=24,
            height=6,
        ),
    ),
)

ISOLATION = Row(
    "Isolation",
    (
        Panel(
            "Canary violations by tenant (count since process start)",
            "timeseries",
            "Must stay a flat zero. Any step up is a response that carried another tenant's "
            "canary marker: page, stop the rollout, keep the engines' logs.",
            (
                Query(
                    zero_if_absent(
                        f"sum by (tenant) ({sel('kvproxy_canary_violations_total')})",
                        "tenant",
                    ),
                    "{{tenant}}",
                ),
            ),
            unit="none",
            width=18,
            height=6,
            thresholds=RED_FROM_ONE,
            color_by_threshold=True,
            threshold_line=True,
        ),
        Panel(
            "Canary violations (time range)",
            "stat",
            "Same as at a glance: must be 0.",
            (CANARY_IN_RANGE,),
            unit="none",
            width=6,
            height=6,
            thresholds=RED_FROM_ONE,
            color_by_threshold=True,
        ),
    ),
)

HEALTH = Row(
    "Proxy health",
    (
        Panel(
            "Requests by route (req/s)",
            "timeseries",
            "Every request kvproxy handled, by route: the counted inference routes (chat, "
            "completions, generate, responses, messages, embeddings, classify, rerank, score, "
            "encode, native_classify), passthrough (read-only and operator-listed routes, not "
            "counted) and refused (404 route_not_found, never forwarded).",
            (
                Query(
                    f"sum by (route) (rate({sel('kvproxy_requests_total')}[{RATE}]))",
                    "{{route}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Request duration by route (s)",
            "timeseries",
            "Request start to end of response (or of the drain), p50 and p99.",
            quantiles("kvproxy_request_duration_seconds", "route", (0.5, 0.99), "{{route}}"),
            unit="s",
        ),
        Panel(
            "Upstream time to first byte (s)",
            "timeseries",
            "From forwarding to the first generated output of a stream (any field), or the "
            "first body byte otherwise: prefill time of long prompts.",
            quantiles("kvproxy_upstream_ttft_seconds", "", (0.5, 0.9, 0.99), ""),
            unit="s",
        ),
        Panel(
            "In-flight requests",
            "timeseries",
            "Requests being handled per instance, deferred cancellations included.",
            (Query(f"sum by (instance) ({sel('kvproxy_inflight_requests')})", "{{instance}}"),),
            unit="none",
        ),
        Panel(
            "Event-loop lag (s)",
            "timeseries",
            f"p99 lag of the event loop and the largest seen since start. Above "
            f"{LOOP_LAG_ALERT_S} s (red line) every request on the instance waits.",
            (
                *quantiles("kvproxy_event_loop_lag_seconds", "instance", (0.99,), "{{instance}}"),
                Query(
                    f"max by (instance) ({sel('kvproxy_event_loop_lag_max_seconds')})",
                    "max since start {{instance}}",
                ),
            ),
            unit="s",
            thresholds=((None, "green"), (LOOP_LAG_ALERT_S, "red")),
            threshold_line=True,
        ),
        Panel(
            "Event-loop tasks",
            "timeseries",
            "Tasks alive on each instance's event loop. Growth that in-flight requests do not "
            "explain is a leak (a relay or deferred cancellation that never ended).",
            (Query(f"max by (instance) ({sel('kvproxy_event_loop_tasks')})", "{{instance}}"),),
            unit="none",
        ),
        Panel(
            "Overload shed (/s)",
            "timeseries",
            "Requests answered 503 overloaded, or connections dropped at accept, by the "
            "resource that ran out (connections: the fd-derived connection limit; body_memory: "
            "bytes of bodies being read or counted). Sustained shedding: add replicas or raise "
            "the Pod's fd and memory limits (docs/operating.md, Faults).",
            (
                Query(
                    zero_if_absent(
                        f"sum by (resource, action) "
                        f"(rate({sel('kvproxy_overload_shed_total')}[{RATE}]))",
                        "resource",
                    ),
                    "{{resource}} {{action}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Overload headroom",
            "timeseries",
            "Public connections and bytes of request bodies being read or counted, each as a "
            "share of its limit: at 1 new work is shed with 503 overloaded.",
            (
                Query(
                    f"max by (instance) ({sel('kvproxy_public_connections')} / "
                    f"{sel('kvproxy_public_connections_limit')})",
                    "connections {{instance}}",
                ),
                Query(
                    f"max by (instance) ({sel('kvproxy_body_memory_bytes')} / "
                    f"{sel('kvproxy_body_memory_limit_bytes')})",
                    "body memory {{instance}}",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Error responses by status (/s), upstream errors by outcome",
            "timeseries",
            "4xx/5xx sent to clients (400 includes kvproxy's rejections) and upstream "
            "failures by kvproxy outcome.",
            (
                Query(
                    f"sum by (status) (rate({ERROR_RESPONSES}[{RATE}]))",
                    "HTTP {{status}}",
                ),
                Query(
                    zero_if_absent(
                        f"sum by (outcome) (rate({sel('kvproxy_upstream_errors_total')}[{RATE}]))",
                        "outcome",
                    ),
                    "upstream {{outcome}}",
                ),
            ),
            unit="reqps",
        ),
    ),
)

ROWS: tuple[Row, ...] = (
    AT_A_GLANCE,
    CAPACITY,
    REJECTIONS,
    GATEWAY,
    DISCONNECTS,
    ISOLATION,
    POSTURE,
    HEALTH,
)
