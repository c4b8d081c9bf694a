"""Check, then time, the TwELL inference FFN against dense cuBLAS (one GPU).

    python scripts/bench_ffn.py            # quick set (default, ~2-3 min on an H200)
    python scripts/bench_ffn.py --full     # adds M=131072 and more shapes
    python scripts/bench_ffn.py --acts acts.safetensors   # also recorded layers (twell.nn.record)
    OUT=/some/dir python scripts/bench_ffn.py    # also writes CSVs there
    TRITON_INTERPRET=1 python scripts/bench_ffn.py --smoke   # CPU: tiny sizes, exercises the code only

Shape legend: M tokens, D model width, H FFN width.

Variants (see VARIANTS): ``twell`` (the library defaults: cuBLAS gate + pack on one warp per row
+ consumer at nb 4 on 4 warps), factor 4, a consumer launch shape, and launch-shape sweeps of
the pack and the consumer alone (``part_pack_*``, ``part_consumer_*``, at 0.3 / 1 % i.i.d.).
Superseded kernels (pack v1 / v2 / v4, consumer v1, the fused gate GEMM + pack) are deleted (their
code is at git commit 629013a); the summary ends with the defaults' speedup against the one
recorded in BENCHMARKS.md (:data:`RECORDED_SPEEDUP`).

Phase 1 (correctness, every variant, GPU): each variant (factor 8/4 x gated / non-gated,
launch shapes) over the
shape sweep M in {1,7,128,300,4096}, D in {64,576,2048}, H in {256,1408,5632,8192}
(full product for the default variant, a subset for the others), relative
error against an fp32 dense reference next to the dense bf16 path's error;
PASS needs ours <= 1.5x dense + 1e-3 and exact non-zero counts.
Phase 2 (speed): median (20%/80% quantiles) of ``triton.testing.do_bench`` for
dense (torch bf16: gate, up, relu*mul, down), TwELL, auto,
and the parts (gate GEMM, pack, consumer), at densities
0.1/0.3/1/3/10 %, i.i.d. and heavy-tailed rows (max non-zeros per row >= 10x
the mean below 3 % density). Inputs: x[:, 0] is a constant feature, its gate
weight -1, so the row's threshold x[r, 0] sets the ReLU density.
A variant that fails to compile or is wrong is reported in the table, never
stops the script. The last lines printed are the summary table. A thin driver over
``studies.kernel_bench.infer``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from studies.kernel_bench.infer import (
    ON_GPU,
    phase_check,
    phase_speed,
    print_check_summary,
    print_speed_summary,
    write_csv,
)
from twell.policy import FFNPolicy


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring), with ``policy``: auto's ``FFNPolicy``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="add M=131072 and more shapes")
    ap.add_argument("--quick", action="store_true", help="the default set (kept for clarity)")
    ap.add_argument("--acts", default=None, help="comma-separated recorded layers (.safetensors "
                    "of twell.nn.record, from scripts/record_acts.py)")
    ap.add_argument("--densities", default=None,
                    help="with --main-only: the i.i.d. densities (comma-separated fractions)")
    ap.add_argument("--no-check", action="store_true", help="skip phase 1")
    ap.add_argument("--check-only", action="store_true", help="skip phase 2")
    ap.add_argument("--main-only", action="store_true",
                    help="phase 2 at M=16384, H=5632 gated, i.i.d. 0.1 / 0.3 / 1 %% only")
    ap.add_argument("--no-sweep", dest="sweep_consumer", action="store_false",
                    help="skip the consumer launch-shape sweep")
    ap.add_argument("--threshold", type=float, default=None,
                    help="auto's density threshold (FFNPolicy.infer_density_threshold; default: "
                         "the policy's, or $TWELL_AUTO_DENSITY)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpreter code check)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    # auto's policy: the defaults, the TWELL_* environment overrides (FFNPolicy.from_env), then
    # --threshold
    args.policy = FFNPolicy.from_env()
    if args.threshold is not None:
        args.policy.infer_density_threshold = args.threshold
    return args


def main():
    """Phase 1, phase 2, then the summary tables (printed last) and the CSVs to ``$OUT``."""
    args = parse_args()
    print(f"auto policy: {args.policy}")
    if not ON_GPU and not args.smoke:
        sys.exit("no CUDA device: run on a GPU, or pass --smoke with TRITON_INTERPRET=1 for a code check")
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    out_dir = os.environ.get("OUT")
    t_start = time.time()
    if ON_GPU:
        import triton
        print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")

    checks = [] if args.no_check else phase_check(args)
    if checks:
        print(f"phase 1 (correctness): {time.time() - t_start:.0f}s")
        if out_dir:
            write_csv(os.path.join(out_dir, "check_ffn.csv"), checks)
    speed = [] if args.check_only else phase_speed(args)
    if speed and out_dir:
        write_csv(os.path.join(out_dir, "bench_ffn.csv"), speed)

    # ---- summary (printed last)
    if checks:
        print_check_summary(checks)
    if speed:
        print_speed_summary(speed)
    n_bad = sum(1 for r in checks if r["status"] != "PASS") + sum(
        1 for r in speed if r.get("status") not in ("ok",))
    print(f"\ntotal {time.time() - t_start:.0f}s; {n_bad} failed/erroring entries; CSV: "
          f"{out_dir or '(set OUT to write)'}")


if __name__ == "__main__":
    main()
