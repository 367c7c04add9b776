"""What a client receives in a response, and which part of it is generated output.

One reading of a response event (or of a whole non-streamed body) serves both guards that
need the response:

- the canary tripwire scans **every string the client receives**: each string value at any
  depth and the object keys, decoded from JSON (escapes resolved), whatever key it sits
  under. Each string comes with a *path* (`\\x1fchoices\\x1f#0\\x1fdelta\\x1fcontent`) so
  the scanner can keep a rolling tail per choice and per field and find a marker split
  across events;
- the drain's first-token detection asks whether the event carries **generated output**.

Generated output is the one definition both use (#15, #24): inside a *generation record*
(an element of `choices`; the top level of an SGLang `/generate` event; the `delta` of a
Responses / Messages streaming event), any non-empty string or any number inside a list
(token ids, logprob bytes) under a key that is not envelope (`ENVELOPE_KEYS`: index, role,
finish_reason, ids, usage, prompt echoes...). So `content`, `reasoning` (vLLM >= 0.16
streams reasoning only there: `DeltaMessage.reasoning` in
vllm/entrypoints/openai/engine/protocol.py), `reasoning_content` (SGLang), `tool_calls`
names and arguments, `function_call`, `refusal`, logprobs, `token_ids`, `/generate`
`text` and `output_ids`, and any field an engine adds to a choice all count; a role-only
delta, empty strings, a usage-only or finish-only chunk do not, and an error event never
does (its strings are still scanned). `/generate`'s `meta_info.completion_tokens >= 1`
counts too (SGLang can send an event whose text is unchanged).

Why outside a record nothing counts: top-level fields (`id`, `model`, `usage`, vLLM's
`prompt_token_ids`, a Responses `response.created` echo of the request) can arrive
before decode holds the KV; calling them a token would end a drain early (I5). The
tripwire still scans them: the client sees them.

Lists: elements that are objects with an integer `index` (choices, tool calls) get a path
per index; any other list is read as a sequence (its elements share one path, in order),
so a marker spread over logprob tokens is one text. Strings met twice at one path in one
event are joined in order.

Must never: raise on any input (undecodable JSON, nesting deeper than the interpreter's
recursion, invalid UTF-8 fall back to the raw text, scanned as-is and with JSON escapes
resolved leniently), log, or keep state between calls.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from kvproxy.sse import SSEParser

SEP = "\x1f"  # joins path components; JSON keys rarely hold it, and a clash only merges
RAW_PATH = SEP + "raw"
RAW_UNESCAPED_PATH = SEP + "raw\\"
KEYS_PATH = SEP + "{}"
# Keys whose values are metadata, not generated output, inside a generation record.
ENVELOPE_KEYS = frozenset(
    {
        "index",
        "role",
        "finish_reason",
        "stop_reason",
        "stop_sequence",
        "matched_stop",
        "id",
        "type",
        "object",
        "created",
        "model",
        "usage",
        "system_fingerprint",
        "prompt_token_ids",
        "prompt_logprobs",
        "prompt_tokens",
        "sequence_number",
        "output_index",
        "content_index",
        "item_id",
    }
)
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|(.))", re.DOTALL)
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f"}


class Reading:
    """One event's (or body's) strings with their paths, and what else it says."""

    __slots__ = ("done", "error", "output", "paths", "prompt_tokens", "texts")

    def __init__(
        self,
        paths: list[str],
        texts: list[str],
        output: bool = False,
        *,
        done: bool = False,
        error: bool = False,
        prompt_tokens: int | None = None,
    ) -> None:
        self.paths = paths
        self.texts = texts
        self.output = output
        self.done = done
        self.error = error
        self.prompt_tokens = prompt_tokens


DONE = Reading([], [], done=True)


class _Walk:
    """Collects strings while walking one decoded JSON value."""

    __slots__ = ("dups", "gen", "keys", "paths", "texts")

    def __init__(self, collect: bool = False) -> None:
        self.paths: list[str] = []
        self.texts: list[str] = []
        self.keys: list[str] = []
        self.dups = False
        # (path, text) of each string that counts as generated output, when asked for.
        self.gen: list[tuple[str, str]] | None = [] if collect else None

    def string(self, path: str, text: str, counts: bool) -> bool:
        self.paths.append(path)
        self.texts.append(text)
        if counts and text:
            if self.gen is not None:
                self.gen.append((path, text))
            return True
        return False

    def value(self, v: Any, path: str, counts: bool) -> bool:
        """Collect every string under `v`; True when generated output was seen (only
        looked for while `counts`)."""
        if isinstance(v, dict):
            return self.mapping(v, path, counts)
        if isinstance(v, list):
            return self.sequence(v, path, counts)
        if isinstance(v, str):
            return self.string(path, v, counts)
        return False

    def mapping(self, d: dict[str, Any], path: str, counts: bool) -> bool:
        if not d:
            return False
        self.keys.append("\x00".join(d))
        out = False
        paths, texts = self.paths, self.texts
        for k, v in d.items():
            if isinstance(v, str):
                paths.append(path + SEP + k)
                texts.append(v)
                if counts and v and k not in ENVELOPE_KEYS:
                    out = True
                    if self.gen is not None:
                        self.gen.append((path + SEP + k, v))
            elif isinstance(v, (dict, list)) and self.value(
                v, path + SEP + k, counts and k not in ENVELOPE_KEYS
            ):
                out = True
        return out

    def sequence(self, items: list[Any], path: str, counts: bool) -> bool:
        out = False
        strings: list[str] | None = None
        containers = 0
        seq = path + SEP + "[]"
        for item in items:
            if isinstance(item, str):
                if strings is None:
                    strings = []
                strings.append(item)
            elif isinstance(item, dict):
                containers += 1
                index = item.get("index")
                at = seq if type(index) is not int else path + SEP + "#" + str(index)
                out = self.mapping(item, at, counts) or out
            elif isinstance(item, list):
                containers += 1
                out = self.sequence(item, seq, counts) or out
            elif counts and isinstance(item, (int, float)) and not isinstance(item, bool):
                out = True  # token ids, logprob bytes
        if strings and self.string(seq, "".join(strings), counts):
            out = True
        if containers > 1:
            self.dups = True  # siblings share sub-paths (or repeat an index)
        return out

    def reading(
        self, output: bool, *, error: bool = False, prompt_tokens: int | None = None
    ) -> Reading:
        paths, texts = self.paths, self.texts
        if self.keys:
            paths.append(KEYS_PATH)
            texts.append("\x00".join(self.keys))
        if self.dups and len(set(paths)) != len(paths):
            merged: dict[str, list[str]] = {}
            for p, t in zip(paths, texts, strict=True):
                merged.setdefault(p, []).append(t)
            paths = list(merged)
            texts = ["".join(parts) for parts in merged.values()]
        return Reading(paths, texts, output, error=error, prompt_tokens=prompt_tokens)


def read_value(obj: Any) -> Reading:
    """Every string in a decoded event or body, and whether it carries generated output."""
    w = _Walk()
    if isinstance(obj, list):
        out = False
        for item in obj:  # a /generate batch body is a list of records
            if isinstance(item, dict):
                out = _root(w, item, SEP + "[]") or out
            else:
                w.value(item, SEP + "[]", False)
        w.dups = w.dups or len(obj) > 1
        return w.reading(out)
    if isinstance(obj, dict):
        out = _root(w, obj, "")
        error = "error" in obj or obj.get("object") == "error"
        return w.reading(out and not error, error=error, prompt_tokens=_prompt_tokens(obj))
    w.value(obj, SEP + "$", False)
    return w.reading(False)


def _root(w: _Walk, obj: dict[str, Any], path: str) -> bool:
    """Walk one top-level object; where its generation record is depends on its shape."""
    if "error" in obj or obj.get("object") == "error":
        w.mapping(obj, path, False)
        return False
    if isinstance(obj.get("choices"), list):  # chat / completions (vLLM /generate too)
        record: str | None = "choices"
    elif "meta_info" in obj or "text" in obj or "output_ids" in obj:  # SGLang /generate
        meta = obj.get("meta_info")
        counted = isinstance(meta, dict) and _positive(meta.get("completion_tokens"))
        return _walk_except(w, obj, path, ("meta_info",)) or counted
    elif isinstance(obj.get("type"), str) and obj["type"].endswith("delta"):
        record = "delta"  # Responses `response.*.delta`, Messages `content_block_delta`
    else:
        record = ""
    out = False
    w.keys.append("\x00".join(obj))
    for k, v in obj.items():
        if isinstance(v, str):
            out = w.string(path + SEP + k, v, k == record) or out
        elif isinstance(v, (dict, list)):
            out = w.value(v, path + SEP + k, k == record) or out
    return out


def _walk_except(w: _Walk, obj: dict[str, Any], path: str, excluded: tuple[str, ...]) -> bool:
    out = False
    w.keys.append("\x00".join(obj))
    for k, v in obj.items():
        counts = k not in excluded and k not in ENVELOPE_KEYS
        if isinstance(v, str):
            out = w.string(path + SEP + k, v, counts) or out
        elif isinstance(v, (dict, list)):
            out = w.value(v, path + SEP + k, counts) or out
    return out


def _positive(v: Any) -> bool:
    return type(v) is int and v >= 1


def _prompt_tokens(obj: dict[str, Any]) -> int | None:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        n = usage.get("prompt_tokens")
        if type(n) is int:
            return n
    return None


# --- bytes in ------------------------------------------------------------------------------


def read_payload(payload: bytes) -> Reading:
    """One SSE event's data: `[DONE]`, JSON, or anything else (read as raw text)."""
    if payload.endswith(b"]") and payload.strip() == b"[DONE]":
        return DONE
    try:
        return read_value(orjson.loads(payload))
    except (orjson.JSONDecodeError, RecursionError):
        return raw_reading(payload)


