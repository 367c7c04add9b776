"""The KV transfer checksum of SGLang's `--disaggregation-enable-kv-checksum` (PR #39500),
the simulator's way: prefill digests the KV it hands off and sends the digest with the
final "done"; decode re-digests what actually landed in its own pages and, on a mismatch,
aborts the request and counts a transfer failure instead of decoding from it.

The engine uses Adler-32 over the KV tensors; the simulator's "KV" is the token ids each
slot holds, so the digest is Adler-32 over those. Only a pair with the flag on BOTH sides
is protected: prefill without it sends no digest, decode without it reads none.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from kvproxy.sim.pool import PagedPool


def kv_digest(tokens: Iterable[int]) -> int:
    return zlib.adler32(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))


def landed_digest(pool: PagedPool, pages: list[int], num_tokens: int) -> int:
    """Digest of the first `num_tokens` slots of `pages`, as decode holds them now."""
    ps = pool.page_size
    tokens: list[int] = []
    for i, page in enumerate(pages):
        left = num_tokens - i * ps
        if left <= 0:
            break
        tokens.extend(pool.read_page(page, left))
    return kv_digest(tokens)
