"""`decode_policy: clamp`: rewrite a request's output cap to what the decode pool can hold.

The only place kvproxy re-serialises a request body, and only when the verdict says the
output must shrink (I4). Pure: bytes in, bytes out, or a 400 naming the field; it is reached
only with bodies `parse_request` accepted, but it must hold for every JSON shape anyway,
because a crash here is a 500 for client input.

    route        field rewritten                              shapes
    chat         max_tokens (max_completion_tokens dropped)   the request object
    completions  max_tokens (max_completion_tokens dropped)   one cap for every prompt
    generate     sampling_params.max_new_tokens               object, null/absent (one is
                                                              made), or one object per item
    responses    max_output_tokens                            the request object
    messages     max_tokens                                   the request object

`cap` is the per-sample output the verdict computed from the batch's largest sequence, so it
is safe for every item; an item that already asks for less keeps its own value (clamping
never raises a cap). Never quotes request text in an error (I8).
"""

from __future__ import annotations

from typing import Any

import orjson

from kvproxy.policy.errors import KvproxyError, invalid_request
from kvproxy.policy.routes import Route


def clamp_output(body: bytes, route: Route, cap: int) -> bytes:
    """`body` with its output cap lowered to `cap` tokens per sample."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise invalid_request("request body is not valid JSON", None) from None
    if not isinstance(data, dict):
        raise invalid_request("request body must be a JSON object", None)
    if route == "generate":
        param = "sampling_params"
        data[param] = _clamp_sampling(data.get(param), cap)
    elif route in ("chat", "completions"):
        param = "max_tokens"
        data.pop("max_completion_tokens", None)
        data["max_tokens"] = _lowered(data.get("max_tokens"), cap)
    elif route == "responses":
        param = "max_output_tokens"
        data[param] = _lowered(data.get(param), cap)
    elif route == "messages":
        param = "max_tokens"
        data[param] = _lowered(data.get(param), cap)
    else:  # a route whose output field this module does not know: never forward unclamped
        raise invalid_request("decode_policy clamp cannot rewrite this route's output cap", None)
    try:
        return orjson.dumps(data)
    except orjson.JSONEncodeError:
        # orjson reads 1,024 levels of nesting but writes only 254: a deep field kvproxy
        # does not model cannot be re-serialised, so the request cannot be clamped.
        raise invalid_request(
            "request body is nested too deeply to rewrite its output cap "
            "(decode_policy clamp); send at most 254 levels",
            param,
        ) from None


def _clamp_sampling(sp: Any, cap: int) -> Any:
    if sp is None:
        return {"max_new_tokens": cap}
    if isinstance(sp, dict):
        return _clamp_item(sp, cap)
    if isinstance(sp, list) and not sp:
        raise invalid_request(
            "sampling_params must be an object or a non-empty array of objects",
            "sampling_params",
        )
    if isinstance(sp, list):
        out = []
        for i, item in enumerate(sp):
            if not isinstance(item, dict):
                p = f"sampling_params[{i}]"
                raise invalid_request(f"{p} must be an object", p)
            out.append(_clamp_item(item, cap))
        return out
    raise invalid_request(
        "sampling_params must be an object or an array of objects", "sampling_params"
    )


def _clamp_item(item: dict[str, Any], cap: int) -> dict[str, Any]:
    return {**item, "max_new_tokens": _lowered(item.get("max_new_tokens"), cap)}


def _lowered(value: Any, cap: int) -> Any:
    # Only a number already within the cap is kept; anything else (absent, null, a type
    # the parser would have refused) becomes the cap.
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return value if is_number and 0 <= value <= cap else cap


__all__ = ["KvproxyError", "clamp_output"]
