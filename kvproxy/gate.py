"""`kvproxy check`: the release gate and its release record.

Runs in CI/CD before a rollout that touches long-context settings:
  1. measures every engine with the same probes the proxy uses (kvproxy.capacity);
  2. compares the declared context with the measured limits (kvproxy.capacity.derive_limits,
     the one limit computation) and names the largest safe value;
  3. with --proxy: boundary probes (limit-1 and limit admitted, limit+1 rejected with 400
     context_length_exceeded and, with --sim, proven never to reach the engines);
  4. with --canary: the isolation scenarios (kvproxy.isolation), folded into the verdict;
  5. with --proxy-admin: the proxy's deferred-cancellation counts by outcome; a deferral
     that ended unconfirmed (timeout, shutdown) fails the gate unless the operator passes
     --accept-drain-timeouts, which the record keeps (kvproxy.gate_deferred).
It writes a release record (JSON, schema in kvproxy/schemas/, and Markdown) and exits 0
only when every check passed. Never records prompt or completion text.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from kvproxy import __version__
from kvproxy.capacity import (
    EngineMeasurement,
    ProbeError,
    derive_limits,
    expand_engine,
    probe_engine,
    system_resolver,
)
from kvproxy.config import ConfigError, EngineSpec, load_settings
from kvproxy.gate_deferred import CHECK_NAME, deferred_counts, deferred_verdict
from kvproxy.isolation import (
    CanaryOptions,
    fetch_sim_stats,
    run_isolation,
    sim_arrivals,
    summary,
    token_ids,
)
from kvproxy.posture.gate import CHECK_NAME as POSTURE_CHECK
from kvproxy.posture.gate import markdown_lines as posture_markdown
from kvproxy.posture.gate import posture_check

SCHEMA = "kvproxy.release-record/1"
SCHEMA_PATH = Path(__file__).parent / "schemas" / "release_record.schema.json"
PROBE_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Check:
    name: str
    passed: bool
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class GateOptions:
    engines: tuple[EngineSpec, ...]
    max_context: int | None
    proxy: str | None = None
    proxy_admin: str | None = None
    sim: str | None = None
    canary: bool = False
    unknown_probe: str | None = None
    out: Path | None = None
    model: str = "default"
    # The operator accepts deferrals that ended without a confirmed drain (kept in the record).
    accept_drain_timeouts: bool = False
    # Engine posture (kvproxy.posture): the operator's advisories and accepted ids.
    advisories_file: str | None = None
    accept_advisories: tuple[str, ...] = ()


@dataclass
class ReleaseRecord:
    schema: str
    kvproxy_version: str
    started_at: str
    finished_at: str
    host: str
    declared_context_tokens: int | None
    engines: list[dict[str, Any]]
    limits: dict[str, Any]
    safe_max_context_tokens: int | None
    checks: list[Check]
    deferred_cancellations: dict[str, Any] | None
    accept_drain_timeouts: bool
    isolation: dict[str, Any] | None
    passed: bool
    failed_checks: list[str]
    posture: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _iso(ts: float) -> str:
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
    engine holds. Compared in the same unit (tokens of context: min(context, pool)), so a
    healthy 8,192 / 8,192 deployment passes; the safe value printed is the largest prompt
    the engines accept."""
    holds = [
        (m.pool_tokens if m.context_length is None else min(m.pool_tokens, m.context_length), m)
        for m in measured
        if m.role in ("prefill", "unified") and m.source == "measured"
    ]
    if not holds:
        return Check("declared context fits every engine", False, "no engine measured")
    cap, m = min(holds, key=lambda h: h[0])
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


