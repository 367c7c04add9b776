"""The budget's own pipelined Redis client (kvproxy.budget.resp): its URL reading, its
pipelining against a real `redis-server`, and its failure semantics against a scripted
loopback server (what it sent, what it answered, when it stopped answering), under asyncio
and under uvloop, the loop `kvproxy serve` runs.

What must hold: every call gets its own reply and nothing else; one connection carries
concurrent calls; a call abandoned at its deadline drops the connection (a late reply is
never matched to another call) and the next call opens a fresh one; errors are redis-py's
classes (the budget's REDIS_DOWN and its retry on a closed connection read them).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import uvloop
from redis.exceptions import (
    AuthenticationError,
    ConnectionError,
    ReadOnlyError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis_server import needs_redis, redis_server

from kvproxy.budget import build_budget
from kvproxy.budget.resp import RespClient, Target
from kvproxy.config import ConfigError, load_settings
from kvproxy.observe.metrics import Metrics


def client_for(url: str, password: str | None = None, timeout_s: float = 2.0) -> RespClient:
    return RespClient(Target(url, password, None), timeout_s)


# --- the URL --------------------------------------------------------------------------------


def test_the_url_names_host_port_db_and_login_and_wins_over_the_password_setting() -> None:
    t = Target("redis://user:s%40cret@redis.example:7000/3", "other", None)
    assert (t.host, t.port, t.db, t.username, t.password) == (
        "redis.example", 7000, 3, "user", "s@cret"
    )  # fmt: skip
    assert t.ssl is None
    assert t.path is None
    t = Target("redis://redis.example", "from-file", None)
    assert (t.host, t.port, t.db, t.username, t.password) == (
        "redis.example", 6379, 0, None, "from-file"
    )  # fmt: skip
    assert Target("redis://h/0?db=5", None, None).db == 5
    assert Target("unix:///run/redis.sock", None, None).path == "/run/redis.sock"


def test_tls_verifies_the_server_by_default() -> None:
    t = Target("rediss://redis.example:6380", None, None)
    assert t.ssl is not None
    assert t.ssl.verify_mode == ssl.CERT_REQUIRED
    assert t.ssl.check_hostname
    loose = Target("rediss://h?ssl_cert_reqs=none", None, None)
    assert loose.ssl is not None
    assert loose.ssl.verify_mode == ssl.CERT_NONE


@pytest.mark.parametrize(
    "url", ["redis://h/0?max_connections=5", "http://h:6379", "rediss://h?ssl_cert_reqs=maybe"]
)
def test_an_option_it_cannot_honour_is_refused_not_ignored(url: str) -> None:
    with pytest.raises(ValueError, match="redis_url"):
        Target(url, None, None)


async def test_the_server_refuses_such_a_url_at_start_with_the_setting_named() -> None:
    s = load_settings(budget_backend="redis", redis_url="redis://:s3cret@h:1/0?max_connections=5")
    with pytest.raises(ConfigError) as err:
        build_budget(s, Metrics())
    # Given as an override (a flag's way in), so named as the flag.
    assert "invalid setting redis_url (--redis-url)" in str(err.value)
    assert "max_connections" in str(err.value)
    assert "s3cret" not in str(err.value)


# --- a scripted server ----------------------------------------------------------------------


class Scripted:
    """A loopback server that records each command and answers from `reply(command)`:
    bytes to send, or None to stay silent."""

    def __init__(self, reply: Callable[[list[bytes]], bytes | None]) -> None:
        self.reply = reply
        self.commands: list[list[bytes]] = []
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionResetError, ValueError):
            while line := await reader.readline():
                cmd = []
                for _ in range(int(line[1:])):
                    size = int((await reader.readline())[1:])
                    cmd.append((await reader.readexactly(size + 2))[:-2])
                self.commands.append(cmd)
                out = self.reply(cmd)
                if out is not None:
                    writer.write(out)
        writer.close()


@contextlib.asynccontextmanager
async def scripted(reply: Callable[[list[bytes]], bytes | None]) -> AsyncIterator[Scripted]:
    s = Scripted(reply)
    s.server = await asyncio.start_server(s._serve, "127.0.0.1", 0)
    try:
        yield s
    finally:
        s.server.close()
        for w in s.writers:
            w.close()
            with contextlib.suppress(ConnectionError):
                await w.wait_closed()
        await s.server.wait_closed()


def on_both_loops(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run `test` under asyncio's loop and under uvloop's (their transports differ)."""
    asyncio.run(test())
    uvloop.run(test())


