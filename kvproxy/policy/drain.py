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

An upstream that goes silent for the read timeout (`UpstreamSilent`) while its client is
still there and no safe point was reached is held the same way: the decision `Hold` has the
relay answer the client with the timeout error now and keep the upstream open, as if the
client had left at that moment, until one of the safe points above (a blackholed router
that comes back delivers its token; one that does not is closed at the drain deadline and
counted as `timeout`). Closing it at once would cancel a transfer that may still be writing
(the fault suite saw it: tests/faults/). After a token in first_token mode the transfer is
over and silence simply fails the request (in either mode).

The machine is its table, as h11's is (`_state.py`): `TRANSITIONS[mode][(client, upstream)]
[event]` gives the next state and the decision, and `handle` does nothing but classify the
event, look it up and apply the row. A missing row is a caller bug and raises
`DrainProtocolError` without changing state (an upstream event after the upstream closed, a
second `UpstreamHeaders`, a chunk or EOF before headers, a second `ClientGone`, a `Deadline`
while the client is present and the upstream open). `Shutdown` means "the shutdown grace
period is over, close now", not "SIGTERM arrived": on SIGTERM the server stops accepting and
lets drains run. The two modes differ in two rows only (`_FIRST_TOKEN_ROWS`).

{TRANSITIONS}
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Literal, TypeAlias, get_args

from kvproxy.policy.records import record

DrainUntil = Literal["first_token", "completion"]
Outcome = Literal["first_token", "completed", "upstream_error", "timeout", "shutdown"]
Phase = Literal["before_headers", "before_first_token", "streaming"]

# The machine owns its vocabulary; kvproxy.observe.metrics labels its series with these names.
DEFERRED_OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
DISCONNECT_PHASES: tuple[Phase, ...] = get_args(Phase)


class DrainProtocolError(RuntimeError):
    """An event that cannot happen in the machine's current state (a caller bug)."""


# --- events in --------------------------------------------------------------------------


@record
class UpstreamHeaders:
    now: float


@record
class UpstreamChunk:
    now: float
    # True when the chunk carries a generated token (`sse.StreamTexts(...).has_token`);
    # always False for a non-streamed body.
    has_token: bool = False


@record
class UpstreamEOF:
    now: float


@record
class UpstreamError:
    now: float


@record
class ClientGone:
    now: float


@record
class UpstreamSilent:
    """No byte from the upstream for the read timeout (the connection is still open)."""

    now: float


@record
class Deadline:
    now: float


@record
class Shutdown:
    now: float


Event: TypeAlias = (
    UpstreamHeaders
    | UpstreamChunk
    | UpstreamEOF
    | UpstreamError
    | UpstreamSilent
    | ClientGone
    | Deadline
    | Shutdown
)


# --- decisions out ----------------------------------------------------------------------


@record
class Forward:
    """Relay the headers / chunk to the client."""


@record
class Discard:
    """Drop the chunk (its client has gone) and keep reading the upstream."""


@record
class KeepReading:
    """Nothing to send; keep the upstream open and keep reading it."""


@record
class CloseUpstream:
    """Close the upstream now. `outcome` is set when this ends a deferred cancellation
    (count it), None when the client is still there (finish or fail its response)."""

    outcome: Outcome | None


@record
class Hold:
    """The upstream went silent before a safe point: answer the client with the timeout
    error now, and keep the upstream open and read as a deferred cancellation."""


@record
class NoOp:
    """The event changes nothing (the upstream is already closed)."""


Decision: TypeAlias = Forward | Discard | KeepReading | Hold | CloseUpstream | NoOp

FORWARD = Forward()
DISCARD = Discard()
KEEP_READING = KeepReading()
HOLD = Hold()
NO_OP = NoOp()
CLOSE = CloseUpstream(None)
_CLOSE_AS: dict[Outcome, CloseUpstream] = {o: CloseUpstream(o) for o in DEFERRED_OUTCOMES}


# --- states and the events the table is keyed by ------------------------------------------


class _Key(Enum):
    """An Enum hashed by identity: the table is looked up by (client, upstream) and event
    several times a request, and Enum's own __hash__ is a Python call (hash of the name)
    where a member, a singleton, needs none."""

    __hash__ = object.__hash__


class Client(_Key):
    PRESENT = "present"
    GONE = "gone"


class Up(_Key):
    AWAITING_HEADERS = "awaiting_headers"
    BEFORE_TOKEN = "before_token"
    STREAMING = "streaming"
    CLOSED = "closed"


class On(_Key):
    """An event as the table sees it: `handle` tells a chunk with a generated token from
    one without, and a deadline that is due from one that fired early."""

    HEADERS = "UpstreamHeaders"
    CHUNK = "UpstreamChunk"
    TOKEN = "UpstreamChunk(token)"
    EOF = "UpstreamEOF"
    ERROR = "UpstreamError"
    SILENT = "UpstreamSilent"
    CLIENT_GONE = "ClientGone"
    DEADLINE = "Deadline"
    DEADLINE_EARLY = "Deadline(early)"
    SHUTDOWN = "Shutdown"


class Mode(_Key):
    """FIRST_TOKEN: streaming with until=first_token; COMPLETION: every other request."""

    FIRST_TOKEN = "first_token"
    COMPLETION = "completion"


State: TypeAlias = tuple[Client, Up]
Row: TypeAlias = tuple[State, Decision]

# Members as module names, for the table below and for the machine's per-request paths: a
# member read from its class (`Client.GONE`) goes through the __getattr__ hook EnumType has,
# ~900 instructions on Python 3.11 against a global's ~30, and a request read ~30 of them
# (3% of a small chat's instructions).
P, G = Client.PRESENT, Client.GONE
AWAIT, BEFORE, STREAM, CLOSED = Up.AWAITING_HEADERS, Up.BEFORE_TOKEN, Up.STREAMING, Up.CLOSED
_CHUNK, _TOKEN, _CLIENT_GONE = On.CHUNK, On.TOKEN, On.CLIENT_GONE
_DEADLINE, _DEADLINE_EARLY = On.DEADLINE, On.DEADLINE_EARLY
_FIRST_TOKEN, _COMPLETION = Mode.FIRST_TOKEN, Mode.COMPLETION

_PHASE: dict[Up, Phase] = {
    AWAIT: "before_headers",
    BEFORE: "before_first_token",
    STREAM: "streaming",
}


def _gone_rows(up: Up, chunk: Row, token: Row, eof: Row | None) -> dict[On, Row]:
    """A drain under way: every way out of it, and what the upstream's bytes do meanwhile."""
    rows: dict[On, Row] = {
        On.ERROR: ((G, CLOSED), _CLOSE_AS["upstream_error"]),
        On.DEADLINE: ((G, CLOSED), _CLOSE_AS["timeout"]),
        On.DEADLINE_EARLY: ((G, up), KEEP_READING),  # re-arm at the deadline
        On.SHUTDOWN: ((G, CLOSED), _CLOSE_AS["shutdown"]),
        On.SILENT: ((G, up), KEEP_READING),  # the drain deadline bounds the wait
    }
    if up is AWAIT:
        rows[On.HEADERS] = ((G, BEFORE), KEEP_READING)
    else:
        rows[On.CHUNK] = chunk
        rows[On.TOKEN] = token
    if eof is not None:
        rows[On.EOF] = eof
    return rows


_COMPLETED: Row = ((G, CLOSED), _CLOSE_AS["completed"])

_COMPLETION_ROWS: dict[State, dict[On, Row]] = {
    (P, AWAIT): {
        On.HEADERS: ((P, BEFORE), FORWARD),
        On.ERROR: ((P, CLOSED), CLOSE),
        On.CLIENT_GONE: ((G, AWAIT), KEEP_READING),
        On.SILENT: ((G, AWAIT), HOLD),
        On.SHUTDOWN: ((P, CLOSED), CLOSE),
    },
    (P, BEFORE): {
        On.CHUNK: ((P, BEFORE), FORWARD),
        On.TOKEN: ((P, STREAM), FORWARD),
        On.EOF: ((P, CLOSED), CLOSE),
        On.ERROR: ((P, CLOSED), CLOSE),
        On.CLIENT_GONE: ((G, BEFORE), KEEP_READING),
        On.SILENT: ((G, BEFORE), HOLD),
        On.SHUTDOWN: ((P, CLOSED), CLOSE),
    },
    (P, STREAM): {
        On.CHUNK: ((P, STREAM), FORWARD),
        On.TOKEN: ((P, STREAM), FORWARD),
        On.EOF: ((P, CLOSED), CLOSE),
        On.ERROR: ((P, CLOSED), CLOSE),
        On.CLIENT_GONE: ((G, STREAM), KEEP_READING),
        # A token was relayed: the transfer is over, silence just fails the request.
        On.SILENT: ((P, CLOSED), CLOSE),
        On.SHUTDOWN: ((P, CLOSED), CLOSE),
    },
    (P, CLOSED): {
        # The upstream was done before the client left: nothing to defer.
        On.CLIENT_GONE: ((G, CLOSED), NO_OP),
        On.DEADLINE: ((P, CLOSED), NO_OP),  # a timer that lost the race with the close
        On.DEADLINE_EARLY: ((P, CLOSED), NO_OP),
        On.SHUTDOWN: ((P, CLOSED), NO_OP),
        On.SILENT: ((P, CLOSED), NO_OP),
    },
    (G, AWAIT): _gone_rows(AWAIT, ((G, AWAIT), DISCARD), ((G, AWAIT), DISCARD), None),
    (G, BEFORE): _gone_rows(BEFORE, ((G, BEFORE), DISCARD), ((G, STREAM), DISCARD), _COMPLETED),
    (G, STREAM): _gone_rows(STREAM, ((G, STREAM), DISCARD), ((G, STREAM), DISCARD), _COMPLETED),
    (G, CLOSED): {
        On.DEADLINE: ((G, CLOSED), NO_OP),
        On.DEADLINE_EARLY: ((G, CLOSED), NO_OP),
        On.SHUTDOWN: ((G, CLOSED), NO_OP),
        On.SILENT: ((G, CLOSED), NO_OP),
    },
}
# Streaming until the first token: a generated token ends the drain (decode holds the KV),
# and a client that leaves after one was relayed leaves nothing to wait for.
_FIRST_TOKEN_ROWS: dict[State, dict[On, Row]] = {
    (G, BEFORE): {On.TOKEN: ((G, CLOSED), _CLOSE_AS["first_token"])},
    (P, STREAM): {On.CLIENT_GONE: ((G, CLOSED), _CLOSE_AS["first_token"])},
}


def _merged(
    base: dict[State, dict[On, Row]], over: dict[State, dict[On, Row]]
) -> dict[State, dict[On, Row]]:
    return {state: {**rows, **over.get(state, {})} for state, rows in base.items()}


TRANSITIONS: Mapping[Mode, Mapping[State, Mapping[On, Row]]] = {
    Mode.COMPLETION: _COMPLETION_ROWS,
    Mode.FIRST_TOKEN: _merged(_COMPLETION_ROWS, _FIRST_TOKEN_ROWS),
}
# Per mode, the states in which a chunk, with a token or without, is forwarded and changes
# nothing (read off the table: today a present client with a token relayed). The relay's
# hot streaming path skips those events (`DrainMachine.chunks_change_nothing`).
_QUIET: Mapping[Mode, frozenset[State]] = {
    mode: frozenset(
        state
        for state, rows in table.items()
        if all(rows.get(on) == (state, FORWARD) for on in (On.CHUNK, On.TOKEN))
    )
    for mode, table in TRANSITIONS.items()
}


class DrainMachine:
    """One request's upstream lifetime. Feed every event to `handle`; obey its decision."""

    # Slotted: one is built per request and the relay reads its fields on every chunk.
    __slots__ = (
        "_client",
        "_closed_at",
        "_gone_at",
        "_held",
        "_outcome",
        "_phase",
        "_quiet",
        "_table",
        "_up",
        "_up_reached",
        "_was_deferred",
        "client_gone",
        "discarded_chunks",
        "discarded_token_chunks",
        "streaming",
        "timeout_s",
        "until",
    )

    def __init__(self, streaming: bool, until: DrainUntil, timeout_s: float) -> None:
        if until not in ("first_token", "completion"):
            raise ValueError(f"until must be first_token or completion, got {until!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.streaming = streaming
        self.until: DrainUntil = until
        self.timeout_s = timeout_s
        mode = _FIRST_TOKEN if streaming and until == "first_token" else _COMPLETION
        self._table = TRANSITIONS[mode]
        self._quiet = _QUIET[mode]
        self._client = P
        # A field, not a property: the relay reads it several times a request, and a
        # property is a Python call per read. Set where `_client` is, in `handle`.
        self.client_gone = False
        self._up = AWAIT
        # What the upstream had reached when it closed (for disconnects after the close).
        self._up_reached = AWAIT
        self._gone_at: float | None = None
        self._closed_at: float | None = None
        self._phase: Phase | None = None
        self._outcome: Outcome | None = None
        self._was_deferred = False
        self._held = False
        self.discarded_chunks = 0
        self.discarded_token_chunks = 0

    # --- what the caller reads --------------------------------------------------------

    @property
    def state(self) -> State:
        return self._client, self._up

    @property
    def upstream_closed(self) -> bool:
        return self._up is CLOSED

    @property
    def token_seen(self) -> bool:
        """A chunk with a generated token came while the upstream was open."""
        return STREAM in (self._up, self._up_reached)

    @property
    def chunks_change_nothing(self) -> bool:
        """A chunk now, with a token or without, would be forwarded and change nothing (not
        the state, not a counter): `handle` may be skipped for it. Once per relayed chunk,
        so a set lookup rather than an event built and dispatched."""
        return (self._client, self._up) in self._quiet

    @property
    def deferred(self) -> bool:
        """The client has gone and the upstream is still open: a drain is under way."""
        return self._client is G and self._up is not CLOSED

    @property
    def held(self) -> bool:
        """The upstream went silent and is held for a client that was answered (`Hold`)."""
        return self._held

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

    # --- the transition function: classify, look up, apply ------------------------------

    def handle(self, event: Event) -> Decision:
        on = self._classify(event)
        row = self._table[self._client, self._up].get(on)
        if row is None:
            raise DrainProtocolError(self._why_not(on))
        (client, up), decision = row
        if self._client is G and on in (_CHUNK, _TOKEN):
            self.discarded_chunks += 1
            self.discarded_token_chunks += on is _TOKEN
        if on is _CLIENT_GONE:
            self._gone_at = event.now
            self._phase = _PHASE[self._up if self._up is not CLOSED else self._up_reached]
            self._was_deferred = up is not CLOSED
        elif isinstance(decision, Hold):
            # The client is answered now; the drain runs from here (no disconnect phase:
            # the client did not leave).
            self._gone_at = event.now
            self._was_deferred = True
            self._held = True
        if up is CLOSED and self._up is not CLOSED:
            self._up_reached = STREAM if on is _TOKEN else self._up
            self._closed_at = event.now
        if isinstance(decision, CloseUpstream) and decision.outcome is not None:
            self._outcome = decision.outcome
        self._client, self._up = client, up
        self.client_gone = client is G
        return decision

    def _why_not(self, on: On) -> str:
        """What the caller got wrong, for an event the table has no row for."""
        name = on.value.split("(")[0]
        if (on is On.CLIENT_GONE and self.client_gone) or (
            on is On.HEADERS and self._up in (Up.BEFORE_TOKEN, Up.STREAMING)
        ):
            return f"{name} received twice"
        if self._up is Up.CLOSED:
            return f"{name} after the upstream was closed (outcome {self._outcome or 'none'})"
        if on in (On.DEADLINE, On.DEADLINE_EARLY):
            return "Deadline while no drain is under way (client present)"
        if self._up is Up.AWAITING_HEADERS:
            return f"{name} before UpstreamHeaders" + (" (send UpstreamError)" * (on is On.EOF))
        return f"{name} in state {self._client.value}/{self._up.value}"

    def _classify(self, event: Event) -> On:
        if isinstance(event, UpstreamChunk):
            return _TOKEN if event.has_token else _CHUNK
        if isinstance(event, Deadline):
            deadline = self.deadline
            return _DEADLINE_EARLY if deadline is not None and event.now < deadline else _DEADLINE
        try:
            return _EVENT_KIND[type(event)]
        except KeyError:
            raise DrainProtocolError(f"unknown event {event!r}") from None

    def __repr__(self) -> str:
        return (
            f"<DrainMachine streaming={self.streaming} until={self.until} "
            f"upstream={self._up.value} client={self._client.value} "
            f"outcome={self._outcome}>"
        )


_EVENT_KIND: dict[type, On] = {
    UpstreamHeaders: On.HEADERS,
    UpstreamEOF: On.EOF,
    UpstreamError: On.ERROR,
    UpstreamSilent: On.SILENT,
    ClientGone: On.CLIENT_GONE,
    Shutdown: On.SHUTDOWN,
}


def label(decision: Decision) -> str:
    """A decision as the table's rendering names it."""
    if isinstance(decision, CloseUpstream):
        return f"CloseUpstream({decision.outcome})"
    return type(decision).__name__


def _render(table: Mapping[Mode, Mapping[State, Mapping[On, Row]]]) -> str:
    """The table as the docstring shows it: one line per state and event; the rows that
    differ in mode first_token are marked with it."""
    base, first = table[Mode.COMPLETION], table[Mode.FIRST_TOKEN]
    lines = [
        "    client   upstream          event                 -> next                   decision"
    ]
    for (client, up), rows in base.items():
        for on, ((c2, u2), decision) in rows.items():
            lines.append(_line(client, up, on, c2, u2, decision, ""))
            alt = first[client, up].get(on)
            if alt is not None and alt != ((c2, u2), decision):
                (c3, u3), d3 = alt
                lines.append(_line(client, up, on, c3, u3, d3, "  [first_token]"))
        for on, ((c2, u2), decision) in first[client, up].items():
            if on not in rows:
                lines.append(_line(client, up, on, c2, u2, decision, "  [first_token]"))
    return "\n".join(lines)


def _line(client: Client, up: Up, on: On, c2: Client, u2: Up, d: Decision, tag: str) -> str:
    return (
        f"    {client.value:<8} {up.value:<17} {on.value:<21} -> "
        f"{c2.value + '/' + u2.value:<22} {label(d)}{tag}"
    )


if __doc__:  # None under python -OO
    __doc__ = __doc__.replace("{TRANSITIONS}", _render(TRANSITIONS))
