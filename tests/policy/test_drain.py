"""Deferred-cancellation state machine (kvproxy/policy/drain.py).

The core test walks every event order up to a depth, for every configuration, and checks
the invariants of I5 at each step; the named scenarios after it pin the cases the issue
lists (disconnect before headers, during a long prefill, mid-stream, non-streaming,
until=completion, shutdown during a drain).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import orjson
import pytest

from kvproxy.policy import drain
from kvproxy.policy.drain import (
    DEFERRED_OUTCOMES,
    DISCONNECT_PHASES,
    Client,
    ClientGone,
    CloseUpstream,
    Deadline,
    Decision,
    Discard,
    DrainMachine,
    DrainProtocolError,
    DrainUntil,
    Event,
    Forward,
    Hold,
    KeepReading,
    Mode,
    NoOp,
    On,
    Outcome,
    Shutdown,
    State,
    Up,
    UpstreamChunk,
    UpstreamEOF,
    UpstreamError,
    UpstreamHeaders,
    UpstreamSilent,
    label,
)
from kvproxy.response.guard import StreamGuard

TIMEOUT_S = 100.0
CONFIGS = [
    (True, "first_token"),
    (True, "completion"),
    (False, "first_token"),
    (False, "completion"),
]

# The alphabet: each builds an event for a machine at time `now` (Deadline fires on time).
ALPHABET: dict[str, Callable[[DrainMachine, float], Event]] = {
    "headers": lambda m, t: UpstreamHeaders(t),
    "chunk": lambda m, t: UpstreamChunk(t, has_token=False),
    "token": lambda m, t: UpstreamChunk(t, has_token=True),
    "eof": lambda m, t: UpstreamEOF(t),
    "error": lambda m, t: UpstreamError(t),
    "gone": lambda m, t: ClientGone(t),
    "deadline": lambda m, t: Deadline(m.deadline if m.deadline is not None else t),
    "shutdown": lambda m, t: Shutdown(t),
    "silent": lambda m, t: UpstreamSilent(t),
}
UPSTREAM_EVENTS = {"headers", "chunk", "token", "eof", "error"}
EXPECTED_OUTCOME = {
    "token": "first_token",
    "eof": "completed",
    "error": "upstream_error",
    "deadline": "timeout",
    "shutdown": "shutdown",
}
DEPTH = 7
# What the walk yields: (sequence, decision or None, machine before the last event, after).
Walked = tuple[list[str], "Decision | None", "DrainMachine", "DrainMachine | None"]


@dataclass
class Model:
    """What the walk knows, kept apart from the machine's own bookkeeping."""

    headers: bool = False
    token_seen: bool = False
    gone: bool = False
    closed: bool = False
    closes: int = 0
    tokens_after_gone: int = 0
    held: bool = False  # answered on silence, the upstream kept (Hold)


def walk(streaming: bool, until: DrainUntil) -> Iterator[Walked]:
    """Depth-first over every event sequence; yields (sequence, last decision or None if it
    raised, the machine before the last event, after it or None). Checks the invariants at
    every step. The machines are the walk's own: copy one before feeding it an event (handing
    them out spares a replay of the prefix per sequence, which cost 10x the walk itself).
    Walked once per process and configuration, then read again: ~2.5 s a walk (68-79 k
    sequences), four tests read each, and this module was the fast suite's second largest
    (60 s in all, --durations)."""
    return iter(_walked(streaming, until))


@functools.cache
def _walked(streaming: bool, until: DrainUntil) -> tuple[Walked, ...]:
    return tuple(_walk(streaming, until))


