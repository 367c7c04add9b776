"""Routing among a model's upstream clusters (gateway mode), sans-IO: fit first, then load.

A request is counted once; the clusters are then asked, in the admission module's own words
(`admission.decide` on each cluster's limits), whether they hold it. What this module owns:

    count_ceiling(clusters, shape, policy)   the largest count any measured cluster admits
                                             (the counter tokenizes exactly above it), None
                                             when no cluster is measured (I3: 503)
    Balancer.route(count, shape, clusters,   the cluster to send it to and that cluster's
                   policy, now, key, exclude)  Admit, or the refusal
    Health                                   one cluster's passive-health state: ejected
                                             for a back-off that doubles per consecutive
                                             ejection, cleared by an answer that is not 5xx

The rules, in order:
  - an unmeasured cluster is never a candidate (fail closed per cluster, I3); none measured
    is 503 `capacity_unknown`;
  - the candidates are the measured clusters whose limits hold the request (I1 and I4 per
    cluster); none is a refusal, the one `decide` gives on the cluster with the largest
    published limit, so a 400 `context_length_exceeded` names the largest limit any cluster
    offers (a prompt that fits no cluster, and the limit a client could still reach);
  - an ejected cluster is not a candidate while a healthy one fits (when only ejected ones
    fit, they are: a back-off is a guess, a refusal of a prompt some cluster holds is not);
  - affinity: the key (a header's value) is hashed over the healthy measured clusters by
    weighted rendezvous hashing (highest random weight; score -w / ln(u), Schindelhauer and
    Schomaker's weighted form, so a cluster of weight 2 wins twice as many keys). The winner
    is picked when it holds the request (reason `affinity`); when it cannot, the request
    falls back to fit and load. Hashing over every healthy measured cluster, not only those
    that fit, keeps a conversation on its cluster while its prompts fit there and sends only
    the ones that outgrow it elsewhere; adding or losing a cluster moves only its keys.
  - load: least in-flight prompt tokens relative to the cluster's pool (its admitting
    engines' measured pools), divided by its weight (`score`); exact ties (idle clusters, the
    common case at low load) go to smooth weighted round-robin (nginx's: each tied cluster
    gains its weight, the winner loses the sum), so sequential traffic splits exactly by
    weight and concurrent traffic leans on the less loaded cluster.

Why weighted least-load and not power of two choices (`python bench/routing_sim.py`: Poisson
arrivals of 100-5,000-token prompts, two and three clusters of pools 5,322 / 10,644 tokens,
the load a replica sees being its own in-flight tokens, 3 x 20,000 requests per row):
  - idle traffic (one request at a time, 200 requests): round-robin's split is exact; P2C's
    is binomial and misses the issue's 30 % band in 1.0 % of runs at weights 1:3 and 1.8 %
    with three clusters at 1:2:1 (500 seeds);
  - two clusters: P2C samples both every time, so it is least-load with a random tie-break:
    the same imbalance (time-averaged max - min utilisation 0.392 vs 0.387 at half load,
    0.431 vs 0.429 at 0.8);
  - three clusters: P2C sometimes compares the two busiest and misses the idle one:
    imbalance 0.503 vs 0.581 at half load, 0.616 vs 0.713 at 0.8, a lower 99th-percentile
    peak too.
P2C earns its keep with many backends and stale, shared load signals (its herd avoidance);
a model's few clusters, weighed on fresh local counts updated before the next pick, have
neither. Under load neither keeps the configured shares (split error 0.2-0.55): least load
trades share for even utilisation on purpose; the weights are the split at equal load.

Must never: pick an unmeasured cluster, pick a cluster whose limits do not hold the request,
or read anything but counts, limits, weights and names (no request content, I8).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from kvproxy.policy import admission, errors
from kvproxy.policy.counts import TokenCount

RoutingReason = Literal["fit", "affinity", "retry"]
EjectionCause = Literal["connect", "status_5xx"]
ROUTING_REASONS: tuple[RoutingReason, ...] = ("fit", "affinity", "retry")
EJECTION_CAUSES: tuple[EjectionCause, ...] = ("connect", "status_5xx")


class Health:
    """One cluster's passive health: ejected until `until` (monotonic seconds), the back-off
    doubling per consecutive ejection (`base_s`, 2 x, 4 x ... up to `max_s`)."""

    __slots__ = ("base_s", "consecutive", "max_s", "until")

    def __init__(self, base_s: float, max_s: float) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.until = 0.0
        self.consecutive = 0

    def ejected(self, now: float) -> bool:
        return now < self.until

    def eject(self, now: float) -> bool:
        """A connect failure or a 5xx: eject for the back-off. False when it was ejected
        already (requests sent before the ejection fail too; they do not double it)."""
        if self.ejected(now):
            return False
        self.until = now + min(self.base_s * 2.0**self.consecutive, self.max_s)
        self.consecutive += 1
        return True

    def ok(self) -> None:
        """An answer that is not 5xx: the next ejection starts from the base again."""
        self.consecutive = 0


class ClusterView(Protocol):
    """What routing reads of one cluster (kvproxy.serve.models.ClusterServices has it)."""

    @property
    def name(self) -> str: ...
    @property
    def weight(self) -> float: ...
    @property
    def health(self) -> Health: ...
    def limits(self) -> admission.LimitsView: ...
    def inflight_tokens(self) -> int: ...
    def pool_tokens(self) -> int | None: ...  # None: not measured (the limit stands in)


@dataclass(frozen=True, slots=True)
class Routed:
    cluster: ClusterView
    admit: admission.Admit
    reason: RoutingReason


def count_ceiling(
    clusters: Sequence[ClusterView], shape: admission.ShapeView, policy: admission.Policy
) -> int | None:
    """The largest per-sequence count any measured cluster admits for this shape (the count
    is taken once, exact whenever a cheap bound would miss the largest cluster); None when
    no cluster is measured."""
    best: int | None = None
    for c in clusters:
        limits = c.limits()
        if limits.known and limits.admission_limit_tokens is not None:
            ceiling = admission.count_ceiling(shape, limits, policy)
            best = ceiling if best is None else max(best, ceiling)
    return best


def score(cluster: ClusterView) -> float:
    """Load relative to the cluster's pool, per unit of weight: lower is picked."""
    pool = cluster.pool_tokens() or cluster.limits().admission_limit_tokens or 1
    return cluster.inflight_tokens() / (max(pool, 1) * cluster.weight)


