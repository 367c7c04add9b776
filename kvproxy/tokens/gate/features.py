"""Request features: what a request uses that an engine's preprocessing may treat its own
way. Pure, sans-IO: a parsed body (and its route) in, a set of feature names out.

kvproxy's exact chat count renders its *replica* of the engine's request normalisation
(`tokens.replica.chatnorm`). The replica is only as good as the bodies it was proven on, so the
exact count may admit a request only when every feature the request uses is in the verified
table for the engines and router in front (`tokens.gate.verified`); anything else is decided by
the guaranteed bound alone. This module names the features; it never decides.

The vocabulary is closed and small (every name is a constant of `FEATURES`): feature names
travel into error bodies and a metric label, so they name *where* and *what kind*, never a
value, a key the client chose, or any text (I8). A key kvproxy does not know is a feature
too (`unknown:<where>`), never ignored.

Feature names, by where they live:

    route:<route>              the route (chat, responses, messages, completions, generate, ...)
    role:system|user|assistant|tool      the plain roles, spelled in lowercase
    role:developer, role:function        roles some engines map or templates skip
    role:case                  a known role spelled otherwise ("System", "USER"): SGLang
                               lower-cases roles before rendering, smg refuses them
    role:other                 any other role name
    final:assistant|tool|system|other    the last message is not a user turn (SGLang turns a
                               final assistant message into a prefix the template continues)
    content:string|null|parts  a message's content form
    part:text|string|image|audio|video|refusal|other   content part kinds
    content:multi_text         several text parts in one message (engines join them with
                               "\\n" or " ", or pass the list)
    tool:parts                 list content in a tool message
    message:name|tool_call_id|reasoning_content|reasoning|thinking|refusal|function_call
    tool_calls, tool_calls:empty, tool_calls:args_string, tool_calls:args_object,
    tool_calls:args_invalid, tool_calls:non_assistant
    tools, tools:strict, tools:defer_loading, tools:non_function, functions
    tool_choice, response_format, documents, chat_template, add_special_tokens,
    mm_kwargs                  top-level fields an engine hands its renderer
    add_generation_prompt:true|false    the flag, present in the body
    continue_final_message     set to true
    reasoning_effort, reasoning_effort:none, reasoning (SGLang's object)
    kwarg:enable_thinking|thinking|reasoning_effort|special_token|other   chat_template_kwargs
    number:float               a float anywhere a template can print it
    number:big_int             an integer beyond 2**53 (JSON's exact range in a float64
                               re-serialiser, smg's), or an integral float beyond it (orjson
                               turns integer literals beyond 64 bits into floats)
    prompt:text, prompt:ids, prompt:batch, suffix, echo, generate:text,
    generate:input_ids, generate:media, generate:batch   completions and /generate forms
                               (text is tokenized with the special tokens the engine's
                               tokenizer adds, which kvproxy takes from tokenizer.json)
    unknown:body|message|part|tool|tool_function|tool_call|tool_call_function
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

Feature = str

# Largest integer a float64 holds exactly: a router that re-serialises numbers as 64-bit
# floats (smg, facts/ENGINES.md) prints anything beyond it differently.
EXACT_INT = 2**53
# The feature read runs on the event loop: tool-call argument strings longer than this are
# not parsed and values are walked at most this many at a time. Past either, the numbers
# are taken to be there (number:float and number:big_int): unverified, decided by the
# bound. A 64 KiB json.loads costs well under a millisecond.
MAX_PARSED_ARGS_CHARS = 65_536
MAX_WALKED_VALUES = 50_000
_BOTH_NUMBERS = ("number:float", "number:big_int")

PLAIN_ROLES = frozenset({"system", "user", "assistant", "tool"})
_MAPPED_ROLES = {"developer": "role:developer", "function": "role:function"}

# Top-level chat fields that never reach an engine's request preprocessing (sampling, output
# shaping, transport): OpenAI's chat API, vLLM's ChatCompletionRequest (entrypoints/openai/
# chat_completion/protocol.py) and SGLang's ChatCompletionRequest (srt/entrypoints/openai/
# protocol.py). `truncate_prompt_tokens` only ever lowers the engine's count, never raises it.
# Not inert: vLLM's `kv_transfer_params` can carry the prompt's token ids (the oracle's
# chat-kv-transfer-prompt-ids case), so it is an unknown key like any other.
INERT_KEYS = frozenset(
    {"model", "max_tokens", "max_completion_tokens", "max_new_tokens", "n", "best_of",
     "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
     "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
     "length_penalty", "logprobs", "top_logprobs", "logit_bias", "user", "metadata",
     "store", "service_tier", "parallel_tool_calls", "min_tokens", "ignore_eos",
     "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
     "no_stop_trim", "regex", "ebnf", "json_schema", "structural_tag", "structured_outputs",
     "guided_json", "guided_regex", "guided_choice", "guided_grammar", "lora_path", "rid",
     "bootstrap_host", "bootstrap_port", "bootstrap_room", "separate_reasoning",
     "stream_reasoning", "include_reasoning", "thinking_token_budget", "priority",
     "request_id", "session_id", "cache_salt", "use_beam_search", "bad_words",
     "allowed_token_ids", "prompt_logprobs",
     "return_tokens_as_token_ids", "return_token_ids", "return_hidden_states",
     "return_prompt_text", "custom_logit_processor", "custom_params", "vllm_xargs",
     "watermarking", "truncate_prompt_tokens", "truncation_side", "logprob_token_ids",
     "repetition_detection", "stream_interval", "sampling_seed", "modalities"}
)  # fmt: skip

_CHAT_TOP = frozenset(
    {"messages", "tools", "functions", "tool_choice", "response_format", "documents",
     "chat_template", "chat_template_kwargs", "reasoning_effort", "reasoning",
     "add_generation_prompt", "continue_final_message", "add_special_tokens",
     "mm_processor_kwargs", "media_io_kwargs", "echo"}
)  # fmt: skip
_MESSAGE_KEYS = {
    "name": "message:name",
    "tool_call_id": "message:tool_call_id",
    "reasoning_content": "message:reasoning_content",
    "reasoning": "message:reasoning",
    "thinking": "message:thinking",
    "refusal": "message:refusal",
    "function_call": "message:function_call",
}
_PART_KINDS = {
    "text": "part:text",
    "input_text": "part:text",
    "output_text": "part:text",
    "refusal": "part:refusal",
    "image_url": "part:image",
    "input_image": "part:image",
    "image": "part:image",
    "video_url": "part:video",
    "video": "part:video",
    "input_audio": "part:audio",
    "audio_url": "part:audio",
    "audio": "part:audio",
}
# Keys each part kind may carry besides `type` (OpenAI's content part shapes).
_PART_KEYS = frozenset(
    {"type", "text", "refusal", "image_url", "input_image", "image", "video_url", "video",
     "input_audio", "audio_url", "audio", "detail", "file_id"}
)  # fmt: skip
_TOOL_KEYS = frozenset({"type", "function", "defer_loading"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict", "defer_loading"})
_CALL_KEYS = frozenset({"id", "type", "function", "index"})
_CALL_FUNCTION_KEYS = frozenset({"name", "arguments"})
_SPECIAL_TOKENS = frozenset(
    {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}
)
_KWARGS = {"enable_thinking", "thinking", "reasoning_effort"}

_COMPLETIONS_TOP = frozenset({"prompt", "suffix", "echo"})
_GENERATE_TOP = frozenset(
    {"text", "input_ids", "sampling_params", "image_data", "video_data", "audio_data",
     "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
     "return_text_in_logprobs"}
)  # fmt: skip


def request_features(route: str, data: Mapping[str, Any]) -> frozenset[Feature]:
    """Every feature of one parsed request body on `route` (see the module docstring).

    Total over any JSON: a shape kvproxy's parser would refuse still gets features (the
    function never raises), and anything it cannot place is `unknown:<where>`."""
    out: set[Feature] = {f"route:{route}"}
    if route == "chat":
        _chat(data, out)
    elif route == "completions":
        _top_level(data, _COMPLETIONS_TOP, out)
        prompt = data.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and any(
            isinstance(p, str) for p in prompt
        )):  # fmt: skip
            out.add("prompt:text")
        if isinstance(prompt, list) and prompt:
            if not isinstance(prompt[0], str):
                out.add("prompt:ids")
            if len(prompt) > 1 and not isinstance(prompt[0], int):
                out.add("prompt:batch")
        if data.get("suffix") is not None:
            out.add("suffix")
        if data.get("echo"):
            out.add("echo")
    elif route == "generate":
        _top_level(data, _GENERATE_TOP, out)
        if data.get("text") is not None:
            out.add("generate:text")
        if data.get("input_ids") is not None:
            out.add("generate:input_ids")
        if isinstance(data.get("text"), list):
            out.add("generate:batch")
        if any(data.get(k) is not None for k in ("image_data", "video_data", "audio_data")):
            out.add("generate:media")
    # Other routes (responses, messages, the prompt-only ones) are verified, or not, as a
    # whole: the route feature names them.
    return frozenset(out)


def _top_level(data: Mapping[str, Any], known: frozenset[str], out: set[Feature]) -> None:
    for key in data:
        if key not in known and key not in INERT_KEYS:
            out.add("unknown:body")
            return


def _chat(data: Mapping[str, Any], out: set[Feature]) -> None:
    _top_level(data, _CHAT_TOP, out)
    messages = data.get("messages")
    if isinstance(messages, list):
        for msg in messages:
            _message(msg, out)
        last = messages[-1] if messages else None
        role = last.get("role") if isinstance(last, dict) else None
        if isinstance(role, str) and role != "user":
            low = role.lower()
            out.add(f"final:{low}" if low in ("assistant", "tool", "system") else "final:other")
    tools = data.get("tools")
    if tools is not None:
        _tools(tools, out)
    if data.get("functions") is not None:
        out.add("functions")
        _numbers(data["functions"], out)
    for key, feature in (
        ("tool_choice", "tool_choice"),
        ("response_format", "response_format"),
        ("documents", "documents"),
        ("chat_template", "chat_template"),
        ("reasoning", "reasoning"),
    ):
        if data.get(key) is not None:
            out.add(feature)
            _numbers(data[key], out)
    for key in ("mm_processor_kwargs", "media_io_kwargs"):
        if data.get(key) is not None:
            out.add("mm_kwargs")
    if data.get("add_special_tokens"):
        out.add("add_special_tokens")
    if data.get("echo"):
        out.add("echo")
    agp = data.get("add_generation_prompt")
    if agp is not None:
        out.add("add_generation_prompt:true" if agp is True else "add_generation_prompt:false")
    if data.get("continue_final_message"):
        out.add("continue_final_message")
    effort = data.get("reasoning_effort")
    if effort is not None:
        out.add("reasoning_effort")
        if effort == "none":
            out.add("reasoning_effort:none")
    kwargs = data.get("chat_template_kwargs")
    if isinstance(kwargs, dict):
        for key, value in kwargs.items():
            if key in _KWARGS and (key == "reasoning_effort" or isinstance(value, bool)):
                out.add(f"kwarg:{key}")
            elif key in _SPECIAL_TOKENS:
                out.add("kwarg:special_token")
            else:
                out.add("kwarg:other")
            _numbers(value, out)
    elif kwargs is not None:
        out.add("kwarg:other")


def _message(msg: Any, out: set[Feature]) -> None:
    if not isinstance(msg, dict):
        out.add("unknown:message")
        return
    role = msg.get("role")
    if isinstance(role, str) and role in PLAIN_ROLES:
        out.add(f"role:{role}")
    elif isinstance(role, str) and role in _MAPPED_ROLES:
        out.add(_MAPPED_ROLES[role])
    elif isinstance(role, str) and role.lower() in PLAIN_ROLES.union(_MAPPED_ROLES):
        out.add("role:case")
    else:
        out.add("role:other")
    if len(msg) == 2 and isinstance(msg.get("content"), str):
        out.add("content:string")  # the common case: nothing else to look at
        return
    content = msg.get("content", None)
    if isinstance(content, str):
        out.add("content:string")
    elif content is None:
        out.add("content:null")
    elif isinstance(content, list):
        out.add("content:parts")
        if isinstance(role, str) and role.lower() == "tool":
            out.add("tool:parts")
        texts = 0
        for part in content:
            if isinstance(part, str):
                out.add("part:string")
                texts += 1
                continue
            if not isinstance(part, dict):
                out.add("part:other")
                continue
            kind_name = part.get("type")
            kind = (
                _PART_KINDS.get(kind_name, "part:other")
                if isinstance(kind_name, str)
                else "part:other"
            )
            out.add(kind)
            texts += kind == "part:text"
            if not _PART_KEYS.issuperset(part):
                out.add("unknown:part")
        if texts > 1:
            out.add("content:multi_text")
    else:
        out.add("content:other")
    for key, value in msg.items():
        if key in ("role", "content"):
            continue
        if key == "tool_calls":
            _tool_calls(value, role, out)
        elif key in _MESSAGE_KEYS:
            out.add(_MESSAGE_KEYS[key])
            _numbers(value, out)
        else:
            out.add("unknown:message")
            _numbers(value, out)


def _tool_calls(calls: Any, role: Any, out: set[Feature]) -> None:
    if calls is None:
        out.add("tool_calls")
        return
    out.add("tool_calls")
    if not (isinstance(role, str) and role == "assistant"):
        out.add("tool_calls:non_assistant")
    if not isinstance(calls, list):
        out.add("unknown:tool_call")
        return
    if not calls:
        out.add("tool_calls:empty")
    for call in calls:
        if not isinstance(call, dict):
            out.add("unknown:tool_call")
            continue
        if not _CALL_KEYS.issuperset(call):
            out.add("unknown:tool_call")
        fn = call.get("function")
        if not isinstance(fn, dict):
            continue
        if not _CALL_FUNCTION_KEYS.issuperset(fn):
            out.add("unknown:tool_call_function")
        args = fn.get("arguments")
        if isinstance(args, str):
            out.add("tool_calls:args_string")
            if len(args) > MAX_PARSED_ARGS_CHARS:
                out.update(_BOTH_NUMBERS)
                continue
            try:
                # Both engines parse the string (json or orjson): its numbers reach the
                # template re-serialised, so they are features like any other number.
                _numbers(json.loads(args), out)
            except (ValueError, RecursionError):
                out.add("tool_calls:args_invalid")
        elif args is not None:
            out.add("tool_calls:args_object")
            _numbers(args, out)


def _tools(tools: Any, out: set[Feature]) -> None:
    out.add("tools")
    if not isinstance(tools, list):
        out.add("unknown:tool")
        return
    for tool in tools:
        if not isinstance(tool, dict):
            out.add("unknown:tool")
            continue
        if tool.get("type", "function") != "function":
            out.add("tools:non_function")
        if not _TOOL_KEYS.issuperset(tool):
            out.add("unknown:tool")
        if tool.get("defer_loading") is not None:
            out.add("tools:defer_loading")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            out.add("unknown:tool_function")
            continue
        if not _FUNCTION_KEYS.issuperset(fn):
            out.add("unknown:tool_function")
        if fn.get("strict") is not None:
            out.add("tools:strict")
        if fn.get("defer_loading") is not None:
            out.add("tools:defer_loading")
        _numbers(fn, out)


def _numbers(value: Any, out: set[Feature]) -> None:
    """Adds number:float / number:big_int for numbers anywhere inside `value`.

    Iterative: orjson accepts nesting 1,023 deep, past Python's recursion limit."""
    pending: list[Any] = [value]
    steps = 0
    while pending:
        item = pending.pop()
        steps += 1
        if steps > MAX_WALKED_VALUES:
            out.update(_BOTH_NUMBERS)
            return
        if isinstance(item, bool) or item is None or isinstance(item, str):
            continue
        if isinstance(item, float):
            out.add("number:float")
            if item.is_integer() and abs(item) > EXACT_INT:
                # orjson turns integer literals beyond 64 bits into floats: such a float may
                # stand for digits the client sent and no float prints back.
                out.add("number:big_int")
        elif isinstance(item, int):
            if not -EXACT_INT <= item <= EXACT_INT:
                out.add("number:big_int")
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        if "number:float" in out and "number:big_int" in out:
            return  # nothing more to find


