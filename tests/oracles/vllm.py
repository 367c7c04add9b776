"""vLLM's request preprocessing, replicated from vllm@v0.34.0 (`versions.py`).

`count(model, route, body)` is the number of tokens vLLM 0.34.0 prefills for `body` on
`route` (chat, completions, embeddings, score, rerank), or raises `Refused` (a 4xx) or
`Uncountable` (a body vLLM serves under a server flag whose size is not text, e.g.
`prompt_embeds`). The server replicated runs the model's own template with
`--enable-auto-tool-choice --tool-call-parser ...` (so tool requests are served; without
them a tools request with the default tool_choice "auto" is a 400), no
`--reasoning-effort-map`, no default template kwargs, `--trust-request-chat-template` off.

A chat request, in vLLM's order:
  1. Starlette's `json.loads` parses the body (integers keep every digit, NaN parses)
  2. pydantic validates ChatCompletionRequest (entrypoints/openai/chat_completion/
     protocol.py): roles are any string, kept as sent; tool calls need an id and string
     arguments; `tools: []` is no tools
  3. renderers/online_renderer.py render_chat / preprocess_chat: tools dumped from their
     model, template kwargs merged (request fields over `chat_template_kwargs`, None
     dropped), `kv_transfer_params.prompt_token_ids` replaces the render
  4. renderers/chat_utils/chat_message.py parse_chat_messages: content parts joined with
     "\\n" (string templates) or kept as dicts (openai templates), a tool message's text
     parts joined with "\\n", `reasoning` copied to reasoning_content, `tool_calls: []`
     dropped, tool-call arguments parsed with `json` (invalid ones become {})
  5. renderers/hf.py safe_apply_chat_template: `developer` becomes `system` (and system
     messages merge) when the template never names "developer"; kwargs the template does
     not read are dropped; transformers renders; the tokenizer encodes the text with
     `add_special_tokens` from the request (default false).
"""

from __future__ import annotations

import base64
import binascii
import functools
import inspect
import json
from collections import deque
from collections.abc import Iterator
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from oracles.common import Count, Refused, Uncountable, Unmodelled, batch, one
from oracles.models import Model

SRC = "vllm@v0.34.0"

# renderers/params.py ReasoningEffort
EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
# renderers/chat_utils/chat_message.py TEXT_PART_TYPES / MM_PARSER_MAP
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})
MEDIA_PART_TYPES = frozenset(
    {"image_url", "input_image", "audio_url", "input_audio", "video_url", "image_embeds",
     "audio_embeds", "video_embeds", "image_pil"}
)  # fmt: skip
BILLING_HEADER = "x-anthropic-billing-header"


def parse(body: bytes) -> dict[str, Any]:
    """Starlette Request.json: the standard library parser."""
    try:
        data = json.loads(body)
    except ValueError:
        raise Refused("json") from None
    if not isinstance(data, dict):
        raise Refused("body is not an object")
    return data


# --- template analysis (renderers/hf.py) ----------------------------------------------------


class _Generation(jinja2.ext.Extension):
    """renderers/hf.py AssistantTracker: parses {% generation %} blocks."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_generation_support")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)


def _env() -> ImmutableSandboxedEnvironment:
    return ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )


@functools.lru_cache(maxsize=64)
def template_vars(template: str) -> frozenset[str]:
    """renderers/hf.py _resolve_chat_template_kwargs: the template's undeclared names."""
    return frozenset(jinja2.meta.find_undeclared_variables(_env().parse(template)))


def _is_var(node: jinja2.nodes.Node, var: str) -> bool:
    if isinstance(node, jinja2.nodes.Name):
        return node.ctx == "load" and node.name == var
    if isinstance(node, jinja2.nodes.Getattr) and "." in var:
        base, _, attr = var.rpartition(".")
        return node.attr == attr and _is_var(node.node, base)
    return False


def _is_attr(node: jinja2.nodes.Node, var: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var(node.node, var)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, var) and node.attr == key
    return False