def _walk(streaming: bool, until: DrainUntil) -> Iterator[Walked]:

    def step(m: DrainMachine, model: Model, seq: list[str], now: float) -> Iterator[Walked]:
        if len(seq) == DEPTH:
            return
        for name, make in ALPHABET.items():
            m2, model2 = copy.copy(m), copy.copy(model)
            event = make(m2, now)
            before = repr(m2)
            try:
                decision = m2.handle(event)
            except DrainProtocolError:
                assert repr(m2) == before, "an invalid event changed state"
                assert invalid(name, model2), (seq, name)
                yield [*seq, name], None, m, None
                continue
            assert not invalid(name, model2), (seq, name, "should have raised")
            check(m2, model2, name, decision, streaming, until, [*seq, name])
            yield [*seq, name], decision, m, m2
            yield from step(m2, model2, [*seq, name], now + 1.0)

    yield from step(DrainMachine(streaming, until, TIMEOUT_S), Model(), [], 0.0)


def invalid(name: str, model: Model) -> bool:
    if name in UPSTREAM_EVENTS and model.closed:
        return True
    if name == "headers" and model.headers:
        return True
    if name in ("chunk", "token", "eof") and not model.headers:
        return True
    if name == "gone" and model.gone:
        return True
    # A Deadline with no drain under way and the upstream still open is a caller bug.
    return name == "deadline" and not model.gone and not model.closed


def check(
    m: DrainMachine,
    model: Model,
    name: str,
    d: Decision,
    streaming: bool,
    until: str,
    seq: list[str],
) -> None:
    ends_at_token = streaming and until == "first_token"
    was_closed = model.closed
    # `client_gone` is a field kept beside the state (the relay reads it per chunk): it
    # must say what the state says after every transition.
    assert m.client_gone is (m.state[0] is Client.GONE), seq
    # Update the model with the event.
    if name == "headers":
        model.headers = True
    if name == "token":
        model.token_seen = True
        if model.gone:
            model.tokens_after_gone += 1
    if name == "silent" and not model.gone and not was_closed:
        # Silence before a token holds the upstream for a client that is answered now;
        # after a token (the transfer is over) it just fails the request.
        if model.token_seen:
            assert isinstance(d, CloseUpstream), seq
            assert d.outcome is None, seq
        else:
            assert isinstance(d, Hold), seq
            model.gone = model.held = True
            assert m.held, seq
            assert m.disconnect_phase is None, seq
    elif name == "silent":
        assert isinstance(d, (KeepReading, NoOp)), seq
    if name == "gone":
        model.gone = True
        phase = "streaming" if model.token_seen else (
            "before_first_token" if model.headers else "before_headers")  # fmt: skip
        assert m.disconnect_phase == phase, seq
        assert m.disconnect_phase in DISCONNECT_PHASES

    # I5: nothing reaches a client that has gone; nothing is discarded for a present one.
    if model.gone:
        assert not isinstance(d, Forward), seq
        if not model.held:
            assert m.disconnect_phase is not None, seq
    else:
        assert not isinstance(d, Discard), seq
        assert m.disconnect_phase is None

    if was_closed:
        assert isinstance(d, NoOp), seq
    if isinstance(d, CloseUpstream):
        model.closed = True
        model.closes += 1
        if model.gone:
            # Closed after a disconnect only at a safe point, with the matching outcome.
            if name == "gone":
                assert ends_at_token, seq
                assert model.token_seen, seq
                expected = "first_token"
            else:
                expected = EXPECTED_OUTCOME[name]
            assert d.outcome == expected, seq
            assert d.outcome in DEFERRED_OUTCOMES
            assert m.outcome == expected
            if name == "token":
                assert ends_at_token, seq
        else:
            assert d.outcome is None, seq
            assert m.outcome is None
    assert model.closes <= 1, seq

    # Chunks without a token never end a drain; with until=completion or a non-streamed
    # body, tokens do not either.
    if model.gone and name == "chunk":
        assert isinstance(d, (Discard, NoOp)), seq
    if model.gone and name == "token" and not ends_at_token:
        assert isinstance(d, Discard), seq

    assert m.deferred == (model.gone and not model.closed), seq
    assert (m.deadline is not None) == m.deferred, seq
    assert m.upstream_closed == model.closed
    assert m.discarded_token_chunks == model.tokens_after_gone, seq
    if m.deferred:
        assert m.was_deferred


