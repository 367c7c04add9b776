"""`probe_engine`: one engine, one bounded attempt, one measurement or one ProbeError.

Dispatches on `EngineSpec.kind` to the SGLang and vLLM probes, and builds the static
"measurement" from the configured `capacity_tokens` (always `source="declared"`).

Must never: take longer than `timeout_s` in total (fallback requests included), or let an
exception other than ProbeError escape for a transport or format failure.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from kvproxy.capacity.limits import static_limits
from kvproxy.capacity.measurement import EngineMeasurement, ProbeError
from kvproxy.capacity.reports import probe_error_from_exception
from kvproxy.capacity.sglang import probe_sglang
from kvproxy.capacity.vllm import probe_vllm
from kvproxy.config import EngineSpec
from kvproxy.policy import UpstreamFailure
from kvproxy.upstream import network_boundary


def measure_static(spec: EngineSpec, *, measured_at: float | None = None) -> EngineMeasurement:
    """The operator's declared number, as it is: no engine reported it."""
    if spec.capacity_tokens is None:  # EngineSpec validation makes this unreachable
        raise ProbeError("missing_field", "kind=static needs capacity_tokens")
    limits = static_limits(spec.capacity_tokens)
    source = "config.engines[].capacity_tokens"
    return EngineMeasurement(
        engine=spec.label,
        url=spec.url,
        role=spec.role,
        kind="static",
        input_limit_tokens=limits.input_limit_tokens,
        input_limit_source=source,
        pool_tokens=spec.capacity_tokens,
        pool_source=source,
        bound_by="declared",
        measured_at=time.time() if measured_at is None else measured_at,
        decode_limit_tokens=limits.decode_limit_tokens,
        decode_limit_source=source,
    )


async def probe_engine(
    session: aiohttp.ClientSession, spec: EngineSpec, timeout_s: float
) -> EngineMeasurement:
    """Measure one engine within `timeout_s` seconds; raise ProbeError on any failure."""
    if spec.kind == "static":
        return measure_static(spec)
    try:
        # The overall deadline's TimeoutError leaves through the seam like any other
        # network failure; each fetch inside maps its own failures to ProbeErrors already.
        with network_boundary():
            async with asyncio.timeout(timeout_s):
                if spec.kind == "sglang":
                    return await probe_sglang(session, spec, timeout_s)
                return await probe_vllm(session, spec, timeout_s)
    except UpstreamFailure as failure:
        if failure.kind == "timeout":
            raise ProbeError(
                "timeout", f"{spec.label} did not answer within {timeout_s:g} s"
            ) from None
        raise probe_error_from_exception(failure, spec.url) from None
