"""The budget's Redis client on the request path: one pipelined RESP2 connection.

Why kvproxy's own: each admitted request makes one script call (scripts.ACQUIRE), and
redis-py's asyncio client spends ~145 us of CPU on one (a pool checkout, its own timeout,
retry and parser layers), about as much as the rest of a small request. Here a call is
packed by hiredis, written with the others made in the same loop turn (one write), and
its reply matched in order on one shared connection: ~50 us alone, less under load
(bench/RESULTS.md, the budget table). Only what the budget calls lives here: EVALSHA (EVAL
when Redis lost the script: a restart, a failover), PING, and AUTH/SELECT on connect.
Pub/sub stays on redis-py: one message per release with waiters, not one per request.

Failure semantics are redis-py's, so `connection.REDIS_DOWN` and the budget's "a closed
connection is retried once" read them unchanged: errors are redis-py's exception classes;
a connection that fails, or whose caller gave up waiting (its deadline), is dropped, every
call still pending on it fails with `ConnectionError`, and the next call opens a fresh one
(so a failover's new address is found, and a reply that arrives late is never matched to
the wrong call).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import ssl
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

import hiredis
from redis.exceptions import (
    AuthenticationError,
    ConnectionError,
    InvalidResponse,
    NoScriptError,
    ReadOnlyError,
    RedisError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

# The URL's query options this client honours; any other is refused at start-up rather than
# silently ignored (redis-py accepts dozens: a pool size here would mean nothing).
_QUERY_OPTIONS = frozenset({"db", "ssl_cert_reqs", "ssl_check_hostname"})
_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
# Error replies redis-py maps to its own classes, by their first word.
_ERRORS: dict[str, type[RedisError]] = {
    "NOSCRIPT": NoScriptError,
    "READONLY": ReadOnlyError,
    "NOAUTH": AuthenticationError,
    "WRONGPASS": AuthenticationError,
}


class Target:
    """Where the connection goes and how it logs in, from a redis://, rediss:// or unix://
    URL (a password or user in the URL wins over `password`, as with redis-py)."""

    def __init__(self, url: str, password: str | None, ssl_ca_file: str | None) -> None:
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = sorted(set(query) - _QUERY_OPTIONS)
        if unknown:
            raise ValueError(
                f"redis_url option(s) {', '.join(unknown)} are not supported by the budget's "
                f"client (supported: {', '.join(sorted(_QUERY_OPTIONS))})"
            )
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError("redis_url must start with redis://, rediss:// or unix://")
        self.path = unquote(parts.path) if parts.scheme == "unix" else None
        self.host = parts.hostname or "localhost"
        self.port = parts.port or 6379
        db_path = parts.path.lstrip("/") if parts.scheme != "unix" else ""
        self.db = int(query.get("db") or db_path or 0)
        self.username = unquote(parts.username) if parts.username else None
        self.password = unquote(parts.password) if parts.password else password
        self.ssl: ssl.SSLContext | None = None
        if parts.scheme == "rediss":
            ctx = ssl.create_default_context(cafile=ssl_ca_file)
            reqs = _CERT_REQS.get(query.get("ssl_cert_reqs", "required").lower())
            if reqs is None:
                raise ValueError("redis_url ssl_cert_reqs must be none, optional or required")
            check = query.get("ssl_check_hostname", "true").lower() in ("1", "true", "yes")
            ctx.check_hostname = check and reqs != ssl.CERT_NONE
            ctx.verify_mode = reqs
            self.ssl = ctx


class _Connection(asyncio.Protocol):
    """One RESP2 connection: calls written in order, replies matched in order."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader(protocolError=InvalidResponse, replyError=ResponseError)
        self._pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._out: list[bytes] = []
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail("Connection closed by server." if exc is None else type(exc).__name__)

    def eof_received(self) -> bool | None:
        return False  # close: a half-closed Redis connection answers nothing more

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        pending = self._pending
        while True:
            try:
                reply = self._reader.gets()
            except InvalidResponse:
                self.abort("protocol error")
                return
            if reply is False:
                return
            if not pending:
                self.abort("a reply nobody asked for")
                return
            fut = pending.popleft()
            if fut.done():
                continue
            if isinstance(reply, ResponseError):
                fut.set_exception(_error(reply))
            else:
                fut.set_result(reply)

    def call(self, packed: bytes) -> asyncio.Future[Any]:
        if self.closed:
            raise ConnectionError("Connection closed.")
        fut = self._loop.create_future()
        self._pending.append(fut)
        if not self._out:
            # Calls made in this loop turn go out in one write.
            self._loop.call_soon(self._flush)
        self._out.append(packed)
        return fut

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and not self.closed and self._transport is not None:
            self._transport.write(b"".join(out) if len(out) > 1 else out[0])

    def abort(self, why: str = "dropped") -> None:
        """Drop the connection now: replies still owed to it can no longer be matched."""
        self._fail(why)
        if self._transport is not None:
            self._transport.abort()

    def _fail(self, why: str) -> None:
        self.closed = True
        self._out = []
        while self._pending:
            fut = self._pending.popleft()
            if not fut.done():
                fut.set_exception(ConnectionError(why))


