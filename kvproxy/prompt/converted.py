"""Prompt extraction for the inference routes beyond chat, completions and `/generate`.

Owns: `/v1/responses` and `/v1/messages`, converted into the same chat `SequencePrompt` the
chat route builds, so the template render, bounds and exact counts apply unchanged; and the
dispatch to the prompt-only routes (`kvproxy.prompt.prompt_only`). Pure functions, no I/O; errors
are 400 `invalid_request` naming the field, never quoting request text (I8).

The conversions mirror how smg (the router in front of the engines) turns these requests
into engine input: `responses_to_chat` in smg's
`model_gateway/src/routers/grpc/regular/responses/conversions.rs` and `process_messages` in
`model_gateway/src/routers/grpc/utils/message_utils.rs`. A field with no known rendering is
refused, or bounded by over-counting it (never dropped): a count may come out high, never
low (I1).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvproxy.policy import Route, invalid_request
from kvproxy.prompt.chat import _chat
from kvproxy.prompt.prompt_only import PROMPT_ONLY
from kvproxy.prompt.shape import PromptShape, SequencePrompt, _json_text, _opt_int

# Fields naming context the engine or router stores and the proxy cannot see: the prompt the
# engine would prefill is that stored history plus this request, of unknown size. Bounding
# it is impossible, so such requests are refused rather than admitted uncounted (I1).
_STORED_CONTEXT = ("previous_response_id", "conversation", "prompt")


def parse(route: Route, data: Mapping[str, Any], raw: bytes) -> PromptShape:
    """Parse an already-decoded JSON object for one of this module's routes."""
    body_bytes = len(raw)
    if route in ("responses", "messages"):
        parse_chat = _responses if route == "responses" else _messages
        seq, out, param = parse_chat(data)
        stream = data.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise invalid_request("stream must be a boolean", "stream")
        return PromptShape(
            route, (seq,), out, 1, bool(stream), body_bytes, param, body=data, raw=raw
        )
    parser = PROMPT_ONLY.get(route)
    if parser is None:  # a programming error: the route table names a route with no parser
        raise invalid_request(f"route {route} has no parser", None)
    prompts, param = parser(data)
    return PromptShape(
        route, prompts, None, 1, False, body_bytes, param, generates=False, body=data, raw=raw
    )


# --- /v1/responses -------------------------------------------------------------------------


def _responses(data: Mapping[str, Any]) -> tuple[SequencePrompt, int | None, str]:
    for key in _STORED_CONTEXT:
        if data.get(key) is not None:
            raise invalid_request(
                f"{key} refers to context stored upstream that kvproxy cannot count; "
                "send the full conversation in input",
                key,
            )
    if data.get("background") is True:
        # The engine would keep generating after the reply: no disconnect to defer, no
        # upstream connection to hold the in-flight budget (I5, I6).
        raise invalid_request(
            "background responses are not supported through kvproxy", "background"
        )
    messages: list[dict[str, Any]] = []
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid_request("instructions must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    items = data.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list) and items:
        for i, item in enumerate(items):
            _response_item(item, f"input[{i}]", messages)
    else:
        raise invalid_request("input must be a string or a non-empty array of items", "input")
    chat: dict[str, Any] = {"messages": messages}
    tools = data.get("tools")
    if tools is not None:
        chat["tools"] = [_response_tool(t, f"tools[{i}]") for i, t in _items(tools, "tools")]
    reasoning = data.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise invalid_request("reasoning must be an object", "reasoning")
        effort = reasoning.get("effort")
        if effort is not None:
            if not isinstance(effort, str):
                raise invalid_request("reasoning.effort must be a string", "reasoning.effort")
            # smg passes it on as chat's reasoning_effort, which templates may print.
            chat["chat_template_kwargs"] = {"reasoning_effort": effort}
    out = _opt_int(data, "max_output_tokens")
    return _chat(chat), out, "input"


def _response_item(item: Any, p: str, messages: list[dict[str, Any]]) -> None:
    if not isinstance(item, dict):
        raise invalid_request(f"{p} must be an object", p)
    kind = item.get("type")
    if kind is None or kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise invalid_request(
                f"{p}.role must be one of user, assistant, system, developer", f"{p}.role"
            )
        # smg maps any other role (developer) to a user message.
        chat_role = role if role in ("user", "assistant", "system") else "user"
        messages.append({"role": chat_role, "content": _response_content(item, p)})
    elif kind == "function_call":
        call_id = _string(item, "call_id", p)
        call = {
            "id": call_id,
            "type": "function",
            "function": {
                "name": _string(item, "name", p),
                "arguments": _string(item, "arguments", p),
            },
        }
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        if item.get("output") is not None:
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": _string(item, "output", p)}
            )
    elif kind == "function_call_output":
        call_id = _string(item, "call_id", p)
        output = item.get("output")
        content = output if isinstance(output, str) else _response_parts(output, f"{p}.output")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
    elif kind == "reasoning":
        if item.get("encrypted_content") is not None:
            p2 = f"{p}.encrypted_content"
            raise invalid_request(f"{p2} is opaque to the engines and cannot be counted", p2)
        texts = _text_blocks(item.get("content"), f"{p}.content", "reasoning_text")
        # smg renders only `content`; the summary is counted too, so a count can only be high.
        texts += _text_blocks(item.get("summary"), f"{p}.summary", "summary_text")
        messages.append(
            {"role": "assistant", "content": None, "reasoning_content": "\n".join(texts)}
        )
    else:
        # smg refuses every other item type ("Unsupported input item type"); item_reference
        # and tool-call items of built-in tools point at context the proxy cannot see.
        raise invalid_request(f"{p}.type is not a supported input item type", f"{p}.type")