def test_calls_made_together_share_one_connection_and_get_their_own_replies() -> None:
    async def scenario() -> None:
        async with scripted(lambda cmd: b"$%d\r\n%s\r\n" % (len(cmd[-1]), cmd[-1])) as srv:
            client = client_for(srv.url)
            got = await asyncio.gather(*(client.execute("ECHO", f"n{i}") for i in range(50)))
            assert got == [f"n{i}".encode() for i in range(50)]
            assert srv.connections == 1
            await client.aclose()

    on_both_loops(scenario)


def test_it_logs_in_and_selects_the_db_before_any_call() -> None:
    async def scenario() -> None:
        async with scripted(lambda cmd: b"+OK\r\n" if cmd[0] != b"PING" else b"+PONG\r\n") as s:
            client = client_for(s.url.replace("//", "//app:pw@") + "/2", password="ignored")
            assert await client.ping() == b"PONG"
            assert s.commands == [[b"AUTH", b"app", b"pw"], [b"SELECT", b"2"], [b"PING"]]
            await client.aclose()

    on_both_loops(scenario)


def test_a_refused_login_is_an_authentication_error() -> None:
    async def scenario() -> None:
        async with scripted(lambda cmd: b"-WRONGPASS invalid username-password pair\r\n") as s:
            client = client_for(s.url, password="wrong")
            with pytest.raises(AuthenticationError):
                await client.ping()
            await client.aclose()

    on_both_loops(scenario)


def test_an_abandoned_call_drops_the_connection_and_the_next_opens_a_fresh_one() -> None:
    async def scenario() -> None:
        silent = {"on": True}

        def reply(cmd: list[bytes]) -> bytes | None:
            return None if silent["on"] else b"+PONG\r\n"

        async with scripted(reply) as srv:
            client = client_for(srv.url)
            other = asyncio.ensure_future(client.ping())
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await client.ping()
            # The call still pending on that connection fails as a closed connection (the
            # budget retries those once), never with a reply meant for another call.
            with pytest.raises(ConnectionError):
                async with asyncio.timeout(5):  # bounded: a client that kept it would hang
                    await other
            silent["on"] = False
            assert await client.ping() == b"PONG"
            assert srv.connections == 2
            await client.aclose()

    on_both_loops(scenario)


def test_error_replies_are_redis_py_errors_and_keep_the_connection() -> None:
    async def scenario() -> None:
        def reply(cmd: list[bytes]) -> bytes:
            if cmd[0] == b"SET":
                return b"-READONLY You can't write against a read only replica.\r\n"
            if cmd[0] == b"BAD":
                return b"-ERR unknown command 'BAD'\r\n"
            return b"+PONG\r\n"

        async with scripted(reply) as srv:
            client = client_for(srv.url)
            with pytest.raises(ReadOnlyError):
                await client.execute("SET", "k", "v")
            with pytest.raises(ResponseError, match="unknown command"):
                await client.execute("BAD")
            assert await client.ping() == b"PONG"
            assert srv.connections == 1
            await client.aclose()

    on_both_loops(scenario)


def test_garbage_is_never_a_reply_and_drops_the_connection() -> None:
    async def scenario() -> None:
        async with scripted(lambda cmd: b"?what\r\n") as srv:
            client = client_for(srv.url)
            for _ in range(2):
                with pytest.raises(ConnectionError):
                    await client.ping()
            assert srv.connections == 2
            await client.aclose()

    on_both_loops(scenario)


def test_a_reply_nobody_asked_for_drops_the_connection() -> None:
    async def scenario() -> None:
        async with scripted(lambda cmd: b"+PONG\r\n+EXTRA\r\n") as srv:
            client = client_for(srv.url)
            assert await client.ping() == b"PONG"
            await asyncio.sleep(0.05)
            # The extra reply could only be matched to the next call: that call gets its own,
            # on a fresh connection.
            assert await client.ping() == b"PONG"
            assert srv.connections == 2
            await client.aclose()

    on_both_loops(scenario)


def test_a_server_that_is_not_there_is_a_connection_error() -> None:
    async def scenario() -> None:
        async with scripted(lambda cmd: None) as srv:
            url = srv.url
        with pytest.raises(ConnectionError):
            await client_for(url).ping()

    on_both_loops(scenario)


