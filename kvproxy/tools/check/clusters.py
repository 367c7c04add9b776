"""`kvproxy check`'s layout for a model whose config names its PD clusters (gateway mode,
`upstreams`): `BY_CLUSTER`, the steps being the one gate's (kvproxy.tools.check.gate).

Each cluster is gated on its own (kvproxy.tools.check.engines: its engines measured, their
posture, its limits under the model's declared context, margin and fallback), and gets a
section of the record. Then, through the proxy, whose routing sends a prompt to a cluster
whose limits hold it:
  - each distinct cluster limit L: L-1 and L are admitted; L+1 is admitted when a larger
    cluster holds it, else refused with 400 context_length_exceeded;
  - with ground truth (`--sim NAME=URL` per cluster), a probe of n tokens arrives only at
    clusters whose limit is at least n: never at a smaller one (I1 per cluster), and a
    refused probe arrives nowhere (I7);
  - with the proxy's admin /metrics, each cluster's published limit
    (kvproxy_upstream_limit_tokens) is at most what the gate measured for it.
The model's own limits are the largest any measured cluster offers (what
kvproxy_admission_limit_tokens{model} publishes); the verdict fails when any cluster's does.
Never records prompt or completion text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aiohttp

from kvproxy.tools.check.boundary import REQUEST_TIMEOUT_S, Check
from kvproxy.tools.check.engines import (
    ClusterResult,
    ClusterTarget,
    GateOptions,
    Layout,
    engine_row,
)
from kvproxy.tools.client import (
    ProbeClient,
    boundary_prompts,
    fetch_sim_stats,
    sim_arrivals,
    sim_prefill_url,
)

__all__ = ["BY_CLUSTER", "ClusterTarget", "cluster_boundary_probes", "model_limits"]


def model_limits(results: Sequence[ClusterResult]) -> dict[str, Any]:
    """The model's limits as the proxy publishes them: the largest any measured cluster
    offers (kvproxy_admission_limit_tokens{model}); unknown while no cluster is measured."""
    known = [r for r in results if r.engines.admission_limit_tokens is not None]
    if not known:
        first = dict(results[0].engines.limits)
        first["why"] = "no cluster measured: " + str(first.get("why"))
        return first
    best = max(known, key=lambda r: r.engines.admission_limit_tokens or 0)
    limits = dict(best.engines.limits)
    limits["why"] = (
        f"largest limit any measured cluster offers: {best.target.name} ({limits['why']})"
    )
    limits["cluster"] = best.target.name
    return limits


async def _observe_all(
    http: aiohttp.ClientSession,
    proxy: str,
    body: dict[str, Any],
    headers: dict[str, str],
    sims: dict[str, str],
) -> tuple[Any, dict[str, str | None]]:
    """POST through the proxy between two reads of every cluster's ground truth: the reply
    and, per cluster with a simulator, which of its engines saw the probe ("" none)."""
    before = {n: await fetch_sim_stats(http, u) for n, u in sims.items()}
    reply = await ProbeClient(http, None).post(
        proxy + "/v1/completions", body, headers, REQUEST_TIMEOUT_S
    )
    after = {n: await fetch_sim_stats(http, u) for n, u in sims.items()}
    return reply, {n: sim_arrivals(before[n], after[n]) for n in sims}


async def cluster_boundary_probes(
    http: aiohttp.ClientSession,
    proxy: str,
    results: Sequence[ClusterResult],
    model: str,
    opts: GateOptions,
) -> list[Check]:
    """Each distinct cluster limit probed at L-1, L, L+1 through the proxy (module doc)."""
    limits = {r.target.name: r.limit for r in results if r.limit is not None}
    if not limits:
        return [Check("boundary probes", False, "no cluster limit could be measured")]
    sims = {r.target.name: r.target.gate.sim for r in results if r.target.gate.sim}
    ceiling = max(limits.values())
    counts = sorted({n for lim in limits.values() for n in (lim - 1, lim, lim + 1)})
    bases = [
        e.url.rstrip("/")
        for r in results
        for e in r.target.gate.engines
        if e.role in ("prefill", "unified")
    ]
    for url in sims.values():
        prefill = await sim_prefill_url(http, url)
        if prefill:
            bases.append(prefill)
    seed = "kvproxy release gate probe. " + "the quick brown fox jumps over the lazy dog " * 8
    probes = await boundary_prompts(http, [*bases, proxy], seed, counts, opts.probe_kind)
    checks: list[Check] = []
    for n in counts:
        holders = sorted(name for name, lim in limits.items() if lim >= n)
        body = {"model": model, "prompt": probes.prompts[n], "max_tokens": 1}
        headers = {"X-Request-ID": f"kvproxy-check-clusters-{n}"}
        reply, arrived = await _observe_all(http, proxy, body, headers, sims)
        landed = {name: a for name, a in arrived.items() if a}
        wrong = sorted(name for name in landed if name not in holders)
        data = {
            "tokens": n,
            "probe_kind": probes.kind,
            "status": reply.status,
            "code": reply.code or reply.error,
            "decision": reply.decision,
            "holders": holders,
            "arrived": arrived,
        }
        if holders:
            name = f"boundary {n:,} tokens (held by {', '.join(holders)})"
            ok = reply.status == 200
            detail = "admitted" if ok else f"expected 200, got {reply.describe()}"
            if reply.context_length_exceeded:
                detail += " (over_strict: a cluster holds it)"
        else:
            name = f"boundary {n:,} tokens (over every cluster, ceiling {ceiling:,})"
            ok = reply.context_length_exceeded
            detail = (
                "rejected with 400 context_length_exceeded"
                if ok
                else f"expected 400 context_length_exceeded, got {reply.describe()}"
            )
        if wrong:
            ok = False
            detail += f"; it arrived at {', '.join(wrong)}, whose limit is below it"
        elif sims:
            where = ", ".join(f"{k} ({v})" for k, v in sorted(landed.items())) or "no cluster"
            detail += f"; ground truth: it arrived at {where}"
            if not holders and landed:
                ok = False
        checks.append(Check(name, ok, detail, data))
    return checks


class _ByCluster:
    """A gateway model's record: a section per cluster (its engines, limits, posture, checks
    and verdict), the model's limits the largest any measured cluster offers, each
    cluster's checks after the probes under its name, probed at every cluster's limit."""

    def measuring(self, target: ClusterTarget) -> str | None:
        return f"[check] cluster {target.name}: measuring {len(target.gate.engines)} engines"

    def front_checks(self, results: Sequence[ClusterResult]) -> list[Check]:
        return []

    def read_proxy_limits(self, results: Sequence[ClusterResult], deferred: Any) -> None:
        """Each cluster's published limit (kvproxy_upstream_limit_tokens) is at most what the
        gate measured for it; the probes aim at it."""
        published = (deferred or {}).get("proxy_upstream_limit_tokens", {})
        for r in results:
            proxy_limit = published.get(r.target.name)
            if proxy_limit is None:
                continue
            measured = r.engines.admission_limit_tokens
            r.extra.append(
                Check(
                    "proxy enforces the measured limit",
                    measured is not None and proxy_limit <= measured,
                    f"proxy limit {proxy_limit:,}, measured {measured}",
                )
            )
            r.proxy_limit = proxy_limit

    async def probes(
        self,
        http: aiohttp.ClientSession,
        opts: GateOptions,
        results: Sequence[ClusterResult],
        model: str,
        deferred: dict[str, Any] | None,
        progress: Any,
    ) -> list[Check]:
        progress("[check] boundary probes at every cluster's limit ...")
        assert opts.proxy is not None
        return await cluster_boundary_probes(http, opts.proxy, results, model, opts)

    def back_checks(self, results: Sequence[ClusterResult]) -> list[Check]:
        return [
            Check(f"cluster {r.target.name}: {c.name}", c.passed, c.detail, c.data)
            for r in results
            for c in [*r.engines.checks, *r.extra]
        ]

    def record(self, results: Sequence[ClusterResult], failed: list[str]) -> dict[str, Any]:
        # A cluster whose engines could not be measured fails its "measure" checks: the
        # proxy would send it nothing, which is not the deployment the operator configured.
        return {
            "engines": [
                {**engine_row(s, m), "cluster": r.target.name}
                for r in results
                for s, m in r.engines.measured
            ],
            "limits": model_limits(results),
            "posture": None,
            "clusters": {r.target.name: r.section() for r in results},
            "passed": not failed,
            "failed_checks": failed,
        }


BY_CLUSTER: Layout = _ByCluster()
