"""Server-sent event framing, sans-IO.

Owns: splitting an upstream `text/event-stream` into events (`SSEParser`): each event's
`data`, the other lines a client also receives (comments, `event:`, `id:`), and the bytes
of the events a chunk completed, which are all the relay may forward (an event is
forwarded only once it is whole and has been scanned). What the payloads mean is
`kvproxy.response.payload`'s job.

Must never: touch a socket, log anything, or keep more than one event's bytes (an event
larger than `max_event_bytes` is an error, not unbounded memory).
"""

from __future__ import annotations

from typing import NamedTuple

from kvproxy.policy import record

# One event is one token's worth of JSON in practice (< 4 KiB); a non-streamed-style body
# sent as a single event can be large (n choices x long outputs). 16 MiB bounds memory while
# never cutting a legitimate response short.
DEFAULT_MAX_EVENT_BYTES = 16 * 1024 * 1024
_BOM = b"\xef\xbb\xbf"


class SSEError(ValueError):
    """The stream cannot be parsed within bounds (an event exceeded `max_event_bytes`)."""


class Framed(NamedTuple):  # a tuple: built once per chunk on the hot path
    """What one chunk completed: the `data` payloads, the other lines (comments and
    non-data fields, without their line end), and `forward`, the bytes of the complete
    events (line endings normalised to \\n) in order; an incomplete event stays held."""

    payloads: list[bytes]
    other: list[bytes]
    forward: bytes


@record
class SSEEvent:
    """One complete event: its `data` (lines joined by \\n; None when it had no data line,
    e.g. a keep-alive comment) and `raw`, the event's bytes with line endings normalised to
    \\n, ending in the blank line, ready to forward unchanged."""

    data: bytes | None
    raw: bytes


class SSEParser:
    """Incremental event-stream parser (WHATWG rules, minus `event`/`id`/`retry`, which the
    proxy does not need): lines end in \\n, \\r\\n or \\r, possibly split across chunks; an
    event ends at a blank line; lines starting with ':' are comments; `data:` lines of one
    event are joined with \\n. An incomplete event at EOF is discarded, as the spec says."""

    __slots__ = (
        "_block_start",
        "_buf",
        "_data",
        "_line_start",
        "_max",
        "_other",
        "_skip_lf",
        "_started",
    )

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        if max_event_bytes < 1:
            raise ValueError("max_event_bytes must be >= 1")
        self._max = max_event_bytes
        # Holds the current, incomplete event only (from _block_start on after each feed).
        self._buf = bytearray()
        self._block_start = 0
        self._line_start = 0
        self._data: list[bytes] = []
        self._skip_lf = False  # the previous chunk ended in \r: a leading \n pairs with it
        self._started = False
        self._other: list[bytes] = []  # non-data lines seen since the last feed_chunk

    @property
    def pending_bytes(self) -> int:
        """Bytes of an event not yet complete (discarded if the stream ends now)."""
        return len(self._buf)

    def feed(self, chunk: bytes) -> list[bytes]:
        """The `data` payloads of the events this chunk completes."""
        return self.feed_chunk(chunk).payloads

    def feed_chunk(self, chunk: bytes) -> Framed:
        """Payloads, other lines and the forwardable bytes of the events this chunk
        completes."""
        other: list[bytes] = []
        self._other = other
        fast = self._feed_whole_events(chunk, other)
        if fast is not None:
            return Framed(fast, other, chunk)
        events = self.feed_events(chunk)
        payloads = [ev.data for ev in events if ev.data is not None]
        return Framed(payloads, other, b"".join(ev.raw for ev in events))

    def take_pending(self) -> bytes:
        """The bytes of the incomplete event (the stream ended inside it), and forget them."""
        out = bytes(self._buf)
        self._buf.clear()
        self._block_start = self._line_start = 0
        self._data = []
        return out

    def _feed_whole_events(self, chunk: bytes, other: list[bytes]) -> list[bytes] | None:
        """The relay's hot path: a chunk that is exactly whole one-line events
        (`data: {...}\n\n` each, as engines write them), with nothing pending. Parsed with
        two C-level splits instead of the line loop; any other shape returns None before
        touching state, and the general parser takes it (same result, tested)."""
        if (
            self._buf
            or self._skip_lf
            or not self._started
            or not chunk.endswith(b"\n\n")
            or b"\r" in chunk
        ):
            return None
        blocks = chunk[:-2].split(b"\n\n")
        out: list[bytes] = []
        for line in blocks:
            if not line or b"\n" in line:
                del other[:]
                return None  # a blank run or a multi-line event: the general parser
            if line.startswith(b"data:"):
                out.append(line[6:] if line[5:6] == b" " else line[5:])
            elif line == b"data":
                out.append(b"")
            else:
                other.append(line)  # a comment or another field: the client gets it too
        return out

    def feed_events(self, chunk: bytes) -> list[SSEEvent]:
        """Every event (data-less ones included) this chunk completes, in order."""
        chunk = self._normalise(chunk)
        if not chunk:
            return []
        buf = self._buf
        scan_from = len(buf)  # older bytes hold no newline past _line_start
        buf += chunk
        events: list[SSEEvent] = []
        pos = self._line_start
        nl = buf.find(b"\n", max(pos, scan_from))
        while nl >= 0:
            if nl == pos:
                events.append(self._dispatch(nl))
            else:
                name, colon, value = buf[pos:nl].partition(b":")
                if name == b"data":
                    if colon and value[:1] == b" ":
                        value = value[1:]
                    self._data.append(bytes(value))
                else:  # a comment (':' first) or another field: scanned, not parsed
                    self._other.append(bytes(buf[pos:nl]))
            pos = nl + 1
            nl = buf.find(b"\n", pos)
        self._line_start = pos
        if self._block_start:
            del buf[: self._block_start]
            self._line_start -= self._block_start
            self._block_start = 0
        if len(buf) > self._max:
            raise SSEError(
                f"server-sent event larger than {self._max:,} bytes "
                f"({len(buf):,} bytes without an end)"
            )
        return events

    def _dispatch(self, nl: int) -> SSEEvent:
        raw = bytes(self._buf[self._block_start : nl + 1])
        data = b"\n".join(self._data) if self._data else None
        self._data = []
        self._block_start = nl + 1
        return SSEEvent(data=data, raw=raw)

    def _normalise(self, chunk: bytes) -> bytes:
        if not self._started and chunk:
            self._started = True
            if chunk.startswith(_BOM):
                chunk = chunk[len(_BOM) :]
        if self._skip_lf and chunk:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if b"\r" in chunk:
            # A trailing \r already ends a line; a \n opening the next chunk completes it.
            self._skip_lf = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        return chunk
