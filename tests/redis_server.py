"""A real Debian `redis-server` on a loopback port, started and stopped by the tests.

No persistence (`--save ''`, no AOF), so a restart comes back empty: the case the budget
must survive by putting live leases back. `stop()`/`start()` let a test take Redis away
mid-run and bring it back on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from ports import free_port

REDIS_SERVER = shutil.which("redis-server") or (
    "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
)
needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server (Debian package) is not installed: make sysdeps"
)


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        assert REDIS_SERVER is not None
        self.proc = subprocess.Popen(  # noqa: ASYNC220 (returns at once; waited for below)
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for _ in range(200):  # bounded: ~10 s
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                await writer.wait_closed()
                return
            await asyncio.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    async def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            await asyncio.to_thread(self.proc.wait, 10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait, 10)
        self.proc = None


@contextlib.asynccontextmanager
async def redis_server(workdir: Path) -> AsyncIterator[RedisServer]:
    server = RedisServer(workdir)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
