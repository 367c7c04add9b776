"""What a response's bytes mean, sans-IO: what the relay's client accepts of an upstream's
head (`head`), SSE framing (`sse`), what a client receives and which part is generated output
(`payload`), the `usage` it reports, the runtime canary tripwire (`tripwire`) and the
per-response inspector the relay pumps bytes through."""

from kvproxy.response.head import UpstreamProtocolError, check_interim, check_status, final_fields
from kvproxy.response.inspector import ResponseInspector, Step
from kvproxy.response.payload import body_texts, token_texts
from kvproxy.response.sse import SSEError, SSEParser
from kvproxy.response.tripwire import CanaryHit, CanaryRules, CanaryScanner

__all__ = [
    "CanaryHit", "CanaryRules", "CanaryScanner", "ResponseInspector", "SSEError", "SSEParser",
    "Step", "UpstreamProtocolError", "body_texts", "check_interim", "check_status",
    "final_fields", "token_texts",
]  # fmt: skip
