"""The training FFN benchmark (``scripts/bench_ffn_train.py``, whose docstring says what it runs):
the variants (named by the training paths, ``twell.nn.plan.TRAIN_PATHS``), the per-kernel launch
shapes of the ``ell`` path (PARTS), layer stacks, and the tables.

Shape legend: N tokens, D model width, H FFN width, K ELL width, KC ELL capacity.

References: fp32 autograd of the dense FFN (``twell.ops.reference`` through
``studies.kernel_bench.common``) for the variants; the PyTorch backend of the ELL kernels
(``twell.ops.reference.sparse_train_torch``) for the parts.
"""

from __future__ import annotations

import csv
import math
import os
import time
import traceback
from pathlib import Path

import torch

from studies.kernel_bench.cases import heavy_case, iid_case, recorded_case
from studies.kernel_bench.common import (
    L1_COEFF_PER_TOKEN,
    fp32_train,
    gpu_quantiles,
    peak_extra_mb,
    rel_err,
)
from twell.nn.record import active_counts_of
from twell.ops.ffn_dense_train import dense_ffn_train
from twell.ops.ffn_train import backup_capacity_for, csc_order, sparse_ffn_train
from twell.ops.launch import kernel_config
from twell.ops.reference import gated_ffn_torch
from twell.ops.reference import sparse_train_torch as rt
from twell.ops.train_backend import triton_backend
from twell.stats import default_ell_capacity

CASES = {"iid": iid_case, "heavy": heavy_case}  # --dists


