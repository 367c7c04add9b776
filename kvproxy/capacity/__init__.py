"""Engine capacity: probes that measure each engine's real KV pool, the one limit
computation, and the monitor that keeps the limits fresh (fail closed, I3).

The request path calls `CapacityMonitor.limits()` (cheap); the admin app serves its
`snapshot_json()` on `GET /capacity`; `kvproxy check` calls `probe_engine` and `limits_for`
(the monitor's own limit computation) directly.
"""

from kvproxy.capacity.discovery import expand_engine, system_resolver
from kvproxy.capacity.limits import Limits, held_context, limits_for
from kvproxy.capacity.measurement import EngineMeasurement, ProbeError
from kvproxy.capacity.monitor import CapacityMonitor
from kvproxy.capacity.probes import probe_engine

__all__ = [
    "CapacityMonitor",
    "EngineMeasurement",
    "Limits",
    "ProbeError",
    "expand_engine",
    "held_context",
    "limits_for",
    "probe_engine",
    "system_resolver",
]
