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


_HOP_NAMES = tuple(sorted(HOP_BY_HOP))


def filter_headers(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> CIMultiDict[str]:
    """Drop hop-by-hop headers, including those the Connection header names; the others
    keep their order. A copy and a few deletions in multidict's C code, not a Python loop
    over every header (twice per request)."""
    out: CIMultiDict[str] = CIMultiDict(headers)
    for value in headers.getall("Connection", ()):
        for token in value.split(","):
            out.popall(token.strip(), None)
    for name in _HOP_NAMES:
        if name in out:
            del out[name]
    return out
