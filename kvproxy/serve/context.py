"""One request's context: what the stages of the handler and the relay know about it.

The handler (kvproxy.serve.handler) builds it at entry, each stage reads and fills it, the
relay adds what the upstream answered, and the access log line is a view of it at the end
(`access_fields`): one object per request, not a log record beside the request's state.

Must never: hold or log prompt or completion text (I8). `body` is the request as read (and
decoded): it is forwarded, never logged; every logged field is a size, a duration, an id, a
sanitised tenant or a label from a closed set.
"""

from __future__ import annotations

import operator
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web
from multidict import CIMultiDict

from kvproxy.observe import IMPLICIT_UPSTREAM, rounded
from kvproxy.policy import Admit, ErrorStyle, KvproxyError, TokenCount
from kvproxy.prompt import PromptShape

if TYPE_CHECKING:
    from kvproxy.budget import Lease
    from kvproxy.policy import RouteMatch
    from kvproxy.serve.models import ClusterServices, ModelServices
    from kvproxy.serve.overload import BodyReservation
    from kvproxy.serve.state import ServerState, Services

# Fields of the context that are not part of the access line: the request's objects, and
# the internal timestamp (the line carries the duration instead).
_NOT_LOGGED = frozenset(
    {
        "request", "services", "state", "match", "style", "body", "headers", "reply_headers",
        "model_services", "cluster", "shape", "count", "verdict", "lease", "started",
        "unclamped", "tried", "body_memory", "body_at", "parsed",
    }
)  # fmt: skip


_ID_BYTES = 16
_ID_BATCH = 256  # ids drawn from the OS at once


class _RequestIds:
    """128-bit random request ids (32 hex digits), drawn from the OS a batch at a time.

    Why a batch: os.urandom is a getrandom() system call per use; drawn 256 ids at a time
    it is one per 256 requests, and the bytes are the same kernel randomness. A forked
    child starts a batch of its own (no id is issued twice)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._pool = b""
        self._at = 0

    def __call__(self) -> str:
        at = self._at
        if at >= len(self._pool):
            self._pool = os.urandom(_ID_BYTES * _ID_BATCH)
            at = 0
        self._at = at + _ID_BYTES
        return self._pool[at : at + _ID_BYTES].hex()


new_request_id = _RequestIds()
os.register_at_fork(after_in_child=new_request_id.reset)


@dataclass(slots=True, eq=False)
class RequestContext:
    request: web.Request
    services: Services
    state: ServerState
    match: RouteMatch
    style: ErrorStyle
    # --- the access line (see `access_fields`) ------------------------------------------
    request_id: str
    method: str
    path: str
    route: str
    started: float
    status: int = 0
    decision: str = "passthrough"
    reason: str | None = None
    tenant: str | None = None
    # The configured model the request was admitted against.
    model: str | None = None
    # The upstream cluster it was sent to (gateway mode; the implicit one is "default").
    upstream: str | None = None
    prompt_tokens: int | None = None
    count_method: str | None = None
    # exact | upper-bound | lower-bound: what prompt_tokens is (X-Kvproxy-Prompt-Tokens-Kind).
    prompt_tokens_kind: str | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    ttft_s: float | None = None
    client_disconnect: str | None = None
    deferred_outcome: str | None = None
    deferred_s: float | None = None
    upstream_outcome: str | None = None
    duration_s: float = 0.0
    # --- what the stages build --------------------------------------------------------
    body: bytes = b""
    # A large body parsed in steps as it was decoded (kvproxy.serve.body.parse_large), or
    # the error that gave; None for a small body (parsed where it is used, in one call).
    parsed: dict[str, Any] | KvproxyError | None = None
    # The headers going upstream (filtered, X-Request-ID set, tenant headers stripped).
    headers: CIMultiDict[str] = field(default_factory=CIMultiDict)
    # Headers added to whatever kvproxy answers (X-Request-ID, the decision, the count).
    reply_headers: dict[str, str] = field(default_factory=dict)
    model_services: ModelServices | None = None
    cluster: ClusterServices | None = None
    shape: PromptShape | None = None
    count: TokenCount | None = None
    verdict: Admit | None = None
    # The body before `clamp` rewrote its output cap (a retry on another cluster clamps it
    # for that cluster's limits), and the cluster a connect failure moved it from.
    unclamped: bytes | None = None
    tried: str | None = None
    lease: Lease | None = None
    # This request's share of the body-memory budget while its body is read and counted.
    body_memory: BodyReservation | None = None
    # When the whole body had arrived (monotonic; 0: not read): kvproxy's own time starts here.
    body_at: float = 0.0

    @property
    def streaming(self) -> bool:
        return self.shape is not None and self.shape.stream

    @property
    def upstream_url(self) -> str:
        if self.cluster is not None:
            return self.cluster.url
        return self.services.settings.upstream

    @property
    def upstream_label(self) -> str:
        """The `upstream` metric label: the cluster's name (a pass-through route, sent to
        the configured router, counts under the implicit cluster's)."""
        return self.upstream or IMPLICIT_UPSTREAM

    def release_lease(self) -> None:
        """I6: the budget comes back once, when the upstream connection is closed."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def release_body_memory(self) -> None:
        """The body was counted (or refused): its reading-and-counting share comes back."""
        if self.body_memory is not None:
            self.body_memory.release()
            self.body_memory = None

    def overhead_s(self, now: float) -> float:
        """kvproxy's own time until `now`: since the body arrived (the head, for a request
        answered before reading it), less the wait for in-flight budget (a policy's queue,
        measured apart by kvproxy_queue_wait_seconds)."""
        since = self.body_at or self.started
        waited = self.lease.waited_s if self.lease is not None else 0.0
        return max(0.0, now - since - waited)

    def finish(self) -> None:
        # To the microsecond, as the access line prints them.
        self.duration_s = rounded(time.monotonic() - self.started, 1_000_000)
        if self.ttft_s is not None:
            self.ttft_s = rounded(self.ttft_s, 1_000_000)
        if self.deferred_s is not None:
            self.deferred_s = rounded(self.deferred_s, 1_000_000)

    def access_fields(self) -> tuple[tuple[str, ...], tuple[Any, ...]]:
        """The access line: the logged fields' names and values, in order (the line leaves
        out the None ones: kvproxy.observe.emit_access)."""
        # Read in C (attrgetter): a Python loop over the two dozen fields was ~2 us a request.
        return _LOGGED, _READ_LOGGED(self)


_LOGGED: tuple[str, ...] = tuple(
    name for name in RequestContext.__dataclass_fields__ if name not in _NOT_LOGGED
)
_READ_LOGGED = operator.attrgetter(*_LOGGED)
