"""The cluster budget's stance towards Redis, as a sans-IO state machine in h11's manner: is
Redis the budget's authority (`ok`), unavailable so the configured policy applies
(`degraded`), or back and this replica registering what it holds under a new epoch
(`recovering`)? `RedisBudget` (budget.cluster) is the shell: it feeds the machine an event
for each thing that happened or is about to, and performs the effects the row returns, in
order. The machine never awaits, reads a clock, touches Redis, logs or updates metrics; it
owns the state, the epoch, the last error, and the outage's caps and share window.

The machine is its table, keyed as drain's is: `TRANSITIONS[policy][state][event]` gives
the next state and the effects. `handle` looks the row up, does the machine's own effects
(lower case in the table below: `record_error`, `fix_outage_caps`, `new_epoch`,
`clear_error`, `open_share_window`) and returns the rest for the shell. A missing row is a
shell bug and raises `BudgetProtocolError` without changing state (e.g. `RenewalDue` while
recovering: the renewal loop is the one running the return). The two policies differ
in three rows (`_REJECT_ROWS`): what a request gets while degraded, and no share window
after a return.

Two rows say where a request and a lease given back go in each state (`Acquire`,
`ReleasesWaiting`): they change nothing, so the table holds every decision that depends on
the state. A failure of another call while the return is on its way (one sent before the
outage, timing out late) puts the state back to `degraded`, quietly; the return itself
still ends the outage when Redis answers it (`degraded` + `ReturnRegistered`).

    state        event              -> next         effects
{TRANSITIONS}
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Literal, TypeAlias

from kvproxy.policy import record

Policy = Literal["local_share", "reject"]


class BudgetProtocolError(RuntimeError):
    """An event the machine's current state has no row for (a bug in the shell)."""


class _Key(Enum):
    """Hashed by identity, as drain's keys are: looked up once per request."""

    __hash__ = object.__hash__


class Redis(_Key):
    """Where Redis stands, for this replica."""

    OK = "ok"
    DEGRADED = "degraded"
    RECOVERING = "recovering"


class On(_Key):
    FAILED = "RedisFailed"  # a call failed, timed out, was answered wrongly or fenced
    RENEWAL_DUE = "RenewalDue"  # the renewal loop's pause is over
    PROBE_ANSWERED = "ProbeAnswered"  # PING answered while degraded
    RETURN_REGISTERED = "ReturnRegistered"  # the fenced renewal of the return answered
    RETURN_FAILED = "ReturnFailed"  # it failed or was cancelled
    ACQUIRE = "Acquire"  # a request asks for a lease
    RELEASES_WAITING = "ReleasesWaiting"  # leases given back wait for a call to carry them


class Do(_Key):
    # The machine's own effects, done inside `handle`.
    RECORD_ERROR = "record_error"
    FIX_OUTAGE_CAPS = "fix_outage_caps"
    NEW_EPOCH = "new_epoch"
    CLEAR_ERROR = "clear_error"
    OPEN_SHARE_WINDOW = "open_share_window"
    # The shell's, done synchronously in the order given.
    ANNOUNCE_OUTAGE = "AnnounceOutage"  # gauge 1, fallbacks counted, one log line
    ANNOUNCE_RETURN = "AnnounceReturn"  # gauge 0, one log line
    REGISTER_LOCAL_LEASES = "RegisterLocalLeases"  # local-share leases get lease ids
    SEND_UNRELEASED = "SendUnreleased"  # give back what was released during the return
    WAKE_ALL = "WakeAll"  # every waiter of this replica looks at the state again
    # The shell's duty, at most one per row and last: what to do next.
    RENEW = "Renew"
    PROBE = "Probe"
    RUN_RETURN = "RunReturn"  # the fenced renewal (budget.scripts.RENEW) under the new epoch
    ASK_REDIS = "AskRedis"
    GRANT_LOCAL_SHARE = "GrantLocalShare"  # granted at once if under the cap, else 429
    REFUSE_UNAVAILABLE = "RefuseUnavailable"  # 503 budget_unavailable
    AWAIT_RETURN = "AwaitReturn"  # wait, bounded by the queue timeout, for the return
    SEND_RELEASES = "SendReleases"  # with the next call, or by RELEASE within 2 ms
    KEEP_FOR_RETURN = "KeepForReturn"  # the fenced return gives them back


