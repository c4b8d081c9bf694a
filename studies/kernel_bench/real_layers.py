"""The recorded-layer benchmark of the sparse FFN ops (``scripts/bench_real_layers.py``).

Shape legend: N tokens, D model width, H FFN width, k hot units.

Cases (``studies.kernel_bench.cases``): recorded layers (``twell.nn.record`` files; ``size`` and
``layer`` from their metadata) and synthetic rows at set densities (``iid_case``, ``size`` =
"iid"; ``heavy_case``, ``size`` = "heavy"). For every case:

1. statistics (density, L0 mean / max, heavy rows above the ELL capacity), the hot set from the
   case's own per-unit counts (``twell.ops.hot_units``), the no-sync backup capacities from a
   measuring call (``backup_capacity_for``, with and without the hot set);
2. a CHECK of every op against fp32 (``twell.ops.reference`` through ``common``; relative
   Frobenius error of y, and of dx, dWg, dWu, dWd for training, whose loss is
   ``sum(y dy) + c l1``, c = 0.2 N); an op of ours more than 3x the dense bf16 path's error
   (+ 5e-3) stops the benchmark (:class:`CheckFailed`); the
   paper's op is reported, not stopped on (its known overflow drops); an op with an eager twin
   (:data:`TWINS`: ``ell_graph`` and ``ell_nosync``) is also held to that bound against the
   twin's outputs and L1 term, and an op's capacity guard (``ell_graph``'s) is read after its
   check call and again after the timing (an overflow stops the benchmark the same way);
3. TIMING in :data:`ROUNDS` interleaved rounds (:func:`time_rounds`): every op timed once per
   round (one ``triton.testing.do_bench`` median; an injected timer on the CPU smoke run), the
   op order rotated by one each round; an op's ``ms`` is the median over rounds, its
   ``spread_pct`` (max - min) / median over rounds in % (ops timed at different moments drift
   apart by more than one ``do_bench`` median shows);
4. optionally, every op under ``torch.profiler`` (``studies.kernel_bench.kernel_profile``).

Ops (``OPS``), kind ``fwd`` (inference, no grad; the inference paths' names ``dense`` and
``twell``) and ``train`` (forward + backward; the training paths' names of
``twell.nn.plan.TRAIN_PATHS``: ``torch``, ``dense``, ``ell``):

    dense         fwd: cuBLAS bf16, the baseline (:data:`BASELINE`)
    twell         fwd: TwELL (``sparse_ffn``)
    twell_hot     fwd: TwELL with the hot set
    twell_heavy_first
                  fwd: ``twell`` with the consumer taking rows longest first
                  (``FFNPolicy.infer_heavy_first``)
    twell_long    fwd: TwELL with the :data:`LONG_ROWS` longest rows (above
                  ``FFNPolicy.infer_long_min_nnz`` non-zeros) through a dense backup
                  (``FFNPolicy.infer_long_rows``)
    torch         train: PyTorch autograd of y alone, no L1 term (cuBLAS bf16), the baseline
    ell           train: the ELL op measuring its dense backup per call
    ell_nosync    train: the ELL op, no host sync, backup at the measured capacity; fwd: its
                  forward alone (``twell.ops.ffn_train.ell_ffn_forward``: no CSC order, nothing
                  saved), the same capacity
    ell_graph     train: ``ell_nosync`` captured in one CUDA graph, forward and backward
                  (``twell.ops.ffn_train_graph``): one launch a call instead of ~96; captured at
                  its first call (outside the timing), checked against fp32 and against
                  ``ell_nosync`` (:data:`TWINS`), its capacity guard read after the timing
                  (an overflow stops the run as a failed check); CUDA only (skipped with the
                  reason on the CPU); left out with the reason when the capture fails;
                  fwd: ``ell_nosync``'s forward in one CUDA graph
                  (``ffn_train_graph.graphed_ell_forward``: exact, no guard), checked against
                  fp32 and ``ell_nosync`` fwd: what that forward costs without its launches
    ell_hot       train: no-sync ELL with the hot set; fwd: its forward alone, the same capacity
    auto          fwd: ``mode="auto"`` (measured on CUDA), with the hot set where the layer's
                  density is at least ``FFNPolicy.hot_min_density`` (the plan's rule); train:
                  ``twell.ops.ffn_train_auto.AutoFFNTrain`` (the measured op-level auto): on
                  CUDA it times ``dense``, ``ell_nosync``, ``ell_hot`` and ``ell_graph`` (its
                  own capture) on the case and runs the fastest; its exploration runs in
                  :func:`build_ops` (outside the check and the timing), its choice and medians
                  are printed, its capacity guard read like ``ell_graph``'s and, when it chose
                  the graph, it is checked against ``ell_nosync`` too (:func:`twin_of`); on the
                  CPU (no clock) ``FFNPolicy.train_path`` picks (``dense``: dense mode, else
                  ``ell_hot`` or, below ``hot_min_density``, ``ell_nosync``)
    paper         the paper's CUDA extension (``PaperOps``) when it is importable

CSV columns (``COLUMNS``): size, layer, density, l0_mean, l0_max, heavy_rows, op, kind, ms
(median over rounds), speedup_vs_dense (the kind's baseline ms / op ms, same case), rel_err (the
largest of the op's outputs), spread_pct (over rounds; empty for one round; absent from CSVs
written before it, which readers take as unknown).
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from studies.kernel_bench.cases import Case, heavy_case, iid_case, recorded_case
from studies.kernel_bench.common import (
    L1_COEFF_PER_TOKEN,
    cpu_timer,
    fp32_forward,
    fp32_train,
    gpu_timer,
    rel_err,
)
from twell.nn.record import active_counts_of
from twell.ops.ffn import TwELLState, sparse_ffn
from twell.ops.ffn_train import backup_capacity_for, ell_ffn_forward, sparse_ffn_train
from twell.ops.ffn_train_auto import AutoFFNTrain
from twell.ops.ffn_train_graph import CapacityOverflow
from twell.ops.hot_units import hot_unit_count, hot_units_from_counts
from twell.ops.reference import gated_ffn_torch
from twell.policy import FFNPolicy
from twell.stats import default_ell_capacity

COLUMNS = ["size", "layer", "density", "l0_mean", "l0_max", "heavy_rows", "op", "kind", "ms",
           "speedup_vs_dense", "rel_err", "spread_pct"]
ROUNDS = 3  # interleaved timing rounds per case (the script's --rounds default)
KINDS = ("fwd", "train")
OPS = {"fwd": ("dense", "twell", "twell_heavy_first", "twell_hot", "twell_long", "ell_nosync",
               "ell_graph", "ell_hot", "auto", "paper"),
       "train": ("torch", "ell", "ell_nosync", "ell_graph", "ell_hot", "auto",
                 "paper")}
CUDA_ONLY = {(op, kind): "CUDA graphs need a CUDA device"  # op -> why it is skipped
             for op, kind in (("ell_graph", "fwd"), ("ell_graph", "train"))}
# ops whose first call (the paper's build, ell_graph's capture) may fail: left out with the reason
OPTIONAL = ("paper", "ell_graph")
# op -> the eager op it must equal: also checked against it (outputs, gradients and the L1 term)
TWINS = {("ell_graph", "fwd"): ("ell_nosync", "fwd"),
         ("ell_graph", "train"): ("ell_nosync", "train")}
# twell_long's rows per call: 1/128 of the 16384-row calls (~6 GFLOP of dense backup at the
# 1.5B shape) against the densest tokens of a trained model (BENCHMARKS.md, "Next")
LONG_ROWS = 128
BASELINE = {"fwd": "dense", "train": "torch"}  # the op each kind's speedup is measured against


class CheckFailed(RuntimeError):
    """An op of ours is less exact than the bound (the message names case, op and errors)."""


def prepare(case: Case, policy: FFNPolicy) -> Case:
    """Fill ``stats``, ``counts``, the hot set and the no-sync capacities (host syncs: setup)."""
    n, h = case.x.shape[0], case.wg.shape[0]
    nnz, counts = active_counts_of(case.x, case.wg)
    kc = policy.ell_capacity or default_ell_capacity(h)
    case.counts = counts
    total = int(counts.sum())
    case.stats = {"density": float(f"{total / max(n * h, 1):.6g}"),
                  "l0_mean": round(total / max(n, 1), 3), "l0_max": int(nnz.max()),
                  "heavy_rows": int((nnz > kc).sum())}
    case.hot = hot_units_from_counts(counts, n, hot_unit_count(counts.cpu(), n, policy))
    with torch.no_grad():
        _, st = sparse_ffn_train(case.x, case.wg, case.wu, case.wd, policy=policy)
        _, st_hot = sparse_ffn_train(case.x, case.wg, case.wu, case.wd, policy=policy,
                                     hot_units=case.hot)
    case.cold_heavy = int(st_hot.heavy_rows.item())
    case.caps = {"cold": backup_capacity_for(st.heavy_rows.item()),
                 "hot": backup_capacity_for(case.cold_heavy)}
    return case


def _dense_fwd(x, wg, wu, wd):
    return (torch.relu(x @ wg.t()) * (x @ wu.t())) @ wd.t()


def _train_closure(fn, case: Case, with_l1: bool) -> Callable[[], list[torch.Tensor]]:
    """fwd + bwd of ``fn(x, wg, wu, wd) -> (y, stats or None)``: returns [y, dx, dWg, dWu, dWd]
    of ``sum(y dy) (+ c l1)`` (autograd.grad: nothing accumulates across calls); the last
    call's L1 term in ``run.stats["l1"]`` (with ``with_l1``)."""
    ins = [t.detach().clone().requires_grad_() for t in (case.x, case.wg, case.wu, case.wd)]
    c = L1_COEFF_PER_TOKEN * case.x.shape[0]

    def run():
        y, st = fn(*ins)
        outs, gouts = [y], [case.dy.to(y.dtype)]
        if with_l1:
            outs.append(st.l1)
            gouts.append(torch.full_like(st.l1, c))
            run.stats["l1"] = st.l1.detach()
        return [y.detach(), *torch.autograd.grad(outs, ins, gouts)]
    run.stats = {}
    return run


