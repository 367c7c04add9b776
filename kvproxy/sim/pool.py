"""A paged KV pool whose pages remember who wrote them (sans-IO).

Owns: page allocation and release, the token content of every slot, which request
(``bootstrap_room``) last wrote each slot, which request owns each page, and the writes
that were issued into a page but have not landed yet. From those facts it derives the
ground-truth counters the safety tests assert on: writes that landed in a page another
request now owns, and pages released while writes into them were still in flight.

The allocator is a stack: the most recently freed pages are handed out first, the worst
case a busy production pool produces, so a stale or late-written page is reused at once.
A request's pages are pushed back in reverse so the next request receives them in the
same order; its reply then reads a previous tenant's text in order, as a real leak does.

Never does I/O, never sleeps, never looks at what the tokens mean.
"""

from __future__ import annotations

from dataclasses import dataclass

# A slot that no request ever wrote. Reading it yields no text but counts as stale.
EMPTY_TOKEN = -1
# Writer tag of a slot nobody wrote. Real rooms are random 63-bit integers, never 0.
NO_WRITER = 0


class PoolExhausted(Exception):
    """Not enough free pages right now (the caller queues and retries)."""


@dataclass
class PoolCounters:
    """Ground truth kept by the pool; every field only grows until reset()."""

    pages_allocated: int = 0
    pages_freed: int = 0
    pages_landed: int = 0
    pages_freed_before_drain: int = 0
    late_writes_into_reallocated_pages: int = 0
    late_writes_into_free_pages: int = 0


class PagedPool:
    """A pool of ``pool_tokens`` tokens in pages of ``page_size``.

    The reported size (``total_tokens``) is ``pool_tokens`` as configured, and the last page
    may be partial. Real SGLang rounds its pool down to a page multiple before reporting;
    the simulator does not, so the demo's scaled-down incident numbers (681,280 / 128 =
    5,322 tokens, page 16) come out as the issue states them: ``max_total_num_tokens``
    5,322, ``max_req_input_len`` 5,316, largest accepted prompt 5,315. Holding
    ``ceil(pool / page)`` pages keeps every prompt the engine accepts allocatable."""

    def __init__(self, pool_tokens: int, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if pool_tokens < page_size:
            raise ValueError(f"pool of {pool_tokens} tokens holds no page of {page_size}")
        self.page_size = page_size
        self.num_pages = -(-pool_tokens // page_size)
        self.total_tokens = pool_tokens
        slots = self.num_pages * page_size
        self.tokens: list[int] = [EMPTY_TOKEN] * slots
        self.writers: list[int] = [NO_WRITER] * slots
        self.owner: list[int | None] = [None] * self.num_pages
        self.pending_writes: list[int] = [0] * self.num_pages
        # Top of the stack is the end of the list; page 0 is handed out first at start.
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self.counters = PoolCounters()

    # -- capacity -------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_tokens(self) -> int:
        return min(self.total_tokens, (self.num_pages - len(self._free)) * self.page_size)

    def pages_for(self, num_tokens: int) -> int:
        return max(1, -(-num_tokens // self.page_size))

    # -- allocation -------------------------------------------------------------

    def alloc(self, num_pages: int, owner: int) -> list[int]:
        if num_pages > self.num_pages:
            raise ValueError(f"{num_pages} pages can never fit a pool of {self.num_pages}")
        if num_pages > len(self._free):
            raise PoolExhausted(f"{num_pages} pages wanted, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(num_pages)]
        for page in pages:
            self.owner[page] = owner
        self.counters.pages_allocated += num_pages
        return pages

    def free(self, pages: list[int], owner: int) -> int:
        """Release ``owner``'s pages; returns how many still had writes in flight."""
        undrained = 0
        for page in reversed(pages):
            if self.owner[page] != owner:
                continue  # already released (double free is a no-op, not a crash)
            self.owner[page] = None
            if self.pending_writes[page] > 0:
                undrained += 1
            self._free.append(page)
            self.counters.pages_freed += 1
        self.counters.pages_freed_before_drain += undrained
        return undrained

    # -- writes (the NIC side) -------------------------------------------------------

    def issue_write(self, page: int) -> None:
        """A write into ``page`` is on the wire; it will land whatever happens next."""
        self.pending_writes[page] += 1

    def land_write(self, page: int, tokens: list[int], writer: int) -> None:
        """The write lands: slots 0..len(tokens)-1 of ``page`` now hold ``writer``'s data.

        The pool does not refuse it: remote memory writes do not ask the receiver's
        scheduler. Who owns the page decides whether the landing is a leak.
        """
        if self.pending_writes[page] > 0:
            self.pending_writes[page] -= 1
        owner = self.owner[page]
        if owner is None:
            self.counters.late_writes_into_free_pages += 1
        elif owner != writer:
            self.counters.late_writes_into_reallocated_pages += 1
        base = page * self.page_size
        n = min(len(tokens), self.page_size)
        self.tokens[base : base + n] = tokens[:n]
        self.writers[base : base + n] = [writer] * n
        self.counters.pages_landed += 1

    def write_local(self, page: int, tokens: list[int], writer: int) -> None:
        """The engine's own forward pass writes KV for its request (no wire involved)."""
        base = page * self.page_size
        n = min(len(tokens), self.page_size)
        self.tokens[base : base + n] = tokens[:n]
        self.writers[base : base + n] = [writer] * n

    # -- reads ---------------------------------------------------------------------

    def read(self, pages: list[int], position: int) -> tuple[int, int]:
        """(token, writer) at logical ``position`` of a request holding ``pages``."""
        page = pages[position // self.page_size]
        index = page * self.page_size + position % self.page_size
        return self.tokens[index], self.writers[index]

    def read_page(self, page: int, count: int) -> list[int]:
        base = page * self.page_size
        return self.tokens[base : base + min(count, self.page_size)]

    def reset_counters(self) -> None:
        self.counters = PoolCounters()
