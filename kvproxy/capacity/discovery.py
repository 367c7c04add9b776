"""Engine discovery: a configured engine URL whose host name resolves to several
addresses (a Kubernetes headless Service) stands for one engine per address.

Re-resolved on every refresh by the monitor. A name that resolves to one address keeps
its label, so ordinary single-host names ("localhost", a ClusterIP Service) look the same
on /capacity and in metrics as they are configured; several addresses become one engine
each, labelled by address. When a name
has both IPv4 and IPv6 addresses only the IPv4 ones count: dual-stack records name the
same pods twice, and counting both would double every engine.

Must never: invent an engine, or silently drop one (a name that does not resolve is a
`dns` ProbeError for the caller to account for).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable

from yarl import URL

from kvproxy.capacity.measurement import ProbeError
from kvproxy.config import EngineSpec
from kvproxy.policy import UpstreamFailure
from kvproxy.upstream import network_boundary

# (host, port) -> addresses. Injected in tests; the default asks the system resolver.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _prefer_family(addresses: list[str]) -> list[str]:
    parsed: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    # Sorted by numeric value so the engine order (and log lines) are stable.
    for addr in addresses:
        try:
            parsed.append(ipaddress.ip_address(addr.split("%", 1)[0]))
        except ValueError:
            continue
    v4 = sorted({int(a) for a in parsed if a.version == 4})
    if v4:
        return [str(ipaddress.IPv4Address(a)) for a in v4]
    return [str(ipaddress.IPv6Address(a)) for a in sorted({int(a) for a in parsed})]


async def expand_engine(
    spec: EngineSpec, resolver: Resolver, timeout_s: float
) -> tuple[EngineSpec, ...]:
    """The engines `spec` stands for right now; ProbeError("dns") if its name fails."""
    if spec.kind == "static":
        return (spec,)
    url = URL(spec.url)
    host = url.host or ""
    if not host or _is_ip(host):
        return (spec,)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with network_boundary():  # socket.gaierror is an OSError: the seam maps it too
            async with asyncio.timeout(timeout_s):
                addresses = await resolver(host, port)
    except UpstreamFailure as failure:
        if failure.kind == "timeout":
            raise ProbeError("dns", f"resolving {host} took over {timeout_s:g} s") from None
        raise ProbeError("dns", f"resolving {host} failed ({failure.cause})") from None
    chosen = _prefer_family(addresses)
    if not chosen:
        raise ProbeError("dns", f"{host} resolved to no usable address")
    if len(chosen) == 1:
        if url.scheme != "http":
            return (spec,)  # TLS needs the name for SNI and certificate checks
        # Keep the configured label; connect to the address we resolved, so one refresh
        # resolves each name once and the probe hits the pod discovery saw.
        return (spec.model_copy(update={"url": str(url.with_host(chosen[0])), "name": spec.label}),)
    engines = []
    for addr in chosen:
        member = url.with_host(addr)
        hostport = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
        label = f"{spec.name}/{hostport}" if spec.name else hostport
        engines.append(spec.model_copy(update={"url": str(member), "name": label}))
    return tuple(engines)
