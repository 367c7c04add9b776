"""The network boundary: the one place where aiohttp, OS and timeout exceptions become
kvproxy outcomes (httpx's `map_httpcore_exceptions` is the model).

Every outgoing leg (the relay to the router, the capacity probes of the engines, the
gate's and the canary's requests) runs inside `network_boundary()`; what escapes it is an
`errors.UpstreamFailure` with one status, one body and one metric label per kind, or the
caller's own exception. Nothing else in kvproxy catches transport exceptions by type.
"""

from __future__ import annotations

from dataclasses import replace
from types import TracebackType
from typing import Literal

import aiohttp

from kvproxy.policy import NetworkKind, errors
from kvproxy.upstream.pool import (
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamProtocolError,
)

# What a network leg can raise: aiohttp's errors, the relay client's (kvproxy.upstream.pool), the
# OS's (resets, refused connections, socket.gaierror) and timeouts (asyncio.timeout,
# aiohttp's own ServerTimeoutError).
NETWORK_EXCEPTIONS: tuple[type[BaseException], ...] = (
    TimeoutError,
    aiohttp.ClientError,
    UpstreamProtocolError,
    OSError,
)


def classify(exc: BaseException) -> NetworkKind:
    """The kind of a network exception. Order matters: aiohttp's classes inherit from
    both OSError and their own hierarchy (ClientConnectorError is an OSError)."""
    if isinstance(exc, (TimeoutError, aiohttp.ServerTimeoutError)):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return "dns"
    if isinstance(exc, UpstreamConnectError):
        return "dns" if exc.dns else "connect"
    if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.InvalidURL)):
        return "connect"
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, OSError)):
        return "reset"
    return "protocol"  # payload, response and any other aiohttp.ClientError


def failure_from(exc: BaseException) -> errors.UpstreamFailure:
    """The outcome of one network exception (for code that holds the exception already)."""
    if isinstance(exc, errors.UpstreamFailure):
        return exc
    kind = classify(exc)
    failure = errors.upstream_failure(kind, type(exc).__name__)
    if kind in ("connect", "dns") or isinstance(exc, UpstreamConnectTimeout):
        failure = replace(failure, unsent=True)
    return failure


class _NetworkBoundary:
    """Run an outgoing leg; its transport exceptions leave as `errors.UpstreamFailure`.

    A sync context manager around awaits is enough: an exception raised at an `await`
    inside the block propagates through it. Cancellation (a BaseException) passes. A class,
    not @contextmanager: the relay enters it once per chunk, and a generator costs more.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if exc is None or isinstance(exc, errors.KvproxyError):
            return False
        if isinstance(exc, NETWORK_EXCEPTIONS):
            raise failure_from(exc) from exc
        return False


_BOUNDARY = _NetworkBoundary()


def network_boundary() -> _NetworkBoundary:
    """`with network_boundary(): ...` around every outgoing leg (stateless, shared)."""
    return _BOUNDARY