@pytest.mark.parametrize(("streaming", "until"), CONFIGS)
def test_every_event_order(streaming: bool, until: DrainUntil) -> None:
    n_valid = n_invalid = 0
    outcomes: set[str | None] = set()
    for _seq, decision, _, _ in walk(streaming, until):
        if decision is None:
            n_invalid += 1
            continue
        n_valid += 1
        if isinstance(decision, CloseUpstream):
            outcomes.add(decision.outcome)
    # The walk really explored: every outcome is reachable (first_token only when a token
    # can end the drain), and both valid and invalid orders were tried.
    assert n_valid > 1000
    assert n_invalid > 1000
    expected = set(DEFERRED_OUTCOMES) | {None}
    if not (streaming and until == "first_token"):
        expected.discard("first_token")
    assert outcomes == expected


@pytest.mark.parametrize(("streaming", "until"), CONFIGS)
def test_every_deferred_state_has_a_way_out(streaming: bool, until: DrainUntil) -> None:
    """From every state of a drain, both the deadline and shutdown close the upstream."""
    seen = 0
    for seq, decision, _, m in walk(streaming, until):
        if decision is None or m is None or "gone" not in seq:
            continue
        if not m.deferred:
            continue
        seen += 1
        assert m.deadline is not None
        ways: list[tuple[Event, Outcome]] = [
            (Deadline(m.deadline), "timeout"),
            (Shutdown(m.deadline), "shutdown"),
        ]
        for ev, outcome in ways:
            m2 = copy.copy(m)
            assert m2.handle(ev) == CloseUpstream(outcome)
            assert not m2.deferred
    assert seen > 20


@pytest.mark.no_cover  # CPU-bound (~2x traced); the rest of the suite measures its lines
def test_every_row_of_the_table_is_reached_and_nothing_else_is() -> None:
    """`drain.TRANSITIONS` drives the machine: the exhaustive walk (whose own model checks
    every decision above) reaches every row of each mode's table, and every event the walk
    found invalid has no row."""
    reached: dict[Mode, set[tuple[State, On]]] = {mode: set() for mode in Mode}
    for streaming, until in CONFIGS:
        mode = Mode.FIRST_TOKEN if streaming and until == "first_token" else Mode.COMPLETION
        for seq, decision, before, _ in walk(streaming, until):
            event = ALPHABET[seq[-1]](before, float(len(seq) - 1))
            on = before._classify(event)
            row = drain.TRANSITIONS[mode][before.state].get(on)
            if decision is None:
                assert row is None, seq
                continue
            assert row is not None, seq
            assert row[1] == decision, seq
            reached[mode].add((before.state, on))
    # A deadline that fires early (the walk's fire on time) re-arms.
    for mode, streaming, until in (
        (Mode.FIRST_TOKEN, True, "first_token"),
        (Mode.COMPLETION, True, "completion"),
    ):
        for prefix in (
            [ClientGone(1.0)],
            [UpstreamHeaders(0.0), ClientGone(1.0)],
            [UpstreamHeaders(0.0), UpstreamChunk(0.5, True), ClientGone(1.0)],
            [UpstreamEOF.__new__(UpstreamEOF)][:0],
        ):
            m = DrainMachine(streaming, until, TIMEOUT_S)
            run(m, *prefix)
            state = m.state
            if m.upstream_closed or m.deadline is None:
                continue
            assert label(m.handle(Deadline(2.0))) == "KeepReading"
            reached[mode].add((state, On.DEADLINE_EARLY))
    for mode in Mode:
        until: DrainUntil = "first_token" if mode is Mode.FIRST_TOKEN else "completion"
        for events in ([UpstreamError(0.0)], [ClientGone(0.0), UpstreamError(0.0)]):
            m = DrainMachine(True, until, TIMEOUT_S)
            run(m, *events)
            state = m.state
            m.handle(Deadline(-1.0))  # an early timer after the close: NoOp
            reached[mode].add((state, On.DEADLINE_EARLY))
        listed = {(state, on) for state, rows in drain.TRANSITIONS[mode].items() for on in rows}
        # Streaming until the first token, a token ends every drain: gone/streaming is never
        # entered (its rows come from the shared completion table).
        gone_streaming = (Client.GONE, Up.STREAMING)
        unreachable = {(gone_streaming, on) for on in On} if mode is Mode.FIRST_TOKEN else set()
        assert listed - unreachable == reached[mode] - unreachable, mode
    assert drain.__doc__ is not None
    assert "present  before_token      UpstreamChunk         -> present/before_token" in (
        drain.__doc__
    )


