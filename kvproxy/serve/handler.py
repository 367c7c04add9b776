"""The public handler: one request, through its stages, to the relay.

    handle(request)
      builds a RequestContext (kvproxy.serve.context): route, request id, tenant
      runs the stages of its plan in order (`PLANS`); each reads and fills the context and
      returns a refusal (a `KvproxyError`), ABANDONED (the client left before anything was
      sent) or None:
{PLANS}
      forwards the bytes as read (decoded if they were; no re-serialisation) through the
      relay (kvproxy.serve.relay: I5, I6)
    One way out for a refusal (`_refuse`), one `finally` that gives the in-flight budget
    back once the upstream is closed (I6) and writes the access line (a view of the context).
    After the exchange, the cluster's passive health (`_observe_health`: its outcome, into
    the model's outlier detection); a connect failure, and only that (no byte was sent),
    runs RETRY once on another cluster.
    Every config shape runs these stages alike: a single upstream is a model of one cluster
    (kvproxy.config's model table); nothing here branches on the number of clusters.

Each stage fails closed: a connection accepted past the connection limit, or a body that
finds no room in the body-memory budget in time, is a 503 `overloaded` before its body is
read (kvproxy.serve.overload); a request head past its bounds is a 431 (kvproxy.serve.headers:
aiohttp bounds each line and the count, not the total); routes that are neither counted nor
pass-through are a 404 and never forwarded (kvproxy.policy.routes); capacity unknown is a
503 before any parsing (I3); only a guaranteed bound or an exact count admits (I1, I4). A
refused request sends nothing upstream (I7). Nothing here logs request or response text
(I8): the access line carries sizes, ids and labels.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web

from kvproxy.budget import charge_tokens
from kvproxy.observe import ACCESS_LOGGER, emit_access
from kvproxy.policy import KvproxyError, admission, clamp_output, errors, routing
from kvproxy.prompt import parse_request
from kvproxy.response import CanaryScanner
from kvproxy.serve.body import (
    LARGE_BODY_BYTES,
    content_coding,
    decode,
    forwarded_headers,
    parse_large,
    read_arrived,
    read_raw,
)
from kvproxy.serve.context import RequestContext, new_request_id
from kvproxy.serve.headers import filter_headers, request_head_error, set_forwarded_for
from kvproxy.serve.overload import BodyReservation
from kvproxy.serve.relay import Exchange
from kvproxy.serve.replies import client_gone, client_gone_response, error_response
from kvproxy.serve.state import ServerState, Services

log = logging.getLogger("kvproxy.proxy")
access_log = logging.getLogger(ACCESS_LOGGER)

STATE_KEY = web.AppKey("kvproxy_state", ServerState)
SERVICES_KEY = web.AppKey("kvproxy_services", Services)


class _Abandoned:
    """The client left before anything was sent upstream: nothing to answer, nothing to
    defer (counted as abandoned, not as a client disconnect: those are the requests whose
    upstream the drain machine holds, and each of them ends in a deferral outcome)."""


ABANDONED: Final = _Abandoned()
Stop = KvproxyError | _Abandoned
# A stage that never waits is a plain function: a coroutine per stage was ~0.4 us each, a
# dozen times a request. `_plan` tags each with whether it must be awaited.
SyncStage = Callable[[RequestContext], Stop | None]
AsyncStage = Callable[[RequestContext], Awaitable[Stop | None]]
Stage = SyncStage | AsyncStage
Plan = tuple[tuple[Stage, bool], ...]


async def handle(request: web.Request) -> web.StreamResponse:
    app = request.app  # a property: read once
    services = app[SERVICES_KEY]
    state = app[STATE_KEY]
    # Decided on the raw path that is forwarded, never on a decoded form (kvproxy.policy.routes).
    match = services.routes.classify(request.method, request.rel_url.raw_path)
    route = match.route
    # Positional, one field a line in declaration order: matching eleven keywords cost a
    # third of building the context.
    ctx = RequestContext(
        request,  # request
        services,  # services
        state,  # state
        match,  # match
        errors.error_style(route),  # style
        request.headers.get("X-Request-ID") or new_request_id(),  # request_id
        request.method,  # method
        request.path if route is not None else "other",  # path
        match.label,  # route
        time.monotonic(),  # started
    )
    ctx.tenant = services.tenants.resolve(request.headers)
    ctx.reply_headers["X-Request-ID"] = ctx.request_id
    state.enter()
    try:
        try:
            resp = await _run(ctx, _stages_for(ctx))
        except Exception as exc:
            # A bug must cost one request a 500, never the process; the log names the
            # exception type only (its message could quote request content).
            log.error("internal error handling request %s: %s", ctx.request_id, type(exc).__name__)
            ctx.reason = "internal_error"
            resp = error_response(
                errors.internal_error(), {"X-Request-ID": ctx.request_id}, ctx.style
            )
        if resp is not None:
            ctx.status = resp.status
        elif ctx.status == 0:
            ctx.status = 499 if ctx.client_disconnect else 200
        services.metrics.responses_total.labels(ctx.route, str(ctx.status)).inc()
        return resp if resp is not None else client_gone_response()
    finally:
        ctx.release_body_memory()
        ctx.release_lease()
        ctx.finish()
        services.metrics.request_duration.labels(ctx.route).observe(ctx.duration_s)
        services.metrics.requests_total.labels(
            ctx.route, ctx.decision, services.models.label(ctx.model)
        ).inc()
        if services.settings.access_log:
            emit_access(access_log, *ctx.access_fields(), state.loop)
        state.leave()


async def _run(ctx: RequestContext, stages: Plan) -> web.StreamResponse | None:
    stop = await _stages(ctx, stages)
    if stop is ABANDONED:
        ctx.decision = "abandoned"
        return None
    if isinstance(stop, KvproxyError):
        return _refuse(ctx, stop)
    # kvproxy's own time before the first send (a retry's wait on a failed connect is not).
    ctx.services.metrics.overhead.labels(ctx.route, ctx.decision, "request").observe(
        ctx.overhead_s(time.monotonic())
    )
    resp, exchange = await _send(ctx)
    if _observe_health(ctx, exchange) and not client_gone(ctx.request):
        # Nothing of it reached that router: it may go to another cluster that holds it,
        # once. A request any byte of which was sent is never retried (it may be running).
        stop = await _stages(ctx, RETRY)
        if stop is None:
            resp, exchange = await _send(ctx)
            _observe_health(ctx, exchange)
        elif stop is ABANDONED:
            return None
        else:
            # No other cluster holds it (or its budget refused): the connect failure stands.
            ctx.upstream = ctx.tried
    engine_tokens = exchange.prompt_tokens  # a property: read once
    if engine_tokens is not None and ctx.prompt_tokens is not None:
        _drift(ctx, engine_tokens)
    # A streamed response must be handed back to aiohttp itself: returning any other object
    # would make it write a second status line onto the same keep-alive connection.
    return resp if resp is not None else exchange.client


async def _stages(ctx: RequestContext, stages: Plan) -> Stop | None:
    for stage, waits in stages:
        # No typing.cast here: it is a Python call, two dozen of them a request.
        if waits:
            stop: Stop | None = await stage(ctx)  # type: ignore[misc]  # _plan: waits => async
        else:
            stop = stage(ctx)  # type: ignore[assignment]  # _plan: not waits => SyncStage
        if stop is not None:
            return stop
    return None


async def _send(ctx: RequestContext) -> tuple[web.StreamResponse | None, Exchange]:
    exchange = Exchange(
        ctx.services,
        ctx.state.hard_stop,
        ctx.request,
        ctx,
        streaming=ctx.streaming,
        scanner=_scanner(ctx),
        extra_headers=ctx.reply_headers,
        style=ctx.style,
    )
    svc, cluster = ctx.model_services, ctx.cluster
    if svc is not None and cluster is not None and ctx.verdict is not None:

        def head_timeout() -> None:
            svc.observe(cluster, "timeout", _source(ctx), ctx.services.metrics)

        exchange.on_head_timeout = head_timeout
    try:
        target = ctx.request.rel_url.raw_path_qs
        resp = await exchange.run(ctx.upstream_url, ctx.method, target, ctx.headers, ctx.body)
    finally:
        ctx.release_lease()  # I6: only now is the upstream connection closed
    return resp, exchange


def _observe_health(ctx: RequestContext, exchange: Exchange) -> bool:
    """Passive health of the cluster a counted request went to (kvproxy.policy.routing's
    outlier detection): the exchange's outcome, from the request's source. True when the
    request may move: nothing of it was sent, and it has not moved yet."""
    svc, cluster = ctx.model_services, ctx.cluster
    if svc is None or cluster is None or ctx.verdict is None or ctx.state.stopping:
        return False
    if exchange.head_timed_out:
        return False  # reported when it happened (`_send`)
    up = exchange.upstream
    if up is not None:
        if up.status < 500:
            outcome: routing.Outcome = "success"
        elif routing.request_caused_5xx(
            up.status, up.headers.get("Content-Type", ""), exchange.error_body
        ):
            outcome = "request_5xx"
        else:
            outcome = "status_5xx"
        svc.observe(cluster, outcome, _source(ctx), ctx.services.metrics)
        return False
    failure = exchange.failure
    if failure is None:
        return False  # the client left before a head: nothing said about the router
    if exchange.not_sent:
        outcome = "connect"
    elif failure.kind == "timeout":
        outcome = "timeout"
    else:
        outcome = "reset"  # reset, or closed / garbled before a head
    svc.observe(cluster, outcome, _source(ctx), ctx.services.metrics)
    # Moved once, when another cluster remains to try (a single upstream has none).
    return exchange.not_sent and ctx.tried is None and svc.others(cluster) != ()


def _source(ctx: RequestContext) -> str:
    """Who sent the request, for outlier detection's once-per-source rule: the tenant, else
    the client's address."""
    return ctx.tenant or f"addr:{ctx.request.remote or '?'}"


