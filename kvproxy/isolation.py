"""`kvproxy canary`: the two-tenant isolation harness (runner, report and CLI).

Works against any OpenAI-compatible URL (kvproxy, a router, an engine); with `--sim` (the
simulator's router) it also reads ground truth (`/sim/stats`) and injects faults
(`/sim/faults`). The scenarios themselves are in kvproxy.scenarios, the probe client in
kvproxy.probes.

Before any scenario: the model comes from the target's `/v1/models` unless `--model` is
given (routers such as smg route by model), and one preflight request must be served; a
target that refuses it fails the run at once with the status and code it answered.

A pass proves little: no marker seen is not proof of isolation. A fail proves a leak. The
report says so. Never prints or stores reply text: only marker ids, statuses and counts.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from kvproxy import __version__
from kvproxy.probes import (
    ModelUnknown,
    TargetRefused,
    discover_model,
    get_json,
    sim_prefill_url,
)
from kvproxy.scenarios import (
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
    verdict: str  # pass | fail | over_strict
    tripwire: dict[str, Any] | None = None  # why kvproxy withheld nothing, when it can tell
    caveats: tuple[str, ...] = CAVEATS

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def arming_config(opts: CanaryOptions) -> str:
    """The kvproxy YAML that makes its tripwire know the harness's tenants and markers."""
    lines = [
        f"tenant_header: {opts.tenant_header}",
        "trust_tenant_header: true  # only behind a gateway that sets this header itself",
        "canary_action: block",
        "canaries:",
    ]
    for t in opts.tenants:
        lines += [f"  - tenant: {t}", f'    patterns: ["KVCANARY-{t}-[0-9a-f]{{16}}"]']
    return "\n".join(lines)


async def tripwire_diagnosis(
    http: aiohttp.ClientSession, opts: CanaryOptions, results: list[ScenarioResult]
) -> dict[str, Any] | None:
    """Foreign markers were delivered and none withheld, through something that answers as
    kvproxy (admin URL given, or X-Kvproxy-Decision on its replies): its tripwire does not
    know the harness's tenants. Say so, and how to arm it."""
    delivered = sum(len(r.foreign_markers) for r in results)
    blocked = sum(r.blocked_by_tripwire for r in results)
    if not delivered or blocked:
        return None
    admin = await get_json(http, opts.proxy_admin + "/tripwire") if opts.proxy_admin else None
    is_kvproxy = isinstance(admin, dict) or any(r.kvproxy_answered for r in results)
    if not is_kvproxy:
        return None
    reasons: list[str] = []
    if isinstance(admin, dict):
        source = f"{opts.proxy_admin}/tripwire"
        if not admin.get("trust_tenant_header"):
            reasons.append("trust_tenant_header is false: the harness's tenant header is ignored")
        header = str(admin.get("tenant_header") or "")
        if header.lower() != opts.tenant_header.lower():
            reasons.append(
                f"it reads the tenant from {header!r}, the harness sends {opts.tenant_header!r}"
            )
        known = set(admin.get("canary_tenants") or [])
        missing = [t for t in opts.tenants if t not in known]
        if missing:
            reasons.append(f"no canaries configured for {', '.join(missing)}")
        if admin.get("canary_action") == "observe":
            reasons.append("canary_action is observe: hits are counted, not withheld")
    else:
        source = "X-Kvproxy-Decision response headers"
        reasons.append(
            "the target answers as kvproxy but withheld nothing: its tripwire "
            "probably does not know the harness's tenants (pass --proxy-admin "
            "to check)"
        )
    return {
        "target_is_kvproxy": True,
        "armed": False,
        "source": source,
        "reasons": reasons,
        "config": arming_config(opts),
    }


async def run_isolation(opts: CanaryOptions) -> CanaryReport:
    async with aiohttp.ClientSession() as http:
        return await _run(opts, http)


async def _resolve_model(http: aiohttp.ClientSession, opts: CanaryOptions) -> tuple[str, str]:
    if opts.model:
        return opts.model, "--model"
    auth = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    return await discover_model(http, [opts.target], auth)


