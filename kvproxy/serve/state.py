"""What the server shares between requests, in two kinds (uvicorn's `ServerState` lesson:
one explicit object instead of module globals, and only what really changes in it).

`Services`: built once at start, read by every request, never reassigned: the settings,
the metrics, the relay's upstream pool and the probes' session, the watchers, each model's
capacity/counter/budget (`models`), the tenant resolver, the canary rules and the overload
gates. A handler receives them explicitly.

`ServerState`: the mutable part: how many requests are in flight, whether the server is
stopping, and the hard-stop future deferred drains race against. The app builds both at
start; handlers read them; nothing else owns them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

from kvproxy.config import Settings
from kvproxy.observe import Metrics
from kvproxy.serve.watch import DisconnectWatcher, LoopLagMonitor

if TYPE_CHECKING:
    from kvproxy.policy import TenantResolver
    from kvproxy.response import CanaryRules
    from kvproxy.serve.models import ModelTable
    from kvproxy.serve.overload import BodyMemoryGate, ConnectionGate
    from kvproxy.upstream import UpstreamPool


@dataclass(frozen=True, slots=True)
class Services:
    settings: Settings
    metrics: Metrics
    # The engines' probes and the tools' requests (aiohttp).
    session: aiohttp.ClientSession
    # The relay's requests to the router (kvproxy.upstream.pool).
    upstream: UpstreamPool
    watcher: DisconnectWatcher
    lag: LoopLagMonitor
    # Every model's capacity, counter and budget (`models.first` is the single model's).
    models: ModelTable
    tenants: TenantResolver
    canaries: CanaryRules
    # Overload shedding (kvproxy.serve.overload): public connections and body memory.
    connections: ConnectionGate
    body_memory: BodyMemoryGate


@dataclass
class ServerState:
    # Resolved when the shutdown grace period is over: deferred drains end as `shutdown`.
    hard_stop: asyncio.Future[None]
    # Set on SIGTERM: readiness false, new requests refused.
    stopping: bool = False
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop serving requests (the one `hard_stop` belongs to), without
        asyncio.get_running_loop(): that is a getpid() system call per use on Python 3.11."""
        return self.hard_stop.get_loop()

    def enter(self) -> int:
        """One more request in flight; returns how many now are."""
        self.inflight += 1
        self.idle.clear()
        return self.inflight

    def leave(self) -> int:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()
        return self.inflight
