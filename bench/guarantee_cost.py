"""CPU cost of the count decision for a small chat: the guaranteed bound (tokens.bound.guarantee)
against the render-based plan it replaces on the hot path, in one process, same run.

Run: `python bench/guarantee_cost.py [--model qwen-3] [--limit 32768] [--number 20000]`.

Both rows time `TokenCounter.count` on the bench's small chat (bench/payloads.py) with the
model's `hf:` tokenizer and chat template, a limit the request fits, from one counter:
  guarantee   as served: the O(1) guaranteed bound admits (no render, no walk);
  plan        the same counter with its guarantee removed: the pre-#30 path (the chat's
              proven frame, tokens.replica.frames, bounded by bounds.segments_bound);
plus the walk alone (the per-field guarantee, what a small chat costs when its O(1) bound
does not fit) and parse_request for scale. Prints microseconds per call (best of 5
repeats). A benchmark, not a test: numbers depend on the machine; nothing asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import timeit
from pathlib import Path

from kvproxy.config import Settings
from kvproxy.prompt import parse_request
from kvproxy.tokens import build_counter
from kvproxy.tokens.bound import ChatGuarantee

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from payloads import small_chat_body
from tokenizer_files import real_tokenizer_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen-3")
    ap.add_argument("--limit", type=int, default=32_768)
    ap.add_argument("--number", type=int, default=20_000)
    args = ap.parse_args()
    body = small_chat_body()
    shape = parse_request("chat", body)
    loop = asyncio.new_event_loop()
    counter = build_counter(Settings(tokenizer=f"hf:{real_tokenizer_dir(args.model)}"))
    guarantee = counter._guarantee
    assert isinstance(guarantee, ChatGuarantee)

    def decide() -> None:
        coro = counter.count(shape, args.limit)
        try:
            coro.send(None)  # decided inline: returns at once, never awaits
        except StopIteration:
            return
        raise AssertionError("the small chat awaited")

    def timed(fn: object) -> float:
        best = min(timeit.repeat(fn, number=args.number, repeat=5))  # type: ignore[arg-type]
        return best / args.number * 1e6

    rows = {"parse_request": timed(lambda: parse_request("chat", body))}
    decide()
    rows["count: guarantee (as served)"] = timed(decide)
    rows["guarantee: O(1) form alone"] = timed(lambda: guarantee.quick(body, shape.body, "chat"))
    rows["guarantee: per-field walk alone"] = timed(lambda: guarantee.tokens(shape.body, "chat", 0))
    # The path before #30: the plan (the chat's proven frame + its byte bound).
    counter._guarantee_first = lambda shape: False  # type: ignore[method-assign]
    decide()
    rows["count: plan (before)"] = timed(decide)
    for name, us in rows.items():
        print(f"{name:34s} {us:8.2f} us")
    print(f"body {len(body)} bytes; model {args.model}; limit {args.limit}")
    loop.close()


if __name__ == "__main__":
    main()