_OWN = frozenset(
    {Do.RECORD_ERROR, Do.FIX_OUTAGE_CAPS, Do.NEW_EPOCH, Do.CLEAR_ERROR, Do.OPEN_SHARE_WINDOW}
)
# The effects that end a row: what the shell does next (a call, or where a request goes).
DUTIES = frozenset(
    {
        Do.RENEW,
        Do.PROBE,
        Do.RUN_RETURN,
        Do.ASK_REDIS,
        Do.GRANT_LOCAL_SHARE,
        Do.REFUSE_UNAVAILABLE,
        Do.AWAIT_RETURN,
        Do.SEND_RELEASES,
        Do.KEEP_FOR_RETURN,
    }
)


# --- events in --------------------------------------------------------------------------


@record
class Held:
    """At the switch to `degraded`: what this replica holds under Redis leases, and the
    cluster's use when Redis last answered."""

    tokens: int
    requests: int
    cluster_tokens: int
    cluster_requests: int


@record
class RedisFailed:
    error: str  # the exception's type name: shown in /capacity, never a message
    held: Held


@record
class ReturnRegistered:
    now: float  # monotonic


@record
class Signal:
    """An event that carries nothing but its kind."""

    on: On


Event: TypeAlias = RedisFailed | ReturnRegistered | Signal

RENEWAL_DUE = Signal(On.RENEWAL_DUE)
PROBE_ANSWERED = Signal(On.PROBE_ANSWERED)
RETURN_FAILED = Signal(On.RETURN_FAILED)
ACQUIRE = Signal(On.ACQUIRE)
RELEASES_WAITING = Signal(On.RELEASES_WAITING)


# --- the table ----------------------------------------------------------------------------

Row: TypeAlias = tuple[Redis, tuple[Do, ...]]
OK, DEGRADED, RECOVERING = Redis.OK, Redis.DEGRADED, Redis.RECOVERING

_RETURNED: Row = (
    OK,
    (
        Do.CLEAR_ERROR,
        Do.OPEN_SHARE_WINDOW,
        Do.ANNOUNCE_RETURN,
        Do.SEND_UNRELEASED,
        Do.WAKE_ALL,
    ),
)
_LOCAL_SHARE_ROWS: dict[Redis, dict[On, Row]] = {
    OK: {
        On.FAILED: (
            DEGRADED,
            (Do.RECORD_ERROR, Do.FIX_OUTAGE_CAPS, Do.ANNOUNCE_OUTAGE, Do.WAKE_ALL),
        ),
        On.RENEWAL_DUE: (OK, (Do.RENEW,)),
        On.ACQUIRE: (OK, (Do.ASK_REDIS,)),
        On.RELEASES_WAITING: (OK, (Do.SEND_RELEASES,)),
    },
    DEGRADED: {
        On.FAILED: (DEGRADED, (Do.RECORD_ERROR,)),
        On.RENEWAL_DUE: (DEGRADED, (Do.PROBE,)),
        # Under a new epoch, so a call the outage delayed is fenced when it lands.
        On.PROBE_ANSWERED: (
            RECOVERING,
            (Do.NEW_EPOCH, Do.REGISTER_LOCAL_LEASES, Do.RUN_RETURN),
        ),
        # Another call failed while the return was on its way; the return answered.
        On.RETURN_REGISTERED: _RETURNED,
        On.RETURN_FAILED: (DEGRADED, (Do.WAKE_ALL,)),
        On.ACQUIRE: (DEGRADED, (Do.GRANT_LOCAL_SHARE,)),
        On.RELEASES_WAITING: (DEGRADED, (Do.KEEP_FOR_RETURN,)),
    },
    RECOVERING: {
        # Quietly: the return's own failure comes as ReturnFailed and wakes the waiters.
        On.FAILED: (DEGRADED, (Do.RECORD_ERROR,)),
        On.RETURN_REGISTERED: _RETURNED,
        On.RETURN_FAILED: (DEGRADED, (Do.WAKE_ALL,)),
        # Nothing is admitted on either side of the switch until the return is registered.
        On.ACQUIRE: (RECOVERING, (Do.AWAIT_RETURN,)),
        On.RELEASES_WAITING: (RECOVERING, (Do.KEEP_FOR_RETURN,)),
    },
}
_RETURNED_REJECT: Row = (
    OK,
    (Do.CLEAR_ERROR, Do.ANNOUNCE_RETURN, Do.SEND_UNRELEASED, Do.WAKE_ALL),
)
_REJECT_ROWS: dict[Redis, dict[On, Row]] = {
    DEGRADED: {
        On.ACQUIRE: (DEGRADED, (Do.REFUSE_UNAVAILABLE,)),
        On.RETURN_REGISTERED: _RETURNED_REJECT,
    },
    RECOVERING: {On.RETURN_REGISTERED: _RETURNED_REJECT},
}

