"""The Redis side of the cluster-wide in-flight budget: key layout and the Lua scripts that
change it. Pure data (no I/O): `budget_redis` loads them into a client.

Every change is one server-side script, so no two replicas can both see room and both take
it (Redis runs a script atomically). Time is Redis's own clock (`TIME`), so replicas with
skewed clocks agree on which leases have expired.

Keys, under one prefix per engine pool (`{prefix}` is a hash tag: one Redis Cluster slot):

    {p}:leases   ZSET  live lease id -> expiry (ms, Redis clock)
    {p}:lapsed   ZSET  lapsed lease id -> when it is dropped (ms): still counted
    {p}:tokens   HASH  lease id (live or lapsed) -> prompt tokens it holds
    {p}:usage    HASH  tokens, requests: the sum over live and lapsed leases
    {p}:queue    ZSET  waiter id -> ticket (strict FIFO across replicas)
    {p}:qexp     ZSET  waiter id -> expiry (ms): a waiter that stops asking is forgotten
    {p}:seq      STRING  ticket counter
    {p}:epoch:R  STRING  replica R's fencing epoch (see below)
    {p}:released PUBSUB channel: a release happened, waiters should ask again

Lease and waiter ids start with the replica's id, so an operator can tell whose they are.

Two rules close the races of a Redis outage (a blackhole, not only a refused connection):

- A lease lapses, it does not vanish. A lease not renewed within its TTL moves to `lapsed`
  and stays counted for a grace period (`lapse_ms`, longer than a cut-off replica takes to
  notice Redis is back and renew), and its owner's renewal takes it back. When Redis itself
  was unreachable nobody renewed, so everyone's leases lapse at once, when the first replica
  comes back: the grace runs from then, and a replica that comes back first cannot hand out
  the room the others still hold. A dead replica's leases are dropped after TTL + grace.
- Fencing. Each replica numbers its connections' eras (`epoch`): after any call whose reply
  it lost (a timeout: the request may still be in the network), it starts a new era, and
  the first call of the new era records it in `{p}:epoch:R`. A renewal or acquisition that
  carries an older era is refused, so a request delivered late (a TCP retransmission after
  the blackhole ends) can neither put back a lease released since nor take one nobody
  waits for. Releases need no fence: they only give back.
"""

from __future__ import annotations

from dataclasses import dataclass

# Longer than Linux keeps retransmitting an unacknowledged segment (tcp_retries2 = 15:
# about 15 minutes with RFC 6298 backoff capped at 120 s), so a request from before the
# latest era always meets the record of that era; renewed with every renewal (every third
# of the lease TTL), so it lapses only an hour after its replica is gone.
EPOCH_TTL_MS = 3_600_000

# Purges: lapses leases whose TTL passed (still counted), drops lapsed leases whose grace
# passed, forgets waiters that stopped asking. Expects `lapse_ms` set by the script. Shared by
# every script that reads usage, so usage never counts a dropped lease.
_PURGE = """
local now_t = redis.call('TIME')
local now = tonumber(now_t[1]) * 1000 + math.floor(tonumber(now_t[2]) / 1000)
local lapsing = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, id in ipairs(lapsing) do
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZADD', KEYS[7], now + lapse_ms, id)
end
local dropped = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', now)
for _, id in ipairs(dropped) do
  local tok = redis.call('HGET', KEYS[2], id)
  if tok then
    redis.call('HINCRBY', KEYS[3], 'tokens', -tonumber(tok))
    redis.call('HINCRBY', KEYS[3], 'requests', -1)
    redis.call('HDEL', KEYS[2], id)
  end
  redis.call('ZREM', KEYS[7], id)
end
local gone = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)
for _, w in ipairs(gone) do
  redis.call('ZREM', KEYS[4], w)
  redis.call('ZREM', KEYS[5], w)
end
local used_t = tonumber(redis.call('HGET', KEYS[3], 'tokens') or '0')
local used_r = tonumber(redis.call('HGET', KEYS[3], 'requests') or '0')
"""

# Gives back one lease (live or lapsed) and takes its id out of the queue; sets `freed`.
_FORGET_ONE = """
local function forget(id)
  redis.call('ZREM', KEYS[4], id)
  redis.call('ZREM', KEYS[5], id)
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZREM', KEYS[7], id)
  local tok = redis.call('HGET', KEYS[2], id)
  if not tok then
    return 0
  end
  redis.call('HDEL', KEYS[2], id)
  redis.call('HINCRBY', KEYS[3], 'tokens', -tonumber(tok))
  redis.call('HINCRBY', KEYS[3], 'requests', -1)
  return 1
end
"""