def _var_or_elems(node: jinja2.nodes.Node, var: str, key: str | None = None) -> bool:
    """renderers/hf.py _is_var_or_elems_access."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _var_or_elems(node.node, var, key)
    if isinstance(node, jinja2.nodes.Test):
        return _var_or_elems(node.node, var, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _var_or_elems(node.node, var, key)
    return _is_attr(node, var, key) if key else _is_var(node, var)


def _dotted(node: jinja2.nodes.Node) -> str | None:
    if isinstance(node, jinja2.nodes.NSRef):
        return f"{node.name}.{node.attr}"
    parts = []
    while isinstance(node, jinja2.nodes.Getattr):
        parts.append(node.attr)
        node = node.node
    if isinstance(node, jinja2.nodes.Name):
        parts.append(node.name)
        return ".".join(reversed(parts))
    return None


def _assigns(root: jinja2.nodes.Node, var: str) -> Iterator[str]:
    """renderers/hf.py _iter_nodes_assign_var_or_elems: `var` and every name assigned
    from it (breadth first), namespace aliases included."""
    yield var
    seen = {var}
    pending = deque([var])
    while pending:
        related = pending.popleft()
        for a in root.find_all(jinja2.nodes.Assign):
            lhs, rhs = a.target, a.node
            if isinstance(lhs, jinja2.nodes.Name) and _var_or_elems(rhs, related):
                yield lhs.name
                if lhs.name != related and lhs.name not in seen:
                    seen.add(lhs.name)
                    pending.append(lhs.name)
            aliases: list[str] = []
            if (
                isinstance(lhs, jinja2.nodes.Name)
                and isinstance(rhs, jinja2.nodes.Call)
                and isinstance(rhs.node, jinja2.nodes.Name)
                and rhs.node.name == "namespace"
            ):
                aliases = [
                    f"{lhs.name}.{kw.key}" for kw in rhs.kwargs if _var_or_elems(kw.value, related)
                ]
            elif isinstance(lhs, (jinja2.nodes.Getattr, jinja2.nodes.NSRef)) and _var_or_elems(
                rhs, related
            ):
                d = _dotted(lhs)
                aliases = [d] if d is not None else []
            for alias in aliases:
                yield alias
                if alias != related and alias not in seen:
                    seen.add(alias)
                    pending.append(alias)


def _message_loop_vars(root: jinja2.nodes.Node) -> list[str]:
    names = list(_assigns(root, "messages"))
    out = []
    for loop in root.find_all(jinja2.nodes.For):
        for v in names:
            if _var_or_elems(loop.iter, v):
                assert isinstance(loop.target, jinja2.nodes.Name)
                out.append(loop.target.name)
                break
    return out


def _loops_over_content(root: jinja2.nodes.Node) -> bool:
    """renderers/hf.py _iter_nodes_assign_content_item: any loop over a message's content
    (directly, through a macro parameter bound to it, or over a top-level `content`)."""
    msg_vars = _message_loop_vars(root)
    by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        names = {a.name for a in macro.args}
        params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and any(
                        _var_or_elems(arg, v, "content") for v in msg_vars
                    ):
                        params.add(macro.args[i].name)
                for kw in call.kwargs:
                    if kw.key in names and any(
                        _var_or_elems(kw.value, v, "content") for v in msg_vars
                    ):
                        params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if params:
                by_loop[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_var_or_elems(loop.iter, v, "content") for v in msg_vars):
            return True
        params_for = by_loop.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name):
            if params_for is not None and loop.iter.name in params_for:
                return True
            if id(loop) not in in_macros and loop.iter.name == "content":
                return True
    return False


@functools.lru_cache(maxsize=64)
def content_format(template: str) -> str:
    """renderers/hf.py _detect_content_format (default "string" on a parse failure)."""
    try:
        tree = _env().parse(template)
    except jinja2.TemplateError:
        return "string"
    try:
        return "openai" if _loops_over_content(tree) else "string"
    except Exception:
        return "string"


def names_developer(template: str) -> bool:
    """renderers/hf.py _detect_developer_role_support."""
    return '"developer"' in template or "'developer'" in template


# --- request validation ---------------------------------------------------------------------


def _tool(t: Any) -> dict[str, Any]:
    """ChatCompletionToolsParam.model_dump: {type, function, defer_loading if set}; the
    function (generate/base/protocol.py FunctionDefinition) in field order with null
    description and parameters kept, strict/defer_loading only when set, extras dropped."""
    if not isinstance(t, dict):
        raise Refused("tool must be an object")
    if t.get("type", "function") != "function":
        raise Refused("tool type must be function")
    f = t.get("function")
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise Refused("tool function needs a name")
    desc, params = f.get("description"), f.get("parameters")
    if desc is not None and not isinstance(desc, str):
        raise Refused("description must be a string")
    if params is not None and not isinstance(params, dict):
        raise Refused("parameters must be an object")
    strict, defer, tdefer = f.get("strict"), f.get("defer_loading"), t.get("defer_loading")
    for v in (strict, defer, tdefer):
        if v is not None and not isinstance(v, bool):
            raise Unmodelled("non-boolean strict/defer_loading")
    if tdefer is not None and defer is None:
        defer = tdefer  # ChatCompletionToolsParam._propagate_defer_loading
    fn: dict[str, Any] = {"name": f["name"], "description": desc, "parameters": params}
    if strict is not None:
        fn["strict"] = strict
    if defer is not None:
        fn["defer_loading"] = defer
    out: dict[str, Any] = {"type": "function", "function": fn}
    if tdefer is not None:
        out["defer_loading"] = tdefer
    return out


def _tool_call(c: Any) -> dict[str, Any]:
    """openai ChatCompletionMessageFunctionToolCallParam as pydantic validates it: id,
    function {arguments, name} (all required strings) and type "function", rebuilt in
    that field order with the client's extra keys after."""
    if not isinstance(c, dict):
        raise Refused("tool call must be an object")
    fn = c.get("function")
    if (
        not isinstance(c.get("id"), str)
        or c.get("type") != "function"
        or not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
        or not isinstance(fn.get("arguments"), str)
    ):
        raise Refused("tool call needs id, type function, function.name and string arguments")
    f = {"arguments": fn["arguments"], "name": fn["name"]}
    f.update({k: v for k, v in fn.items() if k not in f})
    out = {"id": c["id"], "function": f, "type": "function"}
    out.update({k: v for k, v in c.items() if k not in out})
    return out


