"""The cluster budget's stance towards Redis (`budget.machine`) driven without Redis: every
event in every state under both policies, legal or not, against the behaviour written out
here row by row; then what the machine's own effects leave in its fields (epoch, error, the
outage's caps, the share window)."""

from __future__ import annotations

import pytest

from kvproxy.budget import machine
from kvproxy.budget.machine import (
    ACQUIRE,
    PROBE_ANSWERED,
    RELEASES_WAITING,
    RENEWAL_DUE,
    RETURN_FAILED,
    TRANSITIONS,
    BudgetMachine,
    BudgetProtocolError,
    Do,
    Event,
    Held,
    On,
    Policy,
    Redis,
    RedisFailed,
    ReturnRegistered,
)

OK, DEGRADED, RECOVERING = Redis.OK, Redis.DEGRADED, Redis.RECOVERING
WINDOW_S = 5.0
NOTHING = Held(0, 0, 0, 0)


def failed(error: str = "ConnectionError", held: Held = NOTHING) -> RedisFailed:
    return RedisFailed(error, held)


def event_for(on: On) -> Event:
    return {
        On.FAILED: failed(),
        On.RENEWAL_DUE: RENEWAL_DUE,
        On.PROBE_ANSWERED: PROBE_ANSWERED,
        On.RETURN_REGISTERED: ReturnRegistered(100.0),
        On.RETURN_FAILED: RETURN_FAILED,
        On.ACQUIRE: ACQUIRE,
        On.RELEASES_WAITING: RELEASES_WAITING,
    }[on]


# The behaviour of RedisBudget before the machine, as (next state, the shell's effects); a
# missing entry is an event that cannot happen in that state.
_RETURN = (OK, (Do.ANNOUNCE_RETURN, Do.SEND_UNRELEASED, Do.WAKE_ALL))
EXPECTED: dict[Policy, dict[Redis, dict[On, tuple[Redis, tuple[Do, ...]]]]] = {
    policy: {
        OK: {
            On.FAILED: (DEGRADED, (Do.ANNOUNCE_OUTAGE, Do.WAKE_ALL)),
            On.RENEWAL_DUE: (OK, (Do.RENEW,)),
            On.ACQUIRE: (OK, (Do.ASK_REDIS,)),
            On.RELEASES_WAITING: (OK, (Do.SEND_RELEASES,)),
        },
        DEGRADED: {
            On.FAILED: (DEGRADED, ()),
            On.RENEWAL_DUE: (DEGRADED, (Do.PROBE,)),
            On.PROBE_ANSWERED: (RECOVERING, (Do.REGISTER_LOCAL_LEASES, Do.RUN_RETURN)),
            On.RETURN_REGISTERED: _RETURN,
            On.RETURN_FAILED: (DEGRADED, (Do.WAKE_ALL,)),
            On.ACQUIRE: (
                DEGRADED,
                (Do.GRANT_LOCAL_SHARE if policy == "local_share" else Do.REFUSE_UNAVAILABLE,),
            ),
            On.RELEASES_WAITING: (DEGRADED, (Do.KEEP_FOR_RETURN,)),
        },
        RECOVERING: {
            # No wake: the return under way ends with ReturnFailed, which wakes.
            On.FAILED: (DEGRADED, ()),
            On.RETURN_REGISTERED: _RETURN,
            On.RETURN_FAILED: (DEGRADED, (Do.WAKE_ALL,)),
            On.ACQUIRE: (RECOVERING, (Do.AWAIT_RETURN,)),
            On.RELEASES_WAITING: (RECOVERING, (Do.KEEP_FOR_RETURN,)),
        },
    }
    for policy in ("local_share", "reject")
}
# How each state is reached from the start.
PATHS: dict[Redis, list[Event]] = {
    OK: [],
    DEGRADED: [failed()],
    RECOVERING: [failed(), PROBE_ANSWERED],
}
POLICIES: tuple[Policy, ...] = ("local_share", "reject")


def at(state: Redis, policy: Policy, **kw: int | None) -> BudgetMachine:
    sizes: dict[str, int | None] = {"max_tokens": 100, "max_requests": 10, **kw}
    m = BudgetMachine(policy, sizes["max_tokens"], sizes["max_requests"], 2, WINDOW_S)
    for event in PATHS[state]:
        m.handle(event)
    assert m.state is state
    return m


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("state", list(Redis))
@pytest.mark.parametrize("on", list(On))
def test_every_event_in_every_state(policy: Policy, state: Redis, on: On) -> None:
    m = at(state, policy)
    expected = EXPECTED[policy][state].get(on)
    if expected is None:
        before = dict(vars(m))
        with pytest.raises(BudgetProtocolError, match=f"{on.value} in state {state.value}"):
            m.handle(event_for(on))
        assert vars(m) == before  # refused without a trace
        return
    assert m.handle(event_for(on)) == expected[1]
    assert m.state is expected[0]
    assert m.degraded is (expected[0] is not OK)


def test_the_table_is_the_expected_behaviour_and_nothing_more() -> None:
    for policy in POLICIES:
        for state in Redis:
            assert set(TRANSITIONS[policy][state]) == set(EXPECTED[policy][state])


def test_a_row_ends_with_at_most_one_duty() -> None:
    """The shell performs effects in order and stops at the duty (`RedisBudget._apply`)."""
    assert {d.value for d in machine.DUTIES} == {
        "Renew",
        "Probe",
        "RunReturn",
        "AskRedis",
        "GrantLocalShare",
        "RefuseUnavailable",
        "AwaitReturn",
        "SendReleases",
        "KeepForReturn",
    }
    for table in TRANSITIONS.values():
        for rows in table.values():
            for _, effects in rows.values():
                found = [i for i, d in enumerate(effects) if d in machine.DUTIES]
                assert found in ([], [len(effects) - 1]), effects


