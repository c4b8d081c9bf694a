#!/usr/bin/env bash
# Cross-check our scorer against lm-evaluation-harness on SmolLM2-135M-Instruct (GGUF, fp32, CPU).
# Both sides run at nice 19 with one torch thread each, concurrently, one JSON per task as it ends.
#
#   bash evals/lmeval_crosscheck/run.sh OUT [TASKS]
#   PREFIX=none bash evals/lmeval_crosscheck/run.sh OUT arc_easy   # no prefix token (lm-eval's default)
#
# Needs: the project venv (PY, default .venv/bin/python of this repository) and a separate venv
# with lm-eval (LMEVAL_PY, default ../venv-lmeval/bin/python: beside the repository), made from
# the repository root with
#   python3 -m venv ../venv-lmeval && ../venv-lmeval/bin/pip install torch==2.13.0 \
#       lm-eval transformers accelerate gguf datasets
# Then: python evals/lmeval_crosscheck/compare.py OUT --md OUT/compare.md
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: run.sh OUT [TASKS]}
TASKS=${2:-arc_easy,arc_challenge,openbookqa,piqa,hellaswag:1000,winogrande,commonsense_qa}
PREFIX=${PREFIX:-0}  # token id put before every context (0 = <|endoftext|>), or none
PY=${PY:-.venv/bin/python}
LMEVAL_PY=${LMEVAL_PY:-../venv-lmeval/bin/python}
mkdir -p "$OUT"
GGUF=$(PYTHONPATH=. "$PY" -c "from evals.models import smollm2_gguf_path; print(smollm2_gguf_path())")
PYTHONPATH=. "$PY" -m evals.data > "$OUT/data.jsonl"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
PYTHONPATH=. nice -n 19 "$PY" evals/lmeval_crosscheck/run_ours.py --out "$OUT" --gguf "$GGUF" \
    --tasks "$TASKS" --prefix-token "$PREFIX" > "$OUT/ours.log" 2>&1 &
echo "ours pid $!"
nice -n 19 "$LMEVAL_PY" evals/lmeval_crosscheck/run_lmeval.py --out "$OUT" --gguf "$GGUF" \
    --tasks "$TASKS" --prefix-token "$PREFIX" > "$OUT/lmeval.log" 2>&1 &
echo "lm-eval pid $!"
{ lscpu | grep -E "Model name|^CPU\(s\)"; nproc; } > "$OUT/machine.txt"
wait
"$PY" evals/lmeval_crosscheck/compare.py "$OUT" --md "$OUT/compare.md" || true