def _graph_closure(case: Case, policy: FFNPolicy) -> Callable[[], list[torch.Tensor]]:
    """``ell_graph``: ``ell_nosync``'s call (same capacity, loss, L1 coefficient) captured in a
    CUDA graph (``twell.ops.ffn_train_graph.graphed_ffn_train``) at the first call, which
    :func:`build_ops` makes before the check and the timing; then a call is one replay (on the
    copies of x and dy made at the capture, the case's weights in place; nothing copied per
    call). Returns the static [y, dx, dWg, dWu, dWd] (overwritten by the next call), the L1
    term in ``run.stats["l1"]``; ``run.check()`` reads the capacity guard (one host sync;
    raises ``CapacityOverflow``)."""
    from twell.ops.ffn_train_graph import graphed_ffn_train

    held = {}

    def run():
        g = held.get("g")
        if g is None:
            g = held["g"] = graphed_ffn_train(
                case.x, case.wg, case.wu, case.wd, case.dy, backup_rows=case.caps["cold"],
                l1_coeff=L1_COEFF_PER_TOKEN * case.x.shape[0], policy=policy)
        out = g()
        run.stats["l1"] = out[5]
        return list(out[:5])

    def check():
        if "g" in held:
            held["g"].check()
    run.stats, run.check = {}, check
    return run


