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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

from kvproxy.config import Settings
from kvproxy.observe import Metrics
from kvproxy.policy import admission
from kvproxy.serve.watch import DisconnectWatcher, LoopLagMonitor

if TYPE_CHECKING:
    from kvproxy.policy import RouteTable, TenantResolver
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
    # The admission policy the settings name (decode_policy, default_output_tokens), built
    # once: every counted request decides with it, and reading two settings fields per use
    # went through pydantic's __getattr__ hook.
    policy: admission.Policy
    # The pass-through routes' table (settings.passthrough_routes), parsed once: every
    # request is classified against it.
    routes: RouteTable


class HardStop:
    """The end of the shutdown grace period, which deferred drains race against: a future
    for whoever awaits it, and a set of wake-ups for the relay's racing waits.

    A wait registers its wake-up here (a set: O(1) in and out), not as a done-callback on
    one future every in-flight request shares: removing a done-callback scans all of them,
    and adding and removing one per request was ~0.8% of a small chat's instructions."""

    __slots__ = ("future", "wakers")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.future: asyncio.Future[None] = loop.create_future()
        self.wakers: set[Callable[[], None]] = set()

    def done(self) -> bool:
        return self.future.done()

    def fire(self) -> None:
        """Resolve it and wake every racing wait (once; later calls do nothing)."""
        if self.future.done():
            return
        self.future.set_result(None)
        for wake in list(self.wakers):
            wake()


@dataclass
class ServerState:
    # Fired when the shutdown grace period is over: deferred drains end as `shutdown`.
    hard_stop: HardStop
    # Set on SIGTERM: readiness false, new requests refused.
    stopping: bool = False
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop serving requests (the one `hard_stop` belongs to), without
        asyncio.get_running_loop(): that is a getpid() system call per use on Python 3.11."""
        return self.hard_stop.future.get_loop()

    def enter(self) -> int:
        """One more request in flight; returns how many now are."""
        self.inflight += 1
        if self.inflight == 1:
            # Set only when the count reaches 0 (`leave`): clear on the way out of it, not
            # per request (a Python call each).
            self.idle.clear()
        return self.inflight

    def leave(self) -> int:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()
        return self.inflight
