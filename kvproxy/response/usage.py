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
    """`read_payload(data).prompt_tokens` without the walk: only a top-level `usage`
    counts, so a body that cannot hold that key (not even escaped) is not decoded."""
    # find, not `in` (which first tries the needle as an integer: kvproxy.tokens.guarantee).
    if data.find(b'"usage"') < 0 and data.find(b"\\") < 0:
        return None
    try:
        obj = orjson.loads(data)
    except (orjson.JSONDecodeError, RecursionError):
        return None
    return prompt_tokens_of(obj) if type(obj) is dict else None


def field_of(d: Any, key: str) -> Any:
    """`d[key]` when `d` is a JSON object that has it, else None (any JSON value is safe)."""
    return d.get(key) if type(d) is dict else None
