"""Two models behind one kvproxy, with the real smg 1.13.0 in front of two simulator
clusters (kvproxy -> smg -> {model-a pair, model-b pair}).

model-a runs the Qwen-3 tokenizer on a small prefill pool, model-b the GLM-4.7 tokenizer
on a larger one. smg routes each request to the workers that registered its model id; kvproxy
must count it with that model's tokenizer and admit it against that model's measured limit:
limit-1 and limit admitted, limit+1 refused, for each. Judged on the simulators' ground
truth (what reached each engine, the engine's own arithmetic), the prompt sizes built with
each simulator's own tokenizer and template (never kvproxy's code).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from e2e_stack import get_json, leak_counters, running_proxy
from ports import free_port
from real_router import READY_TIMEOUT_S, RealRouter, smg_binary, spawn, stop_process
from tokenizer_files import real_tokenizer_dir

from kvproxy.serve.app import KvproxyServer
from kvproxy.sim.launcher import SimCluster, SimOptions
from kvproxy.sim.tokenizer import ChatRenderer, load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.router]

CHAT = "/v1/chat/completions"
BASE = "Summarise the following for tenant A."


def oracle(model_dir: str) -> Callable[[str], int]:
    """The simulator's own count of a one-message chat."""
    tok = load_tokenizer(model_dir)
    renderer = ChatRenderer(tok.chat_template, tok.special_tokens)  # type: ignore[attr-defined]

    def count(content: str) -> int:
        text = renderer.render([{"role": "user", "content": content}])
        return len(tok.encode(text, add_special_tokens=False))

    return count


def padded(count: Callable[[str], int], target: int) -> str:
    # " a" is one token in both vocabularies (GLM groups digits, so kvtest's "1" padding
    # would not be exact for it).
    content = BASE + " a" * (target - count(BASE))
    assert count(content) == target
    return content


def engines_of(sim: SimCluster, name: str) -> list[dict[str, Any]]:
    return [
        {"url": sim.prefill_url, "role": "prefill", "name": f"{name}-prefill"},
        {"url": sim.decode_url, "role": "decode", "name": f"{name}-decode"},
    ]


