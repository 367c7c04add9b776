"""Engine capacity: probes that measure each engine's real KV pool, the one limit
computation, and the monitor that keeps the limits fresh (fail closed, I3).

The request path calls `CapacityMonitor.limits()` (cheap); the admin app serves
`CapacityMonitor.snapshot_json()` on `GET /capacity`; `kvproxy check` calls
`probe_engine` and `limits_for` (the monitor's own limit computation) directly.
"""

from kvproxy.capacity.discovery import Resolver, expand_engine, system_resolver
from kvproxy.capacity.limits import (
    SGLANG_RESERVED_TOKENS,
    EngineLimits,
    Limits,
    LimitSettings,
    derive_limits,
    held_context,
    limits_for,
    sglang_limits,
    static_limits,
    vllm_limits,
)
from kvproxy.capacity.measurement import (
    PROBE_ERROR_REASONS,
    WARNING_LABELS,
    EngineMeasurement,
    ProbeError,
)
from kvproxy.capacity.monitor import CapacityMonitor
from kvproxy.capacity.probes import measure_static, probe_engine
from kvproxy.capacity.sglang import measure_sglang
from kvproxy.capacity.vllm import measure_vllm

__all__ = [
    "PROBE_ERROR_REASONS",
    "SGLANG_RESERVED_TOKENS",
    "WARNING_LABELS",
    "CapacityMonitor",
    "EngineLimits",
    "EngineMeasurement",
    "LimitSettings",
    "Limits",
    "ProbeError",
    "Resolver",
    "derive_limits",
    "expand_engine",
    "held_context",
    "limits_for",
    "measure_sglang",
    "measure_static",
    "measure_vllm",
    "probe_engine",
    "sglang_limits",
    "static_limits",
    "system_resolver",
    "vllm_limits",
]
