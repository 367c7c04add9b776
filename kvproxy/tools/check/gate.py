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
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvproxy import __version__
from kvproxy.capacity import (
    EngineMeasurement,
    ProbeError,
    expand_engine,
    held_context,
    limits_for,
    probe_engine,
    system_resolver,
)
from kvproxy.config import EngineSpec
from kvproxy.tools.check.boundary import (
    Check,
    boundary_probes,
    isolation_checks,
    resolve_model,
    unknown_probe,
)
from kvproxy.tools.check.deferred import CHECK_NAME, deferred_counts, deferred_verdict
from kvproxy.tools.check.posture import CHECK_NAME as POSTURE_CHECK
from kvproxy.tools.check.posture import posture_check
from kvproxy.tools.check.record import (
    SCHEMA,
    ReleaseRecord,
    engine_table,
    markdown,
    write_record,
)
from kvproxy.tools.client import ModelUnknown, ProbeChoice
from kvproxy.tools.isolation.harness import CanaryOptions, run_isolation, summary

__all__ = [
    "Check",
    "GateOptions",
    "ReleaseRecord",
    "engine_table",
    "markdown",
    "run_gate",
    "write_record",
]

PROBE_TIMEOUT_S = 10.0


@dataclass
class GateOptions:
    engines: tuple[EngineSpec, ...]
    max_context: int | None
    # The rest of what the proxy's limits depend on (kvproxy.capacity.limits_for), from the
    # same settings the proxy loads: the gate probes the limit the proxy enforces.
    limit_margin_tokens: int = 0
    capacity_fallback_limit_tokens: int | None = None
    proxy: str | None = None
    proxy_admin: str | None = None
    sim: str | None = None
    canary: bool = False
    unknown_probe: str | None = None
    out: Path | None = None
    model: str | None = None  # None: the proxy's (else an engine's) /v1/models
    probe_kind: ProbeChoice = "auto"
    # The operator accepts deferrals that ended without a confirmed drain (kept in the record).
    accept_drain_timeouts: bool = False
    # The operator accepts an isolation run that skipped scenarios (kept in its report).
    canary_allow_partial: bool = False
    # The isolation scenarios' rounds and long-prompt size (kvproxy canary's --rounds and
    # --prompt-chars): replies are asked for as many tokens as the prompt has characters.
    canary_rounds: int = 4
    canary_prompt_chars: int | None = None
    # Engine posture (kvproxy.posture): the operator's advisories and accepted ids.
    advisories_file: str | None = None
    accept_advisories: tuple[str, ...] = ()
    # A configured model (a `models` entry): the name whose limit the proxy's
    # metrics carry under `model`; None reads the single model's.
    limit_model: str | None = None


