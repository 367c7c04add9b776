"""The release record's human forms: the engine table `kvproxy check` prints and the
Markdown file written next to the JSON record (kvproxy.tools.check.gate builds the record)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from kvproxy.tools.check.posture import markdown_lines as posture_markdown

if TYPE_CHECKING:
    from kvproxy.tools.check.gate import ReleaseRecord


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


def write_record(record: ReleaseRecord, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / "release-record.json", out / "release-record.md"
    j.write_bytes(orjson.dumps(record.to_json(), option=orjson.OPT_INDENT_2))
    m.write_text(markdown(record), encoding="utf-8")
    return j, m
