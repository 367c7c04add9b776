"""The error vocabulary: every outcome kvproxy answers itself, its status, code and body.

Pure data and functions (no aiohttp, no asyncio): admission, the parsers, the counter and
the drain machine build outcomes from here without importing I/O. Turning a network
exception into an outcome is `kvproxy.upstream.boundary.network_boundary` (the one exception seam);
turning an outcome into an aiohttp response is `kvproxy.serve.replies.error_response`.

Tree of what a request can end in, besides a relayed upstream response:

    KvproxyError                      HTTP  code                        metric reason
    ├── rejections (I7: nothing was sent upstream)
    │   ├── context_length_exceeded   400   context_length_exceeded     context_length
    │   ├── decode_budget_exceeded    400   context_length_exceeded     decode_budget
    │   ├── unverified_unbounded      400   context_length_exceeded     context_length
    │   ├── invalid_request           400   invalid_request             invalid_request
    │   ├── unsupported_field         400   unsupported_field           unsupported_field
    │   ├── body_too_large            413   request_too_large           body_too_large
    │   ├── request_head_too_large    431   request_header_fields_too_large request_head
    │   ├── malformed_request         400   malformed_request           (not counted)
    │   ├── unsupported_content_encoding 415 unsupported_content_encoding content_encoding
    │   ├── body_read_timeout         408   request_timeout             body_read_timeout
    │   ├── capacity_unknown          503   capacity_unknown            capacity_unknown
    │   ├── count_unavailable         503   token_count_unavailable     count_unavailable
    │   ├── over_budget               429   inflight_budget_exceeded    over_budget
    │   ├── method_not_allowed        405   method_not_allowed          method_not_allowed
    │   ├── body_not_allowed          400   body_not_allowed            body_not_allowed
    │   ├── route_not_found           404   route_not_found             route_not_found
    │   └── model_not_found           404   model_not_found             model_not_found
    └── upstream failures (UpstreamFailure, raised by kvproxy.upstream.boundary.network_boundary)
        ├── upstream_unreachable      502   upstream_unreachable
        ├── upstream_reset            502   upstream_reset
        ├── upstream_timeout          504   upstream_timeout
        ├── upstream_bad_response     502   upstream_bad_response
        └── canary_violation          502   canary_violation

Bodies follow OpenAI's `{"error": {"message", "type", "param", "code", ...}}` shape for the
OpenAI routes and SGLang's native `{"error": {"message": ...}}` on SGLang's native routes
(`/generate`, `/encode`, `/classify`), on every path (rejections, upstream failures, a
canary block, an error event that ends a stream). `error_style(route)` is the one place that
decides, from `STYLE_BY_ROUTE`; a route not listed gets OpenAI's shape. The machine code of a
whole-body error also travels in the `X-Kvproxy-Error-Code` header (kvproxy.serve.replies), the
one place a native-route client can read it without a field SGLang never sends. Messages
never quote prompt or completion text (I8).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import orjson

ErrorStyle = Literal["openai", "sglang"]
# The machine code of an error kvproxy answered with a whole body (kvproxy.serve.replies).
ERROR_CODE_HEADER = "X-Kvproxy-Error-Code"
# The error shape a client of each route expects; a new route whose clients expect another
# shape adds itself here (and its body builder to `KvproxyError.body`).
# SGLang's native routes answer in their own shape (`sglang_error_body`); everything else (the
# OpenAI routes, and /v1/messages, where smg answers in the same OpenAI shape) gets OpenAI's.
STYLE_BY_ROUTE: dict[str, ErrorStyle] = {
    "generate": "sglang",
    "encode": "sglang",
    "native_classify": "sglang",
}


def error_style(route: str | None) -> ErrorStyle:
    """The error shape for a request on `route` (None: not an inference route)."""
    return STYLE_BY_ROUTE.get(route or "", "openai")


class ConfigError(Exception):
    """A setting is invalid; the message is one line naming it (kvproxy.config.settings raises it,
    and so does whatever compiles a setting, such as the canary rules)."""


# Not frozen: Python assigns `__traceback__` (and `__context__`) to an exception it carries
# through a contextlib context manager, which a frozen dataclass refuses (FrozenInstanceError
# instead of the 4xx/5xx the request was owed). Equal by value, unhashable (as it was: `extra`).
@dataclass
class KvproxyError(Exception):
    """An outcome kvproxy answers itself: status, OpenAI error fields, metric reason."""

    status: int
    code: str
    message: str
    reason: str
    type: str = "invalid_request_error"
    param: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"

    def body(self, style: ErrorStyle = "openai") -> bytes:
        if style == "sglang":
            return sglang_error_body(self.message)
        return openai_error_body(self.message, self.type, self.param, self.code, self.extra)


def openai_error_body(
    message: str,
    type_: str,
    param: str | None,
    code: str,
    extra: dict[str, Any] | None = None,
) -> bytes:
    err: dict[str, Any] = {"message": message, "type": type_, "param": param, "code": code}
    if extra:
        err.update(extra)
    return orjson.dumps({"error": err})


def sglang_error_body(message: str) -> bytes:
    """SGLang's native-route error, byte for byte the shape its HTTP server writes: the body
    of a refused `/generate`, `/encode` or `/classify` (`_create_error_response`) and the
    `data:` event that ends a refused `/generate` stream (`generate_request`'s
    `stream_results`), both `{"error": {"message": str(e)}}`
    (python/sglang/srt/entrypoints/http_server.py). SGLang's own clients read exactly this:
    `error.message` (sglang.lang.backend.runtime_endpoint raises on a non-200 body; a stream
    reader stops at `data: [DONE]`). No further field: the machine code is in the
    X-Kvproxy-Error-Code header when there is a header to put it in."""
    return orjson.dumps({"error": {"message": message}})


def sse_error_event(err: KvproxyError, style: ErrorStyle) -> bytes:
    """An error event to end a stream that already sent headers (canary block, upstream cut),
    then `[DONE]`, as both SGLang (`generate_request`) and the OpenAI-compatible servers end
    a failed stream. The relay forwards whole events only, so the client's stream is at an
    event boundary."""
    return b"data: " + err.body(style) + b"\n\ndata: [DONE]\n\n"


# --- constructors: the one definition of each outcome ------------------------------------


# Why a count is what it is, in an error body's `count_reason` (beside `prompt_tokens_kind`):
#   unverified_feature  the request uses a feature the exact count is not verified for on
#                       these engines and router (tokens.gate.verified): decided by the bound;
#                       `unverified_features` lists them (names from a closed vocabulary).
UNVERIFIED_FEATURE = "unverified_feature"


def count_fields(kind: str | None, unverified: tuple[str, ...] = ()) -> dict[str, Any]:
    """The error-body fields that say what the prompt count is and, for a bound the
    verified table forced, which features forced it."""
    out: dict[str, Any] = {}
    if kind is not None:
        out["prompt_tokens_kind"] = kind
    if unverified:
        out["count_reason"] = UNVERIFIED_FEATURE
        out["unverified_features"] = list(unverified)
    return out


def unverified_note(unverified: tuple[str, ...], where: str) -> str:
    """The message clause naming the features that forced the bound."""
    return (
        f"counted by the guaranteed upper bound: the request uses {', '.join(unverified)}, "
        f"which kvproxy's exact count is not verified for on {where}"
    )


def context_length_exceeded(
    prompt_tokens: int,
    limit_tokens: int,
    limit_source: str,
    param: str,
    why: str,
    *,
    at_least: bool = False,
    kind: str | None = None,
    unverified: tuple[str, ...] = (),
) -> KvproxyError:
    # at_least: counting stopped once the prompt was over the limit, so the number is a floor.
    size = f"at least {prompt_tokens:,}" if at_least else f"{prompt_tokens:,}"
    return KvproxyError(
        status=400,
        code="context_length_exceeded",
        reason="context_length",
        param=param,
        message=(
            f"prompt is {size} tokens; this deployment accepts at most "
            f"{limit_tokens:,} ({why}). Shorten the prompt."
        ),
        extra={
            "prompt_tokens": prompt_tokens,
            "limit_tokens": limit_tokens,
            "limit_source": limit_source,
            **count_fields(kind, unverified),
        },
    )


def unverified_unbounded(
    unverified: list[str], where: str, param: str, *, because: str | None = None
) -> KvproxyError:
    """A request the exact count may not admit (unverified features) and with no guaranteed
    bound (the tokenizer has no byte bound, or `because`: the chat template's output size
    could not be proven): nothing can show it fits, so it is refused (I1)."""
    why = because or "the configured tokenizer has no guaranteed upper bound"
    return KvproxyError(
        status=400,
        code="context_length_exceeded",
        reason="context_length",
        param=param,
        message=(
            f"the prompt's size cannot be established: the request uses {', '.join(unverified)}, "
            f"which kvproxy's exact count is not verified for on {where}, and {why}. Send a "
            "plain chat or configure a tokenizer with a byte bound."
        ),
        extra=count_fields(None, tuple(unverified)),
    )


def decode_budget_exceeded(
    prompt_tokens: int,
    output_tokens: int,
    decode_limit: int,
    limit_source: str,
    *,
    kind: str | None = None,
    unverified: tuple[str, ...] = (),
) -> KvproxyError:
    return KvproxyError(
        status=400,
        code="context_length_exceeded",
        reason="decode_budget",
        param="max_tokens",
        message=(
            f"prompt ({prompt_tokens:,} tokens) plus requested output ({output_tokens:,} "
            f"tokens) is {prompt_tokens + output_tokens:,}; the decode KV pool holds at most "
            f"{decode_limit:,}, so at most {max(decode_limit - prompt_tokens, 0):,} output "
            "tokens fit with this prompt. Lower max_tokens or shorten the prompt."
        ),
        extra={
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "limit_tokens": decode_limit,
            "limit_source": limit_source,
            **count_fields(kind, unverified),
        },
    )


def invalid_request(message: str, param: str | None = None) -> KvproxyError:
    return KvproxyError(
        status=400, code="invalid_request", reason="invalid_request", message=message, param=param
    )


def unsupported_field(
    field_name: str, route: str, where: str, why: str = "", *, neutral_hint: bool = True
) -> KvproxyError:
    """A request field kvproxy has not classified for the engines in front (kvproxy.prompt.
    fields), or one it classifies as refused. 400, never forwarded: a field kvproxy does not
    know may change what the engine prefills. What to do: drop the field, or (for a field
    that cannot change the prompt) have the operator list it in the model's
    `extra_neutral_fields`."""
    name = _field_label(field_name)
    because = why or (
        f"it is not a field kvproxy has classified for {route} on {where}: an unknown field "
        "may change what the engine prefills"
    )
    return KvproxyError(
        status=400,
        code="unsupported_field",
        reason="unsupported_field",
        param=name,
        message=(
            f"{name} is not supported through kvproxy: {because}. Remove it"
            + (
                ", or ask the operator to declare it prompt-neutral (extra_neutral_fields)"
                if neutral_hint
                else ""
            )
        ),
    )


def _field_label(name: str) -> str:
    """A client-chosen key, as an error may name it: printable, at most 80 characters."""
    clean = "".join(c if c.isprintable() else "?" for c in name)
    return clean if len(clean) <= 80 else clean[:77] + "..."


def body_too_large(size: int | None, limit: int) -> KvproxyError:
    got = f"request body is {size:,} bytes" if size is not None else "request body is larger"
    return KvproxyError(
        status=413,
        code="request_too_large",
        reason="body_too_large",
        message=f"{got}; the limit is {limit:,} bytes (KVPROXY_MAX_BODY_BYTES)",
    )


def malformed_request(what: str) -> KvproxyError:
    # The parser's refusal (kvproxy.serve.app): `what` never quotes the request's bytes.
    return KvproxyError(
        status=400, code="malformed_request", reason="malformed_request", message=what
    )


def request_head_too_large(what: str, limit: int, setting: str) -> KvproxyError:
    # `what` is a size or a count, never a header's name or value (client input).
    return KvproxyError(
        status=431,
        code="request_header_fields_too_large",
        reason="request_head",
        message=f"{what}; the limit is {limit:,} (KVPROXY_{setting.upper()})",
    )


def unsupported_content_encoding(detail: str, accepted: str) -> KvproxyError:
    return KvproxyError(
        status=415,
        code="unsupported_content_encoding",
        reason="content_encoding",
        param="Content-Encoding",
        message=f"{detail}; send the body uncompressed or as one of: {accepted}",
        headers={"Accept-Encoding": accepted},
    )


def body_read_timeout(timeout_s: float) -> KvproxyError:
    return KvproxyError(
        status=408,
        code="request_timeout",
        reason="body_read_timeout",
        message=f"request body was not received within {timeout_s:g} s",
        # The rest of the body may still be on its way: this connection cannot be reused.
        headers={"Connection": "close"},
    )


def capacity_unknown(retry_after_s: int, detail: str) -> KvproxyError:
    return KvproxyError(
        status=503,
        code="capacity_unknown",
        reason="capacity_unknown",
        type="service_unavailable",
        message=f"the engines' KV capacity is not known right now ({detail}); retry later",
        headers={"Retry-After": str(retry_after_s)},
    )


def count_unavailable(detail: str) -> KvproxyError:
    return KvproxyError(
        status=503,
        code="token_count_unavailable",
        reason="count_unavailable",
        type="service_unavailable",
        message=f"the prompt could not be token-counted in time ({detail}); retry later",
        headers={"Retry-After": "5"},
    )


def over_budget(retry_after_s: int, detail: str) -> KvproxyError:
    return KvproxyError(
        status=429,
        code="inflight_budget_exceeded",
        reason="over_budget",
        type="rate_limit_error",
        message=f"the in-flight budget is full ({detail}); retry later",
        headers={"Retry-After": str(retry_after_s)},
    )


def budget_unavailable(retry_after_s: int) -> KvproxyError:
    """Redis, which holds the cluster budget, cannot be reached and the operator chose
    `redis_unavailable: reject`: refusing is the price of never over-committing the pool."""
    return KvproxyError(
        status=503,
        code="budget_unavailable",
        reason="budget_unavailable",
        type="service_unavailable",
        message="the cluster in-flight budget (Redis) is unavailable; retry later",
        headers={"Retry-After": str(retry_after_s)},
    )


def shutting_down() -> KvproxyError:
    """SIGTERM arrived: this replica takes no new request (its in-flight ones drain)."""
    return KvproxyError(
        status=503,
        code="shutting_down",
        reason="shutting_down",
        type="service_unavailable",
        message="kvproxy is shutting down; retry on another replica",
        headers={"Retry-After": "1", "Connection": "close"},
    )


def overloaded(resource: str, detail: str, *, close: bool = False) -> KvproxyError:
    """Shed at the door (kvproxy.serve.overload): `resource` is what ran out ("connections",
    "body_memory"); nothing of the request was read past its head or sent upstream."""
    headers = {"Retry-After": "1"}
    if close:
        headers["Connection"] = "close"
    return KvproxyError(
        status=503,
        code="overloaded",
        reason="overloaded",
        type="service_unavailable",
        message=f"kvproxy is overloaded ({resource}: {detail}); retry later",
        headers=headers,
    )


def method_not_allowed(method: str) -> KvproxyError:
    return KvproxyError(
        status=405,
        code="method_not_allowed",
        reason="method_not_allowed",
        message=f"method {method} is not allowed on inference routes",
    )


def body_not_allowed(method: str) -> KvproxyError:
    # A GET or HEAD on a pass-through route carries no body a client needs; forwarded, it is
    # bytes the upstream reads unexamined (and a smuggling vector where framing differs).
    return KvproxyError(
        status=400,
        code="body_not_allowed",
        reason="body_not_allowed",
        message=f"a {method} request may not carry a body",
    )


def route_not_found(why: str) -> KvproxyError:
    # The allowlist's refusal (kvproxy.policy.routes): never forwarded. `why` never quotes the path.
    return KvproxyError(
        status=404,
        code="route_not_found",
        reason="route_not_found",
        message=f"kvproxy does not forward this request: {why}",
    )


def model_not_found(name: str | None, configured: tuple[str, ...]) -> KvproxyError:
    # OpenAI's status, type and code for an unknown model, so its SDK raises NotFoundError.
    # The name is the client's own and is cut short; the configured names are what an
    # operator listed (they also answer on /v1/models).
    said = "names no model" if name is None else f"names model {name[:128]!r}"
    return KvproxyError(
        status=404,
        code="model_not_found",
        reason="model_not_found",
        message=(
            f"the request {said}, which kvproxy has no policy for and no default_model is "
            f"configured; configured models: {', '.join(configured[:32])}"
        ),
        param="model",
    )


def canary_violation() -> KvproxyError:
    return KvproxyError(
        status=502,
        code="canary_violation",
        reason="canary_violation",
        type="server_error",
        message="the response was withheld: it carried data that belongs to another tenant",
    )


def internal_error() -> KvproxyError:
    return KvproxyError(
        status=500,
        code="internal_error",
        reason="internal_error",
        type="server_error",
        message="kvproxy failed to handle this request; it has been logged",
    )


# What a network failure on an outgoing leg (the router, an engine probe, the gate's own
# requests) was, as `kvproxy.upstream.boundary.network_boundary` classifies it.
NetworkKind = Literal["timeout", "dns", "connect", "reset", "protocol"]

# kind -> (status, code, message): one status, one body and one metric label per outcome.
_UPSTREAM: dict[NetworkKind, tuple[int, str, str]] = {
    "timeout": (504, "upstream_timeout", "the router did not answer in time"),
    "dns": (502, "upstream_unreachable", "the router's host name did not resolve"),
    "connect": (502, "upstream_unreachable", "the router is unreachable"),
    "reset": (502, "upstream_reset", "the router closed the connection"),
    "protocol": (502, "upstream_bad_response", "the router sent a malformed response"),
}

UPSTREAM_OUTCOMES = tuple(dict.fromkeys(code for _, code, _ in _UPSTREAM.values()))


@dataclass
class UpstreamFailure(KvproxyError):
    """A failed outgoing leg. `kind` is the classification; `cause` the exception's type
    name (never its message, which could quote a URL or a body)."""

    kind: NetworkKind = "protocol"
    cause: str = ""
    # No connection was opened: nothing of the request reached the upstream (a refused or
    # timed-out connect, a name that did not resolve).
    unsent: bool = False


def upstream_failure(kind: NetworkKind, cause: str = "") -> UpstreamFailure:
    status, code, message = _UPSTREAM[kind]
    return UpstreamFailure(
        status=status,
        code=code,
        reason=code,
        type="server_error",
        message=message,
        kind=kind,
        cause=cause,
    )


def upstream_bad_response(detail: str) -> UpstreamFailure:
    message = f"the router sent a malformed response ({detail})"
    return replace(upstream_failure("protocol", detail), message=message)


# --- what a client is told about each code (docs/errors.md is made from this) --------------


@dataclass(frozen=True)
class ClientGuide:
    """One row of the client error table: when kvproxy answers the code, and what a client
    should do about it. Every code a constructor above can produce has one
    (tests/policy/test_error_table.py); `make docs` writes them into docs/errors.md."""

    when: str
    action: str


CLIENT_GUIDE: dict[str, ClientGuide] = {
    "context_length_exceeded": ClientGuide(
        "the prompt (or prompt plus requested output, `max_tokens` x `n`) is over what the "
        "engines' measured KV pools hold; `limit_tokens`, `prompt_tokens` and `limit_source` "
        "say by how much, `count_reason` when a bound decided. Nothing reached the engines.",
        "shorten the prompt or lower `max_tokens`; retrying unchanged fails the same way.",
    ),
    "unsupported_field": ClientGuide(
        "a request field (or a part kind, a request chat template, media) kvproxy has not "
        "classified for the engine version in front, or classifies as refused; `param` names "
        "it. Nothing reached the engines: an unknown field may change what they prefill.",
        "remove the field; if it cannot change the prompt, ask the operator to declare it "
        "prompt-neutral (`extra_neutral_fields`).",
    ),
    "body_not_allowed": ClientGuide(
        "a `GET` or `HEAD` on a pass-through route carried a body; nothing was forwarded "
        "(a body there is bytes the upstream reads unexamined).",
        "send the request without a body.",
    ),
    "invalid_request": ClientGuide(
        "the body is not a request kvproxy can count (not JSON, a field of the wrong type, a "
        "batch it cannot size).",
        "fix the request; `param` names the field when there is one.",
    ),
    "request_too_large": ClientGuide(
        "the body is over `max_body_bytes` (by Content-Length, or as it is read or inflated).",
        "send a smaller body; do not retry unchanged.",
    ),
    "malformed_request": ClientGuide(
        "the HTTP request itself is malformed (framing, header syntax).",
        "fix the client or its HTTP library; do not retry unchanged.",
    ),
    "request_header_fields_too_large": ClientGuide(
        "the request head is over `max_request_head_bytes` or `max_request_headers`.",
        "send fewer or smaller headers.",
    ),
    "unsupported_content_encoding": ClientGuide(
        "the body's Content-Encoding is not one kvproxy decodes (`Accept-Encoding` lists "
        "those it does).",
        "send the body uncompressed or in a listed coding.",
    ),
    "request_timeout": ClientGuide(
        "the body did not arrive within `body_read_timeout_s`; the connection is closed.",
        "retry on a new connection; check the client's upload speed.",
    ),
    "capacity_unknown": ClientGuide(
        "no fresh measurement of the engines' KV pools (an engine unreachable, or "
        "measurements older than `capacity_stale_s`): kvproxy fails closed.",
        "retry after `Retry-After` seconds, preferably on another replica.",
    ),
    "token_count_unavailable": ClientGuide(
        "the prompt could not be counted within `count_timeout_s` (the engine's `/tokenize` "
        "did not answer): kvproxy fails closed.",
        "retry after `Retry-After` seconds.",
    ),
    "inflight_budget_exceeded": ClientGuide(
        "the in-flight budget (`max_inflight_prompt_tokens` / `max_inflight_requests`) "
        "stayed full for `queue_timeout_s`, or `queue_max_waiters` were already waiting.",
        "retry after `Retry-After` seconds, with backoff.",
    ),
    "budget_unavailable": ClientGuide(
        "the shared budget's Redis is unavailable and the operator chose "
        "`redis_unavailable: reject`.",
        "retry after `Retry-After` seconds.",
    ),
    "shutting_down": ClientGuide(
        "this replica received SIGTERM and takes no new requests.",
        "retry at once; the connection is closed, so a new one reaches another replica.",
    ),
    "overloaded": ClientGuide(
        "shed at the door: too many connections (`max_connections`) or too many body bytes "
        "being read or counted (`max_body_memory_bytes`).",
        "retry after `Retry-After` seconds, with backoff.",
    ),
    "method_not_allowed": ClientGuide(
        "an inference route was called with a method other than POST.",
        "use POST.",
    ),
    "route_not_found": ClientGuide(
        "the path is neither an inference route nor a listed pass-through route: kvproxy "
        "does not forward what it cannot count.",
        "use an OpenAI or SGLang inference route, or ask the operator to list the route "
        "(`passthrough_routes`).",
    ),
    "model_not_found": ClientGuide(
        "with a `models` config, the request's `model` names no configured model and no "
        "`default_model` is set (the OpenAI SDK raises NotFoundError).",
        "use a name `/v1/models` lists.",
    ),
    "canary_violation": ClientGuide(
        "the response carried another tenant's canary marker and `canary_action: block` "
        "withheld it (or cut the stream with an error event).",
        "do not retry blindly: report it to the operator, it is a cross-tenant leak.",
    ),
    "internal_error": ClientGuide(
        "kvproxy itself failed on this request (logged with its request id).",
        "retry once; report it if it persists.",
    ),
    "upstream_timeout": ClientGuide(
        "the router sent nothing for `upstream_read_timeout_s`.",
        "retry later; a very long prompt may need the operator to raise the timeout.",
    ),
    "upstream_unreachable": ClientGuide(
        "the router could not be connected to (refused, timed out, name not resolved): "
        "nothing of the request reached it.",
        "retry; safe, the request was not sent.",
    ),
    "upstream_reset": ClientGuide(
        "the router closed the connection before a complete response.",
        "retry if the request is idempotent for you; part of it may have run.",
    ),
    "upstream_bad_response": ClientGuide(
        "the router's response was malformed (framing, an oversized head).",
        "retry once; report it to the operator if it persists.",
    ),
}
