"""What a small request costs in-process, single-upstream form (and gateway form, when the tree
has it): to compare a tree before and after a change, run it with each tree's venv in turn.

Run: `python bench/gateway_cost.py [--requests 3000] [--rounds 3] [--gateway]`. One process:
a fake router (a fixed completion), kvproxy with a static pool, and a keep-alive client
sending small /v1/completions one at a time. Prints the process CPU microseconds per
request (client, proxy and router together: the same overhead on both sides of a
comparison) for each round, and the median. A benchmark, not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import aiohttp
import orjson
import uvloop
from aiohttp import web

from kvproxy.config import load_settings
from kvproxy.observe import Metrics
from kvproxy.serve.app import KvproxyServer

REPLY = orjson.dumps(
    {
        "id": "x",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    }
)
BODY = orjson.dumps({"model": "m", "prompt": "hello there, small prompt", "max_tokens": 1})


async def router() -> tuple[web.AppRunner, str]:
    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=REPLY, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def static(capacity: int = 100_000) -> list[dict[str, Any]]:
    return [{"url": "static://pool", "kind": "static", "capacity_tokens": capacity}]


async def one_round(settings_kw: dict[str, Any], n: int) -> float:
    settings = load_settings(
        listen="127.0.0.1:0", admin_listen="127.0.0.1:0", access_log=False, **settings_kw
    )
    server = KvproxyServer(settings, Metrics())
    await server.start()
    try:
        for c in getattr(server.services.models.first, "clusters", (server.services.models.first,)):
            await c.capacity.refresh_now()
        async with aiohttp.ClientSession() as http:
            url = server.public_url + "/v1/completions"
            for _ in range(200):  # warm-up: connections, caches, first-call paths
                async with http.post(url, data=BODY) as resp:
                    await resp.read()
            t0 = time.process_time()
            for _ in range(n):
                async with http.post(url, data=BODY) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status
            return (time.process_time() - t0) / n * 1e6
    finally:
        await server.stop()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gateway", action="store_true")
    args = ap.parse_args()
    runner, url = await router()
    try:
        forms: dict[str, dict[str, Any]] = {
            "single": {"upstream": url, "engines": static(), "tokenizer": "bytes"}
        }
        if args.gateway:
            forms["gateway-2"] = {
                "tokenizer": "bytes",
                "upstreams": [
                    {"name": "a", "url": url, "engines": static()},
                    {"name": "b", "url": url, "engines": static(50_000)},
                ],
            }
        for name, kw in forms.items():
            runs = [await one_round(kw, args.requests) for _ in range(args.rounds)]
            print(
                f"{name:10} cpu_us_per_request rounds="
                + " ".join(f"{r:.1f}" for r in runs)
                + f" median={statistics.median(runs):.1f}"
            )
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    uvloop.run(main())
