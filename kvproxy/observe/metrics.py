"""Every Prometheus metric kvproxy exports, defined once.

Names are a contract (DESIGN.md, "Contract"): dashboards, alert rules and `kvproxy check`
read them. Labels never carry prompt or completion text (I8): only routes, reasons,
outcomes, engine names and tenant ids.

Each `Metrics` owns its own registry so that several proxies (tests, the demo) can live in
one process without colliding.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Literal, Self, get_args

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client import values as prometheus_values

from kvproxy.policy import (
    DEFERRED_OUTCOMES,
    DISCONNECT_PHASES,
    EJECTION_CAUSES,
    ROUTING_REASONS,
    SPILL_REASONS,
    UPSTREAM_OUTCOMES,
    CountMethod,
)

# Seconds: a 1M-token prefill can take minutes; default buckets stop at 10 s.
LONG_SECONDS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280,
    2560,
)  # fmt: skip
DECISION_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1, 2.5, 5, 10)  # fmt: skip
LOOP_LAG_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 131072, 262144, 524288, 1048576,
                 2097152)  # fmt: skip
DRIFT_BUCKETS = (-4096, -1024, -256, -64, -16, -4, -1, 0, 1, 4, 16, 64, 256, 1024, 4096)
DEFERRED_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 180, 300, 600)
REDIS_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1)  # fmt: skip
# kvproxy's own time: ~50 us for a small request's stages, ~10 us per relayed chunk, up to
# ~100 ms for an exact count of a 1M-token prompt (bench/RESULTS.md).
OVERHEAD_SECONDS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)  # fmt: skip
# kvproxy_overhead_seconds' phases: before the request goes upstream, and per relayed chunk.
OVERHEAD_PHASES = ("request", "chunk")
QUEUE_SECONDS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

COUNT_METHODS: tuple[CountMethod, ...] = get_args(CountMethod)
# What TokenCounter.backend can be: the library that counts exactly, or the method.
TOKENIZER_BACKENDS = ("fastokens", "hf", "tiktoken", "engine", "bytes")
REDIS_UNAVAILABLE_POLICIES = ("local_share", "reject")
# The `model` label's values: a configured model's name (kvproxy.config's IMPLICIT_MODEL for
# the single-model form), and one bounded value for a request no configured model was
# resolved for (an unknown name, a pass-through or refused route).
UNKNOWN_MODEL = "_unknown"
# The `upstream` label of the implicit cluster (kvproxy.config.IMPLICIT_CLUSTER's value: the
# observe layer does not import config) and of a pass-through route's router.
IMPLICIT_UPSTREAM = "default"


# Children remembered per labelled metric: label values come from closed sets (routes,
# decisions, reasons, methods, tenants, status codes), so this is never reached in practice;
# past it, `labels` just does the full lookup.
MAX_CACHED_CHILDREN = 1024


class _CachedLabels:
    """`labels(*values)` answered from a dict of bound children after the first call.

    prometheus_client's own `labels` validates, converts every value to str and takes a
    lock on every call (~1.3 us; a bound child's `inc` is ~0.5 us), and the handler asks
    for five children per request. Values are looked up as given (the status is already a
    str), so `labels("chat")` and `labels(b"chat")` would be different keys, both correct.
    Children are never removed here (no `remove`/`clear` callers), so a cached child is
    the one the registry exports."""

    _kv_children: dict[tuple[Any, ...], Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._kv_children = {}
        super().__init__(*args, **kwargs)

    def labels(self, *values: Any, **kw: Any) -> Self:
        child = self._kv_children.get(values)
        if child is not None and not kw:
            return child  # type: ignore[no-any-return]
        return self._labels_slow(values, kw)

    def _labels_slow(self, values: tuple[Any, ...], kw: dict[str, Any]) -> Self:
        if kw:
            return super().labels(*values, **kw)  # type: ignore[misc, no-any-return]
        child = super().labels(*values)  # type: ignore[misc]
        if len(self._kv_children) < MAX_CACHED_CHILDREN:
            self._kv_children[values] = child
        return child  # type: ignore[no-any-return]


class LoopValue:
    """A metric's value written and read on the event loop's thread only: prometheus_client's
    default value takes a lock on every write (a context manager entered and left, ~15 times
    a request). kvproxy updates its metrics from the loop (its worker threads tokenize and
    touch no metric) and serves /metrics from the same loop, so nothing ever contends for
    it. The same interface as the library's `MutexValue`; used only when that is the
    library's value class (not in its multiprocess mode, which kvproxy does not use)."""

    # `value` is public to this module: the hot paths below add to it directly (a method
    # call per write was a third of an observation's instructions).
    __slots__ = ("_exemplar", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self._exemplar: Any = None

    def inc(self, amount: float) -> None:
        self.value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self.value = value

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self.value

    def get_exemplar(self) -> Any:
        return self._exemplar


_LOOP_VALUES = prometheus_values.ValueClass is prometheus_values.MutexValue


class Counter(_CachedLabels, prometheus_client.Counter):
    def _metric_init(self) -> None:
        super()._metric_init()
        if _LOOP_VALUES:
            self._value = LoopValue()

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        # The library's inc whenever one of its checks could fail (a labelled parent, a
        # negative amount) or an exemplar comes with it: it raises or records as it would.
        # The same observability test as Histogram.observe below, inline.
        if (
            exemplar
            or not _LOOP_VALUES
            or amount < 0
            or (self._labelnames and not self._labelvalues)
        ):
            super().inc(amount, exemplar)
            return
        self._value.value += amount  # a LoopValue (_LOOP_VALUES)


class Gauge(_CachedLabels, prometheus_client.Gauge):
    def _metric_init(self) -> None:
        super()._metric_init()
        if _LOOP_VALUES:
            self._value = LoopValue()


class Histogram(_CachedLabels, prometheus_client.Histogram):
    def _metric_init(self) -> None:
        super()._metric_init()
        if _LOOP_VALUES:
            self._sum = LoopValue()
            self._buckets = [LoopValue() for _ in self._buckets]

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        """prometheus_client's observe, with the bucket found by bisection: its own walks
        the bounds in a Python loop (a handful of observations per request). The same
        sample lands in the same bucket (the first bound >= amount); a NaN or an exemplar
        goes to the library's own."""
        if exemplar is not None or amount != amount:
            super().observe(amount, exemplar)
            return
        if self._labelnames and not self._labelvalues:
            self._raise_if_not_observable()  # type: ignore[no-untyped-call]
        if _LOOP_VALUES:
            self._sum.value += amount
            self._buckets[bisect_left(self._upper_bounds, amount)].value += 1
        else:
            self._sum.inc(amount)
            self._buckets[bisect_left(self._upper_bounds, amount)].inc(1)


MetricKind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class Family:
    """One exported metric family: the `Metrics` attribute that holds it, its Prometheus
    type, name, label names, help text and (histograms) bucket bounds."""

    attr: str
    kind: MetricKind
    name: str
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] | None = None
    # False: prometheus_client's own class, for a family whose series are removed (a cached
    # child would outlive its removal, `_CachedLabels`).
    cached: bool = True


# Every family, in registration (and so exposition) order.
FAMILIES: tuple[Family, ...] = (
    # --- requests ---------------------------------------------------------------------
    # `route` is bounded: a counted route's name (kvproxy.prompt.parse.Route), "passthrough" or
    # "refused" (kvproxy.policy.routes.RouteMatch.label); never a path.
    Family(
        "requests_total",
        "counter",
        "kvproxy_requests_total",
        ("route", "decision", "model"),
        "Requests handled, by route, admission decision and model.",
    ),
    Family(
        "responses_total",
        "counter",
        "kvproxy_responses_total",
        ("route", "status"),
        "Responses sent to clients, by route and HTTP status code.",
    ),
    Family(
        "request_duration",
        "histogram",
        "kvproxy_request_duration_seconds",
        ("route",),
        "Time from request start to the end of the response (or of the drain).",
        buckets=LONG_SECONDS,
    ),
    # One definition of "what the sidecar adds" (the serve handler and relay observe it).
    Family(
        "overhead",
        "histogram",
        "kvproxy_overhead_seconds",
        ("route", "decision", "phase"),
        "Time kvproxy itself adds, by route, decision and phase: phase=request from the "
        "request body's arrival to the request handed to the upstream client (or the "
        "refusal), less any wait for in-flight budget; phase=chunk, once per response, the "
        "mean time from a response chunk's arrival to its write to the client.",
        buckets=OVERHEAD_SECONDS,
    ),
    Family(
        "upstream_ttft",
        "histogram",
        "kvproxy_upstream_ttft_seconds",
        (),
        "Time from forwarding a request to its first generated output (event streams, whatever "
        "field carries it) or to the first body byte (anything else).",
        buckets=LONG_SECONDS,
    ),
    Family(
        "inflight",
        "gauge",
        "kvproxy_inflight_requests",
        (),
        "Requests currently being handled, deferred cancellations included.",
    ),
    # Overload shedding (kvproxy.serve.overload).
    Family(
        "overload_shed",
        "counter",
        "kvproxy_overload_shed_total",
        ("resource", "action"),
        "Requests or connections shed at the door (503 overloaded, or a connection dropped "
        "at accept), by the resource that ran out and the action.",
    ),
    Family(
        "public_connections",
        "gauge",
        "kvproxy_public_connections",
        (),
        "Public (client) connections open now.",
    ),
    Family(
        "public_connections_limit",
        "gauge",
        "kvproxy_public_connections_limit",
        (),
        "Public connections served at once; more are answered 503 overloaded.",
    ),
    Family(
        "body_memory_bytes",
        "gauge",
        "kvproxy_body_memory_bytes",
        (),
        "Bytes of request bodies being read or counted now (reserved).",
    ),
    Family(
        "body_memory_limit_bytes",
        "gauge",
        "kvproxy_body_memory_limit_bytes",
        (),
        "Bytes of request bodies that may be read or counted at once.",
    ),
    Family(
        "upstream_errors",
        "counter",
        "kvproxy_upstream_errors_total",
        ("outcome",),
        "Upstream failures, by kvproxy outcome.",
    ),
    Family(
        "client_disconnects",
        "counter",
        "kvproxy_client_disconnects_total",
        ("phase", "upstream"),
        "Clients that went away before their response ended, by phase and upstream cluster.",
    ),
    Family(
        "event_loop_lag",
        "histogram",
        "kvproxy_event_loop_lag_seconds",
        (),
        "How late the event loop ran a timer scheduled for now (stalls show here).",
        buckets=LOOP_LAG_SECONDS,
    ),
    Family(
        "event_loop_lag_max",
        "gauge",
        "kvproxy_event_loop_lag_max_seconds",
        (),
        "Largest event-loop lag seen since start.",
    ),
    Family(
        "event_loop_tasks",
        "gauge",
        "kvproxy_event_loop_tasks",
        (),
        "Tasks alive on the event loop (back to its idle level when traffic ends).",
    ),
    # --- capacity ---------------------------------------------------------------------
    Family(
        "pool_capacity",
        "gauge",
        "kvproxy_pool_capacity_tokens",
        ("engine", "role", "source", "model"),
        "KV-cache pool each engine reports having allocated (model: the model it serves).",
    ),
    Family(
        "engine_input_limit",
        "gauge",
        "kvproxy_engine_input_limit_tokens",
        ("engine", "role", "source", "model"),
        "Largest prompt each engine accepts, derived from its runtime report.",
    ),
    Family(
        "admission_limit",
        "gauge",
        "kvproxy_admission_limit_tokens",
        ("model",),
        "Largest prompt admitted with at least one output token (inclusive; the published "
        "limit, kvproxy.capacity.limits), by model; 0 while capacity is unknown.",
    ),
    Family(
        "decode_limit",
        "gauge",
        "kvproxy_decode_limit_tokens",
        ("model",),
        "Largest prompt + output the engines serve in full, neither refused nor cut "
        "(inclusive), by model; 0 while unknown.",
    ),
    Family(
        "declared_context",
        "gauge",
        "kvproxy_declared_context_tokens",
        ("model",),
        "Context length declared in configuration (max_context), by model; 0 if unset.",
    ),
    Family(
        "capacity_known",
        "gauge",
        "kvproxy_capacity_known",
        ("model",),
        "1 when every engine of the model has a fresh measurement, else 0.",
    ),
    Family(
        "capacity_last_success",
        "gauge",
        "kvproxy_capacity_last_success_timestamp_seconds",
        ("engine",),
        "Unix time of each engine's last successful capacity probe.",
    ),
    Family(
        "capacity_probe_errors",
        "counter",
        "kvproxy_capacity_probe_errors_total",
        ("engine", "reason"),
        "Failed capacity probes, by engine and reason.",
    ),
    # --- engine posture (kvproxy.posture) ---------------------------------------------
    # Labels: configured/discovered engines x advisory ids of the loaded table and the
    # builtin pair checks (both bounded).
    Family(
        "engine_advisory",
        "gauge",
        "kvproxy_engine_advisory",
        ("engine", "advisory"),
        "1 while an advisory or pair check applies to the engine and is not accepted; "
        "0 while it applies and the operator accepted it (accept_advisories).",
    ),
    Family(
        "engine_transfer_failures",
        "gauge",
        "kvproxy_engine_transfer_failures",
        ("engine", "kind"),
        "The engine's own failure counter as last probed (kind=transfer: "
        "sglang:num_transfer_failed_reqs_total, which a KV checksum mismatch increments; "
        "kind=bootstrap: sglang:num_bootstrap_failed_reqs_total). Use increase().",
    ),
    # --- admission --------------------------------------------------------------------
    Family(
        "rejections",
        "counter",
        "kvproxy_rejections_total",
        ("reason", "model"),
        "Requests refused before reaching the router, by reason and model.",
    ),
    Family(
        "prompt_tokens",
        "histogram",
        "kvproxy_prompt_tokens",
        ("method", "model"),
        "Prompt tokens used for the decision (a bound or an exact count), by method and model.",
        buckets=TOKEN_BUCKETS,
    ),
    Family(
        "admission_duration",
        "histogram",
        "kvproxy_admission_duration_seconds",
        ("method",),
        "Time to decide admission, by counting method.",
        buckets=DECISION_SECONDS,
    ),
    Family(
        "token_count_drift",
        "histogram",
        "kvproxy_token_count_drift",
        (),
        "Engine-reported usage.prompt_tokens minus kvproxy's count (exact counts only).",
        buckets=DRIFT_BUCKETS,
    ),
    Family(
        "tokenizer_backend",
        "gauge",
        "kvproxy_tokenizer_backend",
        ("backend",),
        "1 for the library that counts prompt tokens exactly (fastokens only once it "
        "agreed with HF tokenizers at start-up), 0 for the others.",
    ),
    Family(
        "unverified_features",
        "counter",
        "kvproxy_unverified_features_total",
        ("feature", "model"),
        "Requests whose exact count was withheld because they use a request feature not "
        "verified for the engines and router in front (decided by the bound instead), "
        "by feature (a closed vocabulary, kvproxy.tokens.gate.features) and model.",
    ),
    Family(
        "token_bound_exceeded",
        "counter",
        "kvproxy_token_bound_exceeded_total",
        ("model",),
        "Responses whose usage.prompt_tokens exceeded kvproxy's count or bound "
        "(the model's configured tokenizer does not match it), by model.",
    ),
    # --- deferred cancellation and budget ---------------------------------------------
    Family(
        "deferred_total",
        "counter",
        "kvproxy_deferred_cancellations_total",
        ("outcome", "upstream"),
        "Upstream closes deferred after a client disconnect, by outcome and upstream cluster.",
    ),
    Family(
        "deferred_duration",
        "histogram",
        "kvproxy_deferred_cancellation_duration_seconds",
        ("outcome", "upstream"),
        "Time an upstream was kept open after its client left, by outcome and upstream cluster.",
        buckets=DEFERRED_SECONDS,
    ),
    Family(
        "deferred_in_progress",
        "gauge",
        "kvproxy_deferred_cancellations_in_progress",
        ("upstream",),
        "Upstreams currently kept open for a client that has gone, by upstream cluster.",
    ),
    Family(
        "discarded_tokens",
        "counter",
        "kvproxy_discarded_tokens_total",
        (),
        "Generated-token chunks read from upstream and discarded after a disconnect.",
    ),
    Family(
        "budget_tokens_in_use",
        "gauge",
        "kvproxy_inflight_prompt_tokens",
        ("model",),
        "Prompt tokens held by requests whose upstream is still open, by model.",
    ),
    Family(
        "budget_tokens_limit",
        "gauge",
        "kvproxy_inflight_prompt_tokens_limit",
        ("model",),
        "Configured in-flight prompt-token budget, by model (0 = unlimited).",
    ),
    Family(
        "queue_depth",
        "gauge",
        "kvproxy_queue_depth",
        ("model",),
        "Requests waiting for in-flight budget, by model.",
    ),
    Family(
        "queue_wait",
        "histogram",
        "kvproxy_queue_wait_seconds",
        (),
        "Time admitted requests waited for in-flight budget.",
        buckets=QUEUE_SECONDS,
    ),
    # --- the cluster budget on Redis (budget_backend: redis) ----------------------------
    Family(
        "budget_cluster_tokens",
        "gauge",
        "kvproxy_budget_cluster_prompt_tokens",
        ("model",),
        "Prompt tokens held by every replica sharing the model's Redis budget, as last seen.",
    ),
    Family(
        "budget_lease_renewals",
        "counter",
        "kvproxy_budget_lease_renewals_total",
        (),
        "Redis budget leases this replica renewed (its requests are still upstream).",
    ),
    Family(
        "budget_lease_expiries",
        "counter",
        "kvproxy_budget_lease_expiries_total",
        (),
        "Expired Redis budget leases reclaimed (a replica died or lost Redis too long).",
    ),
    Family(
        "budget_leases_reasserted",
        "counter",
        "kvproxy_budget_leases_reasserted_total",
        (),
        "Live leases put back after Redis had lost them (restart, long outage), or "
        "local-share leases registered when Redis returned.",
    ),
    Family(
        "budget_redis_rtt",
        "histogram",
        "kvproxy_budget_redis_rtt_seconds",
        (),
        "Round-trip time of the budget's Redis calls.",
        buckets=REDIS_SECONDS,
    ),
    Family(
        "budget_fallbacks",
        "counter",
        "kvproxy_budget_backend_fallbacks_total",
        ("policy",),
        "Switches to the redis_unavailable policy, by policy.",
    ),
    Family(
        "budget_degraded",
        "gauge",
        "kvproxy_budget_backend_degraded",
        (),
        "1 while Redis is unavailable and the redis_unavailable policy applies.",
    ),
    # --- gateway mode: a model's upstream clusters (kvproxy.policy.routing) -------------
    # `upstream` is a configured cluster's name (the implicit one: "default"), never a
    # value from a request: the label set is bounded by the config.
    Family(
        "routing_decisions",
        "counter",
        "kvproxy_routing_decisions_total",
        ("model", "upstream", "reason"),
        "Requests sent to an upstream cluster, by model, cluster and why it was picked "
        "(fit: least load among the clusters that hold it; affinity: the affinity "
        "header's cluster; retry: moved after a connect failure).",
    ),
    Family(
        "upstream_ejections",
        "counter",
        "kvproxy_upstream_ejections_total",
        ("model", "upstream", "cause"),
        "Passive ejections of an upstream cluster (outlier detection), by model, cluster "
        "and cause: the failure that completed a streak of consecutive failures "
        "(connect: no connection; reset: reset or closed before a response head; "
        "timeout: no head within the read timeout; status_5xx: a 5xx the request did "
        "not cause), or success_rate (far below its siblings').",
    ),
    Family(
        "upstream_ejected",
        "gauge",
        "kvproxy_upstream_ejected",
        ("model", "upstream"),
        "1 while the upstream cluster is ejected (passive health back-off), else 0.",
    ),
    # Outlier detection and affinity spills (kvproxy.policy.routing).
    Family(
        "upstream_restores",
        "counter",
        "kvproxy_upstream_restores_total",
        ("model", "upstream", "cause"),
        "Ejected upstream clusters back in rotation (their back-off passed), by model, "
        "cluster and the cause they were ejected for.",
    ),
    Family(
        "upstream_ejections_capped",
        "counter",
        "kvproxy_upstream_ejections_capped_total",
        ("model", "upstream", "cause"),
        "Ejections not made because the share of a model's clusters ejected at once was "
        "at its cap (upstream_outlier_max_ejected_share; never the last), by model, "
        "cluster and cause.",
    ),
    Family(
        "upstream_outcomes",
        "counter",
        "kvproxy_upstream_outcomes_total",
        ("model", "upstream", "outcome"),
        "Outcomes of counted requests' exchanges with a cluster's router as outlier "
        "detection saw them, by model, cluster and outcome (success, connect, reset, "
        "timeout, status_5xx, request_5xx: a 5xx the request caused, never a failure).",
    ),
    Family(
        "affinity_spills",
        "counter",
        "kvproxy_affinity_spills_total",
        ("model", "upstream", "reason"),
        "Requests whose affinity key's home cluster could not take them now and went to "
        "another cluster, by model, home cluster and reason (unmeasured, ejected, limit: "
        "its limits do not hold it, budget_full: its budget would make it wait).",
    ),
    Family(
        "upstream_inflight_tokens",
        "gauge",
        "kvproxy_upstream_inflight_prompt_tokens",
        ("model", "upstream"),
        "Prompt tokens held by requests whose upstream is open, by model and cluster.",
    ),
    # Uncached children: the series is removed while the cluster is unmeasured, and a
    # cached child would outlive its removal (`_CachedLabels`).
    Family(
        "upstream_limit",
        "gauge",
        "kvproxy_upstream_limit_tokens",
        ("model", "upstream"),
        "The cluster's published limit (largest prompt admitted with one output token); "
        "absent while the cluster is unmeasured.",
        cached=False,
    ),
    Family(
        "upstream_capacity_known",
        "gauge",
        "kvproxy_upstream_capacity_known",
        ("model", "upstream"),
        "1 while every engine of the cluster has a fresh measurement, else 0.",
    ),
    # --- isolation --------------------------------------------------------------------
    Family(
        "canary_violations",
        "counter",
        "kvproxy_canary_violations_total",
        ("tenant",),
        "Responses to a tenant that carried another tenant's canary marker.",
    ),
)

_CLASSES: dict[tuple[MetricKind, bool], Any] = {
    ("counter", True): Counter,
    ("gauge", True): Gauge,
    ("histogram", True): Histogram,
    ("counter", False): prometheus_client.Counter,
    ("gauge", False): prometheus_client.Gauge,
    ("histogram", False): prometheus_client.Histogram,
}


def build(family: Family, registry: CollectorRegistry) -> Any:
    """The family's metric, registered in `registry`."""
    cls = _CLASSES[family.kind, family.cached]
    if family.buckets is None:
        return cls(family.name, family.help, family.labels, registry=registry)
    return cls(family.name, family.help, family.labels, buckets=family.buckets, registry=registry)


class Metrics:
    """Each family of `FAMILIES` as the attribute it names."""

    requests_total: Counter
    responses_total: Counter
    request_duration: Histogram
    overhead: Histogram
    upstream_ttft: Histogram
    inflight: Gauge
    overload_shed: Counter
    public_connections: Gauge
    public_connections_limit: Gauge
    body_memory_bytes: Gauge
    body_memory_limit_bytes: Gauge
    upstream_errors: Counter
    client_disconnects: Counter
    event_loop_lag: Histogram
    event_loop_lag_max: Gauge
    event_loop_tasks: Gauge
    pool_capacity: Gauge
    engine_input_limit: Gauge
    admission_limit: Gauge
    decode_limit: Gauge
    declared_context: Gauge
    capacity_known: Gauge
    capacity_last_success: Gauge
    capacity_probe_errors: Counter
    engine_advisory: Gauge
    engine_transfer_failures: Gauge
    rejections: Counter
    prompt_tokens: Histogram
    admission_duration: Histogram
    token_count_drift: Histogram
    tokenizer_backend: Gauge
    unverified_features: Counter
    token_bound_exceeded: Counter
    deferred_total: Counter
    deferred_duration: Histogram
    deferred_in_progress: Gauge
    discarded_tokens: Counter
    budget_tokens_in_use: Gauge
    budget_tokens_limit: Gauge
    queue_depth: Gauge
    queue_wait: Histogram
    budget_cluster_tokens: Gauge
    budget_lease_renewals: Counter
    budget_lease_expiries: Counter
    budget_leases_reasserted: Counter
    budget_redis_rtt: Histogram
    budget_fallbacks: Counter
    budget_degraded: Gauge
    routing_decisions: Counter
    upstream_ejections: Counter
    upstream_ejected: Gauge
    upstream_restores: Counter
    upstream_ejections_capped: Counter
    upstream_outcomes: Counter
    affinity_spills: Counter
    upstream_inflight_tokens: Gauge
    upstream_limit: prometheus_client.Gauge
    upstream_capacity_known: Gauge
    canary_violations: Counter

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        for family in FAMILIES:
            setattr(self, family.attr, build(family, self.registry))

        # Pre-create the label sets dashboards and alerts read, so a fresh proxy exports 0
        # rather than nothing (rate() over a missing series is empty, not zero).
        # Each cluster's deferral series are pre-created by `add_cluster`; the implicit
        # cluster's name here too: a pass-through route's upstream is counted under it.
        self._add_upstream(IMPLICIT_UPSTREAM)
        for backend in TOKENIZER_BACKENDS:
            self.tokenizer_backend.labels(backend)
        for policy in REDIS_UNAVAILABLE_POLICIES:
            self.budget_fallbacks.labels(policy)
        for method in COUNT_METHODS:
            self.admission_duration.labels(method)

    def add_model(self, model: str) -> None:
        """Pre-create a model's series (kvproxy.serve.models calls it once per configured model),
        so each model's counts export 0 rather than nothing."""
        for method in COUNT_METHODS:
            self.prompt_tokens.labels(method, model)
        self.token_bound_exceeded.labels(model)

    def add_cluster(self, model: str, upstream: str) -> None:
        """Pre-create one cluster's series (kvproxy.serve.models calls it once per configured
        cluster), so an alert on a cluster's ejections or deferrals sees 0, not nothing."""
        self._add_upstream(upstream)
        for reason in ROUTING_REASONS:
            self.routing_decisions.labels(model, upstream, reason)
        for cause in EJECTION_CAUSES:
            self.upstream_ejections.labels(model, upstream, cause)
            self.upstream_restores.labels(model, upstream, cause)
            self.upstream_ejections_capped.labels(model, upstream, cause)
        for outcome in UPSTREAM_OUTCOMES:
            self.upstream_outcomes.labels(model, upstream, outcome)
        for spill in SPILL_REASONS:
            self.affinity_spills.labels(model, upstream, spill)
        self.upstream_ejected.labels(model, upstream).set(0)

    def _add_upstream(self, upstream: str) -> None:
        for outcome in DEFERRED_OUTCOMES:
            self.deferred_total.labels(outcome, upstream)
            self.deferred_duration.labels(outcome, upstream)
        for phase in DISCONNECT_PHASES:
            self.client_disconnects.labels(phase, upstream)
        self.deferred_in_progress.labels(upstream)

    def set_tokenizer_backend(self, backend: str) -> None:
        """Exactly one backend reads 1: the one the token counter uses."""
        for name in {*TOKENIZER_BACKENDS, backend}:
            self.tokenizer_backend.labels(name).set(1 if name == backend else 0)
