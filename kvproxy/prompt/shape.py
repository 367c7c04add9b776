"""The shapes prompt extraction produces and the scalar-field rules every route's parser
shares: pure data and pure functions, no I/O.

`SequencePrompt` is one sequence the engine will prefill; `PromptShape` is a whole request
(its sequences, output cap, `n`, stream flag). Parsers live in `prompt` (completions,
`/generate`), `prompt_chat` (chat), `prompt_routes` and `prompt_only` (the other routes).
Errors name fields and types only, never the request's text (I8).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from typing import Any

import orjson

from kvproxy.policy import KvproxyError, Route, invalid_request, record

# Requests asking for more than 2**31 - 1 output tokens or 128 choices are malformed, not big:
# OpenAI caps n at 128 and engines store max_tokens as int32.
MAX_OUTPUT_TOKENS = 2**31 - 1
MAX_N = 128
# orjson itself refuses nesting beyond 1024; tools and template kwargs are re-serialised with
# orjson.dumps, which refuses beyond 254. Both surface as a 400 here.
TEXT_PART_TYPES = frozenset({"text", "input_text", "refusal"})
IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image", "video_url", "video"})
AUDIO_PART_TYPES = frozenset({"input_audio", "audio_url", "audio"})


@record
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
    def text_chars(self) -> int:
        return sum(map(len, self.texts)) + len(self.tools_json)


@record
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
    # (tokens.gate.features) when an exact count is needed, and vLLM's /tokenize gets the
    # client's own chat fields from it (tokens.exact.engine).
    body: Mapping[str, Any] = field(default_factory=dict)
    # The request's bytes as received: the guaranteed bound's O(1) form reads them
    # (tokens.bound.guarantee); never logged.
    raw: bytes = b""
    # What the request's media become in tokens, summed over every item (prompt.media):
    # set by the counter, which holds the model's image processor.
    media_tokens: int = 0

    @property
    def text_chars(self) -> int:
        prompts = self.prompts
        if len(prompts) == 1:
            return prompts[0].text_chars
        return sum(p.text_chars for p in prompts)


# --- JSON and scalar fields ----------------------------------------------------------------


def load_json(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or a 400 naming what is wrong (never its text)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise not_json(exc) from None
    if not isinstance(data, dict):
        raise invalid_request(NOT_AN_OBJECT, None)
    return data


NOT_AN_OBJECT = "request body must be a JSON object"


def not_json(exc: orjson.JSONDecodeError) -> KvproxyError:
    """The 400 for a body orjson could not parse."""
    # orjson's message says what is wrong (invalid UTF-8, depth, syntax) and where, without
    # quoting the document.
    reason = str(exc).split(":", 1)[0]
    return invalid_request(f"request body is not valid JSON ({reason}, at byte {exc.pos})", None)


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
    # Engines disagree on which of two caps wins; the larger one is the one decode must hold.
    best = None
    for v in values:
        if v is not None and (best is None or v > best):
            best = v
    return best


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


# --- the field shapes several routes share -------------------------------------------------


def token_ids(ids: Any, param: str) -> int:
    """How many ids a token-id array holds (a 400 naming `param` unless it is one)."""
    if not isinstance(ids, list) or not ids:
        raise invalid_request(f"{param} must be a non-empty array of token ids", param)
    # One C-level pass (about 8 ms per million ids); bool is rejected because type() is exact.
    if set(map(type, ids)) != {int} or min(ids) < 0:
        raise invalid_request(f"{param} must contain non-negative integers only", param)
    return len(ids)


def media_count(value: Any, param: str) -> int:
    """Items in image_data/audio_data, counted for every sequence (an over-count is safe).

    Iterative on purpose: orjson accepts lists nested 1,023 deep, past Python's recursion
    limit, and a RecursionError here would be a 500 instead of a count."""
    if value is None:
        return 0
    if isinstance(value, (str, dict)):
        return 1
    if not isinstance(value, list):
        raise invalid_request(f"{param} must be a string, an object or an array", param)
    count, pending = 0, [value]
    while pending:
        for item in pending.pop():
            if isinstance(item, list):
                pending.append(item)
            else:
                count += 1
    return count


def strings_or_token_ids(
    value: Any, param: str, extra: tuple[str, ...] = ()
) -> tuple[SequencePrompt, ...]:
    """OpenAI's `prompt` / `input` shape: a string, strings, token ids, or arrays of token
    ids; each one sequence, with `extra` (a completions suffix) in every one."""
    if isinstance(value, str):
        return (SequencePrompt(texts=(value, *extra)),)
    if not isinstance(value, list) or not value:
        raise invalid_request(
            f"{param} must be a string, an array of strings or an array of token ids", param
        )
    first = value[0]
    if isinstance(first, str):
        if not all(isinstance(x, str) for x in value):
            raise invalid_request(f"{param} must not mix strings and other types", param)
        return tuple(SequencePrompt(texts=(x, *extra)) for x in value)
    if isinstance(first, list):
        return tuple(
            SequencePrompt(token_ids=token_ids(x, f"{param}[{i}]"), texts=extra)
            for i, x in enumerate(value)
        )
    return (SequencePrompt(token_ids=token_ids(value, param), texts=extra),)
