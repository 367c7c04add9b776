"""`kvproxy check` on the command line: its flags, the options they make (the same
`load_settings` the proxy uses, so the gate reads the proxy's config file, margin and
fallback), and the printed verdict. The gate itself is kvproxy.gate.

Exit codes: 0 every check passed, 1 a check failed (cli.py maps ConfigError to 2).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from kvproxy.config import ConfigError, Settings, load_settings
from kvproxy.gate import GateOptions, run_gate
from kvproxy.gate_record import engine_table, write_record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="kvproxy YAML config to read engines and max_context from")
    p.add_argument("--engines", help="JSON list as in KVPROXY_ENGINES (default: the config)")
    p.add_argument("--max-context", type=int, help="declared context (KVPROXY_MAX_CONTEXT)")
    p.add_argument("--proxy", help="kvproxy public URL: run boundary probes through it")
    p.add_argument("--proxy-admin", help="kvproxy admin URL: read its limit and deferral counts")
    p.add_argument("--sim", help="simulator router URL: ground truth for the probes")
    p.add_argument("--canary", action="store_true", help="run the isolation scenarios too")
    p.add_argument(
        "--canary-allow-partial",
        action="store_true",
        help="with --canary: pass even if some isolation scenario could not run (e.g. "
        "transfer_failure without --sim); recorded in the isolation report",
    )
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
    p.add_argument(
        "--model",
        help="model id to request (default: the proxy's /v1/models); with a models config, "
        "the configured model to check (default: every one, a section each)",
    )
    p.add_argument(
        "--probe-kind",
        choices=("auto", "text", "token_ids"),
        default="auto",
        help="boundary prompts: text measured by an engine's /tokenize (auto, when one "
        "answers) or token-id arrays",
    )
    p.add_argument("--out", help="directory for release-record.json and release-record.md")


def gate_settings(args: argparse.Namespace) -> Settings:
    """The config file plus --engines / --max-context (ConfigError: one line)."""
    overrides: dict[str, Any] = {}
    if args.engines:
        try:
            overrides["engines"] = orjson.loads(args.engines)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"invalid setting engines (--engines): not JSON: {exc}") from None
    if args.max_context is not None:
        overrides["max_context"] = args.max_context
    return load_settings(config_path=args.config, overrides=overrides)


def options_from(args: argparse.Namespace, settings: Settings | None = None) -> GateOptions:
    settings = settings or gate_settings(args)
    if not settings.engines:
        raise ConfigError("invalid setting engines (--engines / KVPROXY_ENGINES): none given")

    def strip(u: str | None) -> str | None:
        return u.rstrip("/") if u else None

    return GateOptions(
        engines=settings.engines,
        max_context=settings.max_context,
        limit_margin_tokens=settings.limit_margin_tokens,
        capacity_fallback_limit_tokens=settings.capacity_fallback_limit_tokens,
        proxy=strip(args.proxy),
        proxy_admin=strip(args.proxy_admin),
        sim=strip(args.sim),
        canary=args.canary,
        unknown_probe=strip(args.unknown_probe),
        out=Path(args.out) if args.out else None,
        model=args.model,
        accept_drain_timeouts=args.accept_drain_timeouts,
        canary_allow_partial=args.canary_allow_partial,
        probe_kind=args.probe_kind,
        advisories_file=settings.advisories_file,
        accept_advisories=settings.accept_advisories,
    )


def run_check(args: argparse.Namespace) -> int:
    settings = gate_settings(args)
    if settings.models:
        from kvproxy.gate_models import run_models_check  # one section per model

        return run_models_check(args, settings)
    opts = options_from(args, settings)

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
