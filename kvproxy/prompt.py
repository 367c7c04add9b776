"""Prompt extraction: request bytes in, a `PromptShape` out. Pure functions, no I/O.

Owns what the engine will tokenize and how much it was asked to generate, for the three
inference routes: OpenAI `/v1/chat/completions`, `/v1/completions` and SGLang `/generate`.
Every string a chat template can emit (contents, content parts, reasoning, names, tool-call
arguments, tool definitions) lands in the shape, so the token bound built on it covers what
the engine will see (I1).

Anything the engine would choke on, or that we could not bound, is a 400
`invalid_request` naming the field. It must never quote the request's text in an error
(I8): messages name fields and types only.

Cost on the event loop: `orjson.loads` plus a walk over the message list; no per-character
work happens here (that lives in `kvproxy.tokens`, off the loop).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from kvproxy.errors import KvproxyError, invalid_request

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

    @property
    def text_chars(self) -> int:
        return sum(p.text_chars for p in self.prompts)


_CORE_ROUTES: frozenset[Route] = frozenset({"chat", "completions", "generate"})


def route_for_path(path: str) -> Route | None:
    """The counted inference route for a path; None for everything else (`kvproxy.routes`
    decides whether that is passed through or refused)."""
    if len(path) > 1 and path.endswith("/"):
        path = path.rstrip("/")
    return _ROUTES.get(path)


def parse_request(route: Route, body: bytes) -> PromptShape:
    """Parse one request body. Raises a `KvproxyError` (400) naming the offending field."""
    data = _load(body)
    if route not in _CORE_ROUTES:
        # Imported here: prompt_routes builds on this module's shapes and helpers.
        from kvproxy import prompt_routes

        return prompt_routes.parse(route, data, len(body))
    prompts: tuple[SequencePrompt, ...]
    if route == "chat":
        prompts, param = (_chat(data),), "messages"
        out = _max_of(_opt_int(data, "max_tokens"), _opt_int(data, "max_completion_tokens"))
        n = _n(data)
    elif route == "completions":
        prompts, param = _completions(data), "prompt"
        out = _max_of(_opt_int(data, "max_tokens"), _opt_int(data, "max_completion_tokens"))
        n = max(_n(data), _bounded_int(data.get("best_of"), "best_of", 1, MAX_N, 1))
    else:
        prompts, param = _generate(data)
        out, n = _sampling(data.get("sampling_params"))
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid_request("stream must be a boolean", "stream")
    return PromptShape(
        route=route,
        prompts=prompts,
        max_output_tokens=out,
        n=n,
        stream=bool(stream),
        body_bytes=len(body),
        prompt_param=param,
    )


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


# --- chat ------------------------------------------------------------------------------------


def _chat(data: Mapping[str, Any]) -> SequencePrompt:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_request("messages must be a non-empty array of message objects", "messages")
    texts: list[str] = []
    images = audios = 0
    for i, msg in enumerate(messages):
        # Field names for error bodies are formatted only on the error path: this loop runs
        # for every message of every request.
        if not isinstance(msg, dict):
            raise invalid_request(f"messages[{i}] must be an object", f"messages[{i}]")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            p = f"messages[{i}].role"
            raise invalid_request(f"{p} must be a non-empty string", p)
        texts.append(role)
        content = msg.get("content")
        if isinstance(content, str):
            texts.append(content)
        else:
            im, au = _content(content, f"messages[{i}].content", texts)
            images += im
            audios += au
        for key in _MESSAGE_STRINGS:
            s = msg.get(key)
            if s is None:
                continue
            if not isinstance(s, str):
                raise invalid_request(
                    f"messages[{i}].{key} must be a string", f"messages[{i}].{key}"
                )
            if s:
                texts.append(s)
        if msg.get("tool_calls") is not None:
            _tool_calls(msg["tool_calls"], f"messages[{i}].tool_calls", texts)
        if len(msg) > 2 or not _PLAIN_KEYS.issuperset(msg):
            _other_fields(msg, f"messages[{i}]", texts)

    tools = data.get("tools")
    if tools is None:
        tools = data.get("functions")  # legacy name; templates see it as tools
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise invalid_request("tools must be an array of objects", "tools")
    kwargs = data.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise invalid_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    documents = data.get("documents")
    if documents is not None:
        # vLLM hands `documents` to the template (RAG templates print them).
        kwargs = {**(kwargs or {}), "documents": documents}
    agp = data.get("add_generation_prompt", True)
    if not isinstance(agp, bool):
        raise invalid_request("add_generation_prompt must be a boolean", "add_generation_prompt")
    return SequencePrompt(
        texts=tuple(texts),
        messages=tuple(messages),
        tools=tuple(tools) if tools else None,
        tools_json=_json_text(tools, "tools") if tools else "",
        images=images,
        audios=audios,
        template_kwargs=dict(kwargs or {}),
        template_kwargs_json=_json_text(kwargs, "chat_template_kwargs") if kwargs else "",
        add_generation_prompt=agp,
    )


_MESSAGE_STRINGS = ("name", "reasoning_content", "reasoning", "tool_call_id", "refusal")
# A message with only these keys has no other field to collect (the common case).
_PLAIN_KEYS = frozenset({"role", "content"})
_MESSAGE_FIELDS = frozenset(
    {"role", "content", "name", "reasoning_content", "reasoning", "tool_call_id", "refusal",
     "tool_calls"}
)  # fmt: skip


def _other_fields(msg: Mapping[str, Any], p: str, texts: list[str]) -> None:
    """Fields we do not know may still be printed by a template (GLM-4 prints `metadata`)."""
    for key, value in msg.items():
        if key in _MESSAGE_FIELDS or value is None or isinstance(value, bool):
            continue
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, (int, float)):
            texts.append(str(value))
        else:
            texts.append(_json_text(value, f"{p}.{key}"))


def _content(content: Any, p: str, texts: list[str]) -> tuple[int, int]:
    """Collect a message content's text; return its (images, audios)."""
    if content is None:
        return 0, 0
    if isinstance(content, str):
        texts.append(content)
        return 0, 0
    if not isinstance(content, list):
        raise invalid_request(f"{p} must be a string or an array of content parts", p)
    images = audios = 0
    for j, part in enumerate(content):
        pp = f"{p}[{j}]"
        if isinstance(part, str):  # accepted by vLLM and SGLang as a text part
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise invalid_request(f"{pp} must be an object", pp)
        kind = part.get("type")
        if kind in TEXT_PART_TYPES:
            key = "refusal" if kind == "refusal" else "text"
            text = part.get(key)
            if not isinstance(text, str):
                raise invalid_request(f"{pp}.{key} must be a string", f"{pp}.{key}")
            texts.append(text)
        elif kind in IMAGE_PART_TYPES:
            images += 1
        elif kind in AUDIO_PART_TYPES:
            audios += 1
        else:
            # An unknown part has an unknown token cost: it cannot be bounded, so it is refused.
            raise invalid_request(f"{pp}.type is not a supported content part type", f"{pp}.type")
    return images, audios