def _refuse(ctx: RequestContext, err: KvproxyError) -> web.Response:
    """The one way a request is refused: nothing of it was sent upstream (I7)."""
    ctx.services.metrics.overhead.labels(ctx.route, "rejected", "request").observe(
        ctx.overhead_s(time.monotonic())
    )
    ctx.release_lease()
    ctx.decision = "rejected"
    ctx.reason = err.reason
    ctx.services.metrics.rejections.labels(err.reason, ctx.services.models.label(ctx.model)).inc()
    headers = ctx.reply_headers
    headers["X-Kvproxy-Decision"] = "rejected"
    if ctx.prompt_tokens is not None:
        headers["X-Kvproxy-Prompt-Tokens"] = str(ctx.prompt_tokens)
        headers["X-Kvproxy-Prompt-Tokens-Kind"] = ctx.prompt_tokens_kind or "exact"
    return error_response(err, headers, ctx.style)


# --- every request ---------------------------------------------------------------------


def refuse_when_stopping(ctx: RequestContext) -> Stop | None:
    return errors.shutting_down() if ctx.state.stopping else None


def refuse_overloaded(ctx: RequestContext) -> Stop | None:
    """A connection accepted past the connection limit (kvproxy.serve.overload) gets one
    503 and is closed; its body is never read."""
    if getattr(ctx.request.protocol, "shed", False):
        gate = ctx.services.connections
        ctx.services.metrics.overload_shed.labels("connections", "reply").inc()
        return errors.overloaded(
            "connections", f"{gate.open} open, the limit is {gate.limit}", close=True
        )
    return None


