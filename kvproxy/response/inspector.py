"""The response inspector, sans-IO: bytes of one upstream response in; what may be
forwarded, whether it carried generated output, which foreign markers it held, the
`usage` it reported and whether it must be withheld, out.

The relay (`relay.py`) owns the sockets, the drain machine, the metrics and the logs; it
feeds every chunk here and executes what comes back. This module owns the reading: an
event stream goes through `guard.StreamGuard` (whole, scanned events only), any other body
is kept, up to a bound, to read its `usage` and to scan it whole at its end
(`canary.CanaryScanner.scan_body`).

Two bounds, and why each:
- `KEEP_BODY_BYTES` (8 MiB): without a tripwire the body is kept only to read `usage`,
  which a JSON body carries at its top level; past this it is not kept.
- `SCAN_BODY_BYTES` (64 MiB): with a tripwire the whole body is scanned. In block mode it
  is held until scanned, so a body past this bound is refused (`upstream_bad_response`)
  rather than delivered unscanned; in observe mode it is relayed as it comes and the
  inspector reports once that the rest went unscanned.

Must never: log, touch a socket, or keep more than one body (or one incomplete event).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvproxy.policy import KvproxyError, errors
from kvproxy.response.guard import StreamGuard
from kvproxy.response.tripwire import CanaryHit, CanaryScanner
from kvproxy.response.usage import prompt_tokens_in

KEEP_BODY_BYTES = 8 * 1024 * 1024
SCAN_BODY_BYTES = 64 * 1024 * 1024


@dataclass(slots=True)
class Step:
    """What one chunk (or the end of the response) means for the relay.

    `forward`: the bytes to send to the client now (empty while held). `output`: they carry
    generated output (the drain machine's "a token arrived"). `hits`: markers newly seen,
    to count and log. `withhold`: a hit in block mode: the rest of the response must not
    reach the client. `refuse`: the response cannot be delivered at all (too large to
    scan while held)."""

    forward: bytes
    output: bool = False
    # A tuple: the common step has none, and a shared empty tuple costs no list per chunk.
    hits: tuple[CanaryHit, ...] = ()
    withhold: bool = False
    refuse: KvproxyError | None = None


class ResponseInspector:
    """One upstream response. `sse`: it is an event stream. `hold`: a non-streamed body is
    held until scanned (block mode with a tripwire). `read_usage`: a body's `usage` is read
    at its end (the request did not ask for a stream). Raises `sse.SSEError` from `feed`
    when one event outgrows the parser's bound."""

    __slots__ = (
        "block",
        "guard",
        "hold",
        "keep_limit",
        "kept",
        "prompt_tokens",
        "read_usage",
        "scan_limit",
        "scanner",
        "truncated",
    )

    def __init__(
        self,
        scanner: CanaryScanner | None,
        *,
        sse: bool,
        block: bool,
        read_usage: bool,
    ) -> None:
        self.scanner = scanner
        self.block = block
        self.guard = StreamGuard(scanner) if sse else None
        self.hold = scanner is not None and block and not sse
        self.read_usage = read_usage
        # Read now, not at import: tests lower them.
        self.scan_limit = SCAN_BODY_BYTES
        self.keep_limit = SCAN_BODY_BYTES if scanner is not None else KEEP_BODY_BYTES
        self.kept = bytearray()
        self.prompt_tokens: int | None = None  # from the last `usage` seen
        self.truncated = False  # observe mode: the body outgrew the scan; reported once

    def feed(self, chunk: bytes) -> Step:
        """Read one chunk: for an event stream, the whole events it completed."""
        guard = self.guard
        if guard is None:
            return Step(chunk)
        forward, output = guard.feed(chunk)
        if guard.prompt_tokens is not None:
            self.prompt_tokens = guard.prompt_tokens
        return self._with_hits(Step(forward, output), guard.hits)

    def keep(self, chunk: bytes) -> Step:
        """A chunk the drain machine let through: hold it (block mode), or remember it for
        the end-of-body reading and forward it."""
        if self.guard is not None:
            return Step(chunk)
        if self.hold:
            self.kept += chunk
            if len(self.kept) > self.scan_limit:
                return Step(b"", refuse=errors.upstream_bad_response("response too large to scan"))
            return Step(b"")
        if len(self.kept) < self.keep_limit:
            self.kept += chunk
            if len(self.kept) >= self.keep_limit and self.scanner is not None:
                self.truncated = True
        return Step(chunk)

    def finish(self) -> Step:
        """At EOF: an event stream's unfinished tail (scanned as a body), or the kept body's
        reading: its `usage`, its scan, and, when held, the body itself to deliver."""
        guard = self.guard
        if guard is not None:
            rest = guard.finish()
            return self._with_hits(Step(rest), guard.hits)
        body = bytes(self.kept)
        step = Step(body if self.hold else b"")
        if not body:
            return step
        if self.read_usage:
            # The same reading of `usage` the stream guard uses.
            tokens = prompt_tokens_in(body)
            if tokens is not None:
                self.prompt_tokens = tokens
        if self.scanner is not None:
            hit = self.scanner.scan_body(body)
            if hit is not None:
                self._with_hits(step, [hit])
        return step

    def _with_hits(self, step: Step, hits: list[CanaryHit]) -> Step:
        if hits:
            step.hits = tuple(hits)
            step.withhold = self.block
        return step
