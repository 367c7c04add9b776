"""Which request and response headers cross the proxy: hop-by-hop headers (RFC 9110
section 7.6.1), and those the Connection header names, stay on their own connection. Shared
by the handler (request headers going up) and the relay (response headers coming back).

Also the request head's bounds (`request_head_error`) and what the upstream is told about
the client's address (`set_forwarded_for`). Never logs or echoes a header's value.
"""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy, istr

from kvproxy.policy import KvproxyError, errors

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
    """Drop hop-by-hop headers, including those the Connection header names; the others
    keep their order. A copy and a few deletions in multidict's C code, not a Python loop
    over every header (twice per request)."""
    out: CIMultiDict[str] = CIMultiDict(headers)
    for value in headers.getall("Connection", ()):
        for token in value.split(","):
            out.popall(token.strip(), None)
    # The hop-by-hop names present, found by multidict's C set operation, which matches
    # case-insensitively (a Python test per known name was a dozen lines per call, and
    # lower-casing every name into a set for an intersection cost a third more than this);
    # usually Host and Content-Length, or none.
    for name in headers.keys() & HOP_BY_HOP:
        out.popall(name, None)
    return out


# What aiohttp's parser lets through, per line (its defaults, passed to it explicitly by
# kvproxy.serve.app so that this bound and its own stay one number): a field's name and value
# together, and the request line.
MAX_FIELD_BYTES = 8190
MAX_LINE_BYTES = 8190


def request_head_error(
    raw_headers: tuple[tuple[bytes, bytes], ...], target: str, max_bytes: int, max_fields: int
) -> KvproxyError | None:
    """431 when the request head (its request line and field lines, as received) is over
    `max_bytes` or has more than `max_fields` fields; None when it fits. aiohttp bounds each
    line (8,190 bytes) and the count (128) by itself, not the total: 120 fields of 8 KB each
    (939 KiB) passed."""
    count = len(raw_headers)
    if count > max_fields:
        what = f"the request has {count:,} header fields"
        return errors.request_head_too_large(what, max_fields, "max_request_headers")
    # "METHOD target HTTP/1.1" CRLF, each field "name: value" CRLF, the blank line: the
    # method is at most 7 bytes among those kvproxy forwards; 16 covers the rest.
    size = len(target) + 16 + 4 * count
    if size + count * MAX_FIELD_BYTES <= max_bytes:
        return None  # a few fields cannot be too large: no need to add them up
    for name, value in raw_headers:
        size += len(name) + len(value)
    if size > max_bytes:
        what = f"the request head is {size:,} bytes"
        return errors.request_head_too_large(what, max_bytes, "max_request_head_bytes")
    return None


# What a client could write to pass for another address or scheme, besides X-Forwarded-For.
FORWARDING = tuple(
    istr(name)
    for name in (
        "Forwarded",
        "X-Real-IP",
        "X-Forwarded-Host",
        "X-Forwarded-Proto",
        "X-Forwarded-Port",
    )
)
_XFF = istr("X-Forwarded-For")


def set_forwarded_for(
    headers: CIMultiDict[str],
    received: CIMultiDictProxy[str],
    peer: str | None,
    trusted_hops: int | None,
) -> None:
    """X-Forwarded-For for the upstream, in place: the peer's address appended to the one
    received (nginx's $proxy_add_x_forwarded_for, Envoy's use_remote_address). It is read
    from the right: the last address is the one kvproxy saw, each before it was written by
    the hop before; the first ones are whatever the client wrote.

    `trusted_hops` (Envoy's xff_num_trusted_hops): how many proxies in front of kvproxy
    append to it. Only the addresses they appended (the last `trusted_hops` received) are
    kept; what came before them, which no proxy vouches for, is dropped. 0: only the peer's
    address, and the other forwarding fields (FORWARDING) are dropped too. None: everything
    received is kept (append only)."""
    if trusted_hops is None:
        chain = received.getall(_XFF, None)
        if chain is None:
            if peer:
                headers[_XFF] = peer
            return
        if peer:
            chain.append(peer)
        headers[_XFF] = ", ".join(chain)  # one line: the list the received lines made
        return
    kept: list[str] = []
    if trusted_hops:
        for value in received.getall(_XFF, ()):
            kept += (a.strip() for a in value.split(","))
        kept = [a for a in kept if a][-trusted_hops:]
    else:
        for name in FORWARDING:
            headers.popall(name, None)
    headers.popall(_XFF, None)
    if peer:
        kept.append(peer)
    if kept:
        headers[_XFF] = ", ".join(kept)
