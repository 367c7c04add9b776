"""The cluster budget's races around a Redis outage, each reproduced without timing luck: the
replicas reach a real `redis-server` through a relay that holds their traffic (a blackhole:
calls wait for their timeout) and can deliver what was held late, after the replica moved
on (a TCP retransmission after the blackhole ends).

1. local_share, right after the return: acquisitions that start together must not all pass
   the share cap (it was read before the Redis call and charged after it).
2. Leases that expired in Redis during the outage: the replica that comes back first must
   not hand out room that a replica still cut off holds (under either policy).
3. A renewal (or an acquisition) that timed out and reaches Redis after the return must not
   put back a lease released since, nor take one nobody waits for.
Judged on Redis's own usage and on what each replica was granted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from holding_relay import HoldingRelay
from redis_server import RedisServer, needs_redis, redis_server
from test_budget_cluster import POOL, options, sample, usage

from kvproxy.budget.cluster import RedisBudget
from kvproxy.budget.leases import Lease
from kvproxy.budget.scripts import BudgetKeys
from kvproxy.observe.metrics import Metrics
from kvproxy.policy.errors import KvproxyError

pytestmark = needs_redis

INSTANCES = itertools.count()


async def until(check: Callable[[], bool | Awaitable[bool]], timeout_s: float = 20.0) -> None:
    """Poll `check` (bounded in time and tries); fail the test if it never holds."""
    for _ in range(int(timeout_s / 0.02)):
        got = check()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition never held")


@contextlib.asynccontextmanager
async def relayed(server: RedisServer) -> AsyncIterator[HoldingRelay]:
    relay = HoldingRelay(server.port)
    await relay.start()
    try:
        yield relay
    finally:
        await relay.close()


@contextlib.asynccontextmanager
async def budget(url: str, **overrides: Any) -> AsyncIterator[RedisBudget]:
    queue_timeout_s = overrides.pop("queue_timeout_s", 1.0)
    b = RedisBudget(
        max_tokens=100,
        max_requests=None,
        queue_timeout_s=queue_timeout_s,
        queue_max_waiters=100,
        metrics=Metrics(),
        options=options(url, f"race{next(INSTANCES)}", **overrides),
    )
    await b.start()
    try:
        yield b
    finally:
        await b.aclose()


async def lease_expired(server: RedisServer, lease_id: str) -> bool:
    """Redis's own clock is past the lease's expiry (or it has lapsed already)."""
    client = aioredis.Redis.from_url(server.url)
    try:
        prefix = BudgetKeys.for_pool("kvproxy:budget", POOL).prefix
        score = await client.zscore(prefix + ":leases", lease_id)
        secs, micros = await client.time()
    finally:
        await client.aclose()
    return score is None or score < secs * 1000 + micros // 1000


async def test_recovery_share_cap_is_checked_and_charged_at_once(tmp_path: Path) -> None:
    """Race 1. Right after Redis returns, a local_share replica keeps its share (100 // 2 =
    50) as a cap. Three acquisitions of 20 start together: each must see the others'
    reservation, so two fit and the third waits (here: until its queue timeout)."""
    async with (
        redis_server(tmp_path) as server,
        relayed(server) as relay,
        # A recovery window of 2 x 1 s + 3 x 2 s = 8 s, far longer than the queue timeout:
        # the cap, not the window's end, decides.
        budget(relay.url, timeout_s=2.0, expected_replicas=2) as r,
    ):
        relay.block()
        await until(lambda: r.degraded)  # the renewal's timeout
        relay.unblock()
        await until(lambda: not r.degraded)
        got = await asyncio.gather(*(r.acquire(20) for _ in range(3)), return_exceptions=True)
        leases = [g for g in got if not isinstance(g, BaseException)]
        refused = [g for g in got if isinstance(g, KvproxyError)]
        assert len(leases) == 2, got
        assert [e.status for e in refused] == [429], got
        assert r.tokens_in_use == 40
        assert r.share_tokens == 50
        assert await usage(server) == (40, 2)
        for lease in leases:
            lease.release()
        await until(lambda: r.describe_json()["unconfirmed_releases"] == 0)
        assert await usage(server) == (0, 0)


@pytest.mark.parametrize(("policy", "ask"), [("reject", 80), ("local_share", 40)])
async def test_the_first_replica_back_cannot_hand_out_what_another_still_holds(
    tmp_path: Path, policy: str, ask: int
) -> None:
    """Race 2. B holds 80 of 100 when Redis becomes unreachable for longer than the lease
    TTL. A comes back first: B's lease has expired in Redis, but B still holds the work, so A
    must not be granted what would take the engines past 100 (under local_share A's own cap
    of 50 would let 40 through, so that is what it asks). When B comes back its lease counts
    once, not twice, and goes when B releases it."""
    async with (
        redis_server(tmp_path) as server,
        relayed(server) as relay_a,
        relayed(server) as relay_b,
        budget(relay_a.url, lease_ttl_s=1.0, timeout_s=1.0, unavailable=policy) as a,
        budget(relay_b.url, lease_ttl_s=1.0, timeout_s=1.0, unavailable=policy) as b,
    ):
        held = await b.acquire(80)
        assert await usage(server) == (80, 1)
        relay_a.block()
        relay_b.block()
        await until(lambda: a.degraded and b.degraded)
        await until(lambda: lease_expired(server, held.id))  # type: ignore[union-attr]
        relay_a.unblock()
        await until(lambda: not a.degraded)
        with pytest.raises(KvproxyError) as err:
            await a.acquire(ask)
        assert err.value.status == 429
        assert await usage(server) == (80, 1)  # B's lease lapsed, still counted
        relay_b.unblock()
        await until(lambda: not b.degraded)
        assert await usage(server) == (80, 1)  # taken back, not counted twice
        held.release()
        await until(lambda: b.describe_json()["unconfirmed_releases"] == 0)
        assert await usage(server) == (0, 0)
        lease = await a.acquire(ask)
        lease.release()


async def test_a_late_renewal_cannot_put_back_a_released_lease(tmp_path: Path) -> None:
    """Race 3. A renewal sent into the blackhole times out; the lease is released during the
    outage and given back when Redis returns; then the old renewal reaches Redis. It carries
    the old epoch, so it is refused: nothing is held once all traffic has ended."""
    async with (
        redis_server(tmp_path) as server,
        relayed(server) as relay,
        budget(relay.url, lease_ttl_s=3.0, timeout_s=0.5) as r,
    ):
        lease = await r.acquire(40)
        assert isinstance(lease, Lease)
        assert lease.id is not None
        assert not lease.local
        # A renewal went through: the connection it used is open and pooled, so the next
        # one is sent on it (a new connection's handshake would stop in the blackhole).
        await until(lambda: sample(r, "kvproxy_budget_lease_renewals_total") >= 1)
        relay.block()
        await until(lambda: relay.holds(lease.id.encode()))  # the next renewal carries it
        await until(lambda: r.degraded)  # ... and timed out
        lease.release()
        relay.unblock(stale=True)
        await until(lambda: not r.degraded and r.describe_json()["unconfirmed_releases"] == 0)
        assert await usage(server) == (0, 0)
        assert await relay.deliver_stale() >= 1
        assert await usage(server) == (0, 0)


async def test_a_late_acquisition_cannot_take_a_lease_nobody_holds(tmp_path: Path) -> None:
    """Race 3's sibling: an acquisition that timed out in the blackhole (the request then
    follows the policy) reaches Redis after the return. Refused: no lease for nobody."""
    async with (
        redis_server(tmp_path) as server,
        relayed(server) as relay,
        # No renewal during the test (every 10 s): only the acquisition is in the blackhole.
        budget(relay.url, lease_ttl_s=30.0, timeout_s=0.5, unavailable="reject") as r,
    ):
        warm = await r.acquire(1)  # opens the connection the next call is sent on
        warm.release()
        await until(lambda: r.describe_json()["unconfirmed_releases"] == 0)
        relay.block()
        with pytest.raises(KvproxyError) as err:
            await r.acquire(40)  # times out in the blackhole, then the policy answers
        assert relay.holds(f"{r.options.replica_id}:2".encode())
        assert err.value.code == "budget_unavailable"
        relay.unblock(stale=True)
        await until(lambda: not r.degraded and r.describe_json()["unconfirmed_releases"] == 0)
        assert await relay.deliver_stale() >= 1
        assert await usage(server) == (0, 0)
        lease = await r.acquire(100)  # the whole budget is there
        lease.release()


async def test_a_cancelled_acquisition_takes_nothing_for_nobody(tmp_path: Path) -> None:
    """A request cancelled (its client left) while its acquisition is in the blackhole: the
    acquisition reaches Redis after everything the replica sent since (its clean-up
    included). What it may take then is given back, or it is refused."""
    async with (
        redis_server(tmp_path) as server,
        relayed(server) as relay,
        budget(relay.url, timeout_s=1.0) as r,
    ):
        warm = await r.acquire(1)  # opens the connection the next call is sent on
        warm.release()
        await until(lambda: r.describe_json()["unconfirmed_releases"] == 0)
        relay.block()
        task = asyncio.ensure_future(r.acquire(40))
        await until(lambda: relay.holds(f"{r.options.replica_id}:2".encode()))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        relay.unblock(stale=True)  # new traffic flows; the acquisition stays held
        await until(lambda: not r._tasks)  # the clean-up of the cancelled request is over
        assert await relay.deliver_stale() >= 1
        await until(lambda: not r.degraded and r.describe_json()["unconfirmed_releases"] == 0)
        assert await usage(server) == (0, 0)


async def test_local_share_leaves_the_others_only_what_was_free(tmp_path: Path) -> None:
    """local_share with three replicas (share 100 // 3 = 33): A holds 80 when Redis becomes
    unreachable. B and C must not each take a full share (80 + 33 + 33 > 100): each may
    take an even part of the 20 that were free, 20 // 3 = 6, beside what it held."""
    async with (
        redis_server(tmp_path) as server,
        relayed(server) as relay_a,
        relayed(server) as relay_b,
        relayed(server) as relay_c,
        budget(relay_a.url, timeout_s=0.5, expected_replicas=3) as a,
        budget(relay_b.url, timeout_s=0.5, expected_replicas=3) as b,
        budget(relay_c.url, timeout_s=0.5, expected_replicas=3) as c,
    ):
        held = await a.acquire(80)
        for r in (b, c):  # each has seen the cluster's use since A's lease
            (await r.acquire(1)).release()
            await until(lambda r=r: r.describe_json()["unconfirmed_releases"] == 0)
        for relay in (relay_a, relay_b, relay_c):
            relay.block()
        await until(lambda: a.degraded and b.degraded and c.degraded)
        granted = 0
        for r in (b, c):
            with pytest.raises(KvproxyError) as err:
                await r.acquire(7)
            assert err.value.status == 429
            lease = await r.acquire(6)
            granted += lease.tokens
        assert held.tokens + granted <= 100
        with pytest.raises(KvproxyError):
            await a.acquire(1)  # A is above its share: nothing more until it is under
        for relay in (relay_a, relay_b, relay_c):
            relay.unblock()


async def test_a_replica_idle_after_a_burst_keeps_its_share_in_an_outage(tmp_path: Path) -> None:
    """The outage cap is taken from the last view of the cluster's use. A replica that took
    90 of 100 and gave them back before Redis went must see the room its release made: its
    cap is its full share (50), not 5 (what the view at the burst's peak left). Found by the
    slow suite's Redis-stopped run: every request of the outage refused on both replicas."""
    async with (
        redis_server(tmp_path) as server,
        relayed(server) as relay,
        budget(relay.url, timeout_s=0.5, expected_replicas=2) as r,
    ):
        (await r.acquire(90)).release()
        await until(lambda: r.describe_json()["unconfirmed_releases"] == 0)
        assert await usage(server) == (0, 0)
        relay.block()
        await until(lambda: r.degraded)
        lease = await r.acquire(50)
        with pytest.raises(KvproxyError) as err:
            await r.acquire(1)  # the share is the cap all the same
        assert err.value.status == 429
        lease.release()
        relay.unblock()
        await until(lambda: not r.degraded)
