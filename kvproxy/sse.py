"""Server-sent events and the generated text inside them, sans-IO.

Owns: splitting an upstream `text/event-stream` into events (`SSEParser`), and reading the
generated text and the "a token has been generated" signal out of each event's payload
(`StreamTexts`, `token_texts`, `has_token`) or out of a whole non-streamed JSON body
(`body_texts`). The drain state machine needs `has_token` (a generated token proves decode
holds the KV, so the transfer is over); the canary tripwire needs the text.

Must never: touch a socket, log anything, or keep more than one event's bytes (an event
larger than `max_event_bytes` is an error, not unbounded memory). Malformed payloads are
never fatal: they yield no text and no token, which keeps a drain going (the safe side).

Formats read (OpenAI-compatible servers, SGLang, vLLM):

    chat chunk         {"choices": [{"index": i, "delta": {"content" | "reasoning_content"
                         | "tool_calls": [{"function": {"name", "arguments"}}]}}]}
    completions chunk  {"choices": [{"index": i, "text": "..."}]}
    SGLang /generate   {"text": "...", "meta_info": {"completion_tokens": n, ...}, "index": i}
                       (text is cumulative in SGLang's default mode, incremental with
                       --incremental-streaming-output; `StreamTexts` tells them apart)
    Responses stream   {"type": "response.output_text.delta" | "response.refusal.delta" |
                         "response.reasoning_text.delta" | "response.function_call_arguments
                         .delta", "delta": "...", "output_index": i}
    Messages stream    {"type": "content_block_delta", "index": i, "delta": {"text" |
                         "thinking" | "partial_json": "..."}}
    (whole bodies: a Responses object's `output` items, a Messages object's `content`)
    error event        {"error": {...}} or {"object": "error", ...}: no text, no token
    end of stream      [DONE]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

# One event is one token's worth of JSON in practice (< 4 KiB); a non-streamed-style body
# sent as a single event can be large (n choices x long outputs). 16 MiB bounds memory while
# never cutting a legitimate response short.
DEFAULT_MAX_EVENT_BYTES = 16 * 1024 * 1024
_BOM = b"\xef\xbb\xbf"
# Characters compared to decide whether a /generate text continues the previous one.
_CUMULATIVE_PROBE_CHARS = 32


class SSEError(ValueError):
    """The stream cannot be parsed within bounds (an event exceeded `max_event_bytes`)."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One complete event: its `data` (lines joined by \\n; None when it had no data line,
    e.g. a keep-alive comment) and `raw`, the event's bytes with line endings normalised to
    \\n, ending in the blank line, ready to forward unchanged."""

    data: bytes | None
    raw: bytes


class SSEParser:
    """Incremental event-stream parser (WHATWG rules, minus `event`/`id`/`retry`, which the
    proxy does not need): lines end in \\n, \\r\\n or \\r, possibly split across chunks; an
    event ends at a blank line; lines starting with ':' are comments; `data:` lines of one
    event are joined with \\n. An incomplete event at EOF is discarded, as the spec says."""

    __slots__ = ("_block_start", "_buf", "_data", "_line_start", "_max", "_skip_lf", "_started")

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        if max_event_bytes < 1:
            raise ValueError("max_event_bytes must be >= 1")
        self._max = max_event_bytes
        # Holds the current, incomplete event only (from _block_start on after each feed).
        self._buf = bytearray()
        self._block_start = 0
        self._line_start = 0
        self._data: list[bytes] = []
        self._skip_lf = False  # the previous chunk ended in \r: a leading \n pairs with it
        self._started = False

    @property
    def pending_bytes(self) -> int:
        """Bytes of an event not yet complete (discarded if the stream ends now)."""
        return len(self._buf)

    def feed(self, chunk: bytes) -> list[bytes]:
        """The `data` payloads of the events this chunk completes."""
        fast = self._feed_whole_events(chunk)
        if fast is not None:
            return fast
        return [ev.data for ev in self.feed_events(chunk) if ev.data is not None]

    def _feed_whole_events(self, chunk: bytes) -> list[bytes] | None:
        """The relay's hot path: a chunk that is exactly whole one-line events
        (`data: {...}\n\n` each, as engines write them), with nothing pending. Parsed with
        two C-level splits instead of the line loop; any other shape returns None before
        touching state, and the general parser takes it (same result, tested)."""
        if (
            self._buf
            or self._skip_lf
            or not self._started
            or not chunk.endswith(b"\n\n")
            or b"\r" in chunk
        ):
            return None
        blocks = chunk[:-2].split(b"\n\n")
        out: list[bytes] = []
        for line in blocks:
            if not line or b"\n" in line:
                return None  # a blank run or a multi-line event: the general parser
            if line[0] == 0x3A:  # ':' a comment: an event without data
                continue
            name, colon, value = line.partition(b":")
            if name == b"data":
                out.append(value[1:] if colon and value[:1] == b" " else value)
        return out

    def feed_events(self, chunk: bytes) -> list[SSEEvent]:
        """Every event (data-less ones included) this chunk completes, in order."""
        chunk = self._normalise(chunk)
        if not chunk:
            return []
        buf = self._buf
        scan_from = len(buf)  # older bytes hold no newline past _line_start
        buf += chunk
        events: list[SSEEvent] = []
        pos = self._line_start
        nl = buf.find(b"\n", max(pos, scan_from))
        while nl >= 0:
            if nl == pos:
                events.append(self._dispatch(nl))
            elif buf[pos] != 0x3A:  # ':' starts a comment
                name, colon, value = buf[pos:nl].partition(b":")
                if name == b"data":
                    if colon and value[:1] == b" ":
                        value = value[1:]
                    self._data.append(bytes(value))
            pos = nl + 1
            nl = buf.find(b"\n", pos)
        self._line_start = pos
        if self._block_start:
            del buf[: self._block_start]
            self._line_start -= self._block_start
            self._block_start = 0
        if len(buf) > self._max:
            raise SSEError(
                f"server-sent event larger than {self._max:,} bytes "
                f"({len(buf):,} bytes without an end)"
            )
        return events

    def _dispatch(self, nl: int) -> SSEEvent:
        raw = bytes(self._buf[self._block_start : nl + 1])
        data = b"\n".join(self._data) if self._data else None
        self._data = []
        self._block_start = nl + 1
        return SSEEvent(data=data, raw=raw)

    def _normalise(self, chunk: bytes) -> bytes:
        if not self._started and chunk:
            self._started = True
            if chunk.startswith(_BOM):
                chunk = chunk[len(_BOM) :]
        if self._skip_lf and chunk:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if b"\r" in chunk:
            # A trailing \r already ends a line; a \n opening the next chunk completes it.
            self._skip_lf = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        return chunk


# --- generated text in payloads ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PayloadInfo:
    """What one event payload says: new generated text per choice index, whether it carries
    a generated token, whether it is `[DONE]`, whether it is an error event."""

    texts: list[tuple[int, str]]
    has_token: bool
    done: bool = False
    error: bool = False


_NOTHING = PayloadInfo(texts=[], has_token=False)
_DONE = PayloadInfo(texts=[], has_token=False, done=True)
_ERROR = PayloadInfo(texts=[], has_token=False, error=True)


class StreamTexts:
    """Per-response reader of stream payloads. Keep one per response: SGLang's `/generate`
    repeats the whole text so far in every event, and only the new part is new text.

    Mode detection for `/generate` (per choice index): the first event's text is new; from
    the second event on, a text that extends the previous one (same length prefix, same
    last characters) marks the stream cumulative, anything else incremental, and the mode
    then sticks. A wrong guess at the second event can only make the canary scan a suffix
    again or skip a coincidentally repeated prefix; it never changes `has_token`.
    """

    __slots__ = ("_gen",)

    def __init__(self) -> None:
        # index -> [previous cumulative length, its last characters, mode or None]
        self._gen: dict[int, list[Any]] = {}

    def feed(self, payload: bytes) -> PayloadInfo:
        stripped = payload.strip()
        if stripped == b"[DONE]":
            return _DONE
        try:
            obj = orjson.loads(stripped)
        except orjson.JSONDecodeError:
            return _NOTHING
        if not isinstance(obj, dict):
            return _NOTHING
        if "error" in obj or obj.get("object") == "error":
            return _ERROR
        choices = obj.get("choices")
        if isinstance(choices, list):
            return _choices_info(choices)
        if isinstance(obj.get("text"), str):
            return self._generate_info(obj)
        if isinstance(obj.get("type"), str):
            return _typed_event_info(obj)
        return _NOTHING

    def _generate_info(self, obj: dict[str, Any]) -> PayloadInfo:
        text: str = obj["text"]
        index = obj.get("index", 0)
        if not isinstance(index, int):
            index = 0
        state = self._gen.get(index)
        if state is None:
            new = text
            self._gen[index] = [len(text), text[-_CUMULATIVE_PROBE_CHARS:], None]
        else:
            prev_len, prev_tail, mode = state
            if mode is None:
                extends = len(text) >= prev_len and text[prev_len - len(prev_tail) : prev_len] == (
                    prev_tail
                )
                mode = "cumulative" if extends else "incremental"
                state[2] = mode
            new = text[prev_len:] if mode == "cumulative" else text
            state[0] = len(text)
            state[1] = text[-_CUMULATIVE_PROBE_CHARS:]
        meta = obj.get("meta_info")
        completion = meta.get("completion_tokens") if isinstance(meta, dict) else None
        token = bool(new) or (isinstance(completion, int) and completion >= 1)
        return PayloadInfo(texts=[(index, new)] if new else [], has_token=token)


# /v1/responses and /v1/messages stream events that carry generated text (the others:
# lifecycle events, and `response.completed`, which repeats text already seen in deltas).
_RESPONSES_DELTAS = frozenset(
    {
        "response.output_text.delta",
        "response.refusal.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.function_call_arguments.delta",
    }
)
_MESSAGES_DELTA_KEYS = ("text", "thinking", "partial_json")


def _typed_event_info(obj: dict[str, Any]) -> PayloadInfo:
    kind = obj["type"]
    text: Any = None
    if kind in _RESPONSES_DELTAS:
        text, index = obj.get("delta"), obj.get("output_index", 0)
    elif kind == "content_block_delta":
        delta, index = obj.get("delta"), obj.get("index", 0)
        if isinstance(delta, dict):
            text = next((delta[k] for k in _MESSAGES_DELTA_KEYS if k in delta), None)
    if not isinstance(text, str) or not text:
        return _NOTHING
    return PayloadInfo(texts=[(index if isinstance(index, int) else 0, text)], has_token=True)


def _api_object_texts(item: dict[str, Any]) -> list[str]:
    """Generated strings of a Responses object (`output` items) or a Messages object
    (`content` blocks), the shapes smg and SGLang return for those routes."""
    out: list[str] = []
    blocks: list[Any] = []
    output = item.get("output")
    if isinstance(output, list):
        for entry in output:
            if not isinstance(entry, dict):
                continue
            out.extend(entry[k] for k in ("name", "arguments") if isinstance(entry.get(k), str))
            for key in ("content", "summary"):
                if isinstance(entry.get(key), list):
                    blocks.extend(entry[key])
    elif item.get("type") == "message" and isinstance(item.get("content"), list):
        blocks = item["content"]
    for block in blocks:
        if not isinstance(block, dict):
            continue
        out.extend(
            block[k]
            for k in ("text", "refusal", "thinking", "name")
            if isinstance(block.get(k), str)
        )
        if isinstance(block.get("input"), dict):
            out.append(orjson.dumps(block["input"]).decode())
    return out


def _choices_info(choices: list[Any]) -> PayloadInfo:
    texts: list[tuple[int, str]] = []
    for pos, choice in enumerate(choices):
        if not isinstance(choice, dict):
            continue
        index = choice.get("index", pos)
        if not isinstance(index, int):
            index = pos
        delta = choice.get("delta")
        source = delta if isinstance(delta, dict) else choice
        for text in _choice_texts(source):
            if text:
                texts.append((index, text))
    return PayloadInfo(texts=texts, has_token=bool(texts))


def _choice_texts(part: dict[str, Any]) -> list[str]:
    """Generated strings in a chat delta / chat message / completions choice."""
    out: list[str] = []
    for key in ("content", "reasoning_content", "text"):
        value = part.get(key)
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, list):  # content parts
            out.extend(
                p["text"] for p in value if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
    calls = part.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                # The function name is generated too; a leak could surface there.
                out.extend(fn[k] for k in ("name", "arguments") if isinstance(fn.get(k), str))
    return out


def token_texts(payload: bytes) -> list[tuple[int, str]]:
    """New generated text per choice index in one payload, without per-response state: for
    SGLang `/generate` this is the whole cumulative text (use `StreamTexts` for the delta)."""
    return StreamTexts().feed(payload).texts


def has_token(payload: bytes) -> bool:
    """Whether a payload carries a generated token. Role-only deltas, empty texts, usage-only
    chunks, finish-only chunks, errors and [DONE] do not."""
    return StreamTexts().feed(payload).has_token


def body_texts(body: bytes) -> list[str]:
    """Generated strings in a non-streamed response body, for scanning. A body that is not
    JSON is returned whole (decoded leniently): unknown shapes are scanned, not skipped."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return [body.decode("utf-8", "replace")] if body else []
    items = obj if isinstance(obj, list) else [obj]  # /generate with a batch returns a list
    out: list[str] = []
    for item in items:
        if not isinstance(item, dict):
            continue
        choices = item.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                message = choice.get("message")
                out.extend(_choice_texts(message if isinstance(message, dict) else choice))
                if isinstance(message, dict) and isinstance(choice.get("text"), str):
                    out.append(choice["text"])
        elif isinstance(item.get("text"), str):
            out.append(item["text"])
        else:
            out.extend(_api_object_texts(item))
    return [t for t in out if t]
