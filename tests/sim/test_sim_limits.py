"""The simulator's own engine arithmetic (kvproxy/sim/limits.py) and what it reports:
speculative reserve, DCP, the silent output clamp, vLLM DP metrics and the current error
texts. Numbers are worked out by hand from the engines' rules."""

from __future__ import annotations

import pytest

from kvproxy.sim.engine import EngineServer
from kvproxy.sim.limits import (
    EngineError,
    Limits,
    check_context,
    clamp_new_tokens,
    reserved_tokens,
)
from kvproxy.sim.metrics_text import render_metrics
from kvproxy.sim.state import EngineConfig


def test_eagle_reserve_is_the_larger_of_the_tree_and_the_drafts() -> None:
    eagle = EngineConfig(
        role="prefill",
        speculative_algorithm="EAGLE",
        speculative_num_steps=3,
        speculative_eagle_topk=4,
        speculative_num_draft_tokens=8,
    )
    assert reserved_tokens(eagle) == 12
    assert reserved_tokens(EngineConfig(role="prefill", speculative_algorithm="NGRAM")) == 0
    assert reserved_tokens(EngineConfig(role="prefill")) == 0


def test_sglang_context_checks_count_the_reserve() -> None:
    lim = Limits(context_len=8192, pool_tokens=20000, reserved_tokens=16)
    assert lim.largest_prompt == 8175
    check_context("sglang", lim, 8175, None)
    with pytest.raises(EngineError) as exc:
        check_context("sglang", lim, 8176, None)
    # SGLang reports the input with the reserve added.
    assert "The input (8192 tokens) is longer than the model's context length" in str(exc.value)
    check_context("sglang", lim, 8175, 1)  # 8,175 + 16 + 1 = 8,192: current builds use >
    with pytest.raises(EngineError):
        check_context("sglang", lim, 8175, 2)


def test_vllm_text_is_the_current_one() -> None:
    with pytest.raises(EngineError) as exc:
        check_context("vllm", Limits(4096, 5322), 4000, 100)
    assert str(exc.value).startswith(
        "This model's maximum context length is 4096 tokens. However, you requested 100 "
        "output tokens and your prompt contains 4000 input tokens, for a total of 4100 tokens."
    )


def test_dcp_scales_max_req_len_and_the_clamp() -> None:
    lim = Limits(context_len=16384, pool_tokens=5322, dcp_size=2)
    assert (lim.max_req_len, lim.max_req_input_len, lim.largest_prompt) == (10643, 10638, 10637)
    # min(10,643 - 10,000 - 1, 10,644 - 10,000 - 1 - 1) = 642
    assert clamp_new_tokens(lim, 10_000, 5000) == 642


def test_clamp_is_page_aware_and_never_negative() -> None:
    lim = Limits(context_len=8192, pool_tokens=5312, page_size=16)
    # ceil16(5,000) = 5,008; 5,312 - 5,008 - 16 - 1 = 287 < 5,311 - 5,000 - 1 = 310.
    assert clamp_new_tokens(lim, 5000, None) == 287
    assert clamp_new_tokens(lim, 5300, 10) == 0


async def test_server_info_and_metrics_report_the_engine_way() -> None:
    server = EngineServer(
        EngineConfig(
            role="prefill", pool_tokens=5322, page_size=1, dcp_size=2, context_length=16384
        )
    )
    info = server.server_info()
    assert (info["max_total_num_tokens"], info["dcp_size"], info["max_req_input_len"]) == (
        5322,
        2,
        10638,
    )
    assert info["speculative_algorithm"] is None
    vllm = EngineServer(
        EngineConfig(
            role="prefill",
            flavor="vllm",
            context_length=4096,
            pool_tokens=5322,
            page_size=16,
            dp_size=2,
            kv_cache_size_label=False,
        )
    )
    text = render_metrics(vllm)[0].decode()
    series = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(series) == 2
    # 333 pages per engine, summed over both by the front end.
    assert all('num_gpu_blocks="666"' in s and "kv_cache_size_tokens" not in s for s in series)
    assert {'engine="0"' in series[0], 'engine="1"' in series[1]} == {True}
