"""Probe of one SGLang engine (prefill, decode or unified server).

Reads `/server_info` (falling back to the older `/get_server_info`), and, when they
answer, `/metrics` and `/v1/models` as cross-checks. Every report of the pool, the context
and `max_req_input_len` is collected with its field name; the smallest wins:

- pool: top-level `max_total_num_tokens`, each DP rank's
  `internal_states[i].memory_usage.token_capacity` (or its own `max_total_num_tokens`),
  the `sglang:max_total_num_tokens` gauge (every rank series), and a smaller sliding-window
  pool `swa_max_total_num_tokens` when reported;
- context: `context_length` (the CLI value, often null), `/v1/models` `max_model_len`,
  the `sglang:context_len` gauge;
- `max_req_input_len` (top level and per rank);
- the speculative settings and the DCP size (`sglang_args`), which move the limits.

What the probe reads but current engines do not send: `swa_max_total_num_tokens` lives in
the model runner and is not part of `/server_info`; the top-level scheduler facts
(`max_req_input_len`, `max_total_num_tokens`) are DP rank 0's; per-rank `internal_states`
carry `memory_usage.token_capacity` but no per-rank input limit. Every field looked for is
listed in the measurement as present or absent, so `/capacity` shows which checks ran.

The arithmetic itself lives in `limits.sglang_limits`.

Must never: derive a limit from a pool without a context (or the engine's own
`max_req_input_len`), or fail because an optional cross-check endpoint is missing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from kvproxy.capacity.limits import SGLANG_RESERVED_TOKENS, EngineLimits, sglang_limits
from kvproxy.capacity.measurement import EngineMeasurement, Findings, ProbeError
from kvproxy.capacity.reports import (
    HttpStatusError,
    Reports,
    Sample,
    fetch_json,
    fetch_text,
    object_list,
    parse_prometheus,
    token_field,
)
from kvproxy.capacity.sglang_args import ServerArgs, read_server_args
from kvproxy.config import EngineSpec
from kvproxy.posture import FAILURE_COUNTERS, read_posture

GAUGE_POOL = "sglang:max_total_num_tokens"
GAUGE_CONTEXT = "sglang:context_len"
GAUGE_PAGE = "sglang:page_size"

# The numbers a measurement collects, each reported by several fields (smallest wins).
Number = Literal["pool", "swa", "context", "mril", "page"]
NUMBERS: dict[Number, str] = {
    "pool": "KV pool",
    "swa": "sliding-window pool",
    "context": "context length",
    "mril": "max_req_input_len",
    "page": "page size",
}

# Where each number is read from, in the order the reports are added (a tie keeps the
# first: the most specific field). A dotted key is a field of an object field.
# /server_info's top level:
SERVER_INFO_SOURCES: tuple[tuple[str, Number], ...] = (
    ("max_total_num_tokens", "pool"),
    ("swa_max_total_num_tokens", "swa"),
    ("context_length", "context"),
    ("max_req_input_len", "mril"),
    ("page_size", "page"),
)
# Each DP rank's `internal_states[i]`; a rank's pool is the smaller of its two pool fields.
RANK_SOURCES: tuple[tuple[str, Number], ...] = (
    ("memory_usage.token_capacity", "pool"),
    ("max_total_num_tokens", "pool"),
    ("swa_max_total_num_tokens", "swa"),
    ("max_req_input_len", "mril"),
)
# The /metrics gauges, every rank series of each.
METRICS_SOURCES: tuple[tuple[str, Number], ...] = (
    (GAUGE_POOL, "pool"),
    (GAUGE_CONTEXT, "context"),
    (GAUGE_PAGE, "page"),
)
# /v1/models `data[i].max_model_len` reports the context too (`_models_context`).

# The fields listed present or absent in the measurement, beyond the server arguments'.
SERVER_INFO_LISTED = (*(key for key, _ in SERVER_INFO_SOURCES), "internal_states")
RANK_LISTED = ("memory_usage", "max_req_input_len")

# disaggregation_mode as SGLang reports it -> our role name.
_MODE_ROLE = {"prefill": "prefill", "decode": "decode", "null": "unified"}


def _read(obj: Mapping[str, Any], key: str, where: str) -> int | None:
    """The token count at `key` (dotted: through object fields); None when not reported."""
    head, _, rest = key.partition(".")
    if not rest:
        return token_field(obj, key, f"{where}.{key}")
    inner = obj.get(head)
    if inner is None:
        return None
    if not isinstance(inner, dict):
        raise ProbeError("bad_type", f"{where}.{head} is {type(inner).__name__}")
    return _read(inner, rest, f"{where}.{head}")


def _gauge_reports(metrics_text: str | None, reports: Mapping[Number, Reports]) -> list[str]:
    """Add every series of the gauges to `reports`; return notes on bad series."""
    if metrics_text is None:
        return []
    notes: list[str] = []
    try:
        samples = parse_prometheus(metrics_text, [name for name, _ in METRICS_SOURCES])
    except ProbeError as exc:
        return [f"/metrics ignored: {exc.message}"]
    for name, number in METRICS_SOURCES:
        for labels, value in samples[name]:
            if value != value or value < 1 or value != int(value):
                notes.append(f"/metrics {name} = {value!r} ignored")
                continue
            rank = ",".join(f"{k}={labels[k]}" for k in ("dp_rank", "tp_rank") if k in labels)
            src = f"metrics.{name}" + (f"{{{rank}}}" if rank else "")
            reports[number].add(int(value), src)
    return notes


def _models_context(models: Mapping[str, Any] | None, reports: Reports) -> list[str]:
    if models is None:
        return []
    try:
        for i, entry in enumerate(object_list(models, "data", "/v1/models data")):
            reports.add(
                token_field(entry, "max_model_len", f"/v1/models data[{i}].max_model_len"),
                f"v1_models.data[{i}].max_model_len",
            )
    except ProbeError as exc:
        # A cross-check that is malformed is left out, never trusted in part.
        return [f"/v1/models ignored: {exc.message}"]
    return []


@dataclass
class _Collected:
    """Every report of every number, with the server arguments and each DP rank's pool."""

    args: ServerArgs
    reports: dict[Number, Reports]
    rank_pools: list[int]


