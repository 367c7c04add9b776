"""Request and response headers (kvproxy/serve/headers.py): hop-by-hop filtering (the fast
copy-and-delete holds equal to the plain definition: every header but hop-by-hop ones and
those Connection names, in order), the request head's bounds, and X-Forwarded-For."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from kvproxy.serve.headers import (
    HOP_BY_HOP,
    MAX_FIELD_BYTES,
    filter_headers,
    request_head_error,
    set_forwarded_for,
)

NAMES = ["Connection", "connection", "Keep-Alive", "TE", "Host", "Content-Length",
         "Transfer-Encoding", "X-Request-ID", "x-request-id", "Authorization", "X-Drop",
         "x-drop", "Accept", "Upgrade", "Proxy-Authorization", "Trailer"]  # fmt: skip
VALUES = st.sampled_from(["close", "keep-alive", "X-Drop", " x-drop , te", "a", "", ",,"])


def plain(headers: CIMultiDict[str]) -> list[tuple[str, str]]:
    named = {t.strip().lower() for v in headers.getall("Connection", []) for t in v.split(",")}
    return [(k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP | named]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(NAMES), VALUES), max_size=12))
def test_filter_equals_the_plain_definition(items: list[tuple[str, str]]) -> None:
    headers = CIMultiDict(items)
    assert list(filter_headers(headers).items()) == plain(headers)


def test_connection_named_headers_and_hop_by_hop_go() -> None:
    h = CIMultiDict([("Connection", "close, X-Secret"), ("X-Secret", "1"), ("Host", "a"),
                     ("X-Keep", "2"), ("Transfer-Encoding", "chunked")])  # fmt: skip
    assert list(filter_headers(h).items()) == [("X-Keep", "2")]


# --- the request head's bounds (#31.6) -------------------------------------------------------


def raw(n: int, value_bytes: int) -> tuple[tuple[bytes, bytes], ...]:
    return tuple((b"X-H%d" % i, b"v" * value_bytes) for i in range(n))


def test_the_request_head_is_bounded_in_fields_and_in_bytes() -> None:
    assert request_head_error(raw(100, 10), "/v1/chat/completions", 60 * 1024, 100) is None
    many = request_head_error(raw(101, 10), "/", 60 * 1024, 100)
    assert many is not None
    assert (many.status, many.code) == (431, "request_header_fields_too_large")
    assert "101 header fields" in many.message
    assert "KVPROXY_MAX_REQUEST_HEADERS" in many.message
    # The case: 120 fields of 8 KB each (939 KiB), under aiohttp's own limits.
    big = request_head_error(raw(120, 8000), "/", 60 * 1024, 128)
    assert big is not None
    assert "KVPROXY_MAX_REQUEST_HEAD_BYTES" in big.message
    assert "v" * 8 not in big.message  # names the size, never quotes a value


def test_the_byte_bound_counts_the_request_line_and_every_line_ending() -> None:
    fields = ((b"Host", b"a"), (b"X-Pad", b"p" * 100))
    target = "/v1/chat/completions?x=1"
    # "POST " + target + " HTTP/1.1\r\n" at most, "Host: a\r\n", "X-Pad: ...\r\n", "\r\n"
    size = len(target) + 16 + (4 + 1 + 4) + (5 + 100 + 4)
    assert request_head_error(fields, target, size, 100) is None
    assert request_head_error(fields, target, size - 1, 100) is not None


# --- X-Forwarded-For (#31.5) ----------------------------------------------------------------


def forwarded(
    received: list[tuple[str, str]], peer: str | None, hops: int | None
) -> CIMultiDict[str]:
    incoming = CIMultiDictProxy(CIMultiDict(received))
    out = filter_headers(incoming)
    set_forwarded_for(out, incoming, peer, hops)
    return out


def test_by_default_the_peer_is_appended_to_what_was_received() -> None:
    received = [
        ("X-Forwarded-For", "1.2.3.4"),
        ("x-forwarded-for", "5.6.7.8, 9.9.9.9"),
        ("X-Real-IP", "1.2.3.4"),
    ]
    out = forwarded(received, "10.0.0.7", None)
    assert out.getall("X-Forwarded-For") == ["1.2.3.4, 5.6.7.8, 9.9.9.9, 10.0.0.7"]
    assert out["X-Real-IP"] == "1.2.3.4"
    assert forwarded([], "::1", None)["X-Forwarded-For"] == "::1"
    assert "X-Forwarded-For" not in forwarded([], None, None)  # the client is already gone


def test_with_no_trusted_hop_the_client_cannot_name_its_address() -> None:
    out = forwarded(
        [
            ("X-Forwarded-For", "1.2.3.4"),
            ("x-forwarded-for", "5.6.7.8, 9.9.9.9"),
            ("Forwarded", "for=1.2.3.4"),
            ("X-Real-IP", "1.2.3.4"),
            ("X-Forwarded-Proto", "https"),
            ("X-Forwarded-Host", "bank.example"),
            ("Accept", "*/*"),
        ],
        "10.0.0.7",
        0,
    )
    assert list(out.items()) == [("Accept", "*/*"), ("X-Forwarded-For", "10.0.0.7")]


def test_trusted_hops_keep_what_the_proxies_in_front_appended() -> None:
    received = [("X-Forwarded-For", "6.6.6.6, 1.2.3.4"), ("X-Forwarded-For", "10.0.0.2")]
    assert forwarded(received, "10.0.0.9", 1)["X-Forwarded-For"] == "10.0.0.2, 10.0.0.9"
    assert forwarded(received, "10.0.0.9", 2)["X-Forwarded-For"] == "1.2.3.4, 10.0.0.2, 10.0.0.9"
    assert forwarded([("Forwarded", "for=x")], "10.0.0.9", 1)["Forwarded"] == "for=x"
    # Fewer addresses than hops: what there is, then the peer.
    assert forwarded([], "::1", 3)["X-Forwarded-For"] == "::1"
    assert "X-Forwarded-For" not in forwarded([], None, 0)  # the client is already gone


@settings(max_examples=300, deadline=None)
@given(
    addresses=st.lists(st.sampled_from(["1.1.1.1", "2.2.2.2", " 3.3.3.3 ", "", "::1"]), max_size=6),
    hops=st.none() | st.integers(0, 4),
)
def test_the_peer_is_always_last_and_at_most_hops_addresses_come_before_it(
    addresses: list[str], hops: int | None
) -> None:
    out = forwarded([("X-Forwarded-For", ",".join(addresses))], "10.0.0.1", hops)
    chain = [a.strip() for a in out["X-Forwarded-For"].split(",")]
    assert chain[-1] == "10.0.0.1"
    received = [a.strip() for a in ",".join(addresses).split(",")]
    if hops is None:
        assert out["X-Forwarded-For"] == ", ".join([",".join(addresses), "10.0.0.1"])
    else:
        assert chain[:-1] == ([a for a in received if a][-hops:] if hops else [])


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(
        st.tuples(st.integers(1, 64), st.integers(0, MAX_FIELD_BYTES - 70)), max_size=12
    ),
    limit=st.integers(1024, 120 * 1024),
)
def test_the_short_cut_for_few_fields_agrees_with_adding_them_up(
    sizes: list[tuple[int, int]], limit: int
) -> None:
    # Fields as aiohttp lets them through (a line of at most MAX_FIELD_BYTES).
    fields = tuple((b"n" * n, b"v" * v) for n, v in sizes)
    target = "/v1/chat/completions"
    plain = len(target) + 16 + sum(len(k) + len(v) + 4 for k, v in fields)
    got = request_head_error(fields, target, limit, 100)
    assert (got is not None) == (plain > limit)
