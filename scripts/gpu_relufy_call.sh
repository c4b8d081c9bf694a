#!/usr/bin/env bash
# One piece of the ReLUfication study (docs/relufy.md) in a 10-minute device call that carries
# .devcarry, on a machine that already holds the SmolLM2 GGUF (a session's first piece: a call
# per part before it, carrying .devcarry_part1, then .devcarry_part2, ... and running
# `bash scripts/gpu_stash.sh`, back to back; the last part may travel with the piece, which
# gpu_env.sh stashes; `bash scripts/build_carry.sh gguf` makes the parts):
#
#   bash scripts/gpu_relufy_call.sh                                  # the default rows, in order
#   bash scripts/gpu_relufy_call.sh --rows dense_relu,silu_control   # any relufy_study.py options
#   bash scripts/gpu_relufy_call.sh trainer.compile_scope=layers     # and Hydra overrides
#
# Environment (defaults): MAX_WALL (540: the study's --max-wall; the call's 600 s less the set-up
# and the packing).
#
# The study's --out is outputs/relufy_out/study (git-ignored; a machine called again within 30 s
# keeps it), started from docs/relufy/study (the rows of earlier calls, merged there; it travels
# with the working tree) when absent; --work (checkpoints, the converted source) is
# /tmp/relufy_work, so a row a call stopped resumes on a warm machine. The study folder and the
# logs come back as one file, $OUT/relufy_study.tar.gz: a call returns at most 8 files and
# nothing more than 2 folders below $OUT, and a row's files sit in rows/<row>/. To merge:
#   A=relufy_study.tar.gz; test -s $A && rm -rf docs/relufy/study && tar -xzf $A -C docs/relufy
#   (the study folder replaced by the call's, which started from it; logs/ gains the call's)
#   python scripts/relufy_report.py docs/relufy/study --doc docs/relufy.md
# Exit code: the study's.
set -uo pipefail
OUT=${OUT:?set OUT (the device call sets it)}
MAX_WALL=${MAX_WALL:-540}
. scripts/gpu_env.sh || exit 1
RES=outputs/relufy_out
mkdir -p "$RES/logs"
if [ ! -d "$RES/study" ] && [ -d docs/relufy/study ]; then
  cp -r docs/relufy/study "$RES/study"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$RES/logs/gpu.txt" 2>&1
echo "${COMMIT:-$(git log -1 --format=%H 2>/dev/null || echo unknown)}" > "$RES/logs/commit.txt"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
timeout $((${MAX_WALL%.*} + 30)) python3 scripts/relufy_study.py --out "$RES/study" \
  --work /tmp/relufy_work --max-wall "$MAX_WALL" "$@" 2>&1 | tee "$RES/logs/piece_$stamp.log"
rc=${PIPESTATUS[0]}
tar -czf "$OUT/relufy_study.tar.gz" -C "$RES" study logs
echo "gpu_relufy_call: rc $rc; $RES/study and the logs packed into $OUT/relufy_study.tar.gz"
exit "$rc"
