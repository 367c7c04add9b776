"""The real ``sglang-router`` (PyPI, Rust) in PD mode in front of the sim's prefill and
decode: it accepts them as workers, streams through them, and the incident reproduces
through it in vulnerable mode (and is refused with 400 in fixed mode)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from sim_helpers import (
    CHAT,
    canary_text,
    chat,
    marker,
    reply_text,
    running_sim,
    sse_payloads,
    stats,
    wait_until,
)

from kvproxy.sim import SimCluster

pytestmark = [pytest.mark.router, pytest.mark.slow]

ROUTER = Path(sys.executable).parent / "sglang-router"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("w") as sink:
        return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)


def _tail(log: Path) -> str:
    return log.read_text()[-2000:]


@asynccontextmanager
async def real_router(sim: SimCluster, log: Path) -> AsyncIterator[str]:
    if not ROUTER.exists() and shutil.which("sglang-router") is None:
        pytest.skip("sglang-router is not installed")
    binary = str(ROUTER) if ROUTER.exists() else "sglang-router"
    port, metrics_port = _free_port(), _free_port()
    bootstrap = sim.prefill_url.rsplit(":", 1)[1]
    cmd = [
        binary,
        "launch",
        "--pd-disaggregation",
        "--prefill",
        sim.prefill_url,
        bootstrap,
        "--decode",
        sim.decode_url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--prometheus-port",
        str(metrics_port),
        "--prometheus-host",
        "127.0.0.1",
        "--log-level",
        "warn",
    ]
    proc = _spawn(cmd, log)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:

            async def serves() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"router exited: {_tail(log)}")
                try:
                    status, _ = await chat(http, url, "ready?", max_tokens=1)
                except (aiohttp.ClientError, json.JSONDecodeError):
                    return False
                return status == 200

            await wait_until(serves, timeout_s=60.0, interval_s=0.25)
            async with http.post(sim.router_url + "/sim/reset") as resp:
                assert resp.status == 200
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def test_streaming_through_the_real_router(tmp_path: Path) -> None:
    async with (
        running_sim() as sim,
        real_router(sim, tmp_path / "router.log") as url,
        aiohttp.ClientSession() as http,
    ):
        body = {
            "model": "kvproxy-sim",
            "stream": True,
            "max_tokens": 64,
            "messages": [{"role": "user", "content": canary_text("A", 200)}],
        }
        async with http.post(url + CHAT, json=body) as resp:
            status, raw = resp.status, await resp.text()
        truth = await stats(http, sim.router_url)
    payloads = sse_payloads(raw)
    assert status == 200
    assert payloads[-1] == "[DONE]"
    text = "".join(json.loads(p)["choices"][0]["delta"].get("content") or "" for p in payloads[:-1])
    assert text.startswith("<|user|>\ntenant A secret KVCANARY-A")
    # The real router sent the request to both engines with a bootstrap room.
    assert truth["prefill"]["requests_by_route"] == {CHAT: 1}
    assert truth["decode"]["requests_by_route"] == {CHAT: 1}
    assert truth["decode"]["transfers_completed"] == 1


async def test_incident_reproduces_through_the_real_router(tmp_path: Path) -> None:
    async with (
        running_sim(mode="vulnerable") as sim,
        real_router(sim, tmp_path / "router.log") as url,
        aiohttp.ClientSession() as http,
    ):
        status_a, _ = await chat(http, url, canary_text("A", 3000), max_tokens=8)
        status, body = await chat(http, url, canary_text("B", 6000), max_tokens=300)
        truth = await stats(http, sim.router_url)
    assert status_a == 200
    assert status == 200
    assert marker("A") in reply_text(body)
    assert truth["prefill"]["pending_rejections"] == 1
    assert truth["decode"]["stale_page_reads"] > 0


async def test_fixed_engine_refusal_passes_through_the_real_router(tmp_path: Path) -> None:
    async with (
        running_sim(mode="fixed") as sim,
        real_router(sim, tmp_path / "router.log") as url,
        aiohttp.ClientSession() as http,
    ):
        status, body = await chat(http, url, canary_text("B", 6000), max_tokens=300)

        async def decode_idle() -> bool:
            return bool((await stats(http, sim.decode_url))["running"] == 0)

        await wait_until(decode_idle)
        truth = await stats(http, sim.router_url)
    assert status == 400
    assert "exceeds the maximum allowed length" in json.dumps(body)
    assert truth["prefill"]["transfers_started"] == 0
    assert truth["decode"]["transfers_started"] == 0
    assert truth["decode"]["pages_allocated"] == 0
