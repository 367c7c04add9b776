"""The gate tier: whether the exact count may admit a request. Pure, no I/O.

It decides *trust*, not a number: the features a request uses (`features`, a closed
vocabulary) against the verified table of the engines and router in front (`verified`).
A request with any unverified feature is decided by a guaranteed bound alone, because the
exact count renders the replica tier's normalisation and a gap there under-counts.

Must never: name a value, a client-chosen key or any text in a feature.
"""

from kvproxy.tokens.gate.features import INERT_KEYS, request_features
from kvproxy.tokens.gate.verified import Method, RouterKind, Verifier

__all__ = ["INERT_KEYS", "Method", "RouterKind", "Verifier", "request_features"]
