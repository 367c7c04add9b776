"""Overload shedding: what kvproxy refuses at the door, so that a burst costs requests an
explicit 503 `overloaded` and never costs the process (a crash, an fd it cannot open for an
upstream it already admitted, or the OOM killer).

Two resources, each bounded before the request's body is read:

    connections     public connections open at once. Decided when a connection is accepted
                    (`ConnectionGate.opened`): past `limit` its first request is answered
                    503 `overloaded` with `Connection: close` without reading its body; past
                    `limit + reserve/2` it is dropped at once (a reset, no fd spent on a
                    reply). The limit is `max_connections`, or derived from the process's
                    soft RLIMIT_NOFILE: each public connection may need one upstream
                    connection, and FD_RESERVE descriptors are kept for everything else.
                    Before shedding, the longest idle connection (kept alive after a
                    request, or never sent a byte) is closed to let the new one in, as
                    nginx reuses its idle keep-alive connections under pressure
                    (`close_idle`).
    body memory     bytes of request bodies being read or counted at once
                    (`BodyMemoryGate`, `max_body_memory_bytes`). A body reserves its
                    Content-Length (or `max_body_bytes` when it has none: chunked) before
                    it is read, shrinks the reservation to what arrived, and gives it back
                    once it was counted. Reading and counting is where a body's memory
                    multiplies (the JSON parse, the chat render, the tokenizer's encoding),
                    so bounding it there keeps 16 concurrent 4 MB prompts from meeting the
                    OOM killer: the ones that do not fit wait, first come first served, up
                    to `body_memory_wait_s`, then get 503 `overloaded`.

Sans-IO apart from the futures waiters sleep on; never reads or logs a body (I8).
"""

from __future__ import annotations

import asyncio
import collections
import resource
from collections.abc import Callable

# Descriptors kept apart from the public/upstream pairs: the listening and admin sockets,
# the event loop's own, logs, the engines' probes, Redis, the tokenizer's files, metrics
# scrapes. An idle `kvproxy serve` holds about 20 (measured with /proc/PID/fd on this
# machine: tests/faults/ reads it); 64 leaves room for the probes of a few dozen engines.
FD_RESERVE = 64
# The (resource, action) series of kvproxy_overload_shed_total, created at start at zero.
SHED_SERIES = (
    ("connections", "reply"),
    ("connections", "drop"),
    ("connections", "close_idle"),
    ("body_memory", "reply"),
)


def derived_connection_limit(reserve: int = FD_RESERVE) -> int:
    """The public connections this process can hold with an upstream connection each and
    `reserve` descriptors to spare, from its soft fd limit (at least 1)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(1, (soft - reserve) // 2)


class ConnectionGate:
    """Counts the public connections and decides, when one is accepted, whether it is
    served, answered 503 (`shed`), or dropped."""

    __slots__ = ("drop_above", "idle", "limit", "open", "reclaimed", "shed_total")

    def __init__(self, limit: int, reserve: int = FD_RESERVE) -> None:
        self.limit = limit
        # Past this the reply itself is a cost the process cannot afford: drop at accept.
        self.drop_above = limit + max(1, reserve // 2)
        self.open = 0
        self.shed_total = 0
        self.reclaimed = 0
        # Idle connections, the longest idle first (a dict keeps insertion order): each
        # value closes that connection.
        self.idle: dict[object, Callable[[], None]] = {}

    def opened(self) -> str:
        """A connection was accepted: "serve", "shed" (answer 503) or "drop". At the limit,
        the longest idle connection is closed first and the new one served."""
        if self.open >= self.limit and self.idle:
            conn = next(iter(self.idle))
            close = self.idle.pop(conn)
            self.open -= 1  # its close is counted now (`close` must not count it again)
            self.reclaimed += 1
            close()
        self.open += 1
        if self.open <= self.limit:
            return "serve"
        self.shed_total += 1
        return "shed" if self.open <= self.drop_above else "drop"

    def went_idle(self, conn: object, close: Callable[[], None]) -> None:
        self.idle.pop(conn, None)
        self.idle[conn] = close  # to the end: the most recently idle

    def busy(self, conn: object) -> None:
        self.idle.pop(conn, None)

    def closed(self, conn: object = None) -> None:
        self.idle.pop(conn, None)
        self.open -= 1


class BodyMemoryGate:
    """A byte budget for request bodies being read or counted; waiters are served in
    arrival order (a large body is not starved by a stream of small ones)."""

    __slots__ = ("_waiters", "in_use", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_take(self, n: int) -> bool:
        """Take `n` bytes now if they fit and nobody waits before us."""
        if not self._waiters and self.in_use + n <= self.limit:
            self.in_use += n
            return True
        return False

    async def take(self, n: int, wait_s: float) -> bool:
        """Take `n` bytes, waiting at most `wait_s`; False when they did not come in time.
        `n` must not exceed `limit` (Settings validates max_body_bytes <= the limit)."""
        if self.try_take(n):
            return True
        if wait_s <= 0:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(wait_s):
                await fut
            return True
        except TimeoutError:
            # Granted in the same tick the timer fired: keep it.
            return fut.done() and not fut.cancelled()
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
                self._wake()  # the head may have been us: let the next one try

    def give(self, n: int) -> None:
        self.in_use -= n
        self._wake()

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters:
            n, fut = waiters[0]
            if fut.done():
                waiters.popleft()
                continue
            if self.in_use + n > self.limit:
                return
            waiters.popleft()
            self.in_use += n
            fut.set_result(None)


class BodyReservation:
    """One request's share of the body-memory budget; given back once (idempotent)."""

    __slots__ = ("_gate", "bytes")

    def __init__(self, gate: BodyMemoryGate, n: int) -> None:
        self._gate: BodyMemoryGate | None = gate
        self.bytes = n

    def shrink_to(self, n: int) -> None:
        """The body turned out smaller than reserved (a chunked one): give back the rest."""
        gate = self._gate
        if gate is not None and n < self.bytes:
            gate.give(self.bytes - n)
            self.bytes = n

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.give(self.bytes)