async def reserve_body_memory(ctx: RequestContext) -> Stop | None:
    """Room for the body in the body-memory budget before it is read (kvproxy.serve.overload):
    its declared length, or the largest body when its size is not known before reading
    (chunked) or decoding may grow it (a Content-Encoding)."""
    request, s = ctx.request, ctx.services.settings
    if not request.body_exists:
        return None
    size = request.content_length
    if size is None or "Content-Encoding" in request.headers:
        size = s.max_body_bytes
    gate = ctx.services.body_memory
    if not await gate.take(size, s.body_memory_wait_s):
        ctx.services.metrics.overload_shed.labels("body_memory", "reply").inc()
        return errors.overloaded(
            "body_memory",
            f"{gate.in_use:,} of {gate.limit:,} body bytes are being read or counted",
        )
    ctx.body_memory = BodyReservation(gate, size)
    return None


def body_counted(ctx: RequestContext) -> Stop | None:
    ctx.release_body_memory()
    return None


def refuse_oversize_head(ctx: RequestContext) -> Stop | None:
    s, request = ctx.services.settings, ctx.request
    return request_head_error(
        request.raw_headers, request.raw_path, s.max_request_head_bytes, s.max_request_headers
    )


def refuse_route(ctx: RequestContext) -> Stop | None:
    # Before the body is read: nothing of it is needed, and nothing is sent (I7).
    return errors.route_not_found(ctx.match.why) if ctx.match.kind == "refused" else None


