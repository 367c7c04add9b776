"""A real Prometheus server on loopback for tests: config in, PromQL answers out.

Scrapes the given targets every second, loads the given rule files, keeps its storage in the
test's tmp directory and is always stopped (terminate, then kill) by `close()`. Every wait is
bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from ports import free_port

STARTUP_TIMEOUT_S = 30.0


class PrometheusServer:
    def __init__(
        self,
        binary: str,
        workdir: Path,
        targets: list[str],
        rule_files: list[Path] | None = None,
    ) -> None:
        self.binary = binary
        self.workdir = workdir
        self.targets = targets
        self.rule_files = list(rule_files or [])
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.log_path = workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def start(self, session: aiohttp.ClientSession) -> None:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [
                {"job_name": "kvproxy", "static_configs": [{"targets": self.targets}]}
            ],
        }
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
        self.port = free_port()
        log = self.log_path.open("wb")
        try:
            self.proc = await asyncio.create_subprocess_exec(
                self.binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                stdout=log,
                stderr=log,
            )
        finally:
            log.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_TIMEOUT_S
        while loop.time() < deadline:
            if self.proc.returncode is not None:
                break
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{self.url}/-/ready") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"prometheus did not become ready:\n{self.log_tail()}")

    async def close(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    async def api(self, session: aiohttp.ClientSession, path: str, **params: str) -> Any:
        async with session.get(f"{self.url}/api/v1/{path}", params=params) as resp:
            body = await resp.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    async def query(self, session: aiohttp.ClientSession, expr: str) -> list[dict[str, Any]]:
        """Instant query; the vector (or a scalar as a one-element list)."""
        data = await self.api(session, "query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    values = [float(item["value"][1]) for item in result]
    return [v for v in values if math.isfinite(v)]
