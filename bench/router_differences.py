"""Measure, on loopback against the simulator, what the real router does in the three cases
kvproxy's design depends on: a client leaving during prefill, a 400 from prefill, and other
prefill errors (retries). Run for smg 1.13.0 and for sglang-router 0.3.2; docs/engines.md quotes
the output.

    PYTHONPATH=. .venv/bin/python bench/router_differences.py smg
    PYTHONPATH=. .venv/bin/python bench/router_differences.py legacy

Prints counts only (never prompt text).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from real_router import legacy_router, real_router, smg_router

from kvproxy.sim import SimCluster, SimOptions

LEAVERS = 4
POLL_S = 0.005


async def stats(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/sim/stats") as r:
        data: dict[str, Any] = await r.json()
        return data


async def quiet(http: aiohttp.ClientSession, sim: SimCluster) -> dict[str, Any]:
    for _ in range(3000):  # bounded: 30 s
        s = await stats(http, sim.router_url)
        if (
            s["prefill"]["running"] == 0
            and s["decode"]["running"] == 0
            and s["prefill"]["background_tasks"] == 0
            and s["decode"]["writes_in_flight"] == 0
        ):
            return s
        await asyncio.sleep(0.01)
    raise SystemExit("the sim never went idle")


async def leave_during_prefill(http: aiohttp.ClientSession, url: str, sim: SimCluster) -> None:
    prompt = ("tenant a secret. " * 130)[:2000]
    body = {
        "model": "kvproxy-sim",
        "stream": True,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": prompt}],
    }
    for _ in range(LEAVERS):
        before = (await stats(http, sim.decode_url))["pages_allocated"]

        async def go() -> None:
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                await resp.read()

        task = asyncio.ensure_future(go())
        for _ in range(4000):  # bounded: 20 s
            if (await stats(http, sim.decode_url))["pages_allocated"] > before or task.done():
                break
            await asyncio.sleep(POLL_S)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            await task
        await quiet(http, sim)


def router_for(kind: str) -> Any:
    return real_router if kind == "smg" else legacy_router


async def disconnect(kind: str, log: Path) -> None:
    opts = SimOptions(port=0, mode="vulnerable", prefill_us_per_token=500.0)
    async with SimCluster(opts) as sim, router_for(kind)(sim, log) as router:
        async with aiohttp.ClientSession() as http:
            await leave_during_prefill(http, router.url, sim)
            s = await quiet(http, sim)
    p, d = s["prefill"], s["decode"]
    print(
        f"disconnect during prefill x{LEAVERS}: prefill aborts={p['aborts']} "
        f"transfers completed={d['transfers_completed']} decode aborts={d['aborts']}"
    )


async def prefill_400(kind: str, log: Path) -> None:
    async with SimCluster(SimOptions(port=0, mode="fixed")) as sim:
        async with router_for(kind)(sim, log) as router, aiohttp.ClientSession() as http:
            body = {"model": "kvproxy-sim", "max_tokens": 8, "prompt": "x" * 6000}
            async with http.post(router.url + "/v1/completions", json=body) as r:
                status, data = r.status, await r.json(content_type=None)
            s = await quiet(http, sim)
    err = data.get("error") if isinstance(data, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    print(
        f"over-pool prompt, prefill answers 400: client gets {status} code={code!r}; "
        f"prefill saw {sum(s['prefill']['requests_by_route'].values())} request(s), "
        f"decode {sum(s['decode']['requests_by_route'].values())}"
    )


@contextlib.asynccontextmanager
async def fake_worker(role: str, status: int, hits: list[int]) -> AsyncIterator[str]:
    """A worker that registers like the simulator and answers every generation `status`."""

    async def info(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": "kvproxy-sim",
                "served_model_name": "kvproxy-sim",
                "tokenizer_path": "kvproxy-sim",
                "is_generation": True,
                "disaggregation_mode": role,
                "context_length": 8192,
                "model_type": "sim-echo",
                "architectures": ["SimEchoForCausalLM"],
            }
        )

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "kvproxy-sim"}]})

    async def gen(_: web.Request) -> web.Response:
        hits.append(1)
        body = {"object": "error", "message": f"fake {status}", "code": status}
        return web.json_response(body, status=status)

    app = web.Application()
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, lambda _: web.Response(status=200))
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        app.router.add_get(path, info)
    app.router.add_get("/v1/models", models)
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        app.router.add_post(path, gen)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def prefill_errors(kind: str, log: Path) -> None:
    if kind != "smg":
        print("prefill 429/500/503: see ENGINES.md for 0.3.2 (measured earlier)")
        return
    for status in (413, 422, 429, 500, 503):
        p_hits: list[int] = []
        d_hits: list[int] = []
        async with (
            fake_worker("prefill", status, p_hits) as p,
            fake_worker("decode", 200, d_hits) as d,
            smg_router(p, d, log) as router,
            aiohttp.ClientSession() as http,
        ):
            body = {"model": "kvproxy-sim", "max_tokens": 8, "prompt": "hello"}
            async with http.post(router.url + "/v1/completions", json=body) as r:
                got, data = r.status, await r.json(content_type=None)
        err = data.get("error") if isinstance(data, dict) else None
        code = err.get("code") if isinstance(err, dict) else None
        print(
            f"prefill answers {status}: client gets {got} code={code!r}; "
            f"prefill sends={len(p_hits)} decode sends={len(d_hits)}"
        )


async def main(kind: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "router.log"
        print(f"== {kind}")
        await disconnect(kind, log)
        await prefill_400(kind, log)
        await prefill_errors(kind, log)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "smg"))
