#!/usr/bin/env bash
# On the GPU machine, from the repository root: keep the file parts this call carries
# (.devcarry_part*/, made here by `bash scripts/build_carry.sh gguf`) in $TWELL_STASH
# (/tmp/twell_stash), one folder per split (the file's SHA256, the part count and size), and
# once every part of the manifest is there, assemble the file under $TWELL_CACHE (/tmp/twc,
# where scripts/gpu_env.sh unpacks the cache) and check its SHA256. A file too large for one
# call's 64 MiB travels in parts over calls made back to back (the machine keeps /tmp only
# while warm: 30 s after a call).
# scripts/gpu_env.sh runs this too.
#
#   bash scripts/gpu_stash.sh     # exit 0: stored (and assembled when complete); 1: a bad part
set -euo pipefail
STASH=${TWELL_STASH:-/tmp/twell_stash}
CACHE=${TWELL_CACHE:-/tmp/twc}

field() { awk -v k="$1" '$1 == k {print $2}' "$2"; }
valid_manifest() {  # name, sha256, parts and split present and sane
  local m=$1 name sha parts split
  name=$(field name "$m"); sha=$(field sha256 "$m"); parts=$(field parts "$m")
  split=$(field split "$m")
  [ -n "$name" ] && [[ $sha =~ ^[0-9a-f]{64}$ ]] && [[ $parts =~ ^[1-9][0-9]*$ ]] &&
    [[ $split =~ ^[1-9][0-9]*$ ]] && [[ $name != /* && $name != *..* ]]
}
check_manifest() {  # a carried part's manifest: a bad one stops the call
  valid_manifest "$1" || {
    echo "gpu_stash: $1 is not a manifest of build_carry.sh gguf (name, sha256, parts, split); rebuild the parts" >&2
    exit 1; }
}

mkdir -p "$STASH"
for d in .devcarry_part*/; do
  [ -d "$d" ] || continue
  check_manifest "${d}manifest"
  # one folder per split: the same file split at another size is another folder, never mixed
  s="$STASH/$(field sha256 "${d}manifest")-$(field parts "${d}manifest")x$(field split "${d}manifest")"
  for o in "$STASH"/*/; do  # another split of the same file is dropped: the last carried wins
    if [ "${o%/}" != "$s" ] && [ -f "${o}manifest" ] &&
       [ "$(field name "${o}manifest")" = "$(field name "${d}manifest")" ]; then
      echo "gpu_stash: dropped another split of $(field name "${d}manifest") in $o (this call carries ${s##*/})"
      rm -rf "$o"
    fi
  done
  mkdir -p "$s" && cp "${d}manifest" "${d}"part.* "$s"/
done
done_any=0
for s in "$STASH"/*/; do
  [ -f "${s}manifest" ] || continue
  if ! valid_manifest "${s}manifest"; then  # e.g. a stash of an older gpu_stash.sh
    echo "gpu_stash: dropped $s (its manifest is not this script's: a stash of an older gpu_stash.sh?)"
    rm -rf "$s"; continue
  fi
  name=$(field name "${s}manifest"); sha=$(field sha256 "${s}manifest")
  parts=$(field parts "${s}manifest")
  target="$CACHE/$name"
  done_any=1
  if [ -f "$target" ] && [ "$(sha256sum "$target" | cut -d' ' -f1)" = "$sha" ]; then
    echo "gpu_stash: $target in place"; continue
  fi
  files=(); have=0
  for ((i = 0; i < parts; i++)); do
    f="${s}part.$(printf %02d "$i")"
    files+=("$f"); [ -f "$f" ] && have=$((have + 1))
  done
  if [ "$have" -lt "$parts" ]; then
    echo "gpu_stash: $have of $parts parts of $name in $s; carry the others within 30 s"
    continue
  fi
  mkdir -p "$(dirname "$target")"
  cat "${files[@]}" > "$target.tmp"
  got=$(sha256sum "$target.tmp" | cut -d' ' -f1)
  if [ "$got" != "$sha" ]; then
    rm -f "$target.tmp"; rm -rf "$s"
    echo "gpu_stash: $name assembled from $parts parts has SHA256 $got, not $sha; rebuild the parts (scripts/build_carry.sh gguf) and carry them again" >&2
    exit 1
  fi
  mv "$target.tmp" "$target"
  echo "gpu_stash: $target assembled from $parts parts (sha256 ok)"
done
[ "$done_any" = 1 ] || echo "gpu_stash: no part carried or stashed"
