"""One in-flight budget for every kvproxy in front of the same engines, held in Redis.

Each router replica has its own kvproxy sidecar; with a per-replica budget N replicas
over-commit the engines N-fold. Here every replica takes its share from one budget kept by
Redis (an existing store, not a protocol of our own): a lease per admitted request, taken
by one atomic script (`budget_scripts.ACQUIRE`: live leases + request <= budget) and given
back when the upstream is really closed, deferred drains included (I6).

Leases expire: the holding replica renews its live leases every third of the TTL, so a
replica that dies (SIGKILL, node loss) loses its leases after the TTL and the budget heals
without an operator. Release is idempotent. Waiters queue in Redis in strict FIFO order
across replicas (the head that does not fit blocks those behind it, as the local budget
does), are woken by a pub/sub message on every release, and otherwise re-ask at a slow
pace (a dead replica's expiry publishes nothing).

When Redis is unavailable or slow (refused, timeouts, failover, READONLY) the configured
policy applies, logged once on the switch and once on the return, counted and shown in
`/capacity`:
    local_share  this replica enforces budget / expected replicas on its own;
    reject       new requests get 503 `budget_unavailable` with Retry-After.
Requests already holding Redis leases keep them; their releases are kept and replayed when
Redis returns, and live leases that Redis lost are put back, so nothing leaks or counts twice.
Under `local_share` the shares add up to the budget across the switch both ways: what a
replica holds under Redis leases counts against its share during the outage; when Redis
returns, its local-share leases still held are registered there, and for a few seconds it
keeps its share as a cap, while the other replicas notice the return and register theirs.

The interface is the local `InflightBudget`'s: `acquire`, `reject_waiting`, the in-use
properties; plus `start`/`aclose` for the connection and the renewal task.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from kvproxy.budget.connection import REDIS_DOWN, RedisDown, RedisOptions, make_client
from kvproxy.budget.leases import FallbackLease, RedisLease
from kvproxy.budget.local import InflightBudget, retry_after_s
from kvproxy.budget.scripts import ACQUIRE, LEAVE_QUEUE, RELEASE, RENEW, BudgetKeys
from kvproxy.config import IMPLICIT_MODEL
from kvproxy.observe import Metrics
from kvproxy.policy import errors

log = logging.getLogger("kvproxy.budget")

# A waiter that stops asking (its replica died) leaves the cluster queue after this long.
WAITER_TTL_MS = 3000
# How often a waiter re-asks without a release message: slow, since releases wake it.
RETRY_EVERY_S = 0.5
# While degraded, how often Redis is probed for its return.
PROBE_EVERY_S = 1.0
# After Redis returns, a local_share replica keeps its share as a cap for this long: other
# replicas may still be degraded, holding local-share leases Redis cannot see yet (they
# register them when they notice Redis is back, within a probe interval or two).
RECOVERY_GRACE_S = 3 * PROBE_EVERY_S


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
        self._client = client if client is not None else make_client(options)
        self._acquire = self._client.register_script(ACQUIRE)
        self._leave = self._client.register_script(LEAVE_QUEUE)
        self._release_script = self._client.register_script(RELEASE)
        self._renew = self._client.register_script(RENEW)
        self._ids = itertools.count(1)
        self._live: dict[str, int] = {}  # lease id -> tokens, for renewal
        self._unreleased: set[str] = set()  # releases Redis has not confirmed yet
        self._fallback_held: set[FallbackLease] = set()
        self._share_until = 0.0  # monotonic time the post-outage share cap ends
        self._tokens = 0
        self._requests = 0
        self._waiters = 0
        self._wake = asyncio.Event()
        self._closing: str | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._stopping = False
        self.degraded = False
        self.last_error: str | None = None
        self.cluster_tokens = 0
        self.cluster_requests = 0
        share = max(1, options.expected_replicas)
        # The policy's local share: an unlimited dimension stays unlimited.
        self._fallback = InflightBudget(
            max_tokens=None if max_tokens is None else max(1, max_tokens // share),
            max_requests=None if max_requests is None else max(1, max_requests // share),
            queue_timeout_s=queue_timeout_s,
            queue_max_waiters=queue_max_waiters,
            metrics=Metrics(),  # its own, unexported: this budget publishes the totals
        )
        self._retry_after_s = retry_after_s(queue_timeout_s)
        metrics.budget_tokens_limit.labels(model).set(max_tokens or 0)
        metrics.budget_degraded.set(0)
        self._publish()

    # --- the interface the proxy uses -----------------------------------------------------

    @property
    def tokens_in_use(self) -> int:
        """Prompt tokens this replica holds (Redis leases and local-share leases)."""
        return self._tokens + self._fallback.tokens_in_use

    @property
    def requests_in_use(self) -> int:
        return self._requests + self._fallback.requests_in_use

    @property
    def queue_depth(self) -> int:
        return self._waiters + self._fallback.queue_depth

    @property
    def limited(self) -> bool:
        return self.max_tokens is not None or self.max_requests is not None

    async def start(self) -> None:
        try:
            await self._call(lambda: self._client.ping())
        except REDIS_DOWN as exc:
            self._enter_degraded(exc)
        self._loops = [
            asyncio.ensure_future(self._renew_loop()),
            asyncio.ensure_future(self._listen_loop()),
        ]

    async def aclose(self) -> None:
        self._stopping = True
        for task in self._loops:
            task.cancel()
        if self._loops:
            # redis-py can turn a cancellation inside a socket read into a connection error,
            # which the loops catch; the flag ends them then. Bounded either way.
            await asyncio.wait(self._loops, timeout=5)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        # Best effort, degraded or not: a release Redis confirms now is one fewer lease to
        # wait out. What fails here expires after the TTL.
        for lease_id in list(self._unreleased):
            with contextlib.suppress(*REDIS_DOWN):
                await self._remote_release(lease_id)
        with contextlib.suppress(*REDIS_DOWN):
            await self._client.aclose()

    async def acquire(self, tokens: int) -> RedisLease | FallbackLease:
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if self.max_tokens is not None and tokens > self.max_tokens:
            raise errors.over_budget(
                self._retry_after_s,
                f"the prompt's {tokens:,} tokens can never fit the cluster in-flight budget "
                f"of {self.max_tokens:,} tokens (KVPROXY_MAX_INFLIGHT_PROMPT_TOKENS)",
            )
        if self.degraded:
            return await self._degraded_acquire(tokens)
        if self._waiters >= self.queue_max_waiters and self.queue_timeout_s > 0:
            raise errors.over_budget(
                self._retry_after_s,
                f"{self._describe_use()}; this replica's wait queue is full "
                f"({self._waiters} of {self.queue_max_waiters} waiting)",
            )
        lease_id = f"{self.options.replica_id}:{next(self._ids)}"
        started = time.monotonic()
        deadline = started + self.queue_timeout_s
        self._waiters += 1
        try:
            while True:
                wake = self._wake
                if not self._over_share(tokens) and await self._try(lease_id, tokens):
                    waited = time.monotonic() - started
                    self._metrics.queue_wait.observe(waited)
                    self._live[lease_id] = tokens
                    self._tokens += tokens
                    self._requests += 1
                    return RedisLease(self, lease_id, tokens, waited)
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
            self._background(self._forget(lease_id))
            return await self._degraded_acquire(tokens)
        except BaseException:
            # Timed out, refused, or cancelled (perhaps mid-call, after Redis granted): leave
            # the queue and give back whatever Redis may have granted. Both are idempotent.
            if lease_id not in self._live:
                self._background(self._forget(lease_id))
            raise
        finally:
            self._waiters -= 1

    def reject_waiting(self, detail: str = "the server is shutting down") -> int:
        n = self._waiters + self._fallback.reject_waiting(detail)
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
            "local_share_tokens": self._fallback.max_tokens,
            "lease_ttl_s": o.lease_ttl_s,
            "unconfirmed_releases": len(self._unreleased),
        }

    # --- Redis calls ------------------------------------------------------------------------

    async def _call(self, make: Callable[[], Awaitable[Any]]) -> Any:
        """One Redis call under the deadline. A connection Redis closed (a restart, a
        failover) fails the first call made on it: that call is made once more on a fresh
        connection, which is safe because every script is idempotent per lease id."""
        started = time.perf_counter()
        async with asyncio.timeout(self.options.timeout_s):
            try:
                result = await make()
            except RedisConnectionError:
                result = await make()
        self._metrics.budget_redis_rtt.observe(time.perf_counter() - started)
        return result

    def _script_args(self, *argv: Any) -> dict[str, Any]:
        return {"keys": self._keys.script_keys, "args": list(argv)}

    async def _try(self, lease_id: str, tokens: int) -> bool:
        try:
            granted, used_t, used_r, expired = await self._call(
                lambda: self._acquire(
                    **self._script_args(
                        lease_id,
                        tokens,
                        -1 if self.max_tokens is None else self.max_tokens,
                        -1 if self.max_requests is None else self.max_requests,
                        int(self.options.lease_ttl_s * 1000),
                        WAITER_TTL_MS,
                    )
                )
            )
        except REDIS_DOWN as exc:
            raise RedisDown(exc) from exc
        self._seen(int(used_t), int(used_r), int(expired))
        return bool(granted)

    async def _forget(self, lease_id: str) -> None:
        with contextlib.suppress(*REDIS_DOWN):
            await self._call(lambda: self._leave(**self._script_args(lease_id)))
            await self._remote_release(lease_id)

    async def _remote_release(self, lease_id: str) -> None:
        keys = [*self._keys.script_keys, self._keys.channel]
        await self._call(lambda: self._release_script(keys=keys, args=[lease_id]))
        self._unreleased.discard(lease_id)

    def _release(self, lease: RedisLease) -> None:
        self._live.pop(lease.id, None)
        self._tokens -= lease.tokens
        self._requests -= 1
        self._unreleased.add(lease.id)
        self._wake_all()  # our own waiters need no round trip through pub/sub
        if not self.degraded:
            self._background(self._release_quietly(lease.id))

    async def _release_quietly(self, lease_id: str) -> None:
        try:
            await self._remote_release(lease_id)
        except REDIS_DOWN as exc:
            # Kept in _unreleased and replayed when Redis returns; until then the lease
            # stays counted in Redis (it is no longer renewed, so it expires at worst).
            self._enter_degraded(exc)

    # --- background loops -----------------------------------------------------------------

    async def _renew_loop(self) -> None:
        every = max(0.05, self.options.lease_ttl_s / 3)
        while not self._stopping:
            await asyncio.sleep(PROBE_EVERY_S if self.degraded else every)
            try:
                if self.degraded:
                    await self._call(lambda: self._client.ping())
                    await self._recover()
                else:
                    await self._renew_live()
            except REDIS_DOWN as exc:
                self._enter_degraded(exc)

    async def _renew_live(self) -> None:
        args: list[Any] = [int(self.options.lease_ttl_s * 1000)]
        for lease_id, tokens in list(self._live.items()):
            args += [lease_id, tokens]
        renewed, used_t, used_r, expired, put_back = await self._call(
            lambda: self._renew(keys=self._keys.script_keys, args=args)
        )
        self._metrics.budget_lease_renewals.inc(int(renewed))
        self._seen(int(used_t), int(used_r), int(expired))
        lost = 0
        for raw in put_back:
            lease_id = raw.decode() if isinstance(raw, bytes) else str(raw)
            if lease_id in self._live:
                lost += 1
            else:
                # Released while the renewal was on its way: Redis had already dropped it,
                # and the renewal put it back. Give it back again (release is idempotent).
                self._unreleased.add(lease_id)
                await self._remote_release(lease_id)
        if lost:
            self._metrics.budget_leases_reasserted.inc(lost)
            log.warning("budget: put back %d live leases Redis had lost", lost)

    async def _recover(self) -> None:
        # Releases first, so a lease given back during the outage is not put back.
        for lease_id in list(self._unreleased):
            await self._remote_release(lease_id)
        # Local-share leases still held join the cluster budget (the renewal puts them in),
        # or the other replicas would hand their tokens out a second time.
        for held in self._fallback_held:
            if held.redis_id is None:
                held.redis_id = f"{self.options.replica_id}:{next(self._ids)}"
                self._live[held.redis_id] = held.tokens
        await self._renew_live()
        if self.options.unavailable == "local_share":
            self._share_until = time.monotonic() + RECOVERY_GRACE_S
        self.degraded = False
        self.last_error = None
        self._metrics.budget_degraded.set(0)
        log.warning("budget: Redis is back; the cluster budget applies again")
        self._wake_all()

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

    async def _degraded_acquire(self, tokens: int) -> FallbackLease:
        if self.options.unavailable == "reject":
            raise errors.budget_unavailable(self._retry_after_s)
        share = self._fallback.max_tokens
        if share is not None and self._tokens + self._fallback.tokens_in_use + tokens > share:
            # What this replica still holds under Redis leases counts against its share: the
            # shares must add up to the budget, outage or not.
            raise errors.over_budget(
                self._retry_after_s,
                f"Redis is unavailable; this replica's share of {share:,} tokens is in use "
                f"({self.tokens_in_use:,} held)",
            )
        lease = FallbackLease(self, await self._fallback.acquire(tokens))
        self._fallback_held.add(lease)
        return lease

    def _over_share(self, tokens: int) -> bool:
        """Right after an outage: would `tokens` more take this replica past its share?"""
        share = self._fallback.max_tokens
        if share is None or time.monotonic() >= self._share_until:
            return False
        return self.tokens_in_use + tokens > share

    def _fallback_released(self, lease: FallbackLease) -> None:
        self._fallback_held.discard(lease)
        if lease.redis_id is not None:
            self._live.pop(lease.redis_id, None)
            self._unreleased.add(lease.redis_id)
            if not self.degraded:
                self._background(self._release_quietly(lease.redis_id))
        self._wake_all()

    def _enter_degraded(self, exc: BaseException) -> None:
        self.last_error = type(exc).__name__
        if self.degraded:
            return
        self.degraded = True
        self._metrics.budget_degraded.set(1)
        self._metrics.budget_fallbacks.labels(self.options.unavailable).inc()
        log.warning(
            "budget: Redis unavailable (%s); policy %s applies until it returns",
            self.last_error,
            self.options.unavailable,
        )
        self._wake_all()

    def _seen(self, used_tokens: int, used_requests: int, expired: int) -> None:
        self.cluster_tokens = used_tokens
        self.cluster_requests = used_requests
        self._metrics.budget_cluster_tokens.labels(self._model).set(used_tokens)
        if expired:
            self._metrics.budget_lease_expiries.inc(expired)

    def _wake_all(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
