"""What smg 1.13.0 (PD mode, HTTP workers) does to a request body before SGLang sees it,
replicated from smg@v1.13.0 (`versions.py`); then the SGLang oracle counts the result.

In PD mode smg buffers every request: axum's `ValidatedJson` deserializes the body into
the typed request of crates/protocols (serde_json, no `arbitrary_precision`), normalizes
and validates it (`Normalizable::normalize`, `Validate`), and the PD router serializes the
typed value again (model_gateway/src/routers/http/request_body.rs
serialize_request_body), adding the bootstrap fields. So what reaches SGLang is the
request as smg's types understand it:
  - roles are an exact-match serde tag: "System" or "USER" is a 400, not a lower-cased role
  - numbers in free JSON (tool schemas, template kwargs, unknown fields) come back as
    serde_json prints them: integers inside u64/i64 as they were, everything else as an
    f64 (`-0` becomes `-0.0`, an integer beyond 64 bits a float, `1E+2` `100.0`)
  - typed structs come back in their field order with the fields they know: a tool loses
    its top-level `defer_loading`, a function's keys are reordered (name, description,
    parameters, strict, then the unknown ones), a missing `parameters` becomes `{}`; an
    assistant's `reasoning` is renamed `reasoning_content`; a tool message loses `name`
  - `max_tokens` keeps its name (request_body.rs / chat.rs normalize: "not migrated").

`forward(route, body)` returns the forwarded body as JSON values (what SGLang's orjson
parse yields from smg's bytes); `count` feeds it to the SGLang oracle. The slow suite holds
`forward` against the real binary (test_oracle_smg_real.py).
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

from oracles import sglang
from oracles.common import Count, Refused, Unmodelled
from oracles.models import Model

SRC = "smg@v1.13.0"


class F64(float):
    """A JSON number serde_json holds as an f64 (printed by ryu, see `ryu`)."""


def _int(text: str) -> int | float:
    """serde_json's integer parse: u64 when non-negative and it fits, i64 when negative
    and it fits, else an f64 (`-0` too: "Convert into a float if we underflow, or on
    `-0`"; the 1.13.0 binary prints it -0.0)."""
    v = int(text)
    if text.lstrip().startswith("-"):
        if v == 0:
            return F64(-0.0)
        if v >= -(2**63):
            return v
        return F64(float(text))
    if v < 2**64:
        return v
    return F64(float(text))


def _float(text: str) -> float:
    v = float(text)
    if math.isinf(v):
        raise Refused("number out of range")
    return F64(v)


def _constant(text: str) -> Any:
    raise Refused(f"{text} is not JSON")


def load(body: bytes) -> Any:
    """serde_json::from_slice into `Value`s, numbers as serde_json holds them."""
    try:
        return json.loads(body, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except (ValueError, RecursionError):
        raise Refused("json") from None


def ryu(x: float) -> str:
    """How smg's serde_json prints an f64 (as the 1.13.0 binary does; the layout of the
    `ryu` crate's format64 with a signed exponent): the shortest round-trip digits
    (Python's repr finds the same digits), positional with ".0" while the value is below
    1e16, scientific beyond, the exponent unpadded: 1e15 -> "1000000000000000.0",
    1e16 -> "1e+16", 1.5e-7 -> "1.5e-7", -0.0 -> "-0.0"."""
    if x == 0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    sign = "-" if x < 0 else ""
    mantissa, _, exp = repr(abs(x)).partition("e")
    whole, _, frac = mantissa.partition(".")
    raw = (whole + frac).lstrip("0")
    digits = raw.rstrip("0")
    e = int(exp or 0) - len(frac) + (len(raw) - len(digits))  # value = digits * 10**e
    n = len(digits)
    kk = n + e
    if e >= 0 and kk <= 16:
        return f"{sign}{digits}{'0' * e}.0"
    if 0 < kk <= 16:
        return f"{sign}{digits[:kk]}.{digits[kk:]}"
    if -5 < kk <= 0:
        return f"{sign}0.{'0' * -kk}{digits}"
    exp10 = f"e{'+' if kk > 0 else ''}{kk - 1}"
    if n == 1:
        return f"{sign}{digits}{exp10}"
    return f"{sign}{digits[0]}.{digits[1:]}{exp10}"


# --- typed deserialization (crates/protocols/src/chat.rs, common.rs) ------------------------


def _string(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise Refused(f"{what} must be a string")
    return v


def _opt_string(v: Any, what: str) -> str | None:
    return None if v is None else _string(v, what)


def _part(p: Any) -> dict[str, Any]:
    """common.rs ContentPart: a known `type` with its typed fields, else the object as it
    came (`Unknown`, which also takes a malformed known type)."""
    if not isinstance(p, dict):
        raise Refused("content part must be an object")
    t = p.get("type")
    if t == "text" and isinstance(p.get("text"), str):
        return {"type": "text", "text": p["text"]}
    if t == "image_url" and isinstance(p.get("image_url"), dict):
        iu = p["image_url"]
        if isinstance(iu.get("url"), str):
            out: dict[str, Any] = {"url": iu["url"]}
            if isinstance(iu.get("detail"), str):
                out["detail"] = iu["detail"]
            return {"type": "image_url", "image_url": out}
    if t in ("audio_url", "input_audio", "video_url"):
        raise Unmodelled(f"smg {t} parts")
    return dict(p)


def _content(v: Any, *, required: bool, default: Any = None) -> Any:
    """common.rs MessageContent (untagged: a string or an array of parts)."""
    if v is None:
        if required:
            raise Refused("content is required")
        return default
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return [_part(p) for p in v]
    raise Refused("content must be a string or an array")


def _tool_call(c: Any) -> dict[str, Any]:
    """common.rs ToolCall {id, type, function: FunctionCallResponse{name, arguments}}."""
    if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
        raise Refused("tool call must be an object with a function")
    fn = c["function"]
    return {
        "id": _string(c.get("id"), "tool call id"),
        "type": _string(c.get("type"), "tool call type"),
        "function": {
            "name": _string(fn.get("name"), "function name"),
            "arguments": _opt_string(fn.get("arguments"), "arguments"),
        },
    }


def _message(m: Any) -> dict[str, Any]:
    """chat.rs ChatMessage: internally tagged by an exact "role"; unknown keys are
    dropped, extension structs too (ProviderProfile::normalize_chat, Generic profile)."""
    if not isinstance(m, dict):
        raise Refused("message must be an object")
    role = m.get("role")
    out: dict[str, Any] = {"role": role}
    if role in ("system", "user", "developer", "root"):
        if role == "root":
            raise Refused("root messages are refused outside the MiniMax profile")
        out["content"] = _content(
            m.get("content") if "content" in m or role != "system" else "",
            required=True,
        )
        name = _opt_string(m.get("name"), "name")
        if name is not None:
            out["name"] = name
        return out
    if role == "assistant":
        if "reasoning" in m and "reasoning_content" in m:
            raise Refused("duplicate field reasoning_content")
        content = _content(m.get("content"), required=False)
        if content is not None:
            out["content"] = content
        name = _opt_string(m.get("name"), "name")
        if name is not None:
            out["name"] = name
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise Refused("tool_calls must be an array")
            out["tool_calls"] = [_tool_call(c) for c in calls]
        reasoning = _opt_string(m.get("reasoning_content", m.get("reasoning")), "reasoning")
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        return out
    if role == "tool":
        out["content"] = _content(m.get("content"), required=True)
        out["tool_call_id"] = _string(m.get("tool_call_id"), "tool_call_id")
        return out
    if role == "function":
        out["content"] = _string(m.get("content"), "content")
        out["name"] = _string(m.get("name"), "name")
        return out
    raise Refused(f"unknown variant {role!r}")


def _function(f: Any) -> dict[str, Any]:
    """common.rs Function: name, description, parameters (missing or null: {}), strict,
    then the unknown keys in the client's order (`extra`, flattened)."""
    if not isinstance(f, dict):
        raise Refused("function must be an object")
    out: dict[str, Any] = {"name": _string(f.get("name"), "function name")}
    desc = _opt_string(f.get("description"), "description")
    if desc is not None:
        out["description"] = desc
    params = f.get("parameters")
    out["parameters"] = {} if params is None else params
    strict = f.get("strict")
    if strict is not None:
        if not isinstance(strict, bool):
            raise Refused("strict must be a boolean")
        out["strict"] = strict
    for k, v in f.items():
        if k not in ("name", "description", "parameters", "strict"):
            out[k] = v
    return out


def _tool(t: Any) -> dict[str, Any]:
    """common.rs Tool {type, function}: nothing else on the tool survives."""
    if not isinstance(t, dict):
        raise Refused("tool must be an object")
    return {"type": _string(t.get("type"), "tool type"), "function": _function(t.get("function"))}


# chat.rs ChatCompletionRequest: the typed fields (declaration order) the replica carries
# through; every other key goes to `other` (flattened, client order) unchanged.
_TYPED = (
    "messages", "model", "frequency_penalty", "function_call", "functions", "logit_bias",
    "logprobs", "max_tokens", "max_completion_tokens", "metadata", "modalities",
    "return_audio", "n", "parallel_tool_calls", "presence_penalty", "prompt_cache_key",
    "reasoning_effort", "thinking", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "verbosity", "top_k", "min_p", "min_tokens",
    "repetition_penalty", "regex", "ebnf", "stop_token_ids", "no_stop_trim", "ignore_eos",
    "continue_final_message", "skip_special_tokens", "lora_path", "session_params",
    "separate_reasoning", "stream_reasoning", "chat_template_kwargs", "return_hidden_states",
    "sampling_seed", "rid",
)  # fmt: skip


def _number_text(v: int | float) -> str:
    return ryu(v) if isinstance(v, float) else str(v)


def _range(data: dict[str, Any], key: str, lo: float, hi: float | None) -> None:
    v = data.get(key)
    if v is None:
        return
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise Refused(f"{key} must be a number")
    if v < lo or (hi is not None and v > hi):
        raise Refused(f"{key} out of range")


def chat_forward(data: Any) -> dict[str, Any]:
    """POST /v1/chat/completions through smg's PD router: what SGLang receives."""
    if not isinstance(data, dict):
        raise Refused("body is not an object")
    if not isinstance(data.get("model"), str):
        raise Refused("missing field model")
    msgs = data.get("messages")
    if not isinstance(msgs, list):
        raise Refused("messages must be an array")
    messages = [_message(m) for m in msgs]
    if not messages:
        raise Refused("Invalid 'messages': empty array")
    out: dict[str, Any] = {"messages": messages}
    tools = data.get("tools")
    functions = data.get("functions")
    if tools is not None and not isinstance(tools, list):
        raise Refused("tools must be an array")
    typed_tools = None if tools is None else [_tool(t) for t in tools]
    if typed_tools is None and isinstance(functions, list):
        typed_tools = [{"type": "function", "function": _function(f)} for f in functions]
    choice = data.get("tool_choice")
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise Refused("unknown tool_choice")
    if choice is not None and not isinstance(choice, (str, dict)):
        raise Refused("tool_choice")
    if choice is None and typed_tools is not None:
        choice = "none" if not typed_tools else "auto"  # chat.rs normalize
    # chat.rs validate_chat_cross_parameters (the checks a fuzzed body can trip)
    if choice not in (None, "none", "auto") and not typed_tools:
        raise Refused("tool_choice is only allowed when tools are specified")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if not any(t["function"]["name"] == name for t in typed_tools or []):
            raise Refused("tool_choice function not found")
    for t in typed_tools or []:
        if not isinstance(t["function"]["parameters"], dict):
            raise Refused("tools[].function.parameters: expected an object")
    _range(data, "temperature", 0.0, 2.0)
    _range(data, "top_p", 0.0, 1.0)
    _range(data, "max_tokens", 1, 2**32 - 1)
    _range(data, "max_completion_tokens", 1, 2**32 - 1)
    _range(data, "n", 1, 10)
    if data.get("top_logprobs") is not None and not data.get("logprobs"):
        raise Refused("top_logprobs requires logprobs")
    effort = data.get("reasoning_effort")
    if effort is not None and not isinstance(effort, (str, int, float)):
        raise Refused("reasoning_effort must be a string, number, or null")
    ctk = data.get("chat_template_kwargs")
    if ctk is not None and not isinstance(ctk, dict):
        raise Refused("chat_template_kwargs must be an object")
    cfm = data.get("continue_final_message")
    if cfm is not None and not isinstance(cfm, bool):
        raise Refused("continue_final_message must be a boolean")
    for key in _TYPED[1:]:
        if key in ("functions", "function_call"):
            continue  # migrated to tools / tool_choice by chat.rs normalize
        if key == "tools":
            if typed_tools is not None:
                out["tools"] = typed_tools
        elif key == "tool_choice":
            if choice is not None:
                out["tool_choice"] = choice
        elif key == "reasoning_effort":
            if effort is not None:
                # chat.rs deserialize_reasoning_effort: a number becomes its own text
                out[key] = effort if isinstance(effort, str) else _number_text(effort)
        elif key == "continue_final_message":
            if cfm:
                out[key] = True
        elif data.get(key) is not None:
            out[key] = data[key]
    for k, v in data.items():
        if k not in _TYPED:
            out[k] = v  # `other`, flattened in the client's order
    return out


def completions_forward(data: Any) -> dict[str, Any]:
    """completion.rs CompletionRequest: `prompt` is a string or strings (token ids are an
    invalid_type 400), `model` required."""
    if not isinstance(data, dict) or not isinstance(data.get("model"), str):
        raise Refused("missing field model")
    prompt = data.get("prompt")
    if not (
        isinstance(prompt, str)
        or (isinstance(prompt, list) and all(isinstance(p, str) for p in prompt))
    ):
        raise Refused("invalid_type: prompt")
    return dict(data)


def generate_forward(data: Any) -> dict[str, Any]:
    """generate.rs GenerateRequest: `text` is one string; input_ids one list or a batch."""
    if not isinstance(data, dict):
        raise Refused("body is not an object")
    text = data.get("text")
    if text is not None and not isinstance(text, str):
        raise Refused("text must be a string")
    return dict(data)


FORWARD = {"chat": chat_forward, "completions": completions_forward, "generate": generate_forward}


def forward(route: str, body: bytes) -> dict[str, Any]:
    """The body smg forwards to the SGLang workers (as values), or Refused."""
    fn = FORWARD.get(route)
    if fn is None:
        raise Unmodelled(f"route {route} through smg")
    return fn(load(body))


def count(model: Model, route: str, body: bytes) -> Count:
    """smg 1.13 in front of SGLang 0.5.23: smg's rewrite, then SGLang's count."""
    forwarded = forward(route, body)
    return sglang.count(model, route, orjson.dumps(_plain(forwarded)))


def _plain(v: Any) -> Any:
    if isinstance(v, float):
        return float(v)
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v