TRANSITIONS: Mapping[Policy, Mapping[Redis, Mapping[On, Row]]] = {
    "local_share": _LOCAL_SHARE_ROWS,
    "reject": {
        state: {**rows, **_REJECT_ROWS.get(state, {})} for state, rows in _LOCAL_SHARE_ROWS.items()
    },
}
# What `handle` executes per row: the next state, the machine's own effects and the shell's
# (split once here, as the rows are fixed).
_Split: TypeAlias = tuple[Redis, tuple[Do, ...], tuple[Do, ...]]
_SPLIT: Mapping[Policy, Mapping[Redis, Mapping[On, _Split]]] = {
    policy: {
        state: {
            on: (
                nxt,
                tuple(d for d in effects if d in _OWN),
                tuple(d for d in effects if d not in _OWN),
            )
            for on, (nxt, effects) in rows.items()
        }
        for state, rows in table.items()
    }
    for policy, table in TRANSITIONS.items()
}


class BudgetMachine:
    """One replica's stance towards Redis for one engine pool's budget."""

    def __init__(
        self,
        policy: Policy,
        max_tokens: int | None,
        max_requests: int | None,
        expected_replicas: int,
        window_s: float,
    ) -> None:
        if policy not in TRANSITIONS:
            raise ValueError(f"policy must be local_share or reject, got {policy!r}")
        self.policy: Policy = policy
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self.replicas = max(1, expected_replicas)
        self.window_s = window_s
        self._rows = _SPLIT[policy]
        self.state = OK
        self.epoch = 1  # this replica's era of calls (budget.scripts: fencing)
        self.last_error: str | None = None
        # The policy's local share: an unlimited dimension stays unlimited.
        self.share_tokens = None if max_tokens is None else max(1, max_tokens // self.replicas)
        self.share_requests = (
            None if max_requests is None else max(1, max_requests // self.replicas)
        )
        # What this replica may hold while Redis is unavailable and in the recovery window
        # after it (`_fix_outage_caps`): its share, less if the others held more than theirs.
        self.cap_tokens = self.share_tokens
        self.cap_requests = self.share_requests
        self.share_until = 0.0  # monotonic time the post-outage share cap ends

    @property
    def degraded(self) -> bool:
        """Redis is not (yet) the budget's authority: the policy applies."""
        return self.state is not OK

    def handle(self, event: Event) -> tuple[Do, ...]:
        """Apply the event's row; return the effects the shell performs, in order."""
        on = event.on if isinstance(event, Signal) else _KIND[type(event)]
        row = self._rows[self.state].get(on)
        if row is None:
            raise BudgetProtocolError(f"{on.value} in state {self.state.value}")
        nxt, own, shell = row
        for do in own:
            self._do(do, event)
        self.state = nxt
        return shell

    def _do(self, do: Do, event: Event) -> None:
        """One of the machine's own effects; the row says which, the event gives the data."""
        if do is Do.RECORD_ERROR:
            assert isinstance(event, RedisFailed)
            self.last_error = event.error
        elif do is Do.FIX_OUTAGE_CAPS:
            assert isinstance(event, RedisFailed)
            self._fix_outage_caps(event.held)
        elif do is Do.NEW_EPOCH:
            self.epoch += 1
        elif do is Do.CLEAR_ERROR:
            self.last_error = None
        else:
            assert do is Do.OPEN_SHARE_WINDOW
            assert isinstance(event, ReturnRegistered)
            self.share_until = event.now + self.window_s

    def _fix_outage_caps(self, held: Held) -> None:
        """Fix this replica's cap for the outage that starts now: its share, but no more than
        what it holds plus an even part of the room that was free when Redis last answered.
        Each replica's share alone adds up to the budget only if nobody held more than its
        share at the switch; a replica that did keeps its work (it admits nothing more until
        it is under its cap), and the even parts of the free room leave the others no more
        than what is left. Sound up to what the cluster admitted between the last answer and
        the switch (a busy replica asks often, an idle one every third of the lease TTL)."""
        if self.share_tokens is not None and self.max_tokens is not None:
            free = max(0, self.max_tokens - held.cluster_tokens)
            self.cap_tokens = min(self.share_tokens, held.tokens + free // self.replicas)
        if self.share_requests is not None and self.max_requests is not None:
            free = max(0, self.max_requests - held.cluster_requests)
            self.cap_requests = min(self.share_requests, held.requests + free // self.replicas)

    # --- the caps, read by the shell's admission (no state changes) -------------------------

    def over_cap(self, tokens: int, in_use_tokens: int, in_use_requests: int) -> bool:
        """Would `tokens` more (and one request) take this replica past its outage cap?
        `in_use_*` count every lease it holds and every acquisition on its way to Redis."""
        if self.cap_tokens is not None and in_use_tokens + tokens > self.cap_tokens:
            return True
        return self.cap_requests is not None and in_use_requests + 1 > self.cap_requests

    def over_share(self, now: float, tokens: int, in_use_tokens: int, in_use_requests: int) -> bool:
        """Right after an outage (local_share, until `share_until`): would `tokens` more take
        this replica past its cap? The others may still hold local-share leases Redis cannot
        see yet."""
        if now >= self.share_until:
            return False
        return self.over_cap(tokens, in_use_tokens, in_use_requests)


_KIND: dict[type, On] = {RedisFailed: On.FAILED, ReturnRegistered: On.RETURN_REGISTERED}


def _render(table: Mapping[Policy, Mapping[Redis, Mapping[On, Row]]]) -> str:
    """The table as the docstring shows it: one line per state and event; the rows that
    differ under policy reject follow theirs, marked with it."""
    base, reject = table["local_share"], table["reject"]
    lines = []
    for state, rows in base.items():
        for on, row in rows.items():
            lines.append(_line(state, on, row, ""))
            if reject[state][on] != row:
                lines.append(_line(state, on, reject[state][on], "  [reject]"))
    return "\n".join(lines)


def _line(state: Redis, on: On, row: Row, tag: str) -> str:
    nxt, effects = row
    names = ", ".join(d.value for d in effects)
    return f"    {state.value:<12} {on.value:<18} -> {nxt.value:<12} {names}{tag}"


if __doc__:  # None under python -OO
    __doc__ = __doc__.replace("{TRANSITIONS}", _render(TRANSITIONS))
