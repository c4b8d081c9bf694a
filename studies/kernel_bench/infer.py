"""The inference FFN benchmark (``scripts/bench_ffn.py``, whose docstring says what it runs): TwELL
variants and launch shapes checked against the fp32 dense FFN (``twell.ops.reference`` through
``studies.kernel_bench.common``), then timed beside dense cuBLAS; the tables.

Shape legend: M tokens, D model width, H FFN width.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import time
import traceback

import torch

from studies.kernel_bench.cases import threshold_inputs
from studies.kernel_bench.common import cpu_times, fp32_forward, gpu_quantiles
from twell.nn.record import load_ffn_layer
from twell.ops.ffn import TwELLState, sparse_ffn

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
DENSITIES = (0.001, 0.003, 0.01, 0.03, 0.10)


def make_inputs(m, d, h, density, *, heavy=False, gated=True, seed=0, dtype=torch.bfloat16):
    """``studies.kernel_bench.cases.threshold_inputs`` on this benchmark's device."""
    return threshold_inputs(m, d, h, density, heavy=heavy, gated=gated, seed=seed, dtype=dtype,
                            device=DEV)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||y - ref|| / ||ref|| in fp32 (the quotient in Python floats);
    NaN for a non-finite reference and the absolute error for an all-zero one (an M = 1 case can
    have no active unit: ours must then be zero too). Kept apart from ``common.rel_err``, which
    divides on the device and clamps a zero norm, so that this table's numbers stay as recorded."""
    y, ref = y.float(), ref.float()
    den = ref.norm().item()
    if not math.isfinite(den) or den == 0:
        return float("nan") if den else (y - ref).norm().item()
    return (y - ref).norm().item() / den


def dense_ffn(x, wg, wu, wd):
    """The baseline: torch (cuBLAS) bf16 FFN, gate, up, relu * mul, down."""
    if wg is None:
        return torch.relu(x @ wu.T) @ wd.T
    return (torch.relu(x @ wg.T) * (x @ wu.T)) @ wd.T


def bench(fn, smoke=False):
    """Median, 20% and 80% quantiles in ms (on the CPU or with ``smoke``: median, min and max
    of 3 calls)."""
    if smoke or not ON_GPU:
        ts = cpu_times(fn, 3)
        return statistics.median(ts), min(ts), max(ts)
    return gpu_quantiles(fn)


def variant_state(v):
    """A ``TwELLState`` with variant ``v``'s factor and launch shapes (``VARIANTS``)."""
    st = TwELLState(factor=v.get("factor", 8))
    st.consumer_kwargs = dict(v.get("consumer", {}))
    st.pack_kwargs = dict(v.get("pack", {}))
    return st


VARIANTS = {
    "twell": {},                                               # the library defaults
    "twell_f4": {"factor": 4},
    "twell_nb4r2": {"consumer": {"nb": 4, "num_warps": 4, "rows": 2}},
}
ALWAYS = ("twell",)  # at every config; the others with the sweep (--no-sweep skips them)
# launch-shape sweeps of the two kernels alone (parts), at the sweep configurations only
PACK_SWEEP = {
    "m2w2": {"block_m": 2, "num_warps": 2},
    "m2w1": {"block_m": 2, "num_warps": 1},
    "m4w1": {"block_m": 4, "num_warps": 1},
}
CONSUMER_SWEEP = {
    f"nb{nb}w{w}": {"nb": nb, "num_warps": w}
    for nb, w in ((4, 2), (2, 2), (2, 1), (1, 1), (1, 2), (8, 4), (8, 8))
}
CANDIDATE = "twell"  # the auto-threshold suggestion is computed for this variant
# The defaults' speedup over dense recorded with the current kernels (BENCHMARKS.md, "Where things
# stand"; M 16384, D 2048, H 5632, gated, i.i.d.): the summary prints this run's against it.
RECORDED_SPEEDUP = {0.001: 2.04, 0.003: 1.65, 0.01: 1.00, 0.03: 0.48, 0.1: 0.12}


# ------------------------------------------------------------------ phase 1: correctness