def describe(features: Iterable[Feature]) -> str:
    """Features as a short sorted list for messages and logs."""
    return ", ".join(sorted(features))


# The closed vocabulary (metric label values and the verified table use only these).
FEATURES: frozenset[Feature] = frozenset(
    {f"route:{r}" for r in ("chat", "completions", "generate", "responses", "messages",
                            "embeddings", "classify", "rerank", "score", "encode",
                            "native_classify")}
    | {f"role:{r}" for r in (*PLAIN_ROLES, "developer", "function", "case", "other")}
    | {f"final:{r}" for r in ("assistant", "tool", "system", "other")}
    | {"content:string", "content:null", "content:parts", "content:other", "content:multi_text",
       "tool:parts"}
    | set(_PART_KINDS.values()) | {"part:string", "part:other"}
    | set(_MESSAGE_KEYS.values())
    | {"tool_calls", "tool_calls:empty", "tool_calls:args_string", "tool_calls:args_object",
       "tool_calls:args_invalid", "tool_calls:non_assistant"}
    | {"tools", "tools:strict", "tools:defer_loading", "tools:non_function", "functions"}
    | {"tool_choice", "response_format", "documents", "chat_template", "add_special_tokens",
       "mm_kwargs", "echo", "add_generation_prompt:true", "add_generation_prompt:false",
       "continue_final_message", "reasoning_effort", "reasoning_effort:none", "reasoning"}
    | {f"kwarg:{k}" for k in (*_KWARGS, "special_token", "other")}
    | {"number:float", "number:big_int"}
    | {"prompt:text", "prompt:ids", "prompt:batch", "suffix", "generate:text",
       "generate:input_ids", "generate:media", "generate:batch"}
    | {f"unknown:{w}" for w in ("body", "message", "part", "tool", "tool_function",
                                "tool_call", "tool_call_function")}
)  # fmt: skip


__all__ = ["EXACT_INT", "FEATURES", "INERT_KEYS", "Feature", "describe", "request_features"]
