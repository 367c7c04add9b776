"""The route allowlist: counted, pass-through or refused, decided on the raw path."""

from __future__ import annotations

import pytest

from kvproxy.config import ConfigError, load_settings
from kvproxy.policy.routes import parse_passthrough, route_table

TABLE = route_table(())


@pytest.mark.parametrize(
    ("path", "route"),
    [
        ("/v1/chat/completions", "chat"),
        ("/v1/chat/completions/", "chat"),  # one trailing slash: counted like the bare path
        ("/v1/completions", "completions"),
        ("/generate", "generate"),
        ("/v1/responses", "responses"),
        ("/v1/messages", "messages"),
        ("/v1/embeddings", "embeddings"),
        ("/v1/classify", "classify"),
        ("/v1/rerank", "rerank"),
        ("/rerank", "rerank"),
        ("/v1/score", "score"),
        ("/encode", "encode"),
        ("/classify", "native_classify"),
    ],
)
def test_counted_routes(path: str, route: str) -> None:
    match = TABLE.classify("POST", path)
    assert (match.kind, match.route, match.label) == ("counted", route, route)
    # Any method is still "counted": the handler answers it 405, never forwards it.
    assert TABLE.classify("PUT", path).kind == "counted"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/health"),
        ("HEAD", "/health"),
        ("GET", "/health_generate"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/Qwen/Qwen3-8B"),
        ("GET", "/get_model_info"),
        ("GET", "/server_info"),
        ("GET", "/metrics"),
        ("GET", "/version"),
        ("POST", "/v1/tokenize"),
        ("POST", "/tokenize"),
        ("POST", "/v1/detokenize"),
        ("GET", "/v1/models/"),
    ],
)
def test_read_only_routes_pass(method: str, path: str) -> None:
    match = TABLE.classify(method, path)
    assert (match.kind, match.route, match.label) == ("passthrough", None, "passthrough")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        # Not routes kvproxy knows: refused, whatever they would do upstream.
        ("POST", "/v1/unknown"),
        ("POST", "/v1/interactions"),  # smg: Gemini interactions, a prompt kvproxy cannot count
        ("GET", "/v1/realtime"),
        ("POST", "/v1/audio/transcriptions"),
        ("POST", "/invocations"),  # SGLang: SageMaker chat
        ("POST", "/vertex_generate"),  # SGLang: Vertex generate
        ("POST", "/v1/conversations"),
        ("GET", "/v1/responses/resp_1"),
        ("POST", "/v1/responses/resp_1/cancel"),
        ("POST", "/flush_cache"),
        ("POST", "/workers"),
        # Right path, wrong method for a pass-through route.
        ("POST", "/health"),
        ("DELETE", "/v1/models"),
        ("GET", "/v1/tokenize"),
        # Spellings an upstream may route to a counted handler: starlette decodes escapes.
        ("POST", "/v1/chat%2Fcompletions"),
        ("POST", "/v1/%63hat/completions"),
        ("POST", "/v1/chat/completions%00"),
        ("POST", "//v1/chat/completions"),
        ("POST", "/v1//chat/completions"),
        ("POST", "/v1/chat/completions//"),
        ("POST", "/v1/./chat/completions"),
        ("POST", "/v1/x/../chat/completions"),
        ("POST", "/v1/chat/completions/."),
        ("POST", "/v1\\chat\\completions"),
        ("GET", "/v1/models/%2E%2E/x"),
        ("GET", "/v1/models/../../generate"),
        # Case: neither upstream matches it, so it is not a route.
        ("POST", "/V1/chat/completions"),
        ("POST", "/Generate"),
        ("POST", "*"),
        ("POST", ""),
    ],
)
def test_everything_else_is_refused(method: str, path: str) -> None:
    match = TABLE.classify(method, path)
    assert (match.kind, match.route, match.label) == ("refused", None, "refused")
    assert match.why
    assert path not in match.why or path == ""  # the path is never quoted back


def test_operator_routes() -> None:
    table = parse_passthrough(["GET /custom/info", "/any", "GET,HEAD /files/*"])
    assert table.classify("GET", "/custom/info").kind == "passthrough"
    assert table.classify("POST", "/custom/info").kind == "refused"
    assert table.classify("DELETE", "/any").kind == "passthrough"
    assert table.classify("HEAD", "/files/a/b").kind == "passthrough"
    assert table.classify("GET", "/files").kind == "refused"  # the prefix is what is under it
    assert table.classify("GET", "/files/%2E%2E/generate").kind == "refused"
    assert table.classify("POST", "/v1/chat/completions").kind == "counted"


def test_a_wildcard_under_a_counted_route_leaves_the_route_counted() -> None:
    table = parse_passthrough(["GET /v1/responses/*"])
    assert table.classify("GET", "/v1/responses/resp_1").kind == "passthrough"
    assert table.classify("POST", "/v1/responses/resp_1/cancel").kind == "refused"
    assert table.classify("POST", "/v1/responses").kind == "counted"
    assert table.classify("POST", "/v1/responses/").kind == "counted"


@pytest.mark.parametrize(
    "entry",
    [
        "/v1/chat/completions",  # a counted route cannot be made uncounted
        "POST /v1/responses",
        "/v1/*",  # covers counted routes
        "/*",
        "relative/path",
        "/a/../v1/chat/completions",
        "/a%2Fb",
        "/trailing/",
        "G3T /x",
    ],
)
def test_bad_operator_routes_fail_at_start(entry: str) -> None:
    with pytest.raises(ConfigError, match="passthrough_routes"):
        load_settings(upstream="http://127.0.0.1:1", passthrough_routes=[entry])
