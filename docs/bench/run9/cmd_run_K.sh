set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
git log --oneline -1 2>/dev/null
timeout 330 python scripts/bench_ffn_train.py --quick --variants dense,dense_stats,dense_mode,sparse_late,sparse,sparse_dwo512,sparse_dwo256,auto > $OUT/train.log 2>&1; echo "train rc $?"
timeout 130 python -m pytest -q -x tests/test_kernels_train.py tests/test_kernels_infer.py -p no:warnings > $OUT/pytest_gpu.log 2>&1; echo "pytest rc $?"
timeout 120 python scripts/bench_ffn.py --main-only --no-sweep --no-check > $OUT/infer.log 2>&1; echo "infer rc $?"
echo "=== train"; grep -v "^#" $OUT/train.log | tail -75
echo "=== pytest"; tail -4 $OUT/pytest_gpu.log
echo "=== infer"; tail -45 $OUT/infer.log