# KEYS: leases tokens usage queue qexp seq lapsed epoch released-channel
# ARGV: id tokens max_tokens max_requests lease_ttl_ms waiter_ttl_ms lapse_ms epoch
#       (max < 0: no limit), then the ids of leases this replica gives back (RELEASE's
#       work, carried by the next acquisition so a busy replica makes one call per request)
# Returns {granted (1/0, -1: fenced), tokens in use, requests in use, leases dropped}.
# Idempotent per id, so the client may retry a call whose reply it lost.
# Strict FIFO across replicas: a request is granted only when the queue is empty or it is
# the head, and a head that does not fit blocks those behind it, as the local budget does.
# The leases given back go first and unfenced (releases only give back), so the room they
# free is seen by this very acquisition.
ACQUIRE = (
    _FORGET_ONE
    + """
local freed = 0
for i = 9, #ARGV do
  freed = freed + forget(ARGV[i])
end
if freed > 0 and redis.call('ZCARD', KEYS[4]) > 0 then
  redis.call('PUBLISH', KEYS[9], 'acquire')
end
local lapse_ms = tonumber(ARGV[7])
if tonumber(ARGV[8]) < tonumber(redis.call('GET', KEYS[8]) or '0') then
  return {-1, 0, 0, 0}
end
"""
    + _PURGE
    + """
local id = ARGV[1]
local tok = tonumber(ARGV[2])
if redis.call('HEXISTS', KEYS[2], id) == 1 then
  -- Already granted: a client retry after a lost reply must not take the room twice.
  return {1, used_t, used_r, #dropped}
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
  return {1, used_t + tok, used_r + 1, #dropped}
end
if not redis.call('ZSCORE', KEYS[4], id) then
  redis.call('ZADD', KEYS[4], redis.call('INCR', KEYS[6]), id)
end
redis.call('ZADD', KEYS[5], now + tonumber(ARGV[6]), id)
return {0, used_t, used_r, #dropped}
"""
)

# KEYS: leases tokens usage queue qexp seq lapsed released-channel;  ARGV: ids
# A lease given back, or a waiter that gave up (timeout, cancelled), perhaps granted by a
# call whose reply was lost: out of the queue and out of the budget. Idempotent: a lease
# released twice, or already dropped, changes nothing the second time. Returns {leases
# given back, tokens in use, requests in use}.
RELEASE = (
    _FORGET_ONE
    + """
local freed = 0
for i = 1, #ARGV do
  freed = freed + forget(ARGV[i])
end
-- Wake waiters only when there are some: a message costs every replica a wake-up.
if freed > 0 and redis.call('ZCARD', KEYS[4]) > 0 then
  redis.call('PUBLISH', KEYS[8], ARGV[1])
end
-- The usage after the release: the replica's last view of the room, from which its cap
-- for an outage that starts next is taken (a view left at the burst's peak is a zero cap).
return {freed, tonumber(redis.call('HGET', KEYS[3], 'tokens') or '0'),
        tonumber(redis.call('HGET', KEYS[3], 'requests') or '0')}
"""
)

# KEYS: leases tokens usage queue qexp seq lapsed epoch released-channel
# ARGV: lease_ttl_ms lapse_ms epoch epoch_ttl_ms n_forget, n_forget ids, then (id, tokens)
#       pairs of this replica's live leases
# The renewal, and the return from an outage, in one atomic step: fence (an older era is
# refused, and this era is recorded), give back what the replica released or abandoned
# meanwhile (before anything is renewed, so nothing released is put back), then renew its
# live leases: a lapsed one is taken back, one Redis no longer has (Redis restarted empty,
# or an outage outlasted TTL + grace) is put back, since the request still holds its share
# and a budget that forgot it would over-commit the engines. A lease released on another
# connection while this call was on its way is put back too; the caller releases it again
# (see `RedisBudget._renew`). Returns {renewed (-1: fenced), tokens in use, requests in use,
# dropped, {ids put back}, lapsed leases taken back}.
RENEW = (
    _FORGET_ONE
    + """
local lapse_ms = tonumber(ARGV[2])
local epoch = tonumber(ARGV[3])
if epoch < tonumber(redis.call('GET', KEYS[8]) or '0') then
  return {-1, 0, 0, 0, {}, 0}
end
redis.call('SET', KEYS[8], epoch, 'PX', tonumber(ARGV[4]))
"""
    + _PURGE
    + """
local ttl = tonumber(ARGV[1])
local n_forget = tonumber(ARGV[5])
local freed = 0
for i = 6, 5 + n_forget do
  freed = freed + forget(ARGV[i])
end
if freed > 0 then
  used_t = tonumber(redis.call('HGET', KEYS[3], 'tokens') or '0')
  used_r = tonumber(redis.call('HGET', KEYS[3], 'requests') or '0')
  if redis.call('ZCARD', KEYS[4]) > 0 then
    redis.call('PUBLISH', KEYS[9], 'renew')
  end
end
local renewed = 0
local reclaimed = 0
local reasserted = {}
for i = 6 + n_forget, #ARGV, 2 do
  local id = ARGV[i]
  if redis.call('HEXISTS', KEYS[2], id) == 1 then
    if redis.call('ZREM', KEYS[7], id) == 1 then
      reclaimed = reclaimed + 1
    end
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
return {renewed, used_t, used_r, #dropped, reasserted, reclaimed}
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
        return [
            f"{p}:leases",
            f"{p}:tokens",
            f"{p}:usage",
            f"{p}:queue",
            f"{p}:qexp",
            f"{p}:seq",
            f"{p}:lapsed",
        ]

    def epoch(self, replica_id: str) -> str:
        return f"{self.prefix}:epoch:{replica_id}"

    @property
    def channel(self) -> str:
        return f"{self.prefix}:released"
