# cpu_torch VERSION PIP...: sourced by the real-engine installs (tests/real/install_vllm.sh,
# tests/oracles/sglang_real/install.sh). Installs torch==VERSION (a +cpu build) with the pip
# command PIP... and leaves in TORCH_ARGS what pins it for the installs after it, so that
# nothing pulls the CUDA torch. The configured indexes are asked first (this machine's pip
# finds the wheel in /opt/wheels), the PyTorch CPU index only when they don't serve it: asked
# first, its host, which does not resolve here, cost ~8 s of pip retries per package (374
# retries in ~10 min). KVPROXY_TORCH_INDEX: an index URL to use from the start, or empty for
# the configured indexes alone.
cpu_torch() {
  local version=$1
  shift
  local index=${KVPROXY_TORCH_INDEX-auto}
  TORCH_ARGS=("torch==$version")
  if [ "$index" = auto ]; then
    if "$@" "${TORCH_ARGS[@]}" 2>/dev/null; then return; fi
    echo "torch==$version is not on the configured indexes: from the PyTorch CPU index"
    index=https://download.pytorch.org/whl/cpu
  fi
  if [ -n "$index" ]; then TORCH_ARGS+=(--extra-index-url "$index"); fi
  "$@" "${TORCH_ARGS[@]}"
}
