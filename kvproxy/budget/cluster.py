"""One in-flight budget for every kvproxy in front of the same engines, held in Redis.

Each router replica has its own kvproxy sidecar; with a per-replica budget N replicas
over-commit the engines N-fold. Here every replica takes its share from one budget kept by
Redis (an existing store, not a protocol of our own): a lease per admitted request, taken
by one atomic script (`budget_scripts.ACQUIRE`: live leases + request <= budget) and given
back when the upstream is really closed, deferred drains included (I6).

Leases expire: the holding replica renews its live leases every third of the TTL, so a
replica that dies (SIGKILL, node loss) loses its leases after the TTL and a grace period
(`budget_scripts`: a lease lapses, then is dropped), and the budget heals without an
operator. Release is idempotent. Waiters queue in Redis in strict FIFO order across
replicas (the head that does not fit blocks those behind it, as the local budget does), are
woken by a pub/sub message on every release, and otherwise re-ask at a slow pace (a dead
replica's expiry publishes nothing).

When Redis is unavailable or slow (refused, blackholed, timeouts, failover, READONLY) the
configured policy applies, logged once on the switch and once on the return, counted and
shown in `/capacity`:
    local_share  this replica enforces budget / expected replicas on its own (granted at
                 once or refused with 429: the share has no queue);
    reject       new requests get 503 `budget_unavailable` with Retry-After.
Requests already holding Redis leases keep them. A call whose reply was lost may still reach
Redis after the outage (a TCP retransmission), so the return is one fenced script
(`budget_scripts.RENEW` under a new epoch): it gives back what was released or abandoned
meanwhile, then renews (or puts back) every lease still held, before this replica admits
anything again; requests of the old epoch that arrive later are refused. The leases of the
other replicas, cut off too, lapse but stay counted until they come back and renew. So
nothing leaks or counts twice, under either policy.

Under `local_share` the replicas stay within the budget across the switch both ways: each
one's cap is its share, no more than what it holds plus an even part of the room that was
free when Redis last answered (so a replica that held more than its share leaves the others
only what was left); what it holds under Redis leases counts against the cap; when Redis
returns its local-share leases still held are registered there, and for a recovery window
it keeps the cap, since the others may still hold local-share leases Redis cannot see yet.
The cap is checked and charged with no await between (a reservation covers the Redis call),
so waiters woken together cannot all pass it.

Which of these applies when (ok, degraded, recovering; the epoch; the caps and the share
window) is `budget.machine`'s table; this module is its IO shell: it makes the calls, feeds
the machine what came of them, and performs the effects it is given.

The interface is the local `InflightBudget`'s: `acquire`, `reject_waiting`, the in-use
properties; plus `start`/`aclose` for the connection and the renewal task.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from kvproxy.budget.connection import (
    REDIS_DOWN,
    BudgetClient,
    RedisDown,
    RedisOptions,
    check_pong,
    checked,
)
from kvproxy.budget.leases import Lease
from kvproxy.budget.local import retry_after_s
from kvproxy.budget.machine import (
    ACQUIRE,
    DUTIES,
    PROBE_ANSWERED,
    RELEASES_WAITING,
    RENEWAL_DUE,
    RETURN_FAILED,
    BudgetMachine,
    Do,
    Held,
    RedisFailed,
    ReturnRegistered,
)
from kvproxy.budget.scripts import ACQUIRE as ACQUIRE_SCRIPT
from kvproxy.budget.scripts import EPOCH_TTL_MS, RELEASE, RENEW, BudgetKeys
from kvproxy.config import IMPLICIT_MODEL
from kvproxy.observe import Metrics
from kvproxy.policy import errors

log = logging.getLogger("kvproxy.budget")

# A waiter that stops asking (its replica died) leaves the cluster queue after this long.
WAITER_TTL_MS = 3000
# How often a waiter re-asks without a release message: slow, since releases wake it.
RETRY_EVERY_S = 0.5
# How long a lease given back may wait for this replica's next acquisition to carry it to
# Redis before it gets a RELEASE call of its own: under load the next acquisition comes
# sooner (one round trip per request instead of two); idle, the budget in Redis is 2 ms late.
RELEASE_DELAY_S = 0.002
# While degraded, how often Redis is probed for its return.
PROBE_EVERY_S = 1.0


def recovery_window_s(timeout_s: float) -> float:
    """How long after Redis is reachable again every replica has noticed and re-registered
    what it holds: a probe lost in the blackhole (timeout), the pause between probes, the
    probe that succeeds and the fenced renewal (a timeout each), plus one probe interval of
    slack for a loaded event loop. Both the lapse grace of leases in Redis and the local
    share's cap after a return are this long."""
    return 2 * PROBE_EVERY_S + 3 * timeout_s


