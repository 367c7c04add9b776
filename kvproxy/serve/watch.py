"""Background watchers owned by the server: client disconnects and event-loop lag.

Why a disconnect watcher: aiohttp does not cancel a handler when its client leaves (we rely on
that, I5) and offers no supported "wait for disconnect" API; the only signal is that the
request's transport becomes None or closing. A failed write notices it too, but during a long
prefill nothing is written for minutes, and the deferral clock (I5) must start when the client
actually left. One shared ticker checks every registered request, so the cost is one timer
wake-up per tick for the whole process rather than one per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

from aiohttp import web

from kvproxy.observe import Metrics

DISCONNECT_TICK_S = 0.05
LAG_TICK_S = 0.05


class _Background:
    """One long-running task with an explicit start and stop."""

    name = "background"

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None
        # Kept while running: asyncio.get_running_loop() is a getpid() system call per use on
        # Python 3.11, and the disconnect watcher is asked once per request.
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._loop = None

    async def _run(self) -> None:
        raise NotImplementedError


class DisconnectWatcher(_Background):
    name = "disconnect-watch"

    def __init__(self, tick_s: float = DISCONNECT_TICK_S) -> None:
        super().__init__()
        self._tick_s = tick_s
        # Keyed by id(): requests are mutable mappings, hence unhashable.
        self._watched: dict[int, tuple[web.BaseRequest, asyncio.Future[None]]] = {}

    def watch(self, request: web.BaseRequest) -> asyncio.Future[None]:
        """A future resolved when the client's connection is gone."""
        fut: asyncio.Future[None] = (self._loop or asyncio.get_running_loop()).create_future()
        if _gone(request):
            fut.set_result(None)
        else:
            self._watched[id(request)] = (request, fut)
        return fut

    def unwatch(self, request: web.BaseRequest) -> None:
        entry = self._watched.pop(id(request), None)
        if entry is not None and not entry[1].done():
            entry[1].cancel()

    def forget(self, request: web.BaseRequest) -> None:
        """Stop watching without resolving the future: for a caller that no longer races
        the client's departure (a relay past its safe point finds it at its next write).
        Every watched request costs a check per tick, 20 a second: thousands of open
        streams made the scan a per-event cost of its own (bench/streams.py)."""
        self._watched.pop(id(request), None)

    @property
    def watched(self) -> int:
        return len(self._watched)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            if not self._watched:
                continue
            gone = [key for key, (r, _) in self._watched.items() if _gone(r)]
            for key in gone:
                _, fut = self._watched.pop(key)
                if not fut.done():
                    fut.set_result(None)


def _gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def settle_heap() -> int:
    """Collect what start-up left behind, then freeze what survives (gc.freeze); returns the
    number of frozen objects.

    Why: a full collection walks every tracked object and runs the finalisers of whatever it
    frees, on the loop's thread. Dropping a tokenizer (a counter built and discarded while
    starting) costs ~22 ms here, and a full collection of a served process's heap (tokenizer,
    compiled templates, settings: ~52 k objects) ~5.6 ms. Objects alive when serving starts
    live as long as the process, so they leave the collector's reach; later collections
    cost what requests allocate, not what the process holds.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release_heap() -> None:
    """Undo `settle_heap` when serving stops: what was frozen is collectable again, so a
    process that starts and stops servers (the tests, `kvproxy demo`) does not keep the
    cycles of every stopped one."""
    gc.unfreeze()


class LoopLagMonitor(_Background):
    """Measures how late a timer fires: any stall of the loop (a GIL-holding tokenizer call,
    a big synchronous parse) shows up here. Tests and benchmarks assert on `max_lag_s`."""

    name = "loop-lag"

    def __init__(self, metrics: Metrics, tick_s: float = LAG_TICK_S) -> None:
        super().__init__()
        self._metrics = metrics
        self._tick_s = tick_s
        self.max_lag_s = 0.0
        self.samples = 0

    def reset_max(self) -> None:
        self.max_lag_s = 0.0

    async def _run(self) -> None:
        hist = self._metrics.event_loop_lag
        gauge = self._metrics.event_loop_lag_max
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self._tick_s)
            lag = max(0.0, time.perf_counter() - t0 - self._tick_s)
            hist.observe(lag)
            self.samples += 1
            if lag > self.max_lag_s:
                self.max_lag_s = lag
                gauge.set(lag)