def _collect_ranks(
    server_info: Mapping[str, Any], p: str, args: ServerArgs, reports: dict[Number, Reports]
) -> list[int]:
    rank_pools: list[int] = []
    for i, rank in enumerate(object_list(server_info, "internal_states", f"{p}.internal_states")):
        where = f"{p}.internal_states[{i}]"
        pools: list[int] = []
        for key, number in RANK_SOURCES:
            value = _read(rank, key, where)
            reports[number].add(value, f"{where}.{key}")
            if number == "pool" and value is not None:
                pools.append(value)
        if pools:
            rank_pools.append(min(pools))
        for key in RANK_LISTED:
            args.saw(rank, key, f"{where}.{key}")
    return rank_pools


def _collect(
    server_info: Mapping[str, Any],
    p: str,
    metrics_text: str | None,
    models: Mapping[str, Any] | None,
    found: Findings,
) -> _Collected:
    """Read every source of `SERVER_INFO_SOURCES`, `RANK_SOURCES`, `METRICS_SOURCES` and
    /v1/models; a malformed /server_info field is a ProbeError, a malformed cross-check a
    note."""
    args = read_server_args(server_info, p)
    for key in SERVER_INFO_LISTED:
        args.saw(server_info, key, f"{p}.{key}")
    reports = {number: Reports(what) for number, what in NUMBERS.items()}
    for key, number in SERVER_INFO_SOURCES:
        reports[number].add(_read(server_info, key, p), f"{p}.{key}")
    rank_pools = _collect_ranks(server_info, p, args, reports)
    if len(rank_pools) > 1 and not any(
        isinstance(r.get("max_req_input_len"), int)
        for r in object_list(server_info, "internal_states", p)
    ):
        found.note(
            f"{p}.max_req_input_len is DP rank 0's and no rank reports its own: the other "
            "ranks' input limits follow from their token_capacity by the engine's formula"
        )
    (args.present if metrics_text is not None else args.absent).append("/metrics")
    (args.present if models is not None else args.absent).append("/v1/models")
    found.notes.extend(_gauge_reports(metrics_text, reports))
    found.notes.extend(_models_context(models, reports["context"]))
    return _Collected(args, reports, rank_pools)


@dataclass(frozen=True)
class _Chosen:
    """The number each measurement field takes (the smallest report), with its source."""

    pool_tokens: int
    pool_source: str
    page_size: int | None
    page_source: str | None
    context_tokens: int | None
    context_source: str | None
    mril: int | None
    mril_source: str | None


