"""Chat templates: load the model's own template and render it the way engines do.

Rendering follows transformers' `apply_chat_template` (matched it byte for byte in 72/72
measured cases): jinja2 `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
extensions=["jinja2.ext.loopcontrols"])`, helpers `tojson`, `raise_exception`,
`strftime_now`, and the tokenizer's `bos_token` / `eos_token`. The sandbox matters: a
template is code, and the messages it loops over are attacker-controlled.

The template sees the messages each configured engine would hand it (`chatnorm`: reasoning
aliases, parsed tool-call arguments, content parts joined or kept as a list per the
template's content format), with every special token and the request's template kwargs
as transformers passes them. Media parts render as the engines' `{"type": "image"}`
stand-ins; the counter charges their configured token cost on top.

Big strings (>= BIG_CHARS) are rendered as *placeholders*: the template sees a short marker
that answers `len`, `in`, `startswith`, `endswith` and `==` from the real text, and the
output comes back as segments (frame, content, frame, ...). A plain render of a 4 MB
message copies it several times in C calls that hold the GIL for 10-50 ms each, stalling
the event loop from a worker thread; with placeholders the render costs only its frame, and
the counter bounds and tokenizes the segments without ever joining them. Any operation that
would need the real text (slicing, `trim`, `replace`, `indent`, `tojson` of a message, a
method call) raises inside the render and the template is rendered plainly instead: the
fast path is an optimisation, never a different answer. Comparisons (`==`, `in`, ...) are
compiled to calls that answer from the real text, since Python would compare the marker.

Render failures (a template's `raise_exception`, a missing field) become a 400 without the
template's message, which may quote the conversation (I8). This module never logs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import operator
import re
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.nodes
import jinja2.sandbox

from kvproxy.policy import KvproxyError, invalid_request
from kvproxy.prompt import SequencePrompt
from kvproxy.tokens.replica import chatnorm
from kvproxy.tokens.replica.chatnorm import ENGINE_KINDS, SPECIAL_TOKEN_KEYS, EngineKind
from kvproxy.tokens.replica.sandbox import Sandbox as _Sandbox
from kvproxy.tokens.replica.sandbox import environment as _environment
from kvproxy.tokens.replica.sandbox import tojson as _tojson

# Strings at least this long are rendered as placeholders (see module docstring).
BIG_CHARS = 65_536
# Filters that never look inside a string: everything else refuses a placeholder.
_PLACEHOLDER_SAFE_FILTERS = frozenset({"length", "count", "string", "default", "d", "tojson"})
_PROXIED = frozenset({"startswith", "endswith", "find", "rfind", "count", "isspace"})


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may print."""

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        origin: str = "",
        special_tokens: Mapping[str, str] | None = None,
    ):
        self._marker = "\ue000" + secrets.token_hex(8)
        env = _environment(_Sandbox)
        guarded = _environment(_GuardedEnvironment)
        guarded.marker = self._marker
        for name, f in list(guarded.filters.items()):
            if name not in _PLACEHOLDER_SAFE_FILTERS:
                guarded.filters[name] = _refuse_placeholders(f, self._marker)
        guarded.filters["tojson"] = _guarded_tojson(self._marker)
        for name in ("length", "count"):
            guarded.filters[name] = _refuse_spliced(guarded.filters[name], self._marker)
        guarded.tests["in"] = guarded.contains
        self._marker_re = re.compile(re.escape(self._marker) + r"(\d+)\ue001")
        try:
            self._template = env.from_string(source)
            self._guarded = guarded.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template {origin or ''} does not compile: {exc}") from None
        # Every special token transformers hands the template (request kwargs override them).
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v}
        self.special_tokens.setdefault("bos_token", bos_token)
        self.special_tokens.setdefault("eos_token", eos_token)
        self.bos_token = self.special_tokens["bos_token"]
        self.eos_token = self.special_tokens["eos_token"]
        self.origin = origin
        self.source = source
        self.content_formats = chatnorm.content_formats(source)
        # The engine kinds whose normalisation is counted (build_counter narrows it from the
        # configured engines); the default covers both.
        self.engines: tuple[EngineKind, ...] = ENGINE_KINDS

    @classmethod
    def from_file(cls, path: str | Path, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        p = Path(path)
        if p.suffix == ".json":  # a tokenizer_config.json given as the template
            found = from_tokenizer_dir_files(p, None)
            if found is None:
                raise ValueError(f"{p} has no chat_template")
            return found
        return cls(p.read_text(encoding="utf-8"), bos_token, eos_token, origin=str(p))

    def variants(self, seq: SequencePrompt) -> list[chatnorm.Variant]:
        """(messages, tools) as the configured engines hand them to the template (chatnorm)."""
        return chatnorm.template_variants(
            seq.messages, seq.tools, self.engines, self.content_formats
        )

    def render(self, seq: SequencePrompt) -> str:
        """The prompt string the first configured engine tokenizes for this chat sequence."""
        return self._render(self._template, seq, *self.variants(seq)[0])

    def render_all(self, seq: SequencePrompt) -> tuple[tuple[str, ...], ...]:
        """Segments of each engine's render (count the largest; usually there is one).

        A variant the template cannot render is one that engine refuses (it renders and
        sends nothing): it is skipped while another engine's variant renders."""
        variants = self.variants(seq)
        if len(variants) == 1:
            return (self._segments(seq, *variants[0]),)
        renders: list[tuple[str, ...]] = []
        for v in variants:
            with contextlib.suppress(KvproxyError):
                renders.append(self._segments(seq, *v))
        if not renders:  # every engine refuses: raise the first one's 400 (error path only)
            return (self._segments(seq, *variants[0]),)
        return tuple(renders)

    def render_segments(self, seq: SequencePrompt) -> tuple[str, ...]:
        """The first engine's prompt as segments whose concatenation equals `render(seq)`."""
        return self._segments(seq, *self.variants(seq)[0])

    def _segments(
        self, seq: SequencePrompt, messages: list[dict[str, Any]], tools: list[Any] | None
    ) -> tuple[str, ...]:
        reals: list[str] = []
        marked = [self._mark(m, reals) for m in messages]
        if not reals:
            return (self._render(self._template, seq, messages, tools),)
        try:
            out = self._render(self._guarded, seq, marked, tools)
            return self._splice(out, reals)
        except _NeedsReal:
            return (self._render(self._template, seq, messages, tools),)

    def _mark(self, message: dict[str, Any], reals: list[str]) -> dict[str, Any]:
        out = dict(message)
        for key, value in message.items():
            if isinstance(value, str) and len(value) >= BIG_CHARS:
                out[key] = _Placeholder(f"{self._marker}{len(reals)}\ue001", value)
                reals.append(value)
        content = message.get("content")
        if isinstance(content, list) and any(_big_text(p) for p in content):
            out["content"] = [self._mark_part(p, reals) for p in content]
        calls = message.get("tool_calls")
        if isinstance(calls, list) and any(_big_arguments(c) for c in calls):
            out["tool_calls"] = [self._mark_call(c, reals) for c in calls]
        return out

    def _mark_part(self, part: Any, reals: list[str]) -> Any:
        if not _big_text(part):
            return part
        reals.append(part["text"])
        return {**part, "text": _Placeholder(f"{self._marker}{len(reals) - 1}\ue001", part["text"])}

    def _mark_call(self, call: Any, reals: list[str]) -> Any:
        if not _big_arguments(call):
            return call
        fn = dict(call["function"])
        fn["arguments"] = _Placeholder(f"{self._marker}{len(reals)}\ue001", fn["arguments"])
        reals.append(call["function"]["arguments"])
        return {**call, "function": fn}

    def _splice(self, out: str, reals: list[str]) -> tuple[str, ...]:
        parts = self._marker_re.split(out)
        # parts: frame, index, frame, index, ..., frame
        segments: list[str] = []
        for i, part in enumerate(parts):
            if i % 2:
                segments.append(reals[int(part)])
            elif self._marker in part:  # a marker was cut or altered: do not trust the splice
                raise _NeedsReal
            elif part:
                segments.append(part)
        if len(parts) // 2 != len(reals):  # a placeholder was dropped: maybe transformed
            raise _NeedsReal
        return tuple(segments)

    def _render(
        self,
        template: jinja2.Template,
        seq: SequencePrompt,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
    ) -> str:
        # As transformers: the request's kwargs override the special tokens (the parser has
        # refused kwargs that name apply_chat_template's own arguments or template globals).
        kwargs: dict[str, Any] = {"documents": None, **self.special_tokens, **seq.template_kwargs}
        try:
            return template.render(
                **kwargs,
                messages=messages,
                tools=tools,
                add_generation_prompt=seq.add_generation_prompt,
            )
        except _NeedsReal:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError,
                IndexError, RecursionError):  # fmt: skip
            raise invalid_request(
                "the model's chat template cannot render these messages "
                "(check roles, their order and required fields)",
                "messages",
            ) from None


