"""`kvproxy check` on the command line: its flags, the options they make (the same
`load_settings` the proxy uses, so the gate reads the proxy's config file, margin and
fallback), and the printed verdict. The gate itself is kvproxy.tools.check.gate.

One gate per model of the config's model table, one after another (their probes would
compete for the same router otherwise): the single-model form is one gate and one record;
with a `models` config each model is gated on its own engines and declared context, its
boundary probes request it by its configured name, the proxy limit compared with the
measurement is the one under its `model` label, and the record has a section per model
(`--model NAME`, a name or an alias, gates that one alone). The deferral counts on the
proxy's admin /metrics belong to the replica, not to a model: each section shows the same.

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

from kvproxy.config import ConfigError, ModelSpec, Settings, load_settings
from kvproxy.tools.check.gate import GateOptions, run_gate
from kvproxy.tools.check.record import (
    ReleaseRecord,
    combined_json,
    engine_table,
    write_models_record,
    write_record,
)


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


def options_from(
    args: argparse.Namespace, settings: Settings | None = None, spec: ModelSpec | None = None
) -> GateOptions:
    """The gate's options for one model (`spec`; default the single-model form's)."""
    settings = settings or gate_settings(args)
    named = spec is not None and bool(settings.models)
    if spec is None:
        if settings.models:
            raise ConfigError("invalid setting engines (--engines / KVPROXY_ENGINES): none given")
        spec = settings.model_table()[0]
    settings = settings.for_model(spec)
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
        # A configured model is requested by its name and read under its `model` label.
        model=spec.name if named else args.model,
        limit_model=spec.name if named else None,
        accept_drain_timeouts=args.accept_drain_timeouts,
        canary_allow_partial=args.canary_allow_partial,
        probe_kind=args.probe_kind,
        advisories_file=settings.advisories_file,
        accept_advisories=settings.accept_advisories,
    )


def selected_models(settings: Settings, wanted: str | None) -> tuple[ModelSpec, ...]:
    """The models to gate: every one, or with a `models` config the one `--model` names
    (in the single-model form `--model` is only the model id its probes request)."""
    table = settings.model_table()
    if not settings.models or wanted is None:
        return table
    for spec in table:
        if wanted in spec.names:
            return (spec,)
    names = ", ".join(m.name for m in table)
    raise ConfigError(f"invalid setting model (--model): {wanted!r} is not configured ({names})")


async def gate_models(
    args: argparse.Namespace, settings: Settings, progress: Any = print
) -> list[tuple[str, ReleaseRecord]]:
    """One gate per selected model, one after another."""
    records = []
    for spec in selected_models(settings, args.model):
        if settings.models:
            progress(f"[check] model {spec.name}")
        records.append((spec.name, await run_gate(options_from(args, settings, spec), progress)))
    return records


def run_check(args: argparse.Namespace) -> int:
    settings = gate_settings(args)
    # Refused before any probe: a bad --engines or config names itself first.
    options_from(args, settings, selected_models(settings, args.model)[0])

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    records = asyncio.run(gate_models(args, settings, progress))
    for name, record in records:
        if settings.models:
            print(f"== model {name}")
        print("\n".join(engine_table(record)))
        print()
        for c in record.checks:
            print(f"{'PASS' if c.passed else 'FAIL'}  {c.name}: {c.detail}")
        if record.safe_max_context_tokens is not None and not settings.models:
            print(f"\nlargest safe context: {record.safe_max_context_tokens:,} tokens")
        if settings.models:
            print()
    out = Path(args.out) if args.out else Path(os.environ.get("KVPROXY_RECORD_DIR", "."))
    if settings.models:
        j, m = write_models_record(records, out)
        summary = combined_json(records)
        passed, failed = summary["passed"], summary["failed_checks"]
    else:
        [(_, record)] = records
        j, m = write_record(record, out)
        passed, failed = record.passed, record.failed_checks
    print(f"release record: {j} and {m}")
    if passed:
        print("RESULT: PASS")
        return 0
    print("RESULT: FAIL (" + "; ".join(failed) + ")")
    return 1
