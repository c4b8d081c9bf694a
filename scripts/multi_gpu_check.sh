#!/usr/bin/env bash
# Two-GPU acceptance run (DDP / FSDP2 against one GPU), on a machine with 2 GPUs:
#
#   bash scripts/multi_gpu_check.sh CORPUS_CACHE_DIR [OUT_DIR]
#
# CORPUS_CACHE_DIR is the folder holding the built offline corpus (data.cache_dir: the parent
# of offline_mix-<hash>/, e.g. ~/.cache/twell/corpus); nothing is built or downloaded.
# OUT_DIR (default runs/multi_gpu_check) receives the run directories and report.txt.
#
# 1. Sparsify: small_l4, 1 GPU, L1 1e-3, 400 steps of 16 x 1024 tokens, checkpoints every 100
#    steps.
# 2. From its step-300 checkpoint, 100 steps on 1 GPU (micro-batch 16) and on 2 GPUs with
#    ddp.yaml (micro-batch 8 each: the same global batch), for ffn.impl=torch and auto;
#    reported: the largest |loss difference| 2 GPUs vs 1 over the 100 steps, next to the
#    1-GPU torch-vs-auto difference (the bf16 noise scale).
# 3. The 2-GPU auto run's step-350 checkpoint resumed on 1 GPU to step 400: its losses against
#    the 2-GPU run's own steps 351-400.
# 4. tokens/s at the 1.5B shape (paper_1p5b, seq 2048, micro-batch 8, 2 micro-steps per step and
#    GPU, 12 steps; the median of the logged rates after the first log): 2 GPUs (DDP and
#    FSDP2) vs 1 GPU; target >= 1.85x.
# The report (report.txt): studies/multi_gpu.py.
#
# MGC_SMOKE=1: a dry run of every command on CPU (gloo) with a tiny model and 8 steps: checks
# the command lines and the report, not the numbers.
#
# The GPU machine lacks hydra-core, omegaconf, datasets and wandb: carry .devcarry (built by
# scripts/build_carry.sh) and source scripts/gpu_env.sh first (docs/model_bench/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ ! -d "$1" ]; then
  echo "usage: bash scripts/multi_gpu_check.sh CORPUS_CACHE_DIR [OUT_DIR]" >&2; exit 2
fi
CORPUS=$(cd "$1" && pwd)
OUT=${2:-runs/multi_gpu_check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# NVLink multicast off: NCCL (NVLS), torch symmetric memory and NVSHMEM (needed on the
# multi-GPU H200 machines here)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 WANDB_MODE=disabled
PY=${PYTHON:-python3}
TOTAL=400 FROM=300 MID=350 BIG_STEPS=12 EXTRA=()  # steps: sparsify, compare from, resume at
if [ "${MGC_SMOKE:-0}" = 1 ]; then
  TOTAL=8 FROM=4 MID=6 BIG_STEPS=4
  EXTRA=(trainer.cpu=true trainer.precision=fp32 trainer.grad_checkpointing=false
         trainer.num_threads=1 model.hidden_size=64 model.intermediate_size=128
         model.num_layers=2 model.num_heads=2 model.seq_len=64)
  export OMP_NUM_THREADS=1
fi
ONE=("$PY" -m train)
TWO_DDP=("$PY" -m accelerate.commands.launch --config_file configs/accelerate/ddp.yaml --num_processes 2 -m train)
TWO_FSDP=("$PY" -m accelerate.commands.launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2 -m train)
DATA=(data=offline_mix "data.cache_dir=$CORPUS" data.build_if_missing=false)
QUIET=(eval=disabled logging.wandb_mode=disabled trainer.progress=false trainer.val_every=0
       trainer.val_sequences=8)
SMALL=(model=small_l4 trainer=gpu optim=adamw optim.warmup_steps=30 sparsity.l1_coeff=1e-3
       trainer.max_steps=$TOTAL trainer.global_batch=16 "${DATA[@]}" "${QUIET[@]}")

run() {  # name, command...: log to $OUT/name.log, stop the script on failure
  local name=$1; shift
  echo "== $name: $* ${EXTRA[*]}" | tee "$OUT/$name.log"
  if ! timeout 1200 "$@" "${EXTRA[@]}" >> "$OUT/$name.log" 2>&1; then
    echo "$name failed; tail of $OUT/$name.log:" >&2; tail -30 "$OUT/$name.log" >&2; exit 1
  fi
}

# 1. a framework-sparsified model
run sparsify "${ONE[@]}" "${SMALL[@]}" trainer.micro_batch=16 trainer.log_every=50 \
  trainer.save_every=$((TOTAL - FROM)) trainer.keep_last=5 trainer.resume=never \
  "hydra.run.dir=$OUT/sparse"
CK=$OUT/sparse/checkpoints/step$FROM

# 2. 100 steps, 1 GPU vs 2 GPUs, torch and auto
for impl in torch auto; do
  run "one_$impl" "${ONE[@]}" "${SMALL[@]}" trainer.micro_batch=16 trainer.log_every=1 \
    "ffn.impl=$impl" "trainer.resume=$CK" "hydra.run.dir=$OUT/one_$impl"
  run "two_$impl" "${TWO_DDP[@]}" "${SMALL[@]}" trainer.micro_batch=8 trainer.log_every=1 \
    trainer.save_every=$((MID - FROM)) trainer.keep_last=5 "ffn.impl=$impl" "trainer.resume=$CK" \
    "hydra.run.dir=$OUT/two_$impl"
done

# 3. a 2-GPU checkpoint resumed on 1 GPU
run resume_two_on_one "${ONE[@]}" "${SMALL[@]}" trainer.micro_batch=16 trainer.log_every=1 \
  ffn.impl=auto "trainer.resume=$OUT/two_auto/checkpoints/step$MID" \
  "hydra.run.dir=$OUT/resume_two_on_one"

# 4. tokens/s at the 1.5B shape (run dirs deleted after: a 1.5B checkpoint is ~18 GB)
BIG=(experiment=paper_1p5b "${DATA[@]}" "${QUIET[@]}" trainer.max_steps=$BIG_STEPS trainer.log_every=2
     trainer.micro_batch=8 trainer.resume=never)
run speed_one "${ONE[@]}" "${BIG[@]}" trainer.global_batch=16 "hydra.run.dir=$OUT/speed_one"
run speed_ddp "${TWO_DDP[@]}" "${BIG[@]}" trainer.global_batch=32 "hydra.run.dir=$OUT/speed_ddp"
run speed_fsdp "${TWO_FSDP[@]}" "${BIG[@]}" trainer.global_batch=32 "hydra.run.dir=$OUT/speed_fsdp"
for d in speed_one speed_ddp speed_fsdp; do
  cp "$OUT/$d/metrics.jsonl" "$OUT/$d.metrics.jsonl"; rm -rf "$OUT/$d"
done

"$PY" -m studies.multi_gpu "$OUT" | tee "$OUT/report.txt"
