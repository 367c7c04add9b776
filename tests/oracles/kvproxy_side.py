"""kvproxy's admission decision for one request body, taken in-process through the same
functions the public handler calls (kvproxy/serve/handler.py `_admit`): `prompt.parse_request`, the
counter from `tokens.build_counter`, `admission.count_ceiling` and `admission.decide`.

This is the only module under tests/oracles that imports kvproxy, so moving kvproxy's
modules touches one file here. `test_oracle_serve.py` holds it equal to a real
`kvproxy serve` on a few bodies.

    side = KvproxySide(model_dir, engine="sglang")        # "vllm", "smg+sglang"
    d = side.decide("chat", body, limit_tokens=4096)      # Decision(admitted, tokens, kind)
    side.close()
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared_loads import shared_tokenizer_loads

from kvproxy.capacity.limits import Limits
from kvproxy.config import Settings, load_settings
from kvproxy.policy import admission
from kvproxy.policy.errors import KvproxyError
from kvproxy.prompt import parse_request
from kvproxy.tokens import build_counter
from oracles.versions import ENGINE_VERSIONS

# Engine (as the oracles name it) -> the engine kind kvproxy is configured with, and the
# router between kvproxy and the engines (a setting kvproxy may not have yet).
ENGINE_KIND = {"sglang": "sglang", "vllm": "vllm", "smg+sglang": "sglang"}
ROUTER_KIND = {"sglang": "none", "vllm": "none", "smg+sglang": "smg"}
ROUTES = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/generate",
    "responses": "/v1/responses",
    "embeddings": "/v1/embeddings",
    "score": "/v1/score",
    "rerank": "/v1/rerank",
}


def config_key(engine: str) -> str:
    """The engines whose kvproxy configuration is the same: without a router setting,
    kvproxy in front of smg+SGLang is configured as in front of SGLang."""
    if engine == "smg+sglang" and "router_kind" not in Settings.model_fields:
        return "sglang"
    return engine


@dataclass(frozen=True)
class Decision:
    """What kvproxy answers: admitted or not, the number it decided on (the
    X-Kvproxy-Prompt-Tokens header; None when the body is refused before counting), its
    kind (exact, upper-bound, lower-bound) and the error code of a refusal."""

    admitted: bool
    tokens: int | None
    kind: str | None
    code: str | None = None


def settings_for(model_dir: Path, engine: str, **extra: Any) -> dict[str, Any]:
    """The settings kvproxy runs with for `engine` in front of the model in `model_dir`
    (also what test_oracle_serve.py passes to `kvproxy serve`). Media are charged 0 tokens
    so the comparison is of the rendered text alone."""
    out: dict[str, Any] = {
        "tokenizer": f"hf:{model_dir}",
        "image_tokens": 0,
        "audio_tokens": 0,
        "access_log": False,
        "engines": [{"url": "http://127.0.0.1:9", "role": "unified", "kind": ENGINE_KIND[engine]}],
    }
    if "router_kind" in Settings.model_fields:
        out["router_kind"] = ROUTER_KIND[engine]
    out.update(extra)
    return out


class KvproxySide:
    def __init__(self, model_dir: Path, engine: str, **extra: Any) -> None:
        self.engine = engine
        self.settings = load_settings(**settings_for(model_dir, engine, **extra))
        self._loop = asyncio.new_event_loop()
        # Several counters per model (one per engine): one load (tests/shared_loads.py).
        with shared_tokenizer_loads():
            self.counter = build_counter(self.settings)
        # As a deployment in front of the release an oracle replicates: the capacity probe
        # would report that version, and the verified table is read for it.
        verifier = getattr(self.counter, "verifier", None)
        if verifier is not None:
            kind = ENGINE_KIND[engine]
            verifier.observe([(kind, ENGINE_VERSIONS[kind])])
        self._policy = admission.Policy(
            self.settings.decode_policy, self.settings.default_output_tokens
        )

    def close(self) -> None:
        self._loop.run_until_complete(self.counter.aclose())
        self._loop.close()

    def decide(self, route: str, body: bytes, limit_tokens: int) -> Decision:
        """The handler's `_admit` on limits measured at `limit_tokens` (no decode limit:
        I4 is not what the oracles check)."""
        limits = Limits(
            admission_limit_tokens=limit_tokens,
            decode_limit_tokens=None,
            source="measured",
            known=True,
            why="oracle limit",
        )
        try:
            shape = parse_request(route, body)  # type: ignore[arg-type]
        except KvproxyError as err:
            return Decision(False, None, None, err.code)
        try:
            count = self._loop.run_until_complete(
                self.counter.count(shape, admission.count_ceiling(shape, limits, self._policy))
            )
        except KvproxyError as err:
            return Decision(False, None, None, err.code)
        verdict = admission.decide(count, shape, limits, self._policy)
        if isinstance(verdict, admission.Reject):
            return Decision(False, count.tokens, count.kind, verdict.error.code)
        return Decision(True, count.tokens, count.kind)
