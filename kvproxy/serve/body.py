"""Request bodies: read them bounded, and undo their Content-Encoding for counted routes.

Owns what kvproxy forwards for a compressed request body. The public server is started with
`auto_decompress=False`, so aiohttp hands us the bytes as they came off the wire and this
module alone decides:

    Content-Encoding (after dropping `identity`)   counted route            pass-through
    none                                           bytes as sent            bytes as sent
    gzip | x-gzip | deflate (one coding)           decoded, header removed  bytes as sent
    undecodable data under one of those            400 naming the header    bytes as sent
    br, zstd, compress, unknown, or stacked        415 + Accept-Encoding    bytes as sent

Why decoded bytes are forwarded on counted routes, with `Content-Encoding` (and the digests
that describe the encoded bytes) removed and the length recomputed by the client: kvproxy
must count exactly what the engine will tokenize (I1), and neither SGLang nor vLLM decodes
request bodies (both are FastAPI/uvicorn apps; Starlette's GZipMiddleware only compresses
responses), so the original gzip bytes would be a request the engine cannot read. Forwarding
the decoded bytes is also what `decode_policy: clamp` does anyway (it re-serialises).
Pass-through routes are not parsed, so their bytes go on untouched with their own headers:
the label stays true.

Bounds: the wire bytes are bounded by `max_body_bytes` while reading, and so are the decoded
bytes while inflating (413): a zip bomb costs at most `max_body_bytes` of output. Bodies above
`INLINE_INFLATE_BYTES` of wire bytes are inflated in a worker thread (zlib releases the GIL),
so neither a 32 MiB decode nor a bomb stalls the event loop. A counted body above
`LARGE_BODY_BYTES` is parsed here, in steps the event loop runs between (`parse_large`).
Never logs or quotes body content (I8).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Iterable
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from kvproxy.policy import KvproxyError, errors, record
from kvproxy.prompt import load_json_in_steps

# Content codings kvproxy decodes, by their token (RFC 9110 §8.4.1: case-insensitive;
# `x-gzip` is gzip's registered alias). Values are zlib `wbits`: 31 = gzip container only.
# `deflate` is the zlib format (RFC 1950) by the RFC, but raw deflate is common in the wild;
# the wrapper is sniffed from the first two bytes (see `_deflate_wbits`).
_GZIP_WBITS = 31
DECODABLE = ("gzip", "x-gzip", "deflate")
# Sent with a 415 (RFC 9110 §12.5.3: a server that refuses a coding says which it accepts).
ACCEPT_ENCODING = "gzip, deflate"
# Headers that describe the encoded bytes: wrong once the body is decoded.
ENCODED_BODY_HEADERS = (
    "Content-Encoding",
    "Content-MD5",
    "Digest",
    "Content-Digest",
    "Repr-Digest",
)
# Inflated on the loop only below this many wire bytes. The bound is on the output, not the
# input: deflate expands at most ~1032:1 (RFC 1951's longest match per 2-bit code), so 1 KiB
# can become ~1 MiB (about 2 ms here); a 64 KiB bomb inflating to the 32 MiB limit took 149 ms,
# which must never run on the event loop.
INLINE_INFLATE_BYTES = 1024
# Counted bodies above this are parsed in steps (`parse_large`); at or below it in one call
# where they are used: orjson takes 1-1.5 ms of CPU a megabyte of ASCII prose here and ~2.3
# for mixed-script text, so one call stays within a few milliseconds, and small requests
# keep their one-call path.
LARGE_BODY_BYTES = 1024 * 1024


@record
class Body:
    """A request body as read. `wire_bytes` is what came off the socket."""

    data: bytes
    wire_bytes: int
    # The coding that was undone ("gzip", "deflate"), or None when `data` is as sent.
    decoded_from: str | None = None


def read_arrived(request: web.Request, limit: int) -> tuple[bytes, bool]:
    """What of the body has already arrived, without waiting, and whether that is all of it.

    A small request's body comes in the same read as its head: taking it from the buffer
    needs no await, so the caller need not arm the body-read deadline for it. Raises 413
    past `limit`; the rest, if any, is `read_raw`'s (given these bytes as `first`)."""
    first = request.content.read_nowait()
    if len(first) > limit:
        raise errors.body_too_large(None, limit)
    return first, request.content.at_eof()