def _fwd_graph_closure(case: Case, policy: FFNPolicy):
    """``ell_graph`` fwd: ``ell_nosync``'s forward (same capacity, no hot units) captured in a
    CUDA graph (``twell.ops.ffn_train_graph.graphed_ell_forward``) at the first call, which
    :func:`build_ops` makes before the check and the timing; then a call is one replay on the
    capture's copy of x. Returns the static [y]."""
    from twell.ops import ffn_train_graph

    held = {}

    def run():
        g = held.get("g")
        if g is None:
            g = held["g"] = ffn_train_graph.graphed_ell_forward(
                case.x, case.wg, case.wu, case.wd, backup_rows=case.caps["cold"], policy=policy)
        return [g()[0]]
    return run


def _auto_closure(case: Case, policy: FFNPolicy) -> Callable[[], list[torch.Tensor]]:
    """``auto`` train: :class:`twell.ops.ffn_train_auto.AutoFFNTrain` on the case's weights (in
    place), hot set and L1 coefficient. Returns [y, dx, dWg, dWu, dWd] of one call, the L1 term
    in ``run.stats["l1"]``; ``run.explore()`` calls it until it has chosen (:func:`build_ops`,
    before the check and the timing, so the timing sees its steady state); ``run.check()``
    reads its capacity guard (one host sync; raises ``CapacityOverflow``): it does not sync per
    call (``check_each_call=False``), as ``ell_graph`` does not. While it holds a graph a call
    passes the graph's own input buffers (they hold the case's x and dy, copied at the
    capture), so it copies nothing per call, as ``ell_graph``'s replays do not."""
    auto = AutoFFNTrain(case.wg, case.wu, case.wd, hot_units=case.hot,
                        l1_coeff=L1_COEFF_PER_TOKEN * case.x.shape[0], policy=policy,
                        check_each_call=False)

    def run():
        out = auto(*(auto.inputs() or (case.x, case.dy)))
        run.stats["l1"] = out[5]
        return list(out[:5])

    def explore(max_calls: int = 1000):
        auto.explore(case.x, case.dy, max_calls)
    run.stats, run.check, run.explore, run.auto = {}, auto.check, explore, auto
    return run