def check_one(name, v, m, d, h, gated, density, heavy=False):
    """Phase 1, one shape: variant ``v``'s y against fp32 beside the dense bf16 path's error,
    and its non-zero count exactly; PASS needs ours <= 1.5x dense + 1e-3."""
    x, wg, wu, wd = make_inputs(m, d, h, density, heavy=heavy, gated=gated, seed=m + d + h)
    st = variant_state(v)
    with torch.no_grad():
        y, stats = sparse_ffn(x, wg, wu, wd, with_stats=True, state=st)
        ref = fp32_forward(x, wg, wu, wd)
        e_ours = rel_err(y, ref)
        e_dense = rel_err(dense_ffn(x, wg, wu, wd), ref)
        pre = x @ (wg if gated else wu).T
        nnz = int((~(pre <= 0)).sum())
    ok = (e_ours <= 1.5 * e_dense + 1e-3) and int(stats.nnz_sum.item()) == nnz and \
        y.shape == (m, d) and bool(torch.isfinite(y).all())
    return {
        "variant": name, "M": m, "D": d, "H": h, "gated": gated, "density": density,
        "rel_err": e_ours, "rel_err_dense": e_dense, "nnz": nnz,
        "overflow_rows": int(st.last_info.overflow_rows), "status": "PASS" if ok else "FAIL",
    }


def phase_check(args):
    """Phase 1: every variant over the shape sweep (``--smoke``: one tiny shape); a variant that
    raises is a row with its error."""
    rows = []
    if args.smoke:
        shapes = sub = [(7, 64, 300)]
    else:
        shapes = [(m, d, h) for m in (1, 7, 128, 300, 4096) for d in (64, 576, 2048)
                  for h in (256, 1408, 5632, 8192)]
        sub = [(7, 576, 1408), (300, 2048, 5632), (4096, 64, 8192), (128, 2048, 256), (1, 2048, 5632)]
    plan = [("twell", s, True) for s in shapes] + [("twell", s, False) for s in sub]
    for name in VARIANTS:
        if name != "twell":
            plan += [(name, s, True) for s in sub] + [(name, s, False) for s in sub]
    for name, (m, d, h), gated in plan:
        for density, heavy in ((0.01, False), (0.03, True)):
            try:
                r = check_one(name, VARIANTS[name], m, d, h, gated, density, heavy)
            except Exception as e:  # noqa: BLE001 - report, keep going
                r = {"variant": name, "M": m, "D": d, "H": h, "gated": gated, "density": density,
                     "status": f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:80]}"}
                if args.verbose:
                    traceback.print_exc()
            rows.append(r)
    return rows


# ------------------------------------------------------------------ phase 2: speed


def flops_bytes(m, d, h, nnz, gated, words=32):
    """Useful FLOPs and minimum bytes of one TwELL forward; FLOPs of the dense one."""
    n_t = (h + 255) // 256
    if gated:
        dense_flops = 6 * m * d * h
        useful = 2 * m * d * h + nnz * (4 * d + 1)
        gather = nnz * 2 * d * 2
        hbm = 2 * m * d * 2 + 3 * h * d * 2 + 2 * m * n_t * words * 4
    else:
        dense_flops = 4 * m * d * h
        useful = 2 * m * d * h + nnz * 2 * d
        gather = nnz * d * 2
        hbm = 2 * m * d * 2 + 2 * h * d * 2 + 2 * m * n_t * words * 4
    return dense_flops, useful, gather, hbm


def _error_row(base: dict, name: str, ex: Exception, verbose: bool) -> dict:
    """The row of a variant or part that raised (the traceback printed when ``verbose``)."""
    row = {**base, "variant": name, "status": f"ERROR {type(ex).__name__}: "
           f"{str(ex).splitlines()[0][:80]}"}
    if verbose:
        traceback.print_exc()
    return row


