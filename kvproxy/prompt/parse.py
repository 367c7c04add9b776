"""Prompt extraction: request bytes in, a `PromptShape` out. Pure functions, no I/O.

Owns what the engine will tokenize and how much it was asked to generate. `parse_request`
is the one entry point for every counted route; this module parses `/v1/completions` and
SGLang `/generate` itself, chat lives in `prompt_chat`, the other routes in `prompt_routes`
and `prompt_only`, and the shapes and scalar rules they share in `prompt_shape`. Every
string a chat template can emit lands in the shape, so the token bound built on it covers
what the engine will see (I1).

Anything the engine would choke on, or that we could not bound, is a 400
`invalid_request` naming the field. It must never quote the request's text in an error
(I8): messages name fields and types only.

Cost on the event loop: `orjson.loads` plus a walk over the message list; no per-character
work happens here (that lives in `kvproxy.tokens`, off the loop).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvproxy.policy import Route, invalid_request
from kvproxy.prompt import converted
from kvproxy.prompt.chat import _chat
from kvproxy.prompt.shape import (
    MAX_N,
    PromptShape,
    SequencePrompt,
    _bounded_int,
    _max_of,
    _n,
    _opt_int,
    _str_or_none,
    load_json,
    media_count,
    strings_or_token_ids,
    token_ids,
)

_CORE_ROUTES: frozenset[Route] = frozenset({"chat", "completions", "generate"})


def parse_request(route: Route, body: bytes, data: dict[str, Any] | None = None) -> PromptShape:
    """Parse one request body. Raises a `KvproxyError` (400) naming the offending field.

    `data`: the body already parsed as a JSON object (a large body, parsed in steps by
    kvproxy.serve.body); the shape is the same as from `body` alone."""
    if data is None:
        data = load_json(body)
    _refuse_uncountable(data)
    if route not in _CORE_ROUTES:
        return converted.parse(route, data, body)
    prompts: tuple[SequencePrompt, ...]
    if route == "chat":
        prompts, param = (_chat(data),), "messages"
        out = _max_of(_opt_int(data, "max_tokens"), _opt_int(data, "max_completion_tokens"))
        n = 1 if data.get("n") is None else _n(data)
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
    # Positional, one field a line in declaration order: every counted request builds one.
    return PromptShape(
        route,  # route
        prompts,  # prompts
        out,  # max_output_tokens
        n,  # n
        bool(stream),  # stream
        len(body),  # body_bytes
        param,  # prompt_param
        True,  # generates
        data,  # body
        body,  # raw
    )


# Fields whose prompt the proxy cannot count, on any route: embeddings given as tensors
# (vLLM's `prompt_embeds` on completions, SGLang's `input_embeds`: their token count is the
# tensor's first dimension, inside a base64 payload), and SGLang's `session_params`, which
# continues a session whose earlier context lives in the engine.
_UNCOUNTABLE = {
    "prompt_embeds": "prompt_embeds is not supported through kvproxy: its length cannot be "
    "counted before the engine decodes the tensor",
    "input_embeds": "input_embeds is not supported through kvproxy",
    "session_params": "session_params refers to context stored in the engine that kvproxy "
    "cannot count; send the full prompt",
}


def _refuse_uncountable(data: Mapping[str, Any]) -> None:
    if _UNCOUNTABLE.keys().isdisjoint(data):
        return  # one C-level check for the common body, which names none of them
    for key, message in _UNCOUNTABLE.items():
        if data.get(key) is not None:
            raise invalid_request(message, key)


# --- completions and generate ------------------------------------------------------------


def _completions(data: Mapping[str, Any]) -> tuple[SequencePrompt, ...]:
    suffix = _str_or_none(data.get("suffix"), "suffix")
    return strings_or_token_ids(data.get("prompt"), "prompt", (suffix,) if suffix else ())


def _generate(data: Mapping[str, Any]) -> tuple[tuple[SequencePrompt, ...], str]:
    text, input_ids = data.get("text"), data.get("input_ids")
    if data.get("input_embeds") is not None:
        raise invalid_request("input_embeds is not supported through kvproxy", "input_embeds")
    if (text is None) == (input_ids is None):
        raise invalid_request("exactly one of text or input_ids is required", "text")
    images = media_count(data.get("image_data"), "image_data")
    images += media_count(data.get("video_data"), "video_data")
    audios = media_count(data.get("audio_data"), "audio_data")
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
            SequencePrompt(token_ids=token_ids(x, f"input_ids[{i}]"), images=images, audios=audios)
            for i, x in enumerate(input_ids)
        )
        return seqs, "input_ids"
    seq = SequencePrompt(token_ids=token_ids(input_ids, "input_ids"), images=images, audios=audios)
    return (seq,), "input_ids"


def _sampling(sp: Any) -> tuple[int | None, int]:
    """SGLang's sampling_params: one object, or one per batch item."""
    if sp is None:
        return None, 1
    if isinstance(sp, list) and not sp:
        # No item to read a cap from: SGLang has nothing to apply either, and a clamp would
        # have nothing to lower, so the body is refused rather than run uncapped.
        raise invalid_request(
            "sampling_params must be an object or a non-empty array of objects",
            "sampling_params",
        )
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
