"""What the release gate measures: the engines of one upstream cluster (the model's one
cluster in the single-upstream form, each of its `upstreams` in gateway mode), probed with
the proxy's own probes, checked, and turned into the limits the proxy would enforce
(kvproxy.capacity.limits_for, the call its capacity monitor makes). `GateOptions` are the
gate's options; `ClusterTarget` one cluster to gate, `ClusterResult` what was found.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

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
from kvproxy.tools.check.boundary import Check
from kvproxy.tools.check.posture import CHECK_NAME as POSTURE_CHECK
from kvproxy.tools.check.posture import posture_check
from kvproxy.tools.client import ProbeChoice

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
    # Checks of the cluster beyond its engines' (gateway mode: the proxy's limit for it).
    extra: list[Check] = field(default_factory=list)

    @property
    def limit(self) -> int | None:
        """The limit the probes aim at: the proxy's published one when read, else measured."""
        return self.proxy_limit or self.engines.admission_limit_tokens

    def section(self) -> dict[str, Any]:
        checks = [*self.engines.checks, *self.extra]
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


def top_result(results: Sequence[ClusterResult]) -> ClusterResult:
    """The cluster whose limit is the model's: the largest any measured cluster offers
    (kvproxy_admission_limit_tokens{model}), the first configured when none is measured."""
    return max(results, key=lambda r: -1 if (t := r.engines.admission_limit_tokens) is None else t)


class Layout(Protocol):
    """How a gate reads and records its clusters: the single-upstream form's one cluster
    flat (kvproxy.tools.check.gate.FLAT), or a section per named cluster of a gateway
    model (kvproxy.tools.check.clusters.BY_CLUSTER). The steps are the gate's (`run_gate`);
    a layout only says where their checks go and what they probe."""

    def measuring(self, target: ClusterTarget) -> str | None:
        """The progress line before a cluster's engines are measured, if any."""

    def front_checks(self, results: Sequence[ClusterResult]) -> list[Check]:
        """The clusters' checks that open the record's list."""

    def read_proxy_limits(self, results: Sequence[ClusterResult], deferred: Any) -> None:
        """The proxy's published limits (its admin /metrics, `deferred`) into `results`."""

    async def probes(
        self,
        http: aiohttp.ClientSession,
        opts: GateOptions,
        results: Sequence[ClusterResult],
        model: str,
        deferred: dict[str, Any] | None,
        progress: Any,
    ) -> list[Check]:
        """The boundary probes through the proxy (`opts.proxy`)."""

    def back_checks(self, results: Sequence[ClusterResult]) -> list[Check]:
        """The clusters' checks that follow the probes."""

    def record(self, results: Sequence[ClusterResult], failed: list[str]) -> dict[str, Any]:
        """The record's fields that show the clusters: engines, limits, posture, clusters,
        passed and failed_checks (`failed`: the failed checks' names)."""