class _NeedsReal(Exception):
    """The template wants to look inside a placeholder: render it plainly instead."""


class _Placeholder(str):
    """A marker standing for a big string; answers only questions that need no copy."""

    real: str

    def __new__(cls, marker: str, real: str) -> _Placeholder:
        obj = super().__new__(cls, marker)
        obj.real = real
        return obj

    def __len__(self) -> int:
        return len(self.real)

    def __contains__(self, item: object) -> bool:
        if isinstance(item, _Placeholder):
            item = item.real
        return isinstance(item, str) and item in self.real

    def __eq__(self, other: object) -> bool:
        return self.real == (other.real if isinstance(other, _Placeholder) else other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.real)

    def __getattribute__(self, name: str) -> Any:
        if name in _PROXIED:
            return getattr(object.__getattribute__(self, "real"), name)
        if name.startswith("__") or name == "real":
            return object.__getattribute__(self, name)
        raise _NeedsReal

    def _refuse(self, *_: object) -> Any:
        raise _NeedsReal

    __getitem__ = __iter__ = __mod__ = __mul__ = __rmul__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = _refuse


class _GuardedCodeGenerator(jinja2.compiler.CodeGenerator):
    """Compiles every comparison to a call of `environment.compare`.

    Python answers `x in "some text"` and `"a" ~ content == other` from the strings it is
    given, and with a placeholder those hold the marker, not the text: the guarded render
    could take a branch the real render would not. Routed through the environment, each
    comparison is answered from the real text or refused (-> plain render).
    """

    @jinja2.compiler.optimizeconst  # constant comparisons are still folded at compile time
    def visit_Compare(self, node: jinja2.nodes.Compare, frame: Any) -> None:
        if len(node.ops) != 1:
            # A chained comparison (`a < b in c`) is rare in chat templates: render plainly.
            self.write("environment.refuse()")
            return
        op = node.ops[0]
        self.write(f"environment.compare({op.op!r}, ")
        self.visit(node.expr, frame)
        self.write(", ")
        self.visit(op.expr, frame)
        self.write(")")