def raw_reading(data: bytes) -> Reading:
    """Text that is not decodable JSON, as a client that shows it (or decodes it leniently)
    would see it: the raw text, and with JSON escapes resolved when it has any."""
    if not data:
        return Reading([], [])
    text = data.decode("utf-8", "replace")
    paths, texts = [RAW_PATH], [text]
    if "\\" in text:
        paths.append(RAW_UNESCAPED_PATH)
        texts.append(unescape(text))
    return Reading(paths, texts)


def read_body(body: bytes) -> list[Reading]:
    """A whole non-streamed body, as one reading per event: one for JSON; for anything
    else the raw text, plus its SSE events when it carries `data:` lines (an event stream
    labelled as something else still reaches a client that parses it)."""
    try:
        return [read_value(orjson.loads(body))]
    except (orjson.JSONDecodeError, RecursionError):
        pass
    out = [raw_reading(body)]
    if b"data:" in body:
        parser = SSEParser(max_event_bytes=max(1, len(body) + 2))
        framed = parser.feed_chunk(body + b"\n\n")
        out.extend(read_payload(p) for p in framed.payloads)
    return out


def unescape(text: str) -> str:
    """Resolve JSON string escapes leniently (lone surrogates become U+FFFD)."""

    def one(m: re.Match[str]) -> str:
        if m.group(1) is not None:
            return chr(int(m.group(1), 16))
        c = m.group(2)
        return _SIMPLE_ESCAPES.get(c, c)

    out = _ESCAPE.sub(one, text)
    if any("\ud800" <= c <= "\udfff" for c in out):
        out = out.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return out


