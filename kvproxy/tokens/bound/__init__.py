"""The bound tier: a guaranteed upper bound on the engine's token count, with no tokenizer
run. Pure, no I/O.

It decides *admit without counting*: byte bounds under the tokenizer family's rule and the
safe places to cut text (`bounds`), and for a chat-like request the guarantee (`guarantee`):
the template's proof (`proof`, once per template at start-up) multiplied by the raw
request's measures (`measure`). The guarantee never reads the replica tier's
normalisation or render, so it holds whatever an engine does with the request; the replica
tier's frames are the tight bound for plain chats (why both: tokens.replica).

Must never: log, return or keep any part of the text it measures.
"""

from kvproxy.tokens.bound import bounds
from kvproxy.tokens.bound.bounds import (
    EXACT_CHUNK_CHARS,
    NFC_MAX_EXPANSION,
    BoundRule,
    exact_chunks,
    segment_chunks,
    text_bound,
)
from kvproxy.tokens.bound.guarantee import ChatGuarantee, text_tokens

__all__ = [
    "EXACT_CHUNK_CHARS",
    "NFC_MAX_EXPANSION",
    "BoundRule",
    "ChatGuarantee",
    "bounds",
    "exact_chunks",
    "segment_chunks",
    "text_bound",
    "text_tokens",
]
