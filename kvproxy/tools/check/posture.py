"""The release gate's posture check (`kvproxy check`), over the measurements it took.

Fails on any active, unaccepted high-severity finding (an advisory of the engine's version
and backend, a one-sided KV checksum, a page-size mismatch); the data it returns is the
record's `posture` section: per engine version, backend, checksum state and findings, the
table loaded and every acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvproxy.capacity import EngineMeasurement, ProbeError
from kvproxy.config import EngineSpec
from kvproxy.posture import EngineView, evaluate, gate_verdict, load_table, posture_json

CHECK_NAME = "engine posture"


def posture_check(
    measured: Sequence[tuple[EngineSpec, EngineMeasurement | ProbeError]],
    advisories_file: str | None = None,
    accept: Sequence[str] = (),
) -> tuple[bool, str, dict[str, Any]]:
    """(passed, detail, record section) for these measurements."""
    table = load_table(advisories_file, accept)
    views = [
        EngineView(
            spec.label if isinstance(m, ProbeError) else m.engine,
            spec.role,
            spec.kind,
            None if isinstance(m, ProbeError) else m.posture,
        )
        for spec, m in measured
    ]
    findings = evaluate(views, table)
    passed, detail = gate_verdict(findings)
    return passed, detail, posture_json(views, table, findings)


def markdown_lines(posture: dict[str, Any] | None) -> list[str]:
    """The release record's "Engine posture" section (Markdown)."""
    if posture is None:
        return []
    lines = ["", "## Engine posture", "", "| engine | role | version | backend | KV checksum |"
             " findings |", "|---|---|---|---|---|---|"]  # fmt: skip
    for e in posture["engines"]:
        p = e["posture"] or {}
        lines.append(
            f"| {e['engine']} | {e['role']} | {p.get('version') or 'not observable'} | "
            f"{p.get('transfer_backend') or 'not observable'} | "
            f"{p.get('kv_checksum', 'not observable')} | {', '.join(e['findings']) or '-'} |"
        )
    lines.append("")
    for f in posture["findings"]:
        state = "ACCEPTED by the operator" if f["accepted"] else f"{f['severity']}, not accepted"
        lines.append(f"- `{f['id']}` on {', '.join(f['engines'])} ({state}): {f['detail']}"
                     + (f" — {f['source']}" if f["source"] else ""))  # fmt: skip
    accepted = posture["advisories"]["accepted"]
    lines.append(f"- accepted advisories: {', '.join(accepted) or 'none'}")
    return lines
