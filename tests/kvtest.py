"""Test helpers: a scriptable fake upstream and a proxy started on loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from kvproxy.config import load_settings
from kvproxy.observe.metrics import Metrics
from kvproxy.serve.app import KvproxyServer

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FakeUpstream:
    """An aiohttp app on 127.0.0.1:0 whose routes a test defines; records what arrived."""

    def __init__(self, *, auto_decompress: bool = True) -> None:
        # auto_decompress=False records bodies exactly as the proxy put them on the wire.
        self.auto_decompress = auto_decompress
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.received: list[dict[str, Any]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.closed_early = 0  # handlers that saw their client (the proxy) go away

    def route(self, method: str, path: str, handler: Handler) -> None:
        async def recording(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            self.received.append(
                {
                    "method": request.method,
                    "path": request.path,
                    "headers": dict(request.headers),
                    "body": body,
                }
            )
            return await handler(request)

        self.app.router.add_route(method, path, recording)

    async def start(self) -> None:
        self.runner = web.AppRunner(
            self.app, shutdown_timeout=1.0, auto_decompress=self.auto_decompress
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def static_engines(capacity: int = 100_000, decode: int | None = None) -> list[dict[str, Any]]:
    engines: list[dict[str, Any]] = [
        {
            "url": "static://prefill",
            "role": "prefill",
            "kind": "static",
            "capacity_tokens": capacity,
            "name": "static-prefill",
        }
    ]
    if decode is not None:
        engines.append(
            {
                "url": "static://decode",
                "role": "decode",
                "kind": "static",
                "capacity_tokens": decode,
                "name": "static-decode",
            }
        )
    return engines


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """Serve `app` on a free loopback port for the block; yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def running_proxy(
    upstream_url: str, *, refresh: bool = True, **overrides: Any
) -> AsyncIterator[KvproxyServer]:
    overrides.setdefault("engines", static_engines())
    overrides.setdefault("access_log", False)
    settings = load_settings(
        listen="127.0.0.1:0", admin_listen="127.0.0.1:0", upstream=upstream_url, **overrides
    )
    server = KvproxyServer(settings, Metrics())
    await server.start()
    try:
        if refresh:
            await server.services.models.first.capacity.refresh_now()
        yield server
    finally:
        await server.stop()


async def wait_until(pred: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Bounded polling for a condition driven by another task; never a timed assertion."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while loop.time() < end:
        if pred():
            return True
        await asyncio.sleep(0.01)
    return pred()


CANARY_TENANTS = ("canary-a", "canary-b")


def canary_settings() -> dict[str, Any]:
    """Tripwire config matching `kvproxy canary`'s default synthetic tenants."""
    return {
        "trust_tenant_header": True,
        "canaries": [
            {"tenant": t, "patterns": [f"KVCANARY-{t}-[0-9a-f]{{16}}"]} for t in CANARY_TENANTS
        ],
    }


@contextlib.asynccontextmanager
async def sim_and_proxy(
    sim_options: dict[str, Any] | None = None, **overrides: Any
) -> AsyncIterator[tuple[Any, KvproxyServer]]:
    """The simulator (all three servers on free ports) with kvproxy wired to its engines."""
    from kvproxy.sim.launcher import SimCluster, SimOptions

    opts = SimOptions(**{"port": 0, "prefill_port": 0, "decode_port": 0, **(sim_options or {})})
    async with SimCluster(opts) as sim:
        kind = opts.flavor  # probe the engines the way their flavour answers
        overrides.setdefault(
            "engines",
            [
                {"url": sim.prefill_url, "role": "prefill", "kind": kind},
                {"url": sim.decode_url, "role": "decode", "kind": kind},
            ],
        )
        async with running_proxy(sim.router_url, **overrides) as proxy:
            yield sim, proxy


def content_with_tokens(count: Callable[[str], int], target: int, base: str) -> str:
    """`base` padded to exactly `target` tokens by `count` (the simulator's own counter):
    Qwen's pre-tokenizer splits digits one by one, so each "1" adds exactly one token."""
    content = base + "1" * (target - count(base))
    assert count(content) == target
    return content


# Terminal-summary sections a conftest adds at the end of a session: title -> (path or "",
# key -> line). Under pytest-xdist they are filled in the workers and printed by the
# controller (tests/conftest.py carries them across in `workeroutput`).
SummarySections = dict[str, tuple[str, dict[str, str]]]
SUMMARIES = pytest.StashKey[SummarySections]()


def add_summary(config: pytest.Config, title: str, lines: dict[str, str], path: str = "") -> None:
    """Add `lines` (key -> line, printed sorted by key) to the session's summary `title`;
    `path`, if given, is where the controller also writes the section."""
    sections = config.stash.setdefault(SUMMARIES, {})
    _, old = sections.get(title, (path, {}))
    sections[title] = (path, {**old, **lines})


async def serve_ready(
    proc: asyncio.subprocess.Process,
    admin: int,
    exited: Callable[[], Awaitable[str]],
    timeout_s: float = 120.0,
) -> int:
    """A `kvproxy serve` child's admission limit once its /capacity says the engines are
    measured (bounded: `timeout_s` in 0.1 s polls); AssertionError with `exited()` (the tail of
    its log or stderr) if it dies first."""
    import aiohttp

    async with aiohttp.ClientSession() as http:
        for _ in range(int(timeout_s / 0.1)):
            if proc.returncode is not None:
                raise AssertionError(f"kvproxy serve exited: {await exited()}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(f"http://127.0.0.1:{admin}/capacity") as r:
                    if r.status == 200:
                        snap = await r.json()
                        if snap.get("known"):
                            return int(snap["limits"]["admission_limit_tokens"])
            await asyncio.sleep(0.1)
    raise AssertionError(f"kvproxy serve not ready within {timeout_s:.0f} s")
