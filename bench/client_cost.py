"""What one upstream request costs the relay's client: aiohttp's ClientSession (what the
bare forwarder uses) against kvproxy's own (kvproxy/upstream/pool.py), same process, same
upstream, alternating.

Run: `.venv/bin/python bench/client_cost.py [--requests 3000] [--rounds 3]`. It starts the
benchmark's nginx upstream on CPU 1, pins itself to CPU 0, sends small chat POSTs one after
another on one keep-alive connection with each client and prints CPU microseconds per
request (process time, so the upstream's CPU is not counted). Measured here: about 2x
(129 vs 63 us on a busy machine; ClientSession ~61 us alone on a quiet one).

Must never: talk to anything but the loopback upstream it started.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import uvloop
from multidict import CIMultiDict

sys.path.insert(0, str(Path(__file__).resolve().parent))

import nginx
import procstat
from payloads import small_chat_body
from servers import free_port

from kvproxy.upstream.pool import UpstreamPool

WARMUP = 200


async def us_per_call(one: Callable[[], Awaitable[None]], n: int) -> float:
    """CPU microseconds per awaited call, after a warm-up."""
    for _ in range(WARMUP):
        await one()
    t = time.process_time()
    for _ in range(n):
        await one()
    return (time.process_time() - t) / n * 1e6


async def with_aiohttp(url: str, body: bytes, n: int) -> float:
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as s:

        async def one() -> None:
            headers = {"Content-Type": "application/json"}
            async with s.request("POST", url + "/v1/chat/completions", data=body,
                                 headers=headers) as r:  # fmt: skip
                await r.read()

        return await us_per_call(one, n)


async def with_kvproxy(url: str, body: bytes, n: int) -> float:
    pool = UpstreamPool(limit=64, keepalive_s=15, connect_timeout_s=5, read_timeout_s=30)

    async def one() -> None:
        headers = CIMultiDict({"Content-Type": "application/json"})
        resp = await pool.start(url, "POST", "/v1/chat/completions", headers, body)
        while await resp.readany():
            pass
        resp.release()

    try:
        return await us_per_call(one, n)
    finally:
        await pool.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    procstat.pin_self(0)
    body = small_chat_body()
    with tempfile.TemporaryDirectory(prefix="kvbench-client-") as tmp:
        port = free_port()
        up = nginx.start_upstream(Path(tmp) / "upstream", port, cpu=1)
        try:
            url = f"http://127.0.0.1:{port}"
            for rnd in range(args.rounds):
                a = uvloop.run(with_aiohttp(url, body, args.requests))
                k = uvloop.run(with_kvproxy(url, body, args.requests))
                print(f"round {rnd + 1}: aiohttp ClientSession {a:.1f} us/request, "
                      f"kvproxy.upstream.pool {k:.1f} us/request ({a / k:.1f}x)")  # fmt: skip
        finally:
            up.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