def _fields(m: DrainMachine) -> dict[str, object]:
    """Every field of a machine (it is slotted: no __dict__ to compare)."""
    return {name: getattr(m, name) for name in DrainMachine.__slots__}


@pytest.mark.parametrize(("streaming", "until"), CONFIGS)
def test_a_chunk_the_machine_calls_quiet_changes_nothing(
    streaming: bool, until: DrainUntil
) -> None:
    """The relay skips `handle` for chunks while `chunks_change_nothing` holds: in every
    state reached by a valid event order where it holds, a chunk with or without a token
    is forwarded and leaves the machine exactly as it was (state, counters, timestamps)."""
    quiet = loud = 0
    seen: set[tuple[str, ...]] = set()
    for seq, decision, _, m in walk(streaming, until):
        if decision is None or m is None or tuple(seq) in seen:
            continue
        seen.add(tuple(seq))
        if not m.chunks_change_nothing:
            loud += 1
            continue
        quiet += 1
        assert not m.client_gone
        assert not m.upstream_closed
        for has_token in (False, True):
            m2 = copy.copy(m)
            assert isinstance(m2.handle(UpstreamChunk(now=99.0, has_token=has_token)), Forward)
            assert _fields(m2) == _fields(m), seq
    assert quiet > 10
    assert loud > 100


# --- the named scenarios ----------------------------------------------------------------


def run(m: DrainMachine, *events: Event) -> list[Decision]:
    return [m.handle(e) for e in events]


def test_disconnect_before_upstream_headers_keeps_reading_until_first_token() -> None:
    m = DrainMachine(streaming=True, until="first_token", timeout_s=30)
    got = run(
        m,
        ClientGone(1.0),
        UpstreamHeaders(50.0),
        UpstreamChunk(51.0, has_token=False),  # role-only delta
        UpstreamChunk(52.0, has_token=True),
    )
    assert got == [KeepReading(), KeepReading(), Discard(), CloseUpstream("first_token")]
    assert m.disconnect_phase == "before_headers"
    assert m.outcome == "first_token"
    assert m.deferred_for(1000.0) == 51.0  # frozen at the close
    assert m.discarded_token_chunks == 1
    assert m.discarded_chunks == 2
    assert m.was_deferred


def test_disconnect_during_long_prefill_with_no_bytes_waits_then_times_out() -> None:
    m = DrainMachine(streaming=True, until="first_token", timeout_s=300)
    assert run(m, UpstreamHeaders(0.0), ClientGone(10.0)) == [Forward(), KeepReading()]
    assert m.disconnect_phase == "before_first_token"
    assert m.deferred
    assert m.deadline == 310.0
    assert m.deferred_for(100.0) == 90.0
    # A timer that fires early is not a timeout; the caller re-arms at `deadline`.
    assert m.handle(Deadline(309.9)) == KeepReading()
    assert m.handle(Deadline(310.0)) == CloseUpstream("timeout")
    assert m.outcome == "timeout"
    assert m.deadline is None
    assert m.deferred_for(400.0) == 300.0


