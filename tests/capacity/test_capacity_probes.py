"""Probes against recorded response shapes of several SGLang and vLLM versions.

Pure parsing (`measure_sglang`, `measure_vllm`, `measure_static`): no sockets. Each
fixture file under fixtures/ is one engine version's answer; the expected numbers are
worked out by hand in the comments.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from capacity_fakes import load_json, load_text

from kvproxy.capacity import EngineMeasurement, ProbeError
from kvproxy.capacity.probes import measure_static
from kvproxy.capacity.reports import parse_prometheus
from kvproxy.capacity.sglang import measure_sglang
from kvproxy.capacity.vllm import measure_vllm
from kvproxy.config import EngineSpec

PREFILL = EngineSpec(url="http://10.0.0.1:30001", role="prefill", kind="sglang")
DECODE = EngineSpec(url="http://10.0.0.2:30002", role="decode", kind="sglang")
UNIFIED = EngineSpec(url="http://10.0.0.3:30000", role="unified", kind="sglang")
VLLM = EngineSpec(url="http://10.0.0.4:8000", role="unified", kind="vllm")


def models(max_model_len: Any) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": "m", "object": "model", "max_model_len": max_model_len}],
    }


def reason_of(exc: pytest.ExceptionInfo[ProbeError]) -> str:
    return exc.value.reason


# --- SGLang ------------------------------------------------------------------------------


def test_sglang_05_prefill_with_metrics_and_models() -> None:
    got = measure_sglang(
        PREFILL,
        load_json("sglang_0.5_prefill_server_info.json"),
        metrics_text=load_text("sglang_0.5_prefill_metrics.prom"),
        models=models(1_048_576),
    )
    # max_req_input_len 681,274 -> 681,273 = min(1,048,576, 681,280) - 7: the incident pool.
    assert got.input_limit_tokens == 681_273
    assert got.input_limit_source == "server_info.max_req_input_len"
    assert (got.pool_tokens, got.pool_source) == (681_280, "server_info.max_total_num_tokens")
    assert got.context_length == 1_048_576
    assert got.context_source is not None
    assert got.context_source.startswith("metrics.sglang:context_len")
    assert (got.page_size, got.page_size_source) == (64, "server_info.page_size")
    # The scheduler's page-aware clamp (PR #25126): ceil_page(P) + out <= 681,280 - 64 - 1
    # holds for every P + out <= 681,280 - 2 x 64 = 681,152.
    assert got.decode_limit_tokens == 681_152
    assert got.bound_by == "pool"
    assert got.source == "measured"
    # The engine itself is configured with a context larger than its pool.
    assert got.warnings == ("context_exceeds_pool",)
    assert "1,048,576" in got.warning_note("context_exceeds_pool")
    assert got.limit_phrase() == "measured prefill KV pool of 10.0.0.1:30001"


def test_sglang_05_context_null_and_no_cross_checks() -> None:
    # context_length null, /metrics and /v1/models unavailable: max_req_input_len decides.
    got = measure_sglang(PREFILL, load_json("sglang_0.5_prefill_server_info.json"))
    assert got.input_limit_tokens == 681_273
    assert got.context_length is None
    assert got.warnings == ()


def test_sglang_dp_ranks_take_the_smallest() -> None:
    got = measure_sglang(PREFILL, load_json("sglang_0.5_dp4_server_info.json"))
    # Rank 2 holds 679,936 tokens; the top-level max_req_input_len is rank 0's (681,274).
    assert got.pool_tokens == 679_936
    assert got.pool_source == "server_info.internal_states[2].memory_usage.token_capacity"
    assert got.input_limit_tokens == 679_929
    assert got.input_limit_source == got.pool_source
    assert "dp_ranks_differ" in got.warnings
    assert "fields_disagree" not in got.warnings


def test_sglang_04_get_server_info_without_pool_gauge() -> None:
    got = measure_sglang(
        UNIFIED,
        load_json("sglang_0.4_get_server_info.json"),
        info_path="get_server_info",
        metrics_text=load_text("sglang_0.4_metrics_no_pool_gauge.prom"),
        # Old /v1/models entries carry no max_model_len.
        models={"object": "list", "data": [{"id": "meta-llama/Llama-3.1-8B-Instruct"}]},
    )
    # 131,066 - 1: the context (131,072) binds below the pool (163,642).
    assert got.input_limit_tokens == 131_065
    assert got.input_limit_source == "get_server_info.max_req_input_len"
    assert got.pool_tokens == 163_642
    assert got.bound_by == "context"
    assert got.limit_phrase() == "measured unified context length of 10.0.0.3:30000"
    assert got.warnings == ()


def test_sglang_decode_without_max_req_input_len_uses_metrics_context() -> None:
    info = load_json("sglang_0.5_decode_no_mril_server_info.json")
    got = measure_sglang(DECODE, info, metrics_text=load_text("sglang_0.5_decode_metrics.prom"))
    # min(1,048,576, 2,618,868) - 7
    assert got.input_limit_tokens == 1_048_569
    # max_req_len = 1,048,575 (context - 1): prompt + output <= 1,048,574 is served uncut.
    assert got.decode_limit_tokens == 1_048_574
    assert got.bound_by == "context"
    assert got.input_limit_source.startswith("metrics.sglang:context_len")


def test_sglang_without_any_context_fails_rather_than_guess() -> None:
    info = load_json("sglang_0.5_decode_no_mril_server_info.json")
    with pytest.raises(ProbeError) as exc:
        measure_sglang(
            DECODE, info, metrics_text=load_text("sglang_0.4_metrics_no_pool_gauge.prom")
        )
    assert reason_of(exc) == "missing_field"
    assert "context" in exc.value.message


def test_sglang_swa_pool_and_auto_truncate() -> None:
    got = measure_sglang(UNIFIED, load_json("sglang_0.5_swa_autotrunc_server_info.json"))
    assert got.pool_tokens == 960_000
    assert got.pool_source == "server_info.swa_max_total_num_tokens"
    assert got.input_limit_tokens == 131_065
    assert set(got.warnings) == {"swa_pool_binds", "allow_auto_truncate"}
    assert "silently" in got.warning_note("allow_auto_truncate")


def test_sglang_smaller_metrics_gauge_wins_and_is_flagged() -> None:
    metrics = load_text("sglang_0.5_prefill_metrics.prom").replace("} 681280.0", "} 600000.0")
    got = measure_sglang(
        PREFILL, load_json("sglang_0.5_prefill_server_info.json"), metrics_text=metrics
    )
    assert got.pool_tokens == 600_000
    assert got.pool_source.startswith("metrics.sglang:max_total_num_tokens")
    assert got.input_limit_tokens == 599_993
    assert "fields_disagree" in got.warnings


@pytest.mark.parametrize(
    "metrics_text",
    [
        "<html><body>metrics disabled</body></html>",
        'sglang:max_total_num_tokens{tp_rank="0" 12',  # unterminated labels
        "sglang:max_total_num_tokens NaN\nsglang:context_len -1\n",
        "\x00\x01binary",
    ],
)
def test_sglang_bad_metrics_are_ignored_not_trusted(metrics_text: str) -> None:
    got = measure_sglang(
        PREFILL, load_json("sglang_0.5_prefill_server_info.json"), metrics_text=metrics_text
    )
    assert got.input_limit_tokens == 681_273


def test_sglang_reported_pool_is_taken_as_reported() -> None:
    # SGLang rounds its pool to whole pages before reporting it and derives
    # max_req_input_len from the reported number: the probe does not round again.
    info = {"max_total_num_tokens": 1000, "page_size": 64, "context_length": 8192}
    got = measure_sglang(UNIFIED, info)
    assert (got.pool_tokens, got.input_limit_tokens) == (1000, 993)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda i: i.__setitem__("max_total_num_tokens", "681280"), "bad_type"),
        (lambda i: i.__setitem__("max_total_num_tokens", True), "bad_type"),
        (lambda i: i.__setitem__("max_total_num_tokens", 681280.0), "bad_type"),
        (lambda i: i.__setitem__("max_total_num_tokens", 0), "bad_value"),
        (lambda i: i.__setitem__("max_req_input_len", -5), "bad_value"),
        (lambda i: i.__setitem__("max_req_input_len", 1), "bad_value"),
        (lambda i: i.__setitem__("internal_states", "rank0"), "bad_type"),
        (lambda i: i.__setitem__("internal_states", [1, 2]), "bad_type"),
        (lambda i: i["internal_states"][0].__setitem__("memory_usage", [1]), "bad_type"),
        (
            lambda i: (i.pop("max_total_num_tokens"), i["internal_states"][0].pop("memory_usage")),
            "missing_field",
        ),
    ],
)
def test_sglang_wrong_shapes_fail_with_a_reason(mutate: Any, reason: str) -> None:
    info = copy.deepcopy(load_json("sglang_0.5_prefill_server_info.json"))
    mutate(info)
    with pytest.raises(ProbeError) as exc:
        measure_sglang(PREFILL, info)
    assert reason_of(exc) == reason


def test_sglang_role_mismatch_is_noted() -> None:
    got = measure_sglang(DECODE, load_json("sglang_0.5_prefill_server_info.json"))
    assert any("reports mode 'prefill'" in n for n in got.notes)


# --- vLLM --------------------------------------------------------------------------------


def test_vllm_011_kv_cache_size_tokens_binds() -> None:
    got = measure_vllm(VLLM, load_text("vllm_0.11_metrics.prom"), models(2_097_152))
    assert got.pool_tokens == 2_042_016
    assert got.pool_source == "metrics.vllm:cache_config_info{engine=0}.kv_cache_size_tokens"
    assert got.input_limit_tokens == 2_042_015
    assert got.decode_limit_tokens == 2_042_016
    assert "kv_cache_size_tokens" in got.input_limit_source
    assert got.page_size == 16
    assert got.bound_by == "pool"
    assert "pool_from_blocks" not in got.warnings


def test_vllm_context_binds() -> None:
    got = measure_vllm(VLLM, load_text("vllm_0.11_metrics.prom"), models(40_960))
    assert (got.input_limit_tokens, got.decode_limit_tokens) == (40_959, 40_960)
    assert got.bound_by == "context"
    assert got.context_source == "v1_models.data[0].max_model_len"


def test_vllm_08_blocks_times_block_size_is_flagged() -> None:
    got = measure_vllm(VLLM, load_text("vllm_0.8_metrics_blocks_only.prom"), models(8192))
    assert got.pool_tokens == 573 * 16
    assert got.pool_source.endswith("num_gpu_blocks*block_size")
    assert got.input_limit_tokens == 8191
    assert got.warnings == ("pool_from_blocks",)
    assert "hybrid" in got.warning_note("pool_from_blocks")


def test_vllm_dp_engines_take_the_smallest() -> None:
    got = measure_vllm(VLLM, load_text("vllm_0.10_dp2_metrics.prom"), models(2_000_000))
    assert got.pool_tokens == 1_040_384
    assert got.pool_source == "metrics.vllm:cache_config_info{engine=1}.kv_cache_size_tokens"
    assert "dp_ranks_differ" in got.warnings


@pytest.mark.parametrize(
    ("metrics_text", "model_list", "reason"),
    [
        (load_text("vllm_metrics_blocks_none.prom"), models(8192), "missing_field"),
        ("vllm:num_requests_running 0\n", models(8192), "missing_field"),
        ("<!doctype html><title>500</title>", models(8192), "not_metrics"),
        ('vllm:cache_config_info{kv_cache_size_tokens="lots"} 1\n', models(8192), "bad_type"),
        ('vllm:cache_config_info{kv_cache_size_tokens="0"} 1\n', models(8192), "bad_value"),
        (load_text("vllm_0.11_metrics.prom"), {"data": [{"id": "m"}]}, "missing_field"),
        (load_text("vllm_0.11_metrics.prom"), models("8192"), "bad_type"),
        (load_text("vllm_0.11_metrics.prom"), {"data": "m"}, "bad_type"),
    ],
)
def test_vllm_wrong_shapes_fail_with_a_reason(
    metrics_text: str, model_list: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ProbeError) as exc:
        measure_vllm(VLLM, metrics_text, model_list)
    assert reason_of(exc) == reason


# --- static and shared pieces ------------------------------------------------------------


def test_static_is_declared() -> None:
    spec = EngineSpec(url="static://prefill", role="prefill", kind="static", capacity_tokens=65536)
    got = measure_static(spec)
    assert isinstance(got, EngineMeasurement)
    assert (got.input_limit_tokens, got.decode_limit_tokens, got.pool_tokens) == (65536,) * 3
    assert got.source == "declared"
    assert got.bound_by == "declared"
    assert got.to_json()["source"] == "declared"


def test_prometheus_parser_handles_escapes_and_timestamps() -> None:
    text = (
        '# HELP x y\nm{a="q\\"uote",b="back\\\\slash",c="n\\nl"} 12 1700000000000\nm 3\nother 1\n'
    )
    got = parse_prometheus(text, ["m"])["m"]
    assert got == [({"a": 'q"uote', "b": "back\\slash", "c": "n\nl"}, 12.0), ({}, 3.0)]


def test_probe_error_reasons_are_a_closed_set() -> None:
    with pytest.raises(ValueError, match="unknown probe error reason"):
        ProbeError("weird", "x")


# --- the engines' own arithmetic (issue #24) -------------------------------------------------


def test_sglang_eagle3_reserve_from_server_args() -> None:
    # EAGLE3 topk 4 x 5 steps = 20 > 8 draft tokens: SGLang reserves 20. No context is
    # reported, so the smallest one max_req_input_len allows (131,066 + 6) stands in:
    # input + 20 >= 131,072 is refused -> 131,051 (the fixed 7 would say 131,065).
    got = measure_sglang(UNIFIED, load_json("sglang_0.5_eagle3_server_info.json"))
    assert got.input_limit_tokens == 131_051
    assert "EAGLE3 reserve" in got.input_limit_source
    assert "= 20" in got.input_limit_source
    assert "server_info.speculative_algorithm" in got.fields_present
    # With the context reported, the same rule: 131,072 - 20 - 1.
    got = measure_sglang(
        UNIFIED, load_json("sglang_0.5_eagle3_server_info.json"), models=models(131_072)
    )
    assert got.input_limit_tokens == 131_051
    # Prompt + output: the total check counts the reserve too (131,072 - 20 - 1).
    assert got.decode_limit_tokens == 131_051
    assert got.request_limit_tokens == 131_051


def test_sglang_newer_max_speculative_num_draft_tokens_counts() -> None:
    info = load_json("sglang_0.5_eagle3_server_info.json")
    info["max_speculative_num_draft_tokens"] = 64  # adaptive drafts (compute_num_reserved_tokens)
    got = measure_sglang(UNIFIED, info, models=models(131_072))
    assert got.input_limit_tokens == 131_072 - 64 - 1


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"speculative_eagle_topk": None}, "missing_field"),
        ({"speculative_num_steps": "5"}, "bad_type"),
        ({"speculative_num_draft_tokens": 0}, "bad_value"),
        ({"speculative_algorithm": 3}, "bad_type"),
    ],
)
def test_sglang_speculative_on_but_unreadable_gives_no_limit(
    change: dict[str, Any], reason: str
) -> None:
    info = load_json("sglang_0.5_eagle3_server_info.json")
    info.update(change)
    with pytest.raises(ProbeError) as exc:
        measure_sglang(UNIFIED, info, models=models(131_072))
    assert reason_of(exc) == reason
    if reason == "missing_field":
        assert "no limit is derived" in exc.value.message


def test_sglang_ngram_and_off_reserve_nothing() -> None:
    for algorithm in ("NGRAM", None, "NONE"):
        info = load_json("sglang_0.5_eagle3_server_info.json")
        info["speculative_algorithm"] = algorithm
        info["speculative_eagle_topk"] = None
        got = measure_sglang(UNIFIED, info, models=models(131_072))
        assert got.input_limit_tokens == 131_065  # max_req_input_len 131,066 - 1


def test_sglang_dcp2_scales_the_pool_the_engine_reports() -> None:
    # dcp_size 2 over a 681,280-token rank pool; the engine's own max_req_input_len
    # (1,048,570 = min(1,048,575, 1,362,559) - 5) shows its build scales by DCP
    # (PR #33448), so the context binds: 1,048,569. Per rank it would be 681,273.
    got = measure_sglang(PREFILL, load_json("sglang_0.5_dcp2_server_info.json"))
    assert got.input_limit_tokens == 1_048_569
    assert got.pool_tokens == 681_280
    assert "server_info.dcp_size" in got.fields_present


def test_sglang_dcp_without_the_engines_report_keeps_the_rank_pool() -> None:
    # A build before PR #33448 reports max_req_input_len from one rank's pool: the DCP
    # size alone never raises the limit.
    info = load_json("sglang_0.5_prefill_server_info.json")
    info["dcp_size"] = 2
    got = measure_sglang(PREFILL, info)
    assert got.input_limit_tokens == 681_273
    assert any("PR #33448" in n for n in got.notes)
    info.pop("max_req_input_len")
    for rank in info["internal_states"]:
        rank.pop("max_req_input_len", None)
    got = measure_sglang(PREFILL, info, models=models(1_048_576))
    assert got.input_limit_tokens == 681_273


def test_sglang_fields_present_and_absent_are_listed() -> None:
    got = measure_sglang(PREFILL, load_json("sglang_0.5_prefill_server_info.json"))
    # Current engines keep the sliding-window pool in the model runner only.
    assert "server_info.swa_max_total_num_tokens" in got.fields_absent
    assert "server_info.max_total_num_tokens" in got.fields_present
    assert "/metrics" in got.fields_absent
    shown = got.to_json()["fields"]
    assert set(shown["present"]).isdisjoint(shown["absent"])


def test_sglang_dp_ranks_without_their_own_input_limit_are_said_so() -> None:
    got = measure_sglang(PREFILL, load_json("sglang_0.5_dp4_server_info.json"))
    assert any("DP rank 0's" in n for n in got.notes)


def test_vllm_dp2_blocks_are_split_per_engine() -> None:
    # Two engines; each series carries the front end's sum, 131,072 blocks of 16:
    # one engine holds 65,536 x 16 = 1,048,576 tokens, not 2,097,152.
    got = measure_vllm(VLLM, load_text("vllm_0.9_dp2_metrics_blocks_only.prom"), models(131_072))
    assert got.pool_tokens == 1_048_576
    assert "/2 engines" in got.pool_source
    assert "2 DP engines" in got.warning_note("pool_from_blocks")
    assert "metrics.vllm:cache_config_info.kv_cache_size_tokens" in got.fields_absent


def test_vllm_dp_size_unknown_refuses_the_blocks_fallback() -> None:
    text = load_text("vllm_0.9_dp2_metrics_blocks_only.prom").replace('engine="1",', "")
    with pytest.raises(ProbeError) as exc:
        measure_vllm(VLLM, text, models(131_072))
    assert reason_of(exc) == "missing_field"
    assert "DP size" in exc.value.message


@pytest.mark.parametrize("line", ["m{a=x} 1", "m,{} 1", "m{a='x'} 1", "m"])
def test_prometheus_malformed_sample_of_an_asked_name_is_an_error(line: str) -> None:
    with pytest.raises(ProbeError) as exc:
        parse_prometheus(f"m 1\n{line}\n", ["m"])
    assert reason_of(exc) == "not_metrics"


def test_prometheus_malformed_lines_of_other_names_are_skipped() -> None:
    text = 'other{a=x} 1\n<html>\nm{a="1"} 7\nm_total 9\n'
    assert parse_prometheus(text, ["m"]) == {"m": [({"a": "1"}, 7.0)]}
