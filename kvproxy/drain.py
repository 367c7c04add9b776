"""Deferred cancellation: what to do with an upstream request after its client has gone.

Owns the policy of invariants I5 (no cancellation before a safe point) and, through
`outcome`, the accounting that keeps timeouts apart from confirmed drains. A sans-IO state
machine in h11's manner: the relay feeds it events (each stamped with a monotonic `now`
the caller read) and executes the decision it returns. It never reads a clock, touches a
socket, logs or updates metrics: it is unit-tested in microseconds.

Why defer at all: the PD router closes both legs within ~20 ms of a disconnect during
prefill, and a decode engine that frees pages on abort can have them overwritten by RDMA
writes prefill already issued, in pages the next request has just been given. The safe
points, after the client left, are:

    streaming, until=first_token   a chunk carrying a generated token (decode holds the KV,
                                   the transfer is over)           -> outcome first_token
    any mode                       upstream EOF                    -> completed
                                   upstream error                  -> upstream_error
                                   drain deadline passed           -> timeout (NOT a proof
                                                                      that writes stopped)
                                   grace period of a shutdown over -> shutdown
    non-streaming or until=completion: only EOF, error, timeout or shutdown.

States (client side x upstream side):

    client:    PRESENT ──ClientGone──► GONE
    upstream:  AWAITING_HEADERS ──UpstreamHeaders──► BEFORE_TOKEN ──UpstreamChunk(token)──►
               STREAMING;  any of them ──(CloseUpstream decision)──► CLOSED

{TRANSITIONS}

`Shutdown` means "the shutdown grace period is over, close now", not "SIGTERM arrived":
on SIGTERM the server stops accepting and lets drains run. Upstream events after the
upstream closed, a second `UpstreamHeaders`, a chunk or EOF before headers, a second
`ClientGone` and a `Deadline` while the client is present are caller bugs and raise
`DrainProtocolError` without changing state. The table is `TRANSITIONS` (data, as h11
keeps its own): this docstring renders it and the tests hold every decision to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal, TypeAlias, get_args

DrainUntil = Literal["first_token", "completion"]
Outcome = Literal["first_token", "completed", "upstream_error", "timeout", "shutdown"]
Phase = Literal["before_headers", "before_first_token", "streaming"]

# The machine owns its vocabulary; kvproxy.metrics labels its series with these names.
DEFERRED_OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
DISCONNECT_PHASES: tuple[Phase, ...] = get_args(Phase)


class DrainProtocolError(RuntimeError):
    """An event that cannot happen in the machine's current state (a caller bug)."""


# --- events in --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UpstreamHeaders:
    now: float


@dataclass(frozen=True, slots=True)
class UpstreamChunk:
    now: float
    # True when the chunk carries a generated token (`sse.StreamTexts(...).has_token`);
    # always False for a non-streamed body.
    has_token: bool = False


@dataclass(frozen=True, slots=True)
class UpstreamEOF:
    now: float


@dataclass(frozen=True, slots=True)
class UpstreamError:
    now: float


@dataclass(frozen=True, slots=True)
class ClientGone:
    now: float


@dataclass(frozen=True, slots=True)
class Deadline:
    now: float


@dataclass(frozen=True, slots=True)
class Shutdown:
    now: float


Event: TypeAlias = (
    UpstreamHeaders | UpstreamChunk | UpstreamEOF | UpstreamError | ClientGone | Deadline | Shutdown
)


# --- decisions out ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Forward:
    """Relay the headers / chunk to the client."""


@dataclass(frozen=True, slots=True)
class Discard:
    """Drop the chunk (its client has gone) and keep reading the upstream."""


@dataclass(frozen=True, slots=True)
class KeepReading:
    """Nothing to send; keep the upstream open and keep reading it."""


@dataclass(frozen=True, slots=True)
class CloseUpstream:
    """Close the upstream now. `outcome` is set when this ends a deferred cancellation
    (count it), None when the client is still there (finish or fail its response)."""

    outcome: Outcome | None


@dataclass(frozen=True, slots=True)
class NoOp:
    """The event changes nothing (the upstream is already closed)."""


Decision: TypeAlias = Forward | Discard | KeepReading | CloseUpstream | NoOp

FORWARD = Forward()
DISCARD = Discard()
KEEP_READING = KeepReading()
NO_OP = NoOp()


