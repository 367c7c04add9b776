"""The built image (`make image`: deploy/Dockerfile with podman) serving real traffic.

The container runs as the image says (its ENTRYPOINT `kvproxy serve`, its user 10001, a
read-only root filesystem, as the manifests run it) on the host network, in front of the
simulator started here. Through it: a small chat is admitted (200, answered by the
simulator), a prompt far over the measured pool is rejected (400 context_length_exceeded)
and never reaches the simulator (its own counters), the prompt's text is not in the
container's log (I8), and SIGTERM ends the container with exit code 0.

`make test-slow` builds the image first. Without podman the test is skipped (like the other
suites that need a Debian package); with podman but without the image it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from ports import free_port

from kvproxy.sim.launcher import SimCluster, SimOptions

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
# The Makefile's IMAGE (`make image` tags it, `make test-slow` passes it on).
IMAGE = os.environ.get("KVPROXY_IMAGE") or f"localhost/kvproxy:{VERSION}"
PODMAN = shutil.which("podman")
READY_TIMEOUT_S = 60.0  # container start plus the first capacity measurement
CHAT = "/v1/chat/completions"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PODMAN is None, reason="podman is not installed: make image"),
]


def podman(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    assert PODMAN is not None
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(REPO / "deploy" / "image" / "containers.conf"))
    return subprocess.run(
        [PODMAN, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


@pytest.fixture
async def sim() -> AsyncIterator[SimCluster]:
    async with SimCluster(SimOptions(port=0, prefill_port=0, decode_port=0)) as cluster:
        yield cluster


async def sim_routed(http: aiohttp.ClientSession, sim: SimCluster) -> int:
    """Inference requests the simulator's prefill and decode servers received (ground truth)."""
    async with http.get(sim.router_url + "/sim/stats") as resp:
        stats: dict[str, Any] = await resp.json()
    return sum(stats["prefill"]["requests_by_route"].values()) + sum(
        stats["decode"]["requests_by_route"].values()
    )


async def test_the_image_serves_admits_and_rejects_in_front_of_the_simulator(
    sim: SimCluster, http: aiohttp.ClientSession
) -> None:
    inspect = podman("image", "inspect", "--format", "{{.Config.User}}", IMAGE)
    assert inspect.returncode == 0, f"{IMAGE} is not built (make image): {inspect.stderr}"
    assert inspect.stdout.strip() == "10001:10001"
    public, admin = free_port(), free_port()
    engines = [
        {"url": sim.prefill_url, "role": "prefill", "kind": "sglang"},
        {"url": sim.decode_url, "role": "decode", "kind": "sglang"},
    ]
    name = f"kvproxy-test-{os.getpid()}-{public}"
    run = podman(
        "run", "--detach", "--name", name, "--network=host", "--read-only",
        "--env", f"KVPROXY_LISTEN=127.0.0.1:{public}",
        "--env", f"KVPROXY_ADMIN_LISTEN=127.0.0.1:{admin}",
        "--env", f"KVPROXY_UPSTREAM={sim.router_url}",
        "--env", f"KVPROXY_ENGINES={json.dumps(engines)}",
        "--env", "KVPROXY_SHUTDOWN_GRACE_S=5",
        IMAGE,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    # Far over the simulator's prefill pool (5,322 tokens) in any tokenizer: 6,000 words.
    secret = "KVSECRET-" + "-".join(str(i) for i in range(6_000))
    try:
        ready = False
        for _ in range(int(READY_TIMEOUT_S / 0.25)):  # bounded wait for readiness
            state = podman("inspect", "--format", "{{.State.Running}}", name)
            assert state.stdout.strip() == "true", podman("logs", name).stderr[-2000:]
            try:
                async with http.get(f"http://127.0.0.1:{admin}/readyz") as resp:
                    if resp.status == 200:
                        ready = True
                        break
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.25)
        assert ready, podman("logs", name).stderr[-2000:]

        small = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        before = await sim_routed(http, sim)
        async with http.post(f"http://127.0.0.1:{public}{CHAT}", json=small) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["X-Kvproxy-Decision"] == "admitted"
            answer = await resp.json()
        assert answer["choices"][0]["message"]["content"]
        assert await sim_routed(http, sim) > before  # the simulator really answered it

        big = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": secret}]}
        before = await sim_routed(http, sim)
        async with http.post(f"http://127.0.0.1:{public}{CHAT}", json=big) as resp:
            assert resp.status == 400
            assert resp.headers["X-Kvproxy-Decision"] == "rejected"
            error = (await resp.json())["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["prompt_tokens"] > error["limit_tokens"]
        assert await sim_routed(http, sim) == before  # I7: nothing reached the engines

        stop = podman("stop", "--time", "20", name, timeout=60)
        assert stop.returncode == 0, stop.stderr
        exited = podman("inspect", "--format", "{{.State.ExitCode}}", name)
        assert exited.stdout.strip() == "0", podman("logs", name).stderr[-2000:]
        logs = podman("logs", name)
        assert "kvproxy listening" in logs.stdout + logs.stderr
        assert "KVSECRET" not in logs.stdout + logs.stderr  # I8
    finally:
        podman("rm", "--force", "--time", "5", name)
