"""Which request and response headers cross the proxy: hop-by-hop headers (RFC 9110
section 7.6.1), and those the Connection header names, stay on their own connection. Shared
by the handler (request headers going up) and the relay (response headers coming back)."""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Host",
        "Content-Length",
    )
)


def filter_headers(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> CIMultiDict[str]:
    """Drop hop-by-hop headers, including those the Connection header names."""
    named = {tok.strip().lower() for v in headers.getall("Connection", []) for tok in v.split(",")}
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        lk = k.lower()
        if lk in HOP_BY_HOP or lk in named:
            continue
        out.add(k, v)
    return out
