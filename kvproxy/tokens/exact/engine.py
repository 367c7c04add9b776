"""The engine's own tokenizer, over HTTP: `POST /tokenize` on an SGLang or vLLM engine.

vLLM's `/tokenize` accepts chat `messages` and applies the model's template itself, with the
same normalisation and renderer as its chat completions: the counter sends it the *client's*
own chat fields (`client_chat_fields`), never kvproxy's normalised ones, so the count is the
engine's by construction. SGLang's accepts only `prompt` (facts/ENGINES.md), so for SGLang
the counter renders the template locally and sends the rendered string with
`add_special_tokens: false` (that render is kvproxy's replica: tokens.gate.verified gates it).

The reply carries every token id (a 1 M-token prompt answers ~7 MB): parsing that with
orjson would hold the GIL on the event loop for ~10-20 ms, so large replies are searched
for their `"count"` field instead of being parsed whole.

`EngineTokenize` is the seam: tests and callers may pass any coroutine function with this
shape; `EngineTokenizer` is the aiohttp implementation. Requests carry prompt text to the
engine (that is their job); nothing here logs it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import aiohttp
import orjson

EngineKind = Literal["sglang", "vllm"]
# Replies under this size are parsed; above it only the count field is read.
PARSE_REPLY_BYTES = 256 * 1024
_COUNT = re.compile(rb'"count"\s*:\s*(\d+)')
# The chat fields vLLM's /tokenize takes and renders as its chat completions do
# (vllm/entrypoints/serve/tokenize/protocol.py TokenizeChatRequest). Everything else the
# client sent is left out: a field /tokenize would not render is a feature the verified
# table does not list for this path, so such a request never gets here (tokens.gate.verified).
VLLM_TOKENIZE_CHAT_FIELDS = (
    "messages",
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
)


def client_chat_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's own chat fields for vLLM's /tokenize, exactly as sent (absent ones stay
    absent: the engine applies its own defaults)."""
    return {k: body[k] for k in VLLM_TOKENIZE_CHAT_FIELDS if k in body}


@dataclass(frozen=True, slots=True)
class EngineTokenizeRequest:
    """Exactly one of `prompt`, `messages` (kvproxy's own messages) or `fields` (the
    client's chat fields, sent as they are)."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    fields: Mapping[str, Any] | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None or self.fields is not None

    def body(self) -> bytes:
        payload: dict[str, Any]
        if self.fields is not None:
            payload = dict(self.fields)
        elif self.messages is not None:
            payload = {
                "messages": self.messages,
                "add_generation_prompt": self.add_generation_prompt,
                "add_special_tokens": False,
            }
            if self.tools:
                payload["tools"] = self.tools
            if self.chat_template_kwargs:
                payload["chat_template_kwargs"] = self.chat_template_kwargs
        else:
            payload = {"prompt": self.prompt or "", "add_special_tokens": self.add_special_tokens}
        return orjson.dumps(payload)


class EngineTokenize(Protocol):
    """Counts tokens with the engine's tokenizer; raises on any failure."""

    @property
    def accepts_messages(self) -> bool: ...

    async def __call__(self, request: EngineTokenizeRequest) -> int: ...


class EngineTokenizeError(Exception):
    """The engine did not return a usable count (status, shape); carries no text."""


class EngineTokenizer:
    """`POST {base_url}/tokenize` with a shared aiohttp session (the caller owns it)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, kind: EngineKind) -> None:
        self._session = session
        self._url = base_url.rstrip("/") + "/tokenize"
        self.kind = kind

    @property
    def accepts_messages(self) -> bool:
        return self.kind == "vllm"

    def describe(self) -> str:
        return f"engine /tokenize at {self._url} ({self.kind})"

    async def __call__(self, request: EngineTokenizeRequest) -> int:
        if request.is_chat and not self.accepts_messages:
            raise EngineTokenizeError(f"{self.kind} /tokenize does not accept messages")
        async with self._session.post(
            self._url, data=request.body(), headers={"Content-Type": "application/json"}
        ) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise EngineTokenizeError(f"/tokenize answered HTTP {resp.status}")
        return parse_count(raw)


class FailoverEngineTokenizer:
    """The model's engines' `/tokenize`, one after another when an engine cannot be reached.

    Any SGLang or vLLM engine of a model answers with the model's tokenizer, so the count does
    not depend on which one answers. Asking only the first would make it a single point of
    failure: in gateway mode the first engine belongs to one cluster, and with that cluster's
    engines stopped every prompt that needs an exact count would get 503 while another
    cluster serves. Only a connection failure (nothing answered) moves on; an engine that
    answers with an error is the answer. The engine that answered last is asked first next
    time, so a dead engine costs one failed connect, not one per request.
    """

    def __init__(self, engines: list[EngineTokenizer]) -> None:
        if not engines:
            raise ValueError("FailoverEngineTokenizer needs at least one engine")
        self._engines = engines
        self._first = 0
        self.kind = engines[0].kind

    @property
    def accepts_messages(self) -> bool:
        return self._engines[0].accepts_messages

    def describe(self) -> str:
        return ", then ".join(e.describe() for e in self._engines)

    async def __call__(self, request: EngineTokenizeRequest) -> int:
        n = len(self._engines)
        for i in range(n):
            index = (self._first + i) % n
            try:
                count = await self._engines[index](request)
            except (aiohttp.ClientConnectionError, OSError):
                if i == n - 1:
                    raise
                continue
            self._first = index
            return count
        raise AssertionError("unreachable: the last failure is raised")  # pragma: no cover


def parse_count(raw: bytes) -> int:
    """The `count` of a /tokenize reply, without parsing a multi-megabyte id list."""
    if len(raw) <= PARSE_REPLY_BYTES:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise EngineTokenizeError("/tokenize reply is not JSON") from None
        count = data.get("count") if isinstance(data, dict) else None
        if isinstance(count, list):  # a batch prompt answers one count per item
            count = sum(c for c in count if isinstance(c, int))
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            return count
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if isinstance(tokens, list):
            return len(tokens)
        raise EngineTokenizeError("/tokenize reply has no count")
    # The count sits before or after the ids; the ids are digits, commas and brackets only,
    # so the only `"count":` in the reply is the field itself.
    m = _COUNT.search(raw, max(0, len(raw) - 4096)) or _COUNT.search(raw, 0, 4096)
    if m is None:
        raise EngineTokenizeError("/tokenize reply has no count")
    return int(m.group(1))