def _tool_calls(calls: Any, p: str, texts: list[str]) -> None:
    if calls is None:
        return
    if not isinstance(calls, list):
        raise invalid_request(f"{p} must be an array", p)
    for k, call in enumerate(calls):
        pc = f"{p}[{k}]"
        if not isinstance(call, dict):
            raise invalid_request(f"{pc} must be an object", pc)
        for key in ("id", "type"):
            s = _str_or_none(call.get(key), f"{pc}.{key}")
            if s:
                texts.append(s)
        fn = call.get("function")
        if fn is None:
            continue
        if not isinstance(fn, dict):
            raise invalid_request(f"{pc}.function must be an object", f"{pc}.function")
        name = _str_or_none(fn.get("name"), f"{pc}.function.name")
        if name:
            texts.append(name)
        args = fn.get("arguments")
        if isinstance(args, str):
            texts.append(args)
        elif args is not None:
            # Some clients send an object; templates print it with tojson.
            texts.append(_json_text(args, f"{pc}.function.arguments"))


# --- completions and generate ------------------------------------------------------------


def _completions(data: Mapping[str, Any]) -> tuple[SequencePrompt, ...]:
    prompt = data.get("prompt")
    suffix = _str_or_none(data.get("suffix"), "suffix")
    extra = (suffix,) if suffix else ()
    if isinstance(prompt, str):
        return (SequencePrompt(texts=(prompt, *extra)),)
    if not isinstance(prompt, list) or not prompt:
        raise invalid_request(
            "prompt must be a string, an array of strings or an array of token ids", "prompt"
        )
    first = prompt[0]
    if isinstance(first, str):
        if not all(isinstance(x, str) for x in prompt):
            raise invalid_request("prompt must not mix strings and other types", "prompt")
        return tuple(SequencePrompt(texts=(x, *extra)) for x in prompt)
    if isinstance(first, list):
        return tuple(
            SequencePrompt(token_ids=_ids(x, f"prompt[{i}]"), texts=extra)
            for i, x in enumerate(prompt)
        )
    return (SequencePrompt(token_ids=_ids(prompt, "prompt"), texts=extra),)


