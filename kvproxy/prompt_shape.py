"""The shapes prompt extraction produces and the scalar-field rules every route's parser
shares: pure data and pure functions, no I/O.

`SequencePrompt` is one sequence the engine will prefill; `PromptShape` is a whole request
(its sequences, output cap, `n`, stream flag). Parsers live in `prompt` (completions,
`/generate`), `prompt_chat` (chat), `prompt_routes` and `prompt_only` (the other routes).
Errors name fields and types only, never the request's text (I8).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from kvproxy.errors import invalid_request

Route = Literal[
    "chat",
    "completions",
    "generate",
    # Parsed in `kvproxy.prompt_routes` (the other prompt-carrying routes, kvproxy.routes).
    "responses",
    "messages",
    "embeddings",
    "classify",
    "rerank",
    "score",
    "encode",
    "native_classify",
]

_ROUTES: dict[str, Route] = {
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

# Requests asking for more than 2**31 - 1 output tokens or 128 choices are malformed, not big:
# OpenAI caps n at 128 and engines store max_tokens as int32.
MAX_OUTPUT_TOKENS = 2**31 - 1
MAX_N = 128
# orjson itself refuses nesting beyond 1024; tools and template kwargs are re-serialised with
# orjson.dumps, which refuses beyond 254. Both surface as a 400 here.
TEXT_PART_TYPES = frozenset({"text", "input_text", "refusal"})
IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image", "video_url", "video"})
AUDIO_PART_TYPES = frozenset({"input_audio", "audio_url", "audio"})


@dataclass(frozen=True, slots=True)
class SequencePrompt:
    """One sequence the engine will prefill.

    `texts` are every string the engine tokenizes for it (for chat: every string field a
    template can emit; `tools_json` is kept apart because templates may re-indent it).
    `token_ids` counts pre-tokenized ids given directly. `messages`/`tools` are the raw
    structures a chat template renders; they are empty/None for the other routes.
    """

    texts: tuple[str, ...] = ()
    token_ids: int = 0
    messages: tuple[dict[str, Any], ...] = ()
    tools: tuple[dict[str, Any], ...] | None = None
    tools_json: str = ""
    images: int = 0
    audios: int = 0
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # JSON of template kwargs: a template may print any of them.
    template_kwargs_json: str = ""
    add_generation_prompt: bool = True

    @property
    def message_count(self) -> int:
        return len(self.messages)

    @property
    def tools_json_bytes(self) -> int:
        return len(self.tools_json.encode("utf-8", "surrogatepass"))

    @property
    def text_chars(self) -> int:
        return sum(len(t) for t in self.texts) + len(self.tools_json)


@dataclass(frozen=True, slots=True)
class PromptShape:
    route: Route
    prompts: tuple[SequencePrompt, ...]
    # Largest of max_tokens / max_completion_tokens / sampling_params.max_new_tokens; None if
    # the request named none (the caller applies its default).
    max_output_tokens: int | None
    n: int
    stream: bool
    body_bytes: int
    # The request field holding the prompt, for error bodies: messages, prompt, text, input_ids.
    prompt_param: str
    # False for prompt-only routes (embeddings, rerank, ...): no output, so no decode budget.
    generates: bool = True
    # The parsed JSON body as the client sent it: the counter reads its features
    # (tokens.features) when an exact count is needed, and vLLM's /tokenize gets the
    # client's own chat fields from it (tokens.engine).
    body: Mapping[str, Any] = field(default_factory=dict)
    # The request's bytes as received: the guaranteed bound's O(1) form reads them
    # (tokens.guarantee); never logged.
    raw: bytes = b""

    @property
    def text_chars(self) -> int:
        return sum(p.text_chars for p in self.prompts)


# --- JSON and scalar fields ----------------------------------------------------------------


def _load(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        # orjson's message says what is wrong (invalid UTF-8, depth, syntax) and where, without
        # quoting the document.
        reason = str(exc).split(":", 1)[0]
        raise invalid_request(
            f"request body is not valid JSON ({reason}, at byte {exc.pos})", None
        ) from None
    if not isinstance(data, dict):
        raise invalid_request("request body must be a JSON object", None)
    return data


def _bounded_int(value: Any, param: str, low: int, high: int, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid_request(f"{param} must be an integer", param)
    if not low <= value <= high:
        raise invalid_request(f"{param} must be between {low} and {high:,}", param)
    return value


def _opt_int(obj: Mapping[str, Any], key: str, prefix: str = "") -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    return _bounded_int(value, prefix + key, 0, MAX_OUTPUT_TOKENS, 0)


def _max_of(*values: int | None) -> int | None:
    present = [v for v in values if v is not None]
    # Engines disagree on which of two caps wins; the larger one is the one decode must hold.
    return max(present) if present else None


def _n(data: Mapping[str, Any]) -> int:
    return _bounded_int(data.get("n"), "n", 1, MAX_N, 1)


def _str_or_none(value: Any, param: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise invalid_request(f"{param} must be a string", param)


def _json_text(value: Any, param: str) -> str:
    try:
        return orjson.dumps(value).decode("utf-8")
    except (orjson.JSONEncodeError, TypeError):
        raise invalid_request(f"{param} is nested too deeply", param) from None
