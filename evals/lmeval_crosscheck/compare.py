"""Compare our scorer with lm-eval on the cross-check outputs; print a markdown table.

    python evals/lmeval_crosscheck/compare.py OUT [--md OUT/compare.md]

Reads ``OUT/ours/<task>.json`` and ``OUT/lmeval/<task>.json`` (run_ours.py, run_lmeval.py),
matches items by row index (lm-eval ``doc_id``), and reports per task: n, acc and acc_norm
of both, their difference in points, and the largest per-choice log-likelihood difference.
Exits 1 if a task's accuracies differ by more than 0.5 points.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from evals.tasks import ALL_TASKS


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--md", default=None)
    ap.add_argument("--tol-points", type=float, default=0.5)
    a = ap.parse_args()
    out = Path(a.out)
    lines = [("| task | n | acc ours | acc lm-eval | acc_norm ours | acc_norm lm-eval | "
              "max abs diff (pts) | max |Δ loglik| | same preds |"),
             "|---|---|---|---|---|---|---|---|---|"]
    bad = False
    for t in ALL_TASKS:
        po, pl = out / "ours" / f"{t}.json", out / "lmeval" / f"{t}.json"
        if not (po.exists() and pl.exists()):
            continue
        o = json.loads(po.read_text())["tasks"][t]
        lm = json.loads(pl.read_text())
        ls = {s["doc_id"]: s for s in lm["samples"]}
        dmax, same, common = 0.0, 0, 0
        for s in o["samples"]:
            x = ls.get(s["row"])
            if x is None:
                continue
            common += 1
            dmax = max(dmax, max(abs(p - q) for p, q in zip(s["lls"], x["lls"], strict=True)))
            same += int(max(range(len(s["lls"])), key=lambda i: (s["lls"][i], -i))
                        == max(range(len(x["lls"])), key=lambda i: (x["lls"][i], -i)))
        has_norm = lm["acc_norm"] is not None  # lm-eval's winogrande reports acc only
        accn_l = lm["acc_norm"] if has_norm else float("nan")
        accn_o = o["acc_norm"] if has_norm else float("nan")
        diff = 100 * max(abs(o["acc"] - lm["acc"]), abs(accn_o - accn_l) if has_norm else 0.0)
        bad |= diff > a.tol_points or o["n"] != lm["n"]
        lines.append(
            f"| {t} | {o['n']}/{lm['n']} | {100 * o['acc']:.2f} | {100 * lm['acc']:.2f} | "
            f"{100 * accn_o:.2f} | {100 * accn_l:.2f} | {diff:.2f} | {dmax:.2e} | "
            f"{same}/{common} |")
    text = "\n".join(lines)
    print(text)
    if a.md:
        Path(a.md).write_text(text + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