def _ids(ids: Any, param: str) -> int:
    if not isinstance(ids, list) or not ids:
        raise invalid_request(f"{param} must be a non-empty array of token ids", param)
    # One C-level pass (about 8 ms per million ids); bool is rejected because type() is exact.
    if set(map(type, ids)) != {int} or min(ids) < 0:
        raise invalid_request(f"{param} must contain non-negative integers only", param)
    return len(ids)


def _generate(data: Mapping[str, Any]) -> tuple[tuple[SequencePrompt, ...], str]:
    text, input_ids = data.get("text"), data.get("input_ids")
    if data.get("input_embeds") is not None:
        raise invalid_request("input_embeds is not supported through kvproxy", "input_embeds")
    if (text is None) == (input_ids is None):
        raise invalid_request("exactly one of text or input_ids is required", "text")
    images = _media_count(data.get("image_data"), "image_data")
    images += _media_count(data.get("video_data"), "video_data")
    audios = _media_count(data.get("audio_data"), "audio_data")
    if text is not None:
        if isinstance(text, str):
            texts: list[str] = [text]
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            texts = text
        else:
            raise invalid_request("text must be a string or a non-empty array of strings", "text")
        seqs = tuple(SequencePrompt(texts=(t,), images=images, audios=audios) for t in texts)
        return seqs, "text"
    if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
        seqs = tuple(
            SequencePrompt(token_ids=_ids(x, f"input_ids[{i}]"), images=images, audios=audios)
            for i, x in enumerate(input_ids)
        )
        return seqs, "input_ids"
    seq = SequencePrompt(token_ids=_ids(input_ids, "input_ids"), images=images, audios=audios)
    return (seq,), "input_ids"


def _media_count(value: Any, param: str) -> int:
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


def _sampling(sp: Any) -> tuple[int | None, int]:
    """SGLang's sampling_params: one object, or one per batch item."""
    if sp is None:
        return None, 1
    items = sp if isinstance(sp, list) else [sp]
    outs: list[int | None] = []
    n = 1
    for i, item in enumerate(items):
        prefix = f"sampling_params[{i}]." if isinstance(sp, list) else "sampling_params."
        if not isinstance(item, dict):
            raise invalid_request(f"{prefix.rstrip('.')} must be an object", prefix.rstrip("."))
        outs.append(_opt_int(item, "max_new_tokens", prefix))
        n = max(n, _bounded_int(item.get("n"), prefix + "n", 1, MAX_N, 1))
    return _max_of(*outs), n


__all__ = [
    "CHAT_ROUTES",
    "KvproxyError",
    "PromptShape",
    "Route",
    "SequencePrompt",
    "parse_request",
    "route_for_path",
]
