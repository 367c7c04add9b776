"""`kvproxy canary`: the two-tenant isolation harness (runner and report).

Works against any OpenAI-compatible URL (kvproxy, a router, an engine); with `--sim` (the
simulator's router) it also reads ground truth (`/sim/stats`) and injects faults
(`/sim/faults`). The scenarios themselves are in `scenarios`, the probe client in
kvproxy.tools.client, the diagnosis of an unarmed tripwire in `diagnosis` and the command line
in `cli` (modules of this package).

Before any scenario: the model comes from the target's `/v1/models` unless `--model` is
given (routers such as smg route by model), and one preflight request must be served; a
target that refuses it fails the run at once with the status and code it answered.

The limit the boundary scenario probes: `--limit`, else the published limit in
`--proxy-admin`'s `/capacity` (the number kvproxy admits with one output token), else the
simulator's prefill report.

Verdicts, worst first: fail (a leak, or a scenario that could not observe anything),
over_strict (a legal prompt refused at the boundary), incomplete (some scenario of
`SCENARIOS` did not run: skipped for want of a limit or the simulator, or left out by
`--scenarios`), pass. A run never reads as a pass for a scenario it did not run; an operator
who means a partial run says so (`allow_partial`), which changes the exit code, not the
verdict.

A pass proves little: no marker seen is not proof of isolation. A fail proves a leak. The
report says so. Never prints or stores reply text: only marker ids, statuses and counts.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from kvproxy import __version__
from kvproxy.tools.client import (
    ModelUnknown,
    TargetRefused,
    discover_model,
    get_json,
    listed_models,
    sim_prefill_url,
)
from kvproxy.tools.isolation.diagnosis import tripwire_diagnosis
from kvproxy.tools.isolation.scenarios import (
    NEEDS_SIM_FAULTS,
    SCENARIOS,
    CanaryOptions,
    Finding,
    Harness,
    ScenarioResult,
    Tenant,
)

__all__ = ["SCENARIOS", "CanaryOptions", "CanaryReport", "Finding", "Tenant", "run_isolation"]

CAVEATS = (
    "A pass means no foreign marker was seen in these requests; it is not proof of "
    "isolation. Leaks can be intermittent, can carry no marker, or can occur in traffic "
    "shapes not exercised here.",
    "HTTP 200 and fluent text prove nothing: in the incident every leaking reply was both.",
    "A deferred cancellation that ended by timeout does not prove that KV writes stopped.",
)


@dataclass
class CanaryReport:
    schema: str
    kvproxy_version: str
    target: str
    sim: str | None
    started_at: float
    finished_at: float
    tenants: list[str]
    model: str | None
    model_source: str | None
    limit_tokens: int | None
    limit_source: str | None
    scenarios: list[ScenarioResult]
    verdict: str  # pass | fail | over_strict | incomplete
    tripwire: dict[str, Any] | None = None  # why kvproxy withheld nothing, when it can tell
    # How many of SCENARIOS ran (not skipped, not left out), and which did not, and why.
    scenarios_run: int = 0
    scenarios_total: int = len(SCENARIOS)
    not_run: dict[str, str] = field(default_factory=dict)
    # The operator asked for a partial run: an incomplete verdict exits 0.
    partial_accepted: bool = False
    caveats: tuple[str, ...] = CAVEATS

    def exit_ok(self) -> bool:
        """The command's exit status is 0: a pass, or an incomplete run the operator
        accepted as partial."""
        return self.verdict == "pass" or (self.verdict == "incomplete" and self.partial_accepted)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def run_isolation(opts: CanaryOptions) -> CanaryReport:
    async with aiohttp.ClientSession() as http:
        return await _run(opts, http)


async def models_to_check(opts: CanaryOptions) -> list[str]:
    """Without --model, every model the target's /v1/models lists when it lists several (a
    router such as smg, or kvproxy with a `models` config, serves each on its own engines,
    so each gets its own run); otherwise [] (one run, the model resolved as before)."""
    if opts.model:
        return []
    auth = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    async with aiohttp.ClientSession() as http:
        ids = await listed_models(http, opts.target, auth)
    return list(dict.fromkeys(ids)) if ids is not None and len(ids) > 1 else []


MODELS_SCHEMA = "kvproxy.canary.models/1"


# Worst first: a run's verdict is the first of these that any part of it reached.
VERDICT_ORDER = ("fail", "over_strict", "incomplete", "pass")


def worst(verdicts: Iterable[str]) -> str:
    """fail over over_strict over incomplete over pass. A scenario's own "skipped" reads as
    incomplete: a verdict never passes what it did not run."""
    seen = {"incomplete" if v == "skipped" else v for v in verdicts}
    return next((v for v in VERDICT_ORDER if v in seen), "pass")


def cannot_run_here(result: ScenarioResult, sim: str | None) -> bool:
    """Skipped only because it needs the simulator's fault API and the target is a real
    stack (no --sim): not run, with the reason, but no gap in the run."""
    return result.verdict == "skipped" and result.name in NEEDS_SIM_FAULTS and not sim


def run_verdict(
    results: list[ScenarioResult], requested: tuple[str, ...], sim: str | None = None
) -> tuple[str, dict[str, str]]:
    """The run's verdict, and every scenario of SCENARIOS that did not run with the reason.
    A scenario that cannot run on a real stack (`cannot_run_here`) is listed as not run but
    does not make the verdict incomplete; any other scenario not run does."""
    not_run = {
        r.name: (r.notes[-1] if r.notes else "skipped") for r in results if r.verdict == "skipped"
    }
    for name in SCENARIOS:
        if name not in requested:
            not_run[name] = "not requested (--scenarios)"
    counted = [r for r in results if not cannot_run_here(r, sim)]
    gaps = set(not_run) - {r.name for r in results if cannot_run_here(r, sim)}
    verdict = worst(r.verdict for r in counted)
    if verdict == "pass" and gaps:
        verdict = "incomplete"
    return verdict, not_run


def combined_json(reports: list[CanaryReport]) -> dict[str, Any]:
    """One report per model (each a complete `kvproxy.canary/1` report) and the worst
    verdict: the isolation holds only if it holds for every model."""
    return {
        "schema": MODELS_SCHEMA,
        "verdict": worst(r.verdict for r in reports),
        "models": {r.model or "?": r.to_json() for r in reports},
    }


async def _resolve_model(http: aiohttp.ClientSession, opts: CanaryOptions) -> tuple[str, str]:
    if opts.model:
        return opts.model, "--model"
    auth = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    return await discover_model(http, [opts.target], auth)


async def _discover_limit(h: Harness, capacity: dict[str, Any] | None) -> str | None:
    """The limit to probe: --limit, else the published limit in kvproxy's /capacity (what
    the target behind it admits), else the simulator's prefill report."""
    if h.limit is not None:
        return "--limit"
    limits = capacity.get("limits") if capacity else None
    if isinstance(limits, dict) and limits.get("known") is True:
        value = limits.get("admission_limit_tokens")
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            h.limit = value
            return f"{h.opts.proxy_admin}/capacity admission_limit_tokens"
    info = await get_json(h.http, h.opts.sim + "/server_info") if h.opts.sim else None
    mril = info.get("max_req_input_len") if isinstance(info, dict) else None
    if isinstance(mril, int) and mril > 1:
        # SGLang refuses len >= max_req_input_len: the largest accepted prompt is one less.
        h.limit = mril - 1
        return "sim /server_info max_req_input_len - 1"
    return None