def refuse_oversize(ctx: RequestContext) -> Stop | None:
    declared, limit = ctx.request.content_length, ctx.services.settings.max_body_bytes
    return (
        errors.body_too_large(declared, limit)
        if declared is not None and declared > limit
        else None
    )


async def read_body(ctx: RequestContext) -> Stop | None:
    s = ctx.services.settings
    try:
        body, whole = read_arrived(ctx.request, s.max_body_bytes)
        if not whole:
            # asyncio.timeout, not wait_for: no extra task per request on the hot path.
            async with asyncio.timeout(s.body_read_timeout_s):
                body = await read_raw(ctx.request, s.max_body_bytes, body)
    except KvproxyError as err:
        return err
    except TimeoutError:
        return errors.body_read_timeout(s.body_read_timeout_s)
    except ConnectionResetError:
        return ABANDONED  # it left mid-upload: nothing was sent upstream
    ctx.body = body
    ctx.bytes_in = len(body)
    if ctx.body_memory is not None:
        ctx.body_memory.shrink_to(len(body))
    ctx.body_at = time.monotonic()
    return None


def upstream_headers(ctx: RequestContext) -> Stop | None:
    request = ctx.request
    headers = filter_headers(request.headers)
    headers["X-Request-ID"] = ctx.request_id
    set_forwarded_for(
        headers, request.headers, request.remote, ctx.services.settings.forwarded_trusted_hops
    )
    for name in ctx.services.tenants.headers_to_strip():
        headers.popall(name, None)
    ctx.headers = headers
    return None


# --- counted routes ----------------------------------------------------------------------


def require_post(ctx: RequestContext) -> Stop | None:
    return errors.method_not_allowed(ctx.method) if ctx.method != "POST" else None


async def decode_body(ctx: RequestContext) -> Stop | None:
    # Counted routes see (and forward) the decoded body, so what is counted is what the
    # engine reads and the headers say what is sent; pass-through keeps the wire bytes.
    try:
        coding = content_coding(ctx.request.headers.getall("Content-Encoding", ()))
        decoded = await decode(ctx.body, coding, ctx.services.settings.max_body_bytes)
    except KvproxyError as err:
        return err
    ctx.body = decoded.data
    forwarded_headers(ctx.headers, decoded)
    # The answer must come back uncompressed: the tripwire, the SSE reader and the usage
    # drift check read its bytes, and compressed bytes would hide a foreign marker.
    ctx.headers["Accept-Encoding"] = "identity"
    if len(decoded.data) > LARGE_BODY_BYTES:
        # Parsed now, in steps the loop runs between; its 400, if any, is given where a
        # small body's would be (pick_model, admit), so both decide alike.
        ctx.parsed = await parse_large(decoded.data)
    return None


def pick_model(ctx: RequestContext) -> Stop | None:
    # The model the request names picks the capacity, counter and budget (serve.models).
    found = ctx.services.models.for_request(ctx.body, ctx.parsed)
    if isinstance(found, KvproxyError):
        return found
    ctx.model_services = found
    ctx.model = found.name
    return None


async def admit(ctx: RequestContext) -> Stop | None:
    """I3, then parse and count (bound first, exact only if needed) once, against the
    largest limit any measured cluster of the model offers (a single upstream: its own)."""
    svc, metrics, route = ctx.model_services, ctx.services.metrics, ctx.match.route
    assert svc is not None
    assert route is not None
    policy = ctx.services.policy
    clusters = svc.clusters
    if not any(admission.limits_known(c.limits()) for c in clusters):
        return errors.capacity_unknown(svc.retry_after_s(), ctx.services.models.unknown_why(svc))
    parsed = ctx.parsed
    if isinstance(parsed, KvproxyError):
        return parsed
    try:
        shape = parse_request(route, ctx.body, parsed)
        ceiling = routing.count_ceiling(clusters, shape, policy) or 0
        t0 = time.perf_counter()
        count = await svc.counter.count(shape, ceiling, svc.charge_ceiling(shape))
    except KvproxyError as err:
        return err
    metrics.admission_duration.labels(count.method).observe(time.perf_counter() - t0)
    metrics.prompt_tokens.labels(count.method, svc.name).observe(count.tokens)
    for feature in count.unverified:  # names from a closed vocabulary, never content (I8)
        metrics.unverified_features.labels(feature, svc.name).inc()
    ctx.prompt_tokens = count.tokens
    ctx.count_method = count.method
    ctx.prompt_tokens_kind = count.kind
    ctx.shape, ctx.count = shape, count
    return None