def _check_message(m: Any) -> None:
    """The message union (openai's TypedDicts, vLLM's CustomChatCompletionMessageParam):
    any string role; content a string or a list, null only where openai's assistant and
    function messages allow it."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise Refused("message needs a string role")
    content = m.get("content")
    if "content" in m and content is None and m["role"] not in ("assistant", "function"):
        raise Refused("content must not be null")
    if content is not None and not isinstance(content, (str, list)):
        raise Refused("content must be a string or an array")
    for key in ("name", "task"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise Refused(f"{key} must be a string")
    reasoning = m.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, str):
        raise Unmodelled("reasoning given as prompt_embeds")


class ChatRequest:
    def __init__(self, data: dict[str, Any]) -> None:
        msgs = data.get("messages")
        if not isinstance(msgs, list):
            raise Refused("messages must be an array")
        for m in msgs:
            _check_message(m)
        self.messages: list[dict[str, Any]] = msgs
        self._check_tool_usage(data)
        agp, cfm = (
            data.get("add_generation_prompt", True),
            data.get("continue_final_message", False),
        )
        ast = data.get("add_special_tokens", False)
        for v in (agp, cfm, ast):
            if not isinstance(v, bool):
                raise Unmodelled("non-boolean generation flags")
        # protocol.py check_generation_prompt
        if cfm and agp:
            raise Refused("Cannot set both continue_final_message and add_generation_prompt")
        self.add_generation_prompt, self.continue_final_message = agp, cfm
        self.add_special_tokens = ast
        docs = data.get("documents")
        if docs is not None and not (
            isinstance(docs, list)
            and all(
                isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in docs
            )
        ):
            raise Refused("documents must be a list of string maps")
        self.documents = docs
        effort = data.get("reasoning_effort")
        if effort is not None and effort not in EFFORTS:
            raise Refused("reasoning_effort")
        self.reasoning_effort = effort
        ctk = data.get("chat_template_kwargs")
        if ctk is not None and not isinstance(ctk, dict):
            raise Refused("chat_template_kwargs must be an object")
        self.chat_template_kwargs: dict[str, Any] = dict(ctk or {})
        if (
            data.get("chat_template") is not None
            or self.chat_template_kwargs.get("chat_template") is not None
        ):
            # online_renderer.py validate_chat_template (trust flag off)
            raise Refused("request chat template without --trust-request-chat-template")
        if "tokenize" in self.chat_template_kwargs or "chat_template" in self.chat_template_kwargs:
            raise Unmodelled("tokenize/chat_template inside chat_template_kwargs")
        if data.get("truncate_prompt_tokens") is not None:
            raise Unmodelled("truncate_prompt_tokens (the engine cuts the prompt)")
        kv = data.get("kv_transfer_params")
        self.reuse_ids: list[int] | None = None
        if isinstance(kv, dict) and kv.get("prompt_token_ids") is not None:
            self.reuse_ids = self._reuse(kv["prompt_token_ids"], data)

    def _check_tool_usage(self, data: dict[str, Any]) -> None:
        """protocol.py check_tool_usage, then the tools' model."""
        tools, choice = data.get("tools"), data.get("tool_choice")
        has_choice = "tool_choice" in data
        if tools == [] and not isinstance(choice, dict):
            tools = None
            if choice in ("auto", "required"):
                choice = "none"
        if not has_choice and tools:
            choice, has_choice = "auto", True
        if has_choice and choice not in ("none", None):
            if tools is None:
                raise Refused("When using tool_choice, tools must be set.")
            if choice not in ("auto", "required") and not isinstance(choice, dict):
                raise Refused("invalid tool_choice")
            if isinstance(choice, dict):
                fn = choice.get("function")
                if (
                    not isinstance(fn, dict)
                    or not isinstance(fn.get("name"), str)
                    or not fn["name"]
                ):
                    raise Refused("tool_choice.function.name")
                if not any(
                    isinstance(t, dict) and isinstance(t.get("function"), dict)
                    and t["function"].get("name") == fn["name"]
                    for t in tools
                ):  # fmt: skip
                    raise Refused("tool_choice names no tool")
        if tools is not None and not isinstance(tools, list):
            raise Refused("tools must be an array")
        self.tools = None if tools is None else [_tool(t) for t in tools]
        self.tool_choice = choice if has_choice else "none"

    def _reuse(self, ids: Any, data: dict[str, Any]) -> list[int] | None:
        """online_renderer.py _reused_prompt_token_ids (and the request's
        drop_prompt_token_ids_with_media): forwarded ids replace the render."""
        if data.get("echo") or _has_non_text(self.messages):
            return None
        if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
            raise Refused("kv_transfer_params prompt_token_ids")
        return ids


