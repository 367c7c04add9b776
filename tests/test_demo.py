"""`make run` / `kvproxy demo`: it serves, and the commands it prints do what they say."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys

from ports import free_port, free_port_run


async def sh(cmd: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_demo_prints_working_commands() -> None:
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
        for _ in range(200):  # bounded: the banner is ~25 lines
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            banner += line.decode()
            if "context_length_exceeded" in banner and line.strip() == b"":
                break
            if not line:
                break
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
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0