def _response_content(item: Mapping[str, Any], p: str) -> str | list[dict[str, Any]]:
    content = item.get("content")
    if isinstance(content, str):
        return content
    parts = _response_parts(content, f"{p}.content")
    if len(parts) == 1 and parts[0]["type"] == "text":
        # smg hands the engine a string; one part is that string whatever smg joins with.
        return str(parts[0]["text"])
    return parts


def _response_parts(parts: Any, p: str) -> list[dict[str, Any]]:
    """Content parts as chat parts; several text parts stay a list, so the counter charges
    the join it cannot see (smg joins them with "" or " ", templates may use "\\n")."""
    out: list[dict[str, Any]] = []
    for j, part in _items(parts, p):
        pp = f"{p}[{j}]"
        if not isinstance(part, dict):
            raise invalid_request(f"{pp} must be an object", pp)
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            out.append({"type": "text", "text": _string(part, "text", pp)})
        elif kind == "refusal":
            out.append({"type": "text", "text": _string(part, "refusal", pp)})
        elif kind == "input_image":
            # smg drops images on its text path; an engine that renders them costs the
            # configured image tokens: counting them is the safe side.
            out.append({"type": "image"})
        elif kind == "input_audio":
            out.append({"type": "input_audio"})
        else:
            # input_file (PDFs and the like) has no token cost kvproxy can bound.
            raise invalid_request(f"{pp}.type is not a supported content part type", f"{pp}.type")
    return out


def _response_tool(tool: Any, p: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise invalid_request(f"{p} must be an object", p)
    if tool.get("type") != "function":
        # Built-in and MCP tools run a tool loop inside the router or engine: every turn is a
        # new prompt, with tool output, that never passes through kvproxy.
        raise invalid_request(
            f"{p}.type must be function: built-in and MCP tools cannot be counted", f"{p}.type"
        )
    fn: dict[str, Any] = {"name": _string(tool, "name", p)}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


# --- /v1/messages (Anthropic) --------------------------------------------------------------


def _messages(data: Mapping[str, Any]) -> tuple[SequencePrompt, int | None, str]:
    if data.get("mcp_servers") is not None:
        raise invalid_request(
            "mcp_servers run a tool loop upstream that kvproxy cannot count", "mcp_servers"
        )
    out = _opt_int(data, "max_tokens")
    if out is None:
        raise invalid_request("max_tokens is required", "max_tokens")
    messages: list[dict[str, Any]] = []
    system = data.get("system")
    if system is not None:
        text = system if isinstance(system, str) else "\n".join(_text_blocks(system, "system"))
        messages.append({"role": "system", "content": text})
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid_request("messages must be a non-empty array of message objects", "messages")
    for i, msg in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid_request(f"{p} must be an object", p)
        role = msg.get("role")
        content = msg.get("content")
        if role not in ("user", "assistant", "system"):
            raise invalid_request(f"{p}.role must be user, assistant or system", f"{p}.role")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
        elif role == "user":
            _anthropic_user(content, f"{p}.content", messages)
        elif role == "assistant":
            messages.append(_anthropic_assistant(content, f"{p}.content"))
        else:
            texts = _text_blocks(content, f"{p}.content")
            messages.append({"role": "system", "content": "\n".join(texts)})
    chat: dict[str, Any] = {"messages": messages}
    tools = data.get("tools")
    if tools is not None:
        chat["tools"] = [_anthropic_tool(t, f"tools[{i}]") for i, t in _items(tools, "tools")]
    thinking = data.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            p = "thinking.type"
            raise invalid_request(f"{p} must be enabled, disabled or adaptive", p)
        # smg sets the model's own toggle (enable_thinking or thinking); kvproxy sets both,
        # so the template renders the same branch whichever name it reads.
        on = kind != "disabled"
        chat["chat_template_kwargs"] = {"enable_thinking": on, "thinking": on}
    return _chat(chat), out, "messages"


def _anthropic_user(content: Any, p: str, messages: list[dict[str, Any]]) -> None:
    """smg: text and image blocks become one user message, each tool_result its own tool
    message after it."""
    parts: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    for j, block in _blocks(content, p):
        pb = f"{p}[{j}]"
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _string(block, "text", pb)})
        elif kind == "image":
            parts.append({"type": "image"})
        elif kind == "tool_result":
            result = block.get("content")
            if result is None or isinstance(result, str):
                text: Any = result or ""
            else:
                # Text blocks are joined by smg; images in a result are counted as images.
                text = []
                for k, b in _blocks(result, f"{pb}.content"):
                    if b.get("type") == "image":
                        text.append({"type": "image"})
                    elif b.get("type") == "text":
                        text.append(
                            {"type": "text", "text": _string(b, "text", f"{pb}.content[{k}]")}
                        )
                    else:
                        pt = f"{pb}.content[{k}].type"
                        raise invalid_request(f"{pt} is not a supported tool_result block", pt)
                if all(part["type"] == "text" for part in text):
                    # Exactly smg's string: text blocks joined with "\n".
                    text = "\n".join(part["text"] for part in text)
            tool_id = _string(block, "tool_use_id", pb)
            tools.append({"role": "tool", "tool_call_id": tool_id, "content": text})
        else:
            # document blocks (PDFs) have no bounded cost; other blocks do not belong here.
            raise invalid_request(f"{pb}.type is not supported in a user message", f"{pb}.type")
    if parts:
        messages.append({"role": "user", "content": parts})
    messages.extend(tools)


