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
heavy-tailed (``twell.bench.iid_case`` and ``heavy_case``: the paper's calibration construction,
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
                count x 1.25 + 16 (the trainer's model.ffn_host_sync=step)
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

Measured numbers and their history: BENCHMARKS.md, "Training FFN".
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from twell.bench import heavy_case, iid_case, recorded_case, rel_err
from twell.nn.record import active_counts_of
from twell.ops.ffn_dense_train import dense_ffn_train
from twell.ops.ffn_train import backup_capacity_for, sparse_ffn_train
from twell.ops.launch import kernel_config
from twell.ops.reference import gated_ffn_torch
from twell.ops.reference import sparse_train_torch as rt
from twell.ops.train_backend import triton_backend
from twell.policy import FFNPolicy
from twell.stats import default_ell_capacity

L1_COEFF_PER_TOKEN = 0.2  # loss = sum(y*dy) + c*l1 with c = 0.2 N: L1 grad comparable to dy's
CASES = {"iid": iid_case, "heavy": heavy_case}  # --dists


def make_case(n, d, h, density, dist, seed=0, device="cuda"):
    """bf16 (x, wg, wu, wd, dy) of ``twell.bench``'s ``dist`` case at the target mean density."""
    c = CASES[dist](n, d, h, density, seed=seed, device=device)
    return [c.x, c.wg, c.wu, c.wd, c.dy]


# Kernel configs per variant (on top of the library defaults); every "ell*" variant runs the
# default policy (ELL capacity 128 + dense backup) except ell_wide.
VARIANT_CFG = {
    # dW grid with the D slice outermost (a slice of x and dy at a time in L2)
    "ell_dwo1024": {"dw_d_outer": 1, "dw_block_d": 1024, "dw_warps": 4},
    "ell_dwo512": {"dw_d_outer": 1, "dw_block_d": 512, "dw_warps": 2},
    "ell_dwo256": {"dw_d_outer": 1, "dw_block_d": 256, "dw_warps": 1},
}
# ``ell``'s speedup over torch fwd+bwd recorded with the current default kernels (BENCHMARKS.md,
# "Training FFN"; N 16384, D 2048, H 5632): the summary prints this run's against it.
RECORDED_SPEEDUP = {("iid", 0.003): 1.86, ("iid", 0.01): 1.01, ("iid", 0.03): 0.93,
                    ("iid", 0.1): 0.90, ("heavy", 0.003): 1.48, ("heavy", 0.01): 1.32,
                    ("heavy", 0.03): 1.20, ("heavy", 0.1): 0.87}
# the summary table's columns (the CSV has these first, then the rest)
COLS = ["dist", "density", "l0", "nnz_max", "heavy_frac", "variant", "fwd_ms", "full_ms",
        "speedup", "peak_extra_mb", "mem_vs_torch", "status"]


def load_acts(path, seed=0, device="cuda"):
    """A recorded layer (``twell.bench.recorded_case``: x (N, D), w_gate, w_up (H, D), w_down
    (D, H), a seeded random upstream gradient dy) as bf16 (x, wg, wu, wd, dy), and its mean
    density (fraction of relu(x Wg^T) > 0)."""
    c = recorded_case(path, seed=seed, device=device)
    ts = [t.to(device, torch.bfloat16).contiguous() for t in (c.x, c.wg, c.wu, c.wd, c.dy)]
    nnz, _ = active_counts_of(ts[0], ts[1])
    return ts, int(nnz.sum()) / (ts[0].shape[0] * ts[1].shape[0])


def step_fn(variant, x, wg, wu, wd, dy, ell_cap):
    """Returns a closure running one forward + backward and returning (y, grads, stats)."""
    ins = [t.detach().clone().requires_grad_() for t in (x, wg, wu, wd)]
    c = L1_COEFF_PER_TOKEN * x.shape[0]
    cfg = VARIANT_CFG.get(variant, {})

    def configured(fn):  # the variant's kernel shapes around one call
        with kernel_config(**cfg):
            return fn()

    def run():
        return configured(_run)

    def fwd():
        return configured(_fwd)

    cap = {"rows": -1}  # ell_nosync: the dense-backup capacity, set from the first call

    def _kw():
        if variant == "ell_wide":
            return {"ell_capacity": ell_cap, "dense_row_fraction": 1.0}
        if variant == "ell_nosync":
            return {"backup_rows": cap["rows"]}
        return {}

    def _note(st):
        if variant == "ell_nosync" and cap["rows"] < 0:  # as the trainer
            cap["rows"] = backup_capacity_for(st.heavy_rows.item())

    def _run():
        if variant == "torch":
            y, st = gated_ffn_torch(*ins, with_stats=False)
            outs, gouts = [y], [dy]
        elif variant == "torch_stats":  # the trainer's torch path: stats and the L1 term too
            y, st = gated_ffn_torch(*ins, with_stats=True)
            outs, gouts = [y, st.l1], [dy, torch.full_like(st.l1, c)]
        elif variant == "dense":  # dense_ffn_train: cuBLAS + fused passes, stats, L1 term
            y, st = dense_ffn_train(*ins, with_stats=True)
            outs, gouts = [y, st.l1], [dy, torch.full_like(st.l1, c)]
        else:
            y, st = sparse_ffn_train(*ins, with_stats=True, **_kw())
            _note(st)
            outs, gouts = [y, st.l1], [dy, torch.full_like(st.l1, c)]
        grads = torch.autograd.grad(outs, ins, gouts)
        return y, grads, st

    def _fwd():
        if variant in ("torch", "torch_stats"):
            return gated_ffn_torch(*ins, with_stats=variant == "torch_stats")
        if variant == "dense":
            return dense_ffn_train(*ins, with_stats=True)
        y, st = sparse_ffn_train(*ins, with_stats=True, **_kw())
        _note(st)
        return y, st

    return run, fwd


def stack_times(x, wg, wu, wd, dy, layers, rep):
    """Median ms of ``layers`` FFN layers in sequence, forward + backward (one weight set reused;
    x <- x + 1e-3 * ffn(x) keeps the density), torch vs the ell op with its per-call host sync
    vs the no-sync mode: a per-layer sync stops the host from queueing the next layers."""
    import triton.testing

    ins = [t.detach().clone().requires_grad_() for t in (x, wg, wu, wd)]
    c = L1_COEFF_PER_TOKEN * x.shape[0]
    caps = {}

    def run(kind):
        h = ins[0]
        l1 = 0.0
        for i in range(layers):
            if kind == "torch":
                y, st = gated_ffn_torch(h, *ins[1:], with_stats=False)
            else:
                rows = caps.get(i, -1) if kind == "nosync" else -1
                y, st = sparse_ffn_train(h, *ins[1:], with_stats=True, backup_rows=rows)
                if kind == "nosync" and i not in caps:
                    caps[i] = backup_capacity_for(st.heavy_rows.item())
                l1 = l1 + st.l1
            h = h + 1e-3 * y
        loss = (h * dy).sum() + (c * l1 if kind != "torch" else 0.0)
        return torch.autograd.grad(loss, ins)

    out = {}
    for kind in ("torch", "sync", "nosync"):
        run(kind)
        out[kind] = triton.testing.do_bench(lambda k=kind: run(k), warmup=10, rep=rep)
    return out


def reference_fp32(x, wg, wu, wd, dy, with_l1):
    """fp32 autograd (TF32 off) of the dense FFN: ([y, dx, dWg, dWu, dWd], stats), with the L1
    term in the loss when ``with_l1``."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ins = [t.float().requires_grad_() for t in (x, wg, wu, wd)]
    y, st = gated_ffn_torch(*ins, with_stats=True)
    outs, gouts = [y], [dy.float()]
    if with_l1:
        outs.append(st.l1)
        gouts.append(torch.full_like(st.l1, L1_COEFF_PER_TOKEN * x.shape[0]))
    grads = torch.autograd.grad(outs, ins, gouts)
    return [y.detach(), *grads], st


def peak_extra_mb(run):
    """MB allocated at the peak of one ``run()`` above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


# Per-kernel launch shapes timed in the parts table: (label, kernel_config overrides); the first
# row of each part is the current default and the ratio's base (column "vs_default" = its time /
# this row's time). Every config is spelled out.


def _cp(n, w):
    return (f"n{n} w{w}", {"compact_block_n": n, "compact_warps": w})


def _sd(k, d, w):
    return (f"k{k} d{d} w{w}", {"sddmm_block_k": k, "sddmm_block_d": d, "sddmm_warps": w})


def _dw(j, d, w):
    """A dW launch: D slice ``d`` outermost (0 = auto), ``j`` entries a step, ``w`` warps."""
    return (f"j{j} d{d or 'auto'} w{w}",
            {"dw_block_j": j, "dw_block_d": d, "dw_warps": w, "dw_d_outer": 1})


def _sp(key, k, w):
    return (f"k{k} w{w}", {key: k, "spmm_warps": w})


PART_SHAPES = {
    "compact": [_cp(1, 1), _cp(2, 1), _cp(4, 1), _cp(8, 1), _cp(2, 2)],
    "sddmm_u": [_sd(8, 256, 1), _sd(8, 256, 4), _sd(16, 256, 4), _sd(8, 256, 2), _sd(4, 256, 1),
                _sd(4, 512, 2), _sd(8, 512, 2), _sd(16, 256, 2)],
    "spmm_y": [_sp("spmm_block_k", 4, 4), _sp("spmm_block_k", 2, 4), _sp("spmm_block_k", 4, 2),
               _sp("spmm_block_k", 2, 2), _sp("spmm_block_k", 8, 4)],
    "spmm_dx": [_sp("spmm_block_k2", 2, 4), _sp("spmm_block_k2", 1, 4), _sp("spmm_block_k2", 2, 2),
                _sp("spmm_block_k2", 1, 2), _sp("spmm_block_k2", 4, 4)],
    "dw": [_dw(8, 0, 2), _dw(4, 128, 1), _dw(8, 128, 1), _dw(16, 0, 4), _dw(4, 128, 2),
           _dw(16, 128, 2), _dw(8, 64, 1), _dw(16, 64, 2), _dw(8, 256, 2), _dw(8, 256, 1),
           ("j8 d1024 w4 columns outermost",
            {"dw_block_j": 8, "dw_block_d": 1024, "dw_warps": 4, "dw_d_outer": 0})],
}


def parts(x, wg, wu, wd, dy, rep, label, kernels=()):
    """Times each Triton kernel of the ``ell`` path alone (old vs new launch shapes) on one ELL
    state built from (x, wg); checks each output first. Returns rows for the CSV."""
    import triton.testing

    n, d = x.shape
    h = wg.shape[0]
    out_rows = []
    with torch.no_grad():
        gate = x @ wg.t()
        kc = default_ell_capacity(h)  # as in the ell path: heavier rows -> dense backup
        col_r, val_r, nnz_r, cnt_r = rt.compact(gate, kc)
        nnz = torch.where(nnz_r > kc, 0, nnz_r)
        k = max(1, int(nnz.max()))
        col, gv = col_r[:, :k].contiguous(), val_r[:, :k].contiguous()
        nnz_total = int(nnz.sum())
        wdt = wd.t().contiguous()
        # SDDMM outputs from the PyTorch backend: zeros in the unused slots (the Triton SDDMM
        # leaves them undefined, and the fp32 references multiply them by a 0/1 mask)
        u, _ = rt.sddmm_fwd(x, wu, col, gv, nnz)
        scale = torch.tensor(0.2, device=x.device)
        dg, du = rt.sddmm_bwd(dy, wdt, col, gv, u, nnz, scale)
        keys = torch.where(rt.valid_slots(nnz, k), col, h).reshape(-1)
        sk, perm = torch.sort(keys, stable=True)
        colptr = torch.searchsorted(sk, torch.arange(h + 1, dtype=keys.dtype, device=x.device))
        # fp32 references from the PyTorch backend (independent code)
        ref_y = rt.spmm(torch.empty(n, d, device=x.device), wdt, None, col, gv, u, nnz)
        ref_dx = rt.spmm(torch.empty(n, d, device=x.device), wg, wu, col, dg, du, nnz)
        ref_dw = [torch.empty(h, d, device=x.device) for _ in range(3)]
        rt.dw(*ref_dw, None, x, dy, perm, colptr, dg, du, gv, u)
        print(f"## parts {label}: K={k} ELL nnz/token={nnz_total / n:.1f} "
              f"(dense-backup rows {int((nnz_r > kc).sum())})", flush=True)

        def rel(a, b):
            return (torch.linalg.vector_norm(a.float() - b.float())
                    / torch.linalg.vector_norm(b.float()).clamp_min(1e-30)).item()

        tk = triton_backend()
        row_bytes = 2 * d  # one bf16 row of D
        jobs = {
            "compact": (lambda: tk.compact(gate, kc), None, n * h * 2),
            "sddmm_u": (lambda: tk.sddmm_fwd(x, wu, col, gv, nnz)[0], u, nnz_total * row_bytes),
            "spmm_y": (lambda: tk.spmm(torch.empty_like(x), wdt, None, col, gv, u, nnz),
                       ref_y, nnz_total * row_bytes),
            "spmm_dx": (lambda: tk.spmm(torch.empty_like(x), wg, wu, col, dg, du, nnz),
                        ref_dx, 2 * nnz_total * row_bytes),
            "dw": (None, ref_dw, 2 * nnz_total * row_bytes),
        }
        dw_out = [torch.empty_like(wg) for _ in range(3)]

        def run_dw():
            tk.dw(*dw_out, None, x, dy, perm, colptr, dg, du, gv, u)
            return dw_out

        base_ms = {}
        for part, shapes in PART_SHAPES.items():
            if kernels and part not in kernels:
                continue
            fn, ref, nbytes = jobs[part]
            fn = run_dw if part == "dw" else fn
            for name, cfg in shapes:
                row = {"dist": label, "part": part, "shape": name, "status": "ok"}
                try:
                    with kernel_config(**cfg):
                        out = fn()
                        torch.cuda.synchronize()
                        if part == "compact":
                            c2, v2, nz2, ct2 = out
                            val_ok = rt.valid_slots(torch.clamp(nz2, max=kc), kc)
                            ok = (torch.equal(nz2, nnz_r) and torch.equal(ct2, cnt_r)
                                  and torch.equal(c2[val_ok], col_r[val_ok])
                                  and torch.equal(v2[val_ok], val_r[val_ok]))
                            row["err"] = "exact" if ok else "MISMATCH"
                            if not ok:
                                row["status"] = "WRONG"
                        else:
                            outs = out if isinstance(out, list) else [out]
                            if part == "sddmm_u":  # slots past nnz are undefined: compare valid
                                outs = [torch.where(rt.valid_slots(nnz, k), out, 0)]
                            refs = ref if isinstance(ref, list) else [ref]
                            e = max(rel(a, b) for a, b in zip(outs, refs))
                            row["err"] = f"{e:.1e}"
                            if not e < 1e-2:
                                row["status"] = "WRONG"
                        ms = triton.testing.do_bench(fn, warmup=10, rep=rep)
                    row["ms"] = round(ms, 4)
                    base_ms.setdefault(part, ms)
                    row["vs_default"] = round(base_ms[part] / ms, 2)
                    row["TB/s"] = round(nbytes / ms / 1e9, 2)
                except Exception as ex:  # noqa: BLE001 (report, do not crash)
                    row["status"] = f"FAILED: {type(ex).__name__}: {str(ex)[:160]}"
                    traceback.print_exc()
                print(f"   {part:8s} {name:28s} {row.get('ms', ''):>8} ms  x{row.get('vs_default', '')}"
                      f"  {row.get('TB/s', '')} TB/s  err {row.get('err', '')}  {row['status']}",
                      flush=True)
                out_rows.append(row)
    torch.cuda.empty_cache()
    return out_rows


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


def write_rows(path: Path, rows: list[dict], first=()) -> None:
    """CSV of ``rows``: the columns in ``first``, then the others, each group sorted by name."""
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in first, k))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def run_parts(args, n, d, h, rep) -> None:
    """The per-kernel table of every ``--parts`` case ($OUT/bench_ffn_train_parts.csv)."""
    t_start = time.time()
    part_rows = []
    for case in filter(None, args.parts.split(",")):
        dist, dens = case.split(":")
        x, wg, wu, wd, dy = make_case(n, d, h, float(dens), dist)
        part_rows += parts(x, wg, wu, wd, dy, max(20, rep // 2), f"{dist} {dens}",
                           tuple(filter(None, args.part_kernels.split(","))))
        del x, wg, wu, wd, dy
    print(f"# parts done at {time.time() - t_start:.0f} s", flush=True)
    out = os.environ.get("OUT")
    if out and part_rows:
        write_rows(Path(out) / "bench_ffn_train_parts.csv", part_rows)


def case_list(args) -> list[tuple[str, float, str | None]]:
    """(dist, density, source) of every case: the synthetic ones (source None), then each
    recorded layer (its path) and, with --acts-iid, an i.i.d. case of its shape and density
    (source ``iid-like:<path>``). A recorded layer that does not load is skipped with a line."""
    cases = [(dist, dens, None) for dist in filter(None, args.dists.split(","))
             for dens in (float(v) for v in args.densities.split(","))]
    for path in filter(None, args.acts.split(",")):
        try:
            _, dens = load_acts(path)
        except Exception as e:  # noqa: BLE001 (report, do not crash)
            print(f"--acts {path}: {type(e).__name__}: {e}; skipped", flush=True)
            continue
        cases.append((f"acts:{Path(path).stem}", round(dens, 5), path))
        if args.acts_iid:
            cases.append(("iid", round(dens, 5), f"iid-like:{path}"))
    return cases


def case_tensors(dist, dens, src, n, d, h):
    """bf16 (x, wg, wu, wd, dy) of one :func:`case_list` entry."""
    if src is None:
        return make_case(n, d, h, dens, dist)
    if src.startswith("iid-like:"):  # the recorded layer's shape, i.i.d. rows
        (xa, *_), _ = load_acts(src.split(":", 1)[1])
        return make_case(xa.shape[0], xa.shape[1], h, dens, "iid")
    return load_acts(src)[0]


def profile_case(args, ts, dist, dens, ell_cap) -> None:
    """A torch.profiler kernel table of 5 steps of the first ell* variant (and a trace)."""
    from torch.profiler import ProfilerActivity, profile

    pv = next(v for v in args.variants.split(",") if v.startswith("ell"))
    run = step_fn(pv, *ts, ell_cap)[0]
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    print(f"## profile {pv} {dist} {dens} (5 steps)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22,
                                    max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print(f"# chrome trace: {args.trace}")


def check_row(row, run_as, ts, ell_cap, refs, st_ref, st_bf) -> None:
    """Run ``run_as`` once: its errors against fp32 into ``row`` (``err_*``); for every variant
    but the torch baseline also the bound (3x the bf16 torch path's error + 5e-3 per output),
    the L1 term's error and the non-zero count against the bf16 dense statistics (``status``
    WRONG:<outputs> when one is off)."""
    ref_l1, ref_no = refs
    y, grads, st = step_fn(run_as, *ts, ell_cap)[0]()
    errs = [rel_err(a, b) for a, b in zip([y, *grads], ref_no if run_as == "torch" else ref_l1)]
    names = ("y", "dx", "dWg", "dWu", "dWd")
    for nm, e in zip(names, errs):
        row[f"err_{nm}"] = f"{e:.2e}"
    if run_as != "torch":
        # bf16 torch path's own error (no L1) sets the yardstick
        _, gdense, _ = step_fn("torch", *ts, ell_cap)[0]()
        yd = gated_ffn_torch(*ts[:4], with_stats=False)[0]
        base = [rel_err(a, b) for a, b in zip([yd, *gdense], ref_no)]
        bad = [nm for nm, e, b in zip(names, errs, base) if not e <= 3 * b + 5e-3]
        row["l1_rel_err"] = f"{abs(st.l1.item() - st_ref.l1.item()) / st_ref.l1.item():.2e}"
        row["counts_mismatch"] = (st.active_counts != st_bf.active_counts).sum().item()
        if abs(st.nnz_sum.item() - st_bf.nnz_sum.item()) > 1e-3 * st_bf.nnz_sum.item() + 1:
            bad.append("nnz_sum")
        if bad:
            row["status"] = "WRONG:" + "/".join(bad)


def time_row(row, run_as, ts, ell_cap, rep, dense_flops) -> float:
    """Median fwd and fwd+bwd ms (20/80 % quantiles), TFLOP/s of the dense-equivalent work and
    the peak extra memory into ``row``; returns the fwd+bwd median."""
    import triton.testing

    run, fwd = step_fn(run_as, *ts, ell_cap)
    q = (0.5, 0.2, 0.8)
    full = triton.testing.do_bench(run, warmup=10, rep=rep, quantiles=q)
    f_ms = triton.testing.do_bench(fwd, warmup=10, rep=rep, quantiles=q)
    row["fwd_ms"] = round(f_ms[0], 3)
    row["full_ms"] = round(full[0], 3)
    row["full_q20_q80"] = f"{full[1]:.3f}-{full[2]:.3f}"
    row["useful_tflops_dense_equiv"] = round(dense_flops / full[0] / 1e9, 1)
    row["peak_extra_mb"] = round(peak_extra_mb(run), 1)
    return full[0]


def bench_case(args, policy, dist, dens, ts, rep) -> tuple[list[dict], dict | None]:
    """Check and time every variant on one case ``ts`` = (x, wg, wu, wd, dy); returns its rows
    and, with --stack, its stack row. With --profile only the profile is printed (no rows)."""
    n, d, h = ts[0].shape[0], ts[0].shape[1], ts[1].shape[0]
    dense_flops = 9 * 2 * n * d * h  # 3 GEMMs forward, 6 backward
    (ref_l1, st_ref), (ref_no, _) = reference_fp32(*ts, True), reference_fp32(*ts, False)
    # bf16 dense stats (the path the trainer would otherwise use) for the stats check
    _, st_bf = gated_ffn_torch(*ts[:4], with_stats=True)
    l0 = st_bf.nnz_sum.item() / n
    nnz_max = int(st_bf.nnz_max.item())
    ell_cap = max(16, 16 * math.ceil(nnz_max / 16))
    if args.profile:
        profile_case(args, ts, dist, dens, ell_cap)
        return [], None
    rows, torch_ms, torch_mb = [], None, None
    for variant in args.variants.split(","):
        row = {"dist": dist, "density": dens, "l0": round(l0, 1), "nnz_max": nnz_max,
               "heavy_frac": round(st_bf.heavy_rows.item() / n, 4), "variant": variant,
               "status": "ok"}
        run_as = variant
        if variant == "auto":  # the trainer's ffn_impl=auto rule on this layer's L0
            path = policy.train_path(l0 / h, st_bf.heavy_rows.item() / n)
            run_as = "ell_nosync" if path == "ell" else "dense"
            row["variant"] = f"auto[{path}]"
        try:
            check_row(row, run_as, ts, ell_cap, (ref_l1, ref_no), st_ref, st_bf)
            full_ms = time_row(row, run_as, ts, ell_cap, rep, dense_flops)
            if variant == "torch":
                torch_ms, torch_mb = full_ms, row["peak_extra_mb"]
            if torch_ms:
                row["speedup"] = round(torch_ms / full_ms, 3)
                row["mem_vs_torch"] = round(row["peak_extra_mb"] / torch_mb, 3)
        except Exception as e:  # noqa: BLE001 (report, do not crash)
            row["status"] = f"FAILED: {type(e).__name__}: {str(e)[:200]}"
            traceback.print_exc()
        rows.append(row)
        print(dict(row), flush=True)
        torch.cuda.empty_cache()
    stack_row = None
    if args.stack > 0:
        t = stack_times(*ts, args.stack, rep)
        stack_row = {"dist": dist, "density": dens, "layers": args.stack,
                     **{f"{k}_ms": round(v, 3) for k, v in t.items()},
                     "sync_speedup": round(t["torch"] / t["sync"], 3),
                     "nosync_speedup": round(t["torch"] / t["nosync"], 3)}
        print(stack_row, flush=True)
    return rows, stack_row


def print_summary(rows, stack_rows, shape) -> None:
    """The stack rows, the table of :data:`COLS`, and ell against :data:`RECORDED_SPEEDUP`."""
    if stack_rows:
        print("\n## stacks: ms of L layers fwd+bwd; speedup over torch")
        for r in stack_rows:
            print(r)
    print("\n" + " | ".join(f"{c:>10}" for c in COLS))
    for r in rows:
        print(" | ".join(f"{r.get(c, '')!s:>10}" for c in COLS))
    print("\n## ell vs recorded (speedup over torch fwd+bwd, BENCHMARKS.md)")
    for r in rows:
        rec = RECORDED_SPEEDUP.get((r["dist"], r["density"]))
        if r["variant"] == "ell" and "speedup" in r and rec and shape == (16384, 2048, 5632):
            print(f"{r['dist']} {100 * r['density']:g} %: {r['speedup']:.2f}x now, {rec:.2f}x "
                  f"recorded (ratio {r['speedup'] / rec:.2f})")


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
