"""Where an upstream URL points, as the relay's client needs it: the one place kvproxy
decides what a configured router URL may be (sans-IO: parsed once at configuration, so a bad
upstream is a start-up error, not a first request's 502)."""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import urlsplit


class Origin(NamedTuple):
    """Where requests for one upstream URL go: scheme, host, port, the Host header and any
    path prefix the URL carries (requests' targets are appended to it)."""

    host: str
    port: int
    tls: bool
    host_header: bytes
    prefix: str


def parse_origin(url: str) -> Origin:
    """Raises ValueError for anything but an absolute http(s) URL without query or userinfo."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"upstream must be an http:// or https:// URL, got {url!r}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"upstream must not carry a query, fragment or credentials: {url!r}")
    tls = parts.scheme == "https"
    default = 443 if tls else 80
    port = parts.port or default
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    header = shown if port == default else f"{shown}:{port}"
    return Origin(host, port, tls, header.encode("idna"), parts.path.rstrip("/"))
