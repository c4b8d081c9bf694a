"""Benchmark the sparse training FFN (hybrid ELL + dense backup) against dense cuBLAS on one GPU.

    python scripts/bench_ffn_train.py                 # parts + full run (~3 min on an H200)
    python scripts/bench_ffn_train.py --quick         # fewer repetitions
    python scripts/bench_ffn_train.py --parts-only    # per-kernel launch shapes only (~1 min)
    OUT=/some/dir python scripts/bench_ffn_train.py   # also writes $OUT/bench_ffn_train.csv
    python scripts/bench_ffn_train.py --stack 8       # + 8 layers in sequence: sync vs no-sync
    python scripts/bench_ffn_train.py --acts a.safetensors,b.safetensors --acts-iid --dists ''  # recorded layers
                                      # (twell.nn.record files) + i.i.d. at their density

One FFN forward + backward (y, dx, dWg, dWu, dWd; the L1 term in the loss), M = 16384 tokens,
D = 2048, H = 5632, bf16, for densities 0.3 / 1 / 3 / 10 % of active units, i.i.d. and
heavy-tailed (``studies.kernel_bench.cases.iid_case`` and ``heavy_case``: the paper's calibration
construction,
x[:, 0] = 1 and a negative gate weight Wg[:, 0] = -t_j as unit j's ReLU threshold, t solved for
the target mean density; heavy-tailed: log-normal token scales and unit thresholds).

For every case it first CHECKS correctness on the GPU (relative Frobenius error of y and each
gradient against fp32 autograd of the dense reference, next to the dense bf16 path's own error;
stats against the dense bf16 path), then TIMES (median of triton.testing.do_bench, 20/80%
quantiles) and measures PEAK EXTRA MEMORY (torch.cuda.max_memory_allocated above what was
allocated before the step, grads of the step included). A failing variant is reported, not
raised. Variants (named by the training paths, ``twell.nn.plan.TRAIN_PATHS``):

    torch       torch bf16 gate / up / relu*mul / down with autograd, no L1 (the baseline)
    torch_stats the trainer's torch path: the same plus the L1 term and activation statistics
    dense       dense mode, dense_ffn_train (ffn_impl=auto above its threshold): cuBLAS + one
                fused elementwise pass each way, statistics and the L1 term included
    ell         sparse_ffn_train with its default policy and the current default kernels
                (ELL capacity 128, dense backup; twell.ops.launch)
    ell_wide    sparse_ffn_train forced through the ELL part (capacity >= the widest row), to
                show the raw sparse kernels at every density
    auto        the trainer's ffn_impl=auto rule on the case's L0 and heavy-row fraction:
                ell_nosync or dense
    ell_nosync  ell with no host sync: dense-backup capacity from the first call's heavy-row
                count x 1.25 + 16 (the trainer's ffn.host_sync=step)
    ell_dwo*    ell with the dW grid's D slice outermost, slices of 1024 / 512 / 256

Superseded kernels (compaction v1-v3, the first SpMM and dW kernels, the CSC sort after the host
wait) are deleted; their numbers are in BENCHMARKS.md (code at git commit 629013a; the second dW
kernel at 8109721), and the
summary ends with ``ell``'s speedup against the one recorded there (:data:`RECORDED_SPEEDUP`).

PARTS (before the full runs, i.i.d. 0.3 % and 1 %, heavy 0.3 %): every Triton kernel of the
ell path timed alone at several launch shapes, on the same ELL state; each output is first
checked against the PyTorch backend in fp32 (compaction: exact equality). Columns: ms, speedup
over the default shape (the first row of each kernel), effective TB/s of gathered rows.

Targets: ell >= 2.5x torch at 0.3 %, >= 1.5x at 1 %, >= 0.95x at 3 % and 10 %; peak extra
memory <= 0.5x torch at <= 1 %.

Measured numbers and their history: BENCHMARKS.md, "Training FFN". A thin driver over
``studies.kernel_bench.train``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from studies.kernel_bench.train import (
    COLS,
    PART_SHAPES,
    bench_case,
    case_list,
    case_tensors,
    print_summary,
    run_parts,
    write_rows,
)
from twell.policy import FFNPolicy


def parse_args():
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="N, token rows (default 16384)")
    ap.add_argument("--d", type=int, default=2048, help="D, model width (default 2048)")
    ap.add_argument("--h", type=int, default=5632, help="H, FFN width (default 5632)")
    ap.add_argument("--densities", default="0.003,0.01,0.03,0.1",
                    help="comma-separated fractions of active units (default 0.003,0.01,0.03,0.1)")
    ap.add_argument("--dists", default="iid,heavy", help="iid and/or heavy (comma-separated)")
    ap.add_argument("--variants", default="torch,ell,ell_wide",
                    help="comma-separated, of: torch, torch_stats, dense, ell, ell_wide, "
                         "ell_nosync, ell_dwo1024 / 512 / 256, auto (the module docstring says "
                         "what each runs)")
    ap.add_argument("--parts", default="iid:0.003,iid:0.01,heavy:0.003",
                    help="dist:density cases of the per-kernel table ('' = none)")
    ap.add_argument("--parts-only", action="store_true", help="only the per-kernel table")
    ap.add_argument("--part-kernels", default="",
                    help=f"the kernels of the parts table (default all: {','.join(PART_SHAPES)})")
    ap.add_argument("--acts", default="",
                    help="comma-separated recorded layers (twell.nn.record .safetensors), "
                         "timed with their own shape after the synthetic cases")
    ap.add_argument("--acts-iid", action="store_true",
                    help="with --acts: also an i.i.d. case at each recorded layer's mean density "
                         "and shape (the target: recorded >= i.i.d. speedup)")
    ap.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    ap.add_argument("--stack", type=int, default=0,
                    help="also time this many FFN layers in sequence (torch / per-call sync / "
                         "no-sync) per case")
    ap.add_argument("--profile", action="store_true",
                    help="print a torch.profiler kernel table of the ell step per case, no timing")
    ap.add_argument("--trace", default=None,
                    help="with --profile: also write a Chrome trace (JSON) to this path")
    a = ap.parse_args()
    bad = sorted(set(filter(None, a.part_kernels.split(","))) - set(PART_SHAPES))
    if bad:
        ap.error(f"--part-kernels: unknown {bad}; known: {','.join(PART_SHAPES)}")
    return a


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_ffn_train.py needs a CUDA GPU")
    import triton

    torch.set_grad_enabled(True)
    # variant "auto": the trainer's rule under the default policy with the TWELL_* overrides
    policy = FFNPolicy.from_env()
    print(f"# auto policy: {policy}")
    n, d, h = args.tokens, args.d, args.h
    rep = 40 if args.quick else 100
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{triton.__version__}  N={n} D={d} H={h} bf16", flush=True)
    t_start = time.time()
    run_parts(args, n, d, h, rep)
    if args.parts_only:
        return
    rows, stack_rows = [], []
    for dist, dens, src in case_list(args):
        ts = case_tensors(dist, dens, src, n, d, h)
        n, d, h = ts[0].shape[0], ts[0].shape[1], ts[1].shape[0]
        case_rows, stack_row = bench_case(args, policy, dist, dens, ts, rep)
        rows += case_rows
        stack_rows += [stack_row] if stack_row else []
        del ts
    print(f"# total {time.time() - t_start:.0f} s")
    print_summary(rows, stack_rows, (n, d, h))
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "bench_ffn_train.csv"
        write_rows(path, rows, first=COLS)
        print(f"# wrote {path}")


if __name__ == "__main__":
    main()
