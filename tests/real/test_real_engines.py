"""The fixtures are what engines.py says: real engines with the declared limits, a pair that
moves the KV over NIXL. Judged on the engines' own counters, not on our reading of them."""

from __future__ import annotations

import json
import urllib.request
import uuid
from typing import Any

from engines import (
    DECODE_MAX_MODEL_LEN,
    MODEL_NAME,
    PREFILL_MAX_MODEL_LEN,
    UNIFIED_MAX_MODEL_LEN,
    PDPair,
    VllmEngine,
    wait_metrics,
)


def chat(url: str, words: int, max_tokens: int = 4) -> tuple[int, dict[str, Any]]:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": uuid.uuid4().hex + " hello" * words}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def served_max_len(url: str) -> int:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        return int(json.loads(resp.read())["data"][0]["max_model_len"])


def test_unified_engine_serves_and_counts(vllm_unified: VllmEngine) -> None:
    assert served_max_len(vllm_unified.url) == UNIFIED_MAX_MODEL_LEN
    before = vllm_unified.metrics()
    status, body = chat(vllm_unified.url, 100)
    assert status == 200, body
    prompt = body["usage"]["prompt_tokens"]
    after = wait_metrics(
        vllm_unified,
        lambda m: (
            m.value("vllm:request_success_total") > before.value("vllm:request_success_total")
        ),
        "counted the request",
    )
    assert (
        after.value("vllm:prompt_tokens_total") - before.value("vllm:prompt_tokens_total") == prompt
    )
    assert (
        after.value("vllm:request_success_total") - before.value("vllm:request_success_total") == 1
    )


def test_pair_moves_the_prompt_over_nixl(vllm_pd: PDPair) -> None:
    assert served_max_len(vllm_pd.prefill.url) == PREFILL_MAX_MODEL_LEN
    assert served_max_len(vllm_pd.decode.url) == DECODE_MAX_MODEL_LEN
    source = "vllm:prompt_tokens_by_source_total"
    p0, d0 = vllm_pd.prefill.metrics(), vllm_pd.decode.metrics()
    status, body = chat(vllm_pd.router_url, 300, max_tokens=8)
    assert status == 200, body
    prompt = body["usage"]["prompt_tokens"]
    done = "vllm:request_success_total"
    p1 = wait_metrics(vllm_pd.prefill, lambda m: m.value(done) > p0.value(done), "counted it")
    d1 = wait_metrics(vllm_pd.decode, lambda m: m.value(done) > d0.value(done), "counted it")
    assert (
        p1.value(source, source="local_compute") - p0.value(source, source="local_compute")
        == prompt
    )
    got = d1.value(source, source="external_kv_transfer") - d0.value(
        source, source="external_kv_transfer"
    )
    assert got == prompt, f"decode pulled {got} of {prompt} prompt tokens over NIXL"
    assert d1.value(source, source="local_compute") == d0.value(source, source="local_compute")