def _case_base(args, x, wg, wu, wd, pre, density, heavy, label):
    """The case's columns (sizes, measured density, FLOPs, the dense path's time and error)
    shared by its rows, the dense row itself, and the fp32 reference."""
    m, d, h = x.shape[0], x.shape[1], wu.shape[0]
    gated = wg is not None
    ref = fp32_forward(x, wg, wu, wd)
    nnz_row = (~(pre <= 0)).sum(1)
    nnz = int(nnz_row.sum())
    e_dense = rel_err(dense_ffn(x, wg, wu, wd), ref)
    t_dense = bench(lambda: dense_ffn(x, wg, wu, wd), args.smoke)
    dfl, ufl, gbytes, hbm = flops_bytes(m, d, h, nnz, gated)
    base = {"inputs": label, "M": m, "D": d, "H": h, "gated": gated, "density_target": density,
            "heavy": heavy, "density": nnz / (m * h), "nnz_mean": nnz / m,
            "nnz_max": int(nnz_row.max()), "dense_ms": t_dense[0], "flops_dense": dfl,
            "flops_useful": ufl, "bytes_gather": gbytes, "bytes_hbm_min": hbm,
            "rel_err_dense": e_dense}
    dense_row = {**base, "variant": "dense", "ms": t_dense[0], "q20": t_dense[1],
                 "q80": t_dense[2], "speedup": 1.0, "tflops": dfl / t_dense[0] / 1e9,
                 "rel_err": e_dense, "status": "ok"}
    return base, dense_row, ref


def _variant_row(args, name, base, x, wg, wu, wd, ref) -> dict:
    """One TwELL variant (or ``auto``): warmed up, checked against ``ref``, timed."""
    if name == "auto":
        st = TwELLState()
        fn = lambda st=st: sparse_ffn(x, wg, wu, wd, with_stats=False, mode="auto",
                                      state=st, policy=args.policy)
    else:
        st = variant_state(VARIANTS[name])
        fn = lambda st=st: sparse_ffn(x, wg, wu, wd, with_stats=False, state=st)
    y, _ = fn()
    fn()
    if ON_GPU:
        torch.cuda.synchronize()
    y, _ = fn()
    e = rel_err(y, ref)
    t = bench(fn, args.smoke)
    status = "ok" if e <= 1.5 * base["rel_err_dense"] + 1e-3 else "WRONG"
    path = st.last_info.path if st.last_info else "?"
    return {**base, "variant": name + ("" if name != "auto" else f"[{path}]"),
            "ms": t[0], "q20": t[1], "q80": t[2], "speedup": base["dense_ms"] / t[0],
            "tflops": base["flops_useful"] / t[0] / 1e9, "rel_err": e, "status": status,
            "overflow_rows": int(st.last_info.overflow_rows or 0)
            if st.last_info.overflow_rows is not None else 0}


def _part_calls(args, x, wg, wu, wd, pre, parts: dict) -> None:
    """Fill ``parts`` (name -> call): where the time goes (default factor 8), with the
    launch-shape sweeps of the pack and the consumer when ``args.sweep_consumer``; what was
    added before an error stays."""
    from twell.ops.twell_ffn import twell_ffn_apply
    from twell.ops.twell_pack import pack_dense

    w_in = wu if wg is None else wg
    parts["part_gate_cublas"] = lambda: x @ w_in.T
    parts["part_pack"] = lambda: pack_dense(pre, 8)  # library default
    tw, _ = pack_dense(pre, 8)
    wdt = wd.T.contiguous()
    up = {"x_MD": x, "w_up_HD": wu} if wg is not None else {}
    parts["part_consumer"] = lambda: twell_ffn_apply(tw, pre, wdt, **up)
    if args.sweep_consumer:
        for nm, kw in PACK_SWEEP.items():
            parts[f"part_pack_{nm}"] = lambda kw=kw: pack_dense(pre, 8, **kw)
        for nm, kw in CONSUMER_SWEEP.items():
            parts[f"part_consumer_{nm}"] = lambda kw=kw: twell_ffn_apply(tw, pre, wdt, **up, **kw)


def _part_rows(args, base, x, wg, wu, wd, pre) -> list[dict]:
    """Timed rows of the parts (``_part_calls``), an error row for each that fails."""
    out, parts = [], {}
    try:
        _part_calls(args, x, wg, wu, wd, pre, parts)
    except Exception as ex:  # noqa: BLE001
        out.append({**base, "variant": "parts", "status": f"ERROR {type(ex).__name__}: {ex}"})
    for pname, fn in parts.items():
        try:
            t = bench(fn, args.smoke)
            out.append({**base, "variant": pname, "ms": t[0], "q20": t[1], "q80": t[2],
                        "speedup": base["dense_ms"] / t[0], "status": "ok"})
        except Exception as ex:  # noqa: BLE001
            out.append(_error_row(base, pname, ex, False))
    return out


