"""Error shapes (kvproxy/policy/errors.py): one decision of the shape, from the route."""

from __future__ import annotations

import orjson

from kvproxy.policy import errors
from kvproxy.serve.replies import error_response


def test_the_route_decides_the_shape_and_openai_is_the_default() -> None:
    # SGLang's native routes (http_server.py: /generate, /encode, /classify).
    for route in ("generate", "encode", "native_classify"):
        assert errors.error_style(route) == "sglang"
    for route in ("chat", "completions", "responses", "messages", None, ""):
        assert errors.error_style(route) == "openai"


def test_every_outcome_has_both_shapes_and_the_stream_event_follows_the_style() -> None:
    err = errors.upstream_bad_response("oversized SSE event")
    event, done, tail = errors.sse_error_event(err, "sglang").split(b"\n\n")
    assert orjson.loads(event[6:]) == {"error": {"message": err.message}}
    assert (done, tail) == (b"data: [DONE]", b"")
    nested = orjson.loads(errors.sse_error_event(err, "openai").split(b"\n\n")[0][6:])
    assert nested["error"]["code"] == "upstream_bad_response"
    resp = error_response(errors.canary_violation(), {"X-Request-ID": "r"}, "sglang")
    assert resp.status == 502
    assert resp.body is not None
    assert orjson.loads(bytes(resp.body)) == {
        "error": {"message": errors.canary_violation().message}
    }
    assert resp.headers["X-Kvproxy-Error-Code"] == "canary_violation"
