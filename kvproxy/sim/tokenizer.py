"""The simulator's own tokenizers and chat-template rendering.

Owns: turning a request's text or chat messages into token ids exactly the way the engine
does (render the chat template, then tokenize with ``add_special_tokens=False``; plain text
with ``add_special_tokens=True``), and turning ids back into text for the echo model.

Two tokenizers:

* ``ByteTokenizer`` (default): one token per UTF-8 byte, ids 0..255, no special tokens.
  Its chat template is ``BYTE_CHAT_TEMPLATE`` below, documented so another implementation
  can reproduce it byte for byte: an optional tools block, then per message
  ``<|ROLE|>\\nCONTENT\\n``, then ``<|assistant|>\\n`` as the generation prompt.
* ``HFTokenizer``: a Hugging Face ``tokenizer.json`` (plain, ``.zip``-ed, or a directory),
  with the chat template from ``chat_template.jinja`` or ``tokenizer_config.json`` next to it.

This module is part of the independent oracle: it must never import kvproxy code outside
``kvproxy/sim``, and it never logs prompt text.
"""

from __future__ import annotations

import codecs
import json
import zipfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The built-in template. Content that is a list of parts arrives already flattened to a
# string (text parts joined with one space), as SGLang does for "string" templates.
BYTE_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] or '' }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TemplateError(ValueError):
    """The chat template could not be rendered for these messages (HTTP 400)."""


class Tokenizer(Protocol):
    name: str
    chat_template: str
    special_tokens: dict[str, str]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def new_detokenizer(self) -> Detokenizer: ...


class Detokenizer(Protocol):
    def push(self, token: int) -> str: ...

    def flush(self) -> str: ...


class ByteTokenizer:
    name = "byte"
    chat_template = BYTE_CHAT_TEMPLATE
    special_tokens: dict[str, str] = {}  # noqa: RUF012 - read-only, shared on purpose

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def new_detokenizer(self) -> Detokenizer:
        return _ByteDetokenizer()


class _ByteDetokenizer:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        if not 0 <= token < 256:
            return ""
        return str(self._decoder.decode(bytes((token,))))

    def flush(self) -> str:
        return str(self._decoder.decode(b"", final=True))


class HFTokenizer:
    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _HFTok  # optional extra: import on demand

        source = Path(path)
        if source.is_dir():
            config_dir = source
            plain, zipped = source / "tokenizer.json", source / "tokenizer.json.zip"
            source = plain if plain.exists() else zipped
        else:
            config_dir = source.parent
        if not source.exists():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        if source.suffix == ".zip":
            with zipfile.ZipFile(source) as archive:
                member = next(n for n in archive.namelist() if n.endswith("tokenizer.json"))
                self._tok = _HFTok.from_str(archive.read(member).decode("utf-8"))
        else:
            self._tok = _HFTok.from_file(str(source))
        self.name = str(config_dir.name)
        config: dict[str, Any] = {}
        config_file = config_dir / "tokenizer_config.json"
        if config_file.exists():
            config = json.loads(config_file.read_text(encoding="utf-8"))
        self.special_tokens = {
            key: text
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(config.get(key))) is not None
        }
        self.chat_template = _pick_template(config_dir, config)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode([i for i in ids if i >= 0], skip_special_tokens=True))

    def new_detokenizer(self) -> Detokenizer:
        return _OffsetDetokenizer(self.decode)


class _OffsetDetokenizer:
    """Incremental decode that never re-decodes the whole output (O(n) overall).

    Decodes a short window ending at the newest token and emits what it adds; holds text
    back while the window ends in a partial character (U+FFFD).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token: int) -> str:
        if token < 0:
            return ""
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :] if len(after) > len(before) else ""


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _pick_template(config_dir: Path, config: dict[str, Any]) -> str:
    jinja_file = config_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the engine uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else BYTE_CHAT_TEMPLATE


def load_tokenizer(path: str | None) -> Tokenizer:
    return ByteTokenizer() if path is None else HFTokenizer(path)


# -- chat templates ------------------------------------------------------------------------


def _tojson(value: Any, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(
        value,
        ensure_ascii=False,
        indent=indent,
        separators=kwargs.get("separators"),
        sort_keys=bool(kwargs.get("sort_keys", False)),
    )


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatRenderer:
    """Renders one tokenizer's chat template; compiled once, rendered per request."""

    def __init__(self, template: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(template)
        self._special = dict(special_tokens)
        self.content_format = _detect_content_format(env, template)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        prepared = [self._prepare(m) for m in messages]
        context: dict[str, Any] = {**self._special, **(extra or {})}
        context.update(
            messages=prepared, tools=tools or None, documents=None, add_generation_prompt=True
        )
        try:
            return str(self._template.render(**context))
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, ValueError) as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc

    def _prepare(self, message: dict[str, Any]) -> dict[str, Any]:
        content = message.get("content")
        if not isinstance(content, list):
            return {k: v for k, v in message.items() if v is not None}
        if self.content_format == "openai":
            return {k: v for k, v in message.items() if v is not None}
        texts = [
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        ]
        flat = {k: v for k, v in message.items() if v is not None}
        flat["content"] = " ".join(texts)
        return flat


def _detect_content_format(env: jinja2.Environment, template: str) -> str:
    """'openai' when the template loops over a message's content parts, else 'string'."""
    try:
        tree = env.parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in tree.find_all(jinja2.nodes.For):
        node: jinja2.nodes.Node = loop.iter
        while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
            node = node.node
        if _is_content_of_message(node):
            return "openai"
    return "string"


def _is_content_of_message(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Getattr):
        is_content = node.attr == "content"
    elif isinstance(node, jinja2.nodes.Getitem):
        is_content = isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    else:
        return False
    base = node.node
    return (
        is_content and isinstance(base, jinja2.nodes.Name) and base.name in {"message", "msg", "m"}
    )