async def read_raw(request: web.Request, limit: int, first: bytes = b"") -> bytes:
    """The body exactly as sent (after `first`, what `read_arrived` took); 413 as soon as
    it passes `limit` (chunked uploads too)."""
    # Kept as they came and joined once: a bytearray grown by each chunk and copied out at
    # the end copied a 4 MB body twice more, each copy one long call on the event loop.
    chunks = [first] if first else []
    size = len(first)
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise errors.body_too_large(None, limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_large(body: bytes) -> dict[str, Any] | KvproxyError:
    """A body of more than LARGE_BODY_BYTES parsed as `load_json` would, in steps of at
    most ~`SLICE_BYTES` each (kvproxy.prompt.sliced), the event loop running between them;
    the 400 it would raise is returned."""
    steps = load_json_in_steps(body)
    try:
        while True:
            next(steps)
            await asyncio.sleep(0)
    except StopIteration as done:
        data: dict[str, Any] = done.value
        return data
    except KvproxyError as err:
        return err


def content_coding(values: Iterable[str]) -> str | None:
    """The one coding to undo, from every Content-Encoding header line; None for none.

    Raises 415 for a coding kvproxy cannot decode, and for stacked codings (each would have
    to be undone in reverse order; no client library sends them and refusing is cheaper
    than getting the order wrong)."""
    tokens = [t.strip().lower() for v in values for t in v.split(",")]
    codings = [t for t in tokens if t and t != "identity"]
    if not codings:
        return None
    if len(codings) > 1:
        raise errors.unsupported_content_encoding(
            "stacked content codings are not supported", ACCEPT_ENCODING
        )
    coding = codings[0]
    if coding not in DECODABLE:
        # The name is echoed only if it is a plain token: it is client input.
        plain = coding.isascii() and all(c.isalnum() or c in "-._" for c in coding)
        shown = coding if plain and len(coding) <= 16 else "?"
        raise errors.unsupported_content_encoding(
            f"content coding {shown!r} is not supported", ACCEPT_ENCODING
        )
    return "gzip" if coding == "x-gzip" else coding


async def decode(raw: bytes, coding: str | None, limit: int) -> Body:
    """Undo `coding` (from `content_coding`), bounded by `limit` decoded bytes."""
    if coding is None:
        return Body(raw, len(raw))
    if len(raw) <= INLINE_INFLATE_BYTES:
        data = inflate(raw, coding, limit)
    else:
        data = await asyncio.to_thread(inflate, raw, coding, limit)
    return Body(data, len(raw), coding)


def inflate(raw: bytes, coding: str, limit: int) -> bytes:
    """Decode gzip (every member) or deflate; 400 on bad data, 413 past `limit` bytes."""
    wbits = _GZIP_WBITS if coding == "gzip" else _deflate_wbits(raw)
    out = bytearray()
    rest = raw
    while True:
        d = zlib.decompressobj(wbits)
        pending = rest
        try:
            while pending and not d.eof:
                # max_length is >= 1 here (0 would mean unlimited): len(out) <= limit.
                chunk = d.decompress(pending, limit + 1 - len(out))
                out += chunk
                if len(out) > limit:
                    raise errors.body_too_large(None, limit)
                if not chunk and len(d.unconsumed_tail) == len(pending):
                    break  # no progress: cannot happen with zlib, but never loop on it
                pending = d.unconsumed_tail
        except zlib.error:
            raise _undecodable(coding, "the data is corrupt") from None
        if not d.eof:
            raise _undecodable(coding, "the data is truncated")
        rest = d.unused_data
        # gzip allows several members back to back (RFC 1952 §2.2); deflate is one stream.
        if not rest or coding != "gzip":
            break
    if rest:
        raise _undecodable(coding, "bytes follow the end of the compressed data")
    return bytes(out)


def forwarded_headers(headers: CIMultiDict[str], body: Body) -> None:
    """Make the upstream headers describe the bytes actually forwarded (in place)."""
    if body.decoded_from is None:
        return
    for name in ENCODED_BODY_HEADERS:
        headers.popall(name, None)


def _deflate_wbits(raw: bytes) -> int:
    # A zlib header: compression method 8 in the low nibble and the 16-bit header a
    # multiple of 31 (RFC 1950 §2.2). Anything else is taken as raw deflate (RFC 1951).
    if len(raw) >= 2 and raw[0] & 0x0F == 8 and (raw[0] << 8 | raw[1]) % 31 == 0:
        return 15
    return -15


def _undecodable(coding: str, why: str) -> KvproxyError:
    return errors.invalid_request(
        f"request body could not be decoded as Content-Encoding: {coding} ({why})",
        "Content-Encoding",
    )