async def boundary_probes(
    http: aiohttp.ClientSession, opts: GateOptions, limit: int
) -> list[Check]:
    assert opts.proxy is not None
    checks: list[Check] = []
    ids_cache = await token_ids(
        http, [b for b in (opts.sim, opts.proxy) if b], "kvproxy release gate probe. ", limit + 1
    )
    for delta in (-1, 0, 1):
        n = limit + delta
        body = {"model": opts.model, "prompt": ids_cache[:n], "max_tokens": 1}
        before = await fetch_sim_stats(http, opts.sim)
        status, code, decision = await _post(
            http, opts.proxy + "/v1/completions", body, f"kvproxy-check-limit{delta:+d}"
        )
        after = await fetch_sim_stats(http, opts.sim)
        arrived = sim_arrivals(before, after)
        name = f"boundary limit{delta:+d} ({n:,} tokens)"
        data = {
            "tokens": n,
            "status": status,
            "code": code,
            "decision": decision,
            "reached_engines": arrived,
        }
        if delta <= 0:
            ok = status == 200
            detail = "admitted" if ok else f"expected 200, got {status} {code or ''}".strip()
        else:
            ok = status == 400 and code == "context_length_exceeded"
            detail = (
                "rejected with 400 context_length_exceeded"
                if ok
                else f"expected 400 context_length_exceeded, got {status} {code or ''}".strip()
            )
            if arrived:
                ok = False
                detail += f"; it reached the engines ({arrived})"
            elif arrived == "":
                detail += "; the simulator confirms nothing reached the engines"
        checks.append(Check(name, ok, detail, data))
    return checks


async def unknown_probe(http: aiohttp.ClientSession, url: str, model: str) -> Check:
    body = {"model": model, "prompt": "capacity unknown probe", "max_tokens": 1}
    status, code, _ = await _post(http, url + "/v1/completions", body, "kvproxy-check-unknown")
    ok = status == 503 and code == "capacity_unknown"
    detail = "fails closed (503 capacity_unknown)" if ok else f"got {status} {code}"
    return Check("capacity-unknown probe", ok, detail, {"status": status, "code": code})


async def _post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], rid: str
) -> tuple[int, str | None, str | None]:
    try:
        async with http.post(
            url,
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json", "X-Request-ID": rid},
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        ) as resp:
            raw = await resp.read()
            decision = resp.headers.get("X-Kvproxy-Decision")
            code = None
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError:
                data = None
            if isinstance(data, dict):
                err = data.get("error")
                if isinstance(err, dict) and isinstance(err.get("code"), str):
                    code = err["code"]
                elif isinstance(data.get("kvproxy_code"), str):
                    code = data["kvproxy_code"]
            return resp.status, code, decision
    except (TimeoutError, aiohttp.ClientError) as exc:
        return 0, type(exc).__name__, None


