"""Offline evaluation of the no-sync dense-backup capacity rules (``ffn.backup_capacity``)
on synthetic heavy-row traces that mimic a framework-trained 1.5B model (CPU, seconds): a thin
driver over :mod:`studies.capacity_sim` (the traces and the replay through ``FFNPlan``).

    python scripts/capacity_policy_sim.py                 # all scenarios, 3 seeds
    python scripts/capacity_policy_sim.py --steps 5000 --seeds 5 --csv out.csv

Per scenario, micro-batches per step and rule it prints the steady state (after ``--warm``
steps: redone steps per 100, mean capacity, spare rows, cost in % of the steps), fresh starts
(``--fresh`` steps from an empty history, as a benchmark's first steps: redone steps per 10,
mean capacity and cost in % of the steps) and
a micro-batch change from 8 to 16 sequences (redone steps per 100 over the 100 steps after it,
and layer-steps measured per call, with the histories scaled or forgotten).
"""

from __future__ import annotations

import argparse
import csv
import sys

import numpy as np

from studies.capacity_sim import SCENARIOS, make_trace, replay
from twell.nn.capacity import CAPACITY_RULES


def rows_for(scen: str, accum: int, rule: str, a) -> dict:
    steady = [replay(make_trace(scen, a.steps, accum, seed), rule, a.warm)
              for seed in range(a.seeds)]
    fresh = []
    for seed in range(a.seeds):
        trace = make_trace(scen, a.steps, accum, seed)
        fresh += [replay(trace[s:s + a.fresh], rule, warm=0)
                  for s in range(a.warm, a.steps - a.fresh + 1, a.fresh)]
    at = a.steps // 2
    change = {True: [], False: []}
    for seed in range(a.seeds):
        both = np.concatenate([make_trace(scen, a.steps, accum, seed)[:at],
                               make_trace(scen, a.steps, accum, seed, sequences=16)[at:]])
        for scale in (True, False):
            change[scale].append(replay(both[:at + 100], rule, warm=at, change=(at, 16),
                                        rescale=scale))
    return {
        "scenario": scen, "accum": accum, "rule": rule,
        "redo_per_100": round(float(np.mean([r.redo_per_100 for r in steady])), 3),
        "redo_worst_seed": round(max(r.redo_per_100 for r in steady), 3),
        "mean_cap_rows": round(float(np.mean([r.mean_cap for r in steady])), 1),
        "spare_rows": round(float(np.mean([r.spare_rows for r in steady])), 1),
        "cost_pct_of_step": round(float(np.mean([r.cost_pct for r in steady])), 3),
        "fresh_redo_per_10": round(float(np.mean([r.redo_per_100 for r in fresh])) / 10, 3),
        "fresh_mean_cap_rows": round(float(np.mean([r.mean_cap for r in fresh])), 1),
        "fresh_cost_pct": round(float(np.mean([r.cost_pct for r in fresh])), 3),
        "change_redo_per_100_scaled": round(float(np.mean([r.redo_per_100 for r in change[True]])), 3),
        "change_redo_per_100_forgot": round(float(np.mean([r.redo_per_100 for r in change[False]])), 3),
        "change_measured_forgot": round(float(np.mean([r.measured_layer_steps
                                                       for r in change[False]])), 3),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warm", type=int, default=200, help="steps before the steady state")
    p.add_argument("--fresh", type=int, default=20, help="steps of each fresh start")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--accum", type=int, nargs="+", default=[1, 8],
                   help="micro-batches per optimizer step (and per GPU)")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--csv", default=None, help="write the rows here too")
    a = p.parse_args(argv)
    rows = [rows_for(scen, accum, rule, a) for scen in a.scenarios for accum in a.accum
            for rule in CAPACITY_RULES]
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
