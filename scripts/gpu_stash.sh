#!/usr/bin/env bash
# On the GPU machine, from the repository root: keep the file parts this call carries
# (.devcarry_part*/, made here by `bash scripts/build_carry.sh gguf`) in $TWELL_STASH
# (/tmp/twell_stash), and once every part of the manifest is there, assemble the file under
# $TWELL_CACHE (/tmp/twc, where scripts/gpu_env.sh unpacks the cache) and check its SHA256.
# A file too large for one call's 64 MiB travels in parts over calls made back to back (the
# machine keeps /tmp only while warm: 30 s after a call). scripts/gpu_env.sh runs this too.
#
#   bash scripts/gpu_stash.sh     # exit 0: stored (and assembled when complete); 1: a bad part
set -euo pipefail
STASH=${TWELL_STASH:-/tmp/twell_stash}
CACHE=${TWELL_CACHE:-/tmp/twc}
mkdir -p "$STASH"
for d in .devcarry_part*/; do
  [ -d "$d" ] || continue
  cp "$d"manifest "$d"part.* "$STASH"/
done
[ -f "$STASH/manifest" ] || { echo "gpu_stash: no part carried or stashed"; exit 0; }
name=$(awk '$1 == "name" {print $2}' "$STASH/manifest")
sha=$(awk '$1 == "sha256" {print $2}' "$STASH/manifest")
parts=$(awk '$1 == "parts" {print $2}' "$STASH/manifest")
target="$CACHE/$name"
if [ -f "$target" ] && [ "$(sha256sum "$target" | cut -d' ' -f1)" = "$sha" ]; then
  echo "gpu_stash: $target in place"; exit 0
fi
have=$(find "$STASH" -maxdepth 1 -name 'part.*' | wc -l)
if [ "$have" -lt "$parts" ]; then
  echo "gpu_stash: $have of $parts parts of $name in $STASH; carry the next within 30 s"
  exit 0
fi
mkdir -p "$(dirname "$target")"
cat "$STASH"/part.* > "$target.tmp"
got=$(sha256sum "$target.tmp" | cut -d' ' -f1)
if [ "$got" != "$sha" ]; then
  rm -f "$target.tmp"
  echo "gpu_stash: $name assembled from $have parts has SHA256 $got, not $sha; rebuild the parts (scripts/build_carry.sh gguf) and carry them again" >&2
  exit 1
fi
mv "$target.tmp" "$target"
echo "gpu_stash: $target assembled from $parts parts (sha256 ok)"
