"""Probe of one vLLM engine.

The pool comes from the `vllm:cache_config_info` info gauge on `/metrics` (one series per
DP engine; the smallest wins): `kv_cache_size_tokens` when the build exports it (since
PR #42206, per engine), else `num_gpu_blocks x block_size`. The second is flagged
`pool_from_blocks`: on hybrid models `block_size` is a minimum over cache groups, so the
product can overstate the pool. It is also the whole deployment's pool under data
parallelism: the front end adds every DP engine's blocks into one `num_gpu_blocks`
(v1/engine/core_client.py `_apply_ready_response`) and repeats that cache config once per
engine index it serves (v1/metrics/loggers.py `log_metrics_info`, label `engine`). So the
per-engine pool is `num_gpu_blocks // engines x block_size`, engines being the distinct
`engine` labels. Series without an `engine` label come from builds without DP (V0): one
engine. Series that mix the two leave the DP size unknown, and the probe refuses.
vLLM refuses to start when max_model_len exceeds one engine's pool
(v1/core/kv_cache_utils.py), so the context binds in practice; the per-engine pool keeps
`/capacity`, the warnings and the release gate's table honest.
The context is `/v1/models` `data[].max_model_len`. Both endpoints are required. `/version`
is asked alongside and never fails the probe: it names the engine version the verified-feature
table is read for (kvproxy.tokens.gate.verified); absent, nothing version-specific is verified.

The arithmetic lives in `limits.vllm_limits`.

Must never: read "None" label values as numbers, or admit without max_model_len.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from kvproxy.capacity.limits import vllm_limits
from kvproxy.capacity.measurement import EngineMeasurement, Findings, ProbeError
from kvproxy.capacity.reports import (
    Reports,
    Sample,
    fetch_json,
    fetch_text,
    label_token_count,
    looks_like_prometheus,
    object_list,
    parse_prometheus,
    token_field,
)
from kvproxy.config import EngineSpec

CACHE_INFO = "vllm:cache_config_info"

# Where each number is read from. The pool: each `CACHE_INFO` series' `kv_cache_size_tokens`
# label, else its `num_gpu_blocks` x `block_size` split per DP engine (`_series_pool`). The
# page size: the smallest `block_size` label. The context: every /v1/models entry.
PAGE_LABEL = "block_size"
CONTEXT_FIELD = "/v1/models data[].max_model_len"


def _cache_series(metrics_text: str) -> list[Sample]:
    series = parse_prometheus(metrics_text, (CACHE_INFO,))[CACHE_INFO]
    if not series:
        if not looks_like_prometheus(metrics_text):
            raise ProbeError("not_metrics", "/metrics is not Prometheus text")
        raise ProbeError("missing_field", f"/metrics has no {CACHE_INFO} series")
    return series


def _dp_size(series: Sequence[Sample]) -> int | None:
    """The DP engines the front end serves (distinct `engine` labels; 1 without them), or
    None when labelled and unlabelled series mix."""
    labelled = [labels.get("engine") for labels, _ in series]
    if any(e is None for e in labelled) and any(e is not None for e in labelled):
        return None
    return max(1, len(set(labelled)) if labelled[0] is not None else 1)


def _series_pool(
    labels: Mapping[str, str], where: str, block_size: int | None, dp_size: int | None
) -> tuple[int, str, bool]:
    """One series' per-engine pool, its source, and whether it came from blocks."""
    tokens = label_token_count(labels, "kv_cache_size_tokens", f"{where}.kv_cache_size_tokens")
    if tokens is not None:
        return tokens, f"{where}.kv_cache_size_tokens", False
    blocks = label_token_count(labels, "num_gpu_blocks", f"{where}.num_gpu_blocks")
    if blocks is None or block_size is None:
        raise ProbeError(
            "missing_field",
            f"{where} has neither kv_cache_size_tokens nor num_gpu_blocks and block_size",
        )
    if dp_size is None:
        raise ProbeError(
            "missing_field",
            f"{CACHE_INFO} series mix engine-labelled and unlabelled ones, so the DP size "
            "is unknown and num_gpu_blocks (the front end's sum over its DP engines) "
            "cannot be split per engine; use a build that exports kv_cache_size_tokens",
        )
    if dp_size == 1:
        return blocks * block_size, f"{where}.num_gpu_blocks*block_size", True
    return (
        blocks // dp_size * block_size,
        f"{where}.num_gpu_blocks/{dp_size} engines*block_size",
        True,
    )


