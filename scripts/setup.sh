#!/usr/bin/env bash
# Create .venv (if missing) and install twell with its dev extra.
# On a machine without a GPU, torch is pinned to the CPU wheel 2.13.0 so pip
# never pulls a multi-GB CUDA build; on a GPU machine any installed torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q torch
  else
    python -m pip install -q torch==2.13.0
  fi
fi
# triton 3.6 runs its interpreter (TRITON_INTERPRET=1) only with numpy < 2.3.
python -m pip install -q -e ".[dev]" "numpy<2.3"
