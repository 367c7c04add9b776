"""What the engine hands its chat template: each engine's request normalisation. Pure, no I/O.

kvproxy's exact chat count is the count of what the *configured engine* renders (I1), and
both SGLang and vLLM change the request's messages before they call transformers'
`apply_chat_template`. Rendering the client's messages as sent under-counts without limit:
a `reasoning` field the engine renders as `reasoning_content`, tool-call arguments the
engine parses and the template prints re-serialised, content parts a template prints as a
list. This module mirrors each engine's rules (read from their source, cited per rule;
no code is copied) so the template sees the same data as in the engine:

vLLM (vllm/entrypoints/chat_utils.py, `_parse_chat_message_content`,
`_parse_chat_message_content_parts`, `_postprocess_messages`):
  * a new message holds only role, content, and: assistant `tool_calls` (when not None)
    and `reasoning` + `reasoning_content` (from `reasoning or reasoning_content`); tool
    `tool_call_id`; any string `name`. Every other field is dropped;
  * content: None -> no parts, a string -> one text part. With the "string" content
    format text parts are joined with "\\n"; with "openai" the template gets a list of
    `{"type": "text", "text": ...}` / `{"type": "image"}` dicts (also for string content);
  * assistant tool-call `function.arguments`: a JSON string is parsed (`json.loads`), a
    missing/empty one becomes `{}`.
SGLang (python/sglang/srt/entrypoints/openai/serving_chat.py `_apply_jinja_template`,
python/sglang/srt/parser/jinja_template_utils.py `process_content_for_template_format`):
  * content None -> ""; list content: "openai" keeps text (and tool_reference) parts as
    sent and media as `{"type": "image"|"video"|"audio"}`; "string" joins text parts with
    " "; None-valued fields are dropped;
  * string tool-call arguments are parsed (`orjson.loads`);
  * the message model may keep fields kvproxy does not know: they are kept here (a field
    a template can print is never dropped from the count).
transformers 5.x (utils/chat_template_utils.py `_normalize_chat_messages`,
`_alias_reasoning_fields`, tokenization_utils_base.py `apply_chat_template`), which both
engines call: None-valued keys are dropped; the first non-None of `reasoning_content`,
`thinking`, `reasoning` is copied to `thinking` (if absent) and `reasoning_content`; the
request's template kwargs override the tokenizer's special tokens (`bos_token`, ...).

Content format ("string" / "openai") is detected from the template the way both engines
do it: a `for` loop over a message's `content` means "openai" (`content_formats`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import jinja2
import jinja2.nodes

from kvproxy.prompt import REFUSED_TEMPLATE_KWARGS as REFUSED_KWARGS
from kvproxy.tokens.replica.sandbox import Sandbox, environment

EngineKind = Literal["sglang", "vllm"]
ContentFormat = Literal["string", "openai"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("sglang", "vllm")

# transformers' SPECIAL_TOKENS_ATTRIBUTES: every one is a template variable that the
# request's chat_template_kwargs override (`{**special_tokens_map, **kwargs}`).
SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_TEXT_TYPES = frozenset({"text", "input_text", "output_text"})
_MEDIA_TYPES = {
    "image_url": "image", "input_image": "image", "image": "image", "image_pil": "image",
    "video_url": "video", "video": "video",
    "input_audio": "audio", "audio_url": "audio", "audio": "audio",
}  # fmt: skip


def content_formats(source: str) -> tuple[ContentFormat, ...]:
    """The content formats an engine may detect for this template, most likely first.

    ("openai",) when the template loops over a message's content, as vLLM's
    `_detect_content_format` and SGLang's `detect_jinja_template_content_format` decide;
    ("string", "openai") when it loops over a macro argument or a `content` variable (the
    engines' detectors differ by version there: both are counted for list content);
    ("string",) otherwise, and when the template does not parse (both engines)."""
    try:
        ast = environment(Sandbox).parse(source)
    except jinja2.TemplateError:
        return ("string",)
    content_names = {
        target.name
        for node in ast.find_all(jinja2.nodes.Assign)
        if isinstance(target := node.target, jinja2.nodes.Name) and _is_content(node.node)
    }
    macro_args = {a.name for m in ast.find_all(jinja2.nodes.Macro) for a in m.args}
    unsure = False
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        while isinstance(it, (jinja2.nodes.Filter, jinja2.nodes.Test)) and it.node is not None:
            it = it.node
        if _is_content(it) or (isinstance(it, jinja2.nodes.Name) and it.name in content_names):
            return ("openai",)
        if isinstance(it, jinja2.nodes.Name) and (it.name in macro_args or it.name == "content"):
            unsure = True
    return ("string", "openai") if unsure else ("string",)


def _is_content(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        arg = node.arg
        return isinstance(arg, jinja2.nodes.Const) and arg.value == "content"
    return False


def is_plain(messages: Iterable[Mapping[str, Any]]) -> bool:
    """Only role and string content: the common case, which every engine passes unchanged
    to a "string"-format template (the hot path skips normalisation for it)."""
    return all(len(m) == 2 and isinstance(m.get("content"), str) for m in messages)


def passes_unchanged(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None,
    engines: Sequence[EngineKind],
    formats: Sequence[ContentFormat],
) -> bool:
    """Every configured engine hands these messages to the template as they are."""
    return (
        tools is None and is_plain(messages) and (formats[0] == "string" or "vllm" not in engines)
    )


def engine_messages(
    messages: Sequence[Mapping[str, Any]], engine: EngineKind, content_format: ContentFormat
) -> list[dict[str, Any]]:
    """The messages `engine` passes to transformers' apply_chat_template."""
    if engine == "vllm":
        return [_vllm_message(m, content_format) for m in messages]
    return [_sglang_message(m, content_format) for m in messages]


def normalize(
    messages: Sequence[Mapping[str, Any]], engine: EngineKind, content_format: ContentFormat
) -> list[dict[str, Any]]:
    """The messages the template sees: the engine's, after transformers' own changes."""
    return [_transformers_message(m) for m in engine_messages(messages, engine, content_format)]


Variant = tuple[list[dict[str, Any]], list[Any] | None]


def template_variants(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None,
    engines: Sequence[EngineKind],
    formats: Sequence[ContentFormat],
) -> list[Variant]:
    """(messages, tools) as each configured engine hands them to the template, deduplicated.

    Plain role/content messages without tools pass unchanged except through vLLM on a
    template detected as "openai" (string content becomes a one-part list); for them no
    second render is made when the format is only possibly "openai" (`content_formats`)."""
    if passes_unchanged(messages, tools, engines, formats):
        return [([dict(m) for m in messages], None)]
    if tools is None and is_plain(messages):
        formats = formats[:1]
    variants: list[Variant] = []
    for engine in engines:
        engine_tools_ = engine_tools(tools, engine)
        for fmt in formats:
            v = (normalize(messages, engine, fmt), engine_tools_)
            if v not in variants:
                variants.append(v)
    return variants


def engine_tools(tools: Sequence[Any] | None, engine: EngineKind) -> list[Any] | None:
    """The tool definitions `engine` passes to the template: its pydantic models dumped.

    vLLM (entrypoints/openai/protocol.py `ChatCompletionToolsParam`, `FunctionDefinition`;
    serving_chat.py `tool.model_dump()`): `{"type", "function": {"name", "description",
    "parameters", ...extra}}` with None kept (its models allow extra fields). SGLang
    (entrypoints/openai/protocol.py `Function`; serving_chat.py
    `item.function.model_dump()`): the function alone, `{"description", "name",
    "parameters", "strict"}` with None kept. A template's `tojson` prints the nulls."""
    if not tools:
        return None
    out: list[Any] = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict):
            out.append(tool)  # the engine refuses it: nothing is rendered
            continue
        declared = {
            "name": fn.get("name"),
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        if engine == "vllm":
            extra_fn = {k: v for k, v in fn.items() if k not in declared}
            extra = {k: v for k, v in tool.items() if k not in ("type", "function")}
            body = {**declared, **extra_fn}
            out.append({"type": tool.get("type", "function"), "function": body, **extra})
        else:
            dumped = {
                "description": declared["description"],
                "name": declared["name"],
                "parameters": declared["parameters"],
                "strict": fn.get("strict", False),
            }
            if fn.get("defer_loading") is not None:
                dumped["defer_loading"] = fn["defer_loading"]
            out.append(dumped)
    return out


# --- vLLM ---------------------------------------------------------------------------------


def _vllm_message(msg: Mapping[str, Any], fmt: ContentFormat) -> dict[str, Any]:
    role = msg.get("role")
    content = msg.get("content")
    parts: list[Any] = [] if content is None else [content] if isinstance(content, str) else content
    out: dict[str, Any] = {"role": role, "content": _vllm_content(parts, fmt)}
    if role == "assistant":
        calls = msg.get("tool_calls")
        if calls is not None:
            out["tool_calls"] = [_vllm_call(c) for c in calls]
        reasoning = msg.get("reasoning") or msg.get("reasoning_content")
        if reasoning is not None:
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in msg:
        out["tool_call_id"] = msg["tool_call_id"]
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    return out


def _vllm_content(parts: list[Any], fmt: ContentFormat) -> Any:
    items: list[Any] = []
    for part in parts:
        text = _part_text(part)
        if text is not None:
            items.append({"type": "text", "text": text} if fmt == "openai" else text)
        elif fmt == "openai" and isinstance(part, dict) and part.get("type") in _MEDIA_TYPES:
            items.append({"type": _MEDIA_TYPES[part["type"]]})
    if fmt == "openai":
        return items
    # Media become model-specific placeholder strings in the text; kvproxy charges their
    # configured token cost instead (counter).
    return "\n".join(items)


def _vllm_call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    args = fn.get("arguments")
    if not args:
        fn["arguments"] = {}
    elif not isinstance(args, (dict, list)):
        fn["arguments"] = _loads(args)
    return {**call, "function": fn}


# --- SGLang -------------------------------------------------------------------------------


def _sglang_message(msg: Mapping[str, Any], fmt: ContentFormat) -> dict[str, Any]:
    out = {k: v for k, v in msg.items() if v is not None}
    content = msg.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        if fmt == "openai":
            parts: list[Any] = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else "text"
                if isinstance(part, str):
                    parts.append({"type": "text", "text": part})
                elif kind in _MEDIA_TYPES:
                    parts.append({"type": _MEDIA_TYPES[kind]})
                elif kind in _TEXT_TYPES or kind in ("refusal", "tool_reference"):
                    parts.append(part)
            out["content"] = parts
        else:
            out["content"] = " ".join(t for t in map(_part_text, content) if t is not None)
    calls = out.get("tool_calls")
    if out.get("role") == "assistant" and isinstance(calls, list):
        out["tool_calls"] = [_sglang_call(c) for c in calls]
    return out


def _sglang_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    return {**call, "function": {**fn, "arguments": _loads(fn["arguments"])}}


# --- transformers ------------------------------------------------------------------------


def _transformers_message(msg: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in msg.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        # Key order as transformers builds it: `thinking` first unless present, then the rest.
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict):
        kind = part.get("type")
        if kind in _TEXT_TYPES:
            return str(part.get("text", ""))
        if kind == "refusal":
            return str(part.get("refusal", ""))
    return None


def _loads(args: Any) -> Any:
    # An argument string that is not JSON makes the engine fail the request (nothing is
    # rendered); kvproxy then counts the string as sent, which covers the raw text.
    try:
        return json.loads(args)
    except (ValueError, TypeError, RecursionError):
        return args


def reserialised_bytes(args: str) -> int:
    """Bytes a template can print for an arguments string the engine parsed: the larger of
    the raw text, its JSON re-serialisations (with and without ASCII escapes) and Python's
    repr of the parsed value (`{{ arguments }}` of a dict). For the template-free bound."""
    parsed = _loads(args)
    sizes = [len(args.encode("utf-8", "surrogatepass"))]
    if parsed is not args:
        for text in (
            json.dumps(parsed, ensure_ascii=False),
            json.dumps(parsed),
            str(parsed),
        ):
            sizes.append(len(text.encode("utf-8", "surrogatepass")))
    return max(sizes)


__all__ = [
    "ENGINE_KINDS",
    "REFUSED_KWARGS",
    "SPECIAL_TOKEN_KEYS",
    "ContentFormat",
    "EngineKind",
    "content_formats",
    "engine_messages",
    "engine_tools",
    "is_plain",
    "normalize",
    "reserialised_bytes",
    "template_variants",
]