async def proxy_capacity(
    http: aiohttp.ClientSession, proxy_admin: str | None, model: str
) -> dict[str, Any] | None:
    """kvproxy's /capacity for `model`: the whole answer, or with several models the section
    whose name or alias is `model`; None without --proxy-admin or an answer."""
    capacity = await get_json(http, proxy_admin + "/capacity") if proxy_admin else None
    models = capacity.get("models") if isinstance(capacity, dict) else None
    if isinstance(models, dict):
        capacity = next(
            (
                v
                for name, v in models.items()
                if isinstance(v, dict) and (name == model or model in (v.get("aliases") or ()))
            ),
            None,
        )
    return capacity if isinstance(capacity, dict) else None


def capacity_engines(capacity: dict[str, Any] | None) -> list[str]:
    """The URLs of the engines behind kvproxy that see prompts (prefill, unified): their
    /tokenize measures the boundary probes."""
    rows = capacity.get("engines") if capacity else None
    return [
        e["url"].rstrip("/")
        for e in rows or ()
        if isinstance(e, dict)
        and e.get("role") in ("prefill", "unified")
        and e.get("kind") in ("sglang", "vllm")
        and isinstance(e.get("url"), str)
    ]


async def _run(opts: CanaryOptions, http: aiohttp.ClientSession) -> CanaryReport:
    started = time.time()
    results: list[ScenarioResult] = []
    model: str | None = None
    model_source: str | None = None
    limit_source: str | None = None
    refused: str | None = None
    h: Harness | None = None
    try:
        model, model_source = await _resolve_model(http, opts)
        opts.progress(f"[canary] model {model} (from {model_source})")
        h = Harness(opts, http, model)
        capacity = await proxy_capacity(http, opts.proxy_admin, model)
        limit_source = await _discover_limit(h, capacity)
        sim_prefill = await sim_prefill_url(http, opts.sim)
        h.tokenizer_bases = [
            u for u in (opts.engine, sim_prefill, *capacity_engines(capacity), opts.target) if u
        ]
        rid = h.request_id("preflight")
        h.check(
            ScenarioResult("preflight"),
            h.tenants[0],
            rid,
            await h.chat(h.tenants[0], "kvproxy canary preflight", rid, stream=False, max_tokens=1),
        )
    except (ModelUnknown, TargetRefused) as exc:
        opts.progress(f"[canary] {exc}")
        for name in opts.scenarios:
            r = ScenarioResult(name)
            r.fail(f"not run: {exc}")
            results.append(r)
        refused = str(exc)
    if h is not None and not results:
        results = [await _scenario(h, name) for name in opts.scenarios]
    verdict, not_run = run_verdict(results, opts.scenarios, opts.sim)
    if refused is not None:
        # Nothing ran: each scenario failed, and each is counted among those not run.
        not_run.update({r.name: f"target refused before any scenario: {refused}" for r in results})
    return CanaryReport(
        schema="kvproxy.canary/1",
        kvproxy_version=__version__,
        target=opts.target,
        sim=opts.sim,
        started_at=started,
        finished_at=time.time(),
        tenants=list(opts.tenants),
        model=model,
        model_source=model_source,
        limit_tokens=h.limit if h else opts.limit,
        limit_source=limit_source,
        scenarios=results,
        verdict=verdict,
        tripwire=await tripwire_diagnosis(http, opts, results),
        scenarios_run=sum(1 for r in results if r.verdict != "skipped" and r.name not in not_run),
        not_run=not_run,
        partial_accepted=opts.allow_partial,
    )


