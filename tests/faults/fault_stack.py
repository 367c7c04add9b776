"""What runs in the fault lab: the simulator and smg 1.13 in the "up" namespace, redis-server in
the "redis" namespace, and `kvproxy serve` processes here, configured by KVPROXY_* only (as in
the Pod) with short timeouts, so every wait a fault causes is bounded and measurable.

kvproxy is a child process: it can be killed, limited (fds, memory) and read from outside
(/proc for fds and memory, its /metrics for tasks, in-flight requests and drains).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from fault_lab import REDIS, REDIS_TRUTH, UP, UP_TRUTH, Lab
from ports import free_port
from real_router import RealRouter, smg_binary, wait_for_workers

SIM_PORT, PREFILL_PORT, DECODE_PORT = 30000, 30001, 30002
SMG_PORT, SMG_METRICS_PORT = 30010, 30011
REDIS_PORT = 6379
ROUTER_PORTS = {"sim": SIM_PORT, "smg": SMG_PORT}
# The simulator: vulnerable (so an early cancellation or an over-limit prompt shows in its
# counters), a prefill slow enough (0.4 ms per token: 0.4-1.2 s for the prompts here) that a
# fault can land during it, and a decode of 10 ms per token. Pools large enough that a run's
# concurrent prompts never queue inside the engines: a queued request sends no byte, and a
# load that waits past the read timeout times itself out with no fault at all. The context
# (8,192) is then the limit: OVER_LIMIT_BYTES prompts are above it.
SIM_ARGS = ("--mode", "vulnerable", "--prefill-us-per-token", "150", "--decode-ms-per-token",
            "10", "--abort-ack-timeout-s", "10", "--prefill-pool-tokens", "65536",
            "--decode-pool-tokens", "131072")  # fmt: skip
# Decode gives up a transfer it waited this long for (SGLang's waiting timeout, 300 s by
# default): a decode whose prefill leg the router cancelled mid-handshake would otherwise
# wait forever, and the run would never go quiet.
SIM_FAULTS = {"waiting_timeout_s": 15}
# kvproxy's timeouts in the suite: each fault's wait ends at one of them (+1 s at most).
PROXY_ENV: dict[str, str] = {
    "KVPROXY_UPSTREAM_CONNECT_TIMEOUT_S": "1",
    "KVPROXY_UPSTREAM_READ_TIMEOUT_S": "5",
    "KVPROXY_UPSTREAM_KEEPALIVE_S": "1",
    # Longer than any transfer here, and than a blackhole's repair plus TCP's retransmission
    # backoff (a held upstream hears from the router again within ~13 s of a 6 s outage).
    "KVPROXY_DRAIN_TIMEOUT_S": "30",
    "KVPROXY_CAPACITY_REFRESH_S": "0.25",
    "KVPROXY_CAPACITY_STALE_S": "1.5",
    "KVPROXY_CAPACITY_PROBE_TIMEOUT_S": "0.5",
    "KVPROXY_QUEUE_TIMEOUT_S": "2",
    "KVPROXY_SHUTDOWN_GRACE_S": "15",
    "KVPROXY_BODY_READ_TIMEOUT_S": "10",
    "KVPROXY_ACCESS_LOG": "false",
    "KVPROXY_TRUST_TENANT_HEADER": "true",
    "KVPROXY_CANARY_ACTION": "observe",
    "KVPROXY_REDIS_TIMEOUT_S": "0.5",
    "KVPROXY_REDIS_LEASE_TTL_S": "3",
}
TENANTS = ("canary-a", "canary-b")


def engines_json(host: str = UP) -> str:
    return json.dumps(
        [
            {"url": f"http://{host}:{PREFILL_PORT}", "role": "prefill", "name": "sim-prefill"},
            {"url": f"http://{host}:{DECODE_PORT}", "role": "decode", "name": "sim-decode"},
        ]
    )


async def poll(
    check: Callable[[], Awaitable[bool]], timeout_s: float, every_s: float = 0.05
) -> bool:
    """Poll `check` until it holds; bounded in time and in tries."""
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / every_s) + 1):
        with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            if await check():
                return True
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(every_s)
    return False


async def get_json(url: str, timeout_s: float = 5.0) -> Any:
    async with (
        aiohttp.ClientSession() as http,
        http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp,
    ):
        return await resp.json(content_type=None)


@dataclass
class Upstream:
    """The simulator (and smg) in the up namespace, Redis in the redis namespace."""

    lab: Lab
    logs: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def _spawn(self, role: str, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        with (self.logs / log).open("wb") as sink:
            proc = subprocess.Popen(
                self.lab.exec_argv(role, argv), stdout=sink, stderr=subprocess.STDOUT
            )
        self.procs.append(proc)
        return proc

    async def start(self, smg: bool = True) -> None:
        self._spawn("up", [sys.executable, "-m", "kvproxy", "sim", "--host", "0.0.0.0",
                           "--port", str(SIM_PORT), "--prefill-port", str(PREFILL_PORT),
                           "--decode-port", str(DECODE_PORT), *SIM_ARGS], "sim.log")  # fmt: skip
        assert await poll(self._sim_up, 60), (self.logs / "sim.log").read_text()[-2000:]
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"http://{UP_TRUTH}:{SIM_PORT}/sim/faults", json=SIM_FAULTS) as resp,
        ):
            assert resp.status == 200, await resp.text()
        self._spawn("redis", ["redis-server", "--port", str(REDIS_PORT), "--bind", "0.0.0.0",
                              "--protected-mode", "no", "--save", "", "--appendonly", "no",
                              "--dir", str(self.logs)], "redis.log")  # fmt: skip
        assert await poll(self._redis_up, 30), (self.logs / "redis.log").read_text()[-2000:]
        if smg:
            loop = f"http://127.0.0.1:{PREFILL_PORT}"
            proc = self._spawn("up", [smg_binary(), "launch", "--host", "0.0.0.0", "--port",
                                      str(SMG_PORT), "--pd-disaggregation", "--prefill", loop,
                                      str(PREFILL_PORT), "--decode",
                                      f"http://127.0.0.1:{DECODE_PORT}", "--policy",
                                      "round_robin", "--disable-tokenizer-autoload",
                                      "--prometheus-host", "127.0.0.1", "--prometheus-port",
                                      str(SMG_METRICS_PORT), "--log-level", "warn"],
                               "smg.log")  # fmt: skip
            router = RealRouter(f"http://{UP_TRUTH}:{SMG_PORT}", "", proc, self.logs / "smg.log")
            await wait_for_workers(router)

    async def _sim_up(self) -> bool:
        assert all(p.poll() is None for p in self.procs), (self.logs / "sim.log").read_text()
        stats = await get_json(f"http://{UP_TRUTH}:{SIM_PORT}/sim/stats")
        return "prefill" in stats and "decode" in stats

    async def _redis_up(self) -> bool:
        _, writer = await asyncio.open_connection(REDIS_TRUTH, REDIS_PORT)
        writer.close()
        await writer.wait_closed()
        return True

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    # --- ground truth ---------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = await get_json(f"http://{UP_TRUTH}:{SIM_PORT}/sim/stats")
        return data

    async def quiet(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Ground truth once no request runs on either engine and every write landed."""

        async def idle() -> bool:
            s = await self.stats()
            return bool(
                s["prefill"]["running"] == 0
                and s["decode"]["running"] == 0
                and s["prefill"]["background_tasks"] == 0
                and s["decode"]["writes_in_flight"] == 0
            )

        if not await poll(idle, timeout_s, 0.05):
            s = await self.stats()
            keys = (
                "running",
                "background_tasks",
                "writes_in_flight",
                "aborts",
                "bootstrap_failures",
            )
            raise AssertionError(
                "the simulator never went idle: "
                + repr({r: {k: s[r].get(k) for k in keys} for r in ("prefill", "decode")})
            )
        return await self.stats()

    async def reset(self) -> None:
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"http://{UP_TRUTH}:{SIM_PORT}/sim/reset") as resp,
        ):
            assert resp.status == 200

    async def redis_state(self, pool: str = "default") -> tuple[int, int, int, int]:
        """Redis's own view of the budget: (tokens, requests, live leases, lapsed leases),
        read from the keys as kvproxy.budget's script docstring lays them out (the hash
        tag is Redis Cluster's), not through kvproxy's code."""
        import redis.asyncio as aioredis

        prefix = f"kvproxy:budget:{{{pool}}}"
        client = aioredis.Redis.from_url(f"redis://{REDIS_TRUTH}:{REDIS_PORT}/0")
        try:
            raw = await client.hgetall(prefix + ":usage")
            live = await client.zcard(prefix + ":leases")
            lapsed = await client.zcard(prefix + ":lapsed")
        finally:
            await client.aclose()
        return int(raw.get(b"tokens", 0)), int(raw.get(b"requests", 0)), int(live), int(lapsed)

    async def redis_usage(self, pool: str = "default") -> tuple[int, int]:
        tokens, requests, _, _ = await self.redis_state(pool)
        return tokens, requests

    async def redis_flush(self) -> None:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(f"redis://{REDIS_TRUTH}:{REDIS_PORT}/0")
        try:
            await client.flushall()
        finally:
            await client.aclose()


