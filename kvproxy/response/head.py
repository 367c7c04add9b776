"""What the relay's upstream client accepts of a response head, sans-IO: the status line and
fields llhttp parsed (kvproxy/upstream/connection.py feeds them here) in, the fields to relay and
the body's framing out, or an UpstreamProtocolError.

llhttp's strict reading plus these rules, each where llhttp is laxer than h11 (the
reference tests/upstream/test_upstream_h11.py holds the client to) or than RFC 9110/9112:
- a status code in 100..599 (RFC 9110 §15: llhttp reads `099` as 99);
- a reason phrase of HTAB, SP, VCHAR and obs-text only (RFC 9112 §4; llhttp passes NUL);
- at most one Transfer-Encoding field line, and then only `chunked` (RFC 9112 §6.1:
  llhttp reads `gzip, chunked` as chunked and `chunked,` or `gzip` as close-delimited,
  which would relay still-coded bytes past the tripwire; h11 refuses all of them);
- an interim (1xx) response with neither Transfer-Encoding nor a non-zero Content-Length
  (RFC 9110 §15.2: a 1xx has no content; llhttp reads a body for 104-199, which reached
  the client in front of the real one; h11 reads the next response right after the head;
  a 1xx that frames a body makes the two disagree, so it is refused);
- field values that are UTF-8 (the relay writes them through aiohttp, which writes str:
  other bytes could not be relayed as received), without trailing whitespace (RFC 9110
  §5.5; llhttp strips only the leading).
The byte and field bounds are counted as bytes arrive, in upstream_conn.py.

Must never: touch a socket, or quote a field's value in an error (it is upstream input).
"""

from __future__ import annotations

import re

from multidict import CIMultiDict

# What a reason phrase may not hold (RFC 9112 §4: HTAB / SP / VCHAR / obs-text only).
_REASON_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


class UpstreamProtocolError(Exception):
    """The upstream sent bytes that are not a readable HTTP/1.1 response."""


def check_status(status: int, reason: bytes | bytearray) -> str:
    """The reason phrase as text, if the status line is one kvproxy relays."""
    if not 100 <= status <= 599:
        raise UpstreamProtocolError(f"status code {status} is not in 100..599")
    text = reason.decode("latin-1")
    # isprintable() is the fast yes for the usual phrases; it is also false for HTAB and
    # obs-text, which are allowed: only then the exact rule.
    if not text.isprintable() and _REASON_CTL.search(reason):
        raise UpstreamProtocolError("a control character in the reason phrase")
    return text


def check_interim(status: int, fields: list[tuple[bytes, bytes]]) -> None:
    """An interim (1xx) head: refused if it frames a body (see the module docstring)."""
    for name, value in fields:
        lower = name.lower()
        if lower == b"transfer-encoding" or (
            lower == b"content-length" and value.strip(b" \t").lstrip(b"0")
        ):
            raise UpstreamProtocolError(f"an interim {status} response frames a body")


def final_fields(fields: list[tuple[bytes, bytes]]) -> tuple[CIMultiDict[str], bool, bool]:
    """The final head's fields as relayed, and whether the body is chunked and whether it
    has a length (llhttp already refused a bad or second Content-Length, and one with
    Transfer-Encoding)."""
    headers: CIMultiDict[str] = CIMultiDict()
    chunked = has_length = False
    codings = 0
    for name, value in fields:
        key = name.decode("latin-1")  # llhttp let only token characters through
        try:
            text = value.rstrip(b" \t").decode("utf-8")
        except UnicodeDecodeError:
            raise UpstreamProtocolError(f"the value of {key} is not UTF-8") from None
        headers.add(key, text)
        lower = key.lower()
        if lower == "content-length":
            has_length = True
        elif lower == "transfer-encoding":
            codings += 1
            chunked = text.lower() == "chunked"
    if codings and (codings > 1 or not chunked):
        raise UpstreamProtocolError("a transfer coding other than one `chunked`")
    return headers, chunked, has_length
