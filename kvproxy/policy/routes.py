"""The route allowlist: which requests kvproxy counts, which it forwards as they are, and
which it refuses. Pure functions, no I/O.

I1 holds for every request the upstream can serve only if nothing reaches an inference
handler uncounted, so routing fails closed:

- **counted**: the inference routes (`route_for_path`), POST only; any other
  method is a 405 (SGLang also serves PUT on /generate, /encode, /classify and /v1/rerank:
  refused here rather than forwarded uncounted);
- **pass-through**: what clients need that carries no prompt to a KV cache (`/health`,
  the model list, tokenize) and the operator's `passthrough_routes`; nothing internal
  (metrics, load, server info, health internals, admin routes) unless the operator lists it;
- **refused** (404 `route_not_found`, never forwarded): everything else, including
  prompt-carrying routes kvproxy does not count (`/v1/interactions`, `/v1/realtime`,
  `/v1/audio/transcriptions`, SageMaker `/invocations`, Vertex `/vertex_generate`) and the
  stored-state routes (`/v1/conversations`, `/v1/responses/{id}`).

The decision is taken on the raw path kvproxy forwards (`request.rel_url.raw_path`), not on
a decoded form, and a path with more than one spelling is refused. The upstreams match
differently: smg (axum/matchit) matches the raw path exactly and 404s every variant;
SGLang (FastAPI/starlette under uvicorn) matches the *percent-decoded* path, so
`/v1/chat%2Fcompletions` or `/v1/%63hat/completions` would reach its chat handler, and it
redirects a trailing slash to the bare path. Hence: any `%`, backslash, empty segment
(`//`), dot segment (`.`, `..`) or character outside RFC 3986's pchar set is refused; a
single trailing slash is normalised away for the lookup (the request is counted like the
bare path, and forwarded as sent: smg 404s it, starlette redirects back to a counted path);
case is kept (both upstreams are case-sensitive, so `/V1/...` matches nothing upstream
either). Query strings never choose a handler upstream and are forwarded untouched.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import field
from typing import Literal

from kvproxy.policy.records import record

RouteKind = Literal["counted", "passthrough", "refused"]

# --- the counted inference routes: the vocabulary kvproxy.prompt parses -------------------

Route = Literal[
    "chat",
    "completions",
    "generate",
    # Parsed by kvproxy.prompt as chat (converted) or as prompt-only requests.
    "responses",
    "messages",
    "embeddings",
    "classify",
    "rerank",
    "score",
    "encode",
    "native_classify",
]

ROUTE_PATHS: dict[str, Route] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/generate": "generate",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/embeddings": "embeddings",
    "/v1/classify": "classify",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v1/score": "score",
    "/encode": "encode",
    "/classify": "native_classify",
}
# Routes whose sequences are chat messages rendered by the chat template.
CHAT_ROUTES: frozenset[Route] = frozenset({"chat", "responses", "messages"})


def route_for_path(path: str) -> Route | None:
    """The counted inference route for a path; None for everything else (the allowlist
    below decides whether that is passed through or refused)."""
    if len(path) > 1 and path.endswith("/"):
        path = path.rstrip("/")
    return ROUTE_PATHS.get(path)


# What the public port forwards uncounted by default: what clients need, nothing internal.
# The health check a load balancer or client uses (/health: smg's answers from the router
# alone, SGLang's and vLLM's from the engine), the model list, and the tokenizer pair (smg
# 1.13 model_gateway/src/server.rs `protected_routes`; SGLang and vLLM serve the bare names
# too): none prefills a prompt into a KV cache.
# Not forwarded (404 unless the operator lists them in `passthrough_routes`): metrics and
# load (/metrics, /engine_metrics, /get_load, /get_loads, vLLM's /load: queue depth, and on
# vLLM the prefix-cache counters, a side channel on other tenants' prompt prefixes),
# health internals (/health_generate runs a generation on demand; /liveness, /readiness,
# /healthz, /ping), server and model internals (/server_info, /get_server_info,
# /model_info, /get_model_info, /version: pool sizes, paths, arguments), and every admin
# route (cache flushes, weight updates, aborts, profiling, LoRA, sessions, workers, HA):
# the allowlist lists none of them, so they are refused with everything else.
_READ = frozenset({"GET", "HEAD"})
KNOWN_PASSTHROUGH: dict[str, frozenset[str]] = {
    **dict.fromkeys(("/health", "/v1/models"), _READ),
    **dict.fromkeys(
        ("/v1/tokenize", "/tokenize", "/v1/detokenize", "/detokenize"), frozenset({"POST"})
    ),
}
# `/v1/models/{id}`: SGLang's `{model:path}` lets the id hold slashes (`Qwen/Qwen3-8B`).
_MODELS_PREFIX = "/v1/models/"

# RFC 3986 pchar without pct-encoded, plus "/": unreserved / sub-delims / ":" / "@".
_CANONICAL = re.compile(r"(?:/[A-Za-z0-9\-._~!$&'()*+,;=:@]+)+/?|/")


MEMO_ENTRIES = 1024
MEMO_PATH_CHARS = 256


@record
class RouteMatch:
    kind: RouteKind
    # The counted route, for counted requests.
    route: Route | None = None
    # Bounded metric/log label: the route name, "passthrough", or "refused".
    label: str = "refused"
    # Why a refused request was refused (the error message; never quotes the path).
    why: str = ""


@record
class RouteTable:
    """The operator's pass-through routes on top of the built-in table.

    An entry is `"/path"` (any method) or `"METHOD /path"`; a path ending in `/*` matches
    everything under it. Validated at start (`parse_passthrough`)."""

    exact: dict[str, frozenset[str] | None]
    prefixes: tuple[tuple[str, frozenset[str] | None], ...] = ()
    # Answers already given: a pure function of (method, raw path) and this table, asked on
    # every request with the same few paths. Bounded: unusual paths are classified afresh.
    _memo: dict[tuple[str, str], RouteMatch] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )

    def classify(self, method: str, raw_path: str) -> RouteMatch:
        key = (method, raw_path)
        got = self._memo.get(key)
        if got is None:
            got = self._classify(method, raw_path)
            if len(self._memo) < MEMO_ENTRIES and len(raw_path) <= MEMO_PATH_CHARS:
                self._memo[key] = got
        return got

    def _classify(self, method: str, raw_path: str) -> RouteMatch:
        if not _CANONICAL.fullmatch(raw_path) or _has_dot_segment(raw_path):
            return RouteMatch(
                "refused",
                why="the path is not in canonical form (percent-escapes, empty or dot "
                "segments, or characters outside RFC 3986 are refused)",
            )
        path = raw_path[:-1] if len(raw_path) > 1 and raw_path.endswith("/") else raw_path
        route = route_for_path(path)
        if route is not None:
            # The method is checked by the handler (405), so a GET to a counted route is
            # answered as before; it is never forwarded.
            return RouteMatch("counted", route, route)
        methods = KNOWN_PASSTHROUGH.get(path)
        if methods is None and path.startswith(_MODELS_PREFIX):
            methods = _READ
        if methods is not None and method in methods:
            return RouteMatch("passthrough", label="passthrough")
        if path in self.exact:
            allowed = self.exact[path]
            if allowed is None or method in allowed:
                return RouteMatch("passthrough", label="passthrough")
        for prefix, allowed in self.prefixes:
            if path.startswith(prefix) and (allowed is None or method in allowed):
                return RouteMatch("passthrough", label="passthrough")
        return RouteMatch(
            "refused",
            why=f"{method} on this path is neither a counted inference route nor a "
            "pass-through route (see passthrough_routes)",
        )


def _has_dot_segment(path: str) -> bool:
    return any(seg in (".", "..") for seg in path.split("/"))


def parse_passthrough(entries: Iterable[str]) -> RouteTable:
    """Build the table from `passthrough_routes`; raises ValueError naming a bad entry."""
    exact: dict[str, frozenset[str] | None] = {}
    prefixes: list[tuple[str, frozenset[str] | None]] = []
    for entry in entries:
        method, _, path = entry.strip().rpartition(" ")
        methods = frozenset(m.upper() for m in method.split(",")) if method else None
        if methods is not None and not all(m.isalpha() for m in methods):
            raise ValueError(f"{entry!r}: methods must be letters, like 'GET /path'")
        wildcard = path.endswith("/*")
        bare = path[:-2] if wildcard else path
        if not bare.startswith("/") or not _CANONICAL.fullmatch(bare) or _has_dot_segment(bare):
            raise ValueError(f"{entry!r}: the path must be a canonical absolute path")
        if bare != "/" and bare.endswith("/"):
            raise ValueError(f"{entry!r}: write the path without a trailing slash")
        prefix = bare.rstrip("/") + "/"
        # A wildcard covers what is under its prefix (`/v1/responses/*` leaves the counted
        # `/v1/responses`, and its trailing-slash spelling, counted: classify looks those up
        # first); it may not cover a counted route.
        if (wildcard and any(p.startswith(prefix) for p in ROUTE_PATHS)) or (
            not wildcard and route_for_path(bare) is not None
        ):
            raise ValueError(f"{entry!r}: a counted inference route cannot be passed through")
        if wildcard:
            prefixes.append((prefix, methods))
        else:
            exact[bare] = methods
    return RouteTable(exact, tuple(prefixes))


@functools.lru_cache(maxsize=8)
def route_table(entries: tuple[str, ...]) -> RouteTable:
    """The table for a settings value (validated at start, so this never raises)."""
    return parse_passthrough(entries)


__all__ = [
    "KNOWN_PASSTHROUGH",
    "RouteMatch",
    "RouteTable",
    "parse_passthrough",
    "route_table",
]