_COMPARE: dict[str, Any] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "gt": operator.gt,
    "gteq": operator.ge,
    "lt": operator.lt,
    "lteq": operator.le,
}


class _GuardedEnvironment(_Sandbox):
    """Refuses attribute access, indexing and calls that touch a placeholder's marker, and
    answers comparisons from the real text (see `_GuardedCodeGenerator`)."""

    code_generator_class = _GuardedCodeGenerator
    marker = "\ue000"

    def _marked(self, value: Any) -> bool:
        return _holds_marker(value, self.marker)

    def _spliced(self, value: Any) -> bool:
        return _is_spliced(value, self.marker)

    def refuse(self) -> Any:
        raise _NeedsReal

    def contains(self, item: Any, container: Any) -> bool:
        if self._spliced(item) or self._spliced(container):
            raise _NeedsReal
        real_item = item.real if isinstance(item, _Placeholder) else item
        if isinstance(container, _Placeholder):
            return isinstance(real_item, str) and real_item in container.real
        # Lists, dicts and plain strings: a placeholder item compares and hashes as its text.
        return bool(real_item in container)

    def compare(self, op: str, left: Any, right: Any) -> bool:
        if op == "in":
            return self.contains(left, right)
        if op == "notin":
            return not self.contains(left, right)
        if self._spliced(left) or self._spliced(right):
            raise _NeedsReal
        return bool(_COMPARE[op](left, right))

    def getattr(self, obj: Any, attribute: str) -> Any:
        if self._marked(obj):
            if isinstance(obj, _Placeholder) and attribute in _PROXIED:
                return getattr(obj.real, attribute)
            raise _NeedsReal
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        if self._marked(obj):
            raise _NeedsReal
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        if any(__self._marked(a) for a in (*args, *kwargs.values())):
            raise _NeedsReal
        return super().call(__context, __obj, *args, **kwargs)


