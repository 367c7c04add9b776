"""The budget's Redis connection: what it is configured with, how the client is built, and
what counts as "Redis is unavailable". No budget logic (that is `budget.cluster`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvproxy.budget.resp import RespClient, Script, Target

# What "Redis is unavailable" means to us: any error of the client or the socket, and a
# call that outlived its deadline. Script bugs (ResponseError) are RedisErrors too: failing
# over to the policy is the safe reaction to those as well.
REDIS_DOWN = (RedisError, OSError, TimeoutError)


class BadReply(RedisError):
    """A reply that is not what the script (or PING) returns: a Redis, or a proxy in front
    of one, answering `+OK` or `:0` to everything. A RedisError, so it is Redis unavailable
    under the configured policy like any other, never an unpacking error on the request
    path. The message names the call and the reply's shape, never its content."""


def _shape(reply: Any) -> str:
    if isinstance(reply, (list, tuple)):
        return f"an array of {len(reply)}"
    return type(reply).__name__


def checked(reply: Any, name: str, shape: str) -> list[Any]:
    """`reply` as the script's array of `shape`: one letter per element, `i` an integer,
    `l` an array of strings (kvproxy.budget.scripts returns exactly these). Else BadReply."""
    if not isinstance(reply, (list, tuple)) or len(reply) != len(shape):
        raise BadReply(f"{name}: expected an array of {len(shape)}, got {_shape(reply)}")
    for kind, v in zip(shape, reply, strict=True):
        if kind == "i" and (not isinstance(v, int) or isinstance(v, bool)):
            raise BadReply(f"{name}: expected an integer, got {_shape(v)}")
        if kind == "l" and (
            not isinstance(v, (list, tuple)) or not all(isinstance(x, (bytes, str)) for x in v)
        ):
            raise BadReply(f"{name}: expected an array of strings, got {_shape(v)}")
    return list(reply)


def check_pong(reply: Any) -> None:
    """PING answers PONG (redis-py's client maps it to True)."""
    if reply is not True and reply not in (b"PONG", "PONG"):
        raise BadReply(f"PING: expected PONG, got {_shape(reply)}")


@dataclass(frozen=True, slots=True)
class RedisOptions:
    url: str
    password: str | None
    ssl_ca_file: str | None
    key_prefix: str
    pool: str
    lease_ttl_s: float
    timeout_s: float
    unavailable: Literal["local_share", "reject"]
    expected_replicas: int
    replica_id: str


class RedisDown(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(type(cause).__name__)
        self.cause = cause


class BudgetClient:
    """What the budget calls Redis with: its scripts and pings on kvproxy's own pipelined
    connection (`budget.resp`: one call per admitted request), pub/sub on redis-py's.
    Raises ValueError for a URL the client cannot honour (an unknown option)."""

    def __init__(self, o: RedisOptions) -> None:
        self._calls = RespClient(Target(o.url, o.password, o.ssl_ca_file), o.timeout_s)
        self._pubsub = _redis_py(o)

    def register_script(self, source: str) -> Script:
        return self._calls.register_script(source)

    async def ping(self) -> Any:
        return await self._calls.ping()

    def pubsub(self) -> Any:
        return self._pubsub.pubsub()

    async def aclose(self) -> None:
        await self._calls.aclose()
        await self._pubsub.aclose()


def _redis_py(o: RedisOptions) -> Any:
    kwargs: dict[str, Any] = {
        # Retries are ours (`RedisBudget._call`), under our deadline. The asyncio client's
        # own Retry: redis-py >= 8.2 warns when handed the synchronous one (and the test
        # suite turns warnings into errors).
        "retry": Retry(NoBackoff(), 0),
        "socket_timeout": o.timeout_s,
        "socket_connect_timeout": o.timeout_s,
        "decode_responses": False,
        "retry_on_timeout": False,
    }
    if o.password is not None:
        kwargs["password"] = o.password
    if o.ssl_ca_file is not None:
        kwargs["ssl_ca_certs"] = o.ssl_ca_file
    return aioredis.Redis.from_url(o.url, **kwargs)


def default_replica_id() -> str:
    """The pod name where Kubernetes gives one (HOSTNAME), plus the pid and a random tail,
    so two processes of one pod never share lease ids."""
    host = os.environ.get("HOSTNAME") or "kvproxy"
    return f"{host}-{os.getpid()}-{os.urandom(3).hex()}"
