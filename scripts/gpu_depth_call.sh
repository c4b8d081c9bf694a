#!/usr/bin/env bash
# The scaling study's depth series in 10-minute device calls that carry .devcarry
# (docs/scaling.md, "Depth series"; build it first: `python scripts/scaling_study.py
# --prepare-evals && bash scripts/build_carry.sh`):
#
#   bash scripts/gpu_depth_call.sh probe                     # the L1 probe (38 layers, 3 rows)
#   L1=0,3e-4,1e-3 bash scripts/gpu_depth_call.sh series     # the series' rows, most informative first
#
# Environment (defaults): L1 (series: required, 0 and the probe's two values), DEPTHS
# (8,18,28,38), STEPS (1000), REINIT (auto: the re-init twin of the sparse row where most units
# die, once results show it; '' = none), PROBE_L1 (1e-4,3e-4,1e-3), PROBE_STEPS (300),
# MAX_WALL (520: the call's 600 s less this script's set-up, ~15 s, a hard stop 30 s after it
# and the packing), EXTRA (more
# scripts/scaling_study.py arguments, e.g. '--eval-limit 1000').
#
# Results and logs go to outputs/depth_out/ (git-ignored; a machine called again within 30 s
# keeps it: its rows are skipped, and a row the deadline stopped resumes from its checkpoint in
# outputs/depth_runs/), and rows already merged into docs/scaling/results/ (which travels with
# the working tree) are skipped too. The whole outputs/depth_out/ comes back as one file,
# $OUT/depth_<mode>.tar.gz (a call returns at most 8 files). Exit code: the study's.
set -uo pipefail
MODE=${1:?usage: gpu_depth_call.sh probe|series}
case $MODE in probe|series) ;; *) echo "gpu_depth_call: unknown mode '$MODE' (probe, series)" >&2; exit 2 ;; esac
OUT=${OUT:?set OUT (the device call sets it)}
if [ "$MODE" = series ] && [ -z "${L1:-}" ]; then
  echo "gpu_depth_call: set L1=0,WEAK,STRONG (the probe's values: scripts/scaling_study.py --suggest-l1 DIR)" >&2
  exit 2
fi
MAX_WALL=${MAX_WALL:-520}
. scripts/gpu_env.sh || exit 1
[ -d "$TWELL_CACHE/evals" ] || {
  echo "gpu_depth_call: the carried cache has no evals/; run 'python scripts/scaling_study.py --prepare-evals' and 'bash scripts/build_carry.sh cache' before the call" >&2
  exit 1; }
RES=outputs/depth_out
mkdir -p "$RES/out" "$RES/logs"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$RES/logs/gpu.txt" 2>&1
echo "${COMMIT:-$(git log -1 --format=%H 2>/dev/null || echo unknown)}" > "$RES/logs/commit.txt"
if [ "$MODE" = probe ]; then
  args=(--probe --probe-l1 "${PROBE_L1:-1e-4,3e-4,1e-3}" --probe-steps "${PROBE_STEPS:-300}")
else
  args=(--l1 "$L1" --reinit-rows "${REINIT-auto}")
fi
stamp=$(date -u +%Y%m%dT%H%M%SZ)
# shellcheck disable=SC2086  # EXTRA is a list of arguments
timeout $((${MAX_WALL%.*} + 30)) python3 scripts/scaling_study.py --depth-series \
  --depths "${DEPTHS:-8,18,28,38}" --steps "${STEPS:-1000}" "${args[@]}" \
  --out "$RES/out" --runs-dir outputs/depth_runs --skip-results docs/scaling/results \
  --max-wall "$MAX_WALL" --keep none ${EXTRA:-} data.build_if_missing=false \
  2>&1 | tee "$RES/logs/study_${MODE}_$stamp.log"
rc=${PIPESTATUS[0]}
cp outputs/depth_runs/*.log "$RES/logs/" 2>/dev/null
tar -czf "$OUT/depth_$MODE.tar.gz" -C outputs depth_out
echo "gpu_depth_call: rc $rc; $(ls "$RES/out" | wc -l) result files in $RES/out, packed into $OUT/depth_$MODE.tar.gz"
exit "$rc"
