"""The end-to-end stack the e2e suites share: the simulator, kvproxy in front of it, the real
router (``smg`` 1.13.0, tests/real_router.py) between them, tenant prompts carrying canary
markers, reply readers and ground-truth readers.

Judging stays independent of the proxy: reply text is reassembled here from the wire (SSE or
JSON) without kvproxy's own parsers, and leaks are judged on the simulator's counters
(``/sim/stats``) and on markers found in that text. Prompt text is never printed: assertion
messages carry counts, tenants and statuses only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, get_args

import aiohttp
from kvtest import running_proxy
from prometheus_client.parser import text_string_to_metric_families

from grafana.promql import MODEL_LABELLED
from kvproxy.config import IMPLICIT_MODEL
from kvproxy.observe import IMPLICIT_UPSTREAM
from kvproxy.policy.drain import DEFERRED_OUTCOMES, DISCONNECT_PHASES
from kvproxy.policy.routes import Route
from kvproxy.serve.app import KvproxyServer
from kvproxy.sim import SimCluster, SimOptions

# The deferral and disconnect series carry the cluster's name (the single cluster: default).
UPSTREAM_LABELLED = (
    "kvproxy_deferred_cancellation",
    "kvproxy_client_disconnects_total",
)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
TENANT_A = "canary-a"
TENANT_B = "canary-b"
TENANTS = (TENANT_A, TENANT_B)
MARKER_RE = re.compile(r"KVCANARY-(canary-[a-z])")
REQUEST_TIMEOUT_S = 60.0


# --- prompts and replies ----------------------------------------------------------------------


def new_marker(tenant: str, rng: random.Random) -> str:
    return f"KVCANARY-{tenant}-{rng.getrandbits(64):016x}"


def tenant_prompt(tenant: str, n_bytes: int, rng: random.Random) -> str:
    """``n_bytes`` of ASCII (one sim token per byte) carrying a fresh marker of ``tenant``
    on every line, so any page of it that leaks shows whose it was."""
    line = f"tenant {tenant} secret {new_marker(tenant, rng)}. "
    tail = " please repeat your context"
    return (line * (n_bytes // len(line) + 1))[: max(0, n_bytes - len(tail))] + tail


def body_for(path: str, prompt: str, *, stream: bool, max_tokens: int) -> dict[str, Any]:
    if path == GENERATE:
        return {
            "text": prompt,
            "stream": stream,
            "sampling_params": {"max_new_tokens": max_tokens},
        }
    if path == COMPLETIONS:
        return {
            "model": "kvproxy-sim",
            "prompt": prompt,
            "stream": stream,
            "max_tokens": max_tokens,
        }
    return {
        "model": "kvproxy-sim",
        "messages": [{"role": "user", "content": prompt}],
        "stream": stream,
        "max_tokens": max_tokens,
    }


def tenant_headers(tenant: str) -> dict[str, str]:
    return {"X-Tenant-ID": tenant}


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    text: str = ""
    error: dict[str, Any] | None = None
    events: int = 0
    done: bool = False

    def foreign(self, own: str) -> list[str]:
        """Tenants other than ``own`` whose marker prefix appears in the reply text."""
        return sorted({t for t in MARKER_RE.findall(self.text) if t != own})


def _texts_of(obj: Any) -> str:
    """Generated text of one JSON payload: chat (delta or message), completions, /generate."""
    if not isinstance(obj, dict):
        return ""
    if isinstance(obj.get("text"), str) and "choices" not in obj:
        return str(obj["text"])
    out = []
    for choice in obj.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        for part in (choice.get("delta"), choice.get("message")):
            if isinstance(part, dict) and isinstance(part.get("content"), str):
                out.append(part["content"])
        if isinstance(choice.get("text"), str):
            out.append(choice["text"])
    return "".join(out)


def parse_reply(status: int, headers: dict[str, str], raw: bytes, path: str) -> Reply:
    reply = Reply(status=status, headers=headers)
    is_sse = headers.get("Content-Type", "").startswith("text/event-stream")
    if not is_sse:
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return reply
        if status != 200:
            reply.error = obj if isinstance(obj, dict) else None
            return reply
        reply.text = _texts_of(obj)
        reply.done = True
        return reply
    pieces: list[str] = []
    last_generate = ""
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            reply.done = True
            continue
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            continue
        reply.events += 1
        if isinstance(obj, dict) and "error" in obj:
            reply.error = obj
        if path == GENERATE:
            # /generate streams the cumulative text so far, not deltas.
            last_generate = _texts_of(obj) or last_generate
        else:
            pieces.append(_texts_of(obj))
    reply.text = last_generate if path == GENERATE else "".join(pieces)
    return reply


async def post(
    http: aiohttp.ClientSession,
    base: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> Reply:
    async with http.post(
        base + path,
        json=body,
        headers=headers or {},
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
    ) as resp:
        raw = await resp.read()
        return parse_reply(resp.status, dict(resp.headers), raw, path)


async def disconnect_after(
    http: aiohttp.ClientSession,
    base: str,
    body: dict[str, Any],
    headers: dict[str, str],
    gate: Callable[[], Awaitable[None]],
    path: str = CHAT,
) -> bool:
    """Send ``body``, wait for ``gate``, then leave: cancelling the client task closes its
    connection. Returns False if the response had already ended (nothing was cut)."""

    async def go() -> None:
        async with http.post(base + path, json=body, headers=headers) as resp:
            await resp.read()

    task = asyncio.ensure_future(go())
    try:
        await gate()
    finally:
        ended = task.done()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError, OSError):
            await task
    return not ended


# --- the simulator --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def sim_cluster(**options: Any) -> AsyncIterator[SimCluster]:
    cluster = SimCluster(SimOptions(port=0, **options))
    await cluster.start()
    try:
        yield cluster
    finally:
        await cluster.close()


async def get_json(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        assert resp.status == 200, f"GET {url} -> {resp.status}"
        data: dict[str, Any] = await resp.json()
        return data


async def sim_stats(http: aiohttp.ClientSession, sim: SimCluster) -> dict[str, Any]:
    """``{"router", "prefill", "decode"}`` ground truth of the whole cluster."""
    return await get_json(http, sim.router_url + "/sim/stats")


def leak_counters(stats: dict[str, Any]) -> dict[str, int]:
    """The ground-truth counters that must stay 0 when nothing leaks, summed over roles."""
    names = (
        "late_writes_into_reallocated_pages",
        "late_writes_into_free_pages",
        "pages_freed_before_drain",
        "stale_page_reads",
        "pending_rejections",
    )
    return {n: sum(int(stats[r].get(n, 0)) for r in ("prefill", "decode")) for n in names}


def engines_of(sim: SimCluster) -> list[dict[str, Any]]:
    return [
        {"url": sim.prefill_url, "role": "prefill", "name": "sim-prefill"},
        {"url": sim.decode_url, "role": "decode", "name": "sim-decode"},
    ]


def canary_settings() -> list[dict[str, Any]]:
    return [{"tenant": t, "patterns": [f"KVCANARY-{t}-[0-9a-f]{{16}}"]} for t in TENANTS]


@contextlib.asynccontextmanager
async def proxy_for(
    sim: SimCluster, upstream: str | None = None, **overrides: Any
) -> AsyncIterator[KvproxyServer]:
    """kvproxy measuring the sim's engines, forwarding to ``upstream`` (default: the sim's
    own router). Canaries observe only, so a leak reaches the client and the test sees it
    rather than the tripwire hiding it."""
    overrides.setdefault("engines", engines_of(sim))
    overrides.setdefault("trust_tenant_header", True)
    overrides.setdefault("canaries", canary_settings())
    overrides.setdefault("canary_action", "observe")
    overrides.setdefault("capacity_probe_timeout_s", 2.0)
    async with running_proxy(upstream or sim.router_url, **overrides) as server:
        yield server


# --- reading metrics --------------------------------------------------------------------------


# Families that carry a `model` label (the dashboard's list, grafana.promql): these stacks
# run the single-model form, whose one fixed value is kvproxy.observe.metrics.IMPLICIT_MODEL.


def sample(server: KvproxyServer, name: str, **labels: str) -> float:
    if name in MODEL_LABELLED:
        labels.setdefault("model", IMPLICIT_MODEL)
    if name.startswith(UPSTREAM_LABELLED):
        labels.setdefault("upstream", IMPLICIT_UPSTREAM)
    value = server.metrics.registry.get_sample_value(name, labels)
    return float(value or 0.0)


def deferred_by_outcome(server: KvproxyServer) -> dict[str, int]:
    return {
        o: int(sample(server, "kvproxy_deferred_cancellations_total", outcome=o))
        for o in DEFERRED_OUTCOMES
    }


def disconnects_by_phase(server: KvproxyServer) -> dict[str, int]:
    return {
        p: int(sample(server, "kvproxy_client_disconnects_total", phase=p))
        for p in DISCONNECT_PHASES
    }


def abandoned(server: KvproxyServer) -> int:
    """Requests whose client left before anything was sent upstream (mid-upload, while
    counted or queued): not client disconnects, since there is nothing to defer."""
    return int(
        sum(
            sample(server, "kvproxy_requests_total", route=r, decision="abandoned")
            for r in (*get_args(Route), "passthrough")
        )
    )


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


async def scrape(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        assert resp.status == 200
        return await resp.text()


# --- polling ----------------------------------------------------------------------------------


async def poll(
    check: Callable[[], Awaitable[bool]], timeout_s: float = 20.0, interval_s: float = 0.005
) -> bool:
    """Poll ``check``; bounded in time and in tries. Returns the last result."""
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / interval_s) + 1):
        if await check():
            return True
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(interval_s)
    return False


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --- ground truth once the engines are quiet ----------------------------------------------


async def sim_quiet(http: aiohttp.ClientSession, sim: SimCluster) -> dict[str, Any]:
    """Ground truth once no request runs on either engine and every write issued so far has
    landed. Judged on the sim's own state (requests running, writes on the wire), not on a
    sleep that a loaded machine can outlast: a write landing after the snapshot would hide a
    leak from the assertion that looks for it."""

    async def idle() -> bool:
        stats = await sim_stats(http, sim)
        return bool(
            stats["prefill"]["running"] == 0
            and stats["decode"]["running"] == 0
            # Prefill's transfers run as background work: none left means no write can
            # still be issued; none pending on decode means every issued write landed.
            and stats["prefill"]["background_tasks"] == 0
            and stats["decode"]["writes_in_flight"] == 0
        )

    assert await poll(idle, timeout_s=60.0, interval_s=0.02), "the sim never went idle"
    return await sim_stats(http, sim)


async def drains_over(proxy: KvproxyServer, disconnects: int) -> None:
    """Wait (bounded) until the proxy has seen ``disconnects`` clients leave and ended the
    deferred drain of each one."""

    async def settled() -> bool:
        seen = sum(disconnects_by_phase(proxy).values())
        ended = sum(deferred_by_outcome(proxy).values())
        return (
            seen >= disconnects
            and ended == seen
            and sample(proxy, "kvproxy_deferred_cancellations_in_progress") == 0
            and proxy.state.inflight == 0
        )

    assert await poll(settled, timeout_s=30.0, interval_s=0.02), (
        disconnects_by_phase(proxy),
        deferred_by_outcome(proxy),
    )
