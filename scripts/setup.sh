#!/usr/bin/env bash
# Create .venv (if missing) and install twell with its dev extra.
# On a machine without a GPU (no nvidia-smi) torch is the CPU build of 2.13.0, never a CUDA
# build with its nvidia-* packages: a torch 2.13.0 wheel that pip's configuration already offers
# without the network (find-links, e.g. a local wheel folder) is installed as it is; otherwise
# pip is asked for the CPU build explicitly (PyTorch's CPU index, TORCH_CPU_INDEX). Either way
# the script stops, saying how to fix it, if the torch it ends with is a CUDA build or an
# nvidia-* package came with it. On a GPU machine an installed torch is kept (else: pip's torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_CPU=torch==2.13.0
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
gpu=0
command -v nvidia-smi >/dev/null 2>&1 && gpu=1
if ! python -c "import torch" 2>/dev/null; then
  if [ "$gpu" = 1 ]; then
    python -m pip install -q torch
  elif python -m pip install -q --no-index --no-deps "$TORCH_CPU" 2>/dev/null; then
    # a configured local wheel (no index asked); its dependencies from the usual indexes
    python -m pip install -q "$TORCH_CPU"
  else
    echo "setup.sh: no local $TORCH_CPU wheel; installing the CPU build from $TORCH_CPU_INDEX" >&2
    python -m pip install -q "$TORCH_CPU" --index-url "$TORCH_CPU_INDEX"
  fi
fi
if [ "$gpu" = 0 ]; then
  cuda=$(python -W ignore -c "import torch; print(torch.version.cuda or '')" 2>/dev/null)
  nvidia=$(python -m pip list --format=freeze 2>/dev/null | grep -i '^nvidia-' || true)
  if [ -n "$cuda" ] || [ -n "$nvidia" ]; then
    echo "setup.sh: this machine has no GPU but .venv holds a CUDA build of torch" \
      "(torch.version.cuda=${cuda:-none};" $nvidia "). Fix: rm -rf .venv and run this script" \
      "again with pip's configuration offering no CUDA torch wheel (it then asks" \
      "$TORCH_CPU_INDEX), or: .venv/bin/pip install --force-reinstall $TORCH_CPU" \
      "--index-url $TORCH_CPU_INDEX" >&2
    exit 1
  fi
fi
# triton 3.6 runs its interpreter (TRITON_INTERPRET=1) only with numpy < 2.3.
python -m pip install -q -e ".[dev]" "numpy<2.3"
if [ "$gpu" = 0 ] && python -m pip list --format=freeze 2>/dev/null | grep -qi '^nvidia-'; then
  echo "setup.sh: installing twell's dependencies pulled nvidia-* packages on a machine without" \
    "a GPU:" $(python -m pip list --format=freeze | grep -i '^nvidia-') >&2
  exit 1
fi
