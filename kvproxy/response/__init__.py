"""What a response's bytes mean, sans-IO: SSE framing (`sse`), what a client receives and
which part is generated output (`payload`), the `usage` it reports, the runtime canary
tripwire (`tripwire`) and the per-response inspector the relay pumps bytes through."""

from kvproxy.response.inspector import ResponseInspector, Step
from kvproxy.response.payload import body_texts, token_texts
from kvproxy.response.sse import SSEError, SSEParser
from kvproxy.response.tripwire import CanaryHit, CanaryRules, CanaryScanner

__all__ = [
    "CanaryHit", "CanaryRules", "CanaryScanner", "ResponseInspector", "SSEError", "SSEParser",
    "Step", "body_texts", "token_texts",
]  # fmt: skip