def _pool(series: Sequence[Sample], found: Findings) -> tuple[Reports, list[int]]:
    """Every series' pool report, and every block size reported."""
    pool = Reports("KV pool")
    blocks_used = False
    block_sizes: list[int] = []
    dp_size = _dp_size(series)
    for labels, _ in series:
        engine = labels.get("engine")
        tag = f"{{engine={engine}}}" if engine is not None else ""
        where = f"metrics.{CACHE_INFO}{tag}"
        block_size = label_token_count(labels, PAGE_LABEL, f"{where}.{PAGE_LABEL}")
        if block_size is not None:
            block_sizes.append(block_size)
        tokens, source, from_blocks = _series_pool(labels, where, block_size, dp_size)
        pool.add(tokens, source)
        blocks_used = blocks_used or from_blocks
    if blocks_used:
        split = (
            f" / {dp_size} DP engines (the front end sums their blocks)"
            if dp_size is not None and dp_size > 1
            else ""
        )
        found.warn(
            "pool_from_blocks",
            f"pool = num_gpu_blocks{split} x block_size (this vLLM build does not export "
            "kv_cache_size_tokens); on hybrid models this can overstate the pool",
        )
    dp_msg = pool.disagreement()
    if dp_msg is not None:
        found.warn("dp_ranks_differ", dp_msg)
    return pool, block_sizes


def _context(models: Mapping[str, Any], found: Findings) -> Reports:
    context = Reports("context length")
    for i, entry in enumerate(object_list(models, "data", "/v1/models data")):
        context.add(
            token_field(entry, "max_model_len", f"/v1/models data[{i}].max_model_len"),
            f"v1_models.data[{i}].max_model_len",
        )
    if not context:
        raise ProbeError("missing_field", "/v1/models has no data[].max_model_len")
    context_msg = context.disagreement()
    if context_msg is not None:
        found.warn("fields_disagree", context_msg)
    return context


def measure_vllm(
    spec: EngineSpec,
    metrics_text: str,
    models: Mapping[str, Any],
    *,
    measured_at: float | None = None,
    version: str | None = None,
) -> EngineMeasurement:
    """Pure: recorded `/metrics` text and `/v1/models` JSON in, one measurement out."""
    found = Findings()
    series = _cache_series(metrics_text)
    pool, block_sizes = _pool(series, found)
    context = _context(models, found)
    present = [f"metrics.{CACHE_INFO}", CONTEXT_FIELD]
    absent: list[str] = []
    has_tokens = any("kv_cache_size_tokens" in labels for labels, _ in series)
    (present if has_tokens else absent).append(f"metrics.{CACHE_INFO}.kv_cache_size_tokens")
    pool_tokens, pool_source = pool.smallest()
    max_model_len, context_source = context.smallest()
    limits = vllm_limits(pool_tokens=pool_tokens, max_model_len=max_model_len)
    if limits.input_limit_tokens < 1:
        raise ProbeError("bad_value", f"max_model_len {max_model_len} leaves no room for a prompt")
    if max_model_len > pool_tokens:
        found.warn(
            "context_exceeds_pool",
            f"max_model_len {max_model_len:,} exceeds the KV pool {pool_tokens:,}",
        )
    # Both fields bound the limit; name both, binding one first.
    first, second = (
        (pool_source, context_source)
        if limits.bound_by == "pool"
        else (context_source, pool_source)
    )
    input_source = f"min({first}, {second})"
    return EngineMeasurement(
        engine=spec.label,
        url=spec.url,
        role=spec.role,
        kind="vllm",
        input_limit_tokens=limits.input_limit_tokens,
        input_limit_source=f"{input_source} - 1",
        pool_tokens=pool_tokens,
        pool_source=pool_source,
        bound_by=limits.bound_by,
        measured_at=time.time() if measured_at is None else measured_at,
        page_size=min(block_sizes) if block_sizes else None,
        page_size_source=f"metrics.{CACHE_INFO}.{PAGE_LABEL}" if block_sizes else None,
        context_length=max_model_len,
        context_source=context_source,
        decode_limit_tokens=limits.decode_limit_tokens,
        decode_limit_source=input_source,
        request_limit_tokens=limits.request_limit_tokens,
        warnings=tuple(found.warnings),
        notes=tuple(found.notes),
        fields_present=tuple(present),
        fields_absent=tuple(absent),
        version=version,
    )


async def _version(session: aiohttp.ClientSession, base: str, timeout_s: float) -> str | None:
    """`GET /version` (vLLM's api_server), or None on any failure: optional."""
    try:
        data = await fetch_json(session, f"{base}/version", timeout_s)
    except ProbeError:
        return None
    version = data.get("version")
    return version if isinstance(version, str) else None


async def probe_vllm(
    session: aiohttp.ClientSession, spec: EngineSpec, timeout_s: float
) -> EngineMeasurement:
    base = spec.url.rstrip("/")
    metrics = asyncio.ensure_future(fetch_text(session, f"{base}/metrics", timeout_s))
    models = asyncio.ensure_future(fetch_json(session, f"{base}/v1/models", timeout_s))
    # Half the budget, as SGLang's optional cross-checks: a hanging /version cannot time the
    # whole probe out.
    version = asyncio.ensure_future(_version(session, base, timeout_s / 2))
    tasks = (metrics, models, version)
    try:
        metrics_text, models_json = await asyncio.gather(metrics, models)
        engine_version = await version
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return measure_vllm(spec, metrics_text, models_json, version=engine_version)
