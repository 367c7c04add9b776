"""One release gate for every config shape (kvproxy.tools.check.gate.run_gate): the
single-upstream form and a one-cluster `upstreams` form are measured, judged and passed by
the same steps on the same engines; only the record's layout follows the form (flat, or a
section per named cluster). Ground truth: the simulator's own pool and limit.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvproxy.config import load_settings
from kvproxy.sim.launcher import SimCluster, SimOptions
from kvproxy.tools.check.cli import add_arguments, gate_models


def engines_of(sim: SimCluster) -> list[dict[str, Any]]:
    return [
        {"url": sim.prefill_url, "role": "prefill", "kind": "sglang"},
        {"url": sim.decode_url, "role": "decode", "kind": "sglang"},
    ]


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


async def test_a_single_upstream_and_one_named_cluster_are_gated_alike() -> None:
    # Pool 2,048 under a declared context of 8,192: the incident's misconfiguration, so
    # both forms must fail on the same check and name the same safe value (2,041).
    opts = SimOptions(
        port=0, prefill_port=0, decode_port=0, engine_version="0.5.23", prefill_pool_tokens=2048
    )
    async with SimCluster(opts) as sim:
        single = load_settings(upstream=sim.router_url, engines=engines_of(sim), max_context=8192)
        named = load_settings(
            upstreams=[{"name": "default", "url": sim.router_url, "engines": engines_of(sim)}],
            max_context=8192,
        )
        [(_, flat)] = await gate_models(parse(), single, lambda _: None)
        [(_, sectioned)] = await gate_models(parse(), named, lambda _: None)
    truth_limit = 2041  # the simulator's largest prompt: pool 2,048 less its reserve
    assert flat.clusters is None
    assert sectioned.clusters is not None
    section = sectioned.clusters["default"]
    # The same measurement and the same limits the proxy would enforce.
    assert flat.limits == section["limits"]
    assert flat.limits["admission_limit_tokens"] == truth_limit
    assert flat.safe_max_context_tokens == sectioned.safe_max_context_tokens == truth_limit
    # Measured twice, so at two times; the rest of each row is the same.
    assert [{**e, "cluster": "default", "measured_at": 0} for e in flat.engines] == [
        {**e, "measured_at": 0} for e in sectioned.engines
    ]
    # The same checks with the same verdicts; the named cluster's carry its name.
    assert [(f"cluster default: {c.name}", c.passed, c.detail) for c in flat.checks] == [
        (c.name, c.passed, c.detail) for c in sectioned.checks
    ]
    assert not flat.passed
    assert not sectioned.passed
    assert flat.failed_checks == ["declared context fits every engine"]
    assert sectioned.failed_checks == ["cluster default: declared context fits every engine"]
