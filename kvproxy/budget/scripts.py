"""The Redis side of the cluster-wide in-flight budget: key layout and the Lua scripts that
change it. Pure data (no I/O): `budget_redis` loads them into a client.

Every change is one server-side script, so no two replicas can both see room and both take
it (Redis runs a script atomically). Time is Redis's own clock (`TIME`), so replicas with
skewed clocks agree on which leases have expired.

Keys, under one prefix per engine pool (`{prefix}` is a hash tag: one Redis Cluster slot):

    {p}:leases   ZSET  lease id -> expiry (ms, Redis clock)
    {p}:tokens   HASH  lease id -> prompt tokens it holds
    {p}:usage    HASH  tokens, requests: the sum over live leases, kept with every change
    {p}:queue    ZSET  waiter id -> ticket (strict FIFO across replicas)
    {p}:qexp     ZSET  waiter id -> expiry (ms): a waiter that stops asking is forgotten
    {p}:seq      STRING  ticket counter
    {p}:released PUBSUB channel: a release happened, waiters should ask again

Lease and waiter ids start with the replica's id, so an operator can tell whose they are.
"""

from __future__ import annotations

from dataclasses import dataclass

# Purges expired leases (a dead replica's) and waiters; returns how many leases expired.
# Shared by every script that reads usage, so usage never counts a dead lease.
_PURGE = """
local now_t = redis.call('TIME')
local now = tonumber(now_t[1]) * 1000 + math.floor(tonumber(now_t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, id in ipairs(expired) do
  local tok = redis.call('HGET', KEYS[2], id)
  if tok then
    redis.call('HINCRBY', KEYS[3], 'tokens', -tonumber(tok))
    redis.call('HINCRBY', KEYS[3], 'requests', -1)
    redis.call('HDEL', KEYS[2], id)
  end
  redis.call('ZREM', KEYS[1], id)
end
local gone = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)
for _, w in ipairs(gone) do
  redis.call('ZREM', KEYS[4], w)
  redis.call('ZREM', KEYS[5], w)
end
local used_t = tonumber(redis.call('HGET', KEYS[3], 'tokens') or '0')
local used_r = tonumber(redis.call('HGET', KEYS[3], 'requests') or '0')
"""

# KEYS: leases tokens usage queue qexp seq
# ARGV: id tokens max_tokens max_requests lease_ttl_ms waiter_ttl_ms  (max < 0: no limit)
# Returns {granted (1/0), tokens in use, requests in use, leases expired by this call}.
# Idempotent per id, so the client may retry a call whose reply it lost.
# Strict FIFO across replicas: a request is granted only when the queue is empty or it is
# the head, and a head that does not fit blocks those behind it, as the local budget does.
ACQUIRE = (
    _PURGE
    + """
local id = ARGV[1]
local tok = tonumber(ARGV[2])
if redis.call('HEXISTS', KEYS[2], id) == 1 then
  -- Already granted: a client retry after a lost reply must not take the room twice.
  return {1, used_t, used_r, #expired}
end
local max_t = tonumber(ARGV[3])
local max_r = tonumber(ARGV[4])
local fits = (max_t < 0 or used_t + tok <= max_t) and (max_r < 0 or used_r + 1 <= max_r)
local head = redis.call('ZRANGE', KEYS[4], 0, 0)[1]
if fits and (head == nil or head == id) then
  redis.call('ZREM', KEYS[4], id)
  redis.call('ZREM', KEYS[5], id)
  redis.call('HSET', KEYS[2], id, tok)
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[5]), id)
  redis.call('HINCRBY', KEYS[3], 'tokens', tok)
  redis.call('HINCRBY', KEYS[3], 'requests', 1)
  return {1, used_t + tok, used_r + 1, #expired}
end
if not redis.call('ZSCORE', KEYS[4], id) then
  redis.call('ZADD', KEYS[4], redis.call('INCR', KEYS[6]), id)
end
redis.call('ZADD', KEYS[5], now + tonumber(ARGV[6]), id)
return {0, used_t, used_r, #expired}
"""
)

# KEYS: leases tokens usage queue qexp seq;  ARGV: waiter id
# A waiter that gave up (timeout, cancelled) leaves the queue so it blocks nobody.
LEAVE_QUEUE = """
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
return 1
"""

# KEYS: leases tokens usage queue qexp seq released-channel;  ARGV: lease id
# Idempotent: a lease released twice, or already expired, changes nothing the second time.
RELEASE = """
local tok = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
if not tok then
  return 0
end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[3], 'tokens', -tonumber(tok))
redis.call('HINCRBY', KEYS[3], 'requests', -1)
-- Wake waiters only when there are some: a message costs every replica a wake-up.
if redis.call('ZCARD', KEYS[4]) > 0 then
  redis.call('PUBLISH', KEYS[7], ARGV[1])
end
return 1
"""

# KEYS: leases tokens usage queue qexp seq;  ARGV: lease_ttl_ms, then (id, tokens) pairs
# Renews this replica's live leases. A live lease Redis no longer has (Redis restarted empty,
# or an outage outlasted the expiry) is put back: the request still holds its share, and a
# budget that forgot it would over-commit the engines. A lease released while this script
# was on its way is put back too; the caller releases it again (see `_renew_live`). Returns
# {renewed, tokens in use, requests in use, expired, {ids put back}}.
RENEW = (
    _PURGE
    + """
local ttl = tonumber(ARGV[1])
local renewed = 0
local reasserted = {}
for i = 2, #ARGV, 2 do
  local id = ARGV[i]
  if redis.call('HEXISTS', KEYS[2], id) == 1 then
    redis.call('ZADD', KEYS[1], now + ttl, id)
    renewed = renewed + 1
  else
    local tok = tonumber(ARGV[i + 1])
    redis.call('HSET', KEYS[2], id, tok)
    redis.call('ZADD', KEYS[1], now + ttl, id)
    redis.call('HINCRBY', KEYS[3], 'tokens', tok)
    redis.call('HINCRBY', KEYS[3], 'requests', 1)
    used_t = used_t + tok
    used_r = used_r + 1
    table.insert(reasserted, id)
  end
end
return {renewed, used_t, used_r, #expired, reasserted}
"""
)


@dataclass(frozen=True, slots=True)
class BudgetKeys:
    """The keys of one engine pool's budget."""

    prefix: str

    @classmethod
    def for_pool(cls, key_prefix: str, pool: str) -> BudgetKeys:
        # The braces are a Redis Cluster hash tag: every key of one pool in one slot, which
        # multi-key scripts require there.
        return cls(f"{key_prefix}:{{{pool}}}")

    @property
    def script_keys(self) -> list[str]:
        p = self.prefix
        return [f"{p}:leases", f"{p}:tokens", f"{p}:usage", f"{p}:queue", f"{p}:qexp", f"{p}:seq"]

    @property
    def channel(self) -> str:
        return f"{self.prefix}:released"
