"""The capacity monitor: a background task that measures every engine and keeps the
current `Limits` for the request path.

Owns the per-engine state (last measurement, its age, last error), discovery of engines
behind headless Services, the capacity metrics, and the log lines operators act on: the
declared context exceeding the measured limit, every change of an engine's pool or
limit (old and new values), `allow_auto_truncate`, capacity becoming unknown.

Fail closed (I3): an engine with no measurement younger than `capacity_stale_s` is
unknown, and any unknown engine makes `limits().known` false unless an explicit fallback
is configured. One refresh probes all engines concurrently, each bounded by
`capacity_probe_timeout_s`; a slow or broken engine never delays the others, and the
request path only ever reads a precomputed `Limits` (`limits()` is O(1) between the
moments a measurement can go stale).

Must never: block a request on a probe, admit on a stale measurement, or raise out of
the refresh loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvproxy.capacity.discovery import Resolver, expand_engine, system_resolver
from kvproxy.capacity.limits import Limits, limits_for
from kvproxy.capacity.measurement import EngineMeasurement, ProbeError, Role
from kvproxy.capacity.posture import PostureTracker
from kvproxy.capacity.probes import probe_engine
from kvproxy.capacity.router import Detection, detect_router
from kvproxy.config import IMPLICIT_CLUSTER, IMPLICIT_MODEL, EngineSpec, Settings
from kvproxy.observe import Metrics
from kvproxy.tokens import Verifier

log = logging.getLogger("kvproxy.capacity")

# Refresh period is jittered by +-10% so that many proxies in front of the same engines
# do not poll them in lock-step.
JITTER = 0.1
# A detected router is asked again after this long (a router is replaced rarely; an
# undetected one is asked at every refresh).
ROUTER_RECHECK_S = 300.0


@dataclass
class _EngineState:
    spec: EngineSpec
    configured: EngineSpec
    measurement: EngineMeasurement | None = None
    success_mono: float | None = None
    last_error: ProbeError | None = None
    last_error_at: float | None = None
    consecutive_errors: int = 0
    error_reasons: set[str] = field(default_factory=set)

    @property
    def label(self) -> str:
        return self.spec.label

    def fresh(self, now: float, stale_s: float) -> bool:
        return self.success_mono is not None and now - self.success_mono <= stale_s


class CapacityMonitor:
    """Measures every configured engine in the background; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        session: aiohttp.ClientSession | None = None,
        *,
        resolver: Resolver | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        model: str = IMPLICIT_MODEL,
        verifier: Verifier | None = None,
        upstream: str = IMPLICIT_CLUSTER,
        publish_model: bool = True,
    ) -> None:
        self._settings = settings
        # Fed each refresh's engine versions and the detected router (kvproxy.tokens.gate.verified).
        self.verifier = verifier
        self._router_checked_mono: float | None = None
        # The `model` label of the limit gauges (kvproxy.serve.models: one monitor per model's
        # cluster), and the cluster's name (`upstream`). A model of several clusters publishes
        # its own model-wide limit gauges (the largest any cluster offers): `publish_model`
        # False leaves them to it.
        self._model = model
        self._upstream = upstream
        self._publish_model = publish_model
        self._pool_tokens: int | None = None
        self._metrics = metrics
        self._session = session
        self._own_session = False
        self._resolver = resolver or system_resolver
        self._clock = clock
        self._wall = wall_clock
        self._rng = random.Random()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        # Last successful expansion of each configured engine (index-aligned).
        self._groups: list[tuple[EngineSpec, ...]] = [(s,) for s in settings.engines]
        self._discovery_errors: dict[int, str] = {}  # last failure per configured engine
        self._engines: dict[str, _EngineState] = {}
        for spec in settings.engines:
            self._engines[spec.label] = _EngineState(spec, spec)
        self._limits: Limits = self._derive(self._clock())
        # Nothing is measured yet, so nothing can age out before the first refresh.
        self._valid_until = math.inf
        self._logged_warnings: set[str] = set()
        self._refreshes = 0
        self._last_refresh_at: float | None = None
        self._next_refresh_mono: float | None = None
        metrics.declared_context.labels(model).set(settings.max_context or 0)
        self.posture = PostureTracker(settings, metrics)
        self._publish(self._limits)

    # --- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start the refresh loop; the first refresh runs in the background."""
        if self._task is not None:
            return
        if self._session is None:
            # Its own pool: probes never queue behind proxied requests, nor they behind us.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64), trust_env=False
            )
            self._own_session = True
        self._task = asyncio.create_task(self._run(), name="kvproxy-capacity-monitor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None
            self._own_session = False

    async def _run(self) -> None:
        while True:
            self._next_refresh_mono = self._clock()
            try:
                await self.refresh_now()
            except Exception:  # a bug here must not stop measuring: log and go on
                log.exception("capacity: refresh failed unexpectedly")
            refresh_s = self._settings.capacity_refresh_s
            delay = refresh_s * self._rng.uniform(1 - JITTER, 1 + JITTER)
            self._next_refresh_mono = self._clock() + delay
            await asyncio.sleep(delay)

    # --- the request path (cheap, synchronous) ----------------------------------------

    def limits(self) -> Limits:
        now = self._clock()
        if now > self._valid_until:
            self._recompute(now)
        return self._limits

    def ready(self) -> bool:
        return self.limits().known

    def pool_tokens(self) -> int | None:
        """The prompt tokens the admitting engines (prefill, unified) hold at once: the sum of
        their fresh pools, None while none is fresh. Routing weighs in-flight load by it."""
        self.limits()  # recomputes when a measurement aged out
        return self._pool_tokens

    def retry_after_s(self) -> int:
        """Seconds until a fresh measurement can reasonably exist (for Retry-After)."""
        s = self._settings
        ceiling = math.ceil(s.capacity_refresh_s * (1 + JITTER) + s.capacity_probe_timeout_s)
        if self._next_refresh_mono is None:
            return max(1, math.ceil(s.capacity_probe_timeout_s))
        remaining = self._next_refresh_mono - self._clock() + s.capacity_probe_timeout_s
        return max(1, min(ceiling, math.ceil(remaining)))

    # --- refreshing -------------------------------------------------------------------

    async def refresh_now(self) -> Limits:
        """One full round: re-resolve, probe every engine concurrently, recompute."""
        async with self._lock:
            if self._session is None:
                raise RuntimeError("CapacityMonitor.refresh_now() needs start() or a session")
            await self._discover()
            states = list(self._engines.values())
            await asyncio.gather(*(self._probe(st) for st in states))
            # After the probes: the versions they found decide whether the router matters.
            self._observe(None)
            self._observe(await self._detect_router())
            self._refreshes += 1
            self.posture.update(
                (st.label, st.spec.role, st.spec.kind,
                 st.measurement.posture if st.measurement is not None else None)
                for st in self._engines.values()
            )  # fmt: skip
            self._last_refresh_at = self._wall()
            self._recompute(self._clock())
            return self._limits

    async def _detect_router(self) -> Detection | None:
        """Under router_kind auto: ask the upstream what it is, when due and when the answer
        could change what is verified (`Verifier.router_matters`). A configured kind is
        checked once, and only logged when the upstream looks like something else."""
        if self.verifier is None or self._session is None or not self.verifier.router_matters():
            return None
        now = self._clock()
        auto = self._settings.router_kind == "auto"
        last = self._router_checked_mono
        if last is not None and (not auto or (
            self.verifier.router is not None and now - last < ROUTER_RECHECK_S
        )):  # fmt: skip
            return None
        self._router_checked_mono = now
        try:
            detection = await detect_router(
                self._session, self._settings.upstream, self._settings.capacity_probe_timeout_s
            )
        except Exception:  # a detection bug must not stop measuring: undetected
            log.exception("capacity: router detection crashed")
            return None
        kind, why = detection
        if not auto and kind is not None and kind != self._settings.router_kind:
            log.warning(
                "router_kind is %s but the upstream looks like %s (%s): the verified features "
                "follow the setting", self._settings.router_kind, kind, why,
            )  # fmt: skip
        return detection

    def _observe(self, detection: Detection | None) -> None:
        verifier = self.verifier
        if verifier is None:
            return
        engines = [
            (st.spec.kind, st.measurement.version if st.measurement is not None else None)
            for st in self._engines.values()
        ]
        if verifier.observe(engines, detection):
            log.info(
                "verification: the exact count may admit %d request features on %s (%s)",
                len(verifier.verified()), verifier.describe(), verifier.router_evidence,
            )  # fmt: skip

    async def _discover(self) -> None:
        timeout_s = self._settings.capacity_probe_timeout_s
        specs = self._settings.engines
        results = await asyncio.gather(
            *(expand_engine(spec, self._resolver, timeout_s) for spec in specs),
            return_exceptions=True,
        )
        for i, (spec, result) in enumerate(zip(specs, results, strict=True)):
            if isinstance(result, ProbeError):
                # Keep the last good expansion: a DNS hiccup is not a scale-down. When
                # there is none, the configured URL is probed and fails on its own.
                if self._groups[i] != (spec,):
                    self._count_error(spec.label, result)
                if self._discovery_errors.get(i) != str(result):
                    log.warning("capacity: discovery of %s failed: %s", spec.label, result)
                self._discovery_errors[i] = str(result)
                continue
            if isinstance(result, BaseException):
                log.error("capacity: discovery of %s crashed: %r", spec.label, result)
                continue
            self._groups[i] = result
            self._discovery_errors.pop(i, None)
        wanted: dict[str, tuple[EngineSpec, EngineSpec]] = {}
        for spec, group in zip(specs, self._groups, strict=True):
            for member in group:
                wanted.setdefault(member.label, (member, spec))
        for label in [lb for lb in self._engines if lb not in wanted]:
            self._forget(self._engines.pop(label))
        for label, (member, spec) in wanted.items():
            if label not in self._engines:
                log.info(
                    "capacity: engine %s (%s) discovered behind %s", label, member.url, spec.label
                )
                self._engines[label] = _EngineState(member, spec)

    async def _probe(self, st: _EngineState) -> None:
        assert self._session is not None
        timeout_s = self._settings.capacity_probe_timeout_s
        try:
            m = await probe_engine(self._session, st.spec, timeout_s)
        except ProbeError as exc:
            self._record_error(st, exc)
            return
        except Exception as exc:  # a probe bug is a failed probe, not a dead monitor
            log.exception("capacity: probe of %s crashed", st.label)
            self._record_error(st, ProbeError("protocol", f"probe crashed: {type(exc).__name__}"))
            return
        self._record_success(st, m)

    def _record_error(self, st: _EngineState, exc: ProbeError) -> None:
        changed = st.last_error is None or str(st.last_error) != str(exc)
        st.last_error, st.last_error_at = exc, self._wall()
        st.consecutive_errors += 1
        st.error_reasons.add(exc.reason)
        self._count_error(st.label, exc)
        # Log the first failure and every change of cause; repeats go to debug.
        level = logging.WARNING if changed or st.consecutive_errors == 1 else logging.DEBUG
        log.log(level, "capacity: probe of %s (%s) failed (%d in a row): %s",
                st.label, st.spec.url, st.consecutive_errors, exc)  # fmt: skip

    def _count_error(self, label: str, exc: ProbeError) -> None:
        self._metrics.capacity_probe_errors.labels(label, exc.reason).inc()

    def _record_success(self, st: _EngineState, m: EngineMeasurement) -> None:
        old = st.measurement
        if st.consecutive_errors:
            log.info(
                "capacity: %s answers again after %d failed probes", st.label, st.consecutive_errors
            )
        if old is None:
            log.info(
                "capacity: %s (%s %s) input limit %s tokens [%s], pool %s [%s], "
                "context %s, page %s",
                m.engine, m.role, m.kind, f"{m.input_limit_tokens:,}", m.input_limit_source,
                f"{m.pool_tokens:,}", m.pool_source, m.context_length, m.page_size,
            )  # fmt: skip
        elif (old.pool_tokens, old.input_limit_tokens, old.decode_limit_tokens) != (
            m.pool_tokens, m.input_limit_tokens, m.decode_limit_tokens
        ):  # fmt: skip
            log.warning(
                "capacity: %s changed: pool %s -> %s tokens, input limit %s -> %s, "
                "decode limit %s -> %s [%s]",
                m.engine, f"{old.pool_tokens:,}", f"{m.pool_tokens:,}",
                f"{old.input_limit_tokens:,}", f"{m.input_limit_tokens:,}",
                old.decode_limit_tokens, m.decode_limit_tokens, m.input_limit_source,
            )  # fmt: skip
        old_warnings = set(old.warnings) if old is not None else set()
        for label in m.warnings:
            if label not in old_warnings:
                log.warning("capacity: %s: %s (%s)", m.engine, label, m.warning_note(label))
        st.measurement, st.success_mono = m, self._clock()
        st.last_error, st.consecutive_errors = None, 0
        mx = self._metrics
        model = self._model
        mx.pool_capacity.labels(m.engine, m.role, m.source, model).set(m.pool_tokens)
        mx.engine_input_limit.labels(m.engine, m.role, m.source, model).set(m.input_limit_tokens)
        mx.capacity_last_success.labels(m.engine).set(m.measured_at)
        self.posture.observe_failures(m.engine, m.posture)

    def _forget(self, st: _EngineState) -> None:
        """An engine left discovery: drop its series so dashboards do not show ghosts."""
        log.info("capacity: engine %s (%s) is gone from discovery", st.label, st.spec.url)
        mx = self._metrics
        with contextlib.suppress(KeyError):
            mx.capacity_last_success.remove(st.label)
        if st.measurement is not None:
            m = st.measurement
            for gauge in (mx.pool_capacity, mx.engine_input_limit):
                with contextlib.suppress(KeyError):
                    gauge.remove(m.engine, m.role, m.source, self._model)
        for reason in st.error_reasons:
            with contextlib.suppress(KeyError):
                mx.capacity_probe_errors.remove(st.label, reason)

    # --- deriving ---------------------------------------------------------------------

    def _derive(self, now: float) -> Limits:
        stale_s = self._settings.capacity_stale_s
        fresh: list[EngineMeasurement] = []
        unknown: dict[str, Role] = {}
        for st in self._engines.values():
            if st.fresh(now, stale_s) and st.measurement is not None:
                fresh.append(st.measurement)
            else:
                unknown[st.label] = st.spec.role
        admitting = [m.pool_tokens for m in fresh if m.role in ("prefill", "unified")]
        self._pool_tokens = sum(admitting) if admitting else None
        return limits_for(self._settings, fresh, unknown)

    def _recompute(self, now: float) -> None:
        stale_s = self._settings.capacity_stale_s
        new = self._derive(now)
        successes = [
            st.success_mono for st in self._engines.values()
            if st.success_mono is not None and st.fresh(now, stale_s)
        ]  # fmt: skip
        # The limits change by themselves only when a fresh measurement ages out.
        self._valid_until = min(successes) + stale_s if successes else math.inf
        old, self._limits = self._limits, new
        self._log_change(old, new)
        self._publish(new)

    def _log_change(self, old: Limits, new: Limits) -> None:
        for warning in new.warnings:
            if warning not in self._logged_warnings:
                log.warning("capacity: %s", warning)
        self._logged_warnings = set(new.warnings)
        if new.known and not old.known:
            log.info(
                "capacity: known; admission limit %s tokens (%s, %s), decode limit %s (%s)",
                _fmt(new.admission_limit_tokens), new.source, new.why,
                _fmt(new.decode_limit_tokens), new.decode_why,
            )  # fmt: skip
        elif old.known and not new.known:
            log.warning("capacity: unknown (%s); inference answers 503 capacity_unknown", new.why)
        elif new.known and (
            old.admission_limit_tokens != new.admission_limit_tokens
            or old.decode_limit_tokens != new.decode_limit_tokens
            or old.source != new.source
        ):
            log.warning(
                "capacity: admission limit %s -> %s tokens (%s, %s); decode limit %s -> %s",
                _fmt(old.admission_limit_tokens), _fmt(new.admission_limit_tokens),
                new.source, new.why,
                _fmt(old.decode_limit_tokens), _fmt(new.decode_limit_tokens),
            )  # fmt: skip

    def _publish(self, limits: Limits) -> None:
        mx = self._metrics
        # 0 means "unknown" on the dashboards (the metric help text says so).
        model = self._model
        known = limits.known and limits.admission_limit_tokens is not None
        if self._publish_model:
            mx.admission_limit.labels(model).set(
                (limits.admission_limit_tokens or 0) if limits.known else 0
            )
            mx.decode_limit.labels(model).set(
                (limits.decode_limit_tokens or 0) if limits.known else 0
            )
            mx.capacity_known.labels(model).set(1 if limits.known else 0)
        mx.upstream_capacity_known.labels(model, self._upstream).set(1 if known else 0)
        if known:
            mx.upstream_limit.labels(model, self._upstream).set(limits.admission_limit_tokens or 0)
        else:
            # Absent while unmeasured: a 0 would read as a cluster that holds nothing.
            with contextlib.suppress(KeyError):
                mx.upstream_limit.remove(model, self._upstream)

    # --- admin surface ----------------------------------------------------------------

    def snapshot_json(self) -> dict[str, Any]:
        """Everything `GET /capacity` shows: engines, limits, and why."""
        limits = self.limits()
        now, wall = self._clock(), self._wall()
        stale_s = self._settings.capacity_stale_s
        engines: list[dict[str, Any]] = []
        warnings = list(limits.warnings)
        for st in self._engines.values():
            m = st.measurement
            if st.fresh(now, stale_s):
                state = "fresh"
            elif m is not None:
                state = "stale"
            else:
                state = "unmeasured"
            age = now - st.success_mono if st.success_mono is not None else None
            err = st.last_error
            engines.append({
                "engine": st.label,
                "url": st.spec.url,
                "configured_url": st.configured.url,
                "role": st.spec.role,
                "kind": st.spec.kind,
                "state": state,
                "age_s": round(age, 3) if age is not None else None,
                "measurement": m.to_json() if m is not None else None,
                "last_error": None if err is None else {
                    "reason": err.reason,
                    "message": err.message,
                    "at": st.last_error_at,
                },
                "consecutive_errors": st.consecutive_errors,
            })  # fmt: skip
            if m is not None:
                warnings.extend(f"{st.label}: {w}: {m.warning_note(w)}" for w in m.warnings)
        return {
            "known": limits.known,
            "ready": limits.known,
            "limits": limits.to_json(),
            "engines": engines,
            "warnings": warnings,
            "declared_context": self._settings.max_context,
            "refresh_s": self._settings.capacity_refresh_s,
            "stale_s": stale_s,
            "probe_timeout_s": self._settings.capacity_probe_timeout_s,
            "fallback_limit_tokens": self._settings.capacity_fallback_limit_tokens,
            "refreshes": self._refreshes,
            "last_refresh_at": self._last_refresh_at,
            "retry_after_s": self.retry_after_s(),
            "now": wall,
            "posture": self.posture.snapshot_json(),
            "verification": self.verifier.to_json() if self.verifier is not None else None,
        }


def _fmt(value: int | None) -> str:
    return "none" if value is None else f"{value:,}"
