set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 200 python -m pytest -q -x tests/test_kernels_train.py tests/test_kernels_infer.py -p no:warnings > $OUT/pytest_gpu.log 2>&1; echo "pytest rc $?"
tail -5 $OUT/pytest_gpu.log
