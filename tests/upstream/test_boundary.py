"""The network exception seam (kvproxy/upstream/boundary.py): every transport exception of an
outgoing leg leaves as one UpstreamFailure per kind, with one status, code and label;
everything else passes through untouched."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from kvproxy.policy import errors
from kvproxy.upstream.boundary import NETWORK_EXCEPTIONS, classify, failure_from, network_boundary


def _key() -> aiohttp.client_reqrep.ConnectionKey:
    return aiohttp.client_reqrep.ConnectionKey("h", 1, False, True, None, None, None)


@pytest.mark.parametrize(
    ("exc", "kind", "status", "code"),
    [
        (TimeoutError(), "timeout", 504, "upstream_timeout"),
        (aiohttp.ServerTimeoutError(), "timeout", 504, "upstream_timeout"),
        (
            aiohttp.ClientConnectorDNSError(_key(), OSError(socket.EAI_NONAME, "x")),
            "dns",
            502,
            "upstream_unreachable",
        ),
        (
            aiohttp.ClientConnectorError(_key(), OSError(111, "refused")),
            "connect",
            502,
            "upstream_unreachable",
        ),
        (aiohttp.InvalidURL("x"), "connect", 502, "upstream_unreachable"),
        (aiohttp.ServerDisconnectedError(), "reset", 502, "upstream_reset"),
        (ConnectionResetError(), "reset", 502, "upstream_reset"),
        (aiohttp.ClientPayloadError(), "protocol", 502, "upstream_bad_response"),
        (aiohttp.ClientError(), "protocol", 502, "upstream_bad_response"),
    ],
)
def test_each_network_exception_has_one_outcome(
    exc: BaseException, kind: str, status: int, code: str
) -> None:
    assert isinstance(exc, NETWORK_EXCEPTIONS)
    assert classify(exc) == kind
    with pytest.raises(errors.UpstreamFailure) as got:
        with network_boundary():
            raise exc
    failure = got.value
    assert (failure.kind, failure.status, failure.code, failure.reason) == (
        kind,
        status,
        code,
        code,
    )
    assert failure.cause == type(exc).__name__
    assert failure.__cause__ is exc
    assert failure_from(exc) == failure
    assert code in errors.UPSTREAM_OUTCOMES


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("not network"),
        KeyError("k"),
        errors.invalid_request("bad"),
        asyncio.CancelledError(),
    ],
)
def test_everything_else_passes_through_untouched(exc: BaseException) -> None:
    with pytest.raises(type(exc)) as got:
        with network_boundary():
            raise exc
    assert got.value is exc


async def _get(session: aiohttp.ClientSession, url: str) -> None:
    with network_boundary():
        async with session.get(url):
            pass


async def test_a_real_refused_connection_is_connect() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    async with aiohttp.ClientSession() as session:
        with pytest.raises(errors.UpstreamFailure) as got:
            await _get(session, f"http://127.0.0.1:{port}/")
    assert got.value.kind == "connect"


async def test_a_server_that_closes_without_answering_is_reset() -> None:
    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(errors.UpstreamFailure) as got:
                await _get(session, f"http://127.0.0.1:{port}/")
        assert got.value.kind == "reset"
        assert got.value.status == 502
    finally:
        server.close()
        await server.wait_closed()


def test_the_body_of_a_failure_names_the_outcome_in_both_styles() -> None:
    failure = errors.upstream_failure("timeout", "TimeoutError")
    assert b'"code":"upstream_timeout"' in failure.body("openai")
    assert failure.body("sglang") == b'{"error":{"message":"the router did not answer in time"}}'
    assert b"TimeoutError" not in failure.body("openai")  # the cause is for logs, not bodies


def test_only_a_failure_before_any_connection_is_unsent() -> None:
    """A connect that timed out is a timeout to the client (504) like a read timeout, but
    only it says nothing was sent: a gateway may move that request, never the other."""
    from kvproxy.upstream.pool import UpstreamConnectError, UpstreamConnectTimeout

    timed_out = failure_from(UpstreamConnectTimeout("no connection within 5 s"))
    assert (timed_out.kind, timed_out.status, timed_out.unsent) == ("timeout", 504, True)
    assert failure_from(UpstreamConnectError("refused")).unsent
    assert failure_from(UpstreamConnectError("no such name", dns=True)).unsent
    assert not failure_from(TimeoutError()).unsent  # a read timeout: the request was sent
    assert not failure_from(ConnectionResetError()).unsent
