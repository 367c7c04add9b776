"""The release gate's probes through the proxy: the boundary (limit-1 and limit admitted,
limit+1 rejected before the engines), the capacity-unknown probe, the model to name, and the
checks the isolation report turns into. Requests and reply parsing are kvproxy.tools.client', the
same the isolation harness uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvproxy.config import EngineSpec
from kvproxy.tools.client import (
    ProbeChoice,
    ProbeClient,
    boundary_counts,
    boundary_prompts,
    discover_model,
    post,
    sim_prefill_url,
)
from kvproxy.tools.isolation.harness import CanaryReport, cannot_run_here
from kvproxy.tools.isolation.scenarios import ScenarioResult

# One boundary probe: a prompt at the limit (up to ~1M tokens) through the proxy and engine.
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Check:
    name: str
    passed: bool
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


async def boundary_probes(
    http: aiohttp.ClientSession,
    proxy: str,
    engines: tuple[EngineSpec, ...],
    sim: str | None,
    limit: int,
    model: str,
    probe_kind: ProbeChoice = "auto",
) -> list[Check]:
    """limit-1 and limit must be admitted (else the published limit is unreachable: the
    "limit reachable" check fails, over-strict) and limit+1 rejected with 400
    context_length_exceeded, proven (with --sim) never to reach the engines. Prompt lengths
    come from an engine's own /tokenize, not from kvproxy's counter."""
    client = ProbeClient(http, sim)
    counts = boundary_counts(limit)
    bases = [e.url.rstrip("/") for e in engines if e.role in ("prefill", "unified")]
    bases += [u for u in (await sim_prefill_url(http, sim), proxy) if u]
    seed = "kvproxy release gate probe. " + "the quick brown fox jumps over the lazy dog " * 8
    probes = await boundary_prompts(http, bases, seed, counts, probe_kind)
    checks: list[Check] = []
    legal: list[str] = []
    for n in counts:
        delta = n - limit
        body = {"model": model, "prompt": probes.prompts[n], "max_tokens": 1}
        headers = {"X-Request-ID": f"kvproxy-check-limit{delta:+d}"}
        seen = await client.observe(proxy + "/v1/completions", body, headers, REQUEST_TIMEOUT_S)
        reply, arrived = seen.reply, seen.arrived
        name = f"boundary limit{delta:+d} ({n:,} tokens)"
        data = {
            "tokens": n,
            "probe_kind": probes.kind,
            "status": reply.status,
            "code": reply.code or reply.error,
            "decision": reply.decision,
            "reached_engines": arrived,
        }
        refused = f"; target refused the probe: {reply.describe()}" if reply.refused() else ""
        if delta <= 0:
            ok = reply.status == 200
            detail = "admitted" if ok else f"expected 200, got {reply.describe()}{refused}"
            if reply.context_length_exceeded:
                legal.append(f"limit{delta:+d}")
        else:
            ok = reply.context_length_exceeded
            detail = (
                "rejected with 400 context_length_exceeded"
                if ok
                else f"expected 400 context_length_exceeded, got {reply.describe()}{refused}"
            )
            if arrived:
                ok = False
                detail += f"; it reached the engines ({arrived})"
            elif arrived == "":
                detail += "; the simulator confirms nothing reached the engines"
        checks.append(Check(name, ok, detail, data))
    admitted = all(c.passed for c in checks[:2])
    checks.insert(
        0,
        Check(
            "limit reachable",
            admitted,
            f"limit-1 and limit ({limit:,}) admitted ({probes.note})"
            if admitted
            else "over_strict: a legal prompt was refused "
            f"({', '.join(legal)} got 400 context_length_exceeded)"
            if legal
            else "a legal prompt was not served: "
            + "; ".join(c.detail for c in checks[:2] if not c.passed),
            {
                "verdict": "pass" if admitted else "over_strict" if legal else "fail",
                "probe_kind": probes.kind,
                "probe_note": probes.note,
            },
        ),
    )
    return checks


async def unknown_probe(http: aiohttp.ClientSession, url: str, model: str) -> Check:
    body = {"model": model, "prompt": "capacity unknown probe", "max_tokens": 1}
    reply = await post(
        http, url + "/v1/completions", body, {"X-Request-ID": "kvproxy-check-unknown"}
    )
    ok = reply.status == 503 and reply.code == "capacity_unknown"
    detail = "fails closed (503 capacity_unknown)" if ok else f"got {reply.describe()}"
    return Check("capacity-unknown probe", ok, detail, {"status": reply.status, "code": reply.code})


async def resolve_model(
    http: aiohttp.ClientSession, model: str | None, bases: list[str]
) -> tuple[str, str]:
    """--model, else the one model the proxy (else an engine) lists in /v1/models."""
    if model:
        return model, "--model"
    return await discover_model(http, bases, {})


def ran_how(sc: ScenarioResult, sim: str | None) -> str:
    """How a scenario that ran was judged, for the record."""
    truth = "the simulator's ground truth" if sim else "the replies' markers only"
    return f"ran: {sc.requests} requests through the target, judged on {truth}"


def isolation_checks(report: CanaryReport) -> list[Check]:
    """One check per scenario (no foreign marker delivered; a scenario that did not run
    fails unless the run was accepted as partial), plus "limit reachable" when the boundary
    refused a legal prompt (over_strict), plus "tripwire armed" when the target is kvproxy
    but its tripwire does not know the harness's tenants."""
    checks: list[Check] = []
    for sc in report.scenarios:
        if cannot_run_here(sc, report.sim):
            # Not a gap the operator can close on a real stack: recorded, not failed.
            why = report.not_run.get(sc.name, "skipped")
            checks.append(
                Check(
                    f"isolation {sc.name}",
                    True,
                    f"not run ({why}); not counted against the gate",
                    {"verdict": sc.verdict, "how": f"not run: {why}"},
                )
            )
            continue
        if sc.verdict == "skipped":
            # Not run is not passed: only an operator who asked for a partial run lets it by.
            why = report.not_run.get(sc.name, "skipped")
            checks.append(
                Check(
                    f"isolation {sc.name}",
                    report.partial_accepted,
                    f"not run ({why})"
                    + (
                        "; partial run accepted (--canary-allow-partial)"
                        if report.partial_accepted
                        else "; give the gate what it needs, or --canary-allow-partial"
                    ),
                    {"verdict": sc.verdict, "how": f"not run: {why}"},
                )
            )
            continue
        checks.append(
            Check(
                f"isolation {sc.name}",
                sc.verdict != "fail",
                f"{sc.verdict}: {sc.requests} requests, "
                f"{len(sc.foreign_markers)} foreign markers, "
                f"{sc.blocked_by_tripwire} withheld by the tripwire"
                + (f", probes={sc.probe_kind}" if sc.probe_kind else "")
                + ("; " + "; ".join(sc.problems[:3]) if sc.problems else ""),
                {"verdict": sc.verdict, "how": ran_how(sc, report.sim)},
            )
        )
        if sc.verdict == "over_strict":
            checks.append(
                Check(
                    "limit reachable (isolation boundary)",
                    False,
                    "over_strict: " + "; ".join(sc.problems[:3]),
                    {"verdict": "over_strict", "probe_kind": sc.probe_kind},
                )
            )
    if report.tripwire:
        checks.append(
            Check(
                "tripwire armed",
                False,
                "the target's tripwire does not know the harness's tenants: "
                + "; ".join(report.tripwire["reasons"])
                + " (the configuration that arms it is in data.config)",
                report.tripwire,
            )
        )
    return checks