def twin_of(op: str, kind: str, fn) -> tuple[str, str] | None:
    """The eager op that ``op`` must equal (:data:`TWINS`), or for ``auto`` train the twin of
    the candidate it chose (``ell_graph``: ``ell_nosync``); None without one."""
    auto = getattr(fn, "auto", None)
    return TWINS.get((op, kind)) or (None if auto is None else TWINS.get((auto.choice, kind)))


def skip_reason(op: str, kind: str, case: Case) -> str | None:
    """Why ``op`` does not run on ``case``'s device (:data:`CUDA_ONLY` off CUDA), else None."""
    why = CUDA_ONLY.get((op, kind))
    return None if why is None or case.x.is_cuda else f"{why}; this case is on {case.x.device}"


def references(case: Case) -> dict:
    """fp32 references (TF32 off; ``twell.ops.reference`` through ``common``): "fwd" [y],
    "train" [y, dx, dWg, dWu, dWd] with the L1 term, "train_dense" the same without it (what
    the dense baseline computes)."""
    ts = (case.x, case.wg, case.wu, case.wd)
    return {"fwd": [fp32_forward(*ts)], "train": fp32_train(*ts, case.dy, True)[0],
            "train_dense": fp32_train(*ts, case.dy, False)[0]}


def _split_pays(case: Case, policy: FFNPolicy) -> bool:
    """Does the forward ``auto`` take the hot set on this case (the plan's rule: the layer's
    density at least ``policy.hot_min_density``)?"""
    return case.stats["density"] >= policy.hot_min_density


def make_op(op: str, kind: str, case: Case, policy: FFNPolicy, paper=None):
    """Closure running one call of ``op`` (``OPS``) on ``case``; returns its outputs ([y], or
    [y, dx, dWg, dWu, dWd]) for the check. None when the op does not apply (paper absent, a
    :data:`CUDA_ONLY` op off CUDA, a no-sync op with every row heavy)."""
    x, wg, wu, wd = case.x, case.wg, case.wu, case.wd
    if op == "paper":
        return None if paper is None else (paper.fwd_closure(case) if kind == "fwd"
                                           else paper.train_closure(case))
    if _every_row_heavy(op, case):
        return None
    if kind == "fwd":
        if op == "dense":
            return lambda: [_dense_fwd(x, wg, wu, wd)]
        if op in ("ell_nosync", "ell_hot"):
            return _ell_fwd_closure(op, case, policy)
        if op == "ell_graph":
            return _fwd_graph_closure(case, policy)
        st = TwELLState()
        mode = "auto" if op == "auto" else "twell"
        hot = None if op in ("twell", "twell_heavy_first", "twell_long") or (
            op == "auto" and not _split_pays(case, policy)) else case.hot
        if op == "twell_long":
            policy = dataclasses.replace(policy, infer_long_rows=LONG_ROWS)
        if op == "twell_heavy_first":
            policy = dataclasses.replace(policy, infer_heavy_first=True)

        @torch.no_grad()
        def fwd():
            return [sparse_ffn(x, wg, wu, wd, with_stats=False, mode=mode, state=st,
                               policy=policy, hot_units=hot)[0]]
        fwd.state = st
        return fwd
    if op == "torch":
        return _train_closure(lambda *a: gated_ffn_torch(*a, with_stats=False), case, False)
    if op == "auto":
        return _auto_closure(case, policy)
    if op == "ell_graph":
        return None if skip_reason(op, kind, case) else _graph_closure(case, policy)
    kw = {"ell": {}, "ell_nosync": {"backup_rows": case.caps.get("cold", -1)},
          "ell_hot": {"backup_rows": case.caps.get("hot", -1), "hot_units": case.hot}}[op]
    return _train_closure(lambda *a: sparse_ffn_train(*a, policy=policy, **kw), case, True)