@contextlib.asynccontextmanager
async def smg_for(sims: list[SimCluster], log: Path) -> AsyncIterator[RealRouter]:
    """smg in PD mode over every cluster's pair, ready once all of them are listed healthy."""
    port, metrics_port = free_port(), free_port()
    cmd = [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--pd-disaggregation"]
    for sim in sims:
        cmd += ["--prefill", sim.prefill_url, sim.prefill_url.rsplit(":", 1)[1]]
    for sim in sims:
        cmd += ["--decode", sim.decode_url]
    cmd += ["--policy", "round_robin", "--disable-tokenizer-autoload"]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    cmd += ["--log-level", "warn"]
    proc = spawn(cmd, log)
    router = RealRouter(f"http://127.0.0.1:{port}", "", proc, log)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        async with aiohttp.ClientSession() as http:
            for _ in range(int(READY_TIMEOUT_S / 0.1) + 1):
                assert proc.poll() is None, f"smg exited: {router.tail()}"
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                    async with http.get(router.url + "/workers") as r:
                        listed = (await r.json(content_type=None)).get("workers", [])
                        healthy = [w for w in listed if w.get("is_healthy")]
                        if len(healthy) == 2 * len(sims):
                            break
                assert time.monotonic() < deadline, (
                    f"smg never listed every worker: {router.tail()}"
                )
                await asyncio.sleep(0.1)
            for sim in sims:  # registration probed the engines: start from zero
                async with http.post(sim.router_url + "/sim/reset") as resp:
                    assert resp.status == 200
        yield router
    finally:
        stop_process(proc)


async def chat(
    http: aiohttp.ClientSession, proxy: KvproxyServer, model: str, content: str
) -> tuple[int, dict[str, str], dict[str, Any]]:
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
    async with http.post(proxy.public_url + CHAT, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


async def test_two_models_behind_smg_each_at_its_own_limit_with_its_own_tokenizer(
    tmp_path: Path,
) -> None:
    qwen, glm = str(real_tokenizer_dir("qwen-3")), str(real_tokenizer_dir("glm-4.7-flash"))
    free = {"port": 0, "prefill_port": 0, "decode_port": 0}
    a_opts = SimOptions(**free, model_name="model-a", tokenizer=qwen, prefill_pool_tokens=2048)
    b_opts = SimOptions(**free, model_name="model-b", tokenizer=glm, prefill_pool_tokens=5322)
    counts = {"model-a": oracle(qwen), "model-b": oracle(glm)}
    async with (
        SimCluster(a_opts) as a,
        SimCluster(b_opts) as b,
        smg_for([a, b], tmp_path / "smg.log") as router,
        aiohttp.ClientSession() as http,
    ):
        sims = {"model-a": a, "model-b": b}
        models = [
            {"name": "model-a", "engines": engines_of(a, "a"), "tokenizer": f"hf:{qwen}"},
            {"name": "model-b", "engines": engines_of(b, "b"), "tokenizer": f"hf:{glm}"},
        ]
        async with running_proxy(
            router.url,
            refresh=False,
            engines=None,
            models=models,
            capacity_refresh_s=0.5,
            capacity_stale_s=1.5,
            capacity_probe_timeout_s=1.0,
        ) as proxy:
            for m in proxy.services.models.models:
                await m.capacity.refresh_now()
            limits = {
                name: (await get_json(http, sim.router_url + "/sim/stats"))["prefill"]["limits"][
                    "largest_prompt"
                ]
                for name, sim in sims.items()
            }
            replies = {}
            for name in sims:
                for delta in (-1, 0, 1):
                    content = padded(counts[name], limits[name] + delta)
                    replies[name, delta] = await chat(http, proxy, name, content)
            # model-b's largest prompt, sent as model-a: counted with Qwen and refused at A's
            # limit; the same text is fine for B.
            cross = await chat(http, proxy, "model-a", padded(counts["model-b"], limits["model-b"]))
            unknown = await chat(http, proxy, "model-c", "hello")
            truth = {n: await get_json(http, s.router_url + "/sim/stats") for n, s in sims.items()}

            # model-a's engines go away: A fails closed, B keeps serving.
            await a.stop_server("prefill")
            await a.stop_server("decode")
            model_a = proxy.services.models.resolve("model-a")
            assert model_a is not None
            for _ in range(200):  # bounded: the monitor marks A stale after capacity_stale_s
                if not model_a.capacity.ready():
                    break
                await asyncio.sleep(0.05)
            down = await chat(http, proxy, "model-a", "hello")
            up = await chat(http, proxy, "model-b", padded(counts["model-b"], limits["model-b"]))
            async with http.get(proxy.admin_url + "/readyz") as resp:
                ready = resp.status

    assert limits["model-a"] < limits["model-b"]
    for name in sims:
        for delta in (-1, 0):
            status, headers, reply = replies[name, delta]
            assert status == 200, (name, delta, reply)
            assert int(headers["X-Kvproxy-Prompt-Tokens"]) == limits[name] + delta
            assert reply["usage"]["prompt_tokens"] == limits[name] + delta  # the engine agrees
        status, headers, reply = replies[name, 1]
        assert status == 400, (name, reply)
        assert reply["error"]["code"] == "context_length_exceeded"
        assert reply["error"]["prompt_tokens"] == limits[name] + 1
        assert reply["error"]["limit_tokens"] == limits[name]
        # Ground truth: exactly the two admitted prompts reached this model's engines, and
        # none of them was over the engine's own limit.
        prefill = truth[name]["prefill"]
        assert prefill["requests_by_route"] == {CHAT: 2}
        assert prefill["prompt_tokens"] == 2 * limits[name] - 1
        assert prefill["rejections_at_admission"] == 0
        assert leak_counters(truth[name]) == dict.fromkeys(leak_counters(truth[name]), 0)
    assert cross[0] == 400
    assert cross[2]["error"]["limit_tokens"] == limits["model-a"]
    assert unknown[0] == 404
    assert unknown[2]["error"]["code"] == "model_not_found"
    assert down[0] == 503
    assert down[2]["error"]["code"] == "capacity_unknown"
    assert up[0] == 200, up[2]
    assert ready == 200  # readiness: any