def _has_non_text(messages: list[dict[str, Any]]) -> bool:
    """chat_message.py has_non_text_content."""
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for p in content:
            if isinstance(p, dict) and (
                any(k in p for k in MEDIA_PART_TYPES | {"prompt_embeds"})
                or p.get("type", "text") not in TEXT_PART_TYPES | {"tool_reference"}
            ):
                return True
    return False


# --- conversation (chat_message.py parse_chat_messages) -------------------------------------

# openai's and vLLM's content-part TypedDict keys (chat_message.py
# _collect_known_content_part_fields): everything else on a text part reaches the template.
KNOWN_PART_FIELDS = frozenset(
    {"type", "text", "image_url", "input_audio", "file", "refusal", "audio_url", "video_url",
     "image_pil", "uuid", "image_embeds", "audio_embeds", "video_embeds", "data", "thinking",
     "closed", "name"}
)  # fmt: skip


def _part_text(p: Any) -> str | None:
    """chat_message.py parse_chat_message_content_mm_part for the text-like parts."""
    if isinstance(p, str):
        return p
    if not isinstance(p, dict):
        raise Refused("content part must be an object")
    t = p.get("type")
    if t in ("text", "input_text", "output_text"):
        v = p.get("text")
    elif t == "refusal":
        v = p.get("refusal")
    elif t == "thinking":
        v = p.get("thinking")
        if v is None:
            raise Unmodelled("thinking part without thinking")
    elif t == "tool_reference":
        raise Unmodelled("tool_reference parts")
    elif t in MEDIA_PART_TYPES or t == "prompt_embeds":
        return None
    else:
        raise Refused(f"unsupported content part type {t!r}")
    if v is not None and not isinstance(v, str):
        raise Refused("text must be a string")
    return v


