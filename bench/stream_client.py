"""The streams-at-scale client: N SSE streams held open at once, every event timed.

Run by bench/streams.py (one process per share of the streams, pinned to the load CPU):
`python bench/stream_client.py --url URL --streams N --events K --pace-ms T --start S
--ramp R --window W0 W1 --deadline D`, times in CLOCK_MONOTONIC seconds (`time.monotonic()`,
the same clock in every process of the machine), so the harness reads the target's CPU at
W0 and W1 while this process counts the events that arrived between them. Prints one JSON
line: the tally (events in the window, lost streams by reason, histograms of the interval
between a stream's events and of the time to its first event).

Why raw asyncio protocols on uvloop and not aiohttp's client: the client has to take
tens of thousands of events a second on the same core as the upstream, and it must not be
the bottleneck; a protocol's `data_received` is one call per read, nothing more.

A stream is *lost* when it errored, got no response head, answered other than 200, went
silent for more than `--stall-s` (from its request to its first event, or between two
events), or ended with other than exactly K events and `[DONE]`. Must never: print or keep
event text, or open a connection outside loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

# Histogram bin width (ms) and bins: 0.5 ms up to 2 s, the rest in the last bin.
BIN_MS = 0.5
BINS = 4000


@dataclass
class Tally:
    """One stream's history, as the client saw it (times from `time.monotonic()`)."""

    sent_at: float = 0.0
    first_at: float = 0.0
    last_at: float = 0.0
    events: int = 0
    max_gap_s: float = 0.0
    status: int = 0
    done: bool = False
    error: str = ""


def lost_reason(t: Tally, expected: int, stall_s: float) -> str | None:
    """Why this stream counts as lost, or None when it was held to its end."""
    if t.error:
        return "error"
    if not t.status:
        return "no answer"
    if t.status != 200:
        return f"status {t.status}"
    if t.max_gap_s > stall_s:
        return "stalled"
    if not t.done or t.events != expected:
        return "ended early"
    return None


@dataclass
class Histogram:
    """Counts in fixed bins of BIN_MS (a p99 is read from counts, no list of samples)."""

    bins: dict[int, int] = field(default_factory=dict)
    count: int = 0

    def add_ms(self, ms: float) -> None:
        b = min(BINS - 1, max(0, int(ms / BIN_MS)))
        self.bins[b] = self.bins.get(b, 0) + 1
        self.count += 1

    def merge(self, other: Histogram) -> None:
        for b, c in other.bins.items():
            self.bins[b] = self.bins.get(b, 0) + c
        self.count += other.count

    def quantile_ms(self, q: float) -> float | None:
        """The upper edge of the bin holding rank q (nearest rank): a ceiling, never less."""
        if not self.count:
            return None
        rank = max(1, round(q * self.count + 0.4999))
        seen = 0
        for b in sorted(self.bins):
            seen += self.bins[b]
            if seen >= rank:
                return (b + 1) * BIN_MS
        return BINS * BIN_MS

    def as_json(self) -> dict[str, Any]:
        return {"bins": {str(b): c for b, c in sorted(self.bins.items())}, "count": self.count}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Histogram:
        return cls({int(b): int(c) for b, c in d["bins"].items()}, int(d["count"]))


@dataclass
class Run:
    """What every stream of one process shares: the schedule and the figures."""

    expected: int
    pace_s: float
    window: tuple[float, float]
    window_events: int = 0
    # Interval between consecutive events of a stream minus the pace, within the window:
    # what a stalled proxy loop adds (the upstream's timers and this client's own add too;
    # the harness measures them without a proxy, `direct`).
    late: Histogram = field(default_factory=Histogram)
    first: Histogram = field(default_factory=Histogram)


