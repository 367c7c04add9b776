"""Input limits and error bodies, computed the way the real engines compute them.

Owns: SGLang's ``max_req_input_len`` arithmetic, the two places SGLang refuses a prompt
(the tokenizer manager's context check and the scheduler's pool check), vLLM's
``max_model_len`` check, and the exact error bodies each engine returns for them.

SGLang (python/sglang/srt, behaviour not code):
  pool            = max_total_num_tokens, rounded down to whole pages
  max_req_len     = min(context_len - 1, pool - 1)
  max_req_input_len = max_req_len - 5
  refuse when len(input_ids) >= context_len            (tokenizer manager, 400)
  refuse when input + max_new_tokens >= context_len    (tokenizer manager, 400)
  refuse when len(input_ids) >= max_req_input_len      (scheduler, 400; in PD the buggy
                                                        path instead swaps in a one-token
                                                        placeholder and keeps going)
So the largest accepted prompt is min(context, pool) - 7.

Independent oracle: never import kvproxy code outside ``kvproxy/sim``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Flavor = Literal["sglang", "vllm"]


class EngineError(Exception):
    """A refusal with the HTTP status the real engine uses."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True)
class Limits:
    context_len: int
    pool_tokens: int

    @property
    def max_req_len(self) -> int:
        return min(self.context_len - 1, self.pool_tokens - 1)

    @property
    def max_req_input_len(self) -> int:
        return self.max_req_len - 5

    @property
    def largest_prompt(self) -> int:
        return self.max_req_input_len - 1


def check_context(flavor: Flavor, limits: Limits, n_input: int, max_new_tokens: int | None) -> None:
    """The front-end check every engine makes against the model's context (raises 400)."""
    ctx = limits.context_len
    if flavor == "vllm":
        requested = n_input + (max_new_tokens or 0)
        if n_input >= ctx or requested > ctx:
            raise EngineError(
                f"This model's maximum context length is {ctx} tokens. However, you "
                f"requested {requested} tokens ({n_input} in the messages, "
                f"{max_new_tokens or 0} in the completion). Please reduce the length of "
                "the messages or completion."
            )
        return
    if n_input >= ctx:
        raise EngineError(
            f"The input ({n_input} tokens) is longer than the model's context length "
            f"({ctx} tokens)."
        )
    if max_new_tokens is not None and n_input + max_new_tokens >= ctx:
        raise EngineError(
            f"Requested token count exceeds the model's maximum context length of {ctx} "
            f"tokens. You requested a total of {n_input + max_new_tokens} tokens: "
            f"{n_input} tokens from the input messages and {max_new_tokens} tokens for "
            "the completion. Please reduce the number of tokens in the input messages or "
            "the completion to fit within the limit."
        )


def pool_refusal(limits: Limits, n_input: int) -> str | None:
    """SGLang scheduler's message when the prompt does not fit the pool, else None."""
    if n_input < limits.max_req_input_len:
        return None
    return (
        f"Input length ({n_input} tokens) exceeds the maximum allowed length "
        f"({limits.max_req_input_len} tokens). Use a shorter input or enable "
        "--allow-auto-truncate."
    )


def clamp_new_tokens(limits: Limits, n_input: int, max_new_tokens: int | None) -> int:
    room = max(0, limits.max_req_len - n_input - 1)
    return room if max_new_tokens is None else max(0, min(max_new_tokens, room))


def error_type(status: int) -> str:
    return {
        400: "BadRequestError",
        404: "NotFoundError",
        422: "BadRequestError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }.get(status, "BadRequestError")


def openai_error_body(flavor: Flavor, message: str, status: int) -> dict[str, Any]:
    """Non-streaming error body of the OpenAI-compatible routes.

    SGLang answers a flat ``{"object": "error", ...}``; vLLM (>= 0.10.1) nests it under
    ``"error"``.
    """
    inner: dict[str, Any] = {
        "message": message,
        "type": error_type(status),
        "param": None,
        "code": status,
    }
    if flavor == "vllm":
        return {"error": inner}
    return {"object": "error", **inner}


def stream_error_event(flavor: Flavor, message: str, status: int) -> dict[str, Any]:
    """The ``data:`` payload of the HTTP-200-plus-error-event form of a refused stream."""
    inner: dict[str, Any] = {
        "message": message,
        "type": error_type(status),
        "param": None,
        "code": status,
    }
    if flavor == "sglang":
        inner = {"object": "error", **inner}
    return {"error": inner}


def native_error_body(message: str) -> dict[str, Any]:
    """SGLang's native ``/generate`` error body."""
    return {"error": {"message": message}}
