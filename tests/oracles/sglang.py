"""SGLang's request preprocessing, replicated from its source (releases in `versions.py`).

`count(model, route, body)` is the number of tokens SGLang 0.5.23 prefills for the request
body `body` on `route` (chat, completions, generate, responses), or raises `Refused` when
it answers 4xx. The server configuration replicated is the plain one: the model's own
Jinja template (no `--chat-template`, no Python encoder), no `--reasoning-parser` or
`--tool-call-parser` (they constrain decoding, not the prompt), no default template kwargs,
radix cache on. Every step cites the file and function it comes from; `sglang@v0.5.23`
means that release's wheel (`versions.ARTIFACTS`).

Order of SGLang's steps for a chat request, all replicated here:
  1. orjson parses the body (http_server.py ORJSONRequest.json)
  2. pydantic validates ChatCompletionRequest (protocol.py): `reasoning` and
     `reasoning_effort` become `thinking`/`enable_thinking` kwargs, roles are lower-cased,
     unknown fields are dropped, tools keep the client's key order
  3. serving_chat.py _validate_request, _convert_to_internal_request, _process_messages
  4. _apply_jinja_template: model_dump of every message, tool-call arguments parsed with
     orjson, content parts flattened for the template's content format, tool text parts
     joined with " ", a final assistant message turned into a user turn (or, with
     continue_final_message, appended raw after the generation prompt)
  5. transformers renders (add_generation_prompt always true), the tokenizer encodes.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import jinja2
import jinja2.nodes
import orjson

from oracles.common import Count, Refused, Unmodelled, batch, one
from oracles.models import Model

SRC = "sglang@v0.5.23"

# sglang@v0.5.23 protocol.py _GenericMessageRole ("user" has its own model, exact match).
GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")
# protocol.py ReasoningEffortTier
EFFORT_TIERS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"})
MEDIA_PART_TYPES = frozenset({"image_url", "video_url", "audio_url", "input_audio"})
# protocol.py ChatCompletionMessageContent{Image,Video,Audio}URL: the fields a dump carries.
MEDIA_FIELDS = {
    "image_url": ("url", "detail", "max_dynamic_patch", "min_dynamic_patch",
                  "max_long_side_pixel", "content_hash"),
    "video_url": ("url", "max_dynamic_patch", "min_dynamic_patch", "fps", "max_frames",
                  "max_tokens_per_frame", "max_image_tokens", "max_long_side_pixel"),
    "audio_url": ("url",),
}  # fmt: skip


# --- parsing --------------------------------------------------------------------------------


def parse(body: bytes) -> dict[str, Any]:
    """sglang@v0.5.23 http_server.py ORJSONRequest.json: orjson, so NaN/Infinity and
    numbers orjson cannot hold refuse; integers beyond 64 bits become floats (the orjson
    the test venv runs, versions.ORJSON_VERSION)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise Refused(f"json: {exc}") from None
    if not isinstance(data, dict):
        raise Refused("body is not an object")
    return data