def test_disconnect_mid_stream_closes_at_once_because_decode_holds_the_kv() -> None:
    m = DrainMachine(streaming=True, until="first_token", timeout_s=30)
    got = run(m, UpstreamHeaders(0.0), UpstreamChunk(1.0, True), ClientGone(2.0))
    assert got == [Forward(), Forward(), CloseUpstream("first_token")]
    assert m.disconnect_phase == "streaming"
    assert not m.was_deferred  # nothing was held open, no in-progress gauge to undo
    assert m.deferred_for(9.0) == 0.0


def test_until_completion_discards_every_token_until_eof() -> None:
    m = DrainMachine(streaming=True, until="completion", timeout_s=30)
    got = run(
        m,
        UpstreamHeaders(0.0),
        UpstreamChunk(1.0, True),
        ClientGone(2.0),
        UpstreamChunk(3.0, True),
        UpstreamChunk(4.0, True),
        UpstreamEOF(5.0),
    )
    assert got == [Forward(), Forward(), KeepReading(), Discard(), Discard(),
                   CloseUpstream("completed")]  # fmt: skip
    assert m.discarded_token_chunks == 2
    assert m.deferred_for(99.0) == 3.0


def test_non_streaming_keeps_upstream_until_the_body_ends() -> None:
    m = DrainMachine(streaming=False, until="first_token", timeout_s=30)
    got = run(m, ClientGone(0.5), UpstreamHeaders(20.0), UpstreamChunk(21.0, True),
              UpstreamEOF(22.0))  # fmt: skip
    assert got == [KeepReading(), KeepReading(), Discard(), CloseUpstream("completed")]
    assert m.outcome == "completed"


def test_shutdown_during_a_drain_is_counted_shutdown() -> None:
    m = DrainMachine(streaming=True, until="first_token", timeout_s=300)
    run(m, ClientGone(0.0))
    assert m.handle(Shutdown(29.0)) == CloseUpstream("shutdown")
    assert m.outcome == "shutdown"
    assert m.deferred_for(1e6) == 29.0
    assert m.handle(Deadline(400.0)) == NoOp()  # stale timer after the close
    assert m.handle(Shutdown(401.0)) == NoOp()


def test_shutdown_with_client_present_closes_without_a_deferral_outcome() -> None:
    m = DrainMachine(streaming=True, until="first_token", timeout_s=300)
    assert run(m, UpstreamHeaders(0.0), Shutdown(1.0)) == [Forward(), CloseUpstream(None)]
    assert m.outcome is None


def test_upstream_error_during_drain() -> None:
    m = DrainMachine(streaming=True, until="first_token", timeout_s=300)
    got = run(m, ClientGone(0.0), UpstreamError(3.0))
    assert got == [KeepReading(), CloseUpstream("upstream_error")]


def test_client_present_response_is_forwarded_and_closed_without_outcome() -> None:
    m = DrainMachine(streaming=True, until="first_token", timeout_s=300)
    got = run(m, UpstreamHeaders(0), UpstreamChunk(1, True), UpstreamChunk(2), UpstreamEOF(3))
    assert got == [Forward(), Forward(), Forward(), CloseUpstream(None)]
    assert m.disconnect_phase is None
    assert m.outcome is None