def _holds_marker(value: Any, marker: str) -> bool:
    # str.__contains__, not `in`: a _Placeholder answers `in` about its real text, which
    # let filters such as replace() transform the marker instead of refusing it (the
    # spliced segments then held the untransformed text and the count was wrong).
    return isinstance(value, str) and str.__contains__(value, marker)


def _is_spliced(value: Any, marker: str) -> bool:
    """A plain string holding a marker (built by `~` or a join around a placeholder): its
    length and contents are the marker's, not the text's."""
    return not isinstance(value, _Placeholder) and _holds_marker(value, marker)


def _refuse_placeholders(f: Any, marker: str) -> Any:
    @functools.wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        for a in (*args, *kwargs.values()):
            if _holds_marker(a, marker):
                raise _NeedsReal
        return f(*args, **kwargs)

    return guarded


def _refuse_spliced(f: Any, marker: str) -> Any:
    """`length`/`count`: a placeholder answers with its text's length, but a plain string
    built around one would answer with the marker's."""

    @functools.wraps(f)
    def guarded(value: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_spliced(value, marker):
            raise _NeedsReal
        return f(value, *args, **kwargs)

    return guarded


def _guarded_tojson(marker: str) -> Any:
    def tojson(value: Any, *args: Any, **kwargs: Any) -> str:
        out = _tojson(value, *args, **kwargs)
        if marker in out:  # json would quote the marker, not the text
            raise _NeedsReal
        return out

    return tojson


def _big_text(part: Any) -> bool:
    return isinstance(part, dict) and isinstance(t := part.get("text"), str) and len(t) >= BIG_CHARS


def _big_arguments(call: Any) -> bool:
    fn = call.get("function") if isinstance(call, dict) else None
    args = fn.get("arguments") if isinstance(fn, dict) else None
    return isinstance(args, str) and len(args) >= BIG_CHARS


def from_tokenizer_dir_files(config_path: Path, template_path: Path | None) -> ChatTemplate | None:
    """Template from `chat_template.jinja` or `tokenizer_config.json`, with bos/eos strings."""
    config: dict[str, Any] = {}
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
    specials = {k: _token_text(config.get(k)) for k in SPECIAL_TOKEN_KEYS}
    bos, eos = specials["bos_token"], specials["eos_token"]
    if template_path is not None and template_path.is_file():
        text = template_path.read_text(encoding="utf-8")
        return ChatTemplate(text, bos, eos, str(template_path), specials)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if isinstance(source, str) and source:
        return ChatTemplate(source, bos, eos, str(config_path), specials)
    return None


def _token_text(value: Any) -> str:
    # tokenizer_config.json stores special tokens as strings or AddedToken dicts.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


def load_template(path: str | None, fallback: ChatTemplate | None) -> ChatTemplate | None:
    """An explicit template file wins over the one shipped with the tokenizer."""
    if path is None:
        return fallback
    if fallback is None:
        return ChatTemplate.from_file(path)
    found = ChatTemplate.from_file(path, fallback.bos_token, fallback.eos_token)
    found.special_tokens = {**fallback.special_tokens, **found.special_tokens}
    return found


__all__: Sequence[str] = ["ChatTemplate", "load_template"]
