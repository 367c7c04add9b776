"""The proxy's running view of engine posture: fed by the capacity monitor after every
refresh, read by /capacity, the metrics and /readyz.

Logs, at start, the table it loaded and every acceptance (one line), and afterwards each
finding when it appears or goes away (one line each, never per refresh).

Must never: raise into the capacity monitor (a bad report is a missing posture, not a
failed refresh), or keep metric series of engines or findings that are gone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any, Literal, Protocol

from kvproxy.observe import Metrics
from kvproxy.posture import (
    FAILURE_COUNTERS,
    EnginePosture,
    EngineView,
    Finding,
    evaluate,
    gauge_series,
    load_table,
    posture_json,
)

log = logging.getLogger("kvproxy.posture")


class PostureSettings(Protocol):
    """The settings the tracker reads (kvproxy.config's Settings has them)."""

    @property
    def advisories_file(self) -> str | None: ...
    @property
    def accept_advisories(self) -> tuple[str, ...]: ...
    @property
    def posture_action(self) -> Literal["warn", "not_ready"]: ...


class PostureTracker:
    def __init__(self, settings: PostureSettings, metrics: Metrics) -> None:
        self._settings = settings
        self._metrics = metrics
        # Settings validation already loaded this table once; a failure here is a bug.
        self.table = load_table(settings.advisories_file, settings.accept_advisories)
        self._views: list[EngineView] = []
        self._findings: list[Finding] = []
        self._series: dict[tuple[str, str], int] = {}
        self._failure_series: set[tuple[str, str]] = set()
        log.info(
            "posture: %d advisories from %s; accepted by the operator: %s; action %s",
            len(self.table.advisories), ", ".join(self.table.files),
            ", ".join(sorted(self.table.accepted)) or "none", settings.posture_action,
        )  # fmt: skip

    @property
    def findings(self) -> list[Finding]:
        return list(self._findings)

    def observe_failures(self, engine: str, posture: EnginePosture | None) -> None:
        """Mirror the engine's own failure counters (called on every successful probe)."""
        if posture is None:
            return
        for kind in FAILURE_COUNTERS:
            value = posture.failures.get(kind)
            if value is not None:
                self._metrics.engine_transfer_failures.labels(engine, kind).set(value)
                self._failure_series.add((engine, kind))

    def update(self, engines: Iterable[tuple[str, str, str, EnginePosture | None]]) -> None:
        """Re-evaluate after a refresh: (engine, role, kind, last posture or None)."""
        views = [EngineView(e, role, kind, p) for e, role, kind, p in engines]
        findings = evaluate(views, self.table)
        old = {(f.id, f.engines) for f in self._findings}
        new = {(f.id, f.engines) for f in findings}
        for f in findings:
            if (f.id, f.engines) not in old:
                level = logging.INFO if f.accepted else logging.WARNING
                log.log(level, "posture: %s %s on %s: %s%s%s", f.severity, f.id,
                        ", ".join(f.engines), f.detail, f" [{f.source}]" if f.source else "",
                        " (accepted)" if f.accepted else "")  # fmt: skip
        for fid, labels in old - new:
            log.info("posture: %s no longer applies to %s", fid, ", ".join(labels))
        self._views, self._findings = views, findings
        series = gauge_series(findings)
        gauge = self._metrics.engine_advisory
        for key in set(self._series) - set(series):
            with contextlib.suppress(KeyError):
                gauge.remove(*key)
        for (engine, fid), value in series.items():
            gauge.labels(engine, fid).set(value)
        self._series = series
        present = {v.engine for v in views}
        for key in [k for k in self._failure_series if k[0] not in present]:
            with contextlib.suppress(KeyError):
                self._metrics.engine_transfer_failures.remove(*key)
            self._failure_series.discard(key)

    def blocks_ready(self) -> bool:
        """posture_action: not_ready and an active unaccepted high-severity finding."""
        return self._settings.posture_action == "not_ready" and any(
            f.blocks for f in self._findings
        )

    def snapshot_json(self) -> dict[str, Any]:
        out = posture_json(self._views, self.table, self._findings)
        out["action"] = self._settings.posture_action
        return out
