"""Request and response bodies every target sees: the same bytes for all of them.

Owns: the small chat request, the fixed chat-completion reply, the SSE chunk stream, and
the long synthetic prompts (4 KB / 400 KB / 4 MB). Must never: carry anything that looks
like a canary marker (the benchmark measures the scan, not a block) or real user text.
"""

from __future__ import annotations

import json
import random

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