def _choose(c: _Collected, p: str, found: Findings) -> _Chosen:
    """The smallest report of each number; ProbeError when the pool or every context is
    missing; warnings where reports disagree or the sliding-window pool binds."""
    pool, context, mril, page = (c.reports[n] for n in ("pool", "context", "mril", "page"))
    if not pool:
        raise ProbeError(
            "missing_field",
            f"no KV pool size: {p} has no max_total_num_tokens or "
            "internal_states[].memory_usage.token_capacity, and /metrics has no "
            f"{GAUGE_POOL}",
        )
    ranks_differ = len(set(c.rank_pools)) > 1
    if ranks_differ:
        found.warn("dp_ranks_differ", f"DP ranks report pools {c.rank_pools}; the smallest binds")
    # Differing DP ranks already explain a pool disagreement; do not warn twice.
    for reports in (context, mril) if ranks_differ else (pool, context, mril):
        msg = reports.disagreement()
        if msg is not None:
            found.warn("fields_disagree", msg)

    pool_tokens, pool_source = pool.smallest()
    if c.reports["swa"]:
        swa_tokens, swa_source = c.reports["swa"].smallest()
        if swa_tokens < pool_tokens:
            # Conservative: a long prompt also needs sliding-window slots while it is
            # prefilled, and SGLang does not report how many it frees per chunk.
            found.warn(
                "swa_pool_binds", f"sliding-window pool {swa_tokens:,} < full pool {pool_tokens:,}"
            )
            pool_tokens, pool_source = swa_tokens, swa_source
    # No rounding to whole pages here: SGLang rounds max_total_num_tokens down to a page
    # multiple itself before it reports it and derives max_req_input_len from that number,
    # so the reported pool is already what its allocator holds.
    page_size, page_source = page.smallest() if page else (None, None)
    context_tokens, context_source = context.smallest() if context else (None, None)
    mril_value, mril_source = mril.smallest() if mril else (None, None)
    if context_tokens is None and mril_value is None:
        raise ProbeError(
            "missing_field",
            f"no context length: {p}.context_length is null, max_req_input_len is absent, "
            f"and neither /v1/models max_model_len nor {GAUGE_CONTEXT} answered",
        )
    if mril_value is not None and mril_value <= 1:
        raise ProbeError("bad_value", f"{mril_source} = {mril_value} admits no prompt")
    return _Chosen(
        pool_tokens, pool_source, page_size, page_source,
        context_tokens, context_source, mril_value, mril_source,
    )  # fmt: skip


def _limits(n: _Chosen, args: ServerArgs, found: Findings) -> tuple[EngineLimits, str]:
    """The engine's limits (`limits.sglang_limits`) and the source of its input limit."""
    limits = sglang_limits(
        pool_tokens=n.pool_tokens,
        context_tokens=n.context_tokens,
        max_req_input_len=n.mril,
        reserved_tokens=args.reserved_tokens,
        dcp_size=args.dcp_size,
        page_size=n.page_size,
    )
    if args.dcp_size > 1 and not limits.dcp_scaled:
        found.note(
            f"{args.dcp_source} = {args.dcp_size}, but the engine's max_req_input_len does not "
            "show a pool scaled by it (builds before SGLang PR #33448, or not reported): "
            "the per-rank pool is used"
        )
    if limits.input_limit_tokens < 1:
        raise ProbeError(
            "bad_value",
            f"pool {n.pool_tokens:,} / context {n.context_tokens} leave no room for a prompt "
            f"(SGLang reserves {SGLANG_RESERVED_TOKENS}, plus {args.reserved_tokens} for "
            "speculative decoding)",
        )
    if limits.from_reported:
        input_source = str(n.mril_source)
    elif (
        args.reserved_tokens
        and limits.request_limit_tokens is not None
        and limits.input_limit_tokens == limits.request_limit_tokens
    ):
        where = n.context_source or f"{n.mril_source} + 6 (the smallest context it allows)"
        input_source = f"{where} - 1 - {args.reserve_source}"
    elif limits.bound_by == "pool":
        input_source = n.pool_source + (f" x {args.dcp_source}" if limits.dcp_scaled else "")
    else:
        input_source = str(n.context_source)
    if args.reserved_tokens:
        found.note(f"speculative decoding: {args.reserve_source} tokens of the context")
    return limits, input_source


