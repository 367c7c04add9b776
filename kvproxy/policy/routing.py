"""Routing among a model's upstream clusters (gateway mode), sans-IO: fit first, then load.

A request is counted once; the clusters are then asked, in the admission module's own words
(`admission.decide` on each cluster's limits), whether they hold it. What this module owns:

    count_ceiling(clusters, shape, policy)   the largest count any measured cluster admits
                                             (the counter tokenizes exactly above it), None
                                             when no cluster is measured (I3: 503)
    Balancer.route(count, shape, clusters,   the cluster to send it to and that cluster's
                   policy, now, key, exclude)  Admit, or the refusal
    Outliers.observe(cluster, outcome,       passive health (outlier detection): each
                     source, now)             exchange's outcome in, an Ejection (or a
                                             Capped one) out; `restored(now)` the clusters
                                             whose back-off passed, by cause
    Health                                   one cluster's state: back-off level, streak,
                                             success-rate window
    request_caused_5xx(status, type, body)   a 5xx the request caused (never a failure)

The rules, in order:
  - an unmeasured cluster is never a candidate (fail closed per cluster, I3); none measured
    is 503 `capacity_unknown`;
  - the candidates are the measured clusters whose limits hold the request (I1 and I4 per
    cluster); none is a refusal, the one `decide` gives on the cluster with the largest
    published limit, so a 400 `context_length_exceeded` names the largest limit any cluster
    offers (a prompt that fits no cluster, and the limit a client could still reach);
  - an ejected cluster is not a candidate while a healthy one fits (when only ejected ones
    fit, they are: a back-off is a guess, a refusal of a prompt some cluster holds is not);
  - affinity (when another cluster exists: a lone cluster's pick is by fit, with or
    without a key): the key (a header's value) is hashed over every configured cluster by
    weighted rendezvous hashing (highest random weight; score -w / ln(u), Schindelhauer and
    Schomaker's weighted form, so a cluster of weight 2 wins twice as many keys). The winner
    (the key's home) is picked when it can take the request now (reason `affinity`): it is
    measured, not ejected, its limits hold it and its budget lends its tokens without a
    wait. Otherwise the request spills at once to the least loaded other cluster that can
    (`Routed.spill`: unmeasured, ejected, limit, budget_full), so affinity never makes a
    request wait while another cluster could serve it; only when none can does a
    budget_full key queue at home. Hashing over every cluster, not only those that fit,
    keeps a conversation on its cluster while its prompts fit there and sends only the ones
    that outgrow it elsewhere; adding or losing a cluster moves only its keys.
  - load (among the candidates whose budget lends the request now, when any does): least
    in-flight prompt tokens relative to the cluster's pool (its admitting
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
import json
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

from kvproxy.policy import admission
from kvproxy.policy.counts import TokenCount

RoutingReason = Literal["fit", "affinity", "retry"]
ROUTING_REASONS: tuple[RoutingReason, ...] = ("fit", "affinity", "retry")
# What one exchange with a cluster's router said about the router (`Outliers.observe`):
#   connect      no connection (refused, unresolvable, or none within the connect timeout)
#   reset        the connection reset or closed before a response head
#   timeout      no response head within the read timeout
#   status_5xx   a 5xx head the router or its engines own (`request_caused_5xx` is False)
#   request_5xx  a 5xx head the request caused (the body says so): never a failure
#   success      any other head
Outcome = Literal["success", "connect", "reset", "timeout", "status_5xx", "request_5xx"]
FAILURES: tuple[Outcome, ...] = ("connect", "reset", "timeout", "status_5xx")
OUTCOMES: tuple[Outcome, ...] = ("success", *FAILURES, "request_5xx")
# Why a cluster was ejected: the failure that completed a streak of `consecutive`, or a
# success rate far below its siblings'.
EjectionCause = Literal["connect", "reset", "timeout", "status_5xx", "success_rate"]
EJECTION_CAUSES: tuple[EjectionCause, ...] = (
    "connect",
    "reset",
    "timeout",
    "status_5xx",
    "success_rate",
)
# Why an affinity key did not go to its home cluster (`Routed.spill`).
SpillReason = Literal["unmeasured", "ejected", "limit", "budget_full"]
SPILL_REASONS: tuple[SpillReason, ...] = ("unmeasured", "ejected", "limit", "budget_full")


@dataclass(frozen=True, slots=True)
class OutlierPolicy:
    """Outlier detection's knobs (kvproxy.config.settings: `upstream_outlier_*`,
    `upstream_eject_*`). Envoy's defaults, where it has one, are the comparison in
    docs/gateway.md."""

    consecutive: int = 5  # Envoy consecutive_5xx / consecutive_gateway_failure: 5
    base_s: float = 10.0  # ejection time at level 0 (Envoy base_ejection_time 30 s)
    max_s: float = 120.0  # the longest (Envoy max_ejection_time 300 s)
    # The largest share of a model's clusters ejected at once; one may always be, never the
    # last (Envoy max_ejection_percent 10 %, at least one host).
    max_ejected_share: float = 0.5
    # The success-rate window, and the healthy time that lowers the back-off level by one
    # (Envoy interval 10 s: its ejection multiplier decays the same way).
    interval_s: float = 10.0
    # Success rate: a cluster with at least this many outcomes in the window, whose success
    # rate is more than `success_rate_margin` below the mean of its siblings' (each with
    # that many too), is ejected (Envoy success_rate_minimum_hosts 5 and stdev_factor 1.9
    # never apply to a model's two or three clusters; a fixed margin does).
    success_rate_min_requests: int = 20
    success_rate_margin: float = 0.3


class Health:
    """One cluster's passive health (sans-IO; `Outliers` drives it).

    - ejected until `until` (monotonic seconds) for `base_s * 2**level`, at most `max_s`;
      `level` grows by one per ejection and falls by one per `decay_s` of health (not
      ejected), so a router that fails now and then starts from the base again, and one
      that keeps failing stays out longer: a 2xx alone never resets it;
    - `streak`: consecutive failures since the last success. A 5xx counts once per request
      source (tenant, else client address) in a streak: one tenant's requests that make the
      router answer 5xx cannot build a streak alone (`sources`);
    - the window (`ok`, `failed`, `window_sources`) for the success rate, reset every
      `decay_s`, with the same once-per-source rule for 5xx.
    """

    __slots__ = (
        "base_s",
        "cause",
        "decay_s",
        "decayed_at",
        "failed",
        "level",
        "max_s",
        "ok_count",
        "sources",
        "streak",
        "until",
        "window_sources",
        "window_start",
    )

    def __init__(self, base_s: float, max_s: float, decay_s: float | None = None) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.decay_s = decay_s if decay_s is not None else 6.0 * max_s
        self.until = 0.0
        self.level = 0
        self.decayed_at = 0.0
        self.cause: EjectionCause | None = None
        self.streak = 0
        self.sources: set[str] = set()
        self.ok_count = 0
        self.failed = 0
        self.window_sources: set[str] = set()
        self.window_start = 0.0

    @property
    def consecutive(self) -> int:
        """The back-off level (/capacity's `consecutive_ejections`)."""
        return self.level

    def ejected(self, now: float) -> bool:
        return now < self.until

    def _decay(self, now: float) -> None:
        if self.ejected(now) or self.level == 0:
            return
        since = max(self.until, self.decayed_at)
        steps = int((now - since) // self.decay_s)
        if steps > 0:
            self.level = max(0, self.level - steps)
            self.decayed_at = since + steps * self.decay_s

    def eject(self, now: float, cause: EjectionCause = "status_5xx") -> bool:
        """Eject for the back-off. False when it was ejected already (requests sent before
        the ejection fail too; they do not lengthen it)."""
        if self.ejected(now):
            return False
        self._decay(now)
        self.until = now + min(self.base_s * 2.0**self.level, self.max_s)
        self.decayed_at = self.until
        self.level += 1
        self.cause = cause
        self.clear(now)
        return True

    def restore(self) -> EjectionCause | None:
        """The back-off has passed: its cause once (a restore is counted once), then None."""
        cause, self.cause = self.cause, None
        return cause

    def ok(self) -> None:
        """A success ends the streak (the level decays with time, not with one answer)."""
        self.streak = 0
        self.sources.clear()

    def clear(self, now: float) -> None:
        self.streak = 0
        self.sources.clear()
        self.ok_count = self.failed = 0
        self.window_sources.clear()
        self.window_start = now

    def _window(self, now: float) -> None:
        if now - self.window_start >= self.decay_s:
            self.ok_count = self.failed = 0
            self.window_sources.clear()
            self.window_start = now

    def record(self, outcome: Outcome, source: str, now: float) -> bool:
        """Count one outcome; True when it was counted as a failure."""
        self._window(now)
        if outcome == "success":
            self.ok()
            self.ok_count += 1
            return False
        if outcome == "request_5xx":
            return False
        if outcome == "status_5xx":
            # Once per source: in the streak, and in the window.
            counted = False
            if source not in self.sources:
                self.sources.add(source)
                self.streak += 1
                counted = True
            if source not in self.window_sources:
                self.window_sources.add(source)
                self.failed += 1
                counted = True
            return counted
        self.streak += 1
        self.failed += 1
        return True

    def success_rate(self) -> float | None:
        total = self.ok_count + self.failed
        return self.ok_count / total if total else None


@dataclass(frozen=True, slots=True)
class Ejection:
    cluster: str
    cause: EjectionCause
    ejected_for_s: float
    level: int


@dataclass(frozen=True, slots=True)
class Capped:
    """An ejection the share cap refused (the cluster keeps serving)."""

    cluster: str
    cause: EjectionCause


def request_caused_5xx(status: int, content_type: str, body: bytes) -> bool:
    """A 5xx head whose body says the request caused it, not the router or its engines.

    What the routers send (the body's first bytes are enough: these are small JSON bodies):
      - 501 Not Implemented and 505: the request's method or version, never the router's
        health;
      - an OpenAI-shaped error (vLLM >= 0.10.1 `{"error": {"type", "code", ...}}`, SGLang's
        `{"object": "error", "type", "code"}`, smg's `{"error": {"type", "code",
        "message"}}`) whose `type` is a client error type (`invalid_request_error`,
        `BadRequestError`, `BadRequest`, `NotFoundError`, `UnprocessableEntityError`) or
        whose numeric `code` is 4xx: vLLM and SGLang put the status the error means there;
      - smg's wrap of a worker's 4xx: it answers a prefill 413 / 422 / 429 as a 500 whose
        message starts "Prefill server error (4" or "Decode server error (4".
    Anything else (a 500 InternalServerError, 502/503/504, no body, a non-JSON body) is the
    router's. A tenant can still cause such a 5xx; the once-per-source rule bounds that.
    """
    if status in (501, 505):
        return True
    if "json" not in content_type.lower() or not body:
        return False
    try:
        data = json.loads(body)
    except ValueError:
        return False
    if not isinstance(data, dict):
        return False
    err = data.get("error")
    fields: dict[str, Any] = err if isinstance(err, dict) else data
    etype = fields.get("type")
    if isinstance(etype, str) and etype in _CLIENT_ERROR_TYPES:
        return True
    code = fields.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 500:
        return True
    message = fields.get("message")
    return isinstance(message, str) and message.startswith(_SMG_WRAPPED_4XX)


_CLIENT_ERROR_TYPES = frozenset(
    {
        "invalid_request_error",
        "BadRequestError",
        "BadRequest",
        "NotFoundError",
        "UnprocessableEntityError",
    }
)
_SMG_WRAPPED_4XX = ("Prefill server error (4", "Decode server error (4")


class Outliers:
    """One model's outlier detection over its clusters' `Health` (sans-IO: outcomes in,
    ejections out). Event-loop confined, like the balancer.

    A cluster is ejected when a failure (`FAILURES`) completes a streak of
    `policy.consecutive`, or when its success rate in the window is more than
    `success_rate_margin` below its siblings' mean; never while the ejected share is at the
    cap, never the last cluster standing (a lone cluster: never, and nothing is reported).
    """

    __slots__ = ("health", "policy")

    def __init__(self, policy: OutlierPolicy, health: dict[str, Health]) -> None:
        self.policy = policy
        self.health = health

    def cap(self) -> int:
        n = len(self.health)
        return min(n - 1, max(1, int(n * self.policy.max_ejected_share)))

    def ejected_count(self, now: float) -> int:
        return sum(1 for h in self.health.values() if h.ejected(now))

    def restored(self, now: float) -> list[tuple[str, EjectionCause]]:
        """Clusters whose back-off passed since the last call, with their ejection's cause."""
        out: list[tuple[str, EjectionCause]] = []
        for name, h in self.health.items():
            if h.cause is not None and not h.ejected(now):
                cause = h.restore()
                assert cause is not None
                h.clear(now)
                out.append((name, cause))
        return out

    def observe(
        self, cluster: str, outcome: Outcome, source: str, now: float
    ) -> Ejection | Capped | None:
        if self.cap() < 1:
            # No sibling to take its traffic (a model of one cluster): nothing to eject it
            # in favour of, so nothing is detected, ejected or reported as capped.
            return None
        h = self.health[cluster]
        counted = h.record(outcome, source, now)
        if not counted or h.ejected(now):
            return None
        cause: EjectionCause | None = None
        if h.streak >= self.policy.consecutive:
            cause = outcome  # type: ignore[assignment]  # a counted failure is a cause
        elif self._rate_outlier(cluster, h, now):
            cause = "success_rate"
        if cause is None:
            return None
        if self.ejected_count(now) >= self.cap():
            return Capped(cluster, cause)
        h.eject(now, cause)
        return Ejection(cluster, cause, h.until - now, h.level)

    def _rate_outlier(self, cluster: str, h: Health, now: float) -> bool:
        p = self.policy
        if h.ok_count + h.failed < p.success_rate_min_requests:
            return False
        rate = h.success_rate()
        siblings = [
            r
            for name, o in self.health.items()
            if name != cluster
            and not o.ejected(now)
            and now - o.window_start < o.decay_s
            and o.ok_count + o.failed >= p.success_rate_min_requests
            and (r := o.success_rate()) is not None
        ]
        if rate is None or not siblings:
            return False
        return rate < sum(siblings) / len(siblings) - p.success_rate_margin


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
    def room_now(self, tokens: int) -> bool: ...  # its budget lends `tokens` without a wait


class Routed(NamedTuple):
    """One routing decision, built once a request (a single upstream's too): a NamedTuple
    builds in 1.2 us where a frozen slotted dataclass took 2.7 (timeit, the CI machine)."""

    cluster: ClusterView
    admit: admission.Admit
    reason: RoutingReason
    # An affinity key that did not go to its home cluster: why, and the home it left.
    spill: SpillReason | None = None
    home: ClusterView | None = None


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
            # None measured: `decide`'s own refusal of unknown limits (I3).
            return refusal or admission.unmeasured()
        healthy = [f for f in fits if not f[0].health.ejected(now)] or fits
        charge = max(shape.n, 1)
        # Those that can take it now: a full budget would make it wait while another lends.
        ready = [f for f in healthy if f[0].room_now(f[1].total * charge)]
        retry = bool(exclude)
        # Hashed over every configured cluster, so a key's home stays put while a cluster
        # is unmeasured or ejected; the key spills meanwhile. A key with no other cluster to
        # keep it from chose nothing: its pick is by fit, like a request without a key.
        home = rendezvous(key, clusters) if key is not None and not retry else None
        if home is not None and any(c is not home for c in clusters):
            home_fit = next((f for f in fits if f[0] is home), None)
            spill: SpillReason | None
            if home not in measured:
                spill = "unmeasured"
            elif home.health.ejected(now):
                spill = "ejected"
            elif home_fit is None:
                spill = "limit"
            elif not home.room_now(home_fit[1].total * charge):
                spill = "budget_full"
            else:
                return Routed(home, home_fit[1], "affinity")
            others = [f for f in ready if f[0] is not home]
            if others:
                c, admit = self._least_loaded(others)
                return Routed(c, admit, "fit", spill, home)
            if spill == "budget_full" and home_fit is not None:
                # No other cluster can take it now either: its own queue is as good as any.
                return Routed(home, home_fit[1], "affinity")
            c, admit = self._least_loaded(healthy)
            return Routed(c, admit, "fit", spill, home)
        c, admit = self._least_loaded(ready or healthy)
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
    "FAILURES",
    "OUTCOMES",
    "ROUTING_REASONS",
    "SPILL_REASONS",
    "Balancer",
    "Capped",
    "ClusterView",
    "Ejection",
    "EjectionCause",
    "Health",
    "Outcome",
    "OutlierPolicy",
    "Outliers",
    "Routed",
    "RoutingReason",
    "SpillReason",
    "count_ceiling",
    "rendezvous",
    "request_caused_5xx",
    "score",
]