def test_an_outage_fixes_the_caps_at_the_switch_only() -> None:
    m = at(OK, "local_share", max_tokens=100, max_requests=10)
    assert (m.share_tokens, m.share_requests) == (50, 5)
    assert (m.cap_tokens, m.cap_requests) == (50, 5)
    # 30 tokens / 1 request held here; the cluster held 90 / 8: the free 10 / 2 split in two.
    m.handle(failed("TimeoutError", Held(30, 1, 90, 8)))
    assert (m.cap_tokens, m.cap_requests) == (35, 2)
    assert m.last_error == "TimeoutError"
    # More failures while degraded record the error and leave the caps.
    m.handle(failed("BadReply", Held(0, 0, 0, 0)))
    assert (m.cap_tokens, m.cap_requests) == (35, 2)
    assert m.last_error == "BadReply"
    # A replica holding more than its share keeps its work and admits nothing more.
    m2 = at(OK, "local_share")
    m2.handle(failed(held=Held(80, 1, 100, 1)))
    assert m2.cap_tokens == 50
    assert m2.over_cap(0, 80, 1)


def test_a_failure_during_the_return_does_not_fix_the_caps_again() -> None:
    m = at(OK, "local_share")
    m.handle(failed(held=Held(10, 1, 40, 1)))
    assert m.cap_tokens == 40  # min(50, 10 + 60 // 2)
    m.handle(PROBE_ANSWERED)
    m.handle(failed("TimeoutError", Held(0, 0, 0, 0)))
    assert m.state is DEGRADED
    assert m.cap_tokens == 40
    assert m.last_error == "TimeoutError"


def test_each_return_starts_a_new_epoch_and_clears_the_error() -> None:
    m = at(OK, "local_share")
    assert m.epoch == 1
    m.handle(failed())
    assert m.epoch == 1
    m.handle(PROBE_ANSWERED)
    assert m.epoch == 2
    m.handle(RETURN_FAILED)  # the return's renewal failed: the epoch stays spent
    m.handle(PROBE_ANSWERED)
    assert m.epoch == 3
    assert m.last_error == "ConnectionError"
    m.handle(ReturnRegistered(100.0))
    assert m.state is OK
    assert m.epoch == 3
    assert m.last_error is None


@pytest.mark.parametrize("policy", POLICIES)
def test_the_share_window_after_a_return(policy: Policy) -> None:
    m = at(RECOVERING, policy)
    assert m.share_until == 0.0
    m.handle(ReturnRegistered(100.0))
    if policy == "reject":
        assert m.share_until == 0.0
        assert not m.over_share(100.0, 1000, 0, 0)
        return
    assert m.share_until == 100.0 + WINDOW_S
    # Within the window the cap applies to Redis admissions too; after it, not.
    assert m.over_share(100.0, 51, 0, 0)
    assert not m.over_share(100.0, 50, 0, 0)
    assert not m.over_share(100.0 + WINDOW_S, 1000, 0, 0)


def test_the_next_outage_fixes_the_caps_anew() -> None:
    m = at(OK, "local_share")
    m.handle(failed(held=Held(0, 0, 100, 10)))
    assert (m.cap_tokens, m.cap_requests) == (0, 0)
    m.handle(PROBE_ANSWERED)
    m.handle(ReturnRegistered(0.0))
    m.handle(failed(held=Held(0, 0, 20, 2)))
    assert (m.cap_tokens, m.cap_requests) == (40, 4)


def test_over_cap_counts_tokens_and_one_request() -> None:
    m = at(OK, "local_share")
    assert not m.over_cap(50, 0, 0)
    assert m.over_cap(1, 50, 0)
    assert not m.over_cap(0, 0, 4)
    assert m.over_cap(0, 0, 5)  # the request would be the sixth of a share of 5


def test_an_unlimited_dimension_stays_unlimited() -> None:
    m = at(OK, "local_share", max_tokens=None, max_requests=3)
    assert (m.share_tokens, m.share_requests) == (None, 1)
    m.handle(failed(held=Held(0, 0, 10**9, 0)))
    assert m.cap_tokens is None
    assert m.cap_requests == 1
    assert not m.over_cap(10**9, 10**9, 0)
    unlimited = at(OK, "reject", max_tokens=None, max_requests=None)
    unlimited.handle(failed())
    assert not unlimited.over_cap(10**9, 10**9, 10**9)


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="local_share or reject"):
        BudgetMachine("queue", 1, 1, 1, 1.0)  # type: ignore[arg-type]


def test_the_docstring_is_the_table() -> None:
    doc = machine.__doc__
    assert doc is not None
    assert "{TRANSITIONS}" not in doc
    rows = sum(len(r) for r in TRANSITIONS["local_share"].values())
    differing = sum(
        TRANSITIONS["reject"][s][on] != row
        for s, r in TRANSITIONS["local_share"].items()
        for on, row in r.items()
    )
    lines = [line for line in doc.splitlines() if " -> " in line and "state" not in line]
    assert len(lines) == rows + differing == 16 + 3
    assert (
        "    degraded     ProbeAnswered      -> recovering   new_epoch, RegisterLocalLeases, "
        "RunReturn"
    ) in doc
    assert "    degraded     Acquire            -> degraded     RefuseUnavailable  [reject]" in doc