class _Fenced(RedisError):
    """Redis holds a newer epoch than the call carried: its reply says nothing."""


class RedisBudget:
    """The cluster budget of one engine pool, as seen from one replica."""

    def __init__(
        self,
        max_tokens: int | None,
        max_requests: int | None,
        queue_timeout_s: float,
        queue_max_waiters: int,
        metrics: Metrics,
        options: RedisOptions,
        client: Any | None = None,
        model: str = IMPLICIT_MODEL,
    ) -> None:
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self.queue_timeout_s = queue_timeout_s
        self.queue_max_waiters = queue_max_waiters
        self.options = options
        self._metrics = metrics
        self._model = model  # the gauges' `model` label: one budget per model's pool
        self._keys = BudgetKeys.for_pool(options.key_prefix, options.pool)
        self._epoch_key = self._keys.epoch(options.replica_id)
        self._client = client if client is not None else BudgetClient(options)
        self._acquire_script = self._client.register_script(ACQUIRE_SCRIPT)
        self._release_script = self._client.register_script(RELEASE)
        self._renew_script = self._client.register_script(RENEW)
        self._ids = itertools.count(1)
        self._live: dict[str, int] = {}  # lease id -> tokens, for renewal
        self._unreleased: set[str] = set()  # to give back; Redis has not confirmed yet
        self._releasing: set[str] = set()  # of those, carried by a call on its way
        self._flush: asyncio.TimerHandle | None = None  # the pending RELEASE of the rest
        self._calls: dict[str, asyncio.Future[Any]] = {}  # acquisitions still on their way
        self._fallback_held: set[Lease] = set()
        self._tokens = 0  # held under Redis leases
        self._requests = 0
        self._fb_tokens = 0  # held under local-share leases
        self._fb_requests = 0
        self._pending_tokens = 0  # reserved by acquisitions whose Redis call is on its way
        self._pending_requests = 0
        self._waiters = 0
        self._wake = asyncio.Event()
        self._closing: str | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._stopping = False
        # The state, the epoch, the last error, the outage's caps and share window.
        self._machine = BudgetMachine(
            options.unavailable,
            max_tokens,
            max_requests,
            options.expected_replicas,
            recovery_window_s(options.timeout_s),
        )
        self.cluster_tokens = 0  # the cluster's use when Redis last answered
        self.cluster_requests = 0
        self._retry_after_s = retry_after_s(queue_timeout_s)
        metrics.budget_tokens_limit.labels(model).set(max_tokens or 0)
        metrics.budget_degraded.set(0)
        self._publish()

    # --- the interface the proxy uses -----------------------------------------------------

    @property
    def degraded(self) -> bool:
        """Redis is not (yet) the budget's authority: the policy applies."""
        return self._machine.degraded

    @property
    def last_error(self) -> str | None:
        """The type of the last Redis failure, while degraded."""
        return self._machine.last_error

    @property
    def share_tokens(self) -> int | None:
        """The policy's local share (budget / expected replicas); None: unlimited."""
        return self._machine.share_tokens

    @property
    def share_requests(self) -> int | None:
        return self._machine.share_requests

    @property
    def cap_tokens(self) -> int | None:
        """What this replica may hold during an outage and the share window after it."""
        return self._machine.cap_tokens

    @property
    def cap_requests(self) -> int | None:
        return self._machine.cap_requests

    @property
    def tokens_in_use(self) -> int:
        """Prompt tokens this replica holds (Redis leases and local-share leases)."""
        return self._tokens + self._fb_tokens

    @property
    def requests_in_use(self) -> int:
        return self._requests + self._fb_requests

    @property
    def queue_depth(self) -> int:
        return self._waiters

    @property
    def limited(self) -> bool:
        return self.max_tokens is not None or self.max_requests is not None

    def room_now(self, tokens: int) -> bool:
        """Would `acquire(tokens)` be granted without a wait, as far as this replica knows:
        nobody of its own queued, and the cluster's use when Redis last answered (or the
        outage's local share) leaves room. A guess for routing, never an admission."""
        if self._waiters:
            return False
        if self.degraded:
            return self._machine.policy != "reject" and not self._over_local_share(tokens)
        if self.max_tokens is not None and self.cluster_tokens + tokens > self.max_tokens:
            return False
        return self.max_requests is None or self.cluster_requests + 1 <= self.max_requests

    async def start(self) -> None:
        try:
            check_pong(await self._call(lambda: self._client.ping()))
        except REDIS_DOWN as exc:
            self._enter_degraded(exc)
        self._loops = [
            asyncio.ensure_future(self._renew_loop()),
            asyncio.ensure_future(self._listen_loop()),
        ]

    async def aclose(self) -> None:
        self._stopping = True
        if self._flush is not None:
            self._flush.cancel()  # what it would give back is given back below
            self._flush = None
        for task in self._loops:
            task.cancel()
        if self._loops:
            # redis-py can turn a cancellation inside a socket read into a connection error,
            # which the loops catch; the flag ends them then. Bounded either way.
            await asyncio.wait(self._loops, timeout=5)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        # Best effort, degraded or not: a release Redis confirms now is one fewer lease to
        # wait out. What fails here lapses after the TTL.
        if self._unreleased:
            with contextlib.suppress(*REDIS_DOWN):
                await self._release_ids(list(self._unreleased))
        with contextlib.suppress(*REDIS_DOWN):
            await self._client.aclose()

    async def acquire(self, tokens: int) -> Lease:
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if self.max_tokens is not None and tokens > self.max_tokens:
            raise errors.over_budget(
                self._retry_after_s,
                f"the prompt's {tokens:,} tokens can never fit the cluster in-flight budget "
                f"of {self.max_tokens:,} tokens (KVPROXY_MAX_INFLIGHT_PROMPT_TOKENS)",
            )
        started = time.monotonic()
        deadline = started + self.queue_timeout_s
        # Bounded: every turn either returns, raises, or waits out part of the deadline
        # (the recovery wait and the Redis queue both end at it).
        while True:
            (duty,) = self._machine.handle(ACQUIRE)
            if duty is Do.ASK_REDIS:
                lease = await self._redis_acquire(tokens, started, deadline)
                if lease is not None:
                    return lease
            elif duty is Do.AWAIT_RETURN:
                await self._await_recovery(deadline)
            elif duty is Do.GRANT_LOCAL_SHARE:
                return self._local_share_acquire(tokens)
            else:
                raise errors.budget_unavailable(self._retry_after_s)

    def reject_waiting(self, detail: str = "the server is shutting down") -> int:
        n = self._waiters
        self._closing = detail
        self._wake_all()
        return n

    def describe_json(self) -> dict[str, Any]:
        """For `/capacity`: never the URL or the password, only what an operator acts on."""
        o = self.options
        return {
            "backend": "redis",
            "pool": o.pool,
            "replica": o.replica_id,
            "state": "degraded" if self.degraded else "ok",
            "unavailable_policy": o.unavailable,
            "last_error": self.last_error,
            "max_tokens": self.max_tokens,
            "max_requests": self.max_requests,
            "cluster_tokens_in_use": self.cluster_tokens,
            "cluster_requests_in_use": self.cluster_requests,
            "replica_tokens_in_use": self.tokens_in_use,
            "local_share_tokens": self.share_tokens,
            "outage_cap_tokens": self.cap_tokens,
            "lease_ttl_s": o.lease_ttl_s,
            "recovery_window_s": self._machine.window_s,
            "unconfirmed_releases": len(self._unreleased),
        }

    # --- acquiring --------------------------------------------------------------------------

    async def _redis_acquire(self, tokens: int, started: float, deadline: float) -> Lease | None:
        """A lease from Redis, or None when Redis became unavailable meanwhile (the caller
        follows the state from there)."""
        if self._waiters >= self.queue_max_waiters and self.queue_timeout_s > 0:
            raise errors.over_budget(
                self._retry_after_s,
                f"{self._describe_use()}; this replica's wait queue is full "
                f"({self._waiters} of {self.queue_max_waiters} waiting)",
            )
        lease_id = f"{self.options.replica_id}:{next(self._ids)}"
        self._waiters += 1
        try:
            while True:
                if self.degraded:
                    self._abandon(lease_id)
                    return None
                wake = self._wake
                if not self._over_share(tokens) and await self._try(lease_id, tokens):
                    # No await since the call returned: the reservation becomes the charge.
                    waited = time.monotonic() - started
                    self._metrics.queue_wait.observe(waited)
                    self._live[lease_id] = tokens
                    self._tokens += tokens
                    self._requests += 1
                    return Lease(self, tokens, waited, lease_id=lease_id)
                if self._closing is not None:
                    raise errors.over_budget(self._retry_after_s, self._closing)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise errors.over_budget(
                        self._retry_after_s,
                        f"{self._describe_use()}; no room within the queue timeout of "
                        f"{self.queue_timeout_s:g} s (KVPROXY_QUEUE_TIMEOUT_S)",
                    )
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, RETRY_EVERY_S)):
                        await wake.wait()
        except RedisDown as down:
            self._enter_degraded(down.cause)
            self._abandon(lease_id)
            return None
        except BaseException:
            # Timed out, refused, or cancelled: leave the queue and give back whatever Redis
            # may have granted (an acquisition still on its way is given back when its reply
            # is in: `_try`). Both are idempotent.
            if lease_id not in self._live:
                self._abandon(lease_id)
            raise
        finally:
            self._waiters -= 1

    async def _try(self, lease_id: str, tokens: int) -> bool:
        """One ACQUIRE, with `tokens` reserved locally while it is on its way, so the share
        cap counts it before the reply is in. Cancelled mid-call, the call still completes
        (shielded, bounded by the Redis timeout) and what it granted is given back after its
        reply: a release sent now could reach Redis before the acquisition."""
        self._pending_tokens += tokens
        self._pending_requests += 1
        # Leases given back since the last call ride along (scripts.ACQUIRE forgets them
        # first): a busy replica makes one round trip per request, not two.
        forget = self._take_releases()
        call = asyncio.ensure_future(
            self._checked_call(
                "ACQUIRE",
                "iiii",
                lambda: self._acquire_script(
                    keys=[*self._keys.script_keys, self._epoch_key, self._keys.channel],
                    args=[
                        lease_id,
                        tokens,
                        -1 if self.max_tokens is None else self.max_tokens,
                        -1 if self.max_requests is None else self.max_requests,
                        int(self.options.lease_ttl_s * 1000),
                        WAITER_TTL_MS,
                        int(self._machine.window_s * 1000),
                        self._machine.epoch,
                        *forget,
                    ],
                ),
            )
        )
        if forget:
            call.add_done_callback(functools.partial(self._carried, forget))
        self._calls[lease_id] = call
        cancelled = False
        try:
            granted, used_t, used_r, dropped = await asyncio.shield(call)
        except asyncio.CancelledError:
            cancelled = True
            self._background(self._abandon_after(call, lease_id))
            raise
        except REDIS_DOWN as exc:
            raise RedisDown(exc) from exc
        finally:
            self._pending_tokens -= tokens
            self._pending_requests -= 1
            if not cancelled:
                self._calls.pop(lease_id, None)
        if int(granted) < 0:
            # Fenced: a newer epoch is recorded, so this call is from before a return that
            # has happened meanwhile. Nothing was changed; ask again in the current epoch.
            return False
        self._seen(int(used_t), int(used_r), int(dropped))
        return int(granted) == 1

    async def _abandon_after(self, call: asyncio.Future[Any], lease_id: str) -> None:
        # The call is bounded by the Redis timeout; cancelled, it is the budget closing.
        with contextlib.suppress(asyncio.CancelledError):
            try:
                await call
            except REDIS_DOWN as exc:
                # Its reply is lost: the script may still run later. A new epoch fences it.
                self._enter_degraded(exc)
        self._calls.pop(lease_id, None)
        self._abandon(lease_id)

    async def _await_recovery(self, deadline: float) -> None:
        """Wait (bounded by the deadline) while Redis's return is being registered: nothing is
        admitted on either side of the switch until it is."""
        self._waiters += 1
        try:
            if self._closing is not None:
                raise errors.over_budget(self._retry_after_s, self._closing)
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.over_budget(
                    self._retry_after_s,
                    "Redis has just come back and this replica is registering what it holds; "
                    f"not done within the queue timeout of {self.queue_timeout_s:g} s",
                )
            wake = self._wake
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, RETRY_EVERY_S)):
                    await wake.wait()
        finally:
            self._waiters -= 1

    def _local_share_acquire(self, tokens: int) -> Lease:
        """The local_share policy while Redis is unavailable; synchronous, so checked and
        charged at once."""
        if self._over_local_share(tokens):
            # What this replica still holds under Redis leases counts against its share: the
            # shares must add up to the budget, outage or not.
            raise errors.over_budget(
                self._retry_after_s,
                f"Redis is unavailable; this replica's part of the budget "
                f"({self._describe_share()}) is in use ({self.tokens_in_use:,} tokens, "
                f"{self.requests_in_use} requests held)",
            )
        self._fb_tokens += tokens
        self._fb_requests += 1
        self._metrics.queue_wait.observe(0.0)
        # Granted at once or refused: the local share has no queue.
        lease = Lease(self, tokens, local=True)
        self._fallback_held.add(lease)
        return lease

    def _over_local_share(self, tokens: int) -> bool:
        """Would `tokens` more take this replica past its outage cap? Counts every lease it
        holds and every acquisition on its way to Redis."""
        return self._machine.over_cap(
            tokens,
            self.tokens_in_use + self._pending_tokens,
            self.requests_in_use + self._pending_requests,
        )

    def _over_share(self, tokens: int) -> bool:
        """Right after an outage (local_share): would `tokens` more take this replica past
        its share?"""
        return self._machine.over_share(
            time.monotonic(),
            tokens,
            self.tokens_in_use + self._pending_tokens,
            self.requests_in_use + self._pending_requests,
        )

    # --- giving back ----------------------------------------------------------------------

    def give_back(self, lease: Lease) -> None:
        """LeaseOwner: a lease of the cluster budget, or of the local share."""
        if lease.local:
            self._fallback_released(lease)
        else:
            self._release(lease)

    def _release(self, lease: Lease) -> None:
        assert lease.id is not None  # Redis named it when it lent it
        self._live.pop(lease.id, None)
        self._tokens -= lease.tokens
        self._requests -= 1
        self._abandon(lease.id)
        self._wake_all()  # our own waiters need no round trip through pub/sub

    def _fallback_released(self, lease: Lease) -> None:
        self._fallback_held.discard(lease)
        self._fb_tokens -= lease.tokens
        self._fb_requests -= 1
        if lease.id is not None:  # Redis has counted it since it came back
            self._live.pop(lease.id, None)
            self._abandon(lease.id)
        self._wake_all()

    def _abandon(self, lease_id: str) -> None:
        """Give back `lease_id` in Redis (out of the queue, out of the budget): with this
        replica's next acquisition, or by one RELEASE of everything given back meanwhile at
        most RELEASE_DELAY_S later, if Redis is the authority; else with the fenced return.
        An acquisition still on its way is given back once its reply is in
        (`_abandon_after`). Until Redis has it, the lease stays counted there: late, never
        early, so the budget is never over-committed."""
        if lease_id in self._calls:
            return
        self._unreleased.add(lease_id)
        self._flush_soon()

    def _flush_soon(self) -> None:
        """One RELEASE of what was given back, at most RELEASE_DELAY_S from now, if Redis is
        the authority (else the fenced return gives them back)."""
        if self._flush is None and not self._stopping and self._releases_go_to_redis():
            loop = asyncio.get_running_loop()
            self._flush = loop.call_later(RELEASE_DELAY_S, self._flush_releases)

    def _releases_go_to_redis(self) -> bool:
        (duty,) = self._machine.handle(RELEASES_WAITING)
        return duty is Do.SEND_RELEASES

    def _flush_releases(self) -> None:
        self._flush = None
        if not self._releases_go_to_redis():
            return
        ids = self._take_releases()
        if ids:
            self._background(self._release_carried(ids))

    def _take_releases(self) -> list[str]:
        """The leases given back that no call carries yet, now marked as carried."""
        ids = [i for i in self._unreleased if i not in self._releasing]
        self._releasing.update(ids)
        return ids

    def _carried(self, ids: list[str], call: asyncio.Future[Any]) -> None:
        """An acquisition that carried `ids` is done: Redis forgot them if it answered
        (fenced or not: they go before the fence), else they wait for the next call."""
        self._releasing.difference_update(ids)
        if not call.cancelled() and call.exception() is None:
            self._unreleased.difference_update(ids)
        else:
            self._flush_soon()

    async def _release_carried(self, ids: list[str]) -> None:
        try:
            await self._release_quietly(ids)
        finally:
            self._releasing.difference_update(ids)

    async def _release_quietly(self, ids: list[str]) -> None:
        try:
            await self._release_ids(ids)
        except REDIS_DOWN as exc:
            # Kept in _unreleased and given back by the fenced return; until then the lease
            # stays counted in Redis (it is no longer renewed, so it lapses at worst).
            self._enter_degraded(exc)

    async def _release_ids(self, ids: list[str]) -> None:
        keys = [*self._keys.script_keys, self._keys.channel]
        _, used_t, used_r = await self._checked_call(
            "RELEASE", "iii", lambda: self._release_script(keys=keys, args=ids)
        )
        self._unreleased.difference_update(ids)
        self._seen(int(used_t), int(used_r), 0)

    # --- Redis calls ------------------------------------------------------------------------

    async def _call(self, make: Callable[[], Awaitable[Any]]) -> Any:
        """One Redis call under the deadline. A connection Redis closed (a restart, a
        failover) fails the first call made on it: that call is made once more on a fresh
        connection, which is safe because every script is idempotent per lease id and a
        closed connection delivers nothing later."""
        started = time.perf_counter()
        async with asyncio.timeout(self.options.timeout_s):
            try:
                result = await make()
            except RedisConnectionError:
                result = await make()
        self._metrics.budget_redis_rtt.observe(time.perf_counter() - started)
        return result

    async def _checked_call(
        self, name: str, shape: str, make: Callable[[], Awaitable[Any]]
    ) -> list[Any]:
        """A script call whose reply is validated (connection.checked); else BadReply, a
        RedisError: Redis unavailable under the configured policy."""
        return checked(await self._call(make), name, shape)

    async def _renew(self) -> None:
        """Renewal, and the return from an outage: one fenced script under the current epoch
        gives back what was released or abandoned, then renews or puts back the live
        leases (budget_scripts.RENEW)."""
        forget = list(self._unreleased)
        args: list[Any] = [
            int(self.options.lease_ttl_s * 1000),
            int(self._machine.window_s * 1000),
            self._machine.epoch,
            EPOCH_TTL_MS,
            len(forget),
            *forget,
        ]
        for lease_id, tokens in list(self._live.items()):
            args += [lease_id, tokens]
        keys = [*self._keys.script_keys, self._epoch_key, self._keys.channel]
        renewed, used_t, used_r, dropped, put_back, reclaimed = await self._checked_call(
            "RENEW", "iiiili", lambda: self._renew_script(keys=keys, args=args)
        )
        if int(renewed) < 0:
            raise _Fenced("a newer epoch of this replica is recorded")
        self._unreleased.difference_update(forget)
        self._metrics.budget_lease_renewals.inc(int(renewed))
        self._seen(int(used_t), int(used_r), int(dropped))
        lost = int(reclaimed)
        for raw in put_back:
            lease_id = raw.decode() if isinstance(raw, bytes) else str(raw)
            if lease_id in self._live:
                lost += 1
            else:
                # Released on another connection while the renewal was on its way: Redis had
                # already dropped it and the renewal put it back. Give it back again.
                self._abandon(lease_id)
        if lost:
            self._metrics.budget_leases_reasserted.inc(lost)
            log.warning("budget: took back %d live leases Redis had lapsed or lost", lost)

    # --- background loops -----------------------------------------------------------------

    async def _renew_loop(self) -> None:
        every = max(0.05, self.options.lease_ttl_s / 3)
        while not self._stopping:
            await asyncio.sleep(PROBE_EVERY_S if self.degraded else every)
            try:
                duty = self._apply(self._machine.handle(RENEWAL_DUE))
                while duty is not None:
                    duty = await self._perform(duty)
            except REDIS_DOWN as exc:
                self._enter_degraded(exc)

    async def _perform(self, duty: Do) -> Do | None:
        """One call the machine asked for; what came of it goes back to the machine, whose
        next duty (if any) is returned."""
        if duty is Do.RENEW:
            await self._renew()
            return None
        if duty is Do.PROBE:
            check_pong(await self._call(lambda: self._client.ping()))
            return self._apply(self._machine.handle(PROBE_ANSWERED))
        assert duty is Do.RUN_RETURN
        # Redis answers again: under the new epoch (so what the outage delayed is fenced),
        # give back, renew and register everything this replica holds, and only then admit.
        try:
            await self._renew()
        except BaseException:
            self._apply(self._machine.handle(RETURN_FAILED))
            raise
        return self._apply(self._machine.handle(ReturnRegistered(time.monotonic())))

    async def _listen_loop(self) -> None:
        while not self._stopping:
            try:
                async with self._client.pubsub() as ps:
                    await self._call(lambda: ps.subscribe(self._keys.channel))
                    while not self._stopping:
                        msg = await ps.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if msg is not None:
                            self._wake_all()
            except REDIS_DOWN:
                # The renewal loop owns the degraded state; this one only retries slowly.
                await asyncio.sleep(PROBE_EVERY_S)

    # --- bookkeeping ------------------------------------------------------------------------

    def _enter_degraded(self, exc: BaseException) -> None:
        held = Held(self._tokens, self._requests, self.cluster_tokens, self.cluster_requests)
        self._apply(self._machine.handle(RedisFailed(type(exc).__name__, held)))

    def _apply(self, effects: tuple[Do, ...]) -> Do | None:
        """Perform the machine's synchronous effects, in order (no await between them);
        return the duty that ends the row, if any."""
        for do in effects:
            if do is Do.WAKE_ALL:
                self._wake_all()
            elif do is Do.ANNOUNCE_OUTAGE:
                self._metrics.budget_degraded.set(1)
                self._metrics.budget_fallbacks.labels(self.options.unavailable).inc()
                log.warning(
                    "budget: Redis unavailable (%s); policy %s applies until it returns",
                    self.last_error,
                    self.options.unavailable,
                )
            elif do is Do.ANNOUNCE_RETURN:
                self._metrics.budget_degraded.set(0)
                log.warning("budget: Redis is back; the cluster budget applies again")
            elif do is Do.REGISTER_LOCAL_LEASES:
                # Local-share leases still held join the cluster budget (the return puts them
                # in), or the other replicas would hand their tokens out a second time.
                for held in self._fallback_held:
                    if held.id is None:
                        held.id = f"{self.options.replica_id}:{next(self._ids)}"
                        self._live[held.id] = held.tokens
            elif do is Do.SEND_UNRELEASED:
                if self._unreleased:  # given back while the return was on its way
                    self._background(self._release_quietly(list(self._unreleased)))
            else:
                assert do in DUTIES, do  # an effect of the table this shell does not know
                return do
        return None

    def _seen(self, used_tokens: int, used_requests: int, dropped: int) -> None:
        self.cluster_tokens = used_tokens
        self.cluster_requests = used_requests
        self._metrics.budget_cluster_tokens.labels(self._model).set(used_tokens)
        if dropped:
            self._metrics.budget_lease_expiries.inc(dropped)

    def _wake_all(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _describe_share(self) -> str:
        parts = []
        if self.cap_tokens is not None:
            parts.append(f"{self.cap_tokens:,} tokens")
        if self.cap_requests is not None:
            parts.append(f"{self.cap_requests} requests")
        return ", ".join(parts) or "unlimited"

    def _describe_use(self) -> str:
        parts = []
        if self.max_tokens is not None:
            parts.append(
                f"{self.cluster_tokens:,} of {self.max_tokens:,} prompt tokens in flight "
                "across replicas"
            )
        if self.max_requests is not None:
            parts.append(f"{self.cluster_requests} of {self.max_requests} requests in flight")
        return ", ".join(parts) or "budget full"

    def _publish(self) -> None:
        # Read when Prometheus scrapes (as the local budget does), not written per request.
        self._metrics.budget_tokens_in_use.labels(self._model).set_function(
            lambda: self.tokens_in_use
        )
        self._metrics.queue_depth.labels(self._model).set_function(lambda: self.queue_depth)
