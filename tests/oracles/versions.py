"""The engine and router releases the oracles replicate, in one place.

Every function in `sglang.py`, `vllm.py` and `smg.py` cites a file of one of these releases;
the kvproxy side keys its table of verified request features by the same strings
(`ENGINE_VERSIONS`). Each release was read from the artifact its registry serves, pinned
here by sha256, not from a branch that moves:

- SGLang 0.5.23 (PyPI wheel sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl, uploaded
  2026-10-30): the newest release. Its `sglang/_version.py` carries no commit id, so the
  files are cited as ``sglang@v0.5.23``.
- SGLang 0.5.9 (PyPI wheel sglang-0.5.9-py3-none-any.whl, 2026-02-23): a release whose
  `/v1/responses` still falls back to plain ``role: content`` lines when the chat
  conversion fails (0.5.23 answers 400 instead; the releases between were not read). Only
  that fallback is replicated from it.
- vLLM 0.34.0 (PyPI sdist vllm-0.34.0.tar.gz, 2026-11-16; `vllm/_version.py` commit
  ``g62d4bc3c7``): the newest release.
- smg 1.13.0 (PyPI sdist smg-1.13.0.tar.gz, the source of the wheel in `.venv-smg`; its
  binary reports ``Git Commit: unknown``, build 2026-10-15): the router `tests/real_router.py`
  launches.

The engines' own dependencies that shape a count are the test venv's: transformers 5.24.0
renders the templates (SGLang 0.5.23 pins 5.19.0, vLLM 0.34.0 wants >=5.16.1,<5.23), and
orjson parses SGLang bodies as SGLang does (SGLang does not pin orjson; `ORJSON_VERSION`
records the one the oracle ran with, since orjson's handling of integers beyond 64 bits has
changed across releases).
"""

from __future__ import annotations

from importlib.metadata import version

SGLANG = "0.5.23"
SGLANG_LEGACY = "0.5.9"
VLLM = "0.34.0"
SMG = "1.13.0"

# What kvproxy's verified-feature table keys on: engine kind -> the release replicated.
ENGINE_VERSIONS: dict[str, str] = {"sglang": SGLANG, "vllm": VLLM, "smg": SMG}

# sha256 of the artifact each citation was read from.
ARTIFACTS: dict[str, tuple[str, str]] = {
    "sglang@v0.5.23": (
        "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
        "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
    ),
    "sglang@v0.5.9": (
        "sglang-0.5.9-py3-none-any.whl",
        "8a936c4d25fea605f44254e533cff2144c73ceffbc1f8738aba393461bbb64d1",
    ),
    "vllm@v0.34.0": (
        "vllm-0.34.0.tar.gz (commit g62d4bc3c7)",
        "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
    ),
    "smg@v1.13.0": (
        "smg-1.13.0.tar.gz",
        "0f8638751f5ba9aac1ef809cd81cfaf7e354973086a4cb1740a9acc0812dc5da",
    ),
}

TRANSFORMERS_VERSION: str = version("transformers")
ORJSON_VERSION: str = version("orjson")
