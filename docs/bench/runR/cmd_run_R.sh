# Run R (one H200): whole-model bench at 1.5B on a model the framework makes sparse
# (scripts/bench_model.py: train 180 steps at L1 3e-4, then plain transformers vs our paths and
# the speed options side by side), then one-FFN benches on three recorded layers of that model
# next to i.i.d. rows at the same density. Also stashes the first half of the SmolLM2 GGUF for
# run S (the relufy study), which carries the second half.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .devcarry/wheels/*.whl 2>&1 | tail -1
export PYTHONPATH=.:/tmp/site
mkdir -p /tmp/twc $HOME/stash && tar -xJf .devcarry/cache.tar.xz -C /tmp/twc && cp .devcarry/gguf.part.aa $HOME/stash/
export TWELL_CACHE=/tmp/twc
O=/tmp/runR; mkdir -p $O/bm /tmp/acts
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv > $O/gpu.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $O/gpu.txt
V1="auto_ckpt=auto:trainer.checkpoint_ffn=auto,trainer.backup_capacity=adaptive"
V2="auto_fast=auto:trainer.checkpoint_ffn=auto,trainer.backup_capacity=adaptive,trainer.fused_ce=true,trainer.autocast_cache=false"
V3="dense_fast=torch:trainer.dense_ffn_fused=true,trainer.fused_ce=true,trainer.autocast_cache=false"
timeout 385 python3 scripts/bench_model.py --out $O/bm --deadline 370 --no-plots --train-steps 180 \
  --micro-list 8 --profile --profile-paths auto --acts-dir /tmp/acts --variants "$V1" "$V2" "$V3" \
  --config data.cache_dir=/tmp/twc/corpus data.build_if_missing=false > $O/bench_model.log 2>&1
echo "bench_model rc $?"
A=$(ls /tmp/acts/*.pt 2>/dev/null | paste -sd, -)
echo "acts: $A"
timeout 75 python3 scripts/bench_ffn_train.py --acts "$A" --acts-iid --dists "" --parts "" \
  --variants dense,dense_mode,sparse,sparse_nosync,auto --quick > $O/ffn_train_acts.log 2>&1
echo "ffn_train rc $?"
timeout 70 python3 scripts/bench_ffn.py --main-only --no-sweep --no-check --densities 0.003,0.01 \
  --acts "$A" > $O/ffn_infer_acts.log 2>&1
echo "ffn_infer rc $?"
tar -czf $OUT/runR.tgz -C $O .
tail -22 $O/bench_model.log; tail -14 $O/ffn_train_acts.log; grep -E "acts_|dense " $O/ffn_infer_acts.log | tail -12
