"""Findings: which advisories apply to which engine, and the prefill/decode pair checks.

One evaluation feeds /capacity, the `kvproxy_engine_advisory` gauge and the release gate,
so the three never disagree. A condition that cannot be observed (a build that does not
report its transfer backend, say) does not clear an advisory: the finding stands and says
what could not be seen. A version that cannot be parsed matches nothing and is reported
as not observable.

Must never: label a metric with anything but a configured engine and a table/builtin id
(both bounded), or treat an accepted finding as absent (it stays listed, marked accepted).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvproxy.posture.advisories import BUILTIN_CHECKS, Advisory, AdvisoryTable, parse_version
from kvproxy.posture.engine import EnginePosture


@dataclass(frozen=True)
class EngineView:
    engine: str
    role: str
    kind: str
    posture: EnginePosture | None  # None: not measured, or a kind without /server_info


@dataclass(frozen=True)
class Finding:
    id: str
    engines: tuple[str, ...]
    severity: str
    effect: str
    detail: str
    accepted: bool
    source: str | None = None
    fixed_in: str | None = None

    @property
    def blocks(self) -> bool:
        """Fails the release gate (and readiness with posture_action: not_ready)."""
        return self.severity == "high" and not self.accepted

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "engines": list(self.engines),
            "severity": self.severity,
            "accepted": self.accepted,
            "effect": self.effect,
            "detail": self.detail,
            "source": self.source,
            "fixed_in": self.fixed_in,
        }


def _advisory_finding(adv: Advisory, view: EngineView, table: AdvisoryTable) -> Finding | None:
    p = view.posture
    assert p is not None
    version = parse_version(p.version)
    if version is None or not adv.affects_version(version):
        return None
    unseen: list[str] = []
    if adv.transfer_backends is not None:
        if p.transfer_backend is None:
            unseen.append("transfer backend not observable")
        elif p.transfer_backend not in adv.transfer_backends:
            return None
    for arg, values in adv.when.items():
        if arg not in p.server_args:
            unseen.append(f"{arg} not observable")
        elif p.server_args[arg] not in values:
            return None
    detail = f"{view.engine} runs {view.kind} {p.version}"
    if p.transfer_backend:
        detail += f" with {p.transfer_backend}"
    detail += f"; fixed in {adv.fixed_in}"
    if unseen:
        detail += " (" + ", ".join(unseen) + ": assumed to apply)"
    return Finding(
        adv.id, (view.engine,), adv.severity, adv.effect, detail,
        adv.id in table.accepted, adv.source, adv.fixed_in,
    )  # fmt: skip


def _builtin(check: str, engines: tuple[str, ...], detail: str, table: AdvisoryTable) -> Finding:
    severity, effect = BUILTIN_CHECKS[check]
    return Finding(check, engines, severity, effect, detail, check in table.accepted)


def _pair_findings(p_view: EngineView, d_view: EngineView, table: AdvisoryTable) -> list[Finding]:
    p, d = p_view.posture, d_view.posture
    assert p is not None
    assert d is not None
    pair = (p_view.engine, d_view.engine)
    out: list[Finding] = []
    # On (True) for one side and not for the other (False, or a build without the flag).
    if (p.kv_checksum is True) != (d.kv_checksum is True):
        states = f"prefill {_flag(p.kv_checksum)}, decode {_flag(d.kv_checksum)}"
        detail = f"{pair[0]}/{pair[1]}: {states}"
        out.append(_builtin("kv-checksum-one-sided", pair, detail, table))
    if p.page_size is not None and d.page_size is not None and p.page_size != d.page_size:
        detail = f"{pair[0]} page {p.page_size}, {pair[1]} page {d.page_size}"
        out.append(_builtin("page-size-mismatch", pair, detail, table))
    if p.version is not None and d.version is not None and p.version != d.version:
        detail = f"{pair[0]} {p.version}, {pair[1]} {d.version}"
        out.append(_builtin("version-mismatch", pair, detail, table))
    return out


def _flag(value: bool | None) -> str:
    return "not observable" if value is None else ("on" if value else "off")


def evaluate(views: Sequence[EngineView], table: AdvisoryTable) -> list[Finding]:
    """Every active finding (accepted ones included, marked) for these engines."""
    found: list[Finding] = []
    seen = [v for v in views if v.posture is not None]
    for view in seen:
        for adv in table.advisories:
            if adv.engine == view.kind:
                f = _advisory_finding(adv, view, table)
                if f is not None:
                    found.append(f)
    prefills = [v for v in seen if v.role == "prefill"]
    decodes = [v for v in seen if v.role == "decode"]
    for p_view in prefills:
        for d_view in decodes:
            found.extend(_pair_findings(p_view, d_view, table))
    return found


def gauge_series(findings: Iterable[Finding]) -> dict[tuple[str, str], int]:
    """(engine, finding id) -> 1 while active and unaccepted, 0 while accepted."""
    series: dict[tuple[str, str], int] = {}
    for f in findings:
        for engine in f.engines:
            key = (engine, f.id)
            series[key] = max(series.get(key, 0), 0 if f.accepted else 1)
    return series


def gate_verdict(findings: Sequence[Finding]) -> tuple[bool, str]:
    """The release gate: fail on any active, unaccepted high-severity finding."""
    blocking = [f for f in findings if f.blocks]
    accepted = [f for f in findings if f.accepted]
    if blocking:
        names = "; ".join(
            f"{f.id} on {', '.join(f.engines)}" + (f" ({f.source})" if f.source else "")
            for f in blocking
        )
        return False, f"active unaccepted high-severity findings: {names}"
    detail = "no active unaccepted high-severity finding"
    if accepted:
        detail += "; accepted by the operator: " + ", ".join(sorted({f.id for f in accepted}))
    others = [f for f in findings if not f.accepted and not f.blocks]
    if others:
        detail += "; warnings: " + ", ".join(sorted({f.id for f in others}))
    return True, detail


def posture_json(
    views: Sequence[EngineView], table: AdvisoryTable, findings: Sequence[Finding]
) -> dict[str, Any]:
    """The `posture` section of /capacity and of the release record."""
    return {
        "advisories": table.to_json(),
        "engines": [
            {
                "engine": v.engine,
                "role": v.role,
                "kind": v.kind,
                "posture": v.posture.to_json() if v.posture is not None else None,
                "findings": [f.id for f in findings if v.engine in f.engines],
            }
            for v in views
        ],
        "findings": [f.to_json() for f in findings],
        "blocking": sorted({f.id for f in findings if f.blocks}),
    }
