"""Which in-flight budget a server gets: the local one, or the cluster one on Redis.

Kept apart from both budgets so that the local path never imports the Redis client (the
core install has no redis package unless the operator asked for the redis backend).
"""

from __future__ import annotations

from typing import TypedDict

from kvproxy.budget.local import Budget, InflightBudget
from kvproxy.config import IMPLICIT_MODEL, ConfigError, Settings
from kvproxy.observe import Metrics, redact


class _Sizing(TypedDict):
    """What both budgets are sized by (each constructor takes these keywords)."""

    max_tokens: int | None
    max_requests: int | None
    queue_timeout_s: float
    queue_max_waiters: int
    metrics: Metrics
    model: str


def build_budget(s: Settings, metrics: Metrics, model: str = IMPLICIT_MODEL) -> Budget:
    # Exported (0) for the local backend too, as before the gauge had a `model` label: the
    # dashboard's panel reads it whichever backend runs.
    metrics.budget_cluster_tokens.labels(model)
    # The same budget whichever backend holds it.
    sizing: _Sizing = {
        "max_tokens": s.max_inflight_prompt_tokens,
        "max_requests": s.max_inflight_requests,
        "queue_timeout_s": s.queue_timeout_s,
        "queue_max_waiters": s.queue_max_waiters,
        "metrics": metrics,
        "model": model,
    }
    if s.budget_backend == "local":
        return InflightBudget(**sizing)
    try:
        from kvproxy.budget.cluster import RedisBudget
        from kvproxy.budget.connection import RedisOptions, default_replica_id
    except ImportError as exc:  # the redis extra is not installed
        raise ConfigError(
            f"budget_backend redis needs the redis extra: pip install 'kvproxy[redis]' ({exc})"
        ) from None
    assert s.redis_url is not None  # Settings refuses redis without a URL
    try:
        return RedisBudget(
            **sizing,
            options=RedisOptions(
                url=s.redis_url.get_secret_value(),
                password=s.redis_password_value(),
                ssl_ca_file=None if s.redis_tls_ca_file is None else str(s.redis_tls_ca_file),
                key_prefix=s.redis_key_prefix,
                # One budget per engine pool; unset, the model's own (kvproxy.config.models).
                pool=s.budget_pool or model,
                lease_ttl_s=s.redis_lease_ttl_s,
                timeout_s=s.redis_timeout_s,
                unavailable=s.redis_unavailable,
                expected_replicas=s.budget_expected_replicas,
                replica_id=default_replica_id(),
            ),
        )
    except ValueError as exc:  # a URL option the budget's client cannot honour
        raise ConfigError(
            redact(f"invalid setting redis_url ({s.where('redis_url')}): {exc}")
        ) from None