def test_a_connect_that_never_completes_is_a_redis_timeout() -> None:
    async def scenario() -> None:
        # A listener whose backlog is full: the SYN is never answered (loopback only).
        import socket

        with socket.socket() as full:
            full.bind(("127.0.0.1", 0))
            full.listen(0)
            port = full.getsockname()[1]
            fillers = []
            try:
                for _ in range(8):  # bounded: the backlog of 0 fills at once
                    s = socket.socket()
                    s.setblocking(False)
                    with contextlib.suppress(BlockingIOError):
                        s.connect(("127.0.0.1", port))
                    fillers.append(s)
                with pytest.raises((RedisTimeoutError, ConnectionError)):
                    await client_for(f"redis://127.0.0.1:{port}", timeout_s=0.3).ping()
            finally:
                for s in fillers:
                    s.close()

    asyncio.run(scenario())


# --- a real redis-server ------------------------------------------------------------------


@needs_redis
async def test_scripts_run_by_sha_and_survive_a_flushed_script_cache(tmp_path: Path) -> None:
    async with redis_server(tmp_path) as server:
        client = client_for(server.url)
        script = client.register_script("return {KEYS[1], ARGV[1], tonumber(ARGV[2]) + 1}")
        assert await script(keys=["k"], args=["a", 41]) == [b"k", b"a", 42]
        admin = aioredis.Redis.from_url(server.url)
        try:
            await admin.script_flush()  # what a restart or a failover leaves
            assert await script(keys=["k"], args=["b", 1]) == [b"k", b"b", 2]
            assert (await admin.script_exists(script.sha)) == [True]
            before = await admin.info("commandstats")
            assert await script(keys=["k"], args=["c", 2]) == [b"k", b"c", 3]
            after = await admin.info("commandstats")
        finally:
            await admin.aclose()
        # Once Redis has it, the script is called by its SHA alone.
        calls = {
            c: int(after[f"cmdstat_{c}"]["calls"]) - int(before[f"cmdstat_{c}"]["calls"])
            for c in ("evalsha", "eval")
        }
        assert calls == {"evalsha": 1, "eval": 0}
        await client.aclose()


@needs_redis
async def test_a_restarted_redis_is_reached_again_on_a_fresh_connection(tmp_path: Path) -> None:
    async with redis_server(tmp_path) as server:
        client = client_for(server.url)
        assert await client.ping() == b"PONG"
        await server.stop()
        with pytest.raises(ConnectionError):
            await client.ping()
        await server.start()
        assert await client.ping() == b"PONG"
        await client.aclose()


# --- replies that are not the scripts' -----------------------------------------------------

NONSENSE = {
    "ok": lambda cmd: b"+OK\r\n",
    "zero": lambda cmd: b":0\r\n",
    "short": lambda cmd: b"*2\r\n:1\r\n:0\r\n",
    "strings": lambda cmd: b"*4\r\n$1\r\na\r\n$1\r\nb\r\n$1\r\nc\r\n$1\r\nd\r\n",
    "nested": lambda cmd: b"*4\r\n*0\r\n:0\r\n:0\r\n:0\r\n",
}


@pytest.mark.parametrize("reply", list(NONSENSE))
@pytest.mark.parametrize("policy", ["local_share", "reject"])
def test_a_redis_answering_nonsense_is_redis_unavailable(
    reply: str, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis, or a proxy in front of one, that answers `+OK` or `:0` (or an array of the
    wrong arity or types) to the scripts: the budget is Redis unavailable under the
    configured policy, never an exception the request path turns into a 500, and no task
    dies with its exception unretrieved."""

    async def scenario() -> None:
        async with scripted(NONSENSE[reply]) as s:
            settings = load_settings(
                budget_backend="redis",
                redis_url=s.url,
                redis_unavailable=policy,
                max_inflight_prompt_tokens=1_000,
                redis_lease_ttl_s=0.3,
            )
            budget = build_budget(settings, Metrics())
            await budget.start()
            try:
                for _ in range(3):
                    if policy == "local_share":
                        lease = await budget.acquire(10)
                        lease.release()
                    else:
                        with pytest.raises(Exception) as caught:
                            await budget.acquire(10)
                        assert getattr(caught.value, "code", None) == "budget_unavailable"
                await asyncio.sleep(0.25)  # a renewal round on the nonsense too
            finally:
                await budget.aclose()

    with caplog.at_level("ERROR"):
        asyncio.run(scenario())
    assert "Task exception was never retrieved" not in caplog.text
