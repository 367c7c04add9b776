"""The dashboard's "Engine posture" row (kvproxy.posture): advisories that apply to an
engine and are not accepted, a one-sided KV checksum, and the engines' own transfer and
bootstrap failure counters as kvproxy mirrors them.

Kept apart from grafana/dashboard.py (already near the module size limit); dashboard.ROWS
includes it. The series exist only while a finding is active, so each query falls back to
an explicit 0 and "no finding" reads as a flat zero.
"""

from __future__ import annotations

from grafana.model import RATE, RED_FROM_ONE, Panel, Query, Row, zero_if_absent
from grafana.promql import sel

ONE_SIDED = sel("kvproxy_engine_advisory", 'advisory="kv-checksum-one-sided"')
ADVISORIES = sel("kvproxy_engine_advisory", 'advisory!="kv-checksum-one-sided"')
FAILURES = sel("kvproxy_engine_transfer_failures")

POSTURE = Row(
    "Engine posture",
    (
        Panel(
            "Active unaccepted advisories by engine",
            "timeseries",
            "1 while an engine's version, transfer backend and mode match an advisory the "
            "operator has not accepted (accepted ones read 0). /capacity posture.findings "
            "names the fixed version and the source; `kvproxy check` fails on high ones.",
            (
                Query(
                    zero_if_absent(f"max by (engine, advisory) ({ADVISORIES})", "advisory"),
                    "{{engine}} {{advisory}}",
                ),
            ),
            unit="none",
            width=10,
            height=6,
            thresholds=RED_FROM_ONE,
            color_by_threshold=True,
        ),
        Panel(
            "KV checksum on one side only",
            "stat",
            "1: a prefill/decode pair has --disaggregation-enable-kv-checksum on one side "
            "only, so transferred KV is not verified. Must be 0.",
            (Query(f"max({ONE_SIDED}) or on() vector(0)", "one-sided"),),
            unit="none",
            width=4,
            height=6,
            thresholds=RED_FROM_ONE,
            color_by_threshold=True,
        ),
        Panel(
            "Engine KV transfer / bootstrap failures",
            "timeseries",
            "Increase of each engine's sglang:num_transfer_failed_reqs_total (kind=transfer; "
            "a KV checksum mismatch counts here) and num_bootstrap_failed_reqs_total "
            "(kind=bootstrap), as kvproxy's capacity probe last read them.",
            (
                Query(
                    zero_if_absent(f"sum by (engine, kind) (increase({FAILURES}[{RATE}]))", "kind"),
                    "{{engine}} {{kind}}",
                ),
            ),
            unit="none",
            width=10,
            height=6,
        ),
    ),
)