def _parts(role: str, content: list[Any], fmt: str, model: Model) -> Any:
    """chat_message.py parse_chat_message_content_parts (+ _part)."""
    wrapped: list[dict[str, Any]] = []
    texts: list[str] = []
    for p in content:
        if isinstance(p, dict) and p.get("type") == "prompt_embeds":
            raise Uncountable("prompt_embeds content part")
        text = _part_text(p)
        if (
            text is None
            and isinstance(p, dict)
            and (p.get("type") in MEDIA_PART_TYPES or any(k in p for k in MEDIA_PART_TYPES))
        ):
            if not model.multimodal:
                raise Refused("media on a text-only model")
            if fmt != "openai":
                raise Unmodelled("media placeholders in string templates")
            t = p.get("type", "image_url")
            modality = "image" if "image" in t else "audio" if "audio" in t else "video"
            w = {"type": modality}
            w.update({k: v for k, v in p.items() if k not in KNOWN_PART_FIELDS})
            wrapped.append(w)
            continue
        if text is None:
            continue  # a text or refusal part with no content is skipped
        if fmt == "openai":
            w = {"type": "text", "text": text}
            if isinstance(p, dict):
                w.update({k: v for k, v in p.items() if k not in KNOWN_PART_FIELDS})
            wrapped.append(w)
        else:
            texts.append(text)
    if fmt == "openai":
        return wrapped
    return "\n".join(texts)


def _strip_billing(content: list[Any]) -> list[Any]:
    """chat_message.py _strip_claude_code_billing_header (system messages)."""
    out: list[Any] = []
    for p in content:
        text = (
            p
            if isinstance(p, str)
            else p.get("text")
            if isinstance(p, dict) and p.get("type") == "text"
            else None
        )
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(p)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(p, str) else {**p, "text": rest})
    return out


