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
        ("GET", "/v1/models"),
        ("GET", "/v1/models/Qwen/Qwen3-8B"),
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


# The internal routes of the upstreams kvproxy fronts, from their sources: smg 1.13
# (model_gateway/src/server.rs: `public_routes` beyond /health and /v1/models, `admin_routes`,
# `worker_routes`, `mesh_routes`), SGLang (python/sglang/srt/entrypoints/http_server.py) and
# vLLM (vllm/entrypoints/openai/api_server.py and its dev-mode routes). Metrics and load
# are a side channel on other tenants (queue depth; vLLM's prefix-cache counters); the rest
# change or probe the serving state.
INTERNAL_ROUTES = [
    # smg
    ("GET", "/liveness"),
    ("GET", "/readiness"),
    ("GET", "/health_generate"),
    ("GET", "/engine_metrics"),
    ("GET", "/get_model_info"),
    ("GET", "/get_server_info"),
    ("POST", "/flush_cache"),
    ("GET", "/get_loads"),
    ("POST", "/parse/function_call"),
    ("POST", "/parse/reasoning"),
    ("POST", "/wasm"),
    ("GET", "/wasm"),
    ("POST", "/v1/tokenizers"),
    ("GET", "/v1/tokenizers/t1/status"),
    ("POST", "/v1/skills"),
    ("GET", "/workers"),
    ("POST", "/workers"),
    ("DELETE", "/workers/w1"),
    ("GET", "/ha/status"),
    ("POST", "/ha/shutdown"),
    ("POST", "/ha/config"),
    # SGLang
    ("GET", "/metrics"),
    ("GET", "/server_info"),
    ("GET", "/model_info"),
    ("GET", "/get_load"),
    ("GET", "/version"),
    ("GET", "/healthz"),
    ("GET", "/ping"),
    ("POST", "/flush_cache"),
    ("GET", "/flush_cache"),
    ("POST", "/update_weights_from_disk"),
    ("POST", "/update_weights_from_tensor"),
    ("POST", "/update_weights_from_distributed"),
    ("POST", "/update_weights_from_ipc"),
    ("POST", "/init_weights_update_group"),
    ("POST", "/destroy_weights_update_group"),
    ("GET", "/get_weights_by_name"),
    ("POST", "/release_memory_occupation"),
    ("POST", "/resume_memory_occupation"),
    ("POST", "/start_profile"),
    ("POST", "/stop_profile"),
    ("POST", "/abort_request"),
    ("POST", "/configure_logging"),
    ("POST", "/open_session"),
    ("POST", "/close_session"),
    ("POST", "/set_internal_state"),
    ("GET", "/get_internal_state"),
    ("POST", "/slow_down"),
    ("POST", "/pause_generation"),
    ("POST", "/continue_generation"),
    ("POST", "/load_lora_adapter"),
    ("POST", "/unload_lora_adapter"),
    ("POST", "/start_expert_distribution_record"),
    ("POST", "/dump_expert_distribution_record"),
    ("POST", "/update_weight_version"),
    ("POST", "/freeze_gc"),
    # vLLM
    ("GET", "/load"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/reset_mm_cache"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/collective_rpc"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/scale_elastic_ep"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("POST", "/update_weights"),
]


@pytest.mark.parametrize(("method", "path"), INTERNAL_ROUTES)
def test_no_internal_route_of_smg_sglang_or_vllm_passes_by_default(method: str, path: str) -> None:
    assert TABLE.classify(method, path).kind == "refused"
    assert TABLE.classify("HEAD" if method == "GET" else method, path).kind == "refused"


def test_an_operator_may_open_an_internal_route_explicitly() -> None:
    table = parse_passthrough(["GET /metrics"])
    assert table.classify("GET", "/metrics").kind == "passthrough"
    assert table.classify("POST", "/flush_cache").kind == "refused"


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
