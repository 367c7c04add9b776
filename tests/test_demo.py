"""`make run` / `kvproxy demo`: it serves, and the commands it prints do what they say,
including the release checks it passes (issue #33.1)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from ports import free_port, free_port_run


async def sh(cmd: str, timeout_s: float = 60) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


@contextlib.asynccontextmanager
async def running_demo() -> AsyncIterator[str]:
    """`kvproxy demo` on free ports, until its banner is out; yields the banner."""
    sim_port = free_port_run()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvproxy",
        "demo",
        "--sim-port",
        str(sim_port),
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--admin-listen",
        f"127.0.0.1:{free_port()}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        banner = ""
        for _ in range(200):  # bounded: the banner is ~35 lines
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            banner += line.decode()
            if "context_length_exceeded" in banner and line.strip() == b"":
                break
            if not line:
                break
        yield banner
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0


def printed(banner: str, program: str) -> list[str]:
    """The banner's commands that start with `program`, continuation lines joined."""
    found = re.findall(rf"^  ({program} .*?)(?=\n\S|\n\n|\n  \S|\Z)", banner, re.S | re.M)
    return [c.replace("\\\n", " ") for c in found]


async def test_demo_prints_working_commands() -> None:
    async with running_demo() as banner:
        commands = re.findall(r"^  (curl .*?)(?=\n\S|\n\n|\Z)", banner, re.S | re.M)
        assert len(commands) == 3, banner
        stream, leak, stopped = (c.replace("\\\n", " ") for c in commands)

        rc, out = await sh(stream)
        assert rc == 0
        assert out.count("data: ") > 3
        assert '"content"' in out
        assert out.rstrip().endswith("data: [DONE]")

        rc, out = await sh(leak + " -o /dev/null -w '%{http_code}'")
        assert out == "200"  # the vulnerable simulator answers an over-long prompt
        rc, out = await sh(stopped + " -w '\\n%{http_code}'")
        body, code = out.rsplit("\n", 1)
        assert code == "400"
        assert "context_length_exceeded" in body


@pytest.mark.slow
async def test_the_demo_passes_the_checks_it_prints(tmp_path: Path) -> None:
    """The banner's `kvproxy canary` exits 0 with all four scenarios run, through kvproxy
    in front of the vulnerable engines; its `kvproxy check` fails on engine posture only."""
    kvproxy = f"{sys.executable} -m kvproxy"
    async with running_demo() as banner:
        (canary,) = printed(banner, "kvproxy canary")
        (check,) = printed(banner, "kvproxy check")
        report = tmp_path / "canary.json"
        rc, out = await sh(
            canary.replace("kvproxy", kvproxy, 1) + f" --report {report}", timeout_s=600
        )
        assert rc == 0, out
        data = json.loads(report.read_text())
        assert (data["verdict"], data["scenarios_run"], data["not_run"]) == ("pass", 4, {})
        rc, out = await sh(
            check.replace("kvproxy", kvproxy, 1) + f" --out {tmp_path}", timeout_s=600
        )
        assert rc == 1, out
        record = json.loads((tmp_path / "release-record.json").read_text())
        assert record["failed_checks"] == ["engine posture"], out


README = Path(__file__).resolve().parents[1] / "README.md"
# The ports README's demo section shows, i.e. `make run`'s defaults.
README_PORTS = {"proxy": 8080, "admin": 9090, "sim": 30000}


def readme_demo_commands() -> list[str]:
    """README's demo section ("Five minutes with the demo"): its `curl` commands, in order,
    continuation lines joined."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Five minutes with the demo", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [line.strip() for line in lines if line.strip().startswith("curl ")]


def test_readme_commands_use_full_urls() -> None:
    """curl 7.88 (Debian 12) rejects the `:PORT` shorthand, and `-s` hides why: every
    command README shows names http://HOST:PORT."""
    text = README.read_text(encoding="utf-8")
    shorthand = re.findall(r"curl [^`\n]*?(?<![\w/.])(?::\d+|localhost:\d+)", text)
    assert shorthand == []
    assert len(readme_demo_commands()) == 5


def all_keys(data: object) -> set[str]:
    if isinstance(data, dict):
        return set(data) | {k for v in data.values() for k in all_keys(v)}
    if isinstance(data, list):
        return {k for v in data for k in all_keys(v)}
    return set()


async def test_readme_demo_commands_print_what_readme_says() -> None:
    async with running_demo() as banner:
        # The demo on free ports: README's URLs are moved to them, nothing else.
        ports = {
            "proxy": re.search(r"proxy +http://127\.0\.0\.1:(\d+)", banner),
            "admin": re.search(r"admin +http://127\.0\.0\.1:(\d+)", banner),
            "sim": re.search(r"sim +http://127\.0\.0\.1:(\d+)", banner),
        }
        moved = []
        for cmd in readme_demo_commands():
            for name, default in README_PORTS.items():
                found = ports[name]
                assert found is not None, banner
                cmd = cmd.replace(f"http://127.0.0.1:{default}/", f"http://127.0.0.1:{found[1]}/")
            moved.append(cmd)
        leak, refused, stats, capacity, metrics = moved

        # 1. Straight to the engines: 200, and the text is tenant A's.
        rc, out = await sh(leak + " -w '\\n%{http_code}'")
        body, code = out.rsplit("\n", 1)
        assert (rc, code) == (0, "200")
        assert "KVCANARY-tenant-a" in body

        # 2. Through kvproxy: 400 context_length_exceeded naming the limit and the count,
        # and the engines' ground truth shows the request never arrived.
        rc, out = await sh(stats)
        before = json.loads(out)
        rc, out = await sh(refused + " -w '\\n%{http_code}'")
        body, code = out.rsplit("\n", 1)
        assert (rc, code) == (0, "400")
        error = json.loads(body)["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["prompt_tokens"] > error["limit_tokens"] > 0
        rc, out = await sh(stats)
        after = json.loads(out)
        for leg in ("prefill", "decode"):
            assert after[leg]["requests_by_route"] == before[leg]["requests_by_route"]

        # 4. What an operator watches: the measured pools and the limit; the refusal counted.
        rc, out = await sh(capacity)
        assert rc == 0
        assert {"admission_limit_tokens", "pool_tokens"} <= all_keys(json.loads(out))
        rc, out = await sh(metrics)
        counted = [
            line
            for line in out.splitlines()
            if line.startswith("kvproxy_rejections_total{") and 'reason="context_length"' in line
        ]
        assert len(counted) == 1, out
        assert float(counted[0].rsplit(" ", 1)[1]) >= 1