def rendezvous(key: str, clusters: Sequence[ClusterView]) -> ClusterView | None:
    """Weighted highest-random-weight: the cluster with the largest -w / ln(u), u in (0, 1)
    a hash of (key, name). Stable for a key while the set holds; removing a cluster moves
    only the keys it had."""
    best: ClusterView | None = None
    best_score = -math.inf
    for c in clusters:
        digest = hashlib.blake2b(f"{c.name}\x00{key}".encode(), digest_size=8).digest()
        # (h + 1) / (2^64 + 1): strictly inside (0, 1), so the logarithm is finite and < 0.
        u = (int.from_bytes(digest, "big") + 1) / (2.0**64 + 1)
        s = -c.weight / math.log(u)
        if s > best_score:
            best, best_score = c, s
    return best


class Balancer:
    """One model's routing state: the smooth weighted round-robin that breaks load ties.
    Event-loop confined, like the budgets (no locks)."""

    __slots__ = ("_current",)

    def __init__(self) -> None:
        self._current: dict[str, float] = {}

    def route(
        self,
        count: TokenCount,
        shape: admission.ShapeView,
        clusters: Sequence[ClusterView],
        policy: admission.Policy,
        now: float,
        key: str | None = None,
        exclude: Collection[str] = (),
    ) -> Routed | admission.Reject:
        """The cluster for this request and its Admit, or the refusal (see the module
        docstring for the order of the rules). `exclude`: clusters already tried (a
        connect failure); a route that excludes any is a `retry`."""
        measured: list[ClusterView] = []
        fits: list[tuple[ClusterView, admission.Admit]] = []
        refusal: admission.Reject | None = None
        refusal_limit = -1
        for c in clusters:
            if c.name in exclude:
                continue
            limits = c.limits()
            if not limits.known or limits.admission_limit_tokens is None:
                continue
            measured.append(c)
            verdict = admission.decide(count, shape, limits, policy)
            if isinstance(verdict, admission.Admit):
                fits.append((c, verdict))
            elif limits.admission_limit_tokens > refusal_limit:
                refusal, refusal_limit = verdict, limits.admission_limit_tokens
        if not fits:
            if refusal is not None:
                return refusal
            return admission.Reject(errors.capacity_unknown(5, "no measured cluster"))
        healthy = [f for f in fits if not f[0].health.ejected(now)] or fits
        retry = bool(exclude)
        if key is not None and not retry:
            alive = [c for c in measured if not c.health.ejected(now)]
            home = rendezvous(key, alive)
            for c, admit in healthy:
                if c is home:
                    return Routed(c, admit, "affinity")
        c, admit = self._least_loaded(healthy)
        return Routed(c, admit, "retry" if retry else "fit")

    def _least_loaded(
        self, fits: list[tuple[ClusterView, admission.Admit]]
    ) -> tuple[ClusterView, admission.Admit]:
        if len(fits) == 1:
            return fits[0]
        scored = [(score(c), c, a) for c, a in fits]
        low = min(s for s, _, _ in scored)
        tied = [(c, a) for s, c, a in scored if s == low]
        if len(tied) == 1:
            return tied[0]
        # Smooth weighted round-robin over the tied clusters (nginx, ngx_http_upstream_round_
        # robin.c): each gains its weight, the largest wins and loses the total.
        cur = self._current
        total = 0.0
        best: tuple[ClusterView, admission.Admit] | None = None
        best_cur = -math.inf
        for c, a in tied:
            total += c.weight
            v = cur[c.name] = cur.get(c.name, 0.0) + c.weight
            if v > best_cur:
                best, best_cur = (c, a), v
        assert best is not None
        cur[best[0].name] -= total
        return best


__all__ = [
    "EJECTION_CAUSES",
    "ROUTING_REASONS",
    "Balancer",
    "ClusterView",
    "EjectionCause",
    "Health",
    "Routed",
    "RoutingReason",
    "count_ceiling",
    "rendezvous",
    "score",
]
