"""`kvproxy check`: the release gate and its release record.

Runs in CI/CD before a rollout that touches long-context settings:
  1. measures every engine with the same probes the proxy uses (kvproxy.capacity);
  2. compares the declared context with the measured limits (kvproxy.capacity.limits_for,
     the call the proxy's capacity monitor makes, with the same settings: declared
     context, margin, fallback) and names the largest safe value;
  3. with --proxy: boundary probes (limit-1 and limit admitted, limit+1 rejected with 400
     context_length_exceeded and, with --sim, proven never to reach the engines);
  4. with --canary: the isolation scenarios (kvproxy.tools.isolation), folded into the
     verdict;
  5. with --proxy-admin: the proxy's deferred-cancellation counts by outcome, read after the
     isolation scenarios (they defer cancellations of their own); a deferral
     that ended unconfirmed (timeout, shutdown) fails the gate unless the operator passes
     --accept-drain-timeouts, which the record keeps (kvproxy.tools.check.deferred).
It fills in a release record (kvproxy.tools.check.record: JSON with its schema beside it, and
Markdown) and passes only when every check passed; the command line is
kvproxy.tools.check.cli. Never records prompt or completion text.

One gate for every config shape: a model's clusters are measured and probed by the same
steps (`run_gate`). The single-upstream form is its one implicit cluster, recorded flat
(`FLAT`: the model's engines, limits and posture, probed at its limit); a gateway model's
named clusters are each recorded in a section and probed at every cluster's limit
(kvproxy.tools.check.clusters.BY_CLUSTER).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from kvproxy import __version__
from kvproxy.config import IMPLICIT_CLUSTER
from kvproxy.tools.check.boundary import (
    Check,
    boundary_probes,
    isolation_checks,
    resolve_model,
    unknown_probe,
)
from kvproxy.tools.check.clusters import BY_CLUSTER
from kvproxy.tools.check.deferred import CHECK_NAME, deferred_counts, deferred_verdict
from kvproxy.tools.check.engines import (
    ClusterResult,
    ClusterTarget,
    GateOptions,
    Layout,
    engine_row,
    iso_time,
    judge_engines,
    top_result,
)
from kvproxy.tools.check.record import (
    SCHEMA,
    ReleaseRecord,
    engine_table,
    markdown,
    write_record,
)
from kvproxy.tools.client import ModelUnknown
from kvproxy.tools.isolation.harness import CanaryOptions, run_isolation, summary

__all__ = [
    "FLAT",
    "Check",
    "ClusterTarget",
    "GateOptions",
    "ReleaseRecord",
    "engine_table",
    "markdown",
    "run_gate",
    "write_record",
]


class _Flat:
    """The single-upstream form's record: its one cluster's engines, limits and posture at
    the top, its checks first, probed at its limit (the proxy's published one when read)."""

    def measuring(self, target: ClusterTarget) -> str | None:
        return None

    def front_checks(self, results: Sequence[ClusterResult]) -> list[Check]:
        return [c for r in results for c in r.engines.checks]

    def read_proxy_limits(self, results: Sequence[ClusterResult], deferred: Any) -> None:
        return None  # compared with the measured limit by the probes (below)

    async def probes(
        self,
        http: aiohttp.ClientSession,
        opts: GateOptions,
        results: Sequence[ClusterResult],
        model: str,
        deferred: dict[str, Any] | None,
        progress: Any,
    ) -> list[Check]:
        checks: list[Check] = []
        top = top_result(results)
        probe_limit = top.engines.admission_limit_tokens
        proxy_limit = deferred.get("proxy_admission_limit_tokens") if deferred else None
        if proxy_limit:
            checks.append(
                Check(
                    "proxy enforces the measured limit",
                    probe_limit is not None and proxy_limit <= probe_limit,
                    f"proxy limit {proxy_limit:,}, measured {probe_limit}",
                )
            )
            probe_limit = proxy_limit
        if probe_limit is None:
            checks.append(Check("boundary probes", False, "no limit could be measured"))
            return checks
        progress(f"[check] boundary probes at {probe_limit:,} tokens ...")
        gate = top.target.gate
        assert opts.proxy is not None
        checks += await boundary_probes(
            http, opts.proxy, gate.engines, gate.sim, probe_limit, model, opts.probe_kind
        )
        return checks

    def back_checks(self, results: Sequence[ClusterResult]) -> list[Check]:
        return []

    def record(self, results: Sequence[ClusterResult], failed: list[str]) -> dict[str, Any]:
        top = top_result(results)
        measured = any(r.engines.ok for r in results)
        return {
            "engines": [engine_row(s, m) for r in results for s, m in r.engines.measured],
            "limits": top.engines.limits,
            "posture": top.engines.posture,
            "clusters": None,
            "passed": not failed and measured,
            "failed_checks": failed or ([] if measured else ["no engine measured"]),
        }


FLAT: Layout = _Flat()


async def run_gate(
    opts: GateOptions, progress: Any = print, clusters: Sequence[ClusterTarget] = ()
) -> ReleaseRecord:
    """Gate one model: each of its clusters' engines, the proxy's limits and boundary, the
    capacity-unknown probe, the isolation scenarios and the deferral counts (module doc).
    `clusters`: a gateway model's named clusters, each with the gate's options for its own
    engines (`opts` carries the model-level ones: proxy, admin, canary, model name); none:
    the model's engines (`opts`) are its one implicit cluster."""
    layout = BY_CLUSTER if clusters else FLAT
    targets = tuple(clusters) or (ClusterTarget(IMPLICIT_CLUSTER, "", 1.0, opts),)
    started = time.time()
    results: list[ClusterResult] = []
    async with aiohttp.ClientSession() as http:
        for target in targets:
            line = layout.measuring(target)
            if line is not None:
                progress(line)
            results.append(ClusterResult(target, await judge_engines(http, target.gate)))
        checks = layout.front_checks(results)
        deferred = None
        if opts.proxy_admin:
            deferred = await deferred_counts(http, opts.proxy_admin, opts.limit_model)
            if deferred is None:
                checks.append(Check("proxy metrics", False, "admin /metrics unreachable"))
        layout.read_proxy_limits(results, deferred)
        model = "default"
        if opts.proxy or opts.canary:
            try:
                bases = [u for u in (opts.proxy, opts.unknown_probe) if u]
                bases += [e.url.rstrip("/") for t in targets for e in t.gate.engines]
                model, model_source = await resolve_model(http, opts.model, bases)
                progress(f"[check] model {model} (from {model_source})")
            except ModelUnknown as exc:
                checks.append(Check("model", False, str(exc)))
                model = ""
        if opts.proxy and model:
            checks += await layout.probes(http, opts, results, model, deferred, progress)
        if opts.unknown_probe:
            # kvproxy answers capacity_unknown before it looks at the model.
            checks.append(await unknown_probe(http, opts.unknown_probe, model or "default"))
    checks += layout.back_checks(results)
    isolation = None
    if opts.canary and model:
        isolation = await _isolation(opts, top_result(results), model, checks, progress)
    if deferred is not None:
        deferred = await _deferred_after(opts, deferred, checks)
    failed = [c.name for c in checks if not c.passed]
    safe = [r.engines.safe_ctx for r in results if r.engines.safe_ctx is not None]
    return ReleaseRecord(
        schema=SCHEMA,
        kvproxy_version=__version__,
        started_at=iso_time(started),
        finished_at=iso_time(time.time()),
        host=socket.gethostname(),
        declared_context_tokens=opts.max_context,
        safe_max_context_tokens=max(safe) if safe else None,
        checks=checks,
        deferred_cancellations=deferred,
        accept_drain_timeouts=opts.accept_drain_timeouts,
        isolation=isolation,
        **layout.record(results, failed),
    )


async def _isolation(
    opts: GateOptions, top: ClusterResult, model: str, checks: list[Check], progress: Any
) -> dict[str, Any] | None:
    """One isolation run through the proxy at the model's limit; the ground truth and the
    engine it measures prompts with are the cluster's that offers it (the only one a prompt
    at that limit may reach). Its checks go into `checks`."""
    if opts.proxy is None:
        checks.append(Check("isolation", False, "--canary needs --proxy (the target)"))
        return None
    gate = top.target.gate
    report = await run_isolation(
        CanaryOptions(
            target=opts.proxy,
            sim=gate.sim,
            engine=next((e.url.rstrip("/") for e in gate.engines if e.role != "decode"), None),
            proxy_admin=opts.proxy_admin,
            limit=top.engines.admission_limit_tokens,
            model=model,
            probe_kind=opts.probe_kind,
            allow_partial=opts.canary_allow_partial,
            rounds=opts.canary_rounds,
            prompt_chars=opts.canary_prompt_chars,
            progress=progress,
        )
    )
    checks.extend(isolation_checks(report))
    progress(summary(report))
    return report.to_json()


async def _deferred_after(
    opts: GateOptions, deferred: dict[str, Any], checks: list[Check]
) -> dict[str, Any]:
    """The deferral counts read again at the end: the isolation scenarios (cancel) defer
    cancellations of their own, and a drain they caused that ended by timeout must fail
    the gate too. Its verdict goes into `checks`."""
    async with aiohttp.ClientSession() as http:
        after = await deferred_counts(http, opts.proxy_admin or "", opts.limit_model)
    if after is None:
        checks.append(Check("proxy metrics", False, "admin /metrics unreachable at the end"))
    else:
        deferred = after
    verdict = deferred_verdict(deferred, opts.accept_drain_timeouts)
    checks.append(Check(CHECK_NAME, verdict.passed, verdict.detail, deferred))
    return deferred