def _anthropic_assistant(content: Any, p: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, block in _blocks(content, p):
        pb = f"{p}[{j}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_string(block, "text", pb))
        elif kind == "tool_use":
            args = block.get("input")
            if not isinstance(args, dict):
                raise invalid_request(f"{pb}.input must be an object", f"{pb}.input")
            fn = {"name": _string(block, "name", pb), "arguments": _json_text(args, f"{pb}.input")}
            calls.append({"id": _string(block, "id", pb), "type": "function", "function": fn})
        elif kind == "thinking":
            thinking.append(_string(block, "thinking", pb))
        else:
            # redacted_thinking is opaque; server tool blocks carry results kvproxy never saw.
            raise invalid_request(
                f"{pb}.type is not supported in an assistant message", f"{pb}.type"
            )
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    return msg


def _anthropic_tool(tool: Any, p: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise invalid_request(f"{p} must be an object", p)
    if tool.get("type") not in (None, "custom"):
        # Server tools (bash, text_editor, web_search, MCP toolsets) run upstream.
        raise invalid_request(
            f"{p}.type must be custom: server tools cannot be counted", f"{p}.type"
        )
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise invalid_request(f"{p}.input_schema must be an object", f"{p}.input_schema")
    fn: dict[str, Any] = {"name": _string(tool, "name", p), "parameters": schema}
    if tool.get("description") is not None:
        fn["description"] = _string(tool, "description", p)
    return {"type": "function", "function": fn}


# --- small helpers --------------------------------------------------------------------------


def _string(obj: Mapping[str, Any], key: str, p: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise invalid_request(f"{p}.{key} must be a string", f"{p}.{key}")
    return value


def _items(value: Any, p: str) -> list[tuple[int, Any]]:
    if not isinstance(value, list):
        raise invalid_request(f"{p} must be an array", p)
    return list(enumerate(value))


def _blocks(value: Any, p: str) -> list[tuple[int, dict[str, Any]]]:
    """An Anthropic content array: every block an object."""
    out = []
    for j, block in _items(value, p):
        if not isinstance(block, dict):
            raise invalid_request(f"{p}[{j}] must be an object", f"{p}[{j}]")
        out.append((j, block))
    return out


def _text_blocks(value: Any, p: str, kind: str = "text") -> list[str]:
    """Text of an array of `{"type": kind, "text": ...}` blocks; None is no blocks."""
    if value is None:
        return []
    texts = []
    for j, block in _blocks(value, p):
        if block.get("type") != kind:
            raise invalid_request(f"{p}[{j}].type must be {kind}", f"{p}[{j}].type")
        texts.append(_string(block, "text", f"{p}[{j}]"))
    return texts


__all__ = ["parse"]