async def run_gate(opts: GateOptions, progress: Any = print) -> ReleaseRecord:
    started = time.time()
    checks: list[Check] = []
    async with aiohttp.ClientSession() as http:
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
        # The safe value ignores the declared context: what the engines alone can take.
        safe = derive_limits(ok_m, max_context=None)
        limits = derive_limits(ok_m, max_context=opts.max_context)
        safe_ctx = safe.measured_limit_tokens
        if opts.max_context is not None and safe_ctx is not None:
            checks.append(declared_context_check(opts.max_context, ok_m, safe_ctx, safe.why))
        deferred = None
        if opts.proxy_admin:
            deferred = await deferred_counts(http, opts.proxy_admin)
            if deferred is None:
                checks.append(Check("proxy metrics", False, "admin /metrics unreachable"))
        if opts.proxy:
            probe_limit = limits.admission_limit_tokens
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
                checks.extend(await boundary_probes(http, opts, probe_limit))
        if opts.unknown_probe:
            checks.append(await unknown_probe(http, opts.unknown_probe, opts.model))
    isolation = None
    if opts.canary:
        target = opts.proxy
        if target is None:
            checks.append(Check("isolation", False, "--canary needs --proxy (the target)"))
        else:
            report = await run_isolation(
                CanaryOptions(
                    target=target,
                    sim=opts.sim,
                    limit=limits.admission_limit_tokens,
                    model=opts.model,
                    progress=progress,
                )
            )
            isolation = report.to_json()
            for sc in report.scenarios:
                checks.append(
                    Check(
                        f"isolation {sc.name}",
                        sc.verdict != "fail",
                        f"{sc.verdict}: {sc.requests} requests, "
                        f"{len(sc.foreign_markers)} foreign markers, "
                        f"{sc.blocked_by_tripwire} withheld by the tripwire"
                        + ("; " + "; ".join(sc.problems[:3]) if sc.problems else ""),
                    )
                )
            progress(summary(report))
    if deferred is not None:
        verdict = deferred_verdict(deferred, opts.accept_drain_timeouts)
        checks.append(Check(CHECK_NAME, verdict.passed, verdict.detail, deferred))
    failed = [c.name for c in checks if not c.passed]
    return ReleaseRecord(
        schema=SCHEMA,
        kvproxy_version=__version__,
        started_at=_iso(started),
        finished_at=_iso(time.time()),
        host=socket.gethostname(),
        declared_context_tokens=opts.max_context,
        engines=[engine_row(s, m) for s, m in measured],
        limits=limits.to_json(),
        safe_max_context_tokens=safe_ctx,
        checks=checks,
        deferred_cancellations=deferred,
        accept_drain_timeouts=opts.accept_drain_timeouts,
        isolation=isolation,
        passed=not failed and bool(ok_m),
        failed_checks=failed or ([] if ok_m else ["no engine measured"]),
        posture=posture,
    )


