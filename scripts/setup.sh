#!/usr/bin/env bash
# Create .venv (if missing) and install twell with its dev extra.
# On a machine without a GPU (no nvidia-smi) torch is the CPU build of 2.13.0, never a CUDA
# build with its nvidia-* packages: a torch 2.13.0 wheel that pip's configuration already offers
# without the network (find-links, e.g. a local wheel folder) is installed as it is; otherwise
# pip is asked for the CPU build explicitly (PyTorch's CPU index, TORCH_CPU_INDEX). Either way
# the script stops, saying how to fix it, if the torch it ends with is a CUDA build or an
# nvidia-* package came with it. On a GPU machine an installed torch is kept (else: pip's torch).
# A .venv already set up by this script for this checkout (a stamp of pyproject.toml, this
# script, the Python, the checkout's path and the GPU's presence, written at the end of a
# complete run; and torch and the packages import) is left as it is: nothing is run again
# (scripts/test.sh and quickstart.sh call this every time). Each step says what it does, so the
# first set-up's minutes of pip are not silent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_CPU=torch==2.13.0
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
STAMP=.venv/.twell-setup
gpu=0
command -v nvidia-smi >/dev/null 2>&1 && gpu=1
say() { echo "setup.sh: $*"; }
stamp() {  # what the set-up depends on; $1: the Python of .venv
  { cat pyproject.toml scripts/setup.sh; echo "gpu=$gpu root=$PWD"; "$1" -c "import sys; print(sys.version)"; } \
    | sha256sum | cut -d" " -f1
}
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(stamp .venv/bin/python)" ] \
    && .venv/bin/python -c "import torch, twell, train, studies, evals, offline" 2>/dev/null; then
  say ".venv is set up for this checkout (pyproject.toml and setup.sh unchanged); nothing to install"
  exit 0
fi
rm -f "$STAMP"
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
say "upgrading pip in .venv"
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  say "installing torch (about 200 MB for the CPU build: a minute or two the first time)"
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
say "installing twell (editable) and its dependencies: transformers, accelerate, datasets, hydra," \
  "wandb, ... (1-3 min the first time)"
python -m pip install -q -e ".[dev]" "numpy<2.3"
if [ "$gpu" = 0 ] && python -m pip list --format=freeze 2>/dev/null | grep -qi '^nvidia-'; then
  echo "setup.sh: installing twell's dependencies pulled nvidia-* packages on a machine without" \
    "a GPU:" $(python -m pip list --format=freeze | grep -i '^nvidia-') >&2
  exit 1
fi
stamp python > "$STAMP"
say ".venv ready (${SECONDS} s)"
