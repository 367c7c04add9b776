"""How the simulated serving stack turns `/v1/responses` and `/v1/messages` into chat.

Owns: the conversion, written on its own after smg's (the router users run):
`responses_to_chat` (model_gateway/src/routers/grpc/regular/responses/conversions.rs) and
`process_messages` (model_gateway/src/routers/grpc/utils/message_utils.rs). The result is
a chat body (messages, tools) that the engine renders with its chat template like any chat
request, so the simulator's ground truth for these routes is the same render-and-tokenize
it does for chat. Reply shapes of both APIs live here too.

Independent oracle: imports nothing from kvproxy outside ``kvproxy/sim``; sans-IO.
"""

from __future__ import annotations

import json
from typing import Any

from kvproxy.sim.limits import EngineError

ROUTE_RESPONSES = "/v1/responses"
ROUTE_MESSAGES = "/v1/messages"


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise EngineError(f"{what} must be a string")
    return value


def responses_chat_body(body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """(chat body, max new tokens) for a Responses request."""
    if body.get("previous_response_id") is not None:
        raise EngineError("previous_response_id is not stored by the simulator")
    messages: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            if not isinstance(item, dict):
                raise EngineError("each input item must be an object")
            messages.extend(_response_item(item))
    else:
        raise EngineError("input must be a string or a list of items")
    if not messages:
        raise EngineError("Request must contain at least one message")
    tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
        for t in body.get("tools") or []
        if isinstance(t, dict) and t.get("type") == "function"
    ]
    chat: dict[str, Any] = {"messages": messages, "tools": tools or None}
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["chat_template_kwargs"] = {"reasoning_effort": effort}
    return chat, body.get("max_output_tokens")


def _response_item(item: dict[str, Any]) -> list[dict[str, Any]]:
    kind = item.get("type")
    if kind in (None, "message"):
        content = item.get("content")
        if not isinstance(content, str):
            sep = " " if kind is None else ""
            content = sep.join(
                str(p.get("text") if p.get("type") != "refusal" else p.get("refusal"))
                for p in content or []
                if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "refusal")
            )
        role = item.get("role")
        return [
            {
                "role": role if role in ("user", "assistant", "system") else "user",
                "content": content,
            }
        ]
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
        }
        out = [{"role": "assistant", "content": None, "tool_calls": [call]}]
        if item.get("output") is not None:
            out.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": item["output"]}
            )
        return out
    if kind == "function_call_output":
        return [
            {"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")}
        ]
    if kind == "reasoning":
        text = "\n".join(
            str(c.get("text")) for c in item.get("content") or [] if isinstance(c, dict)
        )
        return [{"role": "assistant", "content": None, "reasoning_content": text}]
    raise EngineError("Unsupported input item type")


def messages_chat_body(body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """(chat body, max new tokens) for an Anthropic Messages request."""
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise EngineError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for msg in given:
        if not isinstance(msg, dict):
            raise EngineError("each message must be an object")
        role, content = msg.get("role"), msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif role == "user":
            out.extend(_user_blocks(content or []))
        elif role == "assistant":
            out.append(_assistant_blocks(content or []))
        else:
            texts = [b.get("text", "") for b in content or [] if b.get("type") == "text"]
            out.append({"role": "system", "content": "\n".join(texts)})
    system = body.get("system")
    if system is not None:
        if not isinstance(system, str):
            system = "\n".join(str(b.get("text")) for b in system if isinstance(b, dict))
        out.insert(0, {"role": "system", "content": system})
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.get("name"),
                **({"description": t["description"]} if t.get("description") is not None else {}),
                "parameters": t.get("input_schema"),
            },
        }
        for t in body.get("tools") or []
        if isinstance(t, dict) and t.get("type") in (None, "custom")
    ]
    chat: dict[str, Any] = {"messages": out, "tools": tools or None}
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled", "adaptive"):
        on = thinking["type"] != "disabled"
        chat["chat_template_kwargs"] = {"enable_thinking": on, "thinking": on}
    if body.get("max_tokens") is None:
        raise EngineError("max_tokens: field required")
    return chat, body.get("max_tokens")


def _user_blocks(blocks: list[Any]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    for b in blocks:
        if not isinstance(b, dict):
            raise EngineError("each content block must be an object")
        if b.get("type") == "text":
            parts.append({"type": "text", "text": b.get("text")})
        elif b.get("type") == "tool_result":
            result = b.get("content")
            if isinstance(result, list):
                result = "\n".join(str(x.get("text")) for x in result if x.get("type") == "text")
            tools.append(
                {"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": result or ""}
            )
    user = [{"role": "user", "content": parts}] if parts else []
    return user + tools


def _assistant_blocks(blocks: list[Any]) -> dict[str, Any]:
    texts, calls, thinking = [], [], []
    for b in blocks:
        if b.get("type") == "text":
            texts.append(str(b.get("text")))
        elif b.get("type") == "tool_use":
            fn = {
                "name": b.get("name"),
                "arguments": json.dumps(b.get("input"), separators=(",", ":")),
            }
            calls.append({"id": b.get("id"), "type": "function", "function": fn})
        elif b.get("type") == "thinking":
            thinking.append(str(b.get("thinking")))
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    return msg


# -- replies ---------------------------------------------------------------------------------


def full_reply(
    route: str, rid: str, model: str, text: str, n_prompt: int, n_out: int, finish: str
) -> dict[str, Any]:
    if route == ROUTE_RESPONSES:
        return {
            "id": "resp_" + rid,
            "object": "response",
            "status": "completed" if finish == "stop" else "incomplete",
            "model": model,
            "output": [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ],
            "usage": {
                "input_tokens": n_prompt,
                "output_tokens": n_out,
                "total_tokens": n_prompt + n_out,
            },
        }
    return {
        "id": "msg_" + rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn" if finish == "stop" else "max_tokens",
        "usage": {"input_tokens": n_prompt, "output_tokens": n_out},
    }


def stream_delta(route: str, text: str) -> dict[str, Any]:
    if route == ROUTE_RESPONSES:
        return {"type": "response.output_text.delta", "delta": text}
    return {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": text},
    }


def stream_end(route: str, n_prompt: int, n_out: int) -> dict[str, Any]:
    if route == ROUTE_RESPONSES:
        usage = {"input_tokens": n_prompt, "output_tokens": n_out, "total_tokens": n_prompt + n_out}
        return {"type": "response.completed", "response": {"usage": usage}}
    return {
        "type": "message_delta",
        "delta": {},
        "usage": {"input_tokens": n_prompt, "output_tokens": n_out},
    }