class StreamProtocol(asyncio.Protocol):
    def __init__(self, run: Run, tally: Tally, request: bytes) -> None:
        self.run = run
        self.t = tally
        self.request = request
        self.transport: asyncio.Transport | None = None
        self.head = b""
        self.in_body = False
        self.last_nl = False
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.t.sent_at = time.monotonic()
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if not self.in_body:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            line = self.head[: self.head.find(b"\r\n")].split()
            self.t.status = int(line[1]) if len(line) > 1 and line[1].isdigit() else 0
            data = self.head[end + 4 :]
            self.in_body = True
            self.head = b""
            if self.t.status != 200:
                self._close()
                return
            if not data:
                return
        self._body(data, time.monotonic())

    def _body(self, data: bytes, now: float) -> None:
        t = self.t
        # Events end in a blank line; chunked framing (CRLF) never makes "\n\n" itself.
        n = data.count(b"\n\n") + (1 if self.last_nl and data[:1] == b"\n" else 0)
        self.last_nl = data[-1:] == b"\n"
        if n:
            prev = t.last_at or t.sent_at
            gap = now - prev
            if gap > t.max_gap_s:
                t.max_gap_s = gap
            run = self.run
            w0, w1 = run.window
            if w0 <= now < w1:
                run.window_events += n
                if t.events:
                    run.late.add_ms((gap - run.pace_s) * 1e3)
            if not t.events:
                t.first_at = now
                run.first.add_ms((now - t.sent_at) * 1e3)
            t.events += n
            t.last_at = now
        tail = self.tail + data[-24:]
        self.tail = tail[-24:]
        if not t.done and b"[DONE]" in tail:
            t.done = True
        if t.done and tail.endswith(b"0\r\n\r\n"):
            self._close()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        # A reset is an error; a clean close before [DONE] is an early end (lost_reason).
        if exc is not None and not self.t.done and not self.t.error:
            self.t.error = type(exc).__name__


def request_bytes(host: str, port: int, path: str, events: int, tenant: str, key: str) -> bytes:
    body = json.dumps(
        {
            "model": "bench",
            "max_tokens": events,
            "stream": True,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Hello there, what is the capital of France?"},
            ],
        },
        separators=(",", ":"),
    ).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nX-Tenant-ID: {tenant}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _open(
    loop: asyncio.AbstractEventLoop, run: Run, t: Tally, req: bytes, addr: tuple[str, int],
    src: str,
) -> None:  # fmt: skip
    try:
        await loop.create_connection(
            lambda: StreamProtocol(run, t, req), addr[0], addr[1], local_addr=(src, 0)
        )
    except OSError as exc:
        t.error = type(exc).__name__
        t.sent_at = t.sent_at or time.monotonic()


async def drive(args: argparse.Namespace) -> dict[str, Any]:
    from payloads import API_KEY

    loop = asyncio.get_running_loop()
    host, _, port_s = args.url.removeprefix("http://").partition(":")
    port = int(port_s)
    run = Run(args.events, args.pace_ms / 1e3, (args.window[0], args.window[1]))
    reqs = [
        request_bytes(host, port, "/v1/chat/completions", args.events, tenant, API_KEY)
        for tenant in ("acme", "globex")
    ]
    tallies = [Tally() for _ in range(args.streams)]
    tasks: list[asyncio.Future[None]] = []
    # Streams open evenly over the ramp; connections come from several loopback source
    # addresses so that thousands of them never run the ephemeral ports short.
    step = args.ramp / max(1, args.streams)
    for i, t in enumerate(tallies):
        delay = max(0.0, args.start + i * step - time.monotonic())
        if delay > 0.002:
            await asyncio.sleep(delay)
        src = f"127.0.0.{1 + (i + args.offset) % args.sources}"
        tasks.append(asyncio.ensure_future(_open(loop, run, t, reqs[i % 2], (host, port), src)))
    while time.monotonic() < args.deadline and not all(t.done or t.error for t in tallies):
        await asyncio.sleep(0.1)
    now = time.monotonic()
    for t in tallies:
        if not (t.done or t.error):
            t.max_gap_s = max(t.max_gap_s, now - (t.last_at or t.sent_at or now))
    for task in tasks:
        task.cancel()
    lost: dict[str, int] = {}
    for t in tallies:
        why = lost_reason(t, args.events, args.stall_s)
        if why is not None:
            lost[why] = lost.get(why, 0) + 1
    return {
        "streams": args.streams,
        "window_events": run.window_events,
        "events_total": sum(t.events for t in tallies),
        "lost": lost,
        "late": run.late.as_json(),
        "first": run.first.as_json(),
        "max_gap_ms": round(max((t.max_gap_s for t in tallies), default=0.0) * 1e3, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--streams", type=int, required=True)
    p.add_argument("--events", type=int, required=True, help="events per stream (max_tokens)")
    p.add_argument("--pace-ms", type=float, default=50.0)
    p.add_argument("--start", type=float, required=True)
    p.add_argument("--ramp", type=float, default=1.0)
    p.add_argument("--window", type=float, nargs=2, required=True)
    p.add_argument("--deadline", type=float, required=True)
    p.add_argument("--stall-s", type=float, default=1.0)
    p.add_argument("--sources", type=int, default=4, help="loopback source addresses")
    p.add_argument("--offset", type=int, default=0, help="this process's first source index")
    args = p.parse_args(argv)
    import uvloop

    out = uvloop.run(drive(args))
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    sys.exit(main())