def _every_row_heavy(op: str, case: Case) -> bool:
    """Is ``op`` a no-sync op (``ell_nosync``, ``ell_graph``; ``ell_hot`` by its cold rows) on a
    case whose every row is heavy? Its backup holds at most N - 1 rows (the op's rule), so it
    does not run, forward or training."""
    n = case.x.shape[0]
    if op in ("ell_nosync", "ell_graph"):
        return case.stats["heavy_rows"] >= n
    return op == "ell_hot" and case.cold_heavy >= n


def _ell_fwd_closure(op: str, case: Case, policy: FFNPolicy):
    """``ell_nosync`` / ``ell_hot``'s forward alone (``ell_ffn_forward``) at the training op's
    no-sync capacity."""
    hot = case.hot if op == "ell_hot" else None
    kw = {"backup_rows": case.caps.get("hot" if hot is not None else "cold", -1),
          "hot_units": hot, "policy": policy}
    return lambda: [ell_ffn_forward(case.x, case.wg, case.wu, case.wd, **kw)[0]]


def read_guard(fn, where: str) -> None:
    """Read an op's capacity guard (``fn.check``: ``ell_graph``'s, one host sync; outside the
    timing) and raise :class:`CheckFailed` naming ``where`` when a call since the last read
    overflowed its dense backup (its results were wrong). Ops without a guard pass."""
    check = getattr(fn, "check", None)
    if check is None:
        return
    try:
        check()
    except CapacityOverflow as e:
        raise CheckFailed(f"{where}: {e}") from e


def _twin_diffs(out: list, fn, twin_fn) -> list[float]:
    """Relative differences of ``fn``'s outputs ``out`` (its call just made) from a call of its
    eager twin (:data:`TWINS`), then of their L1 terms (``stats["l1"]``)."""
    twin_out = twin_fn()
    d = [rel_err(a, b) for a, b in zip(out, twin_out)]
    stats = getattr(fn, "stats", None)  # the forward has no L1 term
    return d + ([rel_err(stats["l1"], twin_fn.stats["l1"])] if stats else [])


def check_case(case: Case, ops: dict, refs: dict) -> dict:
    """Relative errors of every op (``ops``: (op, kind) -> closure) against fp32; raises
    :class:`CheckFailed` when an op of ours exceeds 3x the dense bf16 path's error + 5e-3 on
    any output (the dense bf16 path with the L1 term for training; the baselines and the
    paper's op are reported, never stopped on), when an op with a twin (:data:`TWINS`) differs
    from it by more than that bound on an output (5e-3 on the L1 term; printed), or when an
    op's capacity guard (:func:`read_guard`) overflowed. Returns (op, kind) -> (largest error
    against fp32, within the bounds)."""
    base = {"fwd": [rel_err(o, r) for o, r in zip(ops[("dense", "fwd")](), refs["fwd"])]}
    l1_dense = _train_closure(lambda *a: gated_ffn_torch(*a, with_stats=True), case, True)()
    base["train"] = [rel_err(o, r) for o, r in zip(l1_dense, refs["train"])]
    errs, bad = {}, []
    where = f"{case.size} layer {case.layer}"
    for (op, kind), fn in ops.items():
        ref = refs["train_dense" if (op, kind) == ("torch", "train") else kind]
        out = fn()
        read_guard(fn, f"{where}: {op} {kind}")
        e = [rel_err(o, r) for o, r in zip(out, ref)]
        ok = all(ei <= 3 * bi + 5e-3 for ei, bi in zip(e, base[kind]))  # False for NaN
        if not ok and op not in ("paper", BASELINE[kind]):
            bad.append(f"{op} {kind}: errors {', '.join(f'{v:.2e}' for v in e)} vs dense bf16 "
                       f"{', '.join(f'{v:.2e}' for v in base[kind])}")
        if (twin := twin_of(op, kind, fn)) in ops:
            d = _twin_diffs(out, fn, ops[twin])
            names = "y, dx, dWg, dWu, dWd, l1" if kind == "train" else "y"
            print(f"  {op} {kind} vs {twin[0]}: relative differences ({names}) "
                  f"{', '.join(f'{v:.1e}' for v in d)}", flush=True)
            if not all(di <= 3 * bi + 5e-3 for di, bi in zip(d, [*base[kind], 0.0])):
                ok = False
                bad.append(f"{op} {kind} differs from {twin[0]}: "
                           f"{', '.join(f'{v:.2e}' for v in d)}")
        errs[(op, kind)] = (max(e), ok)
    if bad:
        raise CheckFailed(f"{where}: " + "; ".join(bad))
    return errs


