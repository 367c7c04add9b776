"""Request and response bodies every target sees: the same bytes for all of them.

Owns: the small chat request, the fixed chat-completion reply, the SSE chunk stream, and
the long synthetic prompts (4 KB / 400 KB / 4 MB). Must never: carry anything that looks
like a canary marker (the benchmark measures the scan, not a block) or real user text.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import os
import random
import re
from pathlib import Path

MODEL = "bench"
# Every request carries this bearer token: LiteLLM refuses to start without a master key,
# and the other targets forward or ignore it, so all of them see the same header set.
API_KEY = "sk-bench-5f0c1d2e3a4b5c6d7e8f9a0b1c2d3e4f"
KIB = 1024
MIB = 1024 * KIB

CHAT_RESPONSE: bytes = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello! How can I help you today?"},
                "finish_reason": "stop",
            }
        ],
        # Small on purpose: kvproxy compares usage with its own count (drift metric), and an
        # upstream that claims more prompt tokens than the bound would look like a tokenizer
        # mismatch.
        "usage": {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18},
    },
    separators=(",", ":"),
).encode()


def small_chat_body(*, stream: bool = False, max_tokens: int = 16) -> bytes:
    """The "small chat POST": one short user message, like an interactive client sends."""
    return json.dumps(
        {
            "model": MODEL,
            "max_tokens": max_tokens,
            "stream": stream,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Hello there, what is the capital of France?"},
            ],
        },
        separators=(",", ":"),
    ).encode()


def sse_event(i: int, *, last: bool = False) -> bytes:
    """One `chat.completion.chunk` event (~180 bytes, like a real engine's token delta)."""
    chunk: dict[str, object] = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "delta": {} if last else {"content": f"tok{i} "},
                "finish_reason": "stop" if last else None,
            }
        ],
    }
    if last:
        chunk["usage"] = {"prompt_tokens": 9, "completion_tokens": i, "total_tokens": 9 + i}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def sse_stream(chunks: int) -> list[bytes]:
    """`chunks` events: token deltas, a final event with usage, then `[DONE]`."""
    events = [sse_event(i) for i in range(max(0, chunks - 2))]
    events.append(sse_event(max(0, chunks - 2), last=True))
    events.append(b"data: [DONE]\n\n")
    return events


_WORD_TEXT = (
    "the of and to in is was for that with as on by at from his her an were which are this "
    "be or had not but have it they their one all been has more also when who would there "
    "kernel memory cache page transfer request engine token prefill decode pool tenant "
    "network latency budget measure report system model context window server process "
    "research history science language music river mountain garden library evening morning"
)
_WORDS = tuple(_WORD_TEXT.split())


def prompt_text(n_bytes: int, *, seed: int = 7) -> str:
    """English-like ASCII prose of exactly `n_bytes` bytes, deterministic per seed.

    Paragraphs end in "\\n" followed by a letter, the split point exact chunked counting
    uses, so a long prompt exercises the product's fast exact path as real prose would."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        n = rng.randint(8, 24)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(n))
        sentence = sentence[0].upper() + sentence[1:] + ". "
        if rng.random() < 0.15:
            sentence += "\n"
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:n_bytes]


@functools.cache
def _real_words() -> tuple[list[str], list[float]]:
    """Every distinct word of this Python's top-level stdlib sources (~13 K: English from the
    docstrings and comments, identifiers from the code), most frequent first, with Zipf
    weights (1/rank, cumulated for `random.choices`) so that common words recur as they do
    in real text."""
    counts: collections.Counter[str] = collections.Counter()
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        text = path.read_text("utf-8", "replace")
        counts.update(w.lower() for w in re.findall(r"[A-Za-z]{2,14}", text))
    words = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    return words, list(itertools.accumulate(1 / (i + 1) for i in range(len(words))))


_EXTRAS = ("中文文本", "日本語の", "한국어", "def f(x):", "return x + 1", "3.14159", "naïve",
           "café", "👩‍💻", "✨", '{"k": [1, 2]}', "x_1 = y**2", "¿qué?")  # fmt: skip


def varied_text(n_bytes: int, seed: int = 1) -> str:
    """~`n_bytes` of prose over ~13 K distinct real words drawn by their Zipf rank, with
    numbers, CJK, code and emoji mixed in: ~0.22 Qwen-3 tokens per byte (400 KiB ~ 91 K
    tokens), like English, and diverse enough that a per-word cache (fastokens keeps one)
    cannot turn the count into lookups, as one repeated sentence would."""
    rng = random.Random(seed)
    words, cum_weights = _real_words()
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        line_words = rng.choices(words, cum_weights=cum_weights, k=rng.randint(6, 24))
        for i in range(len(line_words)):
            if rng.random() < 0.03:
                extra = rng.choice(_EXTRAS) if rng.random() < 0.5 else str(rng.randint(0, 99999))
                line_words[i] = extra
        line = " ".join(line_words).capitalize() + rng.choice([". ", ".\n", "? ", "! ", ";\n"])
        parts.append(line)
        size += len(line.encode())
    return "".join(parts)


def varied_chat_body(n_bytes: int, *, max_tokens: int = 16, seed: int = 1) -> bytes:
    """A chat request whose one user message is ~`n_bytes` of `varied_text`."""
    return json.dumps(
        {
            "model": MODEL,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": varied_text(n_bytes, seed=seed)}],
        },
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()


def long_chat_body(n_bytes: int, *, max_tokens: int = 16, seed: int = 7) -> bytes:
    """A chat request whose prompt text is `n_bytes` long."""
    return json.dumps(
        {
            "model": MODEL,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt_text(n_bytes, seed=seed)}],
        },
        separators=(",", ":"),
    ).encode()
