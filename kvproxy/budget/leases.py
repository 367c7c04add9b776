"""What a request holds while it is upstream: a `Lease` of in-flight budget, given back once
(`release()` is idempotent) to the budget that lent it, through the small `LeaseOwner`
interface both budgets implement (the local one, and the Redis one with its leases Redis
knows by `id` and, while Redis is unavailable, the leases of this replica's local share).

Must never: give a lease's tokens back twice, or reach into its owner's private state.
"""

from __future__ import annotations

from types import TracebackType
from typing import Protocol


class LeaseOwner(Protocol):
    """The budget a lease goes back to."""

    def give_back(self, lease: Lease) -> None: ...


class Lease:
    """A share of an in-flight budget. `with lease:` releases on exit.

    `id`: the lease's name in Redis, under the cluster budget (None under the local one, and
    for a lease of the local share until Redis counts it); `local`: taken from this replica's
    local share while Redis was unavailable."""

    __slots__ = ("_owner", "id", "local", "released", "tokens", "waited_s")

    def __init__(
        self,
        owner: LeaseOwner,
        tokens: int,
        waited_s: float = 0.0,
        *,
        lease_id: str | None = None,
        local: bool = False,
    ) -> None:
        self._owner = owner
        self.tokens = tokens
        self.waited_s = waited_s
        self.id = lease_id
        self.local = local
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._owner.give_back(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        kind = " local" if self.local else ""
        name = f" {self.id}" if self.id else ""
        return f"<Lease{kind}{name} tokens={self.tokens} released={self.released}>"
