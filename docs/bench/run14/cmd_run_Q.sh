set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps .devcarry/wheels/*.whl 2>&1 | tail -1
mkdir -p /tmp/twc && tar -xJf .devcarry/cache.tar.xz -C /tmp/twc
export TWELL_CACHE=/tmp/twc
timeout 150 python -m train model=small_l4 trainer=gpu trainer.max_steps=400 trainer.global_batch=16 trainer.micro_batch=16 trainer.log_every=50 trainer.val_every=0 trainer.save_every=400 trainer.resume=never optim=adamw optim.warmup_steps=30 sparsity.l1_coeff=1e-3 data.cache_dir=/tmp/twc/corpus data.build_if_missing=false eval=disabled logging.wandb_mode=disabled trainer.progress=false hydra.run.dir=/tmp/sparse_run > $OUT/train_sparse.log 2>&1; echo "train rc $?"
grep -h "step 400\|step 350" $OUT/train_sparse.log | tail -2
CK=$(ls -d /tmp/sparse_run/checkpoints/step* | tail -1)
for L in 1 3; do timeout 60 python scripts/record_acts.py $CK /tmp/twc/corpus/*/val_000.bin --layer $L --tokens 16384 --out /tmp/acts_l$L.pt; done 2>&1 | tail -3
timeout 120 python scripts/bench_ffn.py --main-only --no-sweep --no-check --acts /tmp/acts_l1.pt > $OUT/infer_acts.log 2>&1; echo "bench rc $?"
grep -n "acts_l1\|dense " $OUT/infer_acts.log | tail -14
