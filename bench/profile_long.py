"""Where one long chat prompt's CPU goes, step by step, against fastokens alone (same run).

Run: `.venv/bin/python bench/profile_long.py [--kib 400] [--repeat 7] [--cpu 0]`.
Pinned to one core (so wall time is CPU time), it builds the full-policy counter the server
builds (`hf:` Qwen-3 with its chat template: fastokens when it passed the start-up check)
and, for a ~100k-token chat of varied text (`payloads.varied_text`: a large invented
vocabulary with CJK, code and numbers mixed in, a fresh seed per run so no cache sees the
same text twice), times each step the proxy takes when the limit sits right at the exact
count (so the count must be whole):

  parse      parse_request (orjson + the message walk)
  walk       the guaranteed bound's walk over every field (`TokenCounter._guaranteed_bound`)
  guarantee  what the counter does of it near the limit (`TokenCounter._verdict`)
  frame      the plan from the proven frame (tokens.replica.frames), no jinja
  render     the plain jinja render that an exact decision rests on (`_rendered_plainly`)
  count      the exact count of that render (`_exact_local`)
  decide     the whole `parse_request` + `TokenCounter.count`, as the handler calls it

and `fastokens` = fastokens encoding the message text alone, in one call: the floor. The
ratio decide / fastokens is issue #36's target (<= 1.3x). Median over runs; the spread
(max / min of `decide`) says how noisy the machine was. Never prints prompt text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from payloads import varied_text  # noqa: E402
from tokenizer_files import real_tokenizer_dir  # noqa: E402

from kvproxy.config import Settings  # noqa: E402
from kvproxy.prompt import parse_request  # noqa: E402
from kvproxy.tokens import build_counter  # noqa: E402


def _cpu() -> float:
    return time.process_time()


async def run(kib: int, repeat: int, model: str) -> dict[str, object]:
    path = real_tokenizer_dir(model)
    counter = build_counter(Settings(tokenizer=f"hf:{path}", count_timeout_s=120))
    local = counter._local
    assert local is not None
    fast = local.tokenizer
    steps: dict[str, list[float]] = {
        k: []
        for k in ("parse", "walk", "guarantee", "frame", "render", "count", "decide", "fastokens")
    }
    tokens = 0
    try:
        for i in range(repeat + 1):  # the first run warms up and is dropped
            text = varied_text(kib * 1024, seed=100 + i)
            body = orjson.dumps(
                {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
            )
            got: dict[str, float] = {}
            t = _cpu()
            n_fast = len(fast.encode(text, add_special_tokens=False))
            got["fastokens"] = _cpu() - t
            t = _cpu()
            shape = parse_request("chat", body)
            got["parse"] = _cpu() - t
            t = _cpu()
            walked = counter._guaranteed_bound(shape, 0)
            got["walk"] = _cpu() - t
            t = _cpu()
            judged = counter._verdict(shape, 0)
            got["guarantee"] = _cpu() - t
            t = _cpu()
            plans = counter._plan(shape)
            got["frame"] = _cpu() - t
            t = _cpu()
            plans = counter._rendered_plainly(plans)
            got["render"] = _cpu() - t
            counter.early_stop = False  # the whole count: what the limit is set to
            t = _cpu()
            counted = counter._exact_local(plans, 0)
            got["count"] = _cpu() - t
            counter.early_stop = True
            limit = counted[0].tokens
            t = _cpu()
            shape = parse_request("chat", body)
            decided = await counter.count(shape, limit)
            got["decide"] = _cpu() - t
            assert decided.tokens == limit, (decided, limit)
            assert judged.bound is None or judged.bound >= limit
            assert walked is not None
            assert walked >= limit
            tokens = limit
            if i:
                for k, v in got.items():
                    steps[k].append(v)
            await asyncio.sleep(0.01)
    finally:
        await counter.aclose()
    med = {k: statistics.median(v) * 1e3 for k, v in steps.items()}
    return {
        "kib": kib,
        "tokens": tokens,
        "text_tokens_fastokens": n_fast,
        "backend": counter.backend,
        "runs": repeat,
        "ms": {k: round(v, 2) for k, v in med.items()},
        "decide_over_fastokens": round(med["decide"] / med["fastokens"], 2),
        "decide_spread": round(max(steps["decide"]) / min(steps["decide"]), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kib", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--model", default="qwen-3")
    ap.add_argument("--cpu", type=int, default=0, help="pin to this core (-1: no pinning)")
    args = ap.parse_args()
    if args.cpu >= 0:
        os.sched_setaffinity(0, {args.cpu})
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    row = asyncio.run(run(args.kib, args.repeat, args.model))
    ms = row["ms"]
    assert isinstance(ms, dict)
    print(
        f"{row['kib']} KiB chat, {row['tokens']:,} tokens exact [{row['backend']}], "
        f"{row['runs']} runs, CPU ms (median):"
    )
    for k, v in ms.items():
        print(f"  {k:>10} {v:8.2f}")
    print(
        f"decide / fastokens alone = {row['decide_over_fastokens']}x "
        f"(decide max/min over runs {row['decide_spread']})"
    )
    print("profile_long_json " + json.dumps(row))


if __name__ == "__main__":
    main()
