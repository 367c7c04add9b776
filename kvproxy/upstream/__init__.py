"""The relay's HTTP/1.1 client to the router (pooled keep-alive connections framed by
llhttp), and the one network boundary where aiohttp, OS and timeout exceptions become
kvproxy outcomes (`network_boundary`), for the relay, the probes and the tools alike."""

from kvproxy.upstream.boundary import failure_from, network_boundary
from kvproxy.upstream.connection import UpstreamConnectError, UpstreamProtocolError
from kvproxy.upstream.pool import UpstreamPool, UpstreamResponse

__all__ = [
    "UpstreamConnectError",
    "UpstreamPool",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "failure_from",
    "network_boundary",
]