class _Up(Enum):
    AWAITING_HEADERS = "awaiting_headers"
    BEFORE_TOKEN = "before_token"
    STREAMING = "streaming"
    CLOSED = "closed"


_PHASE: dict[_Up, Phase] = {
    _Up.AWAITING_HEADERS: "before_headers",
    _Up.BEFORE_TOKEN: "before_first_token",
    _Up.STREAMING: "streaming",
}


class DrainMachine:
    """One request's upstream lifetime. Feed every event to `handle`; obey its decision."""

    def __init__(self, streaming: bool, until: DrainUntil, timeout_s: float) -> None:
        if until not in ("first_token", "completion"):
            raise ValueError(f"until must be first_token or completion, got {until!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.streaming = streaming
        self.until: DrainUntil = until
        self.timeout_s = timeout_s
        self._up = _Up.AWAITING_HEADERS
        # What the upstream had reached when it closed (for disconnects after the close).
        self._up_reached = _Up.AWAITING_HEADERS
        self._gone_at: float | None = None
        self._closed_at: float | None = None
        self._phase: Phase | None = None
        self._outcome: Outcome | None = None
        self._was_deferred = False
        self.discarded_chunks = 0
        self.discarded_token_chunks = 0

    # --- what the caller reads --------------------------------------------------------

    @property
    def client_gone(self) -> bool:
        return self._gone_at is not None

    @property
    def upstream_closed(self) -> bool:
        return self._up is _Up.CLOSED

    @property
    def deferred(self) -> bool:
        """The client has gone and the upstream is still open: a drain is under way."""
        return self._gone_at is not None and self._up is not _Up.CLOSED

    @property
    def was_deferred(self) -> bool:
        """The upstream was ever kept open for a client that had gone (an in-progress
        gauge incremented on entry must be decremented on close exactly when this holds)."""
        return self._was_deferred

    @property
    def deadline(self) -> float | None:
        """Monotonic time at which to send `Deadline`; None while no drain is under way."""
        if not self.deferred:
            return None
        assert self._gone_at is not None
        return self._gone_at + self.timeout_s

    @property
    def disconnect_phase(self) -> Phase | None:
        """Where the response was when the client left (None: it has not left)."""
        return self._phase

    @property
    def outcome(self) -> Outcome | None:
        """How the deferred cancellation ended; None if there was none (yet)."""
        return self._outcome

    def deferred_for(self, now: float) -> float:
        """Seconds from the disconnect to the upstream close (or to `now`, if still open)."""
        if self._gone_at is None:
            return 0.0
        end = self._closed_at if self._closed_at is not None else now
        return max(0.0, end - self._gone_at)

    @property
    def _ends_at_first_token(self) -> bool:
        return self.streaming and self.until == "first_token"

    # --- the transition function -------------------------------------------------------

    def handle(self, event: Event) -> Decision:
        if isinstance(event, UpstreamChunk):
            return self._chunk(event)
        if isinstance(event, UpstreamHeaders):
            self._require_open(event)
            if self._up is not _Up.AWAITING_HEADERS:
                raise DrainProtocolError("UpstreamHeaders received twice")
            self._up = _Up.BEFORE_TOKEN
            return KEEP_READING if self.client_gone else FORWARD
        if isinstance(event, UpstreamEOF):
            self._require_open(event)
            if self._up is _Up.AWAITING_HEADERS:
                raise DrainProtocolError("UpstreamEOF before UpstreamHeaders (send UpstreamError)")
            return self._close(event.now, "completed")
        if isinstance(event, UpstreamError):
            self._require_open(event)
            return self._close(event.now, "upstream_error")
        if isinstance(event, ClientGone):
            return self._client_gone(event)
        if isinstance(event, Deadline):
            return self._deadline(event)
        if isinstance(event, Shutdown):
            if self._up is _Up.CLOSED:
                return NO_OP
            return self._close(event.now, "shutdown")
        raise DrainProtocolError(f"unknown event {event!r}")

    def _chunk(self, event: UpstreamChunk) -> Decision:
        self._require_open(event)
        if self._up is _Up.AWAITING_HEADERS:
            raise DrainProtocolError("UpstreamChunk before UpstreamHeaders")
        if event.has_token:
            self._up = _Up.STREAMING
        if not self.client_gone:
            return FORWARD
        self.discarded_chunks += 1
        if event.has_token:
            self.discarded_token_chunks += 1
            if self._ends_at_first_token:
                return self._close(event.now, "first_token")
        return DISCARD

    def _client_gone(self, event: ClientGone) -> Decision:
        if self._gone_at is not None:
            raise DrainProtocolError("ClientGone received twice")
        self._gone_at = event.now
        if self._up is _Up.CLOSED:
            # The upstream was done before the client left: nothing to defer.
            self._phase = _PHASE[self._up_reached]
            return NO_OP
        self._phase = _PHASE[self._up]
        if self._up is _Up.STREAMING and self._ends_at_first_token:
            # A token already reached the client: the transfer is over, close at once.
            return self._close(event.now, "first_token")
        self._was_deferred = True
        return KEEP_READING

    def _deadline(self, event: Deadline) -> Decision:
        if self._up is _Up.CLOSED:
            return NO_OP  # a timer that lost the race with the close
        deadline = self.deadline
        if deadline is None:
            raise DrainProtocolError("Deadline while no drain is under way (client present)")
        if event.now < deadline:
            return KEEP_READING  # fired early: re-arm at `deadline`
        return self._close(event.now, "timeout")

    def _close(self, now: float, outcome_if_gone: Outcome) -> CloseUpstream:
        self._up_reached = self._up
        self._up = _Up.CLOSED
        self._closed_at = now
        if self._gone_at is None:
            return CloseUpstream(None)
        self._outcome = outcome_if_gone
        return CloseUpstream(outcome_if_gone)

    def _require_open(self, event: Event) -> None:
        if self._up is _Up.CLOSED:
            raise DrainProtocolError(
                f"{type(event).__name__} after the upstream was closed "
                f"(outcome {self._outcome or 'none'})"
            )

    def __repr__(self) -> str:
        return (
            f"<DrainMachine streaming={self.streaming} until={self.until} "
            f"upstream={self._up.value} client={'gone' if self.client_gone else 'present'} "
            f"outcome={self._outcome}>"
        )


# --- the table, as data --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Transition:
    """The decisions an event can bring, with the client present and once it has gone."""

    event: type[Event]
    present: tuple[str, ...]
    gone: tuple[str, ...]
    note: str = ""


TRANSITIONS: tuple[Transition, ...] = (
    Transition(UpstreamHeaders, ("Forward",), ("KeepReading",)),
    Transition(
        UpstreamChunk,
        ("Forward",),
        ("Discard", "CloseUpstream(first_token)"),
        "first_token: a token, streaming until=first_token",
    ),
    Transition(UpstreamEOF, ("CloseUpstream(None)",), ("CloseUpstream(completed)",)),
    Transition(UpstreamError, ("CloseUpstream(None)",), ("CloseUpstream(upstream_error)",)),
    Transition(
        ClientGone,
        ("KeepReading", "CloseUpstream(first_token)", "NoOp"),
        (),
        "first_token: a token was relayed; NoOp: upstream closed",
    ),
    Transition(
        Deadline,
        ("NoOp",),
        ("CloseUpstream(timeout)", "KeepReading", "NoOp"),
        "KeepReading: fired early; NoOp: upstream closed",
    ),
    Transition(
        Shutdown,
        ("CloseUpstream(None)", "NoOp"),
        ("CloseUpstream(shutdown)", "NoOp"),
        "NoOp: upstream closed",
    ),
)


def label(decision: Decision) -> str:
    """A decision as `TRANSITIONS` names it."""
    if isinstance(decision, CloseUpstream):
        return f"CloseUpstream({decision.outcome})"
    return type(decision).__name__


def _render(rows: tuple[Transition, ...]) -> str:
    cells = [
        (r.event.__name__, ", ".join(r.present), ", ".join(r.gone) or "(caller bug)") for r in rows
    ]
    w0, w1 = (max(len(c[k]) for c in cells) for k in (0, 1))
    lines = [f"    {'event':<{w0}}  {'client PRESENT':<{w1}}  client GONE (deferred)"]
    for row, (event, present, gone) in zip(rows, cells, strict=True):
        lines.append(f"    {event:<{w0}}  {present:<{w1}}  {gone}")
        if row.note:
            lines.append(f"    {'':<{w0}}    ({row.note})")
    return "\n".join(lines)


if __doc__:  # None under python -OO
    __doc__ = __doc__.replace("{TRANSITIONS}", _render(TRANSITIONS))
