"""In-flight budget: the proxy-side form of "limit transfer batches".

Owns how many prompt tokens and requests may be upstream at once
(`KVPROXY_MAX_INFLIGHT_PROMPT_TOKENS`, `KVPROXY_MAX_INFLIGHT_REQUESTS`), the strict FIFO
queue of requests waiting for room, what one request is charged (`charge_tokens`: every
sequence of a batch, every sample), and the budget metrics. A request takes its prompt
tokens when admitted and gives them back only when `Lease.release()` is called, which the
proxy does when the upstream connection is actually closed: a deferred cancellation keeps
holding its share (I6, "cancelled is not reclaimable").

Outcomes of `acquire`:

    fits and nobody is queued        -> Lease at once
    could never fit (tokens > limit) -> over_budget at once, "can never fit" detail
    queue full, or no queueing (0)   -> over_budget at once, "queue is full" detail
    room within queue_timeout_s      -> Lease (strict FIFO: no overtaking, even by a
                                        smaller request that would fit now)
    no room within queue_timeout_s   -> over_budget (429 + Retry-After)

Must never: let a cancelled waiter keep tokens or block the queue, return tokens twice,
or read anything but counts (no request content reaches this module).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from kvproxy.budget.leases import Lease
from kvproxy.config import IMPLICIT_MODEL
from kvproxy.observe import Metrics
from kvproxy.policy import errors

# A client that got 429 should come back soon but not hammer us; the queue timeout is the
# time scale on which room appears, capped so a long queue timeout does not park clients.
MAX_RETRY_AFTER_S = 30


def charge_tokens(total_prompt_tokens: int, n: int) -> int:
    """Prompt tokens the engines will hold for one request: the sum over its sequences,
    once per sample.

    The admission limit is checked per sequence (that is how the engines check it), but a
    batch is several engine requests at once: SGLang's TokenizerManager splits a batched
    `/generate` or completions prompt list into one request per item, and with `n` > 1
    (`parallel_sample_num`) into n requests per item (tokenizer_manager.py,
    `_handle_batch_request`), each prefilled, transferred and held on decode on its own in
    PD mode; vLLM fans `n` out into child requests of one parent the same way. Charging the
    prompt n times is the conservative reading (prefix sharing can only make it smaller).
    The budget counts prompt tokens only: output is not charged (see I4 for decode)."""
    return total_prompt_tokens * max(n, 1)


def retry_after_s(queue_timeout_s: float) -> int:
    """The Retry-After a 429 (or a 503 of the Redis budget) carries: the queue timeout is the
    time scale on which room appears, capped by MAX_RETRY_AFTER_S."""
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(queue_timeout_s)))


class _Waiter:
    __slots__ = ("fut", "tokens")

    def __init__(self, tokens: int, fut: asyncio.Future[None]) -> None:
        self.tokens = tokens
        self.fut = fut


class InflightBudget:
    """Tokens and requests in flight upstream. One per server; event-loop confined."""

    def __init__(
        self,
        max_tokens: int | None,
        max_requests: int | None,
        queue_timeout_s: float,
        queue_max_waiters: int,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        model: str = IMPLICIT_MODEL,
    ) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("max_tokens must be >= 1 or None")
        if max_requests is not None and max_requests < 1:
            raise ValueError("max_requests must be >= 1 or None")
        if queue_timeout_s < 0 or queue_max_waiters < 0:
            raise ValueError("queue_timeout_s and queue_max_waiters must be >= 0")
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self.queue_timeout_s = queue_timeout_s
        self.queue_max_waiters = queue_max_waiters
        self._metrics = metrics
        self._model = model  # the gauges' `model` label: one budget per model's pool
        self._clock = clock
        self._tokens = 0
        self._requests = 0
        self._waiters: deque[_Waiter] = deque()
        self._retry_after_s = retry_after_s(queue_timeout_s)
        metrics.budget_tokens_limit.labels(model).set(max_tokens or 0)
        self._publish()

    @property
    def tokens_in_use(self) -> int:
        return self._tokens

    @property
    def requests_in_use(self) -> int:
        return self._requests

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    @property
    def limited(self) -> bool:
        return self.max_tokens is not None or self.max_requests is not None

    def room_now(self, tokens: int) -> bool:
        """Would `acquire(tokens)` be granted without a wait (nobody queued, room left)?"""
        return not self._waiters and self._fits(tokens)

    async def acquire(self, tokens: int) -> Lease:
        """A lease for `tokens` prompt tokens (`charge_tokens` of the request) and one
        request, or `KvproxyError` (429)."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if self.max_tokens is not None and tokens > self.max_tokens:
            raise errors.over_budget(
                self._retry_after_s,
                f"the request's {tokens:,} prompt tokens (every sequence and sample) can "
                f"never fit the in-flight budget of "
                f"{self.max_tokens:,} tokens (KVPROXY_MAX_INFLIGHT_PROMPT_TOKENS)",
            )
        if not self._waiters and self._fits(tokens):
            self._take(tokens)
            self._metrics.queue_wait.observe(0.0)
            return Lease(self, tokens, 0.0)
        if len(self._waiters) >= self.queue_max_waiters or self.queue_timeout_s == 0:
            raise errors.over_budget(
                self._retry_after_s,
                f"{self._describe_use()}; the wait queue is full "
                f"({len(self._waiters)} of {self.queue_max_waiters} waiting)",
            )
        return await self._wait(tokens)

    async def _wait(self, tokens: int) -> Lease:
        started = self._clock()
        waiter = _Waiter(tokens, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await waiter.fut
        except TimeoutError:
            if not self._granted(waiter):
                self._forget(waiter)
                raise errors.over_budget(
                    self._retry_after_s,
                    f"{self._describe_use()}; no room within the queue timeout of "
                    f"{self.queue_timeout_s:g} s (KVPROXY_QUEUE_TIMEOUT_S)",
                ) from None
            # Granted in the same loop turn the timer fired: the room is ours, keep it.
        except BaseException:
            # Cancelled (or anything else) while queued: leave no trace. If the grant
            # raced the cancellation, hand the tokens straight back to the next waiter.
            if self._granted(waiter):
                self._return(tokens)
            else:
                self._forget(waiter)
            raise
        waited = self._clock() - started
        self._metrics.queue_wait.observe(waited)
        return Lease(self, tokens, waited)

    async def start(self) -> None:
        """Nothing to connect: the local budget lives in this process."""

    async def aclose(self) -> None:
        """Nothing to close."""

    def describe_json(self) -> dict[str, Any]:
        return {
            "backend": "local",
            "max_tokens": self.max_tokens,
            "max_requests": self.max_requests,
            "replica_tokens_in_use": self._tokens,
            "replica_requests_in_use": self._requests,
            "queued": len(self._waiters),
        }

    def reject_waiting(self, detail: str = "the server is shutting down") -> int:
        """Fail every queued request with over_budget (on shutdown); returns how many."""
        n = 0
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.fut.done():
                waiter.fut.set_exception(errors.over_budget(self._retry_after_s, detail))
                n += 1
        return n

    # --- bookkeeping (event-loop confined, so no locks) ----------------------------------

    def _fits(self, tokens: int) -> bool:
        if self.max_requests is not None and self._requests + 1 > self.max_requests:
            return False
        return self.max_tokens is None or self._tokens + tokens <= self.max_tokens

    def _take(self, tokens: int) -> None:
        self._tokens += tokens
        self._requests += 1

    def give_back(self, lease: Lease) -> None:
        """LeaseOwner: a released lease's tokens come back."""
        self._return(lease.tokens)

    def _return(self, tokens: int) -> None:
        self._tokens -= tokens
        self._requests -= 1
        assert self._tokens >= 0, "budget released more tokens than taken"
        assert self._requests >= 0, "budget released more requests than taken"
        self._wake()

    def _wake(self) -> None:
        # Strict FIFO: grant from the head while it fits; the first that does not fit
        # blocks those behind it (fairness to large prompts over throughput).
        while self._waiters:
            head = self._waiters[0]
            if head.fut.done():  # cancelled or rejected, not yet forgotten
                self._waiters.popleft()
                continue
            if not self._fits(head.tokens):
                break
            self._waiters.popleft()
            self._take(head.tokens)
            head.fut.set_result(None)

    @staticmethod
    def _granted(waiter: _Waiter) -> bool:
        fut = waiter.fut
        return fut.done() and not fut.cancelled() and fut.exception() is None

    def _forget(self, waiter: _Waiter) -> None:
        with contextlib.suppress(ValueError):  # already popped by _wake or reject_waiting
            self._waiters.remove(waiter)
        # It may have been the head blocking others that fit now.
        self._wake()

    def _describe_use(self) -> str:
        parts = []
        if self.max_tokens is not None:
            parts.append(f"{self._tokens:,} of {self.max_tokens:,} prompt tokens in flight")
        if self.max_requests is not None:
            parts.append(f"{self._requests} of {self.max_requests} requests in flight")
        return ", ".join(parts) or "budget full"

    def _publish(self) -> None:
        # Read when Prometheus scrapes, not written on every acquire and release: a gauge
        # write takes a lock and was a measurable part of a small request's cost.
        self._metrics.budget_tokens_in_use.labels(self._model).set_function(lambda: self._tokens)
        self._metrics.queue_depth.labels(self._model).set_function(lambda: len(self._waiters))

    def __repr__(self) -> str:
        return (
            f"<InflightBudget tokens={self._tokens}/{self.max_tokens} "
            f"requests={self._requests}/{self.max_requests} queued={len(self._waiters)}>"
        )


class Budget(Protocol):
    """The interface the proxy and the app use: the local budget and the Redis one."""

    max_tokens: int | None

    @property
    def tokens_in_use(self) -> int: ...
    @property
    def requests_in_use(self) -> int: ...
    @property
    def queue_depth(self) -> int: ...
    async def acquire(self, tokens: int) -> Lease: ...
    # Would acquire(tokens) be granted without a wait, as far as this replica knows?
    def room_now(self, tokens: int) -> bool: ...
    def reject_waiting(self, detail: str = ...) -> int: ...
    async def start(self) -> None: ...
    async def aclose(self) -> None: ...
    def describe_json(self) -> dict[str, Any]: ...
