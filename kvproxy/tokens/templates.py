"""Chat templates: load the model's own template and render it the way engines do.

Rendering follows transformers' `apply_chat_template` (matched it byte for byte in 72/72
measured cases): jinja2 `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
extensions=["jinja2.ext.loopcontrols"])`, helpers `tojson`, `raise_exception`,
`strftime_now`, and the tokenizer's `bos_token` / `eos_token`. The sandbox matters: a
template is code, and the messages it loops over are attacker-controlled.

Content parts are flattened the way vLLM does for string-content templates: text parts
joined with a newline. Media parts render as nothing here; the counter charges their
configured token cost instead.

Render failures (a template's `raise_exception`, a missing field) become a 400 without the
template's message, which may quote the conversation (I8). This module never logs.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox

from kvproxy.errors import invalid_request
from kvproxy.prompt import SequencePrompt

TEMPLATE_FILES = ("chat_template.jinja",)
_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may print."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = ""):
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template {origin or ''} does not compile: {exc}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.origin = origin

    @classmethod
    def from_file(cls, path: str | Path, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        p = Path(path)
        if p.suffix == ".json":  # a tokenizer_config.json given as the template
            found = from_tokenizer_dir_files(p, None)
            if found is None:
                raise ValueError(f"{p} has no chat_template")
            return found
        return cls(p.read_text(encoding="utf-8"), bos_token, eos_token, origin=str(p))

    def render(self, seq: SequencePrompt) -> str:
        """The exact prompt string the engine tokenizes for this chat sequence."""
        kwargs: dict[str, Any] = {
            k: v for k, v in seq.template_kwargs.items() if k not in _RESERVED
        }
        try:
            return self._template.render(
                **kwargs,
                messages=[_flatten(m) for m in seq.messages],
                tools=list(seq.tools) if seq.tools else None,
                add_generation_prompt=seq.add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError,
                IndexError, RecursionError):  # fmt: skip
            raise invalid_request(
                "the model's chat template cannot render these messages "
                "(check roles, their order and required fields)",
                "messages",
            ) from None


def flattened_messages(seq: SequencePrompt) -> list[dict[str, Any]]:
    """Messages as the template sees them (also what vLLM's /tokenize is sent)."""
    return [_flatten(m) for m in seq.messages]


def joined_parts(seq: SequencePrompt) -> int:
    """How many newline joins flattening added (each may shift a merge by a token)."""
    joins = 0
    for m in seq.messages:
        content = m.get("content")
        if isinstance(content, list):
            joins += max(0, sum(1 for p in content if _part_text(p) is not None) - 1)
    return joins


def _flatten(message: Mapping[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    texts = [t for t in (_part_text(p) for p in content) if t is not None]
    return {**message, "content": "\n".join(texts)}


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict):
        kind = part.get("type")
        if kind in ("text", "input_text"):
            return str(part.get("text", ""))
        if kind == "refusal":
            return str(part.get("refusal", ""))
    return None


def from_tokenizer_dir_files(config_path: Path, template_path: Path | None) -> ChatTemplate | None:
    """Template from `chat_template.jinja` or `tokenizer_config.json`, with bos/eos strings."""
    config: dict[str, Any] = {}
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    if template_path is not None and template_path.is_file():
        return ChatTemplate(template_path.read_text(encoding="utf-8"), bos, eos, str(template_path))
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if isinstance(source, str) and source:
        return ChatTemplate(source, bos, eos, str(config_path))
    return None


def _token_text(value: Any) -> str:
    # tokenizer_config.json stores special tokens as strings or AddedToken dicts.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:  # fmt: skip
    # transformers' tojson: no HTML escaping, unlike jinja2's own filter.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def load_template(path: str | None, fallback: ChatTemplate | None) -> ChatTemplate | None:
    """An explicit template file wins over the one shipped with the tokenizer."""
    if path is None:
        return fallback
    bos = fallback.bos_token if fallback else ""
    eos = fallback.eos_token if fallback else ""
    return ChatTemplate.from_file(path, bos, eos)


__all__: Sequence[str] = ["ChatTemplate", "flattened_messages", "joined_parts", "load_template"]
