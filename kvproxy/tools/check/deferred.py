"""The release gate's "deferred cancellations" check: read the proxy's deferral outcomes and
decide whether they let a rollout through.

The incident's rule is that page reuse before drain blocks a rollout. A deferral that ended
on `first_token` or `completed` proves decode held the KV (the transfer was over); one that
ended on `upstream_error` was ended by the upstream, not by kvproxy. `timeout` (the drain
deadline passed) and `shutdown` (the shutdown grace ran out) prove nothing: kvproxy closed
the upstream without a safe point, so decode may have freed pages RDMA writes still reached.
Those fail the check unless the operator accepts them explicitly with
`--accept-drain-timeouts`, and the record says that they did.

Reads metric counts only; never sees request content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvproxy.policy import DEFERRED_OUTCOMES, UpstreamFailure
from kvproxy.upstream import network_boundary

# Outcomes where kvproxy stopped waiting before the drain was confirmed (see drain.py).
UNCONFIRMED_OUTCOMES = ("timeout", "shutdown")
CHECK_NAME = "deferred cancellations"


@dataclass(frozen=True, slots=True)
class DeferredVerdict:
    passed: bool
    detail: str


async def deferred_counts(
    http: aiohttp.ClientSession, admin: str, model: str | None = None
) -> dict[str, Any] | None:
    """The proxy's deferral counts by outcome and its admission limit, from admin /metrics;
    None when the admin endpoint cannot be read. `model` picks one configured model's limit
    (its `model` label) on a proxy that serves several; the deferrals are the replica's."""
    try:
        with network_boundary():
            async with http.get(admin + "/metrics") as resp:
                text = await resp.text()
    except UpstreamFailure:
        return None
    counts: dict[str, float] = dict.fromkeys(DEFERRED_OUTCOMES, 0.0)
    limit = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvproxy_deferred_cancellations_total":
                # Summed over the `upstream` label: the replica's deferrals, every cluster's.
                outcome = s.labels.get("outcome", "")
                counts[outcome] = counts.get(outcome, 0.0) + s.value
            elif s.name == "kvproxy_admission_limit_tokens" and (
                model is None or s.labels.get("model") == model
            ):
                limit = int(s.value)
    unconfirmed = int(sum(counts.get(o, 0) for o in UNCONFIRMED_OUTCOMES))
    return {
        "by_outcome": counts,
        "timeouts_flagged": unconfirmed > 0,
        "unconfirmed": unconfirmed,
        "proxy_admission_limit_tokens": limit,
    }


def deferred_verdict(deferred: dict[str, Any], accept_drain_timeouts: bool) -> DeferredVerdict:
    """Pass only if no deferral ended unconfirmed, or the operator accepted that."""
    by_outcome: dict[str, float] = deferred["by_outcome"]
    counts = ", ".join(f"{k}={int(v)}" for k, v in by_outcome.items())
    unconfirmed = {o: int(by_outcome.get(o, 0)) for o in UNCONFIRMED_OUTCOMES}
    total = sum(unconfirmed.values())
    if total == 0:
        return DeferredVerdict(True, counts)
    which = " and ".join(f"{n} by {o}" for o, n in unconfirmed.items() if n)
    if accept_drain_timeouts:
        return DeferredVerdict(
            True,
            f"{counts}; {which}: drain not confirmed, ACCEPTED by the operator "
            "(--accept-drain-timeouts)",
        )
    return DeferredVerdict(
        False,
        f"{counts}; {which}: drain not confirmed, so decode may have reused pages before "
        "the transfer ended. Find why (KvproxyDeferredCancelTimeouts, the engines' PD "
        "timeouts), or accept it explicitly with --accept-drain-timeouts",
    )
