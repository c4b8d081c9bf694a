set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps .devcarry/wheels/*.whl 2>&1 | tail -1
mkdir -p /tmp/twc && tar -xJf .devcarry/cache.tar.xz -C /tmp/twc
export TWELL_CACHE=/tmp/twc
timeout 200 python scripts/bench_ffn_train.py --quick --parts '' --variants dense,dense_mode,sparse,sparse_nosync,auto > $OUT/train.log 2>&1; echo "train rc $?"
timeout 150 python -m pytest -q -x tests/test_kernels_train.py -p no:warnings > $OUT/pytest_gpu.log 2>&1; echo "pytest rc $?"
timeout 220 python scripts/compare_ffn_paths.py --out $OUT/cmp --runs-dir /tmp/cmpruns model=small_l4 trainer=gpu trainer.global_batch=16 trainer.micro_batch=16 optim=adamw optim.warmup_steps=30 data.cache_dir=/tmp/twc/corpus data.build_if_missing=false eval=disabled > $OUT/cmp.log 2>&1; echo "cmp rc $?"
grep -h "backup\|redo" /tmp/cmpruns/*.log | head -5
echo "=== train"; grep -v "^#\|^{" $OUT/train.log | tail -45
echo "=== pytest"; tail -4 $OUT/pytest_gpu.log
echo "=== cmp"; tail -12 $OUT/cmp.log
