"""The real router in PD mode in front of the simulator's prefill and decode: one launcher for
every suite that puts it in the path (tests/sim, tests/e2e, the harness's slow tests).

The router is ``smg`` 1.13.0 (PyPI ``smg``, the successor of ``sglang-router``). It lives in
its own venv (``.venv-smg``, made by ``make smg``) because ``sglang-router`` 0.3.2 installs a
``bin/smg`` of its own: with both in one venv the last one installed owns the command. The
binary is found in one place, :func:`smg_binary` (``KVPROXY_SMG`` overrides it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from ports import free_port

from kvproxy.sim import SimCluster

REPO = Path(__file__).resolve().parent.parent
SMG_VERSION = "1.13.0"  # the Makefile's SMG_VERSION: keep the two equal
SMG_BIN = REPO / ".venv-smg" / "bin" / "smg"
# Registration runs in the background after start; on a loaded 2-core machine it has taken
# a few seconds. Bounded: a router that never lists both legs fails the test with its log.
READY_TIMEOUT_S = 60.0
MODEL = "kvproxy-sim"  # the model id the simulator's workers report from /model_info


@dataclass
class RealRouter:
    url: str
    metrics_url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]


def smg_binary() -> str:
    """The smg 1.13.0 binary: ``$KVPROXY_SMG``, else ``.venv-smg/bin/smg`` in this checkout.
    Missing: skip (``make smg`` installs it). Another version: fail, since docs/engines.md's
    measured differences are for this one."""
    path = Path(os.environ.get("KVPROXY_SMG") or SMG_BIN)
    if not path.exists():
        pytest.skip(f"smg {SMG_VERSION} is not installed at {path} (run `make smg`)")
    out = subprocess.run(
        [str(path), "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    version = (out.stdout or out.stderr).strip()
    assert version == f"smg {SMG_VERSION}", f"{path} is {version!r}, expected smg {SMG_VERSION}"
    return str(path)


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


def smg_command(prefill_url: str, decode_url: str, port: int, metrics_port: int) -> list[str]:
    """``smg launch`` in PD mode on loopback only, its metrics on their own loopback port
    (never its default 0.0.0.0:29000). For the simulator the bootstrap port is the prefill
    engine's own HTTP port."""
    bootstrap = prefill_url.rsplit(":", 1)[1]
    return [
        smg_binary(),
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--pd-disaggregation",
        "--prefill",
        prefill_url,
        bootstrap,
        "--decode",
        decode_url,
        "--policy",
        "round_robin",
        "--disable-tokenizer-autoload",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warn",
    ]


def both_legs(workers: Any) -> bool:
    """``GET /workers`` lists a ready prefill and a ready decode worker."""
    listed = workers.get("workers") if isinstance(workers, dict) else None
    if not isinstance(listed, list):
        return False
    ready = {
        w.get("worker_type")
        for w in listed
        if isinstance(w, dict) and w.get("is_healthy") and w.get("status", "ready") == "ready"
    }
    return {"prefill", "decode"} <= ready


async def wait_for_workers(router: RealRouter) -> None:
    """Until ``/workers`` lists both legs: bounded in time and tries, and fails at once if the
    router exits. ``/health`` answers before registration ends, so it proves nothing here."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with aiohttp.ClientSession() as http:
        for _ in range(int(READY_TIMEOUT_S / 0.1) + 1):
            if router.proc.poll() is not None:
                raise AssertionError(f"smg exited: {router.tail()}")
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                async with http.get(
                    router.url + "/workers", timeout=aiohttp.ClientTimeout(total=5)
                ) as r:
                    if r.status == 200 and both_legs(await r.json(content_type=None)):
                        return
            assert time.monotonic() < deadline, f"smg never listed both workers: {router.tail()}"
            await asyncio.sleep(0.1)
    raise AssertionError(f"smg never listed both workers: {router.tail()}")


@contextlib.asynccontextmanager
async def smg_router(prefill_url: str, decode_url: str, log: Path) -> AsyncIterator[RealRouter]:
    """smg 1.13 in front of any prefill/decode pair, ready once both workers are listed."""
    port, metrics_port = free_port(), free_port()
    proc = spawn(smg_command(prefill_url, decode_url, port, metrics_port), log)
    router = RealRouter(
        url=f"http://127.0.0.1:{port}",
        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
        proc=proc,
        log=log,
    )
    try:
        await wait_for_workers(router)
        yield router
    finally:
        stop_process(proc)


@contextlib.asynccontextmanager
async def real_router(sim: SimCluster, log: Path) -> AsyncIterator[RealRouter]:
    """smg in front of the simulator's engines; the sim's counters are reset once the workers
    are registered (registration probes them) so tests start from zero."""
    async with smg_router(sim.prefill_url, sim.decode_url, log) as router:
        async with aiohttp.ClientSession() as http:
            async with http.post(sim.router_url + "/sim/reset") as resp:
                assert resp.status == 200
        yield router


# --- the legacy router: sglang-router 0.3.2 (January 2026), kept for one comparison --------


def legacy_binary() -> str:
    """``sglang-router`` 0.3.2 from the test venv (its own ``bin/smg`` is never used)."""
    found = Path(sys.executable).parent / "sglang-router"
    if not found.exists():
        pytest.skip("sglang-router 0.3.2 is not installed (make test-slow installs .[router])")
    return str(found)


@contextlib.asynccontextmanager
async def legacy_router(sim: SimCluster, log: Path) -> AsyncIterator[RealRouter]:
    """sglang-router 0.3.2 in PD mode: it has no ``/workers`` listing to wait on and routes
    any model name, so it is ready once a chat request goes through (bounded)."""
    port, metrics_port = free_port(), free_port()
    cmd = smg_command(sim.prefill_url, sim.decode_url, port, metrics_port)
    cmd[0] = legacy_binary()
    cmd.remove("--disable-tokenizer-autoload")
    proc = spawn(cmd, log)
    router = RealRouter(
        f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", proc, log
    )
    ready = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "ready?"}]}
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        async with aiohttp.ClientSession() as http:
            for _ in range(int(READY_TIMEOUT_S / 0.25) + 1):
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
