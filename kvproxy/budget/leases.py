"""What a request holds under the cluster budget (`budget_redis`): a lease Redis knows, or,
while Redis is unavailable, one of this replica's local share. Both give their tokens back
through the budget that lent them; `release()` is idempotent."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvproxy.budget.cluster import RedisBudget


class RedisLease:
    """A share of the cluster budget held under lease `id` in Redis."""

    __slots__ = ("_budget", "id", "released", "tokens", "waited_s")

    def __init__(self, budget: RedisBudget, lease_id: str, tokens: int, waited_s: float):
        self._budget = budget
        self.id = lease_id
        self.tokens = tokens
        self.waited_s = waited_s
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._budget._release(self)

    def __repr__(self) -> str:
        return f"<RedisLease {self.id} tokens={self.tokens} released={self.released}>"


class FallbackLease:
    """A lease of the local share taken while Redis was unavailable. When Redis returns while
    it is still held, it is registered there too (`redis_id`), so the cluster budget counts
    it."""

    __slots__ = ("_budget", "redis_id", "released", "tokens", "waited_s")

    def __init__(self, budget: RedisBudget, tokens: int) -> None:
        self._budget = budget
        self.tokens = tokens
        # Granted at once or refused: the local share has no queue (see `RedisBudget`).
        self.waited_s = 0.0
        self.released = False
        self.redis_id: str | None = None

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._budget._fallback_released(self)

    def __repr__(self) -> str:
        return f"<FallbackLease tokens={self.tokens} released={self.released}>"
