"""The process as operators run it: bad config exits 2, SIGTERM drains then exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import aiohttp
from aiohttp import web
from kvtest import FakeUpstream, static_engines
from ports import free_port


def run_kvproxy(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvproxy", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_invalid_setting_exits_2_with_one_readable_line() -> None:
    res = run_kvproxy("serve", env={"KVPROXY_LISTEN": "not-a-port"})
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "listen" in lines[0]
    assert "KVPROXY_LISTEN" in lines[0]


def test_invalid_engines_json_exits_2() -> None:
    res = run_kvproxy("serve", "--engines", "[{broken")
    assert res.returncode == 2
    assert "engines" in res.stderr


def test_invalid_yaml_config_exits_2(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = tmp_path / "kvproxy.yaml"
    cfg.write_text("drain_timeout_s: -3\n")
    res = run_kvproxy("serve", "--config", str(cfg))
    assert res.returncode == 2
    assert "drain_timeout_s" in res.stderr


async def test_sigterm_waits_for_in_flight_request_then_exits_0() -> None:
    up = FakeUpstream()
    started = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(20):
            await resp.write(f'data: {{"choices":[{{"index":0,"text":"t{i}"}}]}}\n\n'.encode())
            started.set()
            await asyncio.sleep(0.05)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    up.route("POST", "/v1/completions", slow)
    await up.start()
    port, admin = free_port(), free_port()
    env = {
        **os.environ,
        "KVPROXY_LISTEN": f"127.0.0.1:{port}",
        "KVPROXY_ADMIN_LISTEN": f"127.0.0.1:{admin}",
        "KVPROXY_UPSTREAM": up.url,
        "KVPROXY_ENGINES": json.dumps(static_engines()),
        "KVPROXY_SHUTDOWN_GRACE_S": "20",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvproxy",
        "serve",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(200):  # bounded wait for readiness
                try:
                    async with http.get(f"http://127.0.0.1:{admin}/readyz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)
            body = json.dumps({"model": "m", "prompt": "hello", "stream": True})
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", data=body) as resp:
                assert resp.status == 200
                await asyncio.wait_for(started.wait(), 10)
                proc.send_signal(signal.SIGTERM)
                data = await resp.read()
        assert data.endswith(b"data: [DONE]\n\n")
        assert data.count(b'"text"') == 20
        rc = await asyncio.wait_for(proc.wait(), 30)
        assert rc == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await up.close()


def test_a_subcommand_imports_only_its_own_module() -> None:
    """The plain-install break came from parsing: the simulator (and its dependencies) was
    imported for every subcommand. Now `serve` imports neither the simulator nor the gate."""
    code = (
        "import sys; from kvproxy.cli import build_parser; "
        "build_parser(['serve']).parse_args(['serve']); "
        "print(sorted(m for m in sys.modules if m.startswith(('kvproxy.sim', "
        "'kvproxy.tools.check.gate', 'kvproxy.tools.isolation.harness'))))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert res.stdout.strip() == "[]"
