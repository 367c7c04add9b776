"""The release record: what `kvproxy check` found (kvproxy.tools.check.gate fills it in), the
engine table it prints, and the JSON and Markdown files it writes: one record, or one
section per configured model (each section a complete record) under the models schema."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from kvproxy.tools.check.boundary import Check
from kvproxy.tools.check.posture import markdown_lines as posture_markdown

SCHEMA = "kvproxy.release-record/1"
MODELS_SCHEMA = "kvproxy.release-record.models/1"
SCHEMA_PATH = Path(__file__).parent / "schemas" / "release_record.schema.json"


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
    # Gateway mode: one section per upstream cluster of the model (its engines, limits,
    # posture, checks and verdict); absent from the single-cluster forms' record.
    clusters: dict[str, dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.clusters is None:
            del data["clusters"]
        return data


def engine_table(record: ReleaseRecord) -> list[str]:
    head = ("engine", "role", "pool", "input limit", "source field", "page", "warnings")
    rows = [head]
    for e in record.engines:
        if "cluster" in e:
            e = {**e, "engine": f"{e['cluster']}: {e['engine']}"}
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
        if "cluster" in e:
            e = {**e, "engine": f"{e['cluster']}: {e['engine']}"}
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
    lines += cluster_markdown(record.clusters)
    lines += ["", "## Checks", "", "| check | result | detail |", "|---|---|---|"]
    for c in record.checks:
        lines.append(f"| {c.name} | {'PASS' if c.passed else 'FAIL'} | {c.detail} |")
    lines += posture_markdown(record.posture)
    for name, section in (record.clusters or {}).items():
        lines += [
            line.replace("## Engine posture", f"## Engine posture, cluster `{name}`")
            for line in posture_markdown(section["posture"])
        ]
    if record.isolation:
        lines += ["", "## Isolation evidence", ""]
        for sc in record.isolation["scenarios"]:
            lines.append(
                f"- `{sc['name']}`: {sc['verdict']}, {sc['requests']} requests, "
                f"{len(sc['foreign_markers'])} foreign markers, "
                f"{sc['blocked_by_tripwire']} withheld"
                + (f", probes: {sc['probe_kind']}" if sc.get("probe_kind") else "")
            )
        tripwire = record.isolation.get("tripwire")
        if tripwire:
            lines += ["", "The target's tripwire is not armed for the harness's tenants:", ""]
            lines += [f"- {why}" for why in tripwire["reasons"]]
            lines += ["", "kvproxy configuration that arms it:", "", "```yaml"]
            lines += [tripwire["config"], "```"]
        lines += ["", "> " + " ".join(record.isolation["caveats"])]
    if record.failed_checks:
        lines += ["", "## Failed", ""] + [f"- {n}" for n in record.failed_checks]
    return "\n".join(lines) + "\n"


def cluster_markdown(clusters: dict[str, dict[str, Any]] | None) -> list[str]:
    """The "Clusters" section of a gateway model's record: each cluster's router, weight,
    limits and verdict (its engines are in the engine table, its checks prefixed by name)."""
    if not clusters:
        return []
    lines = [
        "",
        "## Clusters (gateway mode: each measured and gated on its own)",
        "",
        "| cluster | router | weight | admission limit | decode limit | result | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in clusters.items():
        limit = c["limits"].get("admission_limit_tokens")
        decode = c["limits"].get("decode_limit_tokens")
        lines.append(
            f"| {name} | {c['url']} | {c['weight']:g} | "
            f"{f'{limit:,}' if limit is not None else 'unknown'} | "
            f"{f'{decode:,}' if decode is not None else '-'} | "
            f"{'PASS' if c['passed'] else 'FAIL'} | {', '.join(c['failed_checks']) or '-'} |"
        )
    return lines


def write_record(record: ReleaseRecord, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / "release-record.json", out / "release-record.md"
    j.write_bytes(orjson.dumps(record.to_json(), option=orjson.OPT_INDENT_2))
    m.write_text(markdown(record), encoding="utf-8")
    return j, m


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
