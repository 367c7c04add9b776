"""The real PyPI ``sglang-router`` in PD mode in front of the simulator's prefill and decode:
one launcher for every suite that puts it in the path (tests/sim, tests/e2e)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from ports import free_port

from kvproxy.sim import SimCluster

ROUTER_BIN = Path(sys.executable).parent / "sglang-router"
READY_TIMEOUT_S = 60.0


@dataclass
class RealRouter:
    url: str
    metrics_url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]


def router_binary() -> str:
    if ROUTER_BIN.exists():
        return str(ROUTER_BIN)
    found = shutil.which("sglang-router")
    if found is None:
        pytest.skip("sglang-router is not installed")
    return found


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a child process whose stdout and stderr go to ``log``."""
    with log.open("wb") as sink:
        return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)


@contextlib.asynccontextmanager
async def real_router(sim: SimCluster, log: Path) -> AsyncIterator[RealRouter]:
    """The router with its own Prometheus endpoint, ready once a chat request goes through;
    the sim's counters are reset after that warm-up so tests start from zero."""
    port, metrics_port = free_port(), free_port()
    bootstrap = sim.prefill_url.rsplit(":", 1)[1]
    cmd = [
        router_binary(),
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
    proc = spawn(cmd, log)
    router = RealRouter(
        url=f"http://127.0.0.1:{port}",
        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
        proc=proc,
        log=log,
    )
    ready = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "ready?"}]}
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + READY_TIMEOUT_S
            for _ in range(int(READY_TIMEOUT_S / 0.25) + 1):  # bounded in tries and time
                if proc.poll() is not None:
                    raise AssertionError(f"sglang-router exited: {router.tail()}")
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with http.post(router.url + "/v1/chat/completions", json=ready) as r:
                        await r.read()
                        if r.status == 200:
                            break
                assert time.monotonic() < deadline, f"sglang-router never served: {router.tail()}"
                await asyncio.sleep(0.25)
            async with http.post(sim.router_url + "/sim/reset") as resp:
                assert resp.status == 200
        yield router
    finally:
        stop_process(proc)
