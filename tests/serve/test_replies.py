"""Answering a client (kvproxy/serve/replies.py): an outcome becomes the same response whoever
answers it, with its own headers over the caller's, and `Connection: close` really closes."""

from __future__ import annotations

import orjson

from kvproxy.policy import errors
from kvproxy.serve.replies import client_gone_response, error_response


def test_an_outcome_keeps_its_status_body_and_headers_over_the_callers() -> None:
    err = errors.capacity_unknown(7, "no fresh measurement")
    resp = error_response(err, {"X-Request-ID": "r", "Retry-After": "1"}, "openai")
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "7"
    assert resp.headers["X-Request-ID"] == "r"
    assert resp.content_type == "application/json"
    assert resp.body is not None
    assert orjson.loads(bytes(resp.body))["error"]["code"] == "capacity_unknown"
    assert resp.keep_alive is not False  # keep-alive not forced off for a plain 503


def test_connection_close_forces_the_close() -> None:
    resp = error_response(errors.body_read_timeout(5), None, "sglang")
    assert resp.status == 408
    assert resp.keep_alive is False
    assert resp.body is not None
    assert orjson.loads(bytes(resp.body)) == {
        "error": {"message": errors.body_read_timeout(5).message}
    }
    assert resp.headers["X-Kvproxy-Error-Code"] == "request_timeout"


def test_the_client_gone_placeholder_is_never_reused() -> None:
    resp = client_gone_response()
    assert resp.status == 499
    assert resp.keep_alive is False
