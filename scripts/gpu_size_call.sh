#!/usr/bin/env bash
# One model size on one H200, in 10-minute device calls that carry .devcarry
# (docs/model_bench/README.md): the scaling-study row at L1 3e-4 (the bench model: 200 steps),
# the whole-model benchmark on its checkpoint (which records the lowest / median / highest-L0
# layers), and the sparse ops on those recorded layers. Each stage has its own time limit and
# is packed into $OUT/<stage>_<size>.tar.gz as soon as it ends, so a stage cut short loses only
# itself. Checkpoints and recorded layers go to the ignored outputs/ of the checkout, which a
# later call on the same warm machine still finds.
#
#   bash scripts/gpu_size_call.sh 1p5b row bench     # in a device call ($OUT is set there)
#   IID=0.003,0.03 bash scripts/gpu_size_call.sh 1p5b ops
#
# Stage seconds: T_ROW (230), T_BENCH (340), T_OPS (240); BENCH_STEPS: timed steps per bench row
# (15); IID: i.i.d. densities for the ops stage ('' = none); COMMIT: recorded with the results.
set -uo pipefail
SIZE=${1:?usage: gpu_size_call.sh SIZE STAGE... (SIZE: configs/model; STAGE: row bench ops)}
shift
OUT=${OUT:?set OUT (the device call sets it)}
RUNS=outputs/runs ACTS=outputs/acts_$SIZE RES=/tmp/res_$SIZE
for stage in "$@"; do
  case $stage in row|bench|ops) ;; *) echo "unknown stage $stage (row, bench, ops)"; exit 2 ;; esac
done
. scripts/gpu_env.sh || exit 1
mkdir -p "$RES" "$ACTS"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$RES/gpu.txt" 2>&1
echo "${COMMIT:-$(git log -1 --format=%H 2>/dev/null)}" > "$RES/commit.txt"
pack() { tar -czf "$OUT/$1_$SIZE.tar.gz" -C "$RES" "$1" gpu.txt commit.txt; }

status=0
for stage in "$@"; do
  mkdir -p "$RES/$stage"
  case $stage in
  row)
    timeout "${T_ROW:-230}" python3 scripts/scaling_study.py --sizes "$SIZE" --l1 3e-4 \
      --keep weights --out "$RES/row" --runs-dir "$RUNS" --max-wall "${T_ROW:-230}" \
      data.build_if_missing=false > "$RES/row/scaling.log" 2>&1
    rc=$?; echo "row: rc $rc"; [ $rc = 0 ] || status=1; tail -3 "$RES/row/scaling.log" ;;
  bench)
    CK=$(ls -d "$RUNS/${SIZE}_l1_3e-4"/checkpoints/step* 2>/dev/null | sort -V | tail -1)
    if [ -z "$CK" ]; then echo "bench: no checkpoint under $RUNS/${SIZE}_l1_3e-4"; status=1; continue; fi
    timeout "${T_BENCH:-340}" python3 scripts/bench_model.py --sizes "$SIZE" --model-from "$CK" \
      --budgets 80,139 --steps "${BENCH_STEPS:-15}" --deadline $((${T_BENCH:-340} - 15)) \
      --no-plots --acts-dir "$ACTS" --out "$RES/bench" --config data.build_if_missing=false \
      > "$RES/bench/bench_model.log" 2>&1
    rc=$?; echo "bench: rc $rc"; [ $rc = 0 ] || status=1; tail -6 "$RES/bench/bench_model.log" ;;
  ops)
    LAYERS=$(ls "$ACTS"/*.safetensors 2>/dev/null | paste -sd, -)
    timeout "${T_OPS:-240}" python3 scripts/bench_real_layers.py --layers "$LAYERS" \
      --iid "${IID-}" --out "$RES/ops" > "$RES/ops/real_layers.log" 2>&1
    rc=$?; echo "ops: rc $rc"; [ $rc = 0 ] || status=1; tail -14 "$RES/ops/real_layers.log" ;;
  *) echo "unknown stage $stage (row, bench, ops)"; exit 2 ;;
  esac
  pack "$stage"
done
exit $status  # 1 when any stage failed (each stage is packed either way)