async def _scenario(h: Harness, name: str) -> ScenarioResult:
    runners: dict[str, Callable[[ScenarioResult], Awaitable[None]]] = {
        "normal_long": h.normal_long,
        "boundary": h.boundary,
        "cancel": h.cancel,
        "transfer_failure": h.transfer_failure,
    }
    r = ScenarioResult(name)
    h.opts.progress(f"[canary] {name} ...")
    try:
        await runners[name](r)
    except TargetRefused as exc:
        r.fail(str(exc))
    if r.foreign_markers and r.verdict != "fail":
        r.fail("foreign markers found")
    answered = sum(v for k, v in r.statuses.items() if k in ("200", "400"))
    if r.verdict == "pass" and r.requests and not answered:
        # Nothing came back: the scenario observed nothing and proves nothing.
        r.fail(f"no request was answered ({r.statuses}); is the target reachable?")
    h.opts.progress(
        f"[canary] {name}: {r.verdict.upper()} ({r.requests} requests, "
        f"{len(r.foreign_markers)} foreign markers, {r.blocked_by_tripwire} blocked)"
    )
    return r


def verdict_line(report: CanaryReport) -> str:
    """The verdict as printed: an incomplete run says how much of it ran."""
    head = report.verdict.upper()
    if report.not_run:
        head += f" ({report.scenarios_run} of {report.scenarios_total} scenarios run"
        head += "; partial run accepted)" if report.partial_accepted else ")"
    return head


def summary(report: CanaryReport) -> str:
    lines = [f"kvproxy canary against {report.target}: {verdict_line(report)}"]
    if report.model:
        lines.append(f"  model: {report.model} ({report.model_source})")
    if report.limit_tokens is not None:
        lines.append(f"  limit probed: {report.limit_tokens:,} tokens ({report.limit_source})")
    for r in report.scenarios:
        kind = f" probes={r.probe_kind}" if r.probe_kind else ""
        lines.append(
            f"  {r.name:<17} {r.verdict.upper():<11} requests={r.requests} "
            f"rejections={r.rejections_seen} foreign_markers={len(r.foreign_markers)} "
            f"blocked={r.blocked_by_tripwire}{kind}"
        )
        lines.extend(f"      ! {p}" for p in r.problems[:10])
        lines.extend(f"      - {n}" for n in r.notes[:10])
    for name, why in report.not_run.items():
        lines.append(f"  not run: {name}: {why}")
    if report.tripwire:
        lines.append(
            "  the target's tripwire is not armed for the harness's tenants "
            f"({report.tripwire['source']}):"
        )
        lines.extend(f"      ! {why}" for why in report.tripwire["reasons"])
        lines.append("    kvproxy configuration that arms it:")
        lines.extend(f"      {line}" for line in report.tripwire["config"].splitlines())
    lines.append("  note: " + CAVEATS[0])
    return "\n".join(lines)
