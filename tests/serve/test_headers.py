"""Hop-by-hop filtering (kvproxy/serve/headers.py): the fast copy-and-delete holds equal to the
plain definition (every header but hop-by-hop ones and those Connection names, in order)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from kvproxy.serve.headers import HOP_BY_HOP, filter_headers

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
