# Run S (one H200, right after run R on the same machine): the ReLUfication study of SmolLM2-135M
# (scripts/relufy_study.py; its GGUF is 98 MB, over one call's 64 MiB, so run R stashed its first
# half), with the GPU kernel tests running beside it.
set -u
export PYTHONUNBUFFERED=1
[ -f $HOME/stash/gguf.part.aa ] && [ -d /tmp/twc/corpus ] || { echo "COLD MACHINE: run R's stash is gone"; exit 3; }
export PYTHONPATH=.:/tmp/site TWELL_CACHE=/tmp/twc
cat $HOME/stash/gguf.part.aa .devcarry2/gguf.part.ab > /tmp/smollm2.gguf
O=/tmp/runS; mkdir -p $O/study
(timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_train.py tests/test_kernels_infer.py \
  tests/test_format.py tests/test_mlp_torch.py tests/test_policy.py tests/test_loss.py tests/test_dense_ffn_fused.py \
  > $O/pytest_gpu.log 2>&1; echo "pytest rc $?" >> $O/pytest_gpu.log) &
timeout 560 python3 scripts/relufy_study.py --out $O/study --gguf /tmp/smollm2.gguf \
  --corpus-dir /tmp/twc/corpus --max-wall 520 > $O/study.log 2>&1
echo "study rc $?"
wait
tar -czf $OUT/runS.tgz -C $O .
tail -4 $O/pytest_gpu.log; tail -45 $O/study.log
