"""Which tokenizer pipelines the engines may build from a tokenizer directory. Pure, no I/O.

SGLang and vLLM tokenize with transformers' `AutoTokenizer.from_pretrained(model_dir)`, and
transformers 5 does not always use tokenizer.json as it is (read at transformers 5.24.0):

  * the generic class (`TokenizersBackend`, alias `PreTrainedTokenizerFast`), a class with no
    `__init__` of its own, or a `LlamaTokenizer` whose tokenizer.json is byte-level (checked
    on the file's text) load tokenizer.json as it is
    (tokenization_utils_tokenizers.py `TokenizersBackend.convert_to_native_format`;
    models/auto/tokenization_auto.py `AutoTokenizer.from_pretrained`);
  * any other class keeps only the vocabulary, the merges, the post-processor and the added
    tokens, and builds the normalizer, the pre-tokenizer and the BPE options from its own
    `__init__` defaults. `GPT2Tokenizer` (MiniMax, MiniMax-Text-01, MiniMax-M1) drops the
    file's NFC normalizer and its split regex for GPT-2's: transformers counts 40 tokens where
    the file counts 36 on one line of English, and 1,500 more on 9 KB of decomposed Hangul;
    `Qwen2Tokenizer` (Qwen-3.5/3.6) puts Qwen-2's regex in place of the file's.

Which one an engine gets depends on more than tokenizer_config.json: config.json's model type
can replace the declared class (MODEL_TYPE_CLASS) or send it back to the generic one,
transformers 4 always used the file. So kvproxy counts with every pipeline the engine may
have built and takes the largest: exact where they agree, an upper bound where they differ.

Either pipeline also gets the added tokens transformers registers on top of the file's:
tokenizer_config.json's `added_tokens_decoder` and its named special tokens.

A class whose rebuild is not modelled here (`MODELLED` below, or remote code named by
`auto_map`) cannot be counted exactly: `Pipelines.unmodelled` says why, and the counter
decides on the byte bound alone (fail closed). Must never: guess a class's defaults, or
return a single pipeline for a class whose rebuild differs from the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# Classes transformers 5.24 resolves to the generic backend (tokenizer.json as it is):
# `PreTrainedTokenizerFast` is an alias of `TokenizersBackend`; `PreTrainedTokenizer` and no
# class at all resolve to it for a directory that holds a tokenizer.json.
AS_IS = frozenset({"TokenizersBackend", "PreTrainedTokenizer", "PreTrainedTokenizerFast", ""})

# Qwen2Tokenizer's split regex (transformers 5.24 models/qwen2/tokenization_qwen2.py
# PRETOKENIZE_REGEX): the class installs it whatever tokenizer.json says.
QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3_5Tokenizer's (models/qwen3_5/tokenization_qwen3_5.py PRETOKENIZE_REGEX): Qwen-2's
# with combining marks (\p{M}) kept inside words.
QWEN3_5_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# config.json model types whose tokenizer_config.json class transformers 5.24 overrides
# (models/auto/tokenization_auto.py MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), with the
# class it loads instead (TOKENIZER_MAPPING_NAMES; "" is the generic class, the file as it
# is). A model type listed there but not here is not modelled (fail closed).
MODEL_TYPE_CLASS: dict[str, str] = {
    **dict.fromkeys(
        """arctic camembertv2-base chatlm cohere_asr ernie4_5 ernie4_5_moe fuyu h2ovl_chat
        hyperclovax hyperclovax_vlm internlm2 internlm3 iquestcoder jamba llava llava_next
        minicpm3 minicpmv minimax_m2 modernbert modernbert-decoder molmo molmo2 nemotron nvfp4
        opencua openvla paddleocr_vl phi3 phi3_v phimoe smolvlm step3_vl vipllava""".split(),  # noqa: SIM905
        "",
    ),
    "hyperclovax_vision_v2": "GPT2Tokenizer",
    "qwen2": "Qwen2Tokenizer",
    "qwen3_5": "Qwen3_5Tokenizer",
    "qwen3_5_moe": "Qwen3_5Tokenizer",
    "qwen3_5_moe_text": "Qwen3_5Tokenizer",
    "qwen4_exp": "Qwen3_5Tokenizer",
    "siglip2": "Siglip2Tokenizer",
}

# Named special tokens transformers reads from tokenizer_config.json
# (tokenization_utils_base.py SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")  # fmt: skip

# What each modelled class's `__init__` installs, in tokenizer.json's own terms, with the
# defaults of its named special tokens (used when the config does not name them).
_GPT2_SPECIALS = {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
                  "eos_token": "<|endoftext|>"}  # fmt: skip
_QWEN2_SPECIALS = {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                   "pad_token": "<|endoftext|>"}  # fmt: skip


def _gpt2(add_prefix_space: bool) -> dict[str, Any]:
    # models/gpt2/tokenization_gpt2.py GPT2Tokenizer.__init__
    return {
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": add_prefix_space,
            "trim_offsets": True,
            "use_regex": True,
        },
        "bpe": {"continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False},
    }


def _qwen2(add_prefix_space: bool, regex: str = QWEN2_REGEX) -> dict[str, Any]:
    # models/qwen2/tokenization_qwen2.py Qwen2Tokenizer.__init__ (Qwen3_5Tokenizer's is the
    # same with its own regex: models/qwen3_5/tokenization_qwen3_5.py)
    return {
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": regex},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": add_prefix_space,
                    "trim_offsets": True,
                    "use_regex": False,
                },
            ],
        },
        "bpe": {
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
        },
    }


# class name (without "Fast") -> (its rebuild from add_prefix_space, its special defaults)
MODELLED: dict[str, tuple[Any, dict[str, str]]] = {
    "GPT2Tokenizer": (_gpt2, _GPT2_SPECIALS),
    "Qwen2Tokenizer": (_qwen2, _QWEN2_SPECIALS),
    "Qwen3_5Tokenizer": (lambda aps: _qwen2(aps, QWEN3_5_REGEX), _QWEN2_SPECIALS),
}


@dataclass(frozen=True)
class Pipelines:
    """The tokenizer.json specs whose counts an engine may use (the first: the file as
    transformers' generic class loads it), or why kvproxy cannot say."""

    specs: tuple[dict[str, Any], ...]
    # One line for the start-up log: the class and what its rebuild changes.
    note: str = ""
    # Set when the engine's pipeline is not modelled: the exact count is off.
    unmodelled: str | None = None
    # Per spec: whether it differs from the file's own JSON text (needs re-serialising).
    changed: tuple[bool, ...] = field(default=())


def declared_class(config: dict[str, Any]) -> str:
    """tokenizer_config.json's class as transformers 5 reads it ("Fast" is an alias)."""
    name = config.get("tokenizer_class")
    return name.removesuffix("Fast") if isinstance(name, str) else ""


def engine_classes(config: dict[str, Any], raw: str, model_type: str | None) -> list[str]:
    """The tokenizer classes transformers may load for this directory ("" is the generic
    class: the file as it is). A declared byte-level LlamaTokenizer and the generic aliases
    load the file (AutoTokenizer.from_pretrained: `_tokenizer_json_has_byte_level`, a text
    search of the file); config.json's model type may replace the declared class
    (MODEL_TYPE_CLASS), though another transformers release would not: both are kept."""
    cls = declared_class(config)
    if cls in AS_IS or (cls == "LlamaTokenizer" and '"ByteLevel"' in raw):
        cls = ""
    out = [cls]
    if model_type in MODEL_TYPE_CLASS:
        out.append(MODEL_TYPE_CLASS[model_type])
    return list(dict.fromkeys(out))


def engine_pipelines(
    spec: dict[str, Any], config: dict[str, Any], raw: str, model_type: str | None = None
) -> Pipelines:
    """What transformers 5.24 may build from this tokenizer.json (`spec`, its text `raw`),
    tokenizer_config.json (`config`) and config.json's `model_type` (when the directory holds
    one), as the pipelines to count with: the file as it is first, then each rebuild that
    counts differently."""
    cls = declared_class(config)

    def unmodelled(why: str) -> Pipelines:
        return Pipelines((spec,), unmodelled=why, changed=(False,))

    if config.get("auto_map"):
        return unmodelled(
            "tokenizer_config.json names remote tokenizer code (auto_map) the engines run "
            f"with trust_remote_code; kvproxy cannot build {cls or 'it'}"
        )
    if not cls and model_type and model_type not in MODEL_TYPE_CLASS:
        # No declared class: transformers takes config.json's model type's own class.
        return unmodelled(
            f"no tokenizer_class: transformers loads the class of model type {model_type!r}, "
            "which kvproxy does not model"
        )
    as_is = _with_added(spec, _config_added(config, spec, {}))
    specs = [as_is]
    changed_flags = [as_is is not spec]
    notes: list[str] = []
    if counting_view(as_is) != counting_view(spec):
        # The config registers tokens the file lacks. A loader that reads tokenizer.json
        # alone (a gateway tokenizing in Rust, PreTrainedTokenizerFast(tokenizer_file=...))
        # does not: "x<tool_call>y" is 3 tokens with the config's token, 5 without, and
        # the split can go either way at a boundary. Count with both, the largest.
        specs.append(spec)
        changed_flags.append(False)
        notes.append(
            "tokenizer_config.json adds tokens tokenizer.json lacks: counted with and "
            "without them, the largest"
        )
    rebuilt_by: list[str] = []
    for name in engine_classes(config, raw, model_type):
        if not name:
            continue
        if name not in MODELLED:
            return unmodelled(
                f"transformers builds tokenizer class {name!r} from its own defaults instead "
                "of tokenizer.json, and kvproxy does not model that class"
            )
        rebuilt = _rebuild(spec, config, name)
        if rebuilt is None:
            return unmodelled(f"transformers rebuilds {name} as BPE; this tokenizer.json is not")
        if all(counting_view(rebuilt) != counting_view(s) for s in specs):
            specs.append(rebuilt)
            changed_flags.append(True)
            rebuilt_by.append(name)
    if rebuilt_by:
        rebuilds = specs[len(specs) - len(rebuilt_by) :]
        changes = ", ".join(dict.fromkeys(d for r in rebuilds for d in differs(as_is, r)))
        notes.append(
            f"transformers 5 rebuilds {', '.join(rebuilt_by)} from its own defaults "
            f"({changes} differ from tokenizer.json): counted with each, the largest"
        )
    return Pipelines(tuple(specs), note="; ".join(notes), changed=tuple(changed_flags))


def _rebuild(spec: dict[str, Any], config: dict[str, Any], cls: str) -> dict[str, Any] | None:
    """`spec` as class `cls`'s `__init__` rebuilds it (None: the file is not BPE)."""
    model = spec.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return None
    build, defaults = MODELLED[cls]
    parts = build(bool(config.get("add_prefix_space") or False))
    rebuilt = dict(spec)
    rebuilt["normalizer"] = parts["normalizer"]
    rebuilt["pre_tokenizer"] = parts["pre_tokenizer"]
    # Every BPE option the class does not set takes tokenizers' default.
    options = {"dropout": None, "unk_token": None, "continuing_subword_prefix": None,
               "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
               "ignore_merges": False, **parts["bpe"]}  # fmt: skip
    rebuilt["model"] = {**model, **options}
    # The class starts from an empty backend: its added tokens are the config's
    # `added_tokens_decoder` or, without one, tokenizer.json's (tokenization_utils_base.py
    # `_from_pretrained`), then the named special tokens, with the class's defaults.
    base = dict(spec)
    if "added_tokens_decoder" in config:
        base["added_tokens"] = []
    rebuilt["added_tokens"] = _with_added(base, _config_added(config, base, defaults))[
        "added_tokens"
    ]
    return rebuilt


def counting_view(spec: dict[str, Any]) -> dict[str, Any]:
    """The parts of a spec that decide token counts (not offsets, decoding or ids)."""
    model = spec.get("model") or {}
    opts = {k: v for k, v in model.items() if k not in ("vocab", "merges")}
    for key, default in (("ignore_merges", False), ("byte_fallback", False),
                         ("fuse_unk", False), ("dropout", None)):  # fmt: skip
        opts.setdefault(key, default)
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        opts[key] = opts.get(key) or ""
    added = sorted(
        (
            str(t.get("content")),
            bool(t.get("lstrip")),
            bool(t.get("rstrip")),
            bool(t.get("single_word")),
            bool(t.get("normalized")),
        )
        for t in spec.get("added_tokens") or []
    )
    return {
        "normalizer": spec.get("normalizer"),
        "pre_tokenizer": _without_offsets(spec.get("pre_tokenizer")),
        "model": opts,
        "added": added,
    }


def differs(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    va, vb = counting_view(a), counting_view(b)
    names = {"normalizer": "normalizer", "pre_tokenizer": "pre-tokenizer",
             "model": "BPE options", "added": "added tokens"}  # fmt: skip
    return [names[k] for k in va if va[k] != vb[k]]


def _without_offsets(node: Any) -> Any:
    # ByteLevel's trim_offsets only moves offsets; it never changes ids.
    if isinstance(node, dict):
        return {k: _without_offsets(v) for k, v in node.items() if k != "trim_offsets"}
    if isinstance(node, list):
        return [_without_offsets(v) for v in node]
    return node


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _config_added(
    config: dict[str, Any], spec: dict[str, Any], defaults: dict[str, str]
) -> list[dict[str, Any]]:
    """Added tokens transformers registers from the config that `spec` does not hold yet:
    `added_tokens_decoder` entries (with their flags), then named and extra special tokens
    (as `AddedToken(content, special=True)`: not normalized, no strip)."""
    have = {str(t.get("content")) for t in spec.get("added_tokens") or []}
    out: list[dict[str, Any]] = []

    def add(entry: dict[str, Any]) -> None:
        content = str(entry["content"])
        if content and content not in have:
            have.add(content)
            out.append(entry)

    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        for idx, tok in sorted(decoder.items(), key=lambda kv: _int(kv[0])):
            if isinstance(tok, dict) and isinstance(tok.get("content"), str):
                add({
                    "id": _int(idx),
                    "content": tok["content"],
                    "single_word": bool(tok.get("single_word", False)),
                    "lstrip": bool(tok.get("lstrip", False)),
                    "rstrip": bool(tok.get("rstrip", False)),
                    "normalized": bool(tok.get("normalized", not tok.get("special", False))),
                    "special": bool(tok.get("special", False)),
                })  # fmt: skip
    for content in _named_specials(config, defaults):
        add({"id": None, "content": content, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True})  # fmt: skip
    return out


def _named_specials(config: dict[str, Any], defaults: dict[str, str]) -> Iterator[str]:
    for key in NAMED_SPECIALS:
        value = config[key] if key in config else defaults.get(key)
        content = _token_content(value)
        if content:
            yield content
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key)
        if isinstance(extra, dict):
            extra = list(extra.values())
        for value in extra if isinstance(extra, list) else ():
            content = _token_content(value)
            if content:
                yield content


def _with_added(spec: dict[str, Any], extra: list[dict[str, Any]]) -> dict[str, Any]:
    """`spec` with `extra` added tokens appended (ids: the vocabulary's, else new ones)."""
    if not extra:
        return spec
    vocab = (spec.get("model") or {}).get("vocab")
    ids = vocab if isinstance(vocab, dict) else {}
    taken = {t.get("id") for t in spec.get("added_tokens") or []}
    next_id = max([len(ids), *(i + 1 for i in taken if isinstance(i, int))])
    tokens = list(spec.get("added_tokens") or [])
    for entry in extra:
        tid = ids.get(entry["content"], entry["id"])
        if not isinstance(tid, int) or tid in taken:
            tid, next_id = next_id, next_id + 1
        taken.add(tid)
        tokens.append({**entry, "id": tid})
    out = dict(spec)
    out["added_tokens"] = tokens
    return out


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def dumps(spec: dict[str, Any]) -> str:
    """A spec as tokenizer.json text (for HF tokenizers and fastokens alike)."""
    return json.dumps(spec, ensure_ascii=False)