def time_config(args, m, d, h, density, heavy, gated, label="synthetic", inputs=None):
    """Rows of one configuration: dense, each variant and ``auto``, then the parts (a variant
    that fails is a row with its error, never raised)."""
    if inputs is None:
        x, wg, wu, wd = make_inputs(m, d, h, density, heavy=heavy, gated=gated, seed=1)
    else:
        x, wg, wu, wd = inputs
    with torch.no_grad():
        pre = x @ (wg if gated else wu).T
        base, dense_row, ref = _case_base(args, x, wg, wu, wd, pre, density, heavy, label)
        out = [dense_row]
        variants = [*ALWAYS, "auto"]
        if args.sweep_consumer:
            variants += [n for n in VARIANTS if n not in ALWAYS]
        for name in variants:
            try:
                out.append(_variant_row(args, name, base, x, wg, wu, wd, ref))
            except Exception as ex:  # noqa: BLE001
                out.append(_error_row(base, name, ex, args.verbose))
        out += _part_rows(args, base, x, wg, wu, wd, pre)
    if ON_GPU:
        torch.cuda.empty_cache()
    return out


def phase_speed(args):
    """Phase 2: the rows of every configuration (``time_config``), then the ``--acts``
    recorded layers."""
    rows = []
    if args.smoke:
        cfgs = [(64, 64, 520, 0.03, True, True), (64, 64, 520, 0.01, False, False)]
    else:
        cfgs = [(16384, 2048, 5632, dd, hv, True) for dd in DENSITIES for hv in (False, True)]
        cfgs += [(2048, 2048, 5632, dd, False, True) for dd in (0.003, 0.01, 0.03)]
        cfgs += [(16384, 2048, 8192, dd, False, False) for dd in (0.003, 0.01, 0.03)]
        if args.full:
            cfgs += [(131072, 2048, 5632, dd, False, True) for dd in (0.003, 0.01, 0.03)]
            cfgs += [(16384, 2048, 8192, dd, False, True) for dd in (0.003, 0.01)]
            cfgs += [(16384, 2048, 8192, dd, True, False) for dd in (0.003, 0.01)]
    if args.main_only and not args.smoke:  # the headline shape at the targets' densities, i.i.d.
        dens = [float(v) for v in args.densities.split(",")] if args.densities else \
            (0.001, 0.003, 0.01, 0.03, 0.1)
        cfgs = [(16384, 2048, 5632, dd, False, True) for dd in dens]
    for i, (m, d, h, dd, hv, gated) in enumerate(cfgs):
        sweep = args.sweep_consumer if (m, d, h, gated) == (16384, 2048, 5632, True) and \
            dd in (0.003, 0.01) and not hv else False
        a = argparse.Namespace(**{**vars(args), "sweep_consumer": sweep or args.smoke})
        t0 = time.time()
        try:
            rows += time_config(a, m, d, h, dd, hv, gated)
        except Exception as ex:  # noqa: BLE001 (e.g. out of memory at M=131072)
            rows.append({"M": m, "D": d, "H": h, "density_target": dd, "heavy": hv, "gated": gated,
                         "variant": "config", "status": f"ERROR {type(ex).__name__}: {ex}"})
        print(f"[speed {i + 1}/{len(cfgs)}] M={m} D={d} H={h} dens={dd} heavy={hv} gated={gated} "
              f"{time.time() - t0:.1f}s", flush=True)
    for path in filter(None, (args.acts or "").split(",")):
        if not os.path.exists(path):
            print(f"--acts {path}: not found, skipped")
            continue
        rec = load_ffn_layer(path, DEV)
        x = rec.x.to(DEV, torch.bfloat16)
        wg = rec.w_gate
        ws = [None if wg is None else wg.to(DEV, torch.bfloat16),
              rec.w_up.to(DEV, torch.bfloat16), rec.w_down.to(DEV, torch.bfloat16)]
        rows += time_config(args, x.shape[0], x.shape[1], ws[1].shape[0], float("nan"), False,
                            wg is not None, label=os.path.basename(path), inputs=(x, *ws))
    return rows