def _opt_str(v: Any, what: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise Refused(f"{what} must be a string")


# --- content parts (protocol.py ChatCompletionMessageContentPart) ---------------------------


def _part(p: Any, role: str) -> dict[str, Any]:
    """One content part as pydantic validates and dumps it (protocol.py
    ChatCompletionMessageContent*Part; the smart union picks the model whose `type`
    literal matches). Media parts keep only what the template step reads."""
    if not isinstance(p, dict):
        raise Refused("content part must be an object")
    t = p.get("type")
    if t == "text":
        if not isinstance(p.get("text"), str):
            raise Refused("text part needs text")
        return {"type": "text", "text": p["text"]}
    if t in ("thinking", "reasoning"):
        thinking, text = p.get("thinking"), p.get("text")
        _opt_str(thinking, "thinking")
        _opt_str(text, "text")
        if (thinking is None) == (text is None):
            raise Refused("thinking parts require exactly one of thinking or text")
        if role != "assistant":
            raise Refused("thinking parts are only valid in assistant messages")
        return {"type": t, "thinking": thinking, "text": text}
    if t == "tool_reference":
        if not isinstance(p.get("name"), str):
            raise Refused("tool_reference needs a name")
        return {"type": "tool_reference", "name": p["name"]}
    if t in ("image_url", "video_url", "audio_url"):
        inner = p.get(t)
        if not isinstance(inner, dict) or not isinstance(inner.get("url"), str):
            raise Refused(f"{t} needs an object with a url")
        fields = MEDIA_FIELDS[t]
        if any(k != "url" and inner.get(k) is not None for k in fields):
            raise Unmodelled(f"{t} options")
        dumped = dict.fromkeys(fields) | {"url": inner["url"]}
        if t == "image_url":
            dumped["detail"] = "auto"
            return {"type": t, t: dumped, "modalities": "image"}
        return {"type": t, t: dumped}
    if t == "input_audio":
        # protocol.py _to_audio_url_part: inline audio becomes an audio_url data URI.
        inner = p.get("input_audio")
        if not isinstance(inner, dict) or inner.get("format") not in ("wav", "mp3"):
            raise Refused("input_audio needs data and format wav|mp3")
        return {"type": "audio_url", "audio_url": {"url": "data:audio"}}
    raise Refused(f"unsupported content part type {t!r}")


def _content(v: Any, role: str, *, required: bool) -> Any:
    if v is None:
        if required:
            raise Refused("content is required")
        return None
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return [_part(p, role) for p in v]
    raise Refused("content must be a string, an array of parts or null")


# --- tools (protocol.py Function, Tool) -----------------------------------------------------


def _function(f: Any) -> dict[str, Any]:
    """protocol.py Function: validated, then dumped by its wrap serializer in the client's
    key order (`key_order`), fields the client left out after (description and
    parameters as null), strict/defer_loading only when set, unknown keys dropped."""
    if not isinstance(f, dict):
        raise Refused("function must be an object")
    if not isinstance(f.get("name"), str):
        raise Refused("function.name is required")
    desc = _opt_str(f.get("description"), "description")
    strict, defer = f.get("strict"), f.get("defer_loading")
    for name, v in (("strict", strict), ("defer_loading", defer)):
        if v is not None and not isinstance(v, bool):
            raise Unmodelled(f"function.{name} of a non-boolean type (pydantic lax coercion)")
    data: dict[str, Any] = {
        "description": desc,
        "name": f["name"],
        "parameters": f.get("parameters"),
        "strict": strict,
        "defer_loading": defer,
    }
    return _order_function(data, list(f))


def _order_function(data: dict[str, Any], key_order: list[str]) -> dict[str, Any]:
    if data["strict"] is None:
        data.pop("strict")
    if data["defer_loading"] is None:
        data.pop("defer_loading")
    rest = [k for k in data if k not in key_order]
    return {k: data[k] for k in key_order + rest if k in data}


def _tool(t: Any) -> dict[str, Any]:
    """protocol.py Tool: {type, function, defer_loading} with no serializer of its own, so
    `defer_loading` is dumped even when null; a tool-level defer_loading is copied into the
    function (Tool._propagate_defer_loading) and lands after the client's keys."""
    if not isinstance(t, dict):
        raise Refused("tool must be an object")
    ttype = t.get("type", "function")
    if not isinstance(ttype, str):
        raise Refused("tool.type must be a string")
    raw_fn = t.get("function")
    fn = _function(raw_fn)
    defer = t.get("defer_loading")
    if defer is not None and not isinstance(defer, bool):
        raise Unmodelled("tool.defer_loading of a non-boolean type")
    if defer is not None and "defer_loading" not in fn:
        assert isinstance(raw_fn, dict)
        full = {
            "description": fn.get("description"),
            "name": fn["name"],
            "parameters": fn.get("parameters"),
            "strict": fn.get("strict"),
            "defer_loading": defer,
        }
        fn = _order_function(full, list(raw_fn))
    return {"type": ttype, "function": fn, "defer_loading": defer}


def _check_parameters(tool: dict[str, Any]) -> None:
    """serving_chat.py _validate_request: every tool's parameters must be a valid JSON
    Schema (Draft 2020-12), after normalize_json_schema_types rewrote DB-style type names
    in place; that rewrite is not replicated, so such schemas are unmodelled."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    params = tool["function"].get("parameters")
    if params is None:
        return
    _standard_types_only(params)
    try:
        Draft202012Validator.check_schema(params)
    except SchemaError:
        raise Refused("invalid tool parameters schema") from None
    except RecursionError:
        raise Refused("tool parameters nested too deeply") from None


_SCHEMA_TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})


def _standard_types_only(schema: Any, depth: int = 0) -> None:
    if depth > 64:
        raise Unmodelled("deep schema")
    if isinstance(schema, list):
        for s in schema:
            _standard_types_only(s, depth + 1)
    elif isinstance(schema, dict):
        t = schema.get("type")
        types = t if isinstance(t, list) else [t]
        if any(isinstance(x, str) and x not in _SCHEMA_TYPES for x in types):
            raise Unmodelled("non-standard schema type (normalize_json_schema_types)")
        for v in schema.values():
            _standard_types_only(v, depth + 1)


# --- messages (protocol.py ChatCompletionMessageGenericParam / UserParam) --------------------


def _tool_call(c: Any) -> dict[str, Any]:
    """protocol.py ToolCall dumped: {id, index, type, function: {name, arguments}}."""
    if not isinstance(c, dict):
        raise Refused("tool call must be an object")
    fn = c.get("function")
    if not isinstance(fn, dict):
        raise Refused("tool call needs a function")
    args = fn.get("arguments")
    if args is not None and not isinstance(args, (str, dict)):
        raise Refused("arguments must be a string or an object")
    index = c.get("index")
    if index is not None and (not isinstance(index, int) or isinstance(index, bool)):
        raise Unmodelled("tool call index of a non-integer type")
    ctype = c.get("type", "function")
    if ctype != "function":
        raise Refused("tool call type must be function")
    return {
        "id": _opt_str(c.get("id"), "tool call id"),
        "index": index,
        "type": "function",
        "function": {"name": _opt_str(fn.get("name"), "function name"), "arguments": args},
    }


def message(m: Any) -> dict[str, Any]:
    """One message as SGLang's pydantic model dumps it (`msg.model_dump()`), roles
    lower-cased by ChatCompletionMessageGenericParam._normalize_role; "user" is its own
    model that keeps role and content only, and matches the exact spelling alone."""
    if not isinstance(m, dict):
        raise Refused("message must be an object")
    role = m.get("role")
    if not isinstance(role, str):
        raise Refused("'role' must be a string")
    if role == "user":
        return {"role": "user", "content": _content(m.get("content"), "user", required=True)}
    lower = role.lower()
    if lower not in GENERIC_ROLES:
        raise Refused(f"role {role!r} is not one of {GENERIC_ROLES} (case-insensitive)")
    phase = m.get("phase")
    if phase not in (None, "commentary", "final_answer"):
        raise Refused("phase")
    prefix = m.get("prefix")
    if prefix is not None and not isinstance(prefix, bool):
        raise Unmodelled("prefix of a non-boolean type")
    calls = m.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise Refused("tool_calls must be an array")
    tools = m.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise Refused("tools must be an array")
    return {
        "role": lower,
        "content": _content(m.get("content"), lower, required=False),
        "tool_call_id": _opt_str(m.get("tool_call_id"), "tool_call_id"),
        "name": _opt_str(m.get("name"), "name"),
        "phase": phase,
        "reasoning_content": _opt_str(m.get("reasoning_content"), "reasoning_content"),
        "tool_calls": None if calls is None else [_tool_call(c) for c in calls],
        "tools": None if tools is None else [_tool(t) for t in tools],
        "prefix": prefix,
    }


# --- the request model (protocol.py ChatCompletionRequest validators) -----------------------


def _normalize_reasoning_inputs(values: dict[str, Any]) -> None:
    """protocol.py ChatCompletionRequest.normalize_reasoning_inputs (mode="before")."""
    r = values.get("reasoning")
    thinking = None
    if r is not None and isinstance(r, dict):
        effort = r.get("effort")
        if effort is None:
            effort = r.get("reasoning_effort")
        if isinstance(effort, str) and effort in EFFORT_TIERS:
            values["reasoning_effort"] = effort
        elif isinstance(effort, (int, float)) and not isinstance(effort, bool):
            values["reasoning_effort"] = float(effort)
        elif isinstance(effort, str):
            try:
                values["reasoning_effort"] = float(effort)
            except ValueError:
                raise Refused("invalid reasoning effort") from None
        elif effort is not None:
            raise Refused("invalid reasoning effort")
        enabled = r.get("enabled") if r.get("enabled") is not None else r.get("enable", False)
        if isinstance(enabled, str):
            enabled = enabled.strip().lower() in {"1", "true", "yes", "y", "on"}
        if enabled:
            thinking = True
    effort = values.get("reasoning_effort")
    if effort is not None:
        thinking = effort != "none"
    if thinking is not None:
        ctk = values.get("chat_template_kwargs")
        if not isinstance(ctk, dict):
            ctk = {}
        ctk.setdefault("thinking", thinking)
        ctk.setdefault("enable_thinking", thinking)
        values["chat_template_kwargs"] = ctk


def _reasoning_effort(v: Any) -> Any:
    """protocol.py ReasoningEffortType: a tier, or a float in [0, 0.99] (lax: numeric
    strings coerce); booleans refused by validate_reasoning_effort_type."""
    if v is None or (isinstance(v, str) and v in EFFORT_TIERS):
        return v
    if isinstance(v, bool):
        raise Refused("reasoning_effort must not be a boolean")
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise Refused("invalid reasoning_effort") from None
    if isinstance(v, str) and not v.strip():
        raise Refused("invalid reasoning_effort")
    if not (0.0 <= f <= 0.99) or math.isnan(f):
        raise Refused("reasoning_effort out of range")
    return f


def _has_message_level_tools(messages: Any) -> bool:
    """protocol.py _has_message_level_tools."""
    return isinstance(messages, list) and any(
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and m["role"].lower() in ("root", "system", "developer")
        and bool(m.get("tools"))
        for m in messages
    )


class ChatRequest:
    """The validated ChatCompletionRequest fields a count depends on."""

    def __init__(self, data: dict[str, Any]) -> None:
        values = dict(data)
        # protocol.py set_tool_choice_default (mode="before")
        if values.get("tool_choice") is None:
            if values.get("tools") is None and not _has_message_level_tools(values.get("messages")):
                values["tool_choice"] = "none"
            else:
                values["tool_choice"] = "auto"
        _normalize_reasoning_inputs(values)
        msgs = values.get("messages")
        if not isinstance(msgs, list):
            raise Refused("messages must be an array")
        self.messages = [message(m) for m in msgs]
        tools = values.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise Refused("tools must be an array")
        self.tools = None if tools is None else [_tool(t) for t in tools]
        tc = values["tool_choice"]
        if isinstance(tc, dict):
            fn = tc.get("function")
            if not isinstance(fn, dict) or tc.get("type", "function") != "function":
                raise Refused("tool_choice")
            self.tool_choice: Any = {"function": {"name": _opt_str(fn.get("name"), "name")}}
        elif tc in ("auto", "required", "none"):
            self.tool_choice = tc
        else:
            raise Refused("tool_choice")
        self.reasoning_effort = _reasoning_effort(values.get("reasoning_effort"))
        ctk = values.get("chat_template_kwargs")
        if ctk is not None and not isinstance(ctk, dict):
            raise Refused("chat_template_kwargs must be an object")
        self.chat_template_kwargs: dict[str, Any] | None = ctk
        cfm = values.get("continue_final_message", False)
        if not isinstance(cfm, bool):
            raise Unmodelled("continue_final_message of a non-boolean type")
        self.continue_final_message = cfm
        ids = values.get("input_ids")
        if ids is not None and (not isinstance(ids, list) or any(type(x) is not int for x in ids)):
            raise Refused("input_ids must be an array of integers")
        self.input_ids: list[int] | None = ids

    def effective_tools(self) -> list[dict[str, Any]]:
        """serving_chat.py _effective_tools: request tools plus system-level messages'."""
        out = list(self.tools or [])
        for m in self.messages:
            if m["role"] in ("root", "system", "developer") and m.get("tools"):
                out.extend(m["tools"])
        return out


def _validate_media(req: ChatRequest, model: Model) -> None:
    """serving_chat.py _validate_media_content: a text-only model refuses media parts."""
    if not model.multimodal:
        for m in req.messages:
            if isinstance(m["content"], list) and any(
                p["type"] in MEDIA_PART_TYPES for p in m["content"]
            ):
                raise Refused("Model only supports text input")


def _validate(req: ChatRequest, model: Model) -> None:
    """serving_chat.py _validate_request (which runs _validate_media_content)."""
    if not req.messages:
        raise Refused("Messages cannot be empty.")
    if req.chat_template_kwargs and "chat_template" in req.chat_template_kwargs:
        raise Refused("Request-supplied chat_template is not allowed")
    _validate_media(req, model)
    tools = req.effective_tools()
    if req.tool_choice == "required" and not tools:
        raise Refused("Tools cannot be empty if tool choice is set to required.")
    if isinstance(req.tool_choice, dict):
        name = req.tool_choice["function"]["name"]
        if not tools or not any(t["function"]["name"] == name for t in tools):
            raise Refused("named tool not found")
    if any(m["role"] in ("root", "system", "developer") and m.get("tools") for m in req.messages):
        names = [t["function"]["name"] for t in tools]
        if len(names) != len(set(names)):
            raise Refused("Tool names must be unique across request and message tools.")
    for t in tools:
        _check_parameters(t)


# --- template probes (parser/jinja_template_utils.py, parser/template_detection.py) ---------


def _ast(template: str) -> jinja2.nodes.Template | None:
    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return env.parse(template)
    except jinja2.TemplateError:
        return None


def _var_or_elems(node: jinja2.nodes.Node, var: str, key: str | None = None) -> bool:
    """jinja_template_utils.py _is_var_or_elems_access."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _var_or_elems(node.node, var, key)
    if isinstance(node, jinja2.nodes.Test):
        return _var_or_elems(node.node, var, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _var_or_elems(node.node, var, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == var
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            isinstance(node.node, jinja2.nodes.Name)
            and node.node.name == var
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return (
            isinstance(node.node, jinja2.nodes.Name)
            and node.node.name == var
            and (node.attr == key)
        )
    return False


def content_format(template: str) -> str:
    """jinja_template_utils.py detect_jinja_template_content_format: "openai" when the
    template mentions media or loops over message content, else "string"."""
    if any(k in template for k in ("image", "audio", "video", "vision")):
        return "openai"
    tree = _ast(template)
    if tree is None:
        return "string"
    for loop in tree.find_all(jinja2.nodes.For):
        if any(_var_or_elems(loop.iter, v, "content") for v in ("message", "msg", "m")):
            return "openai"
    return "string"


def may_reorder_tool_results(template: str) -> bool:
    """jinja_template_utils.py jinja_template_may_reorder_tool_results."""
    tree = _ast(template)
    if tree is None:
        return False

    def is_id(n: jinja2.nodes.Node) -> bool:
        return isinstance(n, jinja2.nodes.Const) and n.value == "tool_call_id"

    if any(n.attr == "tool_call_id" for n in tree.find_all(jinja2.nodes.Getattr)):
        return True
    if any(is_id(n.arg) for n in tree.find_all(jinja2.nodes.Getitem)):
        return True
    for call in tree.find_all(jinja2.nodes.Call):
        if (
            isinstance(call.node, jinja2.nodes.Getattr)
            and call.node.attr == "get"
            and call.args
            and is_id(call.args[0])
        ):
            return True
    for f in tree.find_all(jinja2.nodes.Filter):
        if f.name not in ("map", "rejectattr", "selectattr"):
            continue
        if f.args and is_id(f.args[0]):
            return True
        if any(k.key == "attribute" and is_id(k.value) for k in f.kwargs):
            return True
    return False


def inline_system_support(template: str) -> bool:
    """template_detection.py detect_inline_system_support: a second system message's
    sentinel shows in a plain sandboxed render."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    sentinel = "__sglang_inline_system_sentinel__"
    try:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        rendered = env.from_string(template).render(
            messages=[
                {"role": "system", "content": "t"},
                {"role": "user", "content": "t"},
                {"role": "system", "content": sentinel},
                {"role": "user", "content": "t"},
            ],
            add_generation_prompt=False,
        )
    except Exception:
        return False
    return sentinel in rendered


# --- the template step (serving_chat.py _apply_jinja_template) ------------------------------


def _flatten(msg: dict[str, Any], fmt: str) -> dict[str, Any]:
    """jinja_template_utils.py process_content_for_template_format (media only noted: the
    multimodal processor expands placeholders after the template, outside this count)."""
    content = msg.get("content")
    if not isinstance(content, list):
        return {k: v for k, v in msg.items() if v is not None}
    if fmt == "openai":
        parts: list[dict[str, Any]] = []
        for chunk in content:
            t = chunk.get("type")
            if t in ("image_url", "input_image"):
                parts.append({"type": "image"})
            elif t == "video_url":
                parts.append({"type": "video"})
            elif t == "audio_url":
                parts.append({"type": "audio"})
            elif t in ("text", "input_text"):
                parts.append({"type": "text", "text": chunk["text"]})
            elif t == "tool_reference":
                parts.append(chunk)
        out = {k: v for k, v in msg.items() if v is not None and k != "content"}
        out["content"] = parts
        return out
    texts = [c["text"] for c in content if c.get("type") in ("text", "input_text")]
    out = dict(msg)
    out["content"] = " ".join(texts) if texts else ""
    return {k: v for k, v in out.items() if v is not None}


def _tool_content(role: str, content: Any) -> Any:
    """serving_chat.py normalize_tool_content: a tool message of text parts only becomes
    one string joined with " "."""
    if role != "tool" or not isinstance(content, list):
        return content
    if all(
        (isinstance(p, dict) and p.get("type") == "text") or isinstance(p, str) for p in content
    ):
        return " ".join(p.get("text", "") if isinstance(p, dict) else p for p in content)
    return content


def _parse_arguments(msg: dict[str, Any]) -> None:
    """serving_chat.py normalize_assistant_tool_call_arguments (strict): string arguments
    are parsed with orjson and must be a JSON object, else the request is refused."""
    if msg.get("role") != "assistant" or not isinstance(msg.get("tool_calls"), list):
        return
    for item in msg["tool_calls"]:
        fn = item.get("function") if isinstance(item, dict) else None
        if not isinstance(fn, dict):
            continue
        if isinstance(fn.get("arguments"), str):
            try:
                parsed = orjson.loads(fn["arguments"])
            except orjson.JSONDecodeError:
                raise Refused("tool call arguments must be valid JSON") from None
            if not isinstance(parsed, dict):
                raise Refused("tool call arguments must be a JSON object")
            fn["arguments"] = parsed


def _reorder(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """serving_chat.py _canonicalize_tool_message_order (sort_text_runs=False): a run of
    tool results after an assistant's calls is put in call order only when it carries
    media and every id pairs up."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        out.append(m)
        i += 1
        calls = m.get("tool_calls") or []
        if m.get("role") != "assistant" or not calls:
            continue
        run = []
        while i < len(messages) and messages[i].get("role") in ("tool", "function"):
            run.append(messages[i])
            i += 1
        out.extend(_sort_run(run, calls))
    return out


def _sort_run(run: list[dict[str, Any]], calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if len(run) < 2:
        return run
    ids = [c.get("id") for c in calls]
    if any(x is None for x in ids) or len(set(ids)) != len(ids):
        return run
    rids = [m.get("tool_call_id") for m in run]
    if any(r not in ids for r in rids) or len(set(rids)) != len(rids):
        return run
    media = any(
        isinstance(m.get("content"), list)
        and any(
            isinstance(p, dict)
            and p.get("type") in ("image_url", "input_image", "video_url", "audio_url")
            for p in m["content"]
        )
        for m in run
    )
    if not media:
        return run
    pos = {x: n for n, x in enumerate(ids)}
    return sorted(run, key=lambda m: pos[m["tool_call_id"]])


def _encode_rendered(model: Model, text: str) -> int:
    """serving_chat.py _apply_jinja_template + parallel_prompt_encode: the rendered text is
    encoded with add_special_tokens=False when the tokenizer adds specials on its own
    (the `encode("")` probe), else with the tokenizer's defaults."""
    if model.auto_adds_specials:
        return len(model.encode(text, add_special_tokens=False))
    return len(model.tokenizer.encode(text))


def _prefix_tokens(model: Model, prefix: str) -> int:
    """serving_chat.py _append_assistant_prefix_to_prompt_ids: `encode(prefix)` with the
    tokenizer's defaults, minus a leading BOS."""
    ids = model.tokenizer.encode(prefix)
    bos = model.tokenizer.bos_token_id
    if ids and bos is not None and ids[0] == bos:
        ids = ids[1:]
    return len(ids)


def _template_tools(req: ChatRequest) -> list[dict[str, Any]] | None:
    """serving_chat.py _process_messages: the tools handed to the template. None when the
    request has none or tool_choice is "none"; a named choice keeps only that tool."""
    if not req.effective_tools() or req.tool_choice == "none":
        return None
    if isinstance(req.tool_choice, dict):
        name = req.tool_choice["function"]["name"]
        return [t for t in req.tools or [] if t["function"]["name"] == name] or None
    return list(req.tools) if req.tools else None


def render_chat(model: Model, req: ChatRequest, *, legacy: bool = False) -> int:
    """serving_chat.py _process_messages then _apply_jinja_template, for a template SGLang
    runs through transformers (the non-encoder branch). `legacy` is sglang@v0.5.9's one
    difference the responses oracle needs: reasoning_effort is always passed (None too)."""
    tools = _template_tools(req)
    messages = copy.deepcopy(req.messages)
    for m in messages:
        _parse_arguments(m)
    if may_reorder_tool_results(model.template):
        messages = _reorder(messages)
    fmt = content_format(model.template)
    processed = []
    for m in copy.deepcopy(messages):
        if m.get("content") is None:
            m["content"] = ""
        p = _flatten(m, fmt)
        p["content"] = _tool_content(p["role"], p.get("content"))
        processed.append(p)
    # _handle_last_assistant_message: add_generation_prompt is never set on chat requests
    # (ChatCompletionRequest has no such field: a body's add_generation_prompt is ignored).
    prefix = None
    if processed and processed[-1].get("role") == "assistant":
        last = processed[-1].get("content")
        if isinstance(last, str):
            if req.continue_final_message:
                prefix = last
                processed = processed[:-1]
            else:
                processed[-1] = {"role": "user", "content": last}
    kwargs: dict[str, Any] = {}
    if req.reasoning_effort is not None or legacy:
        kwargs["reasoning_effort"] = req.reasoning_effort
    if req.chat_template_kwargs:
        kwargs.update(req.chat_template_kwargs)
    # template_detection.py nemotron_3_super_low_effort: the only rule with an effort_kwarg.
    if (
        "low_effort" in model.template
        and "truncate_history_thinking" in model.template
        and req.reasoning_effort == "low"
    ):
        kwargs.setdefault("low_effort", True)
    text = _render_with_retry(model, processed, tools, kwargs)
    n = _encode_rendered(model, text)
    if prefix:
        n += _prefix_tokens(model, prefix)
    return n


def _render_with_retry(
    model: Model, messages: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any]
) -> str:
    """serving_chat.py _apply_jinja_template: a failed render is retried once with each tool
    flattened to its function; a second failure refuses the request."""
    try:
        return model.render(messages, tools=tools, template_kwargs=kwargs)
    except Exception:
        flat = [t.get("function", t) for t in tools] if tools else None
        try:
            return model.render(messages, tools=flat, template_kwargs=kwargs)
        except Exception as exc:
            raise Refused(f"template: {type(exc).__name__}: {exc}") from None


def chat(model: Model, body: bytes) -> Count:
    """POST /v1/chat/completions (http_server.py openai_v1_chat_completions)."""
    data = parse(body)
    req = ChatRequest(data)
    _validate(req, model)
    # serving_chat.py _convert_to_internal_request: a reasoning_effort inside the kwargs
    # moves to the request field (no validation) and leaves the kwargs.
    if req.chat_template_kwargs and "reasoning_effort" in req.chat_template_kwargs:
        moved = req.chat_template_kwargs.pop("reasoning_effort")
        if moved is not None:
            req.reasoning_effort = moved
    if req.input_ids is not None:
        # _process_messages: pre-computed ids bypass the template entirely.
        return one(len(req.input_ids))
    return one(render_chat(model, req))


# --- completions and /generate --------------------------------------------------------------


def _text_tokens(model: Model, text: str) -> int:
    """tokenizer_manager.py _tokenize_texts: `tokenizer(texts)`, special tokens added."""
    return len(model.tokenizer(text)["input_ids"])


def _ids_ok(ids: Any) -> bool:
    return isinstance(ids, list) and bool(ids) and all(type(x) is int for x in ids)


def completions(model: Model, body: bytes) -> Count:
    """POST /v1/completions (serving_completions.py): a string, strings, ids or id lists;
    each sequence is its own request to the scheduler."""
    data = parse(body)
    prompt = data.get("prompt")
    if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
        raise Refused("prompt empty")
    if isinstance(prompt, str):
        return one(_text_tokens(model, prompt))
    if not isinstance(prompt, list):
        raise Refused("prompt type")
    if all(isinstance(p, str) for p in prompt):
        return batch([_text_tokens(model, p) for p in prompt])
    if all(type(p) is int for p in prompt):
        return one(len(prompt))
    if all(_ids_ok(p) for p in prompt):
        return batch([len(p) for p in prompt])
    raise Refused("prompt type")


def generate(model: Model, body: bytes) -> Count:
    """POST /generate (GenerateReqInput): text, input_ids, or input_embeds (one position
    per vector; the default server refuses embeds while the radix cache is on, see
    tokenizer_manager.py _tokenize_one_request, so that is a variant)."""
    data = parse(body)
    given = [k for k in ("text", "input_ids", "input_embeds") if data.get(k) is not None]
    if len(given) != 1:
        raise Refused("exactly one of text, input_ids, input_embeds")
    key = given[0]
    v = data[key]
    if key == "text":
        if isinstance(v, str):
            return one(_text_tokens(model, v))
        if isinstance(v, list) and v and all(isinstance(t, str) for t in v):
            return batch([_text_tokens(model, t) for t in v])
        raise Refused("text type")
    if key == "input_ids":
        if _ids_ok(v):
            return one(len(v))
        if isinstance(v, list) and v and all(_ids_ok(x) for x in v):
            return batch([len(x) for x in v])
        raise Refused("input_ids type")
    if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
        raise Refused("input_embeds with the radix cache on (default)")
    raise Refused("input_embeds type")


# --- /v1/responses (serving_responses.py) ---------------------------------------------------


def _response_item(item: Any) -> dict[str, Any] | None:
    """serving_responses.py _normalize_response_message_for_chat for the item shapes
    replicated: messages with string or input_text/output_text part content, function
    calls and their outputs. Developer messages, reasoning items and media are not."""
    if not isinstance(item, dict):
        raise Refused("input item must be an object")
    if item.get("role") == "developer":
        raise Unmodelled("developer items (label_developer_content) are not replicated")
    t = item.get("type")
    if t == "function_call":
        raw = item.get("arguments")
        if isinstance(raw, str):
            try:
                parsed = orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError:
                parsed = None
            if not isinstance(parsed, dict):
                raw = "{}"
        elif isinstance(raw, dict):
            raw = orjson.dumps(raw).decode()
        else:
            raw = "{}"
        return {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": item.get("call_id") or item.get("id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": raw},
                }
            ],
        }
    if t == "function_call_output":
        out = item.get("output", "")
        if isinstance(out, list):
            out = "".join(p.get("text", "") for p in out if isinstance(p, dict))
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": out}
    if t not in (None, "message"):
        raise Unmodelled(f"responses item type {t!r}")
    content = item.get("content")
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") in ("input_text", "output_text"):
                parts.append({"type": "text", "text": p.get("text", "")})
            elif isinstance(p, dict) and p.get("type") == "text":
                parts.append(p)
            else:
                raise Unmodelled("responses media parts")
        content = parts
    merged = {**item, "content": content}
    return {k: v for k, v in merged.items() if v is not None and k not in ("id", "status", "type")}