@dataclass
class Proxy:
    """One `kvproxy serve` child process."""

    proc: subprocess.Popen[bytes]
    public: str
    admin: str
    log: Path
    name: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    async def metrics(self) -> dict[str, float]:
        """Every sample summed over labels by name (enough for the judge)."""
        async with (
            aiohttp.ClientSession() as http,
            http.get(self.admin + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp,
        ):
            text = await resp.text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    async def metric_where(self, name: str, **labels: str) -> float:
        """A sample summed over the series whose labels include `labels`."""
        from prometheus_client.parser import text_string_to_metric_families

        async with (
            aiohttp.ClientSession() as http,
            http.get(self.admin + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp,
        ):
            text = await resp.text()
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    total += float(sample.value)
        return total

    async def metric(self, name: str) -> float:
        return (await self.metrics()).get(name, 0.0)

    async def capacity(self) -> dict[str, Any]:
        data: dict[str, Any] = await get_json(self.admin + "/capacity")
        return data

    async def ready(self) -> bool:
        async with (
            aiohttp.ClientSession() as http,
            http.get(self.admin + "/readyz", timeout=aiohttp.ClientTimeout(total=2)) as resp,
        ):
            return resp.status == 200

    async def idle(self) -> bool:
        m = await self.metrics()
        return (
            m.get("kvproxy_inflight_requests", 1) == 0
            and m.get("kvproxy_deferred_cancellations_in_progress", 1) == 0
        )

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    async def wait_exit(self, timeout_s: float) -> int | None:
        try:
            return await asyncio.to_thread(self.proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            return None


async def start_proxy(
    logs: Path,
    name: str,
    router: str = "sim",
    prefix: list[str] | None = None,
    **settings: Any,
) -> Proxy:
    """`kvproxy serve` in front of `router`; `prefix` wraps the command (prlimit, a cgroup)."""
    public, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVPROXY_")}
    env.update(PROXY_ENV)
    env.update(
        KVPROXY_LISTEN=public,
        KVPROXY_ADMIN_LISTEN=admin,
        KVPROXY_UPSTREAM=f"http://{UP}:{ROUTER_PORTS[router]}",
        KVPROXY_ENGINES=engines_json(),
        KVPROXY_CANARIES=json.dumps(
            [{"tenant": t, "patterns": [f"KVCANARY-{t}-[0-9a-f]{{16}}"]} for t in TENANTS]
        ),
    )
    env.update({f"KVPROXY_{k.upper()}": str(v) for k, v in settings.items()})
    if env.get("KVPROXY_BUDGET_BACKEND") == "redis":
        env.setdefault("KVPROXY_REDIS_URL", f"redis://{REDIS}:{REDIS_PORT}/0")
    log = logs / f"{name}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(  # noqa: ASYNC220 (returns at once; readiness polled below)
            [*(prefix or []), sys.executable, "-m", "kvproxy", "serve"],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    proxy = Proxy(proc, f"http://{public}", f"http://{admin}", log, name)

    async def up() -> bool:
        assert proc.poll() is None, proxy.tail()
        return await proxy.ready()

    assert await poll(up, 60, 0.1), proxy.tail()
    return proxy


async def stop_proxy(proxy: Proxy, timeout_s: float = 30.0) -> int | None:
    proxy.signal(signal.SIGTERM)
    code = await proxy.wait_exit(timeout_s)
    if code is None:
        proxy.signal(signal.SIGKILL)
        await proxy.wait_exit(10)
    return code
