"""Request parsing and response shapes of the engines' generation routes (sans-IO).

Owns: reading ``/v1/chat/completions``, ``/v1/completions`` and SGLang's ``/generate``
bodies (and ``/v1/responses`` / ``/v1/messages``, converted to chat by ``converse``) into one
``GenRequest`` (token ids after the chat template, output budget, stream
flags, PD bootstrap fields), and writing replies in the engines' formats: OpenAI objects
and chunks, SGLang's native ``{"text", "meta_info"}``, and ``data: ...`` SSE framing.

Never does I/O; never logs prompt or completion text.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvproxy.sim import converse
from kvproxy.sim.converse import ROUTE_MESSAGES, ROUTE_RESPONSES
from kvproxy.sim.limits import EngineError
from kvproxy.sim.tokenizer import ChatRenderer, TemplateError, Tokenizer

ROUTE_CHAT = "/v1/chat/completions"
ROUTE_COMPLETIONS = "/v1/completions"
ROUTE_GENERATE = "/generate"

# SGLang's defaults when the client gives no budget: /generate 128 new tokens, OpenAI
# completions 16 (the OpenAI spec), chat none (generate until stop or context).
_DEFAULT_NEW_TOKENS = {ROUTE_GENERATE: 128, ROUTE_COMPLETIONS: 16}


@dataclass
class GenRequest:
    route: str
    input_ids: list[int]
    max_new_tokens: int | None
    stream: bool
    rid: str
    model: str
    include_usage: bool = False
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def has_bootstrap(self) -> bool:
        return self.bootstrap_room is not None


def _int_or_none(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineError(f"{name} must be an integer, got {type(value).__name__}")
    return value


def _token_list(value: Any) -> list[int] | None:
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return list(value)
    return None


def parse_request(
    route: str,
    body: Any,
    tokenizer: Tokenizer,
    renderer: ChatRenderer,
    model_name: str,
    request_id: str | None = None,
) -> GenRequest:
    """Validate a generation body; raises ``EngineError`` (400) like the engine would."""
    if not isinstance(body, dict):
        raise EngineError("The request body must be a JSON object.")
    if route == ROUTE_CHAT:
        input_ids = _chat_ids(body, tokenizer, renderer)
        budget = body.get("max_completion_tokens", body.get("max_tokens"))
        max_new = _int_or_none(budget, "max_tokens")
    elif route in (ROUTE_RESPONSES, ROUTE_MESSAGES):
        # Converted to chat as the serving stack does, then rendered like any chat request.
        convert = (
            converse.responses_chat_body
            if route == ROUTE_RESPONSES
            else converse.messages_chat_body
        )
        chat, budget = convert(body)
        input_ids = _chat_ids(chat, tokenizer, renderer)
        max_new = _int_or_none(budget, "max_tokens")
    elif route == ROUTE_COMPLETIONS:
        input_ids = _text_ids(body.get("prompt"), tokenizer, "prompt")
        max_new = _int_or_none(body.get("max_tokens", _DEFAULT_NEW_TOKENS[route]), "max_tokens")
    else:
        source = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
        input_ids = _text_ids(source, tokenizer, "text")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise EngineError("sampling_params must be an object")
        max_new = _int_or_none(
            params.get("max_new_tokens", _DEFAULT_NEW_TOKENS[route]), "max_new_tokens"
        )
    if max_new is not None and max_new < 0:
        raise EngineError(f"max_new_tokens must be at least 0, got {max_new}.")
    stream = bool(body.get("stream", False))
    options = body.get("stream_options") or {}
    rid = body.get("rid") if isinstance(body.get("rid"), str) else None
    port = body.get("bootstrap_port")
    room = body.get("bootstrap_room")
    if isinstance(room, list) or (isinstance(body.get("text"), list) and route == ROUTE_GENERATE):
        raise EngineError("Batch requests are not supported by the simulator.")
    return GenRequest(
        route=route,
        input_ids=input_ids,
        max_new_tokens=max_new,
        stream=stream,
        rid=rid or request_id or uuid.uuid4().hex,
        model=str(body.get("model") or model_name),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        bootstrap_host=body.get("bootstrap_host")
        if isinstance(body.get("bootstrap_host"), str)
        else None,
        bootstrap_port=port if isinstance(port, int) and not isinstance(port, bool) else None,
        bootstrap_room=room if isinstance(room, int) and not isinstance(room, bool) else None,
    )


def _chat_ids(body: dict[str, Any], tokenizer: Tokenizer, renderer: ChatRenderer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EngineError("messages must be a non-empty list of messages.")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise EngineError("Each message must be an object with a string 'role'.")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise EngineError("tools must be a list.")
    extra = body.get("chat_template_kwargs")
    try:
        text = renderer.render(messages, tools, extra if isinstance(extra, dict) else None)
    except TemplateError as exc:
        raise EngineError(str(exc)) from exc
    return tokenizer.encode(text, add_special_tokens=False)


def _text_ids(value: Any, tokenizer: Tokenizer, name: str) -> list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return tokenizer.encode(value, add_special_tokens=True)
    ids = _token_list(value)
    if ids is None:
        raise EngineError(f"{name} must be a string or a list of token ids.")
    return ids


# -- replies ---------------------------------------------------------------------------------


def _usage(n_prompt: int, n_completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": n_prompt,
        "total_tokens": n_prompt + n_completion,
        "completion_tokens": n_completion,
        "prompt_tokens_details": None,
    }


def _object_id(req: GenRequest) -> str:
    prefix = "chatcmpl-" if req.route == ROUTE_CHAT else "cmpl-"
    return prefix + req.rid


def full_reply(
    req: GenRequest, text: str, n_prompt: int, output_ids: list[int], finish: str
) -> dict[str, Any]:
    n_out = len(output_ids)
    if req.route in (ROUTE_RESPONSES, ROUTE_MESSAGES):
        return converse.full_reply(req.route, req.rid, req.model, text, n_prompt, n_out, finish)
    if req.route == ROUTE_GENERATE:
        return {
            "text": text,
            "output_ids": output_ids,
            "meta_info": _meta_info(req, n_prompt, n_out, finish),
        }
    if req.route == ROUTE_CHAT:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
                "reasoning_content": None,
                "tool_calls": None,
            },
            "logprobs": None,
            "finish_reason": finish,
            "matched_stop": None,
        }
        kind = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "matched_stop": None,
        }
        kind = "text_completion"
    return {
        "id": _object_id(req),
        "object": kind,
        "created": req.created,
        "model": req.model,
        "choices": [choice],
        "usage": _usage(n_prompt, n_out),
    }


def _meta_info(req: GenRequest, n_prompt: int, n_out: int, finish: str | None) -> dict[str, Any]:
    reason: dict[str, Any] | None = None
    if finish == "length":
        reason = {"type": "length", "length": n_out}
    elif finish == "stop":
        reason = {"type": "stop", "matched": None}
    return {
        "id": req.rid,
        "finish_reason": reason,
        "prompt_tokens": n_prompt,
        "completion_tokens": n_out,
        "cached_tokens": 0,
    }


class StreamShaper:
    """Turns text deltas into the route's SSE ``data:`` payloads."""

    def __init__(self, req: GenRequest, n_prompt: int) -> None:
        self.req = req
        self.n_prompt = n_prompt
        self._text: list[str] = []
        self._n_out = 0

    def first(self) -> list[dict[str, Any]]:
        if self.req.route != ROUTE_CHAT:
            return []
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def delta(self, text: str, n_tokens: int, finish: str | None = None) -> dict[str, Any]:
        self._text.append(text)
        self._n_out += n_tokens
        if self.req.route in (ROUTE_RESPONSES, ROUTE_MESSAGES):
            if finish is not None and not text:
                return converse.stream_end(self.req.route, self.n_prompt, self._n_out)
            return converse.stream_delta(self.req.route, text)
        if self.req.route == ROUTE_GENERATE:
            # SGLang's native stream repeats the cumulative text in every event.
            return {
                "text": "".join(self._text),
                "meta_info": _meta_info(self.req, self.n_prompt, self._n_out, finish),
            }
        if self.req.route == ROUTE_CHAT:
            return self._chunk({"content": text} if text or finish is None else {}, finish)
        return self._chunk(text, finish)

    def usage(self) -> dict[str, Any] | None:
        if self.req.route in (ROUTE_GENERATE, ROUTE_RESPONSES, ROUTE_MESSAGES):
            return None
        if not self.req.include_usage:
            return None
        chunk = self._chunk(None, None)
        chunk["choices"] = []
        chunk["usage"] = _usage(self.n_prompt, self._n_out)
        return chunk

    def _chunk(self, delta: Any, finish: str | None) -> dict[str, Any]:
        if self.req.route == ROUTE_CHAT:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
            }
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            kind = "text_completion"
        return {
            "id": _object_id(self.req),
            "object": kind,
            "created": self.req.created,
            "model": self.req.model,
            "choices": [choice],
            "usage": None,
        }


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
