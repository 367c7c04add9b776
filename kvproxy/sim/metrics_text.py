"""The engines' Prometheus exposition, with the real engines' metric names.

Owns: ``render_metrics(server)``, which produces ``/metrics`` for one simulated engine:
``sglang:*`` names and labels (``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``)
for the SGLang flavor, ``vllm:*`` names (``vllm:cache_config_info`` with ``block_size``,
``num_gpu_blocks``, ``kv_cache_size_tokens``) for the vLLM flavor.

Each server gets a private registry built per scrape from its live state, so the sim never
touches kvproxy's own registry (``kvproxy/observe/metrics.py``) and never shares numbers with it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvproxy.sim.pool import PagedPool
from kvproxy.sim.state import EngineConfig, EngineStats


class EngineServer(Protocol):
    """What the exposition reads of one simulated engine (kvproxy.sim.engine's server)."""

    @property
    def config(self) -> EngineConfig: ...
    @property
    def pool(self) -> PagedPool: ...
    @property
    def rank_pool_tokens(self) -> int: ...
    @property
    def stats(self) -> EngineStats: ...
    @property
    def running(self) -> Sized: ...
    @property
    def queued(self) -> int: ...


class _EngineCollector(Collector):
    def __init__(self, server: EngineServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        if self._server.config.flavor == "vllm":
            yield from _vllm(self._server)
        else:
            yield from _sglang(self._server)


def _sglang(s: EngineServer) -> Iterator[Metric]:
    names = ["model_name", "engine_type", "tp_rank", "pp_rank"]
    values = [s.config.model_name, s.config.role, "0", "0"]
    pool = s.pool
    role = s.config.role

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"sglang:{name}", doc, labels=names)
        family.add_metric(values, value)
        return family

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"sglang:{name}", doc, labels=names)
        family.add_metric(values, value)
        return family

    # One rank's pool, as the scheduler reports it (DCP ranks each hold 1/dcp of a request).
    yield gauge(
        "max_total_num_tokens", "Maximum total number of tokens in the KV pool.", s.rank_pool_tokens
    )
    yield gauge("context_len", "The context length of the model.", s.config.context_length)
    yield gauge("page_size", "Tokens per KV page.", pool.page_size)
    yield gauge("num_pages", "Pages in the KV pool.", pool.num_pages)
    yield gauge("num_used_tokens", "Tokens held in the KV pool.", pool.used_tokens)
    yield gauge(
        "token_usage", "Fraction of the KV pool in use.", pool.used_tokens / pool.total_tokens
    )
    yield gauge("num_running_reqs", "Running requests.", len(s.running))
    yield gauge("num_queue_reqs", "Requests waiting for KV pages.", s.queued)
    inflight = getattr(s, "inflight_transfers", 0)
    waiting = getattr(s, "waiting_bootstrap", 0)
    if role == "prefill":
        yield gauge("num_prefill_bootstrap_queue_reqs", "Requests in bootstrap.", waiting)
        yield gauge("num_prefill_inflight_queue_reqs", "Requests transferring KV.", inflight)
    else:
        yield gauge("num_decode_prealloc_queue_reqs", "Requests waiting for pages.", s.queued)
        yield gauge("num_decode_transfer_queue_reqs", "Requests receiving KV.", inflight)
    st = s.stats
    yield counter(
        "num_bootstrap_failed_reqs", "Requests whose bootstrap failed.", st.bootstrap_failures
    )
    yield counter(
        "num_transfer_failed_reqs", "Requests whose KV transfer failed.", st.transfer_failures
    )
    yield counter("prompt_tokens", "Prompt tokens processed.", st.prompt_tokens)
    yield counter("generation_tokens", "Tokens generated.", st.generation_tokens)
    yield counter("num_requests", "Finished requests.", st.requests_finished)


def _vllm(s: EngineServer) -> Iterator[Metric]:
    pool = s.pool
    c = s.config
    labels = ["block_size", "cache_dtype", "enable_prefix_caching", "engine"]
    labels += ["gpu_memory_utilization"]
    if c.kv_cache_size_label:  # builds since PR #42206
        labels.append("kv_cache_size_tokens")
    labels += ["num_cpu_blocks", "num_gpu_blocks", "num_gpu_blocks_override"]
    info = GaugeMetricFamily(
        "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=labels
    )
    # The front end sums num_gpu_blocks over its DP engines (core_client
    # _apply_ready_response) and repeats the same cache config once per engine index
    # (metrics/loggers.py log_metrics_info): every series carries the deployment's sum.
    engine_pages = -(-s.rank_pool_tokens // pool.page_size)
    for engine in range(c.dp_size):
        values = [str(pool.page_size), "auto", "True", str(engine), "0.9"]
        if c.kv_cache_size_label:
            values.append(str(s.rank_pool_tokens))
        values += ["0", str(engine_pages * c.dp_size), "None"]
        info.add_metric(values, 1.0)
    yield info
    names = ["engine", "model_name"]
    values = ["0", s.config.model_name]

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"vllm:{name}", doc, labels=names)
        family.add_metric(values, value)
        return family

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"vllm:{name}", doc, labels=names)
        family.add_metric(values, value)
        return family

    yield gauge("num_requests_running", "Requests in model execution batches.", len(s.running))
    yield gauge("num_requests_waiting", "Requests waiting to be processed.", s.queued)
    yield gauge(
        "kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        pool.used_tokens / pool.total_tokens,
    )
    yield counter("prompt_tokens", "Number of prefill tokens processed.", s.stats.prompt_tokens)
    yield counter(
        "generation_tokens", "Number of generation tokens processed.", s.stats.generation_tokens
    )


def render_metrics(server: EngineServer) -> tuple[bytes, str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(server))
    return generate_latest(registry), CONTENT_TYPE_LATEST
