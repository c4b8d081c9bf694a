# Source on the GPU machine from the repository root, first thing in a device call that
# carries .devcarry (built here by scripts/build_carry.sh; docs/model_bench/README.md):
#
#   . scripts/gpu_env.sh && python3 scripts/bench_model.py --out $OUT ...
#
# Installs .devcarry/wheels into /tmp/site (no index, no dependencies: the image holds the
# rest), puts the checkout and /tmp/site on PYTHONPATH, unpacks .devcarry/cache.tar.xz into
# /tmp/twc and points TWELL_CACHE there (data.cache_dir defaults to $TWELL_CACHE/corpus), and
# keeps NVLink multicast off (the multi-GPU machines require it). Safe to source twice.
# Sourced, so it returns 1 on failure instead of exiting the caller's shell.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --root-user-action=ignore --target /tmp/site .devcarry/wheels/*.whl || { echo "gpu_env: wheel install failed" >&2; return 1; }
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p /tmp/twc && tar -xJf .devcarry/cache.tar.xz -C /tmp/twc ||
  { echo "gpu_env: no .devcarry/cache.tar.xz (carry .devcarry)" >&2; return 1; }
export TWELL_CACHE=/tmp/twc PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# a file carried in parts over earlier calls (the GGUF); a bad part is said, the rest goes on
bash scripts/gpu_stash.sh || echo "gpu_env: the stashed parts above did not assemble" >&2
