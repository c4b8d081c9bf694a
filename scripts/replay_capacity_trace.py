"""Replay a whole-model benchmark's capacity trace (``capacity_trace.csv``: per sparse row,
step and layer, the heavy rows and the no-sync capacity they ran with) under each
``ffn.backup_capacity`` rule through :func:`studies.capacity_sim.replay` (CPU, seconds): would
the rule have overflowed on these real counts, at what capacity? A thin driver over
:mod:`studies.bench.capacity_trace`.

    python scripts/replay_capacity_trace.py docs/model_bench/capacity_trace.csv
    python scripts/replay_capacity_trace.py out/capacity_trace.csv --ell-layers-only

One line per benchmark row and rule: the rule the row ran, its timed steps and overflowed
layer-steps (redos and forward reruns), and the replay's redone steps per 100 timed steps, mean
capacity and spare rows per step (the replay starts from an empty history and resting margins,
as the row after ``reset_capacities``, except that the row kept its adaptive margins). Rows
whose calls are not whole 2048-token sequences (``--smoke``'s) are named and skipped.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from studies.bench.capacity_trace import read_trace, replay_trace, row_keys, trace_from_rows
from twell.nn.capacity import CAPACITY_RULES


def main(argv: Sequence[str] | None = None) -> int:
    """Print the replay of every row of the CSV under each capacity rule; 0 (2: the file
    could not be read, one line on stderr)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv", type=Path)
    p.add_argument("--ell-layers-only", action="store_true",
                   help="replay only the layers that ran on ell in some step (auto rows)")
    a = p.parse_args(argv)
    try:
        rows = read_trace(a.csv)
        keys = row_keys(rows)
    except (OSError, ValueError) as e:
        print(f"replay_capacity_trace: {e}", file=sys.stderr)
        return 2
    print("size | budget_gb | path | ran | timed_steps | overflows | rule | redo_per_100 | "
          "mean_cap | spare_rows")
    if not keys:
        print(f"(no sparse benchmark row in {a.csv})")
    for size, budget, path in keys:
        try:
            got = trace_from_rows(rows, size=size, budget_gb=budget, path=path,
                                  ell_layers_only=a.ell_layers_only, source=a.csv)
        except ValueError as e:
            print(f"{size} | {budget:g} | {path} | not replayed: {e}")
            continue
        if got.warm >= len(got.trace):
            print(f"{size} | {budget:g} | {path} | not replayed: no timed step")
            continue
        for rule in CAPACITY_RULES:
            r = replay_trace(got, rule)
            print(f"{size} | {budget:g} | {path} | {got.rule} | {r.steps} | {got.overflows} | "
                  f"{rule} | {r.redo_per_100:.1f} | {r.mean_cap:.1f} | {r.spare_rows:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