def pick_cluster(ctx: RequestContext) -> Stop | None:
    """Decide (I1, I4) on each measured cluster's limits and pick one that holds the
    request: affinity, then least load (kvproxy.policy.routing; a single upstream is the
    one candidate, picked by fit)."""
    svc, shape, count = ctx.model_services, ctx.shape, ctx.count
    assert svc is not None
    assert shape is not None
    assert count is not None
    header = svc.affinity_header
    key = ctx.request.headers.get(header) if header is not None else None
    exclude = () if ctx.tried is None else (ctx.tried,)
    now = time.monotonic()
    svc.count_restores(ctx.services.metrics, now)
    routed = svc.balancer.route(
        count, shape, svc.clusters, ctx.services.policy, now, key or None, exclude
    )
    if isinstance(routed, admission.Reject):
        return routed.error
    verdict, name = routed.admit, routed.cluster.name
    if routed.spill is not None and routed.home is not None:
        ctx.services.metrics.affinity_spills.labels(svc.name, routed.home.name, routed.spill).inc()
    # The model's own ClusterServices: the balancer picks among `svc.clusters`.
    ctx.cluster = routed.cluster  # type: ignore[assignment]
    ctx.upstream, ctx.verdict = name, verdict
    ctx.services.metrics.routing_decisions.labels(svc.name, name, routed.reason).inc()
    ctx.reply_headers["X-Kvproxy-Decision"] = "admitted"
    ctx.reply_headers["X-Kvproxy-Prompt-Tokens"] = str(verdict.prompt_tokens)
    ctx.reply_headers["X-Kvproxy-Prompt-Tokens-Kind"] = count.kind
    return None


async def take_budget(ctx: RequestContext) -> Stop | None:
    cluster, shape, verdict = ctx.cluster, ctx.shape, ctx.verdict
    assert cluster is not None
    assert shape is not None
    assert verdict is not None
    try:
        # The budget holds what the engines will hold: every sequence, every sample. Each
        # cluster's own budget: a deferred request keeps its cluster's share (I6).
        ctx.lease = await cluster.budget.acquire(charge_tokens(verdict.total, shape.n))
    except KvproxyError as err:
        return err
    ctx.decision = "admitted"
    if client_gone(ctx.request):
        # It left while being counted or queued: nothing was sent, so nothing to defer.
        ctx.release_lease()
        return ABANDONED
    return None


def recheck_after_queue(ctx: RequestContext) -> Stop | None:
    """The same decision on today's limits when the request waited for budget: a pool that
    shrank meanwhile must not receive what it can no longer hold."""
    cluster, verdict, lease = ctx.cluster, ctx.verdict, ctx.lease
    assert cluster is not None
    assert verdict is not None
    assert lease is not None
    if lease.waited_s <= 0:
        return None
    again = admission.recheck(verdict, cluster.limits(), ctx.services.policy)
    if isinstance(again, admission.Reject):
        return again.error
    ctx.verdict = again
    return None


def clamp(ctx: RequestContext) -> Stop | None:
    # Clamped from the verdict that holds at send time: a decode pool that shrank while
    # the request queued needs a smaller cap than the one decided before (I4).
    verdict, route = ctx.verdict, ctx.match.route
    assert verdict is not None
    assert route is not None
    if verdict.clamped_output_tokens is None:
        return None
    try:
        clamped = clamp_output(ctx.unclamped or ctx.body, route, verdict.clamped_output_tokens)
    except KvproxyError as err:
        return err
    ctx.unclamped = ctx.unclamped or ctx.body  # a retry on another cluster clamps afresh
    ctx.body = clamped
    ctx.reply_headers["X-Kvproxy-Output-Clamped"] = str(verdict.clamped_output_tokens)
    return None


def _plan(*stages: Stage) -> Plan:
    return tuple((stage, inspect.iscoroutinefunction(stage)) for stage in stages)


EVERY_REQUEST: tuple[Stage, ...] = (
    refuse_when_stopping,
    refuse_overloaded,
    refuse_oversize_head,
    refuse_route,
    refuse_oversize,
    reserve_body_memory,
    read_body,
    upstream_headers,
)


