"""`kvproxy check` for a model served by several PD clusters (gateway mode, `upstreams`).

Each cluster is gated on its own, the way one model is (kvproxy.tools.check.gate: its
engines measured, their posture, its limits under the model's declared context, margin and
fallback), and gets a section of the record. Then, through the proxy, whose routing sends a
prompt to a cluster whose limits hold it:
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

import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from kvproxy import __version__
from kvproxy.tools.check.boundary import (
    REQUEST_TIMEOUT_S,
    Check,
    isolation_checks,
    resolve_model,
    unknown_probe,
)
from kvproxy.tools.check.deferred import CHECK_NAME, deferred_counts, deferred_verdict
from kvproxy.tools.check.gate import EngineVerdict, GateOptions, engine_row, iso_time, judge_engines
from kvproxy.tools.check.record import SCHEMA, ReleaseRecord
from kvproxy.tools.client import (
    ModelUnknown,
    ProbeClient,
    boundary_prompts,
    fetch_sim_stats,
    sim_arrivals,
    sim_prefill_url,
)
from kvproxy.tools.isolation.harness import CanaryOptions, run_isolation, summary


@dataclass(frozen=True)
class ClusterTarget:
    """One cluster to gate: its name (the `upstream` label), router URL, weight, and the
    gate's options for its engines (`gate.sim` is its ground truth, if any)."""

    name: str
    url: str
    weight: float
    gate: GateOptions


@dataclass
class ClusterResult:
    target: ClusterTarget
    engines: EngineVerdict
    proxy_limit: int | None = None

    @property
    def limit(self) -> int | None:
        """The limit the probes aim at: the proxy's published one when read, else measured."""
        return self.proxy_limit or self.engines.admission_limit_tokens

    def section(self, extra: list[Check]) -> dict[str, Any]:
        checks = [*self.engines.checks, *extra]
        failed = [c.name for c in checks if not c.passed]
        if not self.engines.ok:
            failed.append("no engine measured")
        t = self.target
        return {
            "url": t.url,
            "weight": t.weight,
            "engines": [engine_row(s, m) for s, m in self.engines.measured],
            "limits": self.engines.limits,
            "safe_max_context_tokens": self.engines.safe_ctx,
            "posture": self.engines.posture,
            "checks": [asdict(c) for c in checks],
            "passed": not failed,
            "failed_checks": failed,
        }


def model_limits(results: list[ClusterResult]) -> dict[str, Any]:
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
    results: list[ClusterResult],
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


async def run_cluster_gate(
    opts: GateOptions, clusters: list[ClusterTarget], progress: Any = print
) -> ReleaseRecord:
    """Gate every cluster of one model and the proxy's routing between them (module doc).
    `opts` carries the model-level options (proxy, admin, canary, model name)."""
    started = time.time()
    checks: list[Check] = []
    results: list[ClusterResult] = []
    extra: dict[str, list[Check]] = {c.name: [] for c in clusters}
    async with aiohttp.ClientSession() as http:
        for cluster in clusters:
            progress(
                f"[check] cluster {cluster.name}: measuring {len(cluster.gate.engines)} engines"
            )
            results.append(ClusterResult(cluster, await judge_engines(http, cluster.gate)))
        deferred = None
        if opts.proxy_admin:
            deferred = await deferred_counts(http, opts.proxy_admin, opts.limit_model)
            if deferred is None:
                checks.append(Check("proxy metrics", False, "admin /metrics unreachable"))
        published = (deferred or {}).get("proxy_upstream_limit_tokens", {})
        for r in results:
            proxy_limit = published.get(r.target.name)
            if proxy_limit is None:
                continue
            measured = r.engines.admission_limit_tokens
            extra[r.target.name].append(
                Check(
                    "proxy enforces the measured limit",
                    measured is not None and proxy_limit <= measured,
                    f"proxy limit {proxy_limit:,}, measured {measured}",
                )
            )
            r.proxy_limit = proxy_limit
        model = ""
        if opts.proxy or opts.canary:
            try:
                bases = [u for u in (opts.proxy,) if u]
                bases += [e.url.rstrip("/") for c in clusters for e in c.gate.engines]
                model, source = await resolve_model(http, opts.model, bases)
                progress(f"[check] model {model} (from {source})")
            except ModelUnknown as exc:
                checks.append(Check("model", False, str(exc)))
        if opts.proxy and model:
            progress("[check] boundary probes at every cluster's limit ...")
            checks.extend(await cluster_boundary_probes(http, opts.proxy, results, model, opts))
        if opts.unknown_probe:
            # kvproxy answers capacity_unknown before it looks at the model.
            checks.append(await unknown_probe(http, opts.unknown_probe, model or "default"))
    for r in results:
        for c in [*r.engines.checks, *extra[r.target.name]]:
            checks.append(Check(f"cluster {r.target.name}: {c.name}", c.passed, c.detail, c.data))
    limits = model_limits(results)
    isolation = None
    if opts.canary and model and opts.proxy:
        # One run through the proxy at the model's ceiling; the ground truth and the
        # engine it measures prompts with are the largest cluster's (the only one a prompt
        # at the ceiling may reach).
        top = next((r for r in results if r.target.name == limits.get("cluster")), results[0])
        report = await run_isolation(
            CanaryOptions(
                target=opts.proxy,
                sim=top.target.gate.sim,
                engine=next(
                    (e.url.rstrip("/") for e in top.target.gate.engines if e.role != "decode"),
                    None,
                ),
                proxy_admin=opts.proxy_admin,
                limit=limits.get("admission_limit_tokens"),
                model=model,
                probe_kind=opts.probe_kind,
                allow_partial=opts.canary_allow_partial,
                rounds=opts.canary_rounds,
                prompt_chars=opts.canary_prompt_chars,
                progress=progress,
            )
        )
        isolation = report.to_json()
        checks.extend(isolation_checks(report))
        progress(summary(report))
    elif opts.canary:
        checks.append(Check("isolation", False, "--canary needs --proxy (the target)"))
    if deferred is not None:
        verdict = deferred_verdict(deferred, opts.accept_drain_timeouts)
        checks.append(Check(CHECK_NAME, verdict.passed, verdict.detail, deferred))
    sections = {r.target.name: r.section(extra[r.target.name]) for r in results}
    # A cluster whose engines could not be measured fails its "measure" checks: the proxy
    # would send it nothing, which is not the deployment the operator configured.
    failed = [c.name for c in checks if not c.passed]
    safe = [r.engines.safe_ctx for r in results if r.engines.safe_ctx is not None]
    return ReleaseRecord(
        schema=SCHEMA,
        kvproxy_version=__version__,
        started_at=iso_time(started),
        finished_at=iso_time(time.time()),
        host=socket.gethostname(),
        declared_context_tokens=opts.max_context,
        engines=[
            {**engine_row(s, m), "cluster": r.target.name}
            for r in results
            for s, m in r.engines.measured
        ],
        limits=limits,
        safe_max_context_tokens=max(safe) if safe else None,
        checks=checks,
        deferred_cancellations=deferred,
        accept_drain_timeouts=opts.accept_drain_timeouts,
        isolation=isolation,
        passed=not failed,
        failed_checks=failed,
        posture=None,
        clusters=sections,
    )
