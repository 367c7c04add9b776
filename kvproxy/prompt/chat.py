"""Chat requests (`/v1/chat/completions`, and the chat form `/v1/responses` and
`/v1/messages` are converted to): every string a chat template can emit lands in the
`SequencePrompt`, so the bound built on it covers what the engine will render (I1). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvproxy.policy import invalid_request
from kvproxy.prompt.shape import (
    AUDIO_PART_TYPES,
    IMAGE_PART_TYPES,
    TEXT_PART_TYPES,
    SequencePrompt,
    _json_text,
    _str_or_none,
)

# --- messages ------------------------------------------------------------------------------------


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
        keys = len(msg)
        if keys == 1 or (keys == 2 and "content" in msg):
            # Only role (read above, so present) and content, the common case: no other
            # field holds text.
            continue
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
        _other_fields(msg, f"messages[{i}]", texts)

    tools = data.get("tools")
    if tools is None:
        tools = data.get("functions")  # legacy name; templates see it as tools
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise invalid_request("tools must be an array of objects", "tools")
    kwargs = _template_kwargs(data)
    agp = data.get("add_generation_prompt", True)
    if not isinstance(agp, bool):
        raise invalid_request("add_generation_prompt must be a boolean", "add_generation_prompt")
    # continue_final_message renders a prefix of the whole conversation (transformers cuts
    # the render after the last message's content): counting the whole render covers it.
    if not isinstance(data.get("continue_final_message", False), bool):
        p = "continue_final_message"
        raise invalid_request(f"{p} must be a boolean", p)
    # Positional, one field a line in declaration order: every chat builds one, and
    # matching nine keywords cost twice as much as building it.
    return SequencePrompt(
        tuple(texts),  # texts
        0,  # token_ids
        tuple(messages),  # messages
        tuple(tools) if tools else None,  # tools
        _json_text(tools, "tools") if tools else "",  # tools_json
        images,  # images
        audios,  # audios
        dict(kwargs) if kwargs else {},  # template_kwargs
        _json_text(kwargs, "chat_template_kwargs") if kwargs else "",  # template_kwargs_json
        agp,  # add_generation_prompt
    )


# chat_template_kwargs keys kvproxy refuses: apply_chat_template's own arguments (passed
# twice they fail in the engine, or, merged, replace what was counted) and template
# globals. `chat_template` is the field gate's (prompt.fields): refused unless the operator
# trusts request templates, then bounded by that template's own proof. Special tokens
# (bos_token, ...) are rendered exactly instead (tokens.replica.chatnorm).
REFUSED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "tools", "documents", "add_generation_prompt",
     "continue_final_message", "tokenize", "return_dict", "padding",
     "truncation", "max_length", "return_tensors", "tokenizer_kwargs", "processor_kwargs",
     "return_assistant_tokens_mask", "sanitize_control_tokens", "raise_exception",
     "strftime_now", "namespace", "dict", "range", "lipsum", "cycler", "joiner"}
)  # fmt: skip


def _template_kwargs(data: Mapping[str, Any]) -> dict[str, Any] | None:
    """The variables the engines pass the template beyond messages/tools, or a 400."""
    if _KWARGS_FIELDS.isdisjoint(data):
        return None  # most bodies: one C call instead of three lookups and their tests
    kwargs = data.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise invalid_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    for key in kwargs or ():
        if key in REFUSED_TEMPLATE_KWARGS or not isinstance(key, str) or key.startswith("_"):
            p = f"chat_template_kwargs.{key}"
            raise invalid_request(
                f"{p} names a template argument or global kvproxy cannot count; "
                "use the request field of that name",
                p,
            )
    documents = data.get("documents")
    if documents is not None:
        # vLLM hands `documents` to the template (RAG templates print them).
        kwargs = {**(kwargs or {}), "documents": documents}
    effort = data.get("reasoning_effort")
    if effort is not None and "reasoning_effort" not in (kwargs or {}):
        # Both engines pass reasoning_effort to apply_chat_template (gpt-oss templates print
        # it): vLLM serving_chat.py, SGLang serving_chat.py `_apply_jinja_template`.
        kwargs = {**(kwargs or {}), "reasoning_effort": effort}
    return kwargs


# The request fields `_template_kwargs` reads.
_KWARGS_FIELDS = frozenset({"chat_template_kwargs", "documents", "reasoning_effort"})
_MESSAGE_STRINGS = ("name", "reasoning_content", "reasoning", "tool_call_id", "refusal")
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
        if kind is not None and not isinstance(kind, str):
            # Checked before any set lookup: a list or object here is unhashable.
            raise invalid_request(f"{pp}.type must be a string", f"{pp}.type")
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