def engine_table(record: ReleaseRecord) -> list[str]:
    head = ("engine", "role", "pool", "input limit", "source field", "page", "warnings")
    rows = [head]
    for e in record.engines:
        if "error" in e:
            rows.append(
                (
                    e["engine"],
                    e["role"],
                    "-",
                    "-",
                    f"ERROR {e['error']['reason']}",
                    "-",
                    e["error"]["message"][:60],
                )
            )
            continue
        rows.append(
            (
                e["engine"],
                e["role"],
                f"{e['pool_tokens']:,}",
                f"{e['input_limit_tokens']:,}",
                e["sources"]["input_limit_tokens"],
                str(e.get("page_size") or "-"),
                ",".join(e.get("warnings") or []) or "-",
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


def markdown(record: ReleaseRecord) -> str:
    verdict = "PASS" if record.passed else "FAIL"
    lines = [
        f"# kvproxy release record: {verdict}",
        "",
        f"- kvproxy {record.kvproxy_version}, host `{record.host}`",
        f"- started {record.started_at}, finished {record.finished_at}",
        f"- declared context: {record.declared_context_tokens or 'not set'}",
        f"- largest safe context (measured): {record.safe_max_context_tokens}",
        f"- admission limit: {record.limits.get('admission_limit_tokens')} "
        f"({record.limits.get('source')}: {record.limits.get('why')})",
        "- unconfirmed drains (timeout, shutdown): "
        + ("ACCEPTED by the operator" if record.accept_drain_timeouts else "fail the gate"),
        "",
        "## Engines (measured at run time)",
        "",
        "| engine | url | role | pool tokens | input limit | source field | page size | warnings |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in record.engines:
        if "error" in e:
            lines.append(
                f"| {e['engine']} | {e['url']} | {e['role']} | - | - | "
                f"probe failed: {e['error']['reason']} | - | - |"
            )
        else:
            lines.append(
                f"| {e['engine']} | {e['url']} | {e['role']} | {e['pool_tokens']:,} "
                f"({e['sources']['pool_tokens']}) | {e['input_limit_tokens']:,} | "
                f"{e['sources']['input_limit_tokens']} | {e.get('page_size') or '-'} | "
                f"{', '.join(e.get('warnings') or []) or '-'} |"
            )
    lines += ["", "## Checks", "", "| check | result | detail |", "|---|---|---|"]
    for c in record.checks:
        lines.append(f"| {c.name} | {'PASS' if c.passed else 'FAIL'} | {c.detail} |")
    lines += posture_markdown(record.posture)
    if record.isolation:
        lines += ["", "## Isolation evidence", ""]
        for sc in record.isolation["scenarios"]:
            lines.append(
                f"- `{sc['name']}`: {sc['verdict']}, {sc['requests']} requests, "
                f"{len(sc['foreign_markers'])} foreign markers, "
                f"{sc['blocked_by_tripwire']} withheld"
            )
        lines += ["", "> " + " ".join(record.isolation["caveats"])]
    if record.failed_checks:
        lines += ["", "## Failed", ""] + [f"- {n}" for n in record.failed_checks]
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="kvproxy YAML config to read engines and max_context from")
    p.add_argument("--engines", help="JSON list as in KVPROXY_ENGINES (default: the config)")
    p.add_argument("--max-context", type=int, help="declared context (KVPROXY_MAX_CONTEXT)")
    p.add_argument("--proxy", help="kvproxy public URL: run boundary probes through it")
    p.add_argument("--proxy-admin", help="kvproxy admin URL: read its limit and deferral counts")
    p.add_argument("--sim", help="simulator router URL: ground truth for the probes")
    p.add_argument("--canary", action="store_true", help="run the isolation scenarios too")
    p.add_argument(
        "--unknown-probe",
        help="a kvproxy URL whose engines are unreachable: must answer 503 capacity_unknown",
    )
    p.add_argument(
        "--accept-drain-timeouts",
        action="store_true",
        help="pass even if deferred cancellations ended by timeout or shutdown (drain not "
        "confirmed); recorded in the release record",
    )
    p.add_argument("--model", default="default")
    p.add_argument("--out", help="directory for release-record.json and release-record.md")


def options_from(args: argparse.Namespace) -> GateOptions:
    if args.config:
        os.environ["KVPROXY_CONFIG"] = args.config
    overrides: dict[str, Any] = {}
    if args.engines:
        try:
            overrides["engines"] = orjson.loads(args.engines)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"invalid setting engines (--engines): not JSON: {exc}") from None
    if args.max_context is not None:
        overrides["max_context"] = args.max_context
    settings = load_settings(**overrides)
    if not settings.engines:
        raise ConfigError("invalid setting engines (--engines / KVPROXY_ENGINES): none given")

    def strip(u: str | None) -> str | None:
        return u.rstrip("/") if u else None

    return GateOptions(
        engines=settings.engines,
        max_context=settings.max_context,
        proxy=strip(args.proxy),
        proxy_admin=strip(args.proxy_admin),
        sim=strip(args.sim),
        canary=args.canary,
        unknown_probe=strip(args.unknown_probe),
        out=Path(args.out) if args.out else None,
        model=args.model,
        accept_drain_timeouts=args.accept_drain_timeouts,
        advisories_file=settings.advisories_file,
        accept_advisories=settings.accept_advisories,
    )


def write_record(record: ReleaseRecord, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / "release-record.json", out / "release-record.md"
    j.write_bytes(orjson.dumps(record.to_json(), option=orjson.OPT_INDENT_2))
    m.write_text(markdown(record), encoding="utf-8")
    return j, m


def run_check(args: argparse.Namespace) -> int:
    opts = options_from(args)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    record = asyncio.run(run_gate(opts, progress))
    print("\n".join(engine_table(record)))
    print()
    for c in record.checks:
        print(f"{'PASS' if c.passed else 'FAIL'}  {c.name}: {c.detail}")
    if record.safe_max_context_tokens is not None:
        print(f"\nlargest safe context: {record.safe_max_context_tokens:,} tokens")
    out = opts.out or Path(os.environ.get("KVPROXY_RECORD_DIR", "."))
    j, m = write_record(record, out)
    print(f"release record: {j} and {m}")
    if record.passed:
        print("RESULT: PASS")
        return 0
    print("RESULT: FAIL (" + "; ".join(record.failed_checks) + ")")
    return 1