def _merge_assistants(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """serving_responses.py _merge_consecutive_assistant_messages (no phases here)."""
    merged: list[dict[str, Any]] = []
    for msg in messages:
        if (
            msg.get("role") == "assistant"
            and merged
            and merged[-1].get("role") == "assistant"
            and merged[-1].get("phase") == msg.get("phase")
        ):
            prev = merged[-1] = dict(merged[-1])
            new = msg.get("content")
            if new is not None and new != "":
                old = prev.get("content")
                if old is None or old == "":
                    prev["content"] = new
                elif isinstance(old, str) and isinstance(new, str):
                    prev["content"] = old + ("\n\n" if old and new else "") + new
                else:
                    raise Unmodelled("merging part lists")
            if msg.get("tool_calls"):
                prev["tool_calls"] = (prev.get("tool_calls") or []) + list(msg["tool_calls"])
            continue
        merged.append(msg)
    return merged


def responses(model: Model, body: bytes) -> Count:
    """POST /v1/responses on SGLang's own server: the input becomes chat messages
    (_construct_input_messages), then one ChatCompletionRequest is rendered as a chat
    request is (_make_request). A conversion that fails validation is a 400."""
    data = parse(body)
    inp = data.get("input")
    messages: list[dict[str, Any]] = []
    instructions = _opt_str(data.get("instructions"), "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for item in inp:
            n = _response_item(item)
            if n is not None:
                messages.append(n)
    else:
        raise Refused("input must be a string or an array")
    if data.get("tools"):
        raise Unmodelled("responses tools")
    messages = _merge_assistants(messages)
    if not inline_system_support(model.template):
        chunks, others = [], []
        for m in messages:
            if m.get("role") == "system":
                c = m.get("content")
                if isinstance(c, str):
                    chunks.append(c)
                elif isinstance(c, list):
                    chunks.extend(p["text"] for p in c if isinstance(p.get("text"), str))
            else:
                others.append(m)
        messages = ([{"role": "system", "content": "\n\n".join(chunks)}] if chunks else []) + others
    reasoning = data.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    chat_body: dict[str, Any] = {
        "messages": messages,
        "tool_choice": "none",
        "reasoning_effort": effort,
        "chat_template_kwargs": data.get("chat_template_kwargs"),
    }
    req = ChatRequest(chat_body)
    # _make_request validates media only (no _validate_request, no kwargs move).
    _validate_media(req, model)
    return one(render_chat(model, req))


def responses_legacy(model: Model, body: bytes) -> Count:
    """POST /v1/responses on sglang@v0.5.9 (serving_responses.py _make_request): the input
    items go to ChatCompletionRequest as they are; when that (or the render) fails, the
    prompt is plain ``f"{role}: {content}\\n"`` lines, list content printed as Python's
    repr of the validated items, encoded with special tokens."""
    data = parse(body)
    inp = data.get("input")
    messages: list[dict[str, Any]] = []
    instructions = _opt_str(data.get("instructions"), "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        messages.extend(_legacy_item(i) for i in inp)
    else:
        raise Refused("input must be a string or an array")
    plain = all(
        m.get("role") in ("user", "system", "assistant") and isinstance(m.get("content"), str)
        for m in messages
    )
    if plain:
        req = ChatRequest({"messages": messages})
        _validate(req, model)
        try:
            return one(render_chat(model, req, legacy=True))
        except Refused:
            pass  # the legacy server falls back instead of refusing
    text = "".join(f"{m.get('role', 'user')}: {m.get('content', '')}\n" for m in messages)
    return one(len(model.tokenizer.encode(text)))


def _legacy_item(item: Any) -> dict[str, Any]:
    """sglang@v0.5.9 protocol.py ResponsesRequest.input: openai's EasyInputMessageParam
    TypedDict (the first union member that fits a role+content item), which pydantic
    rebuilds in its field order (content, role, type) and drops unknown keys from; text
    parts become {text, type}. Other item kinds are pydantic models the fallback cannot
    read (an AttributeError, a 500), not replicated."""
    if not isinstance(item, dict) or item.get("role") not in (
        "user",
        "assistant",
        "system",
        "developer",
    ):
        raise Unmodelled("legacy responses item other than a role message")
    content = item.get("content")
    if isinstance(content, list):
        parts = []
        for p in content:
            if (
                not isinstance(p, dict)
                or p.get("type") != "input_text"
                or not isinstance(p.get("text"), str)
            ):
                raise Unmodelled("legacy responses part other than input_text")
            parts.append({"text": p["text"], "type": "input_text"})
        content = parts
    elif not isinstance(content, str):
        raise Refused("content")
    out: dict[str, Any] = {"content": content, "role": item["role"]}
    if item.get("type") == "message":
        out["type"] = "message"
    return out


ROUTES = {
    "chat": chat,
    "completions": completions,
    "generate": generate,
    "responses": responses,
}


def count(model: Model, route: str, body: bytes) -> Count:
    """The tokens SGLang 0.5.23 prefills for `body` on `route` (raises Refused/Unmodelled)."""
    fn = ROUTES.get(route)
    if fn is None:
        raise Unmodelled(f"route {route} on SGLang")
    return fn(model, body)
