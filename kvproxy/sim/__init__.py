"""PD-disaggregation engine simulator: the independent oracle of kvproxy's safety tests.

Prefill and decode servers speaking SGLang's (or vLLM's) HTTP API, a small PD router,
paged KV pools with page reuse, a KV transfer with real abort physics, an echo model that
makes a cross-request leak visible as text, and ground-truth counters at ``/sim/stats``.

This package must never import kvproxy code outside ``kvproxy/sim``: it re-derives the
engine's limits, tokenization and chat template on its own, so that a test comparing the
proxy against it compares two independent computations.
"""

from kvproxy.sim.launcher import SimCluster, SimOptions, add_arguments, run

__all__ = ["SimCluster", "SimOptions", "add_arguments", "run"]
