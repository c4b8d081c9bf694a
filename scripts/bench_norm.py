"""The trainer's RMSNorm against Liger-Kernel's and a cast, its backward's launches, and the fused
residual add and norm against the add and the norm apart (one GPU, ~10 s a shape;
``studies.kernel_bench.norm`` has the rows and the checks).

    python scripts/bench_norm.py --shapes 32768x2048,16384x576 --out "$OUT"

Writes ``norm.csv`` (columns ``norm.COLUMNS``) under ``--out`` and prints a table per shape last:
Liger's forward and backward, ours, the default backward launch and the five fastest others,
then the fused add's forward and backward against the unfused sequence's.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

from studies.kernel_bench.norm import COLUMNS, norm_case, summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32768x2048,16384x2048,16384x576",
                    help="comma-separated NxD residual-stream shapes")
    ap.add_argument("--out", type=Path, default=Path("outputs/kernel_bench"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_norm.py needs a CUDA GPU and Liger-Kernel")
    try:
        shapes = [(int(n), int(d)) for n, d in (s.split("x") for s in a.shapes.split(","))]
    except ValueError:
        sys.exit(f"--shapes: expected NxD pairs like 32768x2048, got {a.shapes!r}")
    rows = [r for n, d in shapes for r in norm_case(n, d)]
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / "norm.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
