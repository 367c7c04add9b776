"""Long prompts under concurrency: what each target adds to the first response byte.

Owns the `concurrent` phase of `bench/run.py` (in `make bench` and `make bench-peers`): chat
prompts of ~100 K and ~1 M Qwen-3 tokens of varied text (`payloads.varied_text`), sent by
`CONCURRENCY` clients at a time, each on its own keep-alive connection, a fixed number of
requests per level (bounded in count, and every request in time). kvproxy runs with its
full policy and a pool just above the prompt (`POOLS`), so every prompt must be counted
exactly before it is sent on; the same client, with the same bodies, measures `direct` (the
upstream alone) and LiteLLM (peers) in the same run. Per target, size and concurrency:
time to the first response byte (p50/p99; "added" = minus direct's at the same size and
concurrency), the target's CPU per prompt, its peak RSS (VmHWM since its start: each size
starts a fresh target), and the answers' statuses (kvproxy's `X-Kvproxy-Prompt-Tokens-Kind`
too: `exact` proves the count ran). `plot` draws bench/long_prompts.png.

Must never: print or keep prompt text, or leave a connection or a target behind.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import procstat
from payloads import API_KEY, varied_chat_body
from targets import Running

# ~0.223 Qwen-3 tokens per byte of varied text (payloads.varied_text): bytes for ~100 K and
# ~1 M tokens.
SIZES = {"100k": 440 * 1024, "1M": 4400 * 1024}
# The simulated prefill pool per size: above the prompt's exact count (~100.5 K, ~1.005 M
# tokens with the template), far below its byte bound, so kvproxy must count it exactly.
POOLS = {"100k": 110_000, "1M": 1_100_000}
CONCURRENCY = (1, 16, 64)
# Requests per concurrency level (full run); bounded so the phase stays a few minutes even
# for LiteLLM, whose count runs on its event loop (~0.3 s per 1 M-token prompt here).
REQUESTS = {
    "100k": {1: 12, 16: 64, 64: 128},
    "1M": {1: 5, 16: 32, 64: 64},
}
REQUEST_TIMEOUT_S = 120.0


async def _one(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, body: bytes
) -> tuple[float, int, dict[str, str]]:
    """Send one request; (seconds to the first response byte, status, headers)."""
    t0 = time.perf_counter()
    writer.write(head)
    writer.write(body)
    first = await reader.read(1)
    ttfb = time.perf_counter() - t0
    if not first:
        raise ConnectionError("the target closed the connection without answering")
    await writer.drain()
    rest = await reader.readuntil(b"\r\n\r\n")
    lines = (first + rest).decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        k, sep, v = line.partition(":")
        if sep:
            headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    else:
        await reader.readexactly(int(headers.get("content-length", "0")))
    return ttfb, status, headers


async def _client(
    url: str, body: bytes, requests: int, concurrency: int
) -> tuple[list[float], list[int], list[str]]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"X-Tenant-ID: acme\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    left = [requests]
    ttfbs: list[float] = []
    statuses: list[int] = []
    kinds: list[str] = []

    async def worker() -> None:
        reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 20)
        try:
            while left[0] > 0:
                left[0] -= 1
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    ttfb, status, headers = await _one(reader, writer, head, body)
                ttfbs.append(ttfb)
                statuses.append(status)
                kinds.append(headers.get("x-kvproxy-prompt-tokens-kind", "-"))
                if headers.get("connection", "").lower() == "close":
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, int(port))
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttfbs, statuses, kinds


def _q(values: list[float], q: float) -> float:
    """Nearest-rank quantile (ms): no interpolation between two requests' times."""
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 2)


def measure(run: Running, size: str, scale: float = 1.0) -> dict[str, Any]:
    """Every concurrency level against one running target, for one prompt size."""
    body = varied_chat_body(SIZES[size], seed=11)
    out: dict[str, Any] = {"bytes": len(body)}
    # Warm-up: the first big read grows buffers; the tokenizer's caches see other text.
    asyncio.run(_client(run.url, varied_chat_body(SIZES[size], seed=12), 2, 1))
    for c in CONCURRENCY:
        n = max(c, round(REQUESTS[size][c] * scale))
        c0 = procstat.tree_cpu_s(run.pids)
        t0 = time.perf_counter()
        ttfbs, statuses, kinds = asyncio.run(_client(run.url, body, n, c))
        wall = time.perf_counter() - t0
        cpu_s = procstat.tree_cpu_s(run.pids) - c0
        out[str(c)] = {
            "requests": n,
            "ttfb_ms_p50": _q(ttfbs, 0.5),
            "ttfb_ms_p99": _q(ttfbs, 0.99),
            "cpu_ms_per_prompt": round(cpu_s / n * 1e3, 2),
            "prompts_per_s": round(n / wall, 2),
            "statuses": sorted(set(statuses)),
            "kinds": sorted(set(kinds)),
        }
    out["peak_rss_mib"] = round(procstat.memory(run.pids[0]).hwm_mib, 1)
    return out


def added(results: dict[str, Any]) -> None:
    """Fill `added_ms_p50/p99`: each target's TTFB minus direct's, same size and level."""
    direct = results.get("direct", {})
    for sizes in results.values():
        for size, row in sizes.items():
            for c in CONCURRENCY:
                cell, base = row.get(str(c)), direct.get(size, {}).get(str(c))
                if cell is None or base is None:
                    continue
                for q in ("p50", "p99"):
                    cell[f"added_ms_{q}"] = round(cell[f"ttfb_ms_{q}"] - base[f"ttfb_ms_{q}"], 2)


def plot(results: dict[str, Any], path: Path) -> str | None:
    """bench/long_prompts.png: added p50/p99 against concurrency, per size and target; None
    when drawn, else why not (matplotlib missing: `pip install .[bench]`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no plot"
    fig, axes = plt.subplots(1, len(SIZES), figsize=(11, 4.2), squeeze=False)
    for ax, size in zip(axes[0], SIZES, strict=True):
        for i, (name, sizes) in enumerate(results.items()):
            if name == "direct" or size not in sizes:
                continue
            # One colour per target: p50 solid, p99 dashed.
            for q, dash in (("p50", "-"), ("p99", "--")):
                xs = [c for c in CONCURRENCY if f"added_ms_{q}" in sizes[size].get(str(c), {})]
                ys = [max(0.01, sizes[size][str(c)][f"added_ms_{q}"]) for c in xs]
                if xs:
                    ax.plot(xs, ys, dash, color=f"C{i}", marker="o", label=f"{name} {q}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(list(CONCURRENCY), [str(c) for c in CONCURRENCY])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("added ms to first response byte")
        ax.set_title(f"~{size}-token chat prompts (one core)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
