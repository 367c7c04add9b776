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