def move_cluster(ctx: RequestContext) -> Stop | None:
    """The cluster refused the connection (nothing was sent): route again without it."""
    assert ctx.cluster is not None
    ctx.tried = ctx.cluster.name
    ctx.upstream_outcome = None  # the access line's outcome is the retry's
    if ctx.unclamped is not None:
        ctx.body = ctx.unclamped
    return None


def refuse_body_on_read(ctx: RequestContext) -> Stop | None:
    """A pass-through GET or HEAD carries no body: refused before it is read (never
    forwarded). aiohttp reads a body only where Content-Length or chunked framing says so."""
    if ctx.method in ("GET", "HEAD") and ctx.request.body_exists:
        return errors.body_not_allowed(ctx.method)
    return None


def passthrough_upstream(ctx: RequestContext) -> Stop | None:
    # The single-model form with `upstreams` has no top-level router: a pass-through route
    # goes to one of its clusters (the `models:` form keeps the top-level `upstream`).
    models = ctx.services.models
    if models.implicit and models.first.gateway:
        cluster = models.first.passthrough_cluster()
        ctx.cluster, ctx.upstream = cluster, cluster.name
    return None


COUNTED = _plan(
    *EVERY_REQUEST,
    require_post,
    decode_body,
    pick_model,
    admit,
    body_counted,
    pick_cluster,
    take_budget,
    recheck_after_queue,
    clamp,
)
PASSTHROUGH = _plan(
    *EVERY_REQUEST[:4], refuse_body_on_read, *EVERY_REQUEST[4:], passthrough_upstream, body_counted
)
REFUSED = _plan(*EVERY_REQUEST)
# After a connect failure: another cluster, its budget, its limits, its clamp.
RETRY = _plan(move_cluster, pick_cluster, take_budget, recheck_after_queue, clamp)

# Every plan and when it runs. This module's docstring and docs/architecture.md show
# `describe_plans()` (tests/serve/test_handler_plans.py holds the doc to it).
PLANS: tuple[tuple[str, Plan], ...] = (
    ("counted routes", COUNTED),
    ("pass-through", PASSTHROUGH),
    ("refused routes", REFUSED),
    ("RETRY", RETRY),
)


def describe_plans(indent: int = 0, width: int = 92) -> str:
    """The plans as lines of stage names: the stages every request runs first, then what
    each plan adds after them (or runs instead, for RETRY)."""
    names = [stage.__name__ for stage in EVERY_REQUEST]
    rows = [("every request", names)]
    for label, plan in PLANS:
        stages = [stage.__name__ for stage, _ in plan]
        if stages[: len(names)] == names:
            rows.append((f"{label} +", stages[len(names) :] or ["(nothing)"]))
        else:
            rows.append((label, stages))
    label_width = max(len(label) for label, _ in rows) + 2
    lines = []
    for label, stages in rows:
        line = " " * indent + label.ljust(label_width)
        for name in stages:
            if len(line) + len(name) + 1 > width and not line.endswith(" " * label_width):
                lines.append(line.rstrip())
                line = " " * (indent + label_width)
            line += name + " "
        lines.append(line.rstrip())
    return "\n".join(lines)


if __doc__:  # None under python -OO
    __doc__ = __doc__.replace("{PLANS}", describe_plans(indent=8))


# --- helpers ---------------------------------------------------------------------------------


def _stages_for(ctx: RequestContext) -> Plan:
    if ctx.match.route is not None:
        return COUNTED
    return PASSTHROUGH if ctx.match.kind != "refused" else REFUSED


def _scanner(ctx: RequestContext) -> CanaryScanner | None:
    canaries = ctx.services.canaries
    return canaries.scanner(ctx.tenant) if canaries.active else None


def _drift(ctx: RequestContext, engine_tokens: int) -> None:
    assert ctx.prompt_tokens is not None
    check = admission.check_usage(ctx.prompt_tokens, ctx.count_method, engine_tokens)
    metrics = ctx.services.metrics
    if check.drift is not None:
        metrics.token_count_drift.observe(check.drift)
    if check.bound_exceeded:
        metrics.token_bound_exceeded.labels(ctx.services.models.label(ctx.model)).inc()
        log.warning(
            "engine counted more prompt tokens than kvproxy's %s (%d > %d): the configured "
            "tokenizer does not match the model",
            ctx.count_method,
            engine_tokens,
            ctx.prompt_tokens,
        )
