"""Input limits and error bodies, computed the way the real engines compute them.

Owns: SGLang's ``max_req_input_len`` arithmetic, the places SGLang refuses a prompt (the
tokenizer manager's context checks and the scheduler's pool check), the scheduler's
silent clamp of ``max_new_tokens``, vLLM's ``max_model_len`` check, and the exact error
bodies each engine returns for them. Behaviour, not code, of (python/sglang/srt):

  reserve         = max(eagle_topk * num_steps, num_draft_tokens) under EAGLE, else 0
                    (tokenizer_manager: num_reserved_tokens / compute_num_reserved_tokens)
  pool            = max_total_num_tokens per rank, rounded down to whole pages
  max_req_len     = min(context_len - 1, pool * dcp_size - 1)   (tp_worker, PR #33448)
  max_req_input_len = max_req_len - 5
  refuse when len(input_ids) + reserve >= context_len           (tokenizer manager, 400)
  refuse when input + reserve + max_new_tokens > context_len    (tokenizer manager, 400;
                                                                 ``>`` in current builds)
  refuse when len(input_ids) >= max_req_input_len              (scheduler, 400; in PD the
                                                                 buggy path instead swaps in
                                                                 a one-token placeholder)
  max_new_tokens  = max(0, min(asked or 2**30, max_req_len - input - 1,
                               pool * dcp - ceil_page(input) - page - 1))
                    (scheduler.init_req_max_new_tokens, PRs #25126 and #33448): silent
So without speculative decoding the largest accepted prompt is min(context, pool) - 7.

vLLM (v0.18+ renderer): refuse when input >= max_model_len or input + max_tokens >
max_model_len, with the "requested M output tokens and your prompt contains T input
tokens" message.

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
    pool_tokens: int  # one rank's pool, as max_total_num_tokens reports it
    reserved_tokens: int = 0  # the speculative reserve (num_reserved_tokens)
    dcp_size: int = 1
    page_size: int = 1

    @property
    def logical_pool(self) -> int:
        """DCP shards a sequence over its ranks: a request may hold pool x dcp tokens."""
        return self.pool_tokens * self.dcp_size

    @property
    def max_req_len(self) -> int:
        return min(self.context_len - 1, self.logical_pool - 1)

    @property
    def max_req_input_len(self) -> int:
        return self.max_req_len - 5

    @property
    def largest_prompt(self) -> int:
        return min(self.max_req_input_len - 1, self.context_len - self.reserved_tokens - 1)


def reserved_tokens(config: Any) -> int:
    """SGLang's num_reserved_tokens from its server arguments (an ``EngineConfig``).

    Under an EAGLE-family algorithm the draft tokens live in the output slots, so the
    tokenizer manager reserves max(topk * steps, draft tokens); NGRAM (and no algorithm)
    reserves nothing (spec_info.SpeculativeAlgorithm.is_eagle).
    """
    algorithm = config.speculative_algorithm
    if config.flavor != "sglang" or algorithm is None or algorithm.upper() in ("NONE", "NGRAM"):
        return 0
    return max(
        (config.speculative_eagle_topk or 0) * (config.speculative_num_steps or 0),
        config.speculative_num_draft_tokens or 0,
    )


def check_context(flavor: Flavor, limits: Limits, n_input: int, max_new_tokens: int | None) -> None:
    """The front-end check every engine makes against the model's context (raises 400)."""
    ctx = limits.context_len
    if flavor == "vllm":
        out = max_new_tokens or 0
        if n_input >= ctx or n_input + out > ctx:
            # The v0.18+ wording (vllm/renderers); exact token counts, so no "at least".
            raise EngineError(
                f"This model's maximum context length is {ctx} tokens. However, you "
                f"requested {out} output tokens and your prompt contains {n_input} input "
                f"tokens, for a total of {n_input + out} tokens. Please reduce the length "
                "of the input prompt or the number of requested output tokens. "
                f"(parameter=input_tokens, value={n_input})"
            )
        return
    # SGLang counts the speculative reserve as input in both checks, and says so.
    counted = n_input + limits.reserved_tokens
    if counted >= ctx:
        raise EngineError(
            f"The input ({counted} tokens) is longer than the model's context length "
            f"({ctx} tokens)."
        )
    if max_new_tokens is not None and counted + max_new_tokens > ctx:
        raise EngineError(
            f"Requested token count exceeds the model's maximum context length of {ctx} "
            f"tokens. You requested a total of {counted + max_new_tokens} tokens: "
            f"{counted} tokens from the input messages and {max_new_tokens} tokens for "
            "the completion. Please reduce the number of tokens in the input messages or "
            "the completion to fit within the limit."
        )


def pool_refusal(limits: Limits, n_input: int, flavor: Flavor = "sglang") -> str | None:
    """SGLang scheduler's message when the prompt does not fit the pool, else None.

    vLLM has no such check: it refuses to start when max_model_len exceeds its pool, so
    the context check is its only refusal."""
    if flavor == "vllm" or n_input < limits.max_req_input_len:
        return None
    return (
        f"Input length ({n_input} tokens) exceeds the maximum allowed length "
        f"({limits.max_req_input_len} tokens). Use a shorter input or enable "
        "--allow-auto-truncate."
    )


def clamp_new_tokens(limits: Limits, n_input: int, max_new_tokens: int | None) -> int:
    """SGLang's silent clamp: what the scheduler lets a request generate, never a refusal."""
    page = limits.page_size
    paged_input = -(-n_input // page) * page
    asked = (1 << 30) if max_new_tokens is None else max_new_tokens
    room = min(limits.max_req_len - n_input - 1, limits.logical_pool - paged_input - page - 1)
    return max(0, min(asked, room))


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
