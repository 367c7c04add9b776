"""`kvproxy canary` on the command line: its flags, the options they make, the printed
summary and the JSON report. The harness itself is kvproxy.tools.isolation.harness.

Exit codes: 0 the isolation verdict is pass (or incomplete, with --allow-partial), 1
otherwise. An incomplete run (a scenario skipped or not requested) exits 1 unless the
operator asked for a partial run: the verdict never reads as a pass for what did not run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import sys
from collections.abc import Callable
from pathlib import Path

import orjson

from kvproxy.tools.isolation.harness import (
    SCENARIOS,
    CanaryOptions,
    CanaryReport,
    combined_json,
    models_to_check,
    run_isolation,
    summary,
    worst,
)
from kvproxy.tools.isolation.scenarios import DEFAULT_TENANT_HEADER, DEFAULT_TENANTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="OpenAI-compatible base URL to test")
    p.add_argument("--sim", help="the simulator's router URL: ground truth and fault injection")
    p.add_argument(
        "--engine",
        help="an engine URL (SGLang/vLLM) whose /tokenize measures the boundary probes "
        "(default: the simulator's prefill, then the target)",
    )
    p.add_argument(
        "--proxy-admin",
        help="kvproxy's admin URL: the limit to probe (its /capacity) and whether its "
        "tripwire is armed",
    )
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)}",
    )
    p.add_argument("--tenants", default=",".join(DEFAULT_TENANTS), help="synthetic tenant ids")
    p.add_argument("--tenant-header", default=DEFAULT_TENANT_HEADER)
    p.add_argument("--api-key", help="bearer token for the target, if it needs one")
    p.add_argument(
        "--model",
        help="model id to request (default: the target's /v1/models; when it lists several, "
        "each one in turn, a section each in the report)",
    )
    p.add_argument("--limit", type=int, help="the admission limit to probe (inclusive tokens)")
    p.add_argument(
        "--probe-kind",
        choices=("auto", "text", "token_ids"),
        default="auto",
        help="boundary prompts: text measured by the engine's /tokenize (auto, when one "
        "answers) or token-id arrays",
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--prompt-chars",
        type=int,
        help="characters of each long prompt (default: 40%% of the limit); replies are asked "
        "for as many tokens, so on a slow engine a smaller value shortens the run",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--allow-partial",
        action="store_true",
        help="exit 0 when the scenarios that ran passed but some did not run (the verdict "
        "still says INCOMPLETE, and how many ran)",
    )
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
        prompt_chars=max(200, args.prompt_chars) if args.prompt_chars else None,
        seed=args.seed,
        probe_kind=args.probe_kind,
        allow_partial=args.allow_partial,
        progress=progress,
    )


def run_canary(args: argparse.Namespace) -> int:
    opts = options_from(args, lambda line: print(line, file=sys.stderr, flush=True))
    models = asyncio.run(models_to_check(opts))
    if not models:
        report = asyncio.run(run_isolation(opts))
        if args.report:
            Path(args.report).write_bytes(
                orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2)
            )
        print(summary(report))
        return 0 if report.exit_ok() else 1
    if opts.limit is not None or opts.sim or opts.engine:
        # One limit, one simulator, one tokenizer: each belongs to one model's engines.
        raise SystemExit(
            f"kvproxy canary: the target lists {len(models)} models ({', '.join(models)}); "
            "--limit, --sim and --engine belong to one of them: pass --model too"
        )
    reports: list[CanaryReport] = []
    for model in models:
        opts.progress(f"[canary] model {model} ({len(reports) + 1} of {len(models)})")
        report = asyncio.run(run_isolation(dataclasses.replace(opts, model=model)))
        report.model_source = f"{opts.target}/v1/models, {len(reports) + 1} of {len(models)}"
        reports.append(report)
    if args.report:
        body = orjson.dumps(combined_json(reports), option=orjson.OPT_INDENT_2)
        Path(args.report).write_bytes(body)
    verdict = worst(r.verdict for r in reports)
    print("\n\n".join(summary(r) for r in reports))
    print(f"\nkvproxy canary, {len(reports)} models: {verdict.upper()}")
    return 0 if all(r.exit_ok() for r in reports) else 1
