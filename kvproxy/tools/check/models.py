"""`kvproxy check` with a `models` config: the release gate once per configured model, one
section per model in one release record.

Each model is gated on its own engines and declared context (kvproxy.config.models), its
boundary probes request that model by its configured name, and the proxy limit the gate
compares with the measurement is the one the proxy's metrics carry under that model's
`model` label. `--model NAME` (a name or an alias) gates that model alone; by default every
configured model is gated, and the record passes only if every section passes.

The deferral counts on the proxy's admin /metrics belong to the replica, not to a model:
each section shows the same numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from kvproxy.config.models import ModelSpec
from kvproxy.config.settings import ConfigError, Settings
from kvproxy.tools.check.cli import options_from
from kvproxy.tools.check.gate import ReleaseRecord, run_gate
from kvproxy.tools.check.record import engine_table, markdown

MODELS_SCHEMA = "kvproxy.release-record.models/1"


def selected_models(settings: Settings, wanted: str | None) -> list[ModelSpec]:
    if wanted is None:
        return list(settings.models)
    for spec in settings.models:
        if wanted in spec.names:
            return [spec]
    names = ", ".join(m.name for m in settings.models)
    raise ConfigError(f"invalid setting model (--model): {wanted!r} is not configured ({names})")


def model_options(args: argparse.Namespace, settings: Settings, spec: ModelSpec) -> Any:
    """The single-model gate options for one entry: its engines, its declared context, its
    name as the model to request and as the proxy metric's label."""
    one = settings.model_copy(
        update={"models": (), "engines": spec.engines, "max_context": spec.max_context}
    )
    opts = options_from(argparse.Namespace(**{**vars(args), "model": None}), one)
    return dataclasses.replace(opts, model=spec.name, limit_model=spec.name)


def combined_json(records: list[tuple[str, ReleaseRecord]]) -> dict[str, Any]:
    failed = [f"{name}: {c}" for name, r in records for c in r.failed_checks]
    return {
        "schema": MODELS_SCHEMA,
        "passed": all(r.passed for _, r in records),
        "failed_checks": failed,
        # Each section is a complete single-model record (release_record.schema.json).
        "models": {name: r.to_json() for name, r in records},
    }


def combined_markdown(records: list[tuple[str, ReleaseRecord]]) -> str:
    verdict = "PASS" if all(r.passed for _, r in records) else "FAIL"
    lines = [f"# kvproxy release record, {len(records)} models: {verdict}", ""]
    for name, r in records:
        lines.append(f"- `{name}`: {'PASS' if r.passed else 'FAIL'}")
    for name, r in records:
        # Each model's own record, its headings one level down under the model's name.
        body = markdown(r).replace("\n## ", "\n### ")
        body = body.replace("# kvproxy release record:", f"## Model `{name}`:", 1)
        lines += ["", body.rstrip("\n")]
    return "\n".join(lines) + "\n"


def write_models_record(records: list[tuple[str, ReleaseRecord]], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / "release-record.json", out / "release-record.md"
    j.write_bytes(orjson.dumps(combined_json(records), option=orjson.OPT_INDENT_2))
    m.write_text(combined_markdown(records), encoding="utf-8")
    return j, m


async def gate_models(
    args: argparse.Namespace, settings: Settings, progress: Any = print
) -> list[tuple[str, ReleaseRecord]]:
    """One gate per selected model, one after another (their probes would compete for the
    same router otherwise)."""
    records = []
    for spec in selected_models(settings, args.model):
        progress(f"[check] model {spec.name}")
        records.append((spec.name, await run_gate(model_options(args, settings, spec), progress)))
    return records


def run_models_check(args: argparse.Namespace, settings: Settings) -> int:
    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    records = asyncio.run(gate_models(args, settings, progress))
    for name, record in records:
        print(f"== model {name}")
        print("\n".join(engine_table(record)))
        for c in record.checks:
            print(f"{'PASS' if c.passed else 'FAIL'}  {c.name}: {c.detail}")
        print()
    out = Path(args.out) if args.out else Path(os.environ.get("KVPROXY_RECORD_DIR", "."))
    j, m = write_models_record(records, out)
    print(f"release record: {j} and {m}")
    summary = combined_json(records)
    if summary["passed"]:
        print("RESULT: PASS")
        return 0
    print("RESULT: FAIL (" + "; ".join(summary["failed_checks"]) + ")")
    return 1