# ------------------------------------------------------------------ report


def write_csv(path, rows):
    """CSV of ``rows``, columns in order of first appearance."""
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def fmt(v, spec):
    """``v`` formatted with ``spec`` when a number, else as text."""
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def print_check_summary(checks: list[dict]) -> None:
    """Per variant: checks, passes, the worst error over the dense path's, the first failures."""
    print("\n== correctness: variant | checks | pass | worst err/dense-err | failures (first 3)")
    by = {}
    for r in checks:
        by.setdefault(r["variant"], []).append(r)
    for name, rs in by.items():
        ok = [r for r in rs if r["status"] == "PASS"]
        ratios = [r["rel_err"] / max(r["rel_err_dense"], 1e-12) for r in rs if "rel_err" in r]
        bad = [f"M{r['M']}D{r['D']}H{r['H']}{'g' if r['gated'] else 'n'}:{r['status'][:40]}"
               for r in rs if r["status"] != "PASS"][:3]
        worst = max(ratios) if ratios else float("nan")
        print(f"{name:16s} | {len(rs):4d} | {len(ok):4d} | {worst:6.2f} | {'; '.join(bad)}")


def print_speed_summary(speed: list[dict]) -> None:
    """The speed table, auto's threshold suggestion and the defaults against
    :data:`RECORDED_SPEEDUP`."""
    print("\n== speed (median ms; speedup = dense/ours; TFLOP/s of useful work; err = rel. err vs fp32)")
    print(f"{'M':>6} {'H':>5} {'g':1} {'dens%':>6} {'hv':2} {'nnz':>6} {'max':>5} {'variant':22s} "
          f"{'ms':>7} {'q20-q80':>13} {'speedup':>7} {'TFLOP/s':>7} {'err':>8} {'dense err':>9} status")
    for r in speed:
        q = f"{fmt(r.get('q20', ''), '.3f')}-{fmt(r.get('q80', ''), '.3f')}"
        print(f"{r.get('M', ''):>6} {r.get('H', ''):>5} {'g' if r.get('gated') else 'n':1} "
              f"{fmt(100 * r.get('density', float('nan')), '.2f'):>6} {'hv' if r.get('heavy') else '':2} "
              f"{fmt(r.get('nnz_mean', ''), '.1f'):>6} {r.get('nnz_max', ''):>5} {r.get('variant', ''):22s} "
              f"{fmt(r.get('ms', ''), '.3f'):>7} {q:>13} {fmt(r.get('speedup', ''), '.2f'):>7} "
              f"{fmt(r.get('tflops', ''), '.0f'):>7} {fmt(r.get('rel_err', ''), '.2e'):>8} "
              f"{fmt(r.get('rel_err_dense', ''), '.2e'):>9} {r.get('status', '')}")
    # measured crossover for "auto": highest density where two-pass TwELL beats dense
    win = [r["density"] for r in speed if r.get("variant") == CANDIDATE and r.get("M") == 16384
           and r.get("H") == 5632 and r.get("gated") and r.get("speedup", 0) >= 1.0
           and r.get("status") == "ok"]
    lose = [r["density"] for r in speed if r.get("variant") == CANDIDATE and r.get("M") == 16384
            and r.get("H") == 5632 and r.get("gated") and r.get("speedup", 2) < 1.0]
    print(f"\nauto threshold suggestion ({CANDIDATE}): TwELL won up to density {max(win) if win else 'none'}, "
          f"lost from {min(lose) if lose else 'none'} (set FFNPolicy.infer_density_threshold between)")
    print("\n== defaults vs recorded (speedup over dense, BENCHMARKS.md; M 16384, H 5632, "
          "gated, i.i.d.)")
    for r in speed:
        if (r.get("variant") == "twell" and "speedup" in r and r.get("M") == 16384
                and r.get("D") == 2048 and r.get("H") == 5632 and r.get("gated")
                and not r.get("heavy") and r.get("density_target") in RECORDED_SPEEDUP):
            rec = RECORDED_SPEEDUP[r["density_target"]]
            print(f"density {100 * r['density_target']:g} %: {r['speedup']:.2f}x now, "
                  f"{rec:.2f}x recorded (ratio {r['speedup'] / rec:.2f})")
