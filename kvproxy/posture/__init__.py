"""Engine posture: known-vulnerable engine versions and transfer backends (advisories),
each engine's PD settings as its `/server_info` reports them, pair checks across prefill
and decode, and the engines' own transfer-failure counters. Pure: no I/O.

The capacity probes read the reports (kvproxy.capacity); this package only interprets
them, so /capacity, the metrics and `kvproxy check` show the same findings.
"""

from kvproxy.posture.advisories import load_table
from kvproxy.posture.engine import FAILURE_COUNTERS, EnginePosture, read_posture
from kvproxy.posture.findings import (
    EngineView,
    Finding,
    evaluate,
    gate_verdict,
    gauge_series,
    posture_json,
)

__all__ = [
    "FAILURE_COUNTERS",
    "EnginePosture",
    "EngineView",
    "Finding",
    "evaluate",
    "gate_verdict",
    "gauge_series",
    "load_table",
    "posture_json",
    "read_posture",
]