def test_disconnect_after_upstream_closed_is_a_no_op_with_a_phase() -> None:
    m = DrainMachine(streaming=True, until="first_token", timeout_s=300)
    run(m, UpstreamHeaders(0), UpstreamChunk(1, True), UpstreamEOF(2))
    assert m.handle(ClientGone(3)) == NoOp()
    assert m.disconnect_phase == "streaming"
    assert m.outcome is None
    assert not m.deferred


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([UpstreamHeaders(0), UpstreamHeaders(1)], "twice"),
        ([UpstreamChunk(0)], "before UpstreamHeaders"),
        ([UpstreamEOF(0)], "before UpstreamHeaders"),
        ([ClientGone(0), ClientGone(1)], "twice"),
        ([Deadline(0)], "no drain"),
        ([UpstreamError(0), UpstreamError(1)], "after the upstream was closed"),
        ([ClientGone(0), UpstreamError(1), UpstreamHeaders(2)], "outcome upstream_error"),
    ],
)
def test_invalid_transitions_raise_clear_errors(events: list[Event], message: str) -> None:
    m = DrainMachine(streaming=True, until="first_token", timeout_s=300)
    *ok, bad = events
    run(m, *ok)
    with pytest.raises(DrainProtocolError, match=message):
        m.handle(bad)


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="until"):
        DrainMachine(True, "never", 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        DrainMachine(True, "first_token", 0)


# --- the machine fed by the relay's reading of real event shapes ------------------------


def _events(*deltas: dict[str, object]) -> list[bytes]:
    return [
        b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": d}]}) + b"\n\n" for d in deltas
    ] + [b"data: [DONE]\n\n"]


@pytest.mark.parametrize(
    "first",
    [
        {"reasoning": "Let me think"},  # vLLM >= 0.16: reasoning only in delta.reasoning
        {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]},
        {"refusal": "no"},
    ],
)
def test_first_token_in_any_field_ends_a_deferred_drain(first: dict[str, object]) -> None:
    """The client left during prefill; the drain must end at the first generated token,
    not at the first `content` token (possibly thousands of tokens later)."""
    chunks = _events({"role": "assistant", "content": ""}, first, {"content": "answer"})
    guard = StreamGuard(scanner=None)
    m = DrainMachine(streaming=True, until="first_token", timeout_s=TIMEOUT_S)
    m.handle(UpstreamHeaders(0.0))
    assert isinstance(m.handle(ClientGone(1.0)), KeepReading)
    decisions = []
    for t, chunk in enumerate(chunks, start=2):
        _, output = guard.feed(chunk)
        decisions.append(m.handle(UpstreamChunk(float(t), has_token=output)))
        if m.upstream_closed:
            break
    assert decisions == [Discard(), CloseUpstream("first_token")]
    assert m.outcome == "first_token"


def test_silence_before_a_token_holds_the_upstream_until_a_safe_point() -> None:
    """A read timeout before the transfer is known over (a blackholed router): the client is
    answered now (Hold) and the upstream is kept until a safe point, as after a disconnect."""
    m = DrainMachine(True, "first_token", TIMEOUT_S)
    assert isinstance(m.handle(UpstreamSilent(5.0)), Hold)
    assert m.held
    assert m.deferred
    assert m.client_gone
    assert m.disconnect_phase is None  # the client did not leave: no disconnect counted
    assert m.deadline == 5.0 + TIMEOUT_S
    assert run(m, UpstreamHeaders(6.0), UpstreamChunk(7.0, has_token=True))[-1] == CloseUpstream(
        "first_token"
    )
    assert m.outcome == "first_token"
    assert m.was_deferred


def test_silence_that_lasts_closes_at_the_drain_deadline_as_timeout() -> None:
    m = DrainMachine(False, "first_token", TIMEOUT_S)
    run(m, UpstreamHeaders(0.0), UpstreamSilent(1.0))
    assert isinstance(m.handle(UpstreamSilent(2.0)), KeepReading)  # the deadline bounds it
    assert m.handle(Deadline(1.0 + TIMEOUT_S)) == CloseUpstream("timeout")


def test_silence_after_a_token_fails_the_request_and_closes() -> None:
    for until in ("first_token", "completion"):
        m = DrainMachine(True, until, TIMEOUT_S)  # type: ignore[arg-type]
        run(m, UpstreamHeaders(0.0), UpstreamChunk(1.0, has_token=True))
        assert m.handle(UpstreamSilent(2.0)) == CloseUpstream(None)
        assert not m.held
        assert m.outcome is None
