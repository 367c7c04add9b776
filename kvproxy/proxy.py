"""The public handler: read the body, decide admission, forward, relay.

Order matters and each step fails closed:
  0. routes fail closed (kvproxy.routes): a path that is neither counted nor pass-through is a
     404 and is never forwarded;
  1. refuse while stopping, refuse oversize bodies on Content-Length (413) before reading;
  2. read the body under a deadline (slowloris: 408); on counted routes undo its
     Content-Encoding (kvproxy.body: 400 undecodable, 415 unsupported, 413 past the limit);
  3. capacity unknown -> 503 before any parsing (I3);
  4. parse (400 naming the field), count (bound first, exact only if needed), decide (I1, I4);
  5. take in-flight budget (429 when it cannot be had in time);
  6. forward the bytes as read (decoded if they were; no re-serialisation) and relay (I5, I6).
A rejected request sends nothing upstream (I7). Nothing here logs request or response text (I8).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from aiohttp import web

from kvproxy import admission, errors
from kvproxy.body import content_coding, decode, forwarded_headers, read_arrived, read_raw
from kvproxy.budget import charge_tokens
from kvproxy.clamp import clamp_output
from kvproxy.errors import ErrorStyle, KvproxyError
from kvproxy.headers import filter_headers
from kvproxy.logs import ACCESS_LOGGER, AccessRecord
from kvproxy.models import ModelServices
from kvproxy.prompt import PromptShape, Route, parse_request
from kvproxy.relay import Exchange
from kvproxy.replies import client_gone, client_gone_response, error_response
from kvproxy.routes import RouteMatch, route_table
from kvproxy.state import ServerState, Services

log = logging.getLogger("kvproxy.proxy")
access_log = logging.getLogger(ACCESS_LOGGER)

STATE_KEY = web.AppKey("kvproxy_state", ServerState)
SERVICES_KEY = web.AppKey("kvproxy_services", Services)


async def handle(request: web.Request) -> web.StreamResponse:
    services = request.app[SERVICES_KEY]
    state = request.app[STATE_KEY]
    # Decided on the raw path that is forwarded, never on a decoded form (kvproxy.routes).
    match = route_table(services.settings.passthrough_routes).classify(
        request.method, request.rel_url.raw_path
    )
    route = match.route
    rec = AccessRecord(
        request_id=request.headers.get("X-Request-ID") or os.urandom(16).hex(),
        method=request.method,
        path=request.path if route is not None else "other",
        route=match.label,
        started=time.monotonic(),
    )
    state.enter()
    try:
        try:
            resp = await _handle(services, state, request, match, rec)
        except Exception as exc:
            # A bug must cost one request a 500, never the process; the log names the
            # exception type only (its message could quote request content).
            log.error("internal error handling request %s: %s", rec.request_id, type(exc).__name__)
            rec.reason = "internal_error"
            resp = error_response(
                errors.internal_error(), {"X-Request-ID": rec.request_id}, errors.error_style(route)
            )
        if resp is not None:
            rec.status = resp.status
        elif rec.status == 0:
            rec.status = 499 if rec.client_disconnect else 200
        services.metrics.responses_total.labels(rec.route, str(rec.status)).inc()
        return resp if resp is not None else client_gone_response()
    finally:
        rec.finish()
        services.metrics.request_duration.labels(rec.route).observe(rec.duration_s)
        services.metrics.requests_total.labels(
            rec.route, rec.decision, services.models.label(rec.model)
        ).inc()
        if services.settings.access_log:
            rec.emit(access_log)
        state.leave()


async def _handle(
    services: Services,
    state: ServerState,
    request: web.Request,
    match: RouteMatch,
    rec: AccessRecord,
) -> web.StreamResponse | None:
    s = services.settings
    route = match.route
    style = errors.error_style(route)
    tenant = services.tenants.resolve(request.headers)
    rec.tenant = tenant

    if state.stopping:
        err = KvproxyError(
            status=503,
            code="shutting_down",
            reason="shutting_down",
            type="service_unavailable",
            message="kvproxy is shutting down; retry on another replica",
            headers={"Retry-After": "1", "Connection": "close"},
        )
        return _reject(services, rec, err, style)

    if match.kind == "refused":
        # Before the body is read: nothing of it is needed, and nothing is sent (I7).
        return _reject(services, rec, errors.route_not_found(match.why), style)

    if request.content_length is not None and request.content_length > s.max_body_bytes:
        return _reject(
            services, rec, errors.body_too_large(request.content_length, s.max_body_bytes), style
        )

    try:
        body, whole = read_arrived(request, s.max_body_bytes)
        if not whole:
            # asyncio.timeout, not wait_for: no extra task per request on the hot path.
            async with asyncio.timeout(s.body_read_timeout_s):
                body = await read_raw(request, s.max_body_bytes, body)
    except KvproxyError as err:
        return _reject(services, rec, err, style)
    except TimeoutError:
        return _reject(services, rec, errors.body_read_timeout(s.body_read_timeout_s), style)
    except ConnectionResetError:
        # The client left mid-upload: nothing was sent upstream, nothing to defer. Counted as
        # an abandoned request, not a client disconnect: those are the ones whose upstream
        # the drain machine holds, so every one of them ends in a deferral outcome.
        rec.decision = "abandoned"
        return None
    rec.bytes_in = len(body)

    extra = {"X-Request-ID": rec.request_id}
    headers = filter_headers(request.headers)
    headers["X-Request-ID"] = rec.request_id
    for name in services.tenants.headers_to_strip():
        headers.popall(name, None)

    streaming = False
    lease = None
    upstream = s.upstream
    if route is not None:
        if request.method != "POST":
            return _reject(services, rec, errors.method_not_allowed(request.method), style)
        # Counted routes see (and forward) the decoded body, so what is counted is what the
        # engine reads and the headers say what is sent; pass-through keeps the wire bytes.
        try:
            coding = content_coding(request.headers.getall("Content-Encoding", ()))
            decoded = await decode(body, coding, s.max_body_bytes)
        except KvproxyError as err:
            return _reject(services, rec, err, style)
        body = decoded.data
        forwarded_headers(headers, decoded)
        # The answer must come back uncompressed: the tripwire, the SSE reader and the usage
        # drift check read its bytes, and compressed bytes would hide a foreign marker.
        headers["Accept-Encoding"] = "identity"
        # The model the request names picks the capacity, counter and budget (kvproxy.models).
        svc = services.models.for_request(body)
        if isinstance(svc, KvproxyError):
            return _reject(services, rec, svc, style)
        if not services.models.match_all:
            rec.model = svc.name
        upstream = svc.upstream
        decided = await _admit(services, svc, route, body, rec)
        if isinstance(decided, KvproxyError):
            return _reject(services, rec, decided, style)
        shape, verdict = decided
        streaming = shape.stream
        extra["X-Kvproxy-Decision"] = "admitted"
        extra["X-Kvproxy-Prompt-Tokens"] = str(verdict.prompt_tokens)
        extra["X-Kvproxy-Prompt-Tokens-Kind"] = rec.prompt_tokens_kind or "exact"
        try:
            # The budget holds what the engines will hold: every sequence, every sample.
            lease = await svc.budget.acquire(charge_tokens(verdict.total, shape.n))
        except KvproxyError as err:
            return _reject(services, rec, err, style, extra)
        rec.decision = "admitted"
        if client_gone(request):
            # It left while being counted or queued: nothing was sent, so nothing to defer.
            lease.release()
            rec.decision = "abandoned"
            return None
        if lease.waited_s > 0:
            again = admission.recheck(verdict, svc.capacity.limits(), _policy(services))
            if isinstance(again, admission.Reject):
                lease.release()
                return _reject(services, rec, again.error, style, extra)
            verdict = again
        # Clamped from the verdict that holds at send time: a decode pool that shrank while
        # the request queued needs a smaller cap than the one decided before (I4).
        if verdict.clamped_output_tokens is not None:
            try:
                body = clamp_output(body, route, verdict.clamped_output_tokens)
            except KvproxyError as err:
                lease.release()
                return _reject(services, rec, err, style, extra)
            extra["X-Kvproxy-Output-Clamped"] = str(verdict.clamped_output_tokens)

    scanner = services.canaries.scanner(tenant) if services.canaries.active else None
    exchange = Exchange(
        services,
        state.hard_stop,
        request,
        rec,
        streaming=streaming,
        scanner=scanner,
        extra_headers=extra,
        style=style,
    )
    try:
        target = request.rel_url.raw_path_qs
        resp = await exchange.run(upstream, request.method, target, headers, body)
    finally:
        # I6: the budget comes back only now, when the upstream connection is closed.
        if lease is not None:
            lease.release()
    if exchange.prompt_tokens is not None and rec.prompt_tokens is not None:
        _drift(services, rec, exchange.prompt_tokens)
    # A streamed response must be handed back to aiohttp itself: returning any other object
    # would make it write a second status line onto the same keep-alive connection.
    return resp if resp is not None else exchange.client


async def _admit(
    services: Services, svc: ModelServices, route: Route, body: bytes, rec: AccessRecord
) -> tuple[PromptShape, admission.Admit] | KvproxyError:
    limits = svc.capacity.limits()
    why = "no fresh measurement"
    if not services.models.match_all:
        why += f" of model {svc.name}'s engines"  # the others may be serving
    pre = admission.precheck(limits, svc.capacity.retry_after_s(), why)
    if pre is not None:
        return pre.error
    try:
        shape = parse_request(route, body)
    except KvproxyError as err:
        return err
    policy = _policy(services)
    t0 = time.perf_counter()
    try:
        count = await svc.counter.count(
            shape,
            admission.count_ceiling(shape, limits, policy),
            admission.charge_ceiling(svc.budget.max_tokens, shape),
        )
    except KvproxyError as err:
        return err
    m = services.metrics
    m.admission_duration.labels(count.method).observe(time.perf_counter() - t0)
    m.prompt_tokens.labels(count.method, svc.name).observe(count.tokens)
    for feature in count.unverified:  # names from a closed vocabulary, never content (I8)
        m.unverified_features.labels(feature, svc.name).inc()
    rec.prompt_tokens = count.tokens
    rec.count_method = count.method
    rec.prompt_tokens_kind = count.kind
    verdict = admission.decide(count, shape, limits, policy)
    if isinstance(verdict, admission.Reject):
        return verdict.error
    return shape, verdict


def _policy(services: Services) -> admission.Policy:
    s = services.settings
    return admission.Policy(s.decode_policy, s.default_output_tokens)


def _reject(
    services: Services,
    rec: AccessRecord,
    err: KvproxyError,
    style: ErrorStyle,
    extra: dict[str, str] | None = None,
) -> web.Response:
    rec.decision = "rejected"
    rec.reason = err.reason
    services.metrics.rejections.labels(err.reason, services.models.label(rec.model)).inc()
    headers = dict(extra or {})
    headers["X-Request-ID"] = rec.request_id
    headers["X-Kvproxy-Decision"] = "rejected"
    if rec.prompt_tokens is not None:
        headers["X-Kvproxy-Prompt-Tokens"] = str(rec.prompt_tokens)
        headers["X-Kvproxy-Prompt-Tokens-Kind"] = rec.prompt_tokens_kind or "exact"
    return error_response(err, headers, style)


def _drift(services: Services, rec: AccessRecord, engine_tokens: int) -> None:
    assert rec.prompt_tokens is not None
    check = admission.check_usage(rec.prompt_tokens, rec.count_method, engine_tokens)
    if check.drift is not None:
        services.metrics.token_count_drift.observe(check.drift)
    if check.bound_exceeded:
        services.metrics.token_bound_exceeded.labels(services.models.label(rec.model)).inc()
        log.warning(
            "engine counted more prompt tokens than kvproxy's %s (%d > %d): the configured "
            "tokenizer does not match the model",
            rec.count_method,
            engine_tokens,
            rec.prompt_tokens,
        )