def conversation(model: Model, messages: list[dict[str, Any]], fmt: str) -> list[dict[str, Any]]:
    """chat_message.py parse_chat_message_content for each message, then
    _postprocess_messages."""
    conv: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        content = m.get("content")
        if content is None:
            content = []
        elif isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if role == "system":
            content = _strip_billing(content)
        out: dict[str, Any] = {"role": role, "content": _parts(role, content, fmt, model)}
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise Refused("tool_calls must be an array")
                out["tool_calls"] = [_tool_call(c) for c in calls]
            reasoning = m.get("reasoning")
            if reasoning is not None:
                out["reasoning"] = reasoning
                out["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in m:
                out["tool_call_id"] = m["tool_call_id"]
            c = out["content"]
            if isinstance(c, list) and not any(
                isinstance(i, dict) and i.get("type") != "text" for i in c
            ):
                texts = [
                    i.get("text", "") for i in c if isinstance(i, dict) and i.get("type") == "text"
                ]
                out["content"] = "\n".join(texts) if texts else ""
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        if isinstance(m.get("task"), str):
            out["task"] = m["task"]
        if role == "developer":
            out["tools"] = m.get("tools")
        conv.append(out)
    for msg in conv:
        _postprocess(msg)
    return conv


def _postprocess(msg: dict[str, Any]) -> None:
    """chat_message.py _postprocess_messages: `tool_calls: []` dropped; arguments parsed
    with json, anything but an object becomes {}."""
    if msg["role"] != "assistant" or "tool_calls" not in msg:
        return
    calls = msg["tool_calls"]
    if len(calls) == 0:
        msg.pop("tool_calls")
        return
    for item in calls:
        fn = item["function"]
        if content := fn.get("arguments"):
            try:
                parsed = json.loads(content)
            except json.JSONDecodeError:
                parsed = None
            fn["arguments"] = parsed if isinstance(parsed, dict) else {}
        else:
            fn["arguments"] = {}


def _developer_to_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """renderers/hf.py _convert_developer_to_system then _consolidate_system_messages."""
    converted = []
    for msg in conv:
        if msg["role"] == "developer":
            new = dict(msg)
            new["role"] = "system"
            new.pop("tools", None)
            converted.append(new)
        else:
            converted.append(msg)
    contents: list[str] = []
    others: list[dict[str, Any]] = []
    needs = False
    for i, msg in enumerate(converted):
        if msg["role"] == "system":
            if i > 0 or contents:
                needs = True
            c = msg.get("content", "")
            if isinstance(c, list):
                c = "\n".join(
                    p["text"] if isinstance(p, dict) else p
                    for p in c
                    if (isinstance(p, dict) and "text" in p) or isinstance(p, str)
                )
            if c:
                contents.append(c)
        else:
            others.append(msg)
    if not needs:
        return converted
    return [{"role": "system", "content": "\n\n".join(contents)}, *others]


@functools.lru_cache(maxsize=8)
def _named_params(tokenizer_type: type) -> frozenset[str]:
    sig = inspect.signature(tokenizer_type.apply_chat_template)
    return frozenset(
        p.name
        for p in sig.parameters.values()
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    )


def _hf_base_params() -> frozenset[str]:
    """renderers/hf.py _get_hf_base_chat_template_params (transformers' PythonBackend)."""
    from transformers import PythonBackend

    return _named_params(PythonBackend)


def template_kwargs(req: ChatRequest, model: Model) -> dict[str, Any]:
    """protocol.py build_chat_params + ChatParams.with_defaults + renderers/hf.py
    resolve_chat_template_kwargs: the request's own fields override the client's
    chat_template_kwargs, None and "auto" values drop out, and only names the template
    reads (or transformers' own parameters) reach the render."""
    extra: dict[str, Any] = {
        "add_generation_prompt": req.add_generation_prompt,
        "continue_final_message": req.continue_final_message,
        "documents": req.documents,
        "reasoning_effort": req.reasoning_effort,
    }
    if req.reasoning_effort is not None and "enable_thinking" not in req.chat_template_kwargs:
        extra["enable_thinking"] = req.reasoning_effort != "none"
    unset = (None, "auto")

    def merge(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
        return defaults | {k: v for k, v in overrides.items() if v not in unset}

    ctk = merge(req.chat_template_kwargs, extra)
    defaults = merge({}, {"tools": None if req.tools is None else req.tools, "tokenize": False})
    ctk = merge(defaults, ctk)
    accept = (
        {k for k in ctk if k in _named_params(type(model.tokenizer))}
        | template_vars(model.template)
        | _hf_base_params()
    ) - {"chat_template", "tokenize"}
    return {k: v for k, v in ctk.items() if k in accept}


def chat(model: Model, body: bytes) -> Count:
    """POST /v1/chat/completions (chat_completion/serving.py, renderers/online_renderer.py
    render_chat)."""
    req = ChatRequest(parse(body))
    if req.reuse_ids is not None:
        return one(len(req.reuse_ids))
    fmt = content_format(model.template)
    conv = conversation(model, req.messages, fmt)
    if any(m["role"] == "developer" for m in conv) and not names_developer(model.template):
        conv = _developer_to_system(conv)
    kwargs = template_kwargs(req, model)
    tools = kwargs.pop("tools", None)
    agp = kwargs.pop("add_generation_prompt", True)
    cfm = kwargs.pop("continue_final_message", False)
    docs = kwargs.pop("documents", None)
    kwargs.pop("return_dict", None)
    try:
        text = model.render(
            conv,
            tools=tools,
            documents=docs,
            add_generation_prompt=agp,
            continue_final_message=cfm,
            template_kwargs=kwargs,
        )
    except Exception as exc:
        raise Refused(f"template: {type(exc).__name__}: {exc}") from None
    return one(len(model.encode(text, add_special_tokens=req.add_special_tokens)))


# --- prompt-only routes ---------------------------------------------------------------------


def _bool(data: dict[str, Any], key: str, default: bool) -> bool:
    v = data.get(key, default)
    if not isinstance(v, bool):
        raise Unmodelled(f"non-boolean {key}")
    return v


def _text_tokens(model: Model, text: str, special: bool) -> int:
    """renderers/base.py _tokenize_prompt: `tokenizer(text, add_special_tokens=...)`."""
    return len(model.tokenizer(text, add_special_tokens=special)["input_ids"])


def _prompts(model: Model, prompt: Any, special: bool) -> list[int]:
    if isinstance(prompt, str):
        return [_text_tokens(model, prompt, special)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [_text_tokens(model, p, special) for p in prompt]
        if all(type(p) is int and p >= 0 for p in prompt):
            return [len(prompt)]
        if all(isinstance(p, list) and all(type(x) is int and x >= 0 for x in p) for p in prompt):
            return [len(p) for p in prompt]
    raise Refused("prompt type")


def _embeds_rows(payload: Any) -> None:
    """renderers/embed_utils.py safe_load_prompt_embeds: refused unless the server runs
    with --enable-prompt-embeds; then the size is the tensor's first dimension, which this
    oracle does not decode (torch is not a test dependency)."""
    items = payload if isinstance(payload, list) else [payload]
    for item in items:
        if not isinstance(item, str):
            raise Refused("prompt_embeds must be base64 strings")
        try:
            base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError):
            raise Refused("prompt_embeds is not base64") from None
    raise Uncountable("prompt_embeds (served with --enable-prompt-embeds)")


def completions(model: Model, body: bytes) -> Count:
    """POST /v1/completions (completion/protocol.py, online_renderer.py
    preprocess_completion): prompt_embeds first, then the prompt(s), special tokens on
    unless the request turns them off."""
    data = parse(body)
    if data.get("truncate_prompt_tokens") is not None:
        raise Unmodelled("truncate_prompt_tokens")
    prompt, embeds = data.get("prompt"), data.get("prompt_embeds")
    if (prompt is None or prompt == []) and (embeds is None or embeds == []):
        raise Refused("Either prompt or prompt_embeds must be provided and non-empty.")
    if embeds is not None and embeds != []:
        _embeds_rows(embeds)
    if data.get("suffix") is not None:
        raise Unmodelled("suffix")
    return batch(_prompts(model, prompt, _bool(data, "add_special_tokens", True)))


def embeddings(model: Model, body: bytes) -> Count:
    """POST /v1/embeddings, the completion-style request (pooling/embed/protocol.py)."""
    data = parse(body)
    if "messages" in data:
        raise Unmodelled("chat-style embeddings")
    if data.get("truncate_prompt_tokens") is not None:
        raise Unmodelled("truncate_prompt_tokens")
    inp = data.get("input")
    if inp is None:
        raise Refused("input is required")
    return batch(_prompts(model, inp, _bool(data, "add_special_tokens", True)))


# pooling/scoring/protocol.py ScoreRequest: pydantic's union takes the first member whose
# two fields are present (ties on field count fall to the leftmost; extra fields allowed).
SCORE_SHAPES = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)


def _score_items(v: Any) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        return v
    if isinstance(v, dict) or (isinstance(v, list) and any(isinstance(x, dict) for x in v)):
        raise Unmodelled("multimodal score inputs")
    raise Refused("score input type")


def _pairs(first: Any, second: Any) -> list[tuple[str, str]]:
    a, b = _score_items(first), _score_items(second)
    if len(a) == 1:
        return [(a[0], d) for d in b]
    if len(a) != len(b):
        raise Refused("score inputs of different lengths")
    return list(zip(a, b, strict=True))


def _score_count(model: Model, pairs: list[tuple[str, str]], data: dict[str, Any]) -> Count:
    """scoring/io_processor.py get_score_prompt without a score template: a cross-encoder
    encodes the pair (`tokenizer(text=q, text_pair=d)`), an LLM used as a reranker the
    concatenation; which one a server runs depends on its model, so both are variants."""
    for key in ("max_tokens_per_query", "max_tokens_per_doc", "truncate_prompt_tokens"):
        if data.get(key):
            raise Unmodelled(key)
    pair = [len(model.encode_pair(q, d)) for q, d in pairs]
    joined = [_text_tokens(model, q + d, True) for q, d in pairs]
    return Count(max(pair), tuple(pair), {"llm_reranker": max(joined)})


def score(model: Model, body: bytes) -> Count:
    """POST /score and /v1/score."""
    data = parse(body)
    for first, second in SCORE_SHAPES:
        if first in data and second in data:
            return _score_count(model, _pairs(data[first], data[second]), data)
    raise Refused("no score inputs")


def rerank(model: Model, body: bytes) -> Count:
    """POST /rerank, /v1/rerank, /v2/rerank (pooling/scoring/protocol.py RerankRequest)."""
    data = parse(body)
    if "query" not in data or "documents" not in data:
        raise Refused("query and documents are required")
    if not isinstance(data["query"], str):
        raise Unmodelled("multimodal query")
    return _score_count(model, _pairs(data["query"], data["documents"]), data)


ROUTES = {
    "chat": chat,
    "completions": completions,
    "embeddings": embeddings,
    "score": score,
    "rerank": rerank,
}


def count(model: Model, route: str, body: bytes) -> Count:
    """The tokens vLLM 0.34.0 prefills for `body` on `route` (raises Refused, Unmodelled
    or Uncountable)."""
    fn = ROUTES.get(route)
    if fn is None:
        raise Unmodelled(f"route {route} on vLLM")
    return fn(model, body)