def iso_time(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


async def measure(
    http: aiohttp.ClientSession, specs: tuple[EngineSpec, ...]
) -> list[tuple[EngineSpec, EngineMeasurement | ProbeError]]:
    """Every engine (DNS names expanded), probed concurrently with the proxy's own probes."""
    expanded: list[EngineSpec | tuple[EngineSpec, ProbeError]] = []
    for spec in specs:
        try:
            expanded.extend(await expand_engine(spec, system_resolver, PROBE_TIMEOUT_S))
        except ProbeError as exc:
            expanded.append((spec, exc))

    async def one(spec: EngineSpec) -> EngineMeasurement | ProbeError:
        try:
            return await probe_engine(http, spec, PROBE_TIMEOUT_S)
        except ProbeError as exc:
            return exc

    out: list[tuple[EngineSpec, EngineMeasurement | ProbeError]] = []
    todo = [e for e in expanded if isinstance(e, EngineSpec)]
    results = await asyncio.gather(*(one(s) for s in todo))
    out.extend(zip(todo, results, strict=True))
    out.extend(e for e in expanded if isinstance(e, tuple))
    return out


def declared_context_check(
    declared: int, measured: list[EngineMeasurement], safe_limit: int, why: str
) -> Check:
    """The incident's misconfiguration: a declared context larger than what an admitting
    engine holds. Compared in the same unit (tokens of context: min(context, pool), as
    `held_context` computes it for the proxy's own warning), so a healthy 8,192 / 8,192
    deployment passes; the safe value printed is the largest prompt the engines accept."""
    held = held_context(measured)
    if held is None:
        return Check("declared context fits every engine", False, "no engine measured")
    cap, m = held
    data = {"declared": declared, "engine_holds": cap, "engine": m.engine, "safe": safe_limit}
    if declared <= cap:
        return Check(
            "declared context fits every engine",
            True,
            f"declared {declared:,} <= {cap:,} held by {m.engine}; "
            f"largest admitted prompt {safe_limit:,}",
            data,
        )
    return Check(
        "declared context fits every engine",
        False,
        f"declared {declared:,} exceeds the {cap:,} tokens {m.engine} holds "
        f"({m.pool_source}); measured limit {safe_limit:,} ({why}); set the declared "
        f"context to at most {safe_limit:,}",
        data,
    )


def engine_row(spec: EngineSpec, m: EngineMeasurement | ProbeError) -> dict[str, Any]:
    row: dict[str, Any] = {
        "engine": spec.label,
        "url": spec.url,
        "role": spec.role,
        "kind": spec.kind,
    }
    if isinstance(m, ProbeError):
        row["error"] = {"reason": m.reason, "message": m.message}
        return row
    row["engine"] = m.engine
    row.update(m.to_json())
    return row


@dataclass
class EngineVerdict:
    """What the gate found about one set of engines (a model's, or one cluster's): the
    measurements, the checks on them, their posture and the limits the proxy would enforce."""

    measured: list[tuple[EngineSpec, EngineMeasurement | ProbeError]]
    checks: list[Check]
    posture: dict[str, Any]
    # The limits the proxy would enforce (kvproxy.capacity.limits_for), as the record shows.
    limits: dict[str, Any]
    admission_limit_tokens: int | None
    # What the measured engines alone can take (no declared context, margin or unmeasured).
    safe_ctx: int | None

    @property
    def ok(self) -> list[EngineMeasurement]:
        return [m for _, m in self.measured if isinstance(m, EngineMeasurement)]


async def judge_engines(http: aiohttp.ClientSession, opts: GateOptions) -> EngineVerdict:
    """Measure `opts.engines`, check each and their posture, derive the proxy's limits."""
    checks: list[Check] = []
    measured = await measure(http, opts.engines)
    ok_m = [m for _, m in measured if isinstance(m, EngineMeasurement)]
    for spec, m in measured:
        if isinstance(m, ProbeError):
            checks.append(Check(f"measure {spec.label}", False, f"probe failed: {m}"))
        else:
            checks.append(
                Check(
                    f"measure {m.engine}",
                    True,
                    f"{m.role} input limit {m.input_limit_tokens:,} ({m.input_limit_source})",
                )
            )
    ok, detail, posture = posture_check(measured, opts.advisories_file, opts.accept_advisories)
    checks.append(Check(POSTURE_CHECK, ok, detail, {"blocking": posture["blocking"]}))
    # What the proxy would enforce with these measurements: an engine the gate could
    # not measure is unknown to it too (fail closed, or the configured fallback).
    unmeasured = {spec.label: spec.role for spec, m in measured if isinstance(m, ProbeError)}
    limits = limits_for(opts, ok_m, unmeasured)
    safe_ctx = limits.measured_limit_tokens
    if opts.max_context is not None and safe_ctx is not None:
        checks.append(declared_context_check(opts.max_context, ok_m, safe_ctx, limits.measured_why))
    return EngineVerdict(
        measured, checks, posture, limits.to_json(), limits.admission_limit_tokens, safe_ctx
    )


async def run_gate(opts: GateOptions, progress: Any = print) -> ReleaseRecord:
    started = time.time()
    async with aiohttp.ClientSession() as http:
        engines = await judge_engines(http, opts)
        measured, ok_m, checks = engines.measured, engines.ok, engines.checks
        posture, safe_ctx = engines.posture, engines.safe_ctx
        admission_limit = engines.admission_limit_tokens
        deferred = None
        if opts.proxy_admin:
            deferred = await deferred_counts(http, opts.proxy_admin, opts.limit_model)
            if deferred is None:
                checks.append(Check("proxy metrics", False, "admin /metrics unreachable"))
        model = "default"
        if opts.proxy or opts.canary:
            try:
                bases = [u for u in (opts.proxy, opts.unknown_probe) if u]
                bases += [e.url.rstrip("/") for e in opts.engines]
                model, model_source = await resolve_model(http, opts.model, bases)
                progress(f"[check] model {model} (from {model_source})")
            except ModelUnknown as exc:
                checks.append(Check("model", False, str(exc)))
                model = ""
        if opts.proxy and model:
            probe_limit = admission_limit
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
            else:
                progress(f"[check] boundary probes at {probe_limit:,} tokens ...")
                checks.extend(
                    await boundary_probes(
                        http,
                        opts.proxy,
                        opts.engines,
                        opts.sim,
                        probe_limit,
                        model,
                        opts.probe_kind,
                    )
                )
        if opts.unknown_probe:
            # kvproxy answers capacity_unknown before it looks at the model.
            checks.append(await unknown_probe(http, opts.unknown_probe, model or "default"))
    isolation = None
    if opts.canary and model:
        target = opts.proxy
        if target is None:
            checks.append(Check("isolation", False, "--canary needs --proxy (the target)"))
        else:
            report = await run_isolation(
                CanaryOptions(
                    target=target,
                    sim=opts.sim,
                    engine=next(
                        (e.url.rstrip("/") for e in opts.engines if e.role != "decode"), None
                    ),
                    proxy_admin=opts.proxy_admin,
                    limit=admission_limit,
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
    if deferred is not None:
        # Read again now: the isolation scenarios (cancel) defer cancellations of their own,
        # and a drain they caused that ended by timeout must fail the gate too.
        async with aiohttp.ClientSession() as http:
            after = await deferred_counts(http, opts.proxy_admin or "", opts.limit_model)
        if after is None:
            checks.append(Check("proxy metrics", False, "admin /metrics unreachable at the end"))
        else:
            deferred = after
        verdict = deferred_verdict(deferred, opts.accept_drain_timeouts)
        checks.append(Check(CHECK_NAME, verdict.passed, verdict.detail, deferred))
    failed = [c.name for c in checks if not c.passed]
    return ReleaseRecord(
        schema=SCHEMA,
        kvproxy_version=__version__,
        started_at=iso_time(started),
        finished_at=iso_time(time.time()),
        host=socket.gethostname(),
        declared_context_tokens=opts.max_context,
        engines=[engine_row(s, m) for s, m in measured],
        limits=engines.limits,
        safe_max_context_tokens=safe_ctx,
        checks=checks,
        deferred_cancellations=deferred,
        accept_drain_timeouts=opts.accept_drain_timeouts,
        isolation=isolation,
        passed=not failed and bool(ok_m),
        failed_checks=failed or ([] if ok_m else ["no engine measured"]),
        posture=posture,
    )