def _engine_warnings(
    spec: EngineSpec,
    server_info: Mapping[str, Any],
    n: _Chosen,
    limits: EngineLimits,
    found: Findings,
) -> None:
    if n.context_tokens is not None and n.context_tokens > n.pool_tokens:
        found.warn(
            "context_exceeds_pool",
            f"context length {n.context_tokens:,} exceeds the KV pool {n.pool_tokens:,}: "
            f"prompts above {limits.input_limit_tokens:,} tokens do not fit",
        )
    if server_info.get("allow_auto_truncate") is True:
        found.warn("allow_auto_truncate", "the engine silently cuts prompts that are too long")
    mode = server_info.get("disaggregation_mode")
    if isinstance(mode, str) and _MODE_ROLE.get(mode, spec.role) != spec.role:
        found.note(f"configured role {spec.role} but the engine reports mode {mode!r}")


def measure_sglang(
    spec: EngineSpec,
    server_info: Mapping[str, Any],
    *,
    info_path: str = "server_info",
    metrics_text: str | None = None,
    models: Mapping[str, Any] | None = None,
    measured_at: float | None = None,
    notes: list[str] | None = None,
) -> EngineMeasurement:
    """Pure: recorded responses in, one measurement out (or ProbeError)."""
    found = Findings(notes=list(notes or []))
    collected = _collect(server_info, info_path, metrics_text, models, found)
    n = _choose(collected, info_path, found)
    limits, input_source = _limits(n, collected.args, found)
    _engine_warnings(spec, server_info, n, limits, found)
    return EngineMeasurement(
        engine=spec.label,
        url=spec.url,
        role=spec.role,
        kind="sglang",
        input_limit_tokens=limits.input_limit_tokens,
        input_limit_source=input_source,
        pool_tokens=n.pool_tokens,
        pool_source=n.pool_source,
        bound_by=limits.bound_by,
        measured_at=time.time() if measured_at is None else measured_at,
        page_size=n.page_size,
        page_size_source=n.page_source,
        context_length=n.context_tokens,
        context_source=n.context_source,
        decode_limit_tokens=limits.decode_limit_tokens,
        decode_limit_source=(
            "largest prompt + output served uncut: min(max_req_len - 1, "
            f"pool{' x dcp' if limits.dcp_scaled else ''} - 2 x page_size, "
            "context - reserve - 1) (scheduler init_req_max_new_tokens, tokenizer_manager)"
        ),
        request_limit_tokens=limits.request_limit_tokens,
        warnings=tuple(found.warnings),
        notes=tuple(found.notes),
        fields_present=tuple(collected.args.present),
        fields_absent=tuple(collected.args.absent),
        posture=read_posture(server_info, failure_counters(metrics_text)),
        version=v if isinstance(v := server_info.get("version"), str) else None,
    )


def failure_counters(metrics_text: str | None) -> dict[str, list[Sample]] | None:
    """The engine failure counters posture reads, from one /metrics exposition."""
    if metrics_text is None:
        return None
    try:
        return parse_prometheus(metrics_text, FAILURE_COUNTERS.values())
    except ProbeError:  # a malformed counter line: "not exported", not a failed probe
        return {}


async def _server_info(
    session: aiohttp.ClientSession, base: str, timeout_s: float
) -> tuple[str, dict[str, Any]]:
    try:
        return "server_info", await fetch_json(session, f"{base}/server_info", timeout_s)
    except HttpStatusError as exc:
        # Builds before /server_info only answer the deprecated name.
        if exc.status not in (404, 405):
            raise
    return "get_server_info", await fetch_json(session, f"{base}/get_server_info", timeout_s)


async def _optional(coro: Any, what: str, notes: list[str]) -> Any:
    try:
        return await coro
    except ProbeError as exc:
        notes.append(f"{what} unavailable ({exc})")
        return None


async def probe_sglang(
    session: aiohttp.ClientSession, spec: EngineSpec, timeout_s: float
) -> EngineMeasurement:
    base = spec.url.rstrip("/")
    notes: list[str] = []
    # The cross-checks run alongside /server_info and never fail the probe; they get
    # half the budget so that a hanging /metrics cannot time the whole probe out.
    optional_s = timeout_s / 2
    metrics = asyncio.ensure_future(
        _optional(fetch_text(session, f"{base}/metrics", optional_s), "/metrics", notes)
    )
    models = asyncio.ensure_future(
        _optional(fetch_json(session, f"{base}/v1/models", optional_s), "/v1/models", notes)
    )
    try:
        path, info = await _server_info(session, base, timeout_s)
        metrics_text, models_json = await asyncio.gather(metrics, models)
    finally:
        for task in (metrics, models):
            if not task.done():
                task.cancel()
        await asyncio.gather(metrics, models, return_exceptions=True)
    return measure_sglang(
        spec, info, info_path=path, metrics_text=metrics_text, models=models_json, notes=notes
    )
