"""Findings from engine reports: which advisories apply (version x backend x mode), the
prefill/decode pair checks, what is not observable, acceptance, and the gate's verdict.

The reports are written the way SGLang's /server_info shapes them (server arguments flat
next to `version`); expectations are worked out from the advisory table by hand."""

from __future__ import annotations

from typing import Any

import pytest

from kvproxy.capacity.sglang import failure_counters
from kvproxy.posture.advisories import load_table
from kvproxy.posture.engine import read_posture
from kvproxy.posture.findings import (
    EngineView,
    evaluate,
    gate_verdict,
    gauge_series,
    posture_json,
)

PENDING = "sglang-pd-pending-rejection-transfer"
DRAINED = "sglang-pd-failed-send-as-drained"


def info(role: str = "prefill", **changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "version": "0.5.21",
        "disaggregation_mode": role,
        "disaggregation_transfer_backend": "mooncake",
        "disaggregation_enable_kv_checksum": False,
        "allow_auto_truncate": False,
        "page_size": 16,
        "max_total_num_tokens": 5322,
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def pair(
    prefill: dict[str, Any], decode: dict[str, Any], metrics: str | None = None
) -> list[EngineView]:
    return [
        EngineView("p", "prefill", "sglang", read_posture(prefill, failure_counters(metrics))),
        EngineView("d", "decode", "sglang", read_posture(decode, failure_counters(metrics))),
    ]


def ids(views: list[EngineView], accept: tuple[str, ...] = ()) -> set[tuple[str, tuple[str, ...]]]:
    return {(f.id, f.engines) for f in evaluate(views, load_table(accept=accept))}


@pytest.mark.parametrize(
    ("version", "backend", "expected"),
    [
        ("0.5.21-sim", "mooncake", {PENDING}),
        ("0.5.20", "nixl", {PENDING, DRAINED}),
        ("0.5.22", "mooncake", set()),
        ("0.5.22", "nixl", {DRAINED}),
        ("0.5.22", "mori", {DRAINED}),
        ("0.5.23rc0", "mori", {DRAINED}),
        ("0.5.23", "nixl", set()),
        ("0.6.0", "mooncake", set()),
    ],
)
def test_advisories_follow_version_and_backend(
    version: str, backend: str, expected: set[str]
) -> None:
    views = pair(
        info("prefill", version=version, disaggregation_transfer_backend=backend),
        info("decode", version=version, disaggregation_transfer_backend=backend),
    )
    found = ids(views)
    assert {fid for fid, _ in found} == expected
    for fid in expected:  # each engine gets its own finding
        assert (fid, ("p",)) in found
        assert (fid, ("d",)) in found


def test_a_unified_engine_is_not_affected_by_pd_advisories() -> None:
    views = [
        EngineView("u", "unified", "sglang", read_posture(info(disaggregation_mode="null"), None))
    ]
    assert ids(views) == set()


def test_an_unobservable_backend_does_not_clear_a_backend_advisory() -> None:
    views = pair(
        info("prefill", version="0.5.22", disaggregation_transfer_backend=None),
        info("decode", version="0.5.22", disaggregation_transfer_backend=None),
    )
    findings = evaluate(views, load_table())
    assert {f.id for f in findings} == {DRAINED}
    assert all("transfer backend not observable" in f.detail for f in findings)


def test_an_absent_version_is_not_observable_and_matches_nothing() -> None:
    views = pair(info("prefill", version=None), info("decode", version=None))
    assert ids(views) == set()
    posture = views[0].posture
    assert posture is not None
    shown = posture.to_json()
    assert shown["version"] is None
    assert "version" in shown["not_observable"]
    assert "deferred_decode_kv_release" in shown["not_observable"]


@pytest.mark.parametrize(
    ("prefill", "decode", "one_sided"),
    [
        (True, False, True),
        (False, True, True),
        (True, None, True),  # a decode build without the flag does not verify
        (True, True, False),
        (False, False, False),
        (None, None, False),
    ],
)
def test_kv_checksum_on_one_side_only_is_a_high_finding(
    prefill: bool | None, decode: bool | None, one_sided: bool
) -> None:
    views = pair(
        info("prefill", version="0.5.23", disaggregation_enable_kv_checksum=prefill),
        info("decode", version="0.5.23", disaggregation_enable_kv_checksum=decode),
    )
    findings = evaluate(views, load_table())
    assert ({("kv-checksum-one-sided", ("p", "d"))} == ids(views)) is one_sided
    assert gate_verdict(findings)[0] is not one_sided


def test_page_size_and_version_mismatch() -> None:
    views = pair(info("prefill", version="0.5.23", page_size=16),
                 info("decode", version="0.5.24", page_size=64))  # fmt: skip
    findings = evaluate(views, load_table())
    assert {(f.id, f.severity) for f in findings} == {
        ("page-size-mismatch", "high"),
        ("version-mismatch", "medium"),
    }
    passed, detail = gate_verdict([f for f in findings if f.id == "version-mismatch"])
    assert passed
    assert "warnings: version-mismatch" in detail


def test_an_accepted_finding_stays_listed_but_does_not_block() -> None:
    views = pair(info("prefill"), info("decode"))
    table = load_table(accept=[PENDING])
    findings = evaluate(views, table)
    assert [f.accepted for f in findings] == [True, True]
    passed, detail = gate_verdict(findings)
    assert passed
    assert f"accepted by the operator: {PENDING}" in detail
    assert gauge_series(findings) == {("p", PENDING): 0, ("d", PENDING): 0}
    shown = posture_json(views, table, findings)
    assert shown["advisories"]["accepted"] == [PENDING]
    assert shown["blocking"] == []


def test_the_gate_verdict_names_the_advisory_and_its_source() -> None:
    findings = evaluate(pair(info("prefill"), info("decode")), load_table())
    passed, detail = gate_verdict(findings)
    assert not passed
    assert PENDING in detail
    assert "https://github.com/sgl-project/sglang/pull/30325" in detail
    assert gauge_series(findings) == {("p", PENDING): 1, ("d", PENDING): 1}


METRICS = """\
# TYPE sglang:num_transfer_failed_reqs_total counter
sglang:num_transfer_failed_reqs_total{tp_rank="0"} 3.0
sglang:num_transfer_failed_reqs_total{tp_rank="1"} 2.0
sglang:num_bootstrap_failed_reqs_total{tp_rank="0"} 1.0
"""


def test_failure_counters_are_summed_over_ranks_and_absence_is_stated() -> None:
    seen = read_posture(info(), failure_counters(METRICS))
    assert seen.failures == {"transfer": 5.0, "bootstrap": 1.0}
    none = read_posture(info(), None)
    assert none.failures == {}
    assert "metrics.sglang:num_transfer_failed_reqs_total" in none.absent
    broken = read_posture(
        info(), failure_counters("sglang:num_transfer_failed_reqs_total{ nonsense\n")
    )
    assert broken.failures == {}


def test_wrongly_typed_fields_are_not_observable_never_coerced() -> None:
    p = read_posture(info(page_size="16", disaggregation_enable_kv_checksum="true"), None)
    assert p.page_size is None
    assert p.kv_checksum is None
    assert p.to_json()["kv_checksum"] == "not observable"