def make_case(n, d, h, density, dist, seed=0, device="cuda"):
    """bf16 (x, wg, wu, wd, dy) of ``studies.kernel_bench.cases``' ``dist`` case at the target mean density."""
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
    """A recorded layer (``studies.kernel_bench.cases.recorded_case``: x (N, D), w_gate, w_up (H, D), w_down
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


# Per-kernel launch shapes timed in the parts table: (label, kernel_config overrides); the first
# row of each part is the current default and the ratio's base (column "vs_default" = its time /
# this row's time). Every config is spelled out.


def _cp(n, w, h=256):
    return (f"n{n} w{w} h{h}", {"compact_block_n": n, "compact_warps": w, "compact_block_h": h})


def _sd(k, d, w):
    return (f"k{k} d{d} w{w}", {"sddmm_block_k": k, "sddmm_block_d": d, "sddmm_warps": w})


def _dw(j, d, w):
    """A dW launch: D slice ``d`` outermost (0 = auto), ``j`` entries a step, ``w`` warps."""
    return (f"j{j} d{d or 'auto'} w{w}",
            {"dw_block_j": j, "dw_block_d": d, "dw_warps": w, "dw_d_outer": 1})


def _sp(key, k, w):
    return (f"k{k} w{w}", {key: k, "spmm_warps": w})


PART_SHAPES = {
    "compact": [_cp(1, 1), _cp(1, 1, 128), _cp(1, 1, 64), _cp(1, 1, 512), _cp(2, 1), _cp(2, 2, 512),
                _cp(4, 1), _cp(8, 1)],
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


def _ell_state(x, wg, wu, wd, dy) -> dict:
    """One ELL state built from (x, wg) with the PyTorch backend, and the fp32 references of the
    parts from it (``ref_y``, ``ref_dx``, ``ref_dw``): the inputs every part is timed on."""
    n, d = x.shape
    h = wg.shape[0]
    gate = x @ wg.t()
    kc = default_ell_capacity(h)  # as in the ell path: heavier rows -> dense backup
    col_r, val_r, nnz_r, cnt_r = rt.compact(gate, kc)
    nnz = torch.where(nnz_r > kc, 0, nnz_r)
    k = max(1, int(nnz.max()))
    col, gv = col_r[:, :k].contiguous(), val_r[:, :k].contiguous()
    wdt = wd.t().contiguous()
    # SDDMM outputs from the PyTorch backend: zeros in the unused slots (the Triton SDDMM
    # leaves them undefined, and the fp32 references multiply them by a 0/1 mask)
    u, _ = rt.sddmm_fwd(x, wu, col, gv, nnz)
    scale = torch.tensor(0.2, device=x.device)
    dg, du = rt.sddmm_bwd(dy, wdt, col, gv, u, nnz, scale)
    perm, colptr, _ = csc_order(col, nnz, k, h)  # the training op's own (int32 perm)
    # fp32 references from the PyTorch backend (independent code)
    ref_y = rt.spmm(torch.empty(n, d, device=x.device), wdt, None, col, gv, u, nnz)
    ref_dx = rt.spmm(torch.empty(n, d, device=x.device), wg, wu, col, dg, du, nnz)
    ref_dw = [torch.empty(h, d, device=x.device) for _ in range(3)]
    rt.dw(*ref_dw, None, x, dy, perm, colptr, dg, du, gv, u)
    return {"gate": gate, "kc": kc, "col_r": col_r, "val_r": val_r, "nnz_r": nnz_r,
            "cnt_r": cnt_r, "nnz": nnz, "k": k, "col": col, "gv": gv,
            "nnz_total": int(nnz.sum()), "wdt": wdt, "u": u, "dg": dg, "du": du, "perm": perm,
            "colptr": colptr, "ref_y": ref_y, "ref_dx": ref_dx, "ref_dw": ref_dw}


def _part_jobs(s: dict, x, wg, wu, dy) -> dict:
    """part -> (call, reference, bytes of gathered rows) on the ELL state ``s``."""
    tk = triton_backend()
    col, gv, u, nnz, dg, du = s["col"], s["gv"], s["u"], s["nnz"], s["dg"], s["du"]
    row_bytes = 2 * x.shape[1]  # one bf16 row of D
    ell_bytes = s["nnz_total"] * row_bytes
    dw_out = [torch.empty_like(wg) for _ in range(3)]

    def run_dw():
        tk.dw(*dw_out, None, x, dy, s["perm"], s["colptr"], dg, du, gv, u)
        return dw_out

    return {
        "compact": (lambda: tk.compact(s["gate"], s["kc"]), None, x.shape[0] * wg.shape[0] * 2),
        "sddmm_u": (lambda: tk.sddmm_fwd(x, wu, col, gv, nnz)[0], u, ell_bytes),
        "spmm_y": (lambda: tk.spmm(torch.empty_like(x), s["wdt"], None, col, gv, u, nnz),
                   s["ref_y"], ell_bytes),
        "spmm_dx": (lambda: tk.spmm(torch.empty_like(x), wg, wu, col, dg, du, nnz),
                    s["ref_dx"], 2 * ell_bytes),
        "dw": (run_dw, s["ref_dw"], 2 * ell_bytes),
    }


def _check_part(part: str, out, ref, s: dict, row: dict) -> None:
    """One part's output against its reference into ``row`` (``err``; ``status`` WRONG when
    off): the compaction exactly, the others within 1e-2 relative (valid slots only)."""
    if part == "compact":
        kc = s["kc"]
        c2, v2, nz2, ct2 = out
        val_ok = rt.valid_slots(torch.clamp(nz2, max=kc), kc)
        ok = (torch.equal(nz2, s["nnz_r"]) and torch.equal(ct2, s["cnt_r"])
              and torch.equal(c2[val_ok], s["col_r"][val_ok])
              and torch.equal(v2[val_ok], s["val_r"][val_ok]))
        row["err"] = "exact" if ok else "MISMATCH"
        if not ok:
            row["status"] = "WRONG"
        return
    outs = out if isinstance(out, list) else [out]
    if part == "sddmm_u":  # slots past nnz are undefined: compare valid
        outs = [torch.where(rt.valid_slots(s["nnz"], s["k"]), out, 0)]
    refs = ref if isinstance(ref, list) else [ref]
    e = max(rel_err(a, b) for a, b in zip(outs, refs))
    row["err"] = f"{e:.1e}"
    if not e < 1e-2:
        row["status"] = "WRONG"


def _time_part(part, name, cfg, job, s, rep, base_ms, label) -> dict:
    """Check, then time, one part at one launch shape (``cfg``); prints and returns its row."""
    import triton.testing

    fn, ref, nbytes = job
    row = {"dist": label, "part": part, "shape": name, "status": "ok"}
    try:
        with kernel_config(**cfg):
            out = fn()
            torch.cuda.synchronize()
            _check_part(part, out, ref, s, row)
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
    return row


def parts(x, wg, wu, wd, dy, rep, label, kernels=()):
    """Times each Triton kernel of the ``ell`` path alone (old vs new launch shapes) on one ELL
    state built from (x, wg); checks each output first. Returns rows for the CSV."""
    out_rows = []
    with torch.no_grad():
        s = _ell_state(x, wg, wu, wd, dy)
        print(f"## parts {label}: K={s['k']} ELL nnz/token={s['nnz_total'] / x.shape[0]:.1f} "
              f"(dense-backup rows {int((s['nnz_r'] > s['kc']).sum())})", flush=True)
        jobs = _part_jobs(s, x, wg, wu, dy)
        base_ms = {}
        for part, shapes in PART_SHAPES.items():
            if kernels and part not in kernels:
                continue
            for name, cfg in shapes:
                out_rows.append(_time_part(part, name, cfg, jobs[part], s, rep, base_ms, label))
    torch.cuda.empty_cache()
    return out_rows


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
    run, fwd = step_fn(run_as, *ts, ell_cap)
    full = gpu_quantiles(run, warmup=10, rep=rep)
    f_ms = gpu_quantiles(fwd, warmup=10, rep=rep)
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
    (ref_l1, st_ref), (ref_no, _) = fp32_train(*ts, True), fp32_train(*ts, False)
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


