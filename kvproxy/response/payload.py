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

from kvproxy.response.sse import SSEParser
from kvproxy.response.usage import field_of, prompt_tokens_of

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


DONE = Reading([], [], False, True)
_NOT_GENERATE_OUTPUT = ENVELOPE_KEYS | {"meta_info"}  # /generate's top level minus these
_NOT_A_RECORD = 0  # where, under the top level, generated output may be
_RECORD_KEY = 1
_ALL_BUT_META = 2
_ERROR = 3


def read_value(obj: Any, gen: list[tuple[str, str]] | None = None) -> Reading:
    """Every string in a decoded event or body, and whether it carries generated output.
    `gen`, when given, receives (path, text) of each string that counts as output."""
    if gen is None and type(obj) is dict:
        fast = _one_choice_chunk(obj)
        if fast is not None:
            return fast
    return _read_value(obj, gen)


def _one_choice_chunk(obj: dict[str, Any]) -> Reading | None:
    """The walk's reading of what nearly every chat response is made of: one choice whose
    only container is a flat object (a streamed `delta`, a body's `message`), and no other
    container at the top level than flat objects (`usage`). The same paths, texts, keys and
    output as `_read_value`, in the same order (tests/response/test_payload.py holds them equal on
    generated objects), at about half the cost; None for any other shape, which
    `_read_value` then reads."""
    choices = obj.get("choices")
    if type(choices) is not list or len(choices) != 1 or _shape(obj)[0] != _RECORD_KEY:
        return None
    choice = choices[0]
    index = choice.get("index") if type(choice) is dict else None
    if type(index) is not int:
        return None
    paths: list[str] = []
    texts: list[str] = []
    keys = list(obj)
    # The walk reads the top level's strings, then each container depth first, in order.
    containers: list[tuple[str, Any]] = []
    for k, v in obj.items():
        tv = type(v)
        if tv is str:
            paths.append(SEP + k)
            texts.append(v)
        elif tv is dict:
            containers.append((k, v))
        elif tv is list:
            if k != "choices":
                return None
            containers.append((k, None))
    out = False
    for k, v in containers:
        if v is None:
            seen = _the_choice(choice, index, keys, paths, texts)
            if seen is None:
                return None
            out = seen
        elif _flat(v, SEP + k + SEP, False, keys, paths, texts) is None:
            return None
    paths.append(KEYS_PATH)
    texts.append("\x00".join(keys))
    return Reading(paths, texts, out, False, False, prompt_tokens_of(obj))


def _the_choice(
    choice: dict[str, Any], index: int, keys: list[str], paths: list[str], texts: list[str]
) -> bool | None:
    """`_visit` of the one choice (output counts there), or None past a flat inner object."""
    keys.extend(choice)
    prefix = SEP + "choices" + SEP + "#" + str(index) + SEP
    out = False
    inner: tuple[str, dict[str, Any]] | None = None
    envelope = ENVELOPE_KEYS
    for k, x in choice.items():
        tx = type(x)
        if tx is str:
            paths.append(prefix + k)
            texts.append(x)
            if x and k not in envelope:
                out = True
        elif tx is dict:
            if inner is not None:
                return None
            inner = (k, x)
        elif tx is list:
            return None
    if inner is not None:
        k, d = inner
        seen = _flat(d, prefix + k + SEP, k not in envelope, keys, paths, texts)
        if seen is None:
            return None
        out = out or seen
    return out


def _flat(d: dict[str, Any], prefix: str, counts: bool, keys: list[str], paths: list[str],
          texts: list[str]) -> bool | None:  # fmt: skip
    """`_visit` of an object holding no container (whether output counts in it), or None."""
    keys.extend(d)
    out = False
    envelope = ENVELOPE_KEYS
    for k, x in d.items():
        tx = type(x)
        if tx is str:
            paths.append(prefix + k)
            texts.append(x)
            if counts and x and k not in envelope:
                out = True
        elif tx is dict or tx is list:
            return None
    return out


def _read_value(obj: Any, gen: list[tuple[str, str]] | None) -> Reading:
    if type(obj) is list:  # a /generate batch body: a list of records, read in order
        paths: list[str] = []
        texts: list[str] = []
        out = False
        for item in obj:
            sub = read_value(item, gen) if type(item) is dict else _walk_one(item)
            out = out or sub.output
            paths.extend(SEP + "[]" + p for p in sub.paths)
            texts.extend(sub.texts)
        return _reading(paths, texts, [], out, True, False, None)
    if type(obj) is not dict:
        return _walk_one(obj)
    # (value, path, counts) still to visit; the top level decides `counts` per key.
    stack: list[tuple[Any, str, bool]] = []
    paths, texts = [], []
    keys: list[str] = list(obj)
    kind, record = _shape(obj)
    by_key = kind == _RECORD_KEY
    generate = kind == _ALL_BUT_META
    out = generate and _positive(field_of(obj.get("meta_info"), "completion_tokens"))
    for k, v in obj.items():
        counts = (k == record) if by_key else (generate and k not in _NOT_GENERATE_OUTPUT)
        if type(v) is str:
            paths.append(SEP + k)
            texts.append(v)
            if counts and v:
                out = True
                if gen is not None:
                    gen.append((SEP + k, v))
        elif type(v) is dict or type(v) is list:
            stack.append((v, SEP + k, counts))
    stack.reverse()  # visit in document order
    seen, dups = _visit(stack, paths, texts, keys, gen)
    error = kind == _ERROR
    return _reading(paths, texts, keys, out or seen, dups, error, prompt_tokens_of(obj))


