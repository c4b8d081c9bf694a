# Run T2 (one H200, right after run T on the same machine, its setup still in /tmp): the 2B
# shape trained again (120 steps; a different model from run T's), then auto with trainer=gpu's
# tried speed defaults minus checkpoint_ffn=auto (auto_final), beside auto with them, dense mode,
# the fused dense path and plain transformers. The speed defaults were in configs/trainer/gpu.yaml
# for runs T and T2 only (checkpoint_ffn=auto, backup_capacity=adaptive, fused_ce=true,
# autocast_cache=false); they were reverted after these runs (BENCHMARKS.md "Runs T, T2").
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site TWELL_CACHE=/tmp/twc; O=/tmp/runT2; mkdir -p $O/bm
[ -d /tmp/twc/corpus ] || exit 3
timeout 400 python3 scripts/bench_model.py --sizes 2b --out $O/bm --deadline 380 --no-plots \
  --train-steps 120 --train-budget 175 --micro-list 8 --paths hf,dense_mode,auto \
  --variants "auto_final=auto:trainer.checkpoint_ffn=always" "dense_fast=torch:trainer.dense_ffn_fused=true" \
  --config data.cache_dir=/tmp/twc/corpus data.build_if_missing=false > $O/bench_model.log 2>&1
echo "rc $?"; tar -czf $OUT/runT2.tgz -C $O .
