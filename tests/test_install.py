"""A plain `pip install kvproxy` (no extras) in a fresh venv: every core command starts, and
`kvproxy serve` with the default `tokenizer: bytes` proxies a request to a static engine.

Runs the installed copy, not this checkout: PYTHONPATH is removed from the environment and
the working directory is a temporary one. pip may reuse its wheel cache; it needs PyPI (or
the machine's configured index) once, for the core dependencies.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from kvtest import FakeUpstream
from ports import free_port

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and k != "VIRTUAL_ENV"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120):  # type: ignore[no-untyped-def]
    return subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env or _clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plain-install")
    src = root / "src"
    # A copy, so pip's in-tree build leaves nothing (build/, *.egg-info) in the checkout.
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "kvproxy", src / "kvproxy", ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / "venv"
    made = _run(sys.executable, "-m", "venv", venv, cwd=root)
    assert made.returncode == 0, made.stderr
    # The versions the image ships (deploy/constraints.txt): this test is about kvproxy's
    # own imports and extras, not about what PyPI released since the lock was made.
    lock = REPO / "deploy" / "constraints.txt"
    pip = _run(
        venv / "bin" / "python",
        "-m",
        "pip",
        "install",
        "-q",
        "-c",
        lock,
        src,
        cwd=root,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stderr[-2000:]
    return venv


def test_no_extra_is_installed(core_venv: Path, tmp_path: Path) -> None:
    py = core_venv / "bin" / "python"
    for module in ("tokenizers", "tiktoken"):
        res = _run(py, "-c", f"import {module}", cwd=tmp_path)
        assert res.returncode != 0, f"{module} came with the plain install"
    where = _run(py, "-c", "import kvproxy; print(kvproxy.__file__)", cwd=tmp_path)
    assert str(core_venv) in where.stdout, "the test must run the installed copy"


@pytest.mark.parametrize("command", ["serve", "check", "canary", "sim", "demo"])
def test_every_command_parses_on_a_plain_install(
    core_venv: Path, tmp_path: Path, command: str
) -> None:
    res = _run(core_venv / "bin" / "kvproxy", command, "--help", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "usage: kvproxy " + command in res.stdout


def test_an_exact_tokenizer_names_the_extra_it_needs(core_venv: Path, tmp_path: Path) -> None:
    env = {**_clean_env(), "KVPROXY_LISTEN": f"127.0.0.1:{free_port()}",
           "KVPROXY_ADMIN_LISTEN": f"127.0.0.1:{free_port()}"}  # fmt: skip
    res = _run(
        core_venv / "bin" / "kvproxy", "serve", "--tokenizer", "hf:/nowhere", cwd=tmp_path, env=env
    )
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "kvproxy[tokenizers]" in lines[0]
    assert "Traceback" not in res.stderr


async def test_serve_proxies_a_request_to_a_static_engine(core_venv: Path, tmp_path: Path) -> None:
    up = FakeUpstream()

    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"id": "c1", "choices": [{"message": {"content": "ok"}}]})

    up.route("POST", "/v1/chat/completions", ok)
    await up.start()
    port, admin = free_port(), free_port()
    engines = [{"url": "static://", "role": "unified", "kind": "static", "capacity_tokens": 8192}]
    env = {
        **_clean_env(),
        "KVPROXY_LISTEN": f"127.0.0.1:{port}",
        "KVPROXY_ADMIN_LISTEN": f"127.0.0.1:{admin}",
        "KVPROXY_UPSTREAM": up.url,
        "KVPROXY_ENGINES": json.dumps(engines),
        "KVPROXY_SHUTDOWN_GRACE_S": "5",
    }
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            str(core_venv / "bin" / "kvproxy"),
            "serve",
            cwd=tmp_path,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=log,
        )
    try:
        async with aiohttp.ClientSession() as http:
            ready = False
            for _ in range(400):  # bounded wait for readiness (~20 s)
                try:
                    async with http.get(f"http://127.0.0.1:{admin}/readyz") as r:
                        if r.status == 200:
                            ready = True
                            break
                except aiohttp.ClientConnectionError:
                    pass
                if proc.returncode is not None:
                    break
                await asyncio.sleep(0.05)
            assert ready, log_path.read_text(errors="replace")[-2000:]
            body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
            async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["X-Kvproxy-Decision"] == "admitted"
                assert (await resp.json())["choices"][0]["message"]["content"] == "ok"
        assert len(up.received) == 1
        assert json.loads(up.received[0]["body"]) == body
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await up.close()