def _walk_one(obj: Any) -> Reading:
    paths: list[str] = []
    texts: list[str] = []
    keys: list[str] = []
    _, dups = _visit([(obj, SEP + "$", False)], paths, texts, keys, None)
    return _reading(paths, texts, keys, False, dups, False, None)


def _visit(
    stack: list[tuple[Any, str, bool]],
    paths: list[str],
    texts: list[str],
    keys: list[str],
    gen: list[tuple[str, str]] | None,
) -> tuple[bool, bool]:
    """Walk what is on `stack` (depth first, in document order), collecting strings and
    keys. Returns (generated output seen, paths may repeat)."""
    out = False
    dups = False
    add_path, add_text = paths.append, texts.append
    envelope = ENVELOPE_KEYS
    while stack:
        v, path, counts = stack.pop()
        if type(v) is dict:
            if not v:
                continue
            keys.extend(v)
            prefix = path + SEP
            first = len(stack)
            for k, x in v.items():
                tx = type(x)
                if tx is str:
                    add_path(prefix + k)
                    add_text(x)
                    if counts and x and k not in envelope:
                        out = True
                        if gen is not None:
                            gen.append((prefix + k, x))
                elif tx is dict or tx is list:
                    stack.append((x, prefix + k, counts and k not in envelope))
            if len(stack) - first > 1:
                stack[first:] = reversed(stack[first:])  # pop in document order
        elif type(v) is list:
            seq = path + SEP + "[]"
            strings: list[str] | None = None
            children: list[tuple[Any, str, bool]] | None = None
            for item in v:
                ti = type(item)
                if ti is str:
                    if strings is None:
                        strings = []
                    strings.append(item)
                elif ti is dict:
                    index = item.get("index")
                    at = path + SEP + "#" + str(index) if type(index) is int else seq
                    if children is None:
                        children = []
                    children.append((item, at, counts))
                elif ti is list:
                    if children is None:
                        children = []
                    children.append((item, seq, counts))
                elif counts and (ti is int or ti is float):
                    out = True  # token ids, logprob bytes
            if strings:
                joined = "".join(strings)
                add_path(seq)
                add_text(joined)
                if counts and joined:
                    out = True
                    if gen is not None:
                        gen.append((seq, joined))
            if children is not None:
                # Siblings share sub-paths (or repeat an index): they may need joining.
                dups = dups or len(children) > 1
                children.reverse()
                stack.extend(children)
        elif type(v) is str:
            add_path(path)
            add_text(v)
            if counts and v:
                out = True
                if gen is not None:
                    gen.append((path, v))
    return out, dups


def _reading(
    paths: list[str],
    texts: list[str],
    keys: list[str],
    out: bool,
    dups: bool,
    error: bool,
    prompt_tokens: int | None,
) -> Reading:
    if keys:
        paths.append(KEYS_PATH)
        texts.append("\x00".join(keys))
    if dups and len(set(paths)) != len(paths):
        merged: dict[str, list[str]] = {}
        for p, t in zip(paths, texts, strict=True):
            merged.setdefault(p, []).append(t)
        paths = list(merged)
        texts = ["".join(parts) for parts in merged.values()]
    return Reading(paths, texts, out and not error, False, error, prompt_tokens)


def _shape(obj: dict[str, Any]) -> tuple[int, str]:
    """Where a top-level object's generation record is."""
    if "error" in obj or obj.get("object") == "error":
        return _ERROR, ""
    if type(obj.get("choices")) is list:  # chat / completions (vLLM's /generate too)
        return _RECORD_KEY, "choices"
    if "meta_info" in obj or "text" in obj or "output_ids" in obj:  # SGLang /generate
        return _ALL_BUT_META, ""
    kind = obj.get("type")
    if type(kind) is str and kind.endswith("delta"):
        # Responses `response.*.delta`, Messages `content_block_delta`
        return _RECORD_KEY, "delta"
    return _NOT_A_RECORD, ""


def _positive(v: Any) -> bool:
    return type(v) is int and v >= 1


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
    gen: list[tuple[str, str]] = []
    if read_value(obj, gen).error:
        return []
    out: list[tuple[int, str]] = []
    for path, text in gen:
        index = obj["index"] if type(obj.get("index")) is int else 0
        if path.startswith(_CHOICE):
            digits = path[len(_CHOICE) :].split(SEP, 1)[0]
            index = int(digits) if digits.lstrip("-").isdigit() else 0
        out.append((index, text))
    return out