def _pack(*args: Any) -> bytes:
    packed: bytes = hiredis.pack_command(args)
    return packed


def _error(reply: ResponseError) -> RedisError:
    text = str(reply)
    cls = _ERRORS.get(text.split(" ", 1)[0], ResponseError)
    return cls(text)


class RespClient:
    """The budget's calls (`register_script`, `ping`) on one shared, pipelined connection."""

    def __init__(self, target: Target, connect_timeout_s: float) -> None:
        self._target = target
        self._timeout_s = connect_timeout_s
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None

    async def execute(self, *args: Any) -> Any:
        conn = self._conn
        if conn is None or conn.closed:
            conn = await self._connected()
        fut = conn.call(_pack(*args))
        try:
            return await fut
        except asyncio.CancelledError:
            # The caller's deadline passed (or it was cancelled): this reply, when it comes,
            # could only be matched by position; a fresh connection is simpler and safe.
            conn.abort("a call on this connection was abandoned")
            raise

    def register_script(self, source: str) -> Script:
        return Script(self, source)

    async def ping(self) -> Any:
        return await self.execute("PING")

    async def aclose(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        if self._conn is not None:
            self._conn.abort("closed")
            self._conn = None

    async def _connected(self) -> _Connection:
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(self._opened)
        # Shielded: one caller giving up must not cancel the others' connect.
        return await asyncio.shield(self._connecting)

    def _opened(self, fut: asyncio.Future[_Connection]) -> None:
        self._connecting = None
        if not fut.cancelled() and fut.exception() is None:
            self._conn = fut.result()

    async def _open(self) -> _Connection:
        t = self._target
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout_s):
                if t.path is not None:
                    _, conn = await loop.create_unix_connection(_Connection, t.path)
                else:
                    _, conn = await loop.create_connection(
                        _Connection,
                        t.host,
                        t.port,
                        ssl=t.ssl,
                        server_hostname=t.host if t.ssl is not None else None,
                    )
                try:
                    if t.password is not None:
                        login = (t.username, t.password) if t.username else (t.password,)
                        await conn.call(_pack("AUTH", *login))
                    if t.db:
                        await conn.call(_pack("SELECT", t.db))
                except BaseException:
                    conn.abort("login failed")
                    raise
        except TimeoutError:
            raise RedisTimeoutError("Timeout connecting to Redis") from None
        except OSError as exc:
            raise ConnectionError(f"Error connecting to Redis: {type(exc).__name__}") from None
        return conn


class Script:
    """A Lua script called by its SHA1; sent whole once when Redis does not have it (a
    restart or failover flushed its script cache)."""

    def __init__(self, client: RespClient, source: str) -> None:
        self._client = client
        self._source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()

    async def __call__(self, keys: list[Any], args: list[Any]) -> Any:
        try:
            return await self._client.execute("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self._client.execute("EVAL", self._source, len(keys), *keys, *args)
