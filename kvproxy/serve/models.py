"""The model table: which model's policy a request is counted and admitted against.

Each configured model (kvproxy.config.models) gets a `ModelServices` bundle: its settings,
its `TokenCounter` (its tokenizer and chat template) and its upstream clusters
(`ClusterServices`: one, the implicit `default`, unless the model lists `upstreams`), each
with its router URL, its own `CapacityMonitor` (its engines, measured and failing closed on
their own), its in-flight `Budget` (budgets belong to an engine pool), its passive `Health`
and weight; `ModelServices.balancer` is the model's routing state (kvproxy.policy.routing).
`ModelTable.for_request` is the request path's one lookup.

Gateway mode (a model with `upstreams`): the model is ready while any cluster is; its
/capacity lists each cluster under `clusters` (weight, ejected_until and the single-model
snapshot); its model-wide gauges (admission limit, capacity known, budget) are computed at
scrape time over the clusters (the largest limit any measured cluster offers). Its counter
is built on every cluster's engines, and no cluster's monitor feeds its verifier: the count
is taken once, before the cluster is picked, so it must hold on each of them.

Both configuration forms are one table (`Settings.model_table()`): the single-model form is
a table of one implicit model (`IMPLICIT_MODEL`) that is also the default. Resolution, by the
request body's top-level `model` string:
  - a name or alias of an entry picks it (exact, case-sensitive: smg matches worker model
    ids exactly too);
  - a request with no `model` (SGLang's /generate, /encode and /classify have none) or an
    unknown name gets the default model if there is one, else 404 `model_not_found`;
  - the implicit table answers every request with its one model without reading the body:
    there is nothing the body could change.
The body is never changed: the router picks the worker by the same field.

Cost: with a `models` list the body is parsed once here and once by `parse_request`; the
single-model form pays nothing.

Must never: admit a request against a model other than the one its `model` names (unless
the operator configured that fallback as `default_model`), or log the body (I8).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvproxy.budget import Budget, build_budget
from kvproxy.capacity import CapacityMonitor, Limits
from kvproxy.config import IMPLICIT_MODEL, ModelSpec, Settings
from kvproxy.observe import UNKNOWN_MODEL, Metrics
from kvproxy.policy import KvproxyError, admission, errors, routing
from kvproxy.prompt import load_json
from kvproxy.tokens import TokenCounter, build_counter

log = logging.getLogger("kvproxy.models")


@dataclass(frozen=True, eq=False)
class ClusterServices:
    """One upstream cluster of a model: its router, its own capacity monitor (fail closed on
    its own), its in-flight budget and its passive health (kvproxy.policy.routing reads it
    through `ClusterView`)."""

    name: str
    url: str
    weight: float
    settings: Settings
    capacity: CapacityMonitor
    budget: Budget
    health: routing.Health

    def limits(self) -> Limits:
        return self.capacity.limits()

    def inflight_tokens(self) -> int:
        return self.budget.tokens_in_use

    def pool_tokens(self) -> int | None:
        return self.capacity.pool_tokens()

    def room_now(self, tokens: int) -> bool:
        return self.budget.room_now(tokens)

    def ready(self) -> bool:
        return self.capacity.ready() and not self.capacity.posture.blocks_ready()

    def capacity_json(self) -> dict[str, Any]:
        """Its engines, limits and budget (the single-model form's whole /capacity)."""
        return {**self.capacity.snapshot_json(), "budget": self.budget.describe_json()}

    def snapshot_json(self) -> dict[str, Any]:
        now = time.monotonic()
        ejected = self.health.ejected(now)
        return {
            "url": self.url,
            "weight": self.weight,
            # Wall-clock seconds, like the monitor's timestamps; None while not ejected.
            "ejected_until": round(time.time() + self.health.until - now, 3) if ejected else None,
            "consecutive_ejections": self.health.consecutive,
            "ejection_cause": self.health.cause if ejected else None,
            **self.capacity_json(),
        }


@dataclass(frozen=True, eq=False)
class ModelServices:
    """Everything the request path needs for one model: its counter, and its clusters (one,
    the implicit `default`, unless the model lists `upstreams`)."""

    name: str
    aliases: tuple[str, ...]
    settings: Settings
    counter: TokenCounter
    clusters: tuple[ClusterServices, ...]
    # Gateway mode: the model listed `upstreams` (else its one cluster is the implicit one,
    # and /capacity keeps the single-cluster shape).
    gateway: bool = False
    affinity_header: str | None = None
    balancer: routing.Balancer = field(default_factory=routing.Balancer)
    outliers: routing.Outliers | None = None  # None: no outlier detection (tests)

    @property
    def capacity(self) -> CapacityMonitor:
        """The first cluster's monitor: the only one without `upstreams`."""
        return self.clusters[0].capacity

    @property
    def budget(self) -> Budget:
        """The first cluster's budget: the only one without `upstreams`."""
        return self.clusters[0].budget

    def others(self, cluster: ClusterServices) -> tuple[ClusterServices, ...]:
        """Its clusters but `cluster`: where a request it refused the connection moves."""
        return tuple(c for c in self.clusters if c is not cluster)

    def charge_ceiling(self, shape: admission.ShapeView) -> int | None:
        """The largest batch total any of its clusters' budgets could lend (None: one has
        no token limit), so the counter tokenizes exactly rather than refuse a batch only
        its bound puts over the budget (`admission.charge_ceiling`)."""
        ceilings = [admission.charge_ceiling(c.budget.max_tokens, shape) for c in self.clusters]
        if any(c is None for c in ceilings):
            return None
        return max(c for c in ceilings if c is not None)

    def ready(self) -> bool:
        """Ready while any of its clusters is (the others answer nothing, I3 per cluster)."""
        return any(c.ready() for c in self.clusters)

    def retry_after_s(self) -> int:
        return min(c.capacity.retry_after_s() for c in self.clusters)

    def capacity_json(self) -> dict[str, Any]:
        """Its engines, limits and budget; with `upstreams`, each cluster's under `clusters`."""
        if not self.gateway:
            # The form, not the count: a model without `upstreams` is its one implicit
            # cluster, shown flat (a one-cluster `upstreams` list is shown by cluster).
            (implicit,) = self.clusters
            return implicit.capacity_json()
        limits = [c.limits() for c in self.clusters]
        offered = [x.admission_limit_tokens for x in limits if x.known]
        return {
            "known": any(x.known for x in limits),
            "ready": self.ready(),
            # The largest limit any measured cluster offers (what a refusal names).
            "admission_limit_tokens": max((t for t in offered if t is not None), default=None),
            "clusters": {c.name: c.snapshot_json() for c in self.clusters},
        }

    def snapshot_json(self) -> dict[str, Any]:
        return {
            "aliases": list(self.aliases),
            # Its router (`settings.upstream`: the model's own, else the top-level one).
            "upstream": None if self.gateway else self.settings.upstream,
            "tokenizer": self.counter.describe(),
            **self.capacity_json(),
        }

    def passthrough_cluster(self) -> ClusterServices:
        """Where a pass-through route of a gateway model goes: the first measured cluster
        that is not ejected, else the first."""
        now = time.monotonic()
        for c in self.clusters:
            if c.limits().known and not c.health.ejected(now):
                return c
        return self.clusters[0]

    def observe(
        self, cluster: ClusterServices, outcome: routing.Outcome, source: str, metrics: Any
    ) -> None:
        """Passive health: one exchange's outcome with the cluster's router (outlier
        detection, kvproxy.policy.routing.Outliers)."""
        metrics.upstream_outcomes.labels(self.name, cluster.name, outcome).inc()
        if self.outliers is None:
            return
        now = time.monotonic()
        self.count_restores(metrics, now)
        got = self.outliers.observe(cluster.name, outcome, source, now)
        if isinstance(got, routing.Capped):
            metrics.upstream_ejections_capped.labels(self.name, cluster.name, got.cause).inc()
            log.warning(
                "upstream cluster %s of model %s not ejected (%s): the share of clusters "
                "ejected at once is at its cap",
                cluster.name,
                self.name,
                got.cause,
            )
        elif got is not None:
            metrics.upstream_ejections.labels(self.name, cluster.name, got.cause).inc()
            log.warning(
                "upstream cluster %s of model %s ejected for %.1f s (%s, ejection level %d)",
                cluster.name,
                self.name,
                got.ejected_for_s,
                got.cause,
                got.level,
            )

    def count_restores(self, metrics: Any, now: float) -> None:
        """Clusters whose back-off passed: counted by the cause they were ejected for."""
        if self.outliers is None:
            return
        for name, cause in self.outliers.restored(now):
            metrics.upstream_restores.labels(self.name, name, cause).inc()
            log.info(
                "upstream cluster %s of model %s restored (was ejected: %s)", name, self.name, cause
            )


class ModelTable:
    """Resolution by name and the lifecycle of every model's services."""

    def __init__(
        self,
        models: Sequence[ModelServices],
        *,
        default_model: str | None = None,
        readiness: str = "any",
        implicit: bool = False,
    ) -> None:
        if not models:
            raise ValueError("a model table needs at least one model")
        if implicit and (len(models) != 1 or default_model != models[0].name):
            raise ValueError("the implicit table is one model, its own default")
        self.models = tuple(models)
        # The single-model form: nobody named the model, so messages and /capacity do not.
        self.implicit = implicit
        self.readiness = readiness
        self._by_name: dict[str, ModelServices] = {}
        for svc in models:
            for name in (svc.name, *svc.aliases):
                if name in self._by_name:
                    raise ValueError(f"model name or alias {name!r} is used twice")
                self._by_name[name] = svc
        self.default = None if default_model is None else self._by_name[default_model]

    @property
    def first(self) -> ModelServices:
        """The first configured model's services: the only one in the single-model form."""
        return self.models[0]

    @property
    def names(self) -> tuple[str, ...]:
        """Configured names (not aliases): the only values of a `model` metric label."""
        return tuple(m.name for m in self.models)

    def label(self, resolved: str | None) -> str:
        """The `model` metric label for a request resolved to `resolved` (None: to none,
        e.g. a pass-through or refused route: the implicit table's one model answers every
        request, so even those carry its name)."""
        if resolved is not None:
            return resolved
        return self.models[0].name if self.implicit else UNKNOWN_MODEL

    def resolve(self, name: str | None) -> ModelServices | None:
        """The model a request naming `name` is admitted against, None: no such model."""
        if name is not None:
            found = self._by_name.get(name)
            if found is not None:
                return found
        return self.default

    def for_request(
        self, body: bytes, parsed: dict[str, Any] | KvproxyError | None = None
    ) -> ModelServices | KvproxyError:
        """The request path's one lookup (a counted route's decoded body; `parsed`: that
        body already parsed, or the error parsing it gave)."""
        if self.implicit:
            return self.models[0]
        if isinstance(parsed, KvproxyError):
            return parsed
        if parsed is not None:
            data = parsed
        else:
            try:
                data = load_json(body)
            except KvproxyError as err:
                return err  # the same 400 parse_request would give
        raw = data.get("model")
        if raw is not None and not isinstance(raw, str):
            return errors.invalid_request("model must be a string", "model")
        found = self.resolve(raw)
        if found is None:
            return errors.model_not_found(raw, self.names)
        return found

    def ready(self) -> bool:
        """/readyz: any model ready (default) or all of them (`readiness: all`)."""
        states = [m.ready() for m in self.models]
        return all(states) if self.readiness == "all" else any(states)

    def not_ready_reason(self) -> str:
        if self.implicit:
            m = self.models[0]
            if not any(c.capacity.ready() for c in m.clusters):
                return "capacity unknown" + (" for every cluster" if m.gateway else "")
            return "engine posture (posture_action)"
        down = [m.name for m in self.models if not m.ready()]
        return f"capacity unknown for {', '.join(down)} (readiness: {self.readiness})"

    def snapshot_json(self) -> dict[str, Any]:
        """/capacity: the one model's snapshot, or grouped by model (one model's engines and
        limits say nothing about another's)."""
        if self.implicit:
            return self.models[0].capacity_json()
        return {
            "readiness": self.readiness,
            "models": {m.name: m.snapshot_json() for m in self.models},
        }

    def unknown_why(self, model: ModelServices) -> str:
        """Why a request of `model` is refused with 503 capacity_unknown (I3)."""
        why = "no fresh measurement"
        if model.gateway:
            why += " of any upstream cluster"
        if not self.implicit:
            why += f" of model {model.name}'s engines"  # the others may be serving
        return why

    @property
    def clusters(self) -> tuple[ClusterServices, ...]:
        return tuple(c for m in self.models for c in m.clusters)

    async def start(self) -> None:
        for c in self.clusters:
            await c.capacity.start()
            await c.budget.start()

    def reject_waiting(self) -> None:
        for c in self.clusters:
            c.budget.reject_waiting()

    async def stop_capacity(self) -> None:
        await asyncio.gather(*(c.capacity.stop() for c in self.clusters))

    async def aclose(self) -> None:
        """Budgets and counters, after the last request is gone."""
        for c in self.clusters:
            await c.budget.aclose()
        for m in self.models:
            await m.counter.aclose()


async def build_table(
    settings: Settings,
    metrics: Any,
    session: Any,
    *,
    counter: TokenCounter | None = None,
) -> ModelTable:
    """Every model's services, in configured order. `counter` (tests) replaces the first
    model's. A tokenizer that cannot be loaded raises ConfigError after closing the
    counters already built."""
    built: list[ModelServices] = []
    counters: list[TokenCounter] = []
    try:
        for i, spec in enumerate(settings.model_table()):
            name = spec.name
            ms = settings.for_model(spec)
            metrics.add_model(name)
            cs = _counting_settings(settings, spec, ms)
            c = counter if (i == 0 and counter is not None) else build_counter(cs, session=session)
            counters.append(c)
            built.append(_model_services(settings, spec, ms, c, metrics))
    except BaseException:
        for c in counters:
            if c is not counter:
                await c.aclose()
        raise
    implicit = not settings.models
    return ModelTable(
        built,
        default_model=IMPLICIT_MODEL if implicit else settings.default_model,
        readiness=settings.readiness,
        implicit=implicit,
    )


def _counting_settings(settings: Settings, spec: ModelSpec, ms: Settings) -> Settings:
    """What the model's counter is built from. With `upstreams`, a request is counted once,
    before its cluster is picked, so the count must hold on every cluster: the engines are
    all of them (the tokenizer `auto` resolves on them, the chat normalisation covers each
    kind) and the router is the clusters' common kind, else undetected (what holds behind
    every router is verified)."""
    if not spec.upstreams:
        return ms
    clusters = settings.clusters(spec)
    kinds = {c.router_kind for c in clusters}
    router = kinds.pop() if len(kinds) == 1 else "auto"
    engines = tuple(e for c in clusters for e in c.engines)
    return ms.model_copy(update={"engines": engines, "router_kind": router})


def _model_services(
    settings: Settings, spec: ModelSpec, ms: Settings, counter: TokenCounter, metrics: Metrics
) -> ModelServices:
    name = spec.name
    gateway = bool(spec.upstreams)
    clusters: list[ClusterServices] = []
    for cluster in settings.clusters(spec):
        cs = settings.for_cluster(spec, cluster)
        metrics.add_cluster(name, cluster.name)
        budget = build_budget(cs, metrics, name)
        health = routing.Health(
            settings.upstream_eject_s,
            settings.upstream_eject_max_s,
            settings.upstream_outlier_interval_s,
        )
        clusters.append(
            ClusterServices(
                name=cluster.name,
                url=cluster.url,
                weight=cluster.weight,
                settings=cs,
                # After the counter: a start that fails on the tokenizer says only that, not
                # the posture line the monitor logs when it is built. Several clusters feed
                # no verifier: each would overwrite the others' versions and router, and
                # the count is taken once for all of them (`_counting_settings`).
                capacity=CapacityMonitor(
                    cs,
                    metrics,
                    model=name,
                    verifier=None if gateway else counter.verifier,
                    upstream=cluster.name,
                    publish_model=not gateway,
                ),
                budget=budget,
                health=health,
            )
        )
        _publish_cluster(metrics, name, clusters[-1])
    if gateway:
        _publish_model(metrics, name, tuple(clusters))
    policy = routing.OutlierPolicy(
        consecutive=settings.upstream_outlier_consecutive,
        base_s=settings.upstream_eject_s,
        max_s=settings.upstream_eject_max_s,
        max_ejected_share=settings.upstream_outlier_max_ejected_share,
        interval_s=settings.upstream_outlier_interval_s,
        success_rate_min_requests=settings.upstream_outlier_success_rate_min_requests,
        success_rate_margin=settings.upstream_outlier_success_rate_margin,
    )
    return ModelServices(
        name=name,
        aliases=spec.aliases,
        settings=ms,
        counter=counter,
        clusters=tuple(clusters),
        gateway=gateway,
        affinity_header=settings.affinity_for(spec),
        # A lone cluster has nothing to eject it in favour of: `Outliers` ejects none.
        outliers=routing.Outliers(policy, {c.name: c.health for c in clusters}),
    )


def _publish_cluster(metrics: Metrics, model: str, c: ClusterServices) -> None:
    # Read at scrape time, like the budget's own gauges (no write per request).
    metrics.upstream_inflight_tokens.labels(model, c.name).set_function(
        lambda: c.budget.tokens_in_use
    )
    metrics.upstream_ejected.labels(model, c.name).set_function(
        lambda: 1 if c.health.ejected(time.monotonic()) else 0
    )


def _publish_model(metrics: Metrics, model: str, clusters: tuple[ClusterServices, ...]) -> None:
    """A gateway model's model-wide gauges over its clusters: the largest limit any measured
    cluster offers (what a refusal names), known while any is, the budget summed."""

    def offered(pick: Any) -> int:
        values = [pick(x) for x in (c.limits() for c in clusters) if x.known]
        return max((v for v in values if v is not None), default=0)

    metrics.admission_limit.labels(model).set_function(
        lambda: offered(lambda x: x.admission_limit_tokens)
    )
    metrics.decode_limit.labels(model).set_function(
        lambda: offered(lambda x: x.decode_limit_tokens)
    )
    metrics.capacity_known.labels(model).set_function(
        lambda: 1 if any(c.limits().known for c in clusters) else 0
    )
    metrics.budget_tokens_in_use.labels(model).set_function(
        lambda: sum(c.budget.tokens_in_use for c in clusters)
    )
    metrics.queue_depth.labels(model).set_function(
        lambda: sum(c.budget.queue_depth for c in clusters)
    )
    metrics.budget_tokens_limit.labels(model).set(sum(c.budget.max_tokens or 0 for c in clusters))
