"""Named request bodies, one or more per under-count class of issue #30 (1-10) and their
siblings: each is a body an engine accepts where a count that models the engine wrongly
comes out short. The corpus test runs every case through every oracle it applies to, on
every family's model, and asks kvproxy to decide at the oracle's count and one under it.

`W` is ~200 tokens of plain words: large enough that a dropped field shows, small enough
to render fast. Bodies name the capture worker's model id, which smg routes by.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from oracles.capture import MODEL

W = "word " * 200
BIG_INT = 123456789012345678901234567890  # > 2**64: orjson and serde print it as a float
ENGINES = ("sglang", "vllm", "smg+sglang")
SGLANG_FAMILY = ("sglang", "smg+sglang")


@dataclass(frozen=True)
class Case:
    name: str
    klass: str  # the class, "1".."10", or "sibling"
    route: str
    body: dict[str, Any] | bytes
    engines: tuple[str, ...] = ENGINES
    models: tuple[str, ...] | None = None  # None: one model of every family
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def bytes(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode()


def chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": list(messages), **fields}


def user(content: Any = "hi", **kw: Any) -> dict[str, Any]:
    return {"role": "user", "content": content, **kw}


def call(cid: str, args: str, name: str = "get") -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def tool(name: str = "get", params: Any = None, **kw: Any) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name, "description": "d"}
    if params is not None:
        fn["parameters"] = params
    fn.update(kw.pop("function_extra", {}))
    return {"type": "function", "function": fn, **kw}


NUMBERS_SCHEMA = {
    "type": "object",
    "properties": {
        "n": {
            "type": "integer",
            "maximum": BIG_INT,
            "minimum": -BIG_INT,
            "multipleOf": 1e15,
            "default": -0.0,
            "examples": [1e2, 1.5e-7, 18446744073709551616, 1e16, 0.1] * 20,
        }
    },
}
NUMBERS_ARGS = (
    '{"n": 123456789012345678901234567890, "m": -9223372036854775809, "x": 1E+2, '
    '"y": 1e15, "z": -0.0, "w": 1.000000000000000000001, "list": ['
    + ", ".join(["1e16"] * 60)
    + "]}"
)

CASES: list[Case] = [
    # --- 1: role spelling and roles a template skips that an engine maps -------------------
    Case("role-System", "1", "chat", chat({"role": "System", "content": W}, user())),
    Case("role-SYSTEM", "1", "chat", chat({"role": "SYSTEM", "content": W}, user())),
    Case(
        "role-Assistant",
        "1",
        "chat",
        chat(user(), {"role": "Assistant", "content": W}, user()),
    ),
    Case(
        "role-Tool",
        "1",
        "chat",
        chat(
            user(),
            {"role": "assistant", "content": "", "tool_calls": [call("c1", "{}")]},
            {"role": "Tool", "content": W, "tool_call_id": "c1"},
            user(),
        ),
    ),
    Case("role-USER", "1", "chat", chat({"role": "USER", "content": W})),
    Case("role-developer", "1", "chat", chat({"role": "developer", "content": W}, user())),
    Case(
        "role-developer-after-system",
        "1",
        "chat",
        chat(
            {"role": "system", "content": "s"}, user(), {"role": "developer", "content": W}, user()
        ),
    ),
    Case("role-Developer", "1", "chat", chat({"role": "Developer", "content": W}, user())),
    Case(
        "role-latest_reminder",
        "1",
        "chat",
        chat(user(), {"role": "latest_reminder", "content": W}),
        engines=SGLANG_FAMILY,
    ),
    Case(
        "role-function", "1", "chat", chat(user(), {"role": "function", "name": "f", "content": W})
    ),
    Case("role-narrator", "1", "chat", chat({"role": "narrator", "content": W}, user())),
    # --- 2: a final assistant message -------------------------------------------------------
    Case(
        "final-assistant-think",
        "2",
        "chat",
        chat(user(), {"role": "assistant", "content": f"<think>{W}</think>answer"}),
    ),
    Case(
        "final-assistant-think-continue",
        "2",
        "chat",
        chat(
            user(),
            {"role": "assistant", "content": f"<think>{W}</think>answer"},
            continue_final_message=True,
            add_generation_prompt=False,
        ),
    ),
    Case(
        "final-assistant-plain-continue",
        "2",
        "chat",
        chat(
            user(),
            {"role": "assistant", "content": W},
            continue_final_message=True,
            add_generation_prompt=False,
        ),
    ),
    Case(
        "final-assistant-reasoning",
        "2",
        "chat",
        chat(user(), {"role": "assistant", "content": "a", "reasoning_content": W}),
    ),
    Case(
        "final-assistant-tool-calls",
        "2",
        "chat",
        chat(
            user(W),
            {"role": "assistant", "content": None, "tool_calls": [call("c1", '{"q": "x"}')]},
        ),
    ),
    # --- 3: add_generation_prompt in the body -----------------------------------------------
    Case("add-generation-prompt-false", "3", "chat", chat(user(W), add_generation_prompt=False)),
    Case(
        "add-generation-prompt-false-assistant-last",
        "3",
        "chat",
        chat(user(), {"role": "assistant", "content": W}, add_generation_prompt=False),
    ),
    # --- 4: reasoning fields ----------------------------------------------------------------
    Case("reasoning-effort-none", "4", "chat", chat(user(W), reasoning_effort="none")),
    Case("reasoning-effort-high", "4", "chat", chat(user(W), reasoning_effort="high")),
    Case("reasoning-object-effort", "4", "chat", chat(user(W), reasoning={"effort": "none"})),
    Case("reasoning-object-enabled", "4", "chat", chat(user(W), reasoning={"enabled": True})),
    Case(
        "reasoning-effort-in-kwargs",
        "4",
        "chat",
        chat(user(W), chat_template_kwargs={"reasoning_effort": "none"}),
    ),
    Case(
        "assistant-reasoning-alias",
        "4",
        "chat",
        chat(user(), {"role": "assistant", "content": "a", "reasoning": W}, user()),
    ),
    # --- 5: numbers -------------------------------------------------------------------------
    Case("numbers-tool-schema", "5", "chat", chat(user(), tools=[tool(params=NUMBERS_SCHEMA)])),
    Case(
        "numbers-tool-arguments",
        "5",
        "chat",
        chat(
            user(),
            {"role": "assistant", "content": "", "tool_calls": [call("c1", NUMBERS_ARGS)]},
            {"role": "tool", "content": "ok", "tool_call_id": "c1"},
            user(),
            tools=[tool(params={"type": "object"})],
        ),
    ),
    Case(
        "numbers-template-kwargs",
        "5",
        "chat",
        chat(user(), chat_template_kwargs={"custom": [1e16, -0.0, BIG_INT] * 30}),
    ),
    # --- 6: the whole tool object -----------------------------------------------------------
    Case(
        "tool-strict-defer",
        "6",
        "chat",
        chat(
            user(),
            tools=[
                tool(
                    f"t{i}", {"type": "object"}, defer_loading=True, function_extra={"strict": True}
                )
                for i in range(20)
            ],
        ),
    ),
    Case(
        "tool-key-order",
        "6",
        "chat",
        chat(
            user(),
            tools=[
                {
                    "type": "function",
                    "function": {
                        "parameters": {"type": "object"},
                        "strict": False,
                        "name": f"t{i}",
                    },
                }
                for i in range(20)
            ],
        ),
    ),
    Case(
        "tool-unknown-function-keys",
        "6",
        "chat",
        chat(
            user(), tools=[tool(function_extra={"response": {"type": "string", "description": W}})]
        ),
    ),
    # --- 7: tool_calls: [] --------------------------------------------------------------------
    Case(
        "tool-calls-empty",
        "7",
        "chat",
        chat(user(), {"role": "assistant", "content": W, "tool_calls": []}, user()),
    ),
    Case(
        "tool-calls-empty-last",
        "7",
        "chat",
        chat(user(), {"role": "assistant", "content": W, "tool_calls": []}),
    ),
    # --- 8: /v1/responses ---------------------------------------------------------------------
    Case(
        "responses-input-text-parts",
        "8",
        "responses",
        {
            "model": MODEL,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": W}]}],
        },
        engines=("sglang", "sglang-0.5.9"),
    ),
    Case(
        "responses-escapes-repr",
        "8",
        "responses",
        {
            "model": MODEL,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a\n\t'\"\\" * 60}]}
            ],
        },
        engines=("sglang", "sglang-0.5.9"),
    ),
    Case(
        "responses-instructions",
        "8",
        "responses",
        {"model": MODEL, "instructions": W, "input": "hi"},
        engines=("sglang", "sglang-0.5.9"),
    ),
    # --- 9: a tool message's text parts -------------------------------------------------------
    Case(
        "tool-text-parts",
        "9",
        "chat",
        chat(
            user(),
            {"role": "assistant", "content": "", "tool_calls": [call("c1", "{}")]},
            {
                "role": "tool",
                "tool_call_id": "c1",
                "content": [{"type": "text", "text": "x"} for _ in range(100)],
            },
        ),
    ),
    Case(
        "tool-text-parts-marker",
        "9",
        "chat",
        chat(
            user(),
            {"role": "assistant", "content": "", "tool_calls": [call("c1", "{}")]},
            {
                "role": "tool",
                "tool_call_id": "c1",
                "content": [{"type": "text", "text": t} for t in ["<tool_resp", "onse>"] * 40],
            },
        ),
    ),
    Case(
        "user-text-parts-newlines",
        "9",
        "chat",
        chat(user([{"type": "text", "text": "\n"} for _ in range(150)])),
    ),
    # --- 10: prompt-only routes ---------------------------------------------------------------
    Case(
        "score-text-1-2",
        "10",
        "score",
        {"model": MODEL, "text_1": W, "text_2": W},
        engines=("vllm",),
    ),
    Case(
        "score-text-beside-query-items",
        "10",
        "score",
        {"model": MODEL, "query": "q", "items": ["a"], "text_1": W, "text_2": [W, W]},
        engines=("vllm",),
    ),
    Case(
        "score-queries-documents",
        "10",
        "score",
        {"model": MODEL, "queries": W, "documents": ["d", W]},
        engines=("vllm",),
    ),
    Case(
        "score-data-1-2",
        "10",
        "score",
        {"model": MODEL, "data_1": W, "data_2": W},
        engines=("vllm",),
    ),
    Case(
        "rerank-documents",
        "10",
        "rerank",
        {"model": MODEL, "query": W, "documents": [W, "d"]},
        engines=("vllm",),
    ),
    Case(
        "completions-prompt-embeds",
        "10",
        "completions",
        {"model": MODEL, "prompt": "hi", "prompt_embeds": base64.b64encode(b"\0" * 64).decode()},
        engines=("vllm",),
    ),
    Case(
        "chat-prompt-embeds-part",
        "10",
        "chat",
        chat(user([{"type": "prompt_embeds", "data": base64.b64encode(b"\0" * 64).decode()}])),
        engines=("vllm",),
    ),
    Case(
        "generate-input-embeds",
        "10",
        "generate",
        {"model": MODEL, "input_embeds": [[0.0] * 4] * 300},
        engines=("sglang",),
    ),
    # --- siblings -----------------------------------------------------------------------------
    Case(
        "documents",
        "sibling",
        "chat",
        chat(user(), documents=[{"title": "t", "text": W}]),
        engines=("vllm",),
    ),
    Case(
        "tool-choice-none",
        "sibling",
        "chat",
        chat(user(), tools=[tool(params={"type": "object", "description": W})], tool_choice="none"),
    ),
    Case(
        "tool-choice-named",
        "sibling",
        "chat",
        chat(
            user(),
            tools=[tool("a", {"type": "object", "description": W}), tool("b", {"type": "object"})],
            tool_choice={"type": "function", "function": {"name": "a"}},
        ),
    ),
    Case(
        "response-format",
        "sibling",
        "chat",
        chat(
            user(),
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "description": W}},
            },
        ),
    ),
    Case("name-user", "sibling", "chat", chat(user(name=W.replace(" ", "_")[:400]))),
    Case(
        "name-assistant",
        "sibling",
        "chat",
        chat(user(), {"role": "assistant", "content": "a", "name": W.replace(" ", "_")}, user()),
    ),
    Case(
        "tool-call-id",
        "sibling",
        "chat",
        chat(
            user(),
            {"role": "assistant", "content": "", "tool_calls": [call("c" * 400, "{}")]},
            {"role": "tool", "content": "ok", "tool_call_id": "c" * 400},
            user(),
        ),
    ),
    Case(
        "multimodal-image-placeholders",
        "sibling",
        "chat",
        chat(
            user(
                [{"type": "image_url", "image_url": {"url": "data:,x"}} for _ in range(20)]
                + [{"type": "text", "text": "what"}]
            )
        ),
        models=("qwen2-vl-2b-instruct-awq", "glm-4.5v"),
    ),
    Case(
        "chat-input-ids",
        "sibling",
        "chat",
        chat(user(), input_ids=list(range(1000, 1400))),
        engines=SGLANG_FAMILY,
    ),
    Case(
        "chat-kv-transfer-prompt-ids",
        "sibling",
        "chat",
        chat(user(), kv_transfer_params={"prompt_token_ids": list(range(1000, 1400))}),
        engines=("vllm",),
    ),
    Case(
        "chat-add-special-tokens",
        "sibling",
        "chat",
        chat(user(W), add_special_tokens=True),
        engines=("vllm",),
    ),
    Case(
        "kwargs-tools-override",
        "sibling",
        "chat",
        chat(
            user(),
            chat_template_kwargs={"tools": [tool(params={"type": "object", "description": W})]},
        ),
        engines=("vllm",),
    ),
    Case(
        "thinking-part",
        "sibling",
        "chat",
        chat(
            user(),
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": W}, {"type": "text", "text": "a"}],
            },
            user(),
        ),
    ),
    Case("completions-strings", "sibling", "completions", {"model": MODEL, "prompt": ["a", W]}),
    Case(
        "generate-texts",
        "sibling",
        "generate",
        {"model": MODEL, "text": ["a", W]},
        engines=("sglang",),
    ),
    # --- the everyday chat: must stay exact and admissible at exactly the limit ------------
    Case(
        "plain-chat",
        "plain",
        "chat",
        chat(
            {"role": "system", "content": "be brief"},
            user(W),
            {"role": "assistant", "content": "ok"},
            user("more"),
        ),
    ),
]

BY_NAME = {c.name: c for c in CASES}
