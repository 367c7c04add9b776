"""SIGTERM while a deferred cancellation is in progress, against the real process.

`python -m kvproxy serve` runs as a child (configured by KVPROXY_* environment only, as in
the Pod) in front of a vulnerable simulator in this process. A client leaves during a long
prefill; kvproxy holds the upstream (I5). SIGTERM arrives mid-drain: the process must stop
taking requests, keep the drain going until decode has the KV, then exit 0. Judged on the
sim's ground truth (the transfer completed, nothing was aborted early, no late write), on
the process's own access log and metrics, and on its exit status.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
from e2e_stack import (
    CHAT,
    TENANT_A,
    body_for,
    disconnect_after,
    engines_of,
    get_json,
    leak_counters,
    parse_prometheus,
    poll,
    post,
    scrape,
    sim_cluster,
    sim_quiet,
    tenant_headers,
    tenant_prompt,
)
from ports import free_port

from kvproxy.sim import SimCluster

# 2,024 tokens at 1.5 ms each: ~3 s of prefill compute, the window SIGTERM lands in.
SIM: dict[str, Any] = {"mode": "vulnerable", "prefill_us_per_token": 1500.0}
EXIT_TIMEOUT_S = 60.0


async def _serve(sim: SimCluster, tmp: Path) -> tuple[asyncio.subprocess.Process, str, str, Path]:
    public, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVPROXY_")}
    env.update(
        HOME=str(tmp),
        KVPROXY_LISTEN=public,
        KVPROXY_ADMIN_LISTEN=admin,
        KVPROXY_UPSTREAM=sim.router_url,
        KVPROXY_ENGINES=json.dumps(engines_of(sim)),
        KVPROXY_SHUTDOWN_GRACE_S="30",
        KVPROXY_DRAIN_TIMEOUT_S="60",
        KVPROXY_LOG_LEVEL="info",
    )
    log = tmp / "serve.log"
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvproxy", "serve", env=env, stdout=sink, stderr=sink
        )
    return proc, f"http://{public}", f"http://{admin}", log


async def _status(http: aiohttp.ClientSession, url: str) -> int | None:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return resp.status
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None


async def test_sigterm_during_a_drain_waits_for_it_then_exits_0(tmp_path: Path) -> None:
    async with sim_cluster(**SIM) as sim, aiohttp.ClientSession() as http:
        proc, public, admin, log = await _serve(sim, tmp_path)
        try:
            await _run(http, sim, proc, public, admin)
            rc = await asyncio.wait_for(proc.wait(), EXIT_TIMEOUT_S)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        truth = await sim_quiet(http, sim)
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    assert rc == 0, log.read_text()[-2000:]
    # The process itself recorded the drain ending at a safe point before it exited.
    drained = [x for x in lines if x.get("deferred_outcome") is not None]
    assert len(drained) == 1, drained
    assert drained[0]["deferred_outcome"] in ("first_token", "completed"), drained
    assert drained[0]["client_disconnect"] in ("before_headers", "before_first_token")
    # Ground truth: the transfer ran to its end, nothing was aborted mid-way, no page was
    # freed under a landing write.
    assert truth["decode"]["transfers_completed"] == 1
    assert truth["prefill"]["aborts"] == 0
    assert leak_counters(truth) == dict.fromkeys(leak_counters(truth), 0)


async def _run(
    http: aiohttp.ClientSession,
    sim: SimCluster,
    proc: asyncio.subprocess.Process,
    public: str,
    admin: str,
) -> None:
    async def ready() -> bool:
        assert proc.returncode is None, "kvproxy serve exited during start-up"
        return await _status(http, admin + "/readyz") == 200

    assert await poll(ready, timeout_s=30.0, interval_s=0.1)

    async def reserved() -> bool:
        stats = await get_json(http, sim.decode_url + "/sim/stats")
        return bool(stats["pages_allocated"] > 0)

    async def gate() -> None:
        assert await poll(reserved), "decode never reserved the pages"

    body = body_for(
        CHAT, tenant_prompt(TENANT_A, 2000, random.Random(1)), stream=True, max_tokens=8
    )
    assert await disconnect_after(http, public, body, tenant_headers(TENANT_A), gate)

    async def draining() -> bool:
        text = await scrape(http, admin + "/metrics")
        return (
            parse_prometheus(text).get(
                ("kvproxy_deferred_cancellations_in_progress", (("upstream", "default"),))
            )
            == 1
        )

    assert await poll(draining, timeout_s=10.0, interval_s=0.02)
    before = await get_json(http, sim.decode_url + "/sim/stats")
    assert before["transfers_completed"] == 0, "SIGTERM must land while prefill still computes"
    proc.send_signal(signal.SIGTERM)

    # Still alive and draining after the signal: readiness is withdrawn, the drain goes on,
    # and a new request is refused without reaching the router.
    async def unready() -> bool:
        return await _status(http, admin + "/readyz") == 503

    assert await poll(unready, timeout_s=10.0, interval_s=0.02)
    text = await scrape(http, admin + "/metrics")
    assert (
        parse_prometheus(text).get(
            ("kvproxy_deferred_cancellations_in_progress", (("upstream", "default"),))
        )
        == 1
    )
    try:
        late = await post(http, public, CHAT, body_for(CHAT, "hello", stream=False, max_tokens=1))
        assert late.status == 503, late.status
    except (aiohttp.ClientError, OSError):
        pass  # the public port is closed: refused before any byte
    router = (await get_json(http, sim.router_url + "/sim/stats"))["router"]
    assert router["requests_by_route"] == {CHAT: 1}