def round_stats(ms: list[float]) -> tuple[float, float | None]:
    """(median, spread %) of one op's times over rounds (ms each): spread = (max - min) /
    median x 100; None for one round (not measured), 0 for a zero median.

    Raises:
        ValueError: ``ms`` is empty.
    """
    if not ms:
        raise ValueError("round_stats: no times")
    med = statistics.median(ms)
    if len(ms) == 1:
        return med, None
    return med, (100 * (max(ms) - min(ms)) / med if med > 0 else 0.0)


def time_rounds(ops: dict, timer, rounds: int = ROUNDS) -> dict:
    """Time every op of ``ops`` (key -> closure) once per round, ``rounds`` rounds one after
    the other, the op order rotated by one each round (round r starts at the r-th op).

    Args:
        timer: ``timer(fn) -> ms`` (``gpu_timer``: one ``do_bench`` median).

    Returns:
        key -> (median ms over rounds, spread %) (:func:`round_stats`), in ``ops``' order.

    Raises:
        ValueError: ``rounds < 1``.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1; got {rounds}")
    keys = list(ops)
    ms: dict = {k: [] for k in keys}
    for r in range(rounds):
        s = r % max(len(keys), 1)
        for k in keys[s:] + keys[:s]:
            ms[k].append(timer(ops[k]))
    return {k: round_stats(v) for k, v in ms.items()}


def build_ops(case: Case, policy: FFNPolicy, paper=None, kinds=KINDS) -> dict:
    """``(op, kind) -> closure`` of every op of ``kinds`` that applies to ``case`` (prepared:
    :func:`prepare`), dense fwd always (the check's yardstick). A :data:`CUDA_ONLY` op off
    CUDA is skipped and an :data:`OPTIONAL` op whose first call raises (outside any timing:
    the paper's build, ``ell_graph``'s capture) is left out, each with its reason printed; an
    op that explores (``auto`` train: ``fn.explore``) explores here, to its choice.

    Raises:
        CheckFailed: an optional op's first call overflowed its capacity (:func:`read_guard`).
    """
    ops = {}
    for kind in kinds:
        for op in OPS[kind]:
            if (why := skip_reason(op, kind, case)) is not None:
                print(f"  {op} {kind}: skipped ({why})", flush=True)
            elif (fn := make_op(op, kind, case, policy, paper)) is not None:
                ops[(op, kind)] = fn
    if ("dense", "fwd") not in ops:
        ops[("dense", "fwd")] = make_op("dense", "fwd", case, policy)
    for key in [k for k in ops if k[0] in OPTIONAL]:
        try:
            ops[key]()
        except CapacityOverflow as e:  # a wrong result, not a missing feature: stop
            raise CheckFailed(f"{case.size} layer {case.layer}: {key[0]} {key[1]}: {e}") from e
        except Exception as e:  # noqa: BLE001
            print(f"  {key[0]} {key[1]}: left out ({type(e).__name__}: {str(e)[:160]})",
                  flush=True)
            del ops[key]
    for fn in ops.values():
        if hasattr(fn, "explore"):
            fn.explore()
    return ops


def run_case(case: Case, policy: FFNPolicy, timer, paper=None, kinds=KINDS, *,
             rounds: int = ROUNDS, profiles: dict | None = None) -> list[dict]:
    """Prepare, check, then time every op of ``case`` (:func:`time_rounds`); returns its CSV
    rows (``COLUMNS``, plus ``within_bound``).

    Args:
        timer: ``timer(fn) -> ms`` of one measurement (``gpu_timer`` / ``cpu_timer``).
        rounds: interleaved timing rounds.
        profiles: when a dict, filled after the timing with ``(op, kind) -> StepProfile`` per
            call (``kernel_profile.profile_ops``).

    Raises:
        CheckFailed: an op of ours is off (:func:`check_case`; nothing is timed), or a timed
            call overflowed its capacity (:func:`read_guard`, after the timing).
    """
    prepare(case, policy)
    refs = references(case)
    ops = build_ops(case, policy, paper, kinds)
    errs = check_case(case, ops, refs)
    ms = time_rounds(ops, timer, rounds)
    if ("auto", "fwd") in ops:  # what the measured auto chose (printed; the CSV keeps "auto")
        print(f"  auto fwd: {ops[('auto', 'fwd')].state.auto.choices()}", flush=True)
    if ("auto", "train") in ops:  # its choice and the candidates' medians over its timed calls
        print(f"  auto train: {ops[('auto', 'train')].auto.summary()}", flush=True)
    if profiles is not None:
        from studies.kernel_bench.kernel_profile import profile_ops

        profiles.update(profile_ops({k: fn for k, fn in ops.items() if k[1] in kinds},
                                    case.x.device, case.wg.shape[0]))
    for (op, kind), fn in ops.items():  # the timed calls' guards (ell_graph's capacity)
        read_guard(fn, f"{case.size} layer {case.layer}: {op} {kind}, timed calls")
    rows = []
    for (op, kind), (t, spread) in ms.items():
        if kind not in kinds:
            continue
        base = ms[(BASELINE[kind], kind)][0]
        err, ok = errs[(op, kind)]
        rows.append({"size": case.size, "layer": case.layer, **case.stats, "op": op,
                     "kind": kind, "ms": round(t, 4),
                     "speedup_vs_dense": round(base / t, 3),
                     "rel_err": float(f"{err:.3e}"),
                     "spread_pct": "" if spread is None else round(spread, 1),
                     "within_bound": ok})
    return rows


def write_csv(path, rows: list[dict]) -> Path:
    """Write ``rows`` with exactly ``COLUMNS`` (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def _spread(r: dict) -> str:
    """``±<spread %>`` of a row, or nothing where the row has none (an older CSV)."""
    v = r.get("spread_pct")
    return "" if v in (None, "") else f"±{float(v):.0f}"


def summary_table(rows: list[dict]) -> str:
    """One line per case and kind: the baseline's ms (dense for fwd, torch for train), then each
    op's speedup over it, each with its spread over rounds in % (``1.39x±4``; none for rows
    without ``spread_pct``); ``*`` marks an op whose error is over the bound (the paper's op
    when it drops overflow)."""
    present = {r["op"] for r in rows}
    ops = [o for o in dict.fromkeys(OPS["fwd"] + OPS["train"])
           if o in present and o not in BASELINE.values()]
    head = f"{'size':>6} {'layer':>6} {'dens %':>7} {'L0':>6} {'max':>5} {'heavy':>6} {'kind':>5} " \
           f"{'base ms':>11} " + " ".join(f"{o:>12}" for o in ops)
    lines = [head]
    keys = list(dict.fromkeys((r["size"], r["layer"], r["kind"]) for r in rows))
    for size, layer, kind in keys:
        rs = {r["op"]: r for r in rows if (r["size"], r["layer"], r["kind"]) == (size, layer, kind)}
        d = rs[BASELINE[kind]]
        cells = []
        for o in ops:
            r = rs.get(o)
            if r is None:
                cells.append(f"{'-':>12}")
                continue
            ratio = f"{r['speedup_vs_dense']:.2f}x{_spread(r)}"
            cells.append(f"{ratio:>11}{' ' if r.get('within_bound', True) else '*'}")
        base = f"{d['ms']:.3f}{_spread(d)}"
        lines.append(f"{size:>6} {layer:>6} {100 * d['density']:>7.2f} {d['l0_mean']:>6.1f} "
                     f"{d['l0_max']:>5} {d['heavy_rows']:>6} {kind:>5} {base:>11} "
                     + " ".join(cells))
    return "\n".join(lines)


def _load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class PaperOps:
    """The paper's CUDA ops (SakanaAI/sparser-faster-llms, built by its own loaders: ~1 min of
    nvcc with ``TORCH_CUDA_ARCH_LIST=9.0a``), through their public Python API: inference
    ``TwELLGatedMLP(layer, GATE, UP, DOWN)`` (DOWN = Wd^T, (H, D)) and training
    ``torch.ops.sparse_ops.ff_forward_gated(X (1, N, D), G, K, V = Wd^T) -> (y, l0, l1, ...)``
    with autograd. None of its code is copied here.

    Args:
        src: the repository checkout (``custom_models/`` inside).

    Raises:
        ImportError / RuntimeError / OSError: the extension did not import or build.
    """

    def __init__(self, src) -> None:
        src = Path(src)
        self.twell = _load_module("paper_twell_modules",
                                  src / "custom_models" / "twell_modules" / "twell.py")
        loader = _load_module("paper_sparse_ops_loader",
                              src / "custom_models" / "hybrid_modules" / "sparse_ops_loader.py")
        loader.load_sparse_ops()
        self._layer = 0

    def fwd_closure(self, case: Case):
        self._layer += 1
        mlp = self.twell.TwELLGatedMLP(self._layer, case.wg, case.wu, case.wd.t().contiguous())
        return torch.no_grad()(lambda: [mlp(case.x).to(case.x.dtype)])

    def train_closure(self, case: Case):
        x, wg, wu = (t.detach().clone().requires_grad_() for t in (case.x, case.wg, case.wu))
        v = case.wd.t().contiguous().requires_grad_()  # its (H, D) layout of Wd
        c = L1_COEFF_PER_TOKEN * case.x.shape[0]
        op = torch.ops.sparse_ops.ff_forward_gated

        def run():
            y, _l0, l1, *_ = op(x[None], wg, wu, v)
            y = y.reshape(case.x.shape)
            gx, gg, gu, gv = torch.autograd.grad([y, l1], [x, wg, wu, v],
                                                 [case.dy.to(y.dtype), torch.full_like(l1, c)])
            return [y.detach(), gx, gg, gu, gv.t()]
        return run


def load_paper_ops(src) -> PaperOps | None:
    """:class:`PaperOps` from ``src``, or None (with the reason printed) when it cannot load."""
    if src is None:
        return None
    try:
        return PaperOps(src)
    except Exception as e:  # noqa: BLE001 (optional: report and go on without it)
        print(f"paper ops from {src}: not available ({type(e).__name__}: {str(e)[:200]})")
        return None


def profile_title(case: Case) -> str:
    """A case's heading in ``kernel_profile.md``: labels, N x D x H, density and L0."""
    (n, d), h = case.x.shape, case.wg.shape[0]
    st = case.stats
    return (f"{case.size} layer {case.layer}: N x D x H = {n} x {d} x {h}, density "
            f"{100 * st['density']:.2f} %, L0 {st['l0_mean']:.1f} (max {st['l0_max']})")


def run_cases(cases, policy: FFNPolicy, paper, timer, header: str, *, out: Path,
              kinds=KINDS, rounds: int = ROUNDS, profile: bool = False) -> tuple[dict, int]:
    """Check, time (and with ``profile`` profile: :mod:`studies.kernel_bench.kernel_profile`)
    every case of ``cases`` ((table, build) pairs: table ``real_layers`` or ``iid``, ``build()``
    -> :class:`Case`), writing ``<table>.csv`` (and the profile) under ``out`` after each, so a
    timeout keeps what finished; stops at the first failed check (printed to stderr).

    Returns:
        ``(table -> rows, exit status)``: 0, or 1 after a failed check.
    """
    from studies.kernel_bench.kernel_profile import write_kernel_profile

    rows: dict = {"real_layers": [], "iid": []}
    profiled: list = []
    status = 0
    for table, build in cases:
        case = build()
        print(f"# {case.size} layer {case.layer}: {tuple(case.x.shape)}", flush=True)
        profiles = {} if profile else None
        try:
            rows[table] += run_case(case, policy, timer, paper, kinds=kinds, rounds=rounds,
                                    profiles=profiles)
        except CheckFailed as e:
            print(f"FAIL (no timing): {e}", file=sys.stderr, flush=True)
            status = 1
            break
        finally:
            for name, rs in rows.items():
                write_csv(out / f"{name}.csv", rs)
            if profiles:
                profiled.append(({"size": case.size, "layer": case.layer,
                                  "title": profile_title(case)}, profiles))
            if profile:
                write_kernel_profile(out, profiled, header)
            del case
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows, status


__all__ = ["BASELINE", "COLUMNS", "CUDA_ONLY", "KINDS", "OPS", "OPTIONAL", "ROUNDS", "TWINS", "Case",
           "CheckFailed", "PaperOps", "build_ops", "check_case", "cpu_timer", "gpu_timer",
           "heavy_case", "iid_case", "load_paper_ops", "make_op", "prepare", "profile_title",
           "read_guard", "recorded_case", "references", "rel_err", "round_stats", "run_case",
           "run_cases", "skip_reason", "summary_table", "time_rounds", "twin_of", "write_csv"]
