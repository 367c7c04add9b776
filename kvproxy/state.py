"""The server's shared state: one explicit object instead of module globals (uvicorn's
`ServerState` lesson). The app builds it at start; handlers read it; nothing else owns it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

from kvproxy.config import Settings
from kvproxy.metrics import Metrics
from kvproxy.watch import DisconnectWatcher, LoopLagMonitor

if TYPE_CHECKING:
    from kvproxy.canary import CanaryRules
    from kvproxy.models import ModelTable
    from kvproxy.tenants import TenantResolver


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics
    session: aiohttp.ClientSession
    watcher: DisconnectWatcher
    lag: LoopLagMonitor
    tenants: TenantResolver
    canaries: CanaryRules
    # Resolved when the shutdown grace period is over: deferred drains end as `shutdown`.
    hard_stop: asyncio.Future[None]
    # Every model's capacity, counter and budget (`models.first` is the single model's).
    models: ModelTable
    # Set on SIGTERM: readiness false, new requests refused.
    stopping: bool = False
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def enter(self) -> None:
        self.inflight += 1
        self.idle.clear()
        self.metrics.inflight.set(self.inflight)

    def leave(self) -> None:
        self.inflight -= 1
        self.metrics.inflight.set(self.inflight)
        if self.inflight == 0:
            self.idle.set()
