"""The aiohttp side of answering a client: an outcome into a response, and whether the
client is still there. Shared by the handler (rejections) and the relay (upstream
failures, canary blocks), so an error looks the same whoever answers it."""

from __future__ import annotations

from aiohttp import web

from kvproxy.policy import ERROR_CODE_HEADER, ErrorStyle, KvproxyError


def error_response(
    err: KvproxyError, extra_headers: dict[str, str] | None, style: ErrorStyle
) -> web.Response:
    """The response for an outcome kvproxy answers itself, in the route's `style` (no
    default: every caller says which, from `errors.error_style`)."""
    headers = dict(extra_headers or {})
    headers.update(err.headers)
    # The code in a header as well as (OpenAI shape) in the body: SGLang's native shape has
    # no field for it, and a client of either can tell kvproxy's answer from the engine's.
    headers[ERROR_CODE_HEADER] = err.code
    resp = web.Response(
        status=err.status, body=err.body(style), content_type="application/json", headers=headers
    )
    if headers.get("Connection", "").lower() == "close":
        # The header alone does not make aiohttp close: it would keep the connection and,
        # after a 408, linger up to 10 s reading the rest of a slow client's body.
        resp.force_close()
    return resp


def client_gone(request: web.Request) -> bool:
    """The client's connection is closed or closing (it left while we counted or queued)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def client_gone_response() -> web.StreamResponse:
    """aiohttp requires a return value; the client left before a response was started, so
    this one is never written (its connection is gone)."""
    resp = web.Response(status=499)
    resp.force_close()
    return resp
