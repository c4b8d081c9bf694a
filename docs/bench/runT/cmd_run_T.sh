# Run T (one H200): the whole-model bench at the 2B shape (and small_l4, for trainer=gpu's
# ffn_impl), with trainer=gpu's new speed defaults (checkpoint_ffn=auto, backup_capacity=adaptive,
# fused_ce, autocast_cache=false) in stage 1 and in every measured path, beside rows with the
# old defaults (*_old) and our best dense path (dense_fast). Stage 1's log gives the redo rate
# of the adaptive capacities over a whole training run. Those speed defaults were in
# configs/trainer/gpu.yaml for runs T and T2 only (commit of this file's parent); reverted after
# them (BENCHMARKS.md "Runs T, T2"): with today's gpu.yaml, pass them as --config overrides.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .devcarry/wheels/*.whl 2>&1 | tail -1
export PYTHONPATH=.:/tmp/site
mkdir -p /tmp/twc && tar -xJf .devcarry/cache.tar.xz -C /tmp/twc
export TWELL_CACHE=/tmp/twc
O=/tmp/runT; mkdir -p $O/bm
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv > $O/gpu.txt
OLD="trainer.checkpoint_ffn=always,trainer.backup_capacity=window,trainer.fused_ce=false,trainer.autocast_cache=true"
timeout 540 python3 scripts/bench_model.py --sizes small_l4,2b --out $O/bm --deadline 500 --no-plots \
  --train-steps 160 --micro-list 8 --paths hf,torch,dense_mode,auto \
  --variants "dense_fast=torch:trainer.dense_ffn_fused=true" "auto_old=auto:$OLD" "torch_old=torch:$OLD" \
  --config data.cache_dir=/tmp/twc/corpus data.build_if_missing=false > $O/bench_model.log 2>&1
echo "bench_model rc $?"
tar -czf $OUT/runT.tgz -C $O .
grep -E "^\[bench_model\]|redoing" $O/bench_model.log | tail -40
