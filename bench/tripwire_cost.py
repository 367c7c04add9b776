"""In-process cost per chunk of the relay's per-chunk guards on event streams: SSE framing,
reading each event, the canary tripwire and first-output detection. A benchmark, not a
test: it asserts nothing and its numbers depend on the machine.

Run: `python bench/tripwire_cost.py [--repeat 7] [--streams 200]`. To compare with an
older kvproxy, run it again with that tree first on PYTHONPATH, e.g.

    git archive <commit> kvproxy | tar -x -C /tmp/old && PYTHONPATH=/tmp/old python ...

It uses `kvproxy.response.guard.StreamGuard` when the tree has it, else the pre-#15 pipeline
(`SSEParser.feed` -> `StreamTexts.feed` -> `CanaryScanner.feed_text`, as the relay's old
`_inspect` ran it). Each workload is a stream of whole events, one per chunk (how engines
write them); the figure is the best of `--repeat` runs of CPU microseconds per chunk
(process time, so other load on the machine inflates it less than wall time).
Never prints response text.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from payloads import sse_event

from kvproxy.config import CanaryTenant
from kvproxy.policy.drain import DrainMachine, UpstreamChunk, UpstreamHeaders
from kvproxy.response.tripwire import CanaryRules, CanaryScanner

TENANTS = ("acme", "globex")  # as bench/targets.py configures the full-policy kvproxy
NEW = importlib.util.find_spec("kvproxy.response.guard") is not None


def _ev(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chat(delta: dict[str, Any], **extra: Any) -> bytes:
    return _ev({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000,
                "model": "bench", "choices": [{"index": 0, "delta": delta, "logprobs": None,
                "finish_reason": None, **extra}]})  # fmt: skip


def workloads() -> dict[str, list[bytes]]:
    top = [{"token": f"t{j}", "logprob": -1.0, "bytes": [116, 48 + j]} for j in range(5)]
    return {
        "chat (bench payload)": [sse_event(i) for i in range(64)],
        "reasoning (vLLM delta.reasoning)": [_chat({"reasoning": f"step {i} "}) for i in range(64)],
        "chat + logprobs (top 5)": [
            _chat(
                {"content": f"tok{i} "},
                logprobs={
                    "content": [
                        {
                            "token": f"tok{i} ",
                            "logprob": -0.5,
                            "bytes": [116, 111, 107],
                            "top_logprobs": top,
                        }
                    ]
                },
            )
            for i in range(64)
        ],
        "/generate cumulative (256 events)": [
            _ev(
                {
                    "text": "".join(f"w{j} " for j in range(i + 1)),
                    "meta_info": {"id": "r", "completion_tokens": i + 1, "prompt_tokens": 9},
                }
            )
            for i in range(256)
        ],
    }


def _rules() -> CanaryRules:
    return CanaryRules.from_tenants(
        [
            CanaryTenant(
                tenant=t,
                markers=(f"KVCANARY-{t}-0123456789abcdef",),
                patterns=(f"KVCANARY-{t}-[0-9a-f]{{16}}",),
            )
            for t in TENANTS
        ]
    )


def _new_pipeline(scanner: CanaryScanner | None) -> Callable[[bytes], bool]:
    from kvproxy.response.guard import StreamGuard

    guard = StreamGuard(scanner)

    def feed(chunk: bytes) -> bool:
        _, output = guard.feed(chunk)
        return output

    return feed


def _old_pipeline(scanner: CanaryScanner | None) -> Callable[[bytes], bool]:
    from kvproxy.response.sse import SSEParser, StreamTexts  # type: ignore[attr-defined]

    parser, texts = SSEParser(), StreamTexts()
    seen = [False]

    def feed(chunk: bytes) -> bool:  # the old Exchange._inspect, minus the relay
        token = False
        need = scanner is not None or not seen[0]
        for payload in parser.feed(chunk):
            if b'"usage"' in payload:
                orjson.loads(payload)
            if not need:
                continue
            info = texts.feed(payload)
            token = token or info.has_token
            if scanner is not None:
                for index, text in info.texts:
                    scanner.feed_text(index, text)
        seen[0] = seen[0] or token
        return token

    return feed


def per_chunk_us(
    chunks: list[bytes], scanned: bool, streams: int, repeat: int, with_drain: bool = False
) -> float:
    """Best CPU microseconds per chunk; `with_drain` adds the relay's drain-machine event
    per chunk (the old relay sent one for every chunk, the new one stops once a token
    reached a present client)."""
    rules = _rules()
    make = _new_pipeline if NEW else _old_pipeline
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        for _ in range(streams):
            feed = make(rules.scanner("acme") if scanned else None)
            machine = DrainMachine(streaming=True, until="first_token", timeout_s=300)
            machine.handle(UpstreamHeaders(now=0.0))
            steady = False
            for c in chunks:
                output = feed(c)
                if with_drain and not steady:
                    machine.handle(UpstreamChunk(now=1.0, has_token=output))
                    steady = NEW and (output or steady)
        best = min(best, (time.process_time() - t0) / (streams * len(chunks)) * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--streams", type=int, default=200)
    args = ap.parse_args()
    print(f"pipeline: {'StreamGuard (every string)' if NEW else 'pre-#15 (three fields)'}")
    print(
        f"{'CPU us per chunk':36} {'scanned':>9} {'+ drain':>9} {'no canaries':>12} {'+ drain':>9}"
    )
    for name, chunks in workloads().items():
        streams = max(1, args.streams * 64 // len(chunks))
        row = [
            per_chunk_us(chunks, scanned, streams, args.repeat, with_drain)
            for scanned in (True, False)
            for with_drain in (False, True)
        ]
        print(f"{name:36} {row[0]:9.2f} {row[1]:9.2f} {row[2]:12.2f} {row[3]:9.2f}")


if __name__ == "__main__":
    main()
