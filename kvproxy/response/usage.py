"""What a response says about its prompt: the `usage` block's prompt size, the one figure
kvproxy compares its own count with (the drift check, kvproxy.policy.admission.check_usage). Pure.
"""

from __future__ import annotations

from typing import Any

import orjson


def prompt_tokens_of(obj: dict[str, Any]) -> int | None:
    """The prompt size a response's `usage` reports, under either name engines use."""
    usage = obj.get("usage")
    n = field_of(usage, "prompt_tokens")
    if n is None:
        n = field_of(usage, "input_tokens")  # /v1/responses and /v1/messages name it so
    return n if type(n) is int else None


def prompt_tokens_in(data: bytes) -> int | None:
    """`read_payload(data).prompt_tokens` of a valid JSON body, without the walk: only a
    top-level `usage` counts, so a body that cannot hold that key (not even escaped) is not
    decoded, and one whose last `"usage"` key is a top-level member is decoded from that
    key on. (A body that is not valid JSON may then read a figure the walk refuses: the
    number only feeds the drift check's metrics, never an admission.)"""
    # find, not `in` (which first tries the needle as an integer: kvproxy.tokens.bound.guarantee).
    at = data.rfind(b'"usage"')
    if at < 0 and data.find(b"\\") < 0:
        return None
    if at > 0 and data[at - 1] in _BEFORE_KEY:
        # A quote after `{`, `,` or white space is not escaped, so in a valid body it opens
        # a key here (`"usage"` then `:`) or a value (then `{` + the rest is no object).
        # From a key at depth d to the end, the rest closes d containers: `{` + the rest is
        # one object only for a top-level key, and holds every top-level member after it,
        # so a later duplicate (even escaped) wins as it does in the whole body. Decoding
        # the rest, not the body: the usage block is near the end of a response, and
        # decoding the whole of a small chat's answer cost ~1.5% of its instructions.
        try:
            tail = orjson.loads(b"{" + data[at:])
        except (orjson.JSONDecodeError, RecursionError):
            pass  # not a top-level key (or not a valid body): decode it all
        else:
            return prompt_tokens_of(tail)
    try:
        obj = orjson.loads(data)
    except (orjson.JSONDecodeError, RecursionError):
        return None
    return prompt_tokens_of(obj) if type(obj) is dict else None


# The bytes a top-level key's opening quote may follow in a JSON body (RFC 8259 white space).
_BEFORE_KEY = frozenset(b"{, \t\r\n")


def field_of(d: Any, key: str) -> Any:
    """`d[key]` when `d` is a JSON object that has it, else None (any JSON value is safe)."""
    return d.get(key) if type(d) is dict else None