async def _discover_limit(h: Harness) -> str | None:
    """The limit to probe: --limit, else the simulator's prefill report."""
    if h.limit is not None:
        return "--limit"
    info = await get_json(h.http, h.opts.sim + "/server_info") if h.opts.sim else None
    mril = info.get("max_req_input_len") if isinstance(info, dict) else None
    if isinstance(mril, int) and mril > 1:
        # SGLang refuses len >= max_req_input_len: the largest accepted prompt is one less.
        h.limit = mril - 1
        return "sim /server_info max_req_input_len - 1"
    return None


async def _run(opts: CanaryOptions, http: aiohttp.ClientSession) -> CanaryReport:
    started = time.time()
    results: list[ScenarioResult] = []
    model: str | None = None
    model_source: str | None = None
    limit_source: str | None = None
    h: Harness | None = None
    try:
        model, model_source = await _resolve_model(http, opts)
        opts.progress(f"[canary] model {model} (from {model_source})")
        h = Harness(opts, http, model)
        limit_source = await _discover_limit(h)
        h.tokenizer_bases = [
            u for u in (opts.engine, await sim_prefill_url(http, opts.sim), opts.target) if u
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
    if h is not None and not results:
        results = [await _scenario(h, name) for name in opts.scenarios]
    verdicts = {r.verdict for r in results}
    verdict = (
        "fail" if "fail" in verdicts else "over_strict" if "over_strict" in verdicts else "pass"
    )
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


def summary(report: CanaryReport) -> str:
    lines = [f"kvproxy canary against {report.target}: {report.verdict.upper()}"]
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


# --- CLI ----------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="OpenAI-compatible base URL to test")
    p.add_argument("--sim", help="the simulator's router URL: ground truth and fault injection")
    p.add_argument(
        "--engine",
        help="an engine URL (SGLang/vLLM) whose /tokenize measures the boundary probes "
        "(default: the simulator's prefill, then the target)",
    )
    p.add_argument("--proxy-admin", help="kvproxy's admin URL: tells whether its tripwire is armed")
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)}",
    )
    p.add_argument("--tenants", default="canary-a,canary-b", help="synthetic tenant ids")
    p.add_argument("--tenant-header", default="X-Tenant-ID")
    p.add_argument("--api-key", help="bearer token for the target, if it needs one")
    p.add_argument("--model", help="model id to request (default: the target's /v1/models)")
    p.add_argument("--limit", type=int, help="the admission limit to probe (inclusive tokens)")
    p.add_argument(
        "--probe-kind",
        choices=("auto", "text", "token_ids"),
        default="auto",
        help="boundary prompts: text measured by the engine's /tokenize (auto, when one "
        "answers) or token-id arrays",
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", help="write the JSON report here")


def options_from(args: argparse.Namespace, progress: Callable[[str], None]) -> CanaryOptions:
    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise SystemExit(f"kvproxy canary: unknown scenario(s) {unknown}; known: {SCENARIOS}")
    tenants = tuple(t.strip().lower() for t in args.tenants.split(",") if t.strip())
    if len(tenants) < 2 or any(not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", t) for t in tenants):
        raise SystemExit("kvproxy canary: --tenants needs two or more ids of [a-z0-9-]")

    def strip(u: str | None) -> str | None:
        return u.rstrip("/") if u else None

    return CanaryOptions(
        target=args.target.rstrip("/"),
        sim=strip(args.sim),
        engine=strip(args.engine),
        proxy_admin=strip(args.proxy_admin),
        scenarios=scenarios,
        tenants=tenants,
        tenant_header=args.tenant_header,
        api_key=args.api_key,
        model=args.model,
        limit=args.limit,
        rounds=max(1, min(args.rounds, 50)),
        seed=args.seed,
        probe_kind=args.probe_kind,
        progress=progress,
    )


def run_canary(args: argparse.Namespace) -> int:
    opts = options_from(args, lambda line: print(line, file=sys.stderr, flush=True))
    report = asyncio.run(run_isolation(opts))
    if args.report:
        Path(args.report).write_bytes(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2))
    print(summary(report))
    return 0 if report.verdict == "pass" else 1