# --- generated text, for callers that want only that ---------------------------------------

_CHOICE = SEP + "choices" + SEP + "#"


def token_texts(payload: bytes) -> list[tuple[int, str]]:
    """Generated strings per choice index in one event payload (no per-response state: an
    SGLang `/generate` event's cumulative text comes whole). For harnesses that look for
    markers in what a client was shown; the proxy's guards use `read_payload`."""
    if payload.endswith(b"]") and payload.strip() == b"[DONE]":
        return []
    try:
        obj = orjson.loads(payload)
    except (orjson.JSONDecodeError, RecursionError):
        return []
    return _generated(obj)


def body_texts(body: bytes) -> list[str]:
    """Generated strings in a non-streamed body; a body that is not JSON comes whole
    (decoded leniently): unknown shapes are scanned, not skipped."""
    try:
        obj = orjson.loads(body)
    except (orjson.JSONDecodeError, RecursionError):
        return [body.decode("utf-8", "replace")] if body else []
    items = obj if isinstance(obj, list) else [obj]
    return [t for item in items for _, t in _generated(item)]


def has_token(payload: bytes) -> bool:
    """Whether one event payload carries generated output."""
    return read_payload(payload).output


def _generated(obj: Any) -> list[tuple[int, str]]:
    """The generated-output strings of one decoded event, with their choice index."""
    if not isinstance(obj, dict):
        return []
    w = _Walk(collect=True)
    _root(w, obj, "")
    assert w.gen is not None
    out: list[tuple[int, str]] = []
    for path, text in w.gen:
        index = obj["index"] if type(obj.get("index")) is int else 0
        if path.startswith(_CHOICE):
            digits = path[len(_CHOICE) :].split(SEP, 1)[0]
            index = int(digits) if digits.lstrip("-").isdigit() else 0
        out.append((index, text))
    return out
