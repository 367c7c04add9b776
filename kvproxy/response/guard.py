"""The per-chunk guards of one streamed response, sans-IO: what may be forwarded, whether
it carries generated output, and which foreign markers it held.

`StreamGuard.feed(chunk)` frames the event stream (`sse.SSEParser`), reads each whole
event once (`output.read_payload`: every string with its path, and whether it is
generated output), feeds the strings to the canary scanner, and returns the bytes of the
events the chunk completed. While a scanner is active only whole, scanned events are
forwarded: an event cut across reads is held until its end arrives, so a marker can never
reach the client in the first half of an event whose second half would have been
withheld. Without one too (an endless line must end in a clean error event). The relay
(`relay.py`) owns the sockets, the drain machine and the metrics; this module owns none.

Cost: one JSON decode and one walk per event until the first output; after it, only
events the scanner cannot prove marker-free from their bytes (`CanaryScanner.skips`: a
backslash, or a marker's first character in them or in a kept tail) are decoded, the
others are only framed (and the `usage` of the last one read).

Must never: log, touch a socket, or keep more than one incomplete event.
"""

from __future__ import annotations

from kvproxy.response import sse
from kvproxy.response.payload import SEP, read_payload
from kvproxy.response.tripwire import CanaryHit, CanaryScanner
from kvproxy.response.usage import prompt_tokens_in

# Comments, `event:` and `id:` lines of the stream: the client receives them too.
OTHER_LINES_PATH = SEP + "sse"


class StreamGuard:
    """One `text/event-stream` response. Raises `sse.SSEError` from `feed` when an event
    outgrows the parser's bound (a broken upstream)."""

    __slots__ = ("hits", "output_seen", "parser", "prompt_tokens", "scanner")

    def __init__(self, scanner: CanaryScanner | None) -> None:
        self.scanner = scanner
        self.parser = sse.SSEParser(sse.DEFAULT_MAX_EVENT_BYTES)  # read now: tests lower it
        self.output_seen = False
        self.prompt_tokens: int | None = None  # from the last `usage` seen
        self.hits: list[CanaryHit] = []  # new since the last feed/finish

    def feed(self, chunk: bytes) -> tuple[bytes, bool]:
        """The bytes to forward (whole events only) and whether they carry output."""
        framed = self.parser.feed_chunk(chunk)
        self.hits = []
        scanner = self.scanner
        output = False
        for payload in framed.payloads:
            # After the first output only the scan and `usage` need an event, and an event
            # the scanner proves marker-free (`CanaryScanner.skips`) needs no decode.
            if self.output_seen and (scanner is None or scanner.skips(payload)):
                if b'"usage"' in payload:
                    self._usage_from(payload)
                continue
            reading = read_payload(payload)
            if reading.prompt_tokens is not None:
                self.prompt_tokens = reading.prompt_tokens
            if reading.output:
                output = self.output_seen = True
            if scanner is not None and reading.texts:
                hit = scanner.feed(reading.paths, reading.texts)
                if hit is not None:
                    self.hits.append(hit)
        if framed.other and scanner is not None:
            lines = "\n".join(line.decode("utf-8", "replace") for line in framed.other)
            hit = scanner.feed([OTHER_LINES_PATH], [lines])
            if hit is not None:
                self.hits.append(hit)
        # Whole events only, scanner or not: an event cut across reads waits for its end
        # (engines write whole events, so this holds nothing in practice), and a line that
        # never ends is never half-forwarded: past the bound the client gets the error
        # event as an event of its own, not glued to the tail of a broken line.
        return framed.forward, output

    def finish(self) -> bytes:
        """At EOF: the bytes of an event the stream ended inside (scanned like a body, as
        a client that shows raw text would see them), to forward unless they hit."""
        self.hits = []
        if self.scanner is None:
            return b""  # already forwarded as they came
        rest = self.parser.take_pending()
        if rest:
            hit = self.scanner.scan_body(rest)
            if hit is not None:
                self.hits.append(hit)
        return rest

    def _usage_from(self, payload: bytes) -> None:
        n = prompt_tokens_in(payload)
        if n is not None:
            self.prompt_tokens = n
