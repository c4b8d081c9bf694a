"""The sparse training op of the ReLU-gated FFN: hybrid ELL + dense backup, forward and backward.

Shape legend: N tokens, D model width, H FFN width, K ELL width, KC ELL capacity, R dense-backup
rows (tokens with more than KC active units).

Math (arXiv 2603.23198, the hybrid ELL + dense-backup training kernels)::

    g = relu(x Wg^T)            dense gate GEMM (cuBLAS) + ReLU + compaction (Triton)
    u = x . Wu[col]             SDDMM, only at the non-zeros of g
    h = g * u                   never stored: recomputed from the ELL values g, u
    y = sum_k h Wd^T[col]       SpMM
    l1 = mean_n sum_j |h_nj|    from the SDDMM (per-row sums), differentiable

    dh = dy . Wd^T[col] + (dL/dl1 / N) sign(h)      SDDMM at the non-zeros
    dg = dh * u,  du = dh * g                         (relu' = 0 off the non-zeros)
    dx = sum_k dg Wg[col] + du Wu[col]                SpMM through both weights at once
    dWg[c] = sum dg x[n], dWu[c] = sum du x[n]        transposed SpMM, one gather of x (CSC via sort)
    dWd^T[c] = sum h dy[n]

Hot units (``hot_units``, a set S of k hidden units; ``twell.ops.hot_units``) go through a dense
slice instead: g_S = g[:, S] is taken from the gate GEMM's output and those columns of g are
zeroed before the compaction (so the ELL part, its capacity, the heavy rows and the dense backup
hold the cold units only), then with cuBLAS::

    u_S = x Wu[S]^T,  h_S = relu(g_S) u_S,  y += h_S Wd[:, S]^T,  l1 += mean_n sum_S |h_S|
    dh_S = dy Wd[:, S] + (dL/dl1 / N) sign(h_S),  dg_S = dh_S u_S [g_S > 0],  du_S = dh_S relu(g_S)
    dx += dg_S Wg[S] + du_S Wu[S],  dWg[S] = dg_S^T x,  dWu[S] = du_S^T x,  dWd[:, S] = dy^T h_S

(added into the sparse part's outputs, which are zero there). A unit active on more than ~1/64
of the tokens is cheaper this way (``twell.policy.FFNPolicy.hot_unit_fraction``); it also takes
the longest CSC columns away from the weight-gradient kernel.

Rows with more than KC non-zeros (the ELL capacity) go whole to the dense backup: their g and u
(R x H each) are computed with cuBLAS and saved, their gradients are dense matmuls. In the
default, measuring mode nothing is dropped at any density: when more than
``dense_row_fraction`` of the rows are heavy, every row goes to the dense backup (the call is
then the dense FFN plus one compaction pass). In the no-sync mode (``backup_rows >= 0``) the
backup has the caller's capacity and no all-dense fallback. In training heavy rows beyond it
would be wrong, so the caller checks ``FFNStats.heavy_rows`` against the capacity before using
the results and redoes the call measuring (the trainer does, once per optimizer step,
``ffn.host_sync``). The forward alone (:func:`ell_ffn_forward`) is exact there, with or
without hot units: the heavy rows beyond the capacity go to the overflow kernel
(``twell.ops.overflow_rows``, ours), which reads their count on the device and computes them
densely (with hot units their cold part: the gate zeroed at S, as the backup's; the hot slice is
added to every row afterwards).

NaN / inf: a NaN gate counts as active (``not (g <= 0)``, as on the inference path), so a row
with a NaN input has every unit active, is heavy and goes to the dense backup, where the NaN
reaches y, dx and the three weight gradients as in dense PyTorch; an inf input row does the same
(its +inf gates are active). The ELL part keeps inactive units as exact zeros (an -inf gate adds
no 0 * inf). ``tests/ops/test_ffn_train.py`` checks every path against fp64 autograd.

Saved for backward: x, the three weights as the caller gave them (under autocast the fp32
masters: no compute-dtype copy of a weight is kept; the backward casts Wg and Wu again, ~2 x 15 us
at the 1.5B shape, for 46 MB less per layer between the two), the ELL part at its capacity width
(col int32, g, u: N x KC; slots past a row's length are never read), the row lengths, the indices
of the heavy rows (N in the no-sync backup's unused slots) and their dense g and u, and the CSC
order of the ELL entries (perm int32, colptr, and the dW kernel's longest-column-first order),
built in the forward while the GPU runs the SDDMM and SpMM so that the backward launches little
besides its kernels;
with hot units also their relu'd gate g_S and up u_S (N x k). No N x H tensor outside the
backup rows, and no copy of Wd: the forward's SpMM reads Wd^T as (H, D) rows in the compute
dtype and the backward makes them again, each with one tiled pass that transposes and casts
(``twell.ops.transpose``; PyTorch's strided copy took 75.5 us of a (2048, 5632) bf16 Wd on the
H200), for 23 MB less per layer between the two at D 2048, H 5632. The weight gradients leave in
the weights' dtypes: dWg, dWu written so by the dW kernel, dWd^T transposed into (D, H) and cast
in one more tiled pass.

Host synchronisation: measuring mode (``backup_rows=-1``), exactly one per forward call (reading
R, which sizes the backup). On CUDA it waits on an event recorded right after the compaction
while the SDDMM, SpMM and CSC sort, queued before the wait, keep the GPU busy; none in backward
(R is carried by the saved tensors' shapes). With gradient checkpointing the recomputed forward
syncs once more. No-sync mode (``backup_rows >= 0``): none.

Backends (``twell.ops.train_backend.pick_backend``): the Triton kernels on CUDA (and on CPU tensors
under ``TRITON_INTERPRET=1``; ``twell.ops.train_backend.triton_backend``); the PyTorch backend of the same
sparse math everywhere else (CPU users are never broken) and for float64
(``twell.ops.reference.sparse_train_torch``). Registered as the custom ops
``twell::ffn_train_fwd`` / ``twell::ffn_train_bwd`` (fake impls: traceable by torch.compile).
"""

from __future__ import annotations

import math

import torch

from twell.ops.hot_units import check_hot_units
from twell.ops.reference.sparse_train_torch import valid_slots
from twell.ops.train_backend import (
    cast_train_args,
    check_train_args,
    dense_rows_bwd,
    pick_backend,
)
from twell.policy import FFNPolicy
from twell.stats import FFNStats, default_ell_capacity, stats_from_counts


def _heavy_indices(heavy_N: torch.Tensor, r: int) -> torch.Tensor:
    try:  # no host sync: the size is known
        return torch.nonzero_static(heavy_N, size=r).reshape(-1)
    except (AttributeError, NotImplementedError, RuntimeError):
        return torch.argsort(heavy_N.to(torch.int8), descending=True, stable=True)[:r]


def _down_rows(be, wd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Wd^T as (H, D) rows in the compute dtype, from Wd (D, H) in any float dtype: the
    transpose and the cast in one tiled pass (``be.transposed``; under autocast Wd is the fp32
    master weight, so no bf16 copy of it outlives the forward)."""
    return be.transposed(wd, dtype)


def _ell_fwd(be, x, wu, wdt, col, gv, nnz_eff):
    """SDDMM (u at the ELL non-zeros, per-row L1) and SpMM (y = h Wd^T) of the light rows."""
    y = torch.empty((x.shape[0], wdt.shape[1]), dtype=x.dtype, device=x.device)
    u, l1_N = be.sddmm_fwd(x, wu, col, gv, nnz_eff)
    be.spmm(y, wdt, None, col, gv, u, nnz_eff)
    return y, u, l1_N


def csc_order(col: torch.Tensor, nnz_eff: torch.Tensor, kc: int, h: int):
    """CSC order of the ELL entries, for the weight-gradient kernel.

    Args:
        col: (N, KC) int32 ELL columns; nnz_eff: (N,) int32 slots in use per row.

    Returns:
        perm: (N*KC,) int32 flat ELL indices ``n*KC + k`` sorted by column (stable: row order
            within a column); the unused slots come last. int32 halves what the backward keeps
            (N x KC x 4 bytes a layer); ``sparse_ffn_train`` checks N*KC < 2^31.
            colptr: (H+1,) int64, column c owns
            ``perm[colptr[c]:colptr[c+1]]`` (``colptr[H]`` = entries in use). order: (H,) int64,
            the columns longest first (the dW kernel's launch order).
    """
    # int16 keys while the columns and H fit (H < 2^15): the radix sort makes 2 passes over the
    # N*KC entries instead of int32's 4 (same stable order)
    kdt = torch.int16 if h < 2**15 else torch.int32
    keys = torch.where(valid_slots(nnz_eff, kc), col.to(kdt), h).reshape(-1)  # unused: H, last
    sorted_keys, perm = torch.sort(keys, stable=True)
    colptr = torch.searchsorted(sorted_keys,
                                torch.arange(h + 1, dtype=keys.dtype, device=keys.device))
    del sorted_keys, keys
    lengths = (colptr[1:] - colptr[:-1]).to(torch.int32)  # int32 keys: half the radix passes
    return perm.to(torch.int32), colptr, torch.argsort(lengths, descending=True)


def backup_capacity_for(heavy_rows: float) -> int:
    """No-sync dense-backup capacity for the next call(s) from a measured heavy-row count.

    Args:
        heavy_rows: R, tokens above the ELL capacity (``FFNStats.heavy_rows``; a float or int,
            the maximum over the calls the capacity should cover).

    Returns:
        Rows (int): 0 when no row was heavy (the backup then costs nothing), else
        ``ceil(1.25 R) + 16``. Source: the hybrid layout's dense backup (arXiv 2603.23198,
        hybrid training layout); the margin is ours (BENCHMARKS.md, "Training FFN").
    """
    r = float(heavy_rows)
    return 0 if r <= 0 else math.ceil(1.25 * r) + 16


def _backup_capacity(backup_rows: int, n: int) -> int:
    """Rows of the dense backup in the no-sync mode: the caller's capacity, at most N - 1 (so a
    backward can tell it from the all-dense fallback, whose backup is all N rows)."""
    return max(0, min(backup_rows, n - 1))


def _hot_split(g_NH, hot):
    """g_S = g[:, S] (N, k), the hot units' gate pre-activation taken from the gate GEMM's
    output; those columns of g are zeroed so that the compaction, the heavy-row count and the
    dense backup see only the cold units. None without a hot set."""
    if hot is None:
        return None
    g_S = g_NH.index_select(1, hot)
    g_NH.index_fill_(1, hot, 0)
    return g_S


def _hot_fwd(be, x, wu, g_S, hot):
    """The hot units' dense slice, forward: u_S = x Wu[S]^T, h_S = relu(g_S) u_S.

    Returns (g_S relu'd (N, k), u_S (N, k), h_S (N, k), sum |h_S| (scalar), active units per
    row (N,) int32, per hot unit (k,) int32), or None without a hot set. NaN gates count as
    active (``not (g <= 0)``) and relu(NaN) = NaN, as on the other paths."""
    if g_S is None:
        return None
    u_S = torch.matmul(x, wu.index_select(0, hot).t())
    h_S, l1_S = be.backup_fwd(g_S, u_S)  # g_S <- relu(g_S) in place
    act = ~(g_S <= 0)
    return (g_S, u_S, h_S, l1_S, act.sum(1, dtype=torch.int32),
            act.sum(0, dtype=torch.int32))


def _hot_out(y, wdt, hot, fwd_S):
    """y += h_S Wd[:, S]^T (rows of the (H, D) Wd^T copy); returns the statistics' additions."""
    if fwd_S is None:
        return None
    _, _, h_S, l1_S, nnz_S, cnt_S = fwd_S
    y.addmm_(h_S, wdt.index_select(0, hot))
    return l1_S, nnz_S, cnt_S


def _with_hot_stats(out, hot, add):
    """The forward's outputs with the hot units' L1, per-row and per-unit counts added (the
    statistics are those of the whole FFN; the heavy-row count stays the cold part's)."""
    if add is None:
        return out
    l1_S, nnz_S, cnt_S = add
    y, l1, nnz_N, counts_H, *rest = out
    n = max(nnz_N.shape[0], 1)
    counts_H.index_add_(0, hot, cnt_S)  # zero there: the compaction saw the columns zeroed
    return (y, l1 + l1_S / n, nnz_N + nnz_S, counts_H, *rest)


def _fwd_body(x, wg, wu, wd, ell_capacity: int, dense_row_fraction: float, backend: str,
              backup_rows: int = -1, hot=None, with_csc: bool = True, wdt=None):
    """``twell::ffn_train_fwd`` (its docstring lists the outputs): gate GEMM and compaction,
    then the no-sync mode (``_fwd_nosync``) or the measuring mode (one host sync reads R).
    ``with_csc=False`` (:func:`ell_ffn_forward`, no backward to follow) skips the CSC order:
    perm, colptr and order come out None. ``wdt``: Wd^T as (H, D) contiguous rows in x's dtype
    made by the caller (:func:`ell_ffn_forward`'s ``w_down_t_HD``, a cached copy), else made
    here from ``wd``."""
    be = pick_backend(x, backend)
    # Wg, Wu in the compute dtype for this call only (module docstring, "Saved for backward")
    wg, wu = wg.to(x.dtype), wu.to(x.dtype)
    n = x.shape[0]
    h = wg.shape[0]
    kc = ell_capacity if ell_capacity > 0 else default_ell_capacity(h)
    acc = torch.promote_types(x.dtype, torch.float32)
    g_NH = torch.matmul(x, wg.t())  # (N, H) pre-activation; freed before the sparse part
    if wdt is None:  # (H, D) rows for the SpMM (the backward makes its own)
        wdt = _down_rows(be, wd, x.dtype)
    g_S = _hot_split(g_NH, hot)  # hot units: a dense slice; g_NH keeps the cold ones
    # ELL buffers at the full capacity KC; nnz_eff = nnz_N, or 0 for a heavy row (> KC
    # non-zeros: dense backup); n_heavy = the number of heavy rows (device, (1,)); counted on
    # the cold units
    col, gv, nnz_N, counts_H, nnz_eff, n_heavy = be.compact_heavy(g_NH, kc)
    n_heavy_out = n_heavy.clone()  # an output: must not alias counts_H (one buffer in Triton)
    if backup_rows >= 0:
        fwd_S = _hot_fwd(be, x, wu, g_S, hot)
        r_cap = _backup_capacity(backup_rows, n)
        # forward only: every heavy row in row order (N-padded), with no host sync; the backup
        # takes the first r_cap, the overflow kernel the rest (``_overflow``; with hot units
        # their gate is zero there, as in the backup, and the hot slice is added below).
        # Training (with_csc) keeps its own guard (``ffn.host_sync``) and saved tensors.
        order_N = (torch.nonzero_static(nnz_N > kc, size=n, fill_value=n).reshape(-1)
                   if not with_csc else None)
        # the backup's gates gathered before the ELL forward, and g_NH dropped in this frame
        # (a callee's del would not free it): the N x H gate is not alive beside u and y
        backup = _gather_backup(g_NH, nnz_N, kc, r_cap,
                                None if order_N is None else order_N[:r_cap])
        del g_NH
        out = _fwd_nosync(be, x, wu, kc, acc, col, gv, nnz_N, counts_H, nnz_eff, wdt, backup,
                          n_heavy_out, with_csc)
        if order_N is not None:
            out = _overflow(be, out, x, wg, wu, wdt, order_N[r_cap:], n_heavy, r_cap, hot)
        return _with_hot_stats(out, hot, _hot_out(out[0], wdt, hot, fwd_S)) + _saved_S(x, fwd_S)
    r, y, u, l1_N, csc, fwd_S = _sync_heavy_count(be, x, wu, wdt, g_S, hot, col, gv, nnz_eff,
                                                  n_heavy, kc, h, with_csc)
    all_dense = r > dense_row_fraction * n
    if all_dense:
        r = n
        nnz_eff = torch.zeros_like(nnz_N)
        heavy_idx = torch.arange(n, device=x.device)
        u = gv.new_zeros(gv.shape)  # never read (every row is on the dense backup); zeros
        # keep the op's outputs deterministic (opcheck's eager-vs-AOT comparison)
        l1_light = torch.zeros((), dtype=acc, device=x.device)
        if csc is None and with_csc:  # never read either (the backward returns before dW)
            csc = _placeholder_csc(n, kc, h, x.device)
    else:
        if y is None:  # not queued before the sync (off CUDA)
            y, u, l1_N = _ell_fwd(be, x, wu, wdt, col, gv, nnz_eff)
        if csc is None and with_csc:
            csc = csc_order(col, nnz_eff, kc, h)
        heavy_idx = (_heavy_indices(nnz_N > kc, r) if r > 0
                     else torch.empty((0,), dtype=torch.int64, device=x.device))
        l1_light = l1_N.sum(dtype=acc)
    perm, colptr, order = csc if with_csc else (None, None, None)
    if r > 0:
        # gathered here, not in a callee: only this frame's del frees g_NH before the GEMMs
        if all_dense:
            g_R, x_R = g_NH, x
        else:
            g_R, x_R = g_NH[heavy_idx], x[heavy_idx]
        del g_NH
        u_R, y_R, l1_heavy = _dense_backup_fwd(be, x_R, g_R, wu, wdt)
        if all_dense:
            y = y_R
        else:
            y.index_copy_(0, heavy_idx, y_R)
    else:
        del g_NH
        g_R, u_R = x.new_empty((0, h)), x.new_empty((0, h))
        l1_heavy = 0.0
    l1 = (l1_light + l1_heavy) / max(n, 1)
    out = (y, l1, nnz_N, counts_H, n_heavy_out, nnz_eff, col, gv, u, heavy_idx, g_R, u_R, perm,
           colptr, order)
    return _with_hot_stats(out, hot, _hot_out(y, wdt, hot, fwd_S)) + _saved_S(x, fwd_S)


def _sync_heavy_count(be, x, wu, wdt, g_S, hot, col, gv, nnz_eff, n_heavy, kc: int, h: int,
                      with_csc: bool = True):
    """The measuring mode's one host sync: reads R, the number of heavy rows (device (1,)
    int32 ``n_heavy``), which sizes the dense backup.

    Returns:
        (R (int), y (N, D), u (N, KC), l1_N (N,), the CSC order ``(perm, colptr, order)``, the
        hot units' forward (``_hot_fwd``)). On CUDA y, u and l1_N are the light rows' SDDMM and
        SpMM (``_ell_fwd``) and the CSC order ``csc_order``'s (None without ``with_csc``), all
        queued before the wait; elsewhere those four are None (the caller computes them once R
        is known).
    """
    # On CUDA the sync waits on an event recorded right after the compaction, not on the
    # whole stream, with the SDDMM, SpMM and CSC sort (which need no host value) queued before
    # it, so the GPU stays busy while the host reads R (a sync before them left ~0.2 ms idle on
    # the H200).
    if not x.is_cuda:
        fwd_S = _hot_fwd(be, x, wu, g_S, hot)
        return int(n_heavy[0]), None, None, None, None, fwd_S
    r_host = torch.empty(1, dtype=torch.int32, pin_memory=True)
    r_host.copy_(n_heavy, non_blocking=True)
    r_ready = torch.cuda.Event()
    r_ready.record()
    y, u, l1_N = _ell_fwd(be, x, wu, wdt, col, gv, nnz_eff)  # discarded if all rows go dense
    # the CSC order too, before the wait: the host has almost nothing left to launch after
    # it (1.86x vs 1.62x queued after the wait, 0.3 %, H200)
    csc = csc_order(col, nnz_eff, kc, h) if with_csc else None
    fwd_S = _hot_fwd(be, x, wu, g_S, hot)  # and the hot slice's GEMM
    r_ready.synchronize()
    return int(r_host[0]), y, u, l1_N, csc, fwd_S


def _placeholder_csc(n: int, kc: int, h: int, device: torch.device):
    """A stand-in of ``csc_order``'s shapes and dtypes (perm (N*KC,) int32 zeros, colptr (H+1,)
    int64 zeros, order (H,) int64 0..H-1) for the all-dense forward off CUDA, where the CSC
    order is not built before the sync."""
    return (torch.zeros((n * kc,), dtype=torch.int32, device=device),
            torch.zeros((h + 1,), dtype=torch.int64, device=device),
            torch.arange(h, device=device))


def _dense_backup_fwd(be, x_R, g_R, wu, wdt):
    """The dense backup's forward over its R rows: u_R = x_R Wu^T and y_R = h_R Wd^T (dense
    GEMMs, ``wdt`` the (H, D) rows), h_R = relu(g_R) u_R (``be.backup_fwd``, which relus g_R
    (R, H) in place: saved so). Returns u_R (R, H), y_R (R, D) and sum |h_R| (a scalar,
    accumulated in fp32 or wider)."""
    u_R = torch.matmul(x_R, wu.t())
    h_R, l1_heavy = be.backup_fwd(g_R, u_R)  # g_R <- relu(g_R) in place
    return u_R, torch.matmul(h_R, wdt), l1_heavy


def _saved_S(x, fwd_S):
    """(g_S, u_S) saved for backward: relu'd gate and up of the hot units, (N, 0) without."""
    if fwd_S is None:
        return (x.new_empty((x.shape[0], 0)), x.new_empty((x.shape[0], 0)))
    return fwd_S[0], fwd_S[1]


def _gather_backup(g_NH, nnz_N, kc: int, r_cap: int, heavy_idx=None):
    """The no-sync dense backup's rows: (heavy_idx (r_cap,) int64, rows, g_R (r_cap, H)). The
    heavy rows fill it in row order; its unused slots keep the index N in ``heavy_idx`` (saved),
    which the row scatters (``be.add_rows``) skip in y and, in backward, dx; ``rows`` is
    ``heavy_idx`` clamped to N - 1 for the gathers, where those slots get a zero gate, so they
    add exact zeros to l1 and the weight gradients. r_cap = 0: no backup (rows None).
    ``heavy_idx``: those indices when the caller has them (the first r_cap of its N-padded
    row-order list of heavy rows), else found here."""
    n, h = g_NH.shape
    if r_cap == 0:
        return torch.empty((0,), dtype=torch.int64, device=g_NH.device), None, g_NH.new_empty((0, h))
    if heavy_idx is None:
        heavy_idx = torch.nonzero_static(nnz_N > kc, size=r_cap, fill_value=n).reshape(-1)
    rows = heavy_idx.clamp(max=n - 1)
    return heavy_idx, rows, torch.where((heavy_idx < n)[:, None], g_NH[rows], 0)


def _fwd_nosync(be, x, wu, kc, acc, col, gv, nnz_N, counts_H, nnz_eff, wdt, backup, n_heavy,
                with_csc: bool = True):
    """The forward with no host synchronisation: the dense backup (``_gather_backup``) has the
    capacity the caller chose from earlier measurements. Heavy rows beyond it are zero here
    (their ELL part is empty): training compares ``FFNStats.heavy_rows`` (or the returned
    count) with the capacity before using the step and redoes it in the measuring mode; the
    forward alone computes them afterwards (``_overflow``)."""
    heavy_idx, rows, g_R = backup
    n, h = x.shape[0], g_R.shape[1]
    y, u, l1_N = _ell_fwd(be, x, wu, wdt, col, gv, nnz_eff)
    perm, colptr, order = (csc_order(col, nnz_eff, kc, h) if with_csc
                           else (None, None, None))
    l1 = l1_N.sum(dtype=acc)
    if rows is not None:
        u_R, y_R, l1_heavy = _dense_backup_fwd(be, x[rows], g_R, wu, wdt)
        # heavy rows have an empty ELL part (y = 0 there): y + y_R, rounded once; unused slots
        # skipped (no atomics, no adds onto row N - 1: twell.ops.add_rows)
        be.add_rows(y, heavy_idx, y_R)
        del y_R
        l1 = l1 + l1_heavy
    else:
        u_R = x.new_empty((0, h))
    return (y, l1 / max(n, 1), nnz_N, counts_H, n_heavy, nnz_eff, col, gv, u, heavy_idx, g_R,
            u_R, perm, colptr, order)


def _overflow(be, out, x, wg, wu, wdt, over_idx, n_heavy, r_cap: int, hot=None):
    """The forward-only no-sync mode's overflow rows: the heavy rows past the backup's r_cap
    (``over_idx``: the rest of the N-padded row-order list of heavy rows; the device count
    ``n_heavy`` says how many are used, read by the kernel, not the host) computed densely and
    stored into y (``be.overflow_rows``), their sum |h| added to l1. ``out``: ``_fwd_nosync``'s
    outputs (y and l1 replaced). With no overflow the kernel's programs read the count and exit,
    and l1 gains an exact 0. ``hot``: the hot units ((k,) int64) or None; the kernel zeroes the
    gate there, as the backup's, so these rows hold the cold part and the hot slice
    (``_hot_out``, after this) is counted once, in y and in l1 (``_with_hot_stats``)."""
    y, l1 = out[0], out[1]
    n = max(x.shape[0], 1)
    l1_over = be.overflow_rows(y, x, wg.contiguous(), wu.contiguous(), wdt, over_idx, n_heavy,
                               r_cap, hot)
    return (y, l1 + l1_over.sum(dtype=l1.dtype) / n, *out[2:])


def _hot_bwd(be, dy, scale, x, wg, wu, wdt, hot, g_S, u_S, dx, dwg, dwu, dwdt=None, dwd=None):
    """The hot units' dense slice, backward, added into the outputs of the rest (zero at S)::

        dh_S = dy Wd[:, S] + scale sign(h_S),  dg_S = dh_S u_S [g_S > 0],  du_S = dh_S relu(g_S)
        dx += dg_S Wg[S] + du_S Wu[S],  dWg[S] += dg_S^T x,  dWu[S] += du_S^T x,
        dWd[:, S] += dy^T h_S  (into ``dwdt`` (H, D) rows, or ``dwd`` (D, H) columns)
    """
    if hot is None:
        return
    k = hot.shape[0]
    dh_S = torch.matmul(dy, wdt.index_select(0, hot).t())
    dg_S, du_S, h_S = be.backup_bwd(dh_S, g_S, u_S, scale)
    # [dg_S du_S] (N, 2k) against [Wg[S]; Wu[S]] (2k, D): dx and x are read once, not twice
    # (2 x 64 MiB less traffic at N 16384, D 2048; BENCHMARKS.md, "Hot/cold split")
    dgu = torch.cat((dg_S, du_S), 1)
    dx.addmm_(dgu, torch.cat((wg.index_select(0, hot), wu.index_select(0, hot))))
    dw_gu = torch.matmul(dgu.t(), x)
    # the hot units are distinct (check_hot_units): row scatters without atomics
    be.add_rows(dwg, hot, dw_gu[:k].to(dwg.dtype))  # dWg, dWu may be in the weights' fp32
    be.add_rows(dwu, hot, dw_gu[k:].to(dwu.dtype))
    if dwdt is not None:
        be.add_rows(dwdt, hot, torch.matmul(h_S.t(), dy))
    else:  # all-dense backward: columns of dWd (D, H)
        dwd.index_add_(1, hot, torch.matmul(dy.t(), h_S))


def _bwd_body(dy, dl1, x, wg, wu, wd, nnz_eff, col, gv, u, heavy_idx, g_R, u_R, perm, colptr,
              order, hot, g_S, u_S, backend):
    be = pick_backend(x, backend)
    n, d = x.shape
    h = wg.shape[0]
    r = heavy_idx.shape[0]
    dy = dy.to(x.dtype).contiguous()
    # the saved Wg, Wu are the caller's (the fp32 masters under autocast): cast again here, and
    # their gradients leave in the caller's dtypes (what autograd's cast did when the op got
    # copies); the dW kernel writes dWg, dWu in them directly (fp32 accumulation: no cast pass)
    dt_g, dt_u = wg.dtype, wu.dtype
    wg, wu = wg.to(x.dtype), wu.to(x.dtype)
    scale = (dl1 / max(n, 1)).reshape(())
    all_dense = r == n and n > 0
    # Wd^T (H, D) in the compute dtype made again from the saved Wd (module docstring, "Saved
    # for backward"); the all-dense branch without hot units reads Wd (D, H) as it is
    if not all_dense or hot is not None:
        wdt = _down_rows(be, wd, x.dtype)
        wd_c = wdt.t()
    else:
        wdt, wd_c = None, wd.to(x.dtype)
    adds = None
    if r > 0:
        # the no-sync backup's unused slots hold N (``_fwd_nosync``): clamped for the gathers
        rows = None if all_dense else heavy_idx.clamp(max=n - 1)
        dy_R = dy if all_dense else dy[rows]
        x_R = x if all_dense else x[rows]
        dx_R, dwg_R, dwu_R, dwd_R = dense_rows_bwd(be, dy_R, scale, x_R, wg, wu, wd_c, g_R, u_R,
                                               wd_transposed=not all_dense)
        if all_dense:
            _hot_bwd(be, dy, scale, x, wg, wu, wdt, hot, g_S, u_S, dx_R, dwg_R, dwu_R, dwd=dwd_R)
            return dx_R, dwg_R.to(dt_g), dwu_R.to(dt_u), dwd_R.to(wd.dtype)
        adds = (dwg_R, dwu_R, dwd_R)  # (H, D) each: the dW kernel adds them
    dx = torch.empty_like(x)
    dwg = torch.empty((h, d), dtype=dt_g, device=x.device)
    dwu = torch.empty((h, d), dtype=dt_u, device=x.device)
    dwdt = torch.empty((h, d), dtype=x.dtype, device=x.device)
    dg, du = be.sddmm_bwd(dy, wdt, col, gv, u, nnz_eff, scale)
    be.spmm(dx, wg, wu, col, dg, du, nnz_eff)
    be.dw(dwg, dwu, dwdt, adds, x, dy, perm, colptr, dg, du, gv, u, order=order)
    if r > 0:  # heavy rows: their ELL part is empty (dx = 0 there); unused slots skipped
        be.add_rows(dx, heavy_idx, dx_R.to(dx.dtype))
    _hot_bwd(be, dy, scale, x, wg, wu, wdt, hot, g_S, u_S, dx, dwg, dwu, dwdt=dwdt)
    # dWd in Wd's dtype and (D, H) layout: one tiled pass (transpose and cast together)
    return dx, dwg, dwu, be.transposed(dwdt, wd.dtype)


@torch.library.custom_op("twell::ffn_train_fwd", mutates_args=())
def _ffn_train_fwd(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    ell_capacity: int,
    dense_row_fraction: float,
    backend: str,
    backup_rows: int = -1,
    hot_units: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns y, l1, nnz_N, counts_H (of the whole FFN), n_heavy ((1,) int32, rows above the
    ELL capacity in the cold units), then the saved state: nnz_eff, col, g, u (N x KC),
    heavy_idx, g_R, u_R, the CSC order of the ELL entries (perm, colptr, order), and the
    hot units' relu'd gate g_S and up u_S (N x k) (see ``_fwd_body``)."""
    with torch.autocast(x.device.type, enabled=False):
        return _fwd_body(x, w_gate, w_up, w_down, ell_capacity, dense_row_fraction, backend,
                         backup_rows, hot_units)


@_ffn_train_fwd.register_fake
def _ffn_train_fwd_fake(x, w_gate, w_up, w_down, ell_capacity, dense_row_fraction, backend,
                        backup_rows=-1, hot_units=None):
    ctx = torch.library.get_ctx()
    n, d = x.shape
    h = w_gate.shape[0]
    k_hot = 0 if hot_units is None else hot_units.shape[0]
    k = ell_capacity if ell_capacity > 0 else default_ell_capacity(h)  # ELL capacity KC
    # dense-backup rows: the given capacity, or measured
    r = _backup_capacity(backup_rows, n) if backup_rows >= 0 else ctx.new_dynamic_size()
    acc = torch.promote_types(x.dtype, torch.float32)
    i32 = {"dtype": torch.int32}
    i64 = {"dtype": torch.int64}
    return (
        x.new_empty((n, d)), x.new_empty((), dtype=acc), x.new_empty((n,), **i32),
        x.new_empty((h,), **i32), x.new_empty((1,), **i32), x.new_empty((n,), **i32),
        x.new_empty((n, k), **i32), x.new_empty((n, k)), x.new_empty((n, k)),
        x.new_empty((r,), **i64), x.new_empty((r, h)), x.new_empty((r, h)),
        x.new_empty((n * k,), **i32), x.new_empty((h + 1,), **i64),
        x.new_empty((h,), **i64), x.new_empty((n, k_hot)), x.new_empty((n, k_hot)),
    )


@torch.library.custom_op("twell::ffn_train_bwd", mutates_args=())
def _ffn_train_bwd(
    dy: torch.Tensor,
    dl1: torch.Tensor,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    nnz_eff: torch.Tensor,
    col: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    heavy_idx: torch.Tensor,
    g_R: torch.Tensor,
    u_R: torch.Tensor,
    perm: torch.Tensor,
    colptr: torch.Tensor,
    order: torch.Tensor,
    hot_units: torch.Tensor | None,
    g_S: torch.Tensor,
    u_S: torch.Tensor,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns dx, dWg, dWu, dWd (see ``_bwd_body``)."""
    with torch.autocast(x.device.type, enabled=False):
        return _bwd_body(dy, dl1, x, w_gate, w_up, w_down, nnz_eff, col, g, u, heavy_idx,
                         g_R, u_R, perm, colptr, order, hot_units, g_S, u_S, backend)


@_ffn_train_bwd.register_fake
def _ffn_train_bwd_fake(dy, dl1, x, w_gate, w_up, w_down, *rest):
    return (torch.empty_like(x), torch.empty_like(w_gate), torch.empty_like(w_up),
            torch.empty_like(w_down))


def _setup_context(ctx, inputs, output):
    x, wg, wu, wd, _, _, backend = inputs[:7]
    hot = inputs[8] if len(inputs) > 8 else None
    ctx.backend = backend
    ctx.has_hot = hot is not None
    ctx.save_for_backward(x, wg, wu, wd, *output[5:], *([hot] if ctx.has_hot else []))
    ctx.mark_non_differentiable(*output[2:])
    # the 15 non-differentiable outputs reach backward as None instead of zero-filled tensors
    # (a profiler trace showed ~11 fill kernels and their allocations per step)
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dl1, *_unused):
    (x, wg, wu, wd, nnz_eff, col, g, u, heavy_idx, g_R, u_R, perm, colptr, order, g_S, u_S,
     *hot) = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(x[:, : wd.shape[0]])
    if dl1 is None:
        dl1 = torch.zeros((), dtype=torch.float32, device=x.device)
    dx, dwg, dwu, dwd = _ffn_train_bwd(
        dy, dl1, x, wg, wu, wd, nnz_eff, col, g, u, heavy_idx, g_R, u_R, perm, colptr, order,
        hot[0] if hot else None, g_S, u_S, ctx.backend,
    )
    return dx, dwg, dwu, dwd, None, None, None, None, None


torch.library.register_autograd("twell::ffn_train_fwd", _backward, setup_context=_setup_context)


def sparse_ffn_train(
    x_ND: torch.Tensor,
    w_gate_HD: torch.Tensor,
    w_up_HD: torch.Tensor,
    w_down_DH: torch.Tensor,
    *,
    with_stats: bool = True,
    ell_capacity: int | None = None,
    dense_row_fraction: float | None = None,
    backend: str = "auto",
    backup_rows: int = -1,
    policy: FFNPolicy | None = None,
    hot_units: torch.Tensor | None = None,
) -> tuple[torch.Tensor, FFNStats | None]:
    """Gated ReLU FFN ``y = (relu(x Wg^T) * (x Wu^T)) Wd^T`` on the ``ell`` training path.

    Source: arXiv 2603.23198, hybrid ELL + dense-backup training kernels.
    Same results as ``twell.ops.reference.gated_ffn_torch`` (up to summation order); gradients flow to
    x and all three weights, and to the L1 term through ``stats.l1``.

    Args:
        x_ND: (N, D) float input (CUDA: Triton kernels; CPU: PyTorch, or the Triton
            interpreter with ``TRITON_INTERPRET=1``). Under autocast, x and the weights are
            cast to the autocast dtype (fp32 master weights get fp32 gradients).
        w_gate_HD: (H, D) gate weight (the non-gated FFN is not supported here).
        w_up_HD: (H, D) up weight.
        w_down_DH: (D, H) down weight.
        with_stats: also return :class:`FFNStats` (l1 differentiable; nnz_sum, nnz_max and
            active_counts from the compaction counts, detached).
        ell_capacity: KC, ELL slots per row; rows with more non-zeros go to the dense backup.
            0 = ``default_ell_capacity(H)`` (128 at H = 5632); None = ``policy.ell_capacity``.
        dense_row_fraction: if more than this fraction of the rows is heavy, the whole call
            runs through the dense backup; None = ``policy.dense_row_fraction``.
        backend: ``"auto"`` (Triton when usable, else PyTorch), ``"triton"`` or ``"torch"``.
        backup_rows: -1 (default): measure R, the number of heavy rows, with one host
            synchronisation per call and size the dense backup to it (exact on every input;
            above ``dense_row_fraction`` every row goes dense). ``>= 0``: **no host
            synchronisation**; the backup has ``min(backup_rows, N - 1)`` rows (the caller's
            capacity, e.g. from the previous step's ``FFNStats.heavy_rows``) and no all-dense
            fallback. The result is exact when ``stats.heavy_rows <= min(backup_rows, N - 1)``;
            otherwise the rows beyond the capacity are wrong, and the caller must discard the
            call's results and redo it with -1 (the trainer does, once per optimizer step).
        policy: :class:`twell.policy.FFNPolicy` giving the capacity and fraction not passed
            explicitly (default: the defaults).
        hot_units: (k,) int64 tensor on x's device, unique hidden-unit indices computed through
            a dense slice (cuBLAS: ``x Wu[S]^T``, ``h_S Wd[:, S]^T`` and the backward's six
            products), the rest through the ELL path; None or empty = none. Pick them with
            :func:`twell.ops.hot_units.hot_units_from_counts` (no host sync here either way).
            The heavy rows, the ELL capacity and the dense backup then concern the cold units
            only: ``stats.heavy_rows`` counts the tokens with more than KC active cold units
            (what the no-sync capacity must hold); l1, nnz and active_counts stay those of the
            whole FFN.

    Returns:
        (y_ND in the compute dtype, FFNStats or None).

    Raises:
        ValueError: a shape, dtype, device or option mismatch (the message names it).
    """
    check_train_args(x_ND, w_gate_HD, w_up_HD, w_down_DH, backend, "sparse_ffn_train")
    ell_capacity, dense_row_fraction = _train_options(policy, ell_capacity, dense_row_fraction,
                                                      backup_rows, with_stats)
    hot = check_hot_units(hot_units, w_gate_HD.shape[0], x_ND.device, "sparse_ffn_train")
    # The weights are passed as they are (the fp32 masters under autocast): the forward and the
    # backward each make their compute-dtype copies, so the saved state holds none (Wd: 0.88 GB
    # less at 2B, micro-batch 8; Wg and Wu twice that; BENCHMARKS.md)
    x, wg, wu, wd = cast_train_args(x_ND, w_gate_HD, w_up_HD, w_down_DH, cast_weights=False)
    n = x.shape[0]
    _check_int32_slots(n, ell_capacity or default_ell_capacity(wg.shape[0]))
    if n == 0:
        from twell.ops.reference import gated_ffn_torch

        return gated_ffn_torch(x, wg.to(x.dtype), wu.to(x.dtype), wd.to(x.dtype),
                               with_stats=with_stats, ell_capacity=ell_capacity)
    args = (x, wg, wu, wd, int(ell_capacity), float(dense_row_fraction), backend,
            int(backup_rows))
    out = _ffn_train_fwd(*args) if hot is None else _ffn_train_fwd(*args, hot)
    return out[0], (_train_stats(out) if with_stats else None)


@torch.no_grad()
def ell_ffn_forward(
    x_ND: torch.Tensor,
    w_gate_HD: torch.Tensor,
    w_up_HD: torch.Tensor,
    w_down_DH: torch.Tensor,
    *,
    ell_capacity: int | None = None,
    dense_row_fraction: float | None = None,
    backend: str = "auto",
    backup_rows: int = -1,
    policy: FFNPolicy | None = None,
    hot_units: torch.Tensor | None = None,
    w_down_t_HD: torch.Tensor | None = None,
    with_stats: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, FFNStats]:
    """The forward of :func:`sparse_ffn_train`'s hybrid layout alone, for inference: the same
    gate GEMM, hot-unit slice, compaction, SDDMM + SpMM of the light rows and dense backup of
    the heavy rows, so ``y`` is bitwise the training op's (except the no-sync mode's overflow
    rows, below), but no autograd, no CSC order (the weight gradient's radix sort) and nothing
    kept for a backward. Inference ``auto`` (``twell.ops.ffn.sparse_ffn``) times it as its
    ``"ell"`` candidate beside TwELL and dense (``twell.ops.auto``), without hot units: a
    bucket's first call measures, later ones use the no-sync mode (``twell.ops.ffn._ell``).

    Source: arXiv 2603.23198, the hybrid ELL + dense-backup layout (its forward half); the
    overflow kernel (``twell.ops.overflow_rows``) is ours.

    Args:
        x_ND, w_gate_HD, w_up_HD, w_down_DH: as :func:`sparse_ffn_train` ((N, D), (H, D),
            (H, D), (D, H); float; autocast casts them the same way).
        ell_capacity, dense_row_fraction, backend, policy, hot_units: as
            :func:`sparse_ffn_train`.
        backup_rows: -1: one host synchronisation reads the heavy-row count and sizes the
            dense backup (exact on every input; above ``dense_row_fraction`` every row goes
            dense). ``>= 0``: no synchronisation, a backup of ``min(backup_rows, N - 1)`` rows
            (no all-dense fallback); exact on every input, with or without hot units: heavy
            rows beyond the backup (rank >= its capacity in row order) are computed by the
            overflow kernel, whose row count is read on the device (with none, one launch
            whose programs exit; with hot units also an (H,) mask of the cold units, built
            each call). With hot units the kernel computes those rows' cold part (the gate
            zeroed at S, as the backup's) and the hot slice is added to them as to every row.
            Those rows are within bf16 / fp16 rounding of the backup's cuBLAS result (another
            summation order), not bitwise the training op's; every other row is. The returned
            count still says how many rows were heavy (what the next capacity must hold).
        w_down_t_HD: optional (H, D) contiguous ``w_down_DH.T`` in the compute dtype (x's, or
            autocast's) on x's device, e.g. ``TwELLState.down_t``'s cached copy: the forward
            then skips its own transposing cast of Wd (one tiled pass, ~11 us a call at D 2048,
            H 5632 on the H200). The same values, so y is bitwise the same.
        with_stats: also return the call's :class:`FFNStats`, those :func:`sparse_ffn_train`
            returns on the same input (l1 = mean over rows of sum |h|, nnz_sum, nnz_max,
            active_counts (H,) int32, n_tokens, heavy_rows), all detached; with overflow rows
            (no-sync mode) their l1 terms are the overflow kernel's, in fp32.

    Returns:
        ``(y, heavy)``, or ``(y, heavy, stats)`` with ``with_stats``: y (N, D) in the compute
        dtype; heavy (1,) int32 on x's device, tokens with more than KC active cold units
        (what a no-sync capacity must hold).

    Raises:
        ValueError: a shape, dtype, device or option mismatch (the message names it), and a
            ``w_down_t_HD`` of another shape, dtype, device or not contiguous.
    """
    check_train_args(x_ND, w_gate_HD, w_up_HD, w_down_DH, backend, "ell_ffn_forward")
    kc, dense_row_fraction = _train_options(policy, ell_capacity, dense_row_fraction,
                                            backup_rows, True, "ell_ffn_forward")
    h = w_gate_HD.shape[0]
    hot = check_hot_units(hot_units, h, x_ND.device, "ell_ffn_forward")
    x, wg, wu, wd = cast_train_args(x_ND, w_gate_HD, w_up_HD, w_down_DH, cast_weights=False)
    _check_down_t(w_down_t_HD, h, wd.shape[0], x)
    n = x.shape[0]
    if n == 0:  # as sparse_ffn_train's empty call: the dense reference's y and statistics
        from twell.ops.reference import gated_ffn_torch

        y, st = gated_ffn_torch(x, wg.to(x.dtype), wu.to(x.dtype), wd.to(x.dtype),
                                with_stats=with_stats, ell_capacity=kc)
        heavy = torch.zeros((1,), dtype=torch.int32, device=x.device)
        return (y, heavy) if not with_stats else (y, heavy, st)
    # autocast off past the cast, as in twell::ffn_train_fwd: the PyTorch backend's fp32
    # accumulating einsums would otherwise run in bf16 (y no longer the training op's)
    with torch.autocast(x.device.type, enabled=False):
        out = _fwd_body(x, wg, wu, wd, int(kc), float(dense_row_fraction), backend,
                        int(backup_rows), hot, with_csc=False, wdt=w_down_t_HD)
    if not with_stats:
        return out[0], out[4]
    return out[0], out[4], _train_stats(out)


def _check_down_t(w_down_t_HD: torch.Tensor | None, h: int, d: int, x: torch.Tensor) -> None:
    """Raise ValueError unless ``w_down_t_HD`` is None or an (H, D) contiguous tensor in x's
    dtype on x's device (:func:`ell_ffn_forward`'s precomputed Wd^T)."""
    if w_down_t_HD is None:
        return
    t = w_down_t_HD
    if (tuple(t.shape) != (h, d) or t.dtype != x.dtype or t.device != x.device
            or not t.is_contiguous()):
        raise ValueError(
            f"ell_ffn_forward: w_down_t_HD must be w_down_DH.T as a contiguous (H={h}, D={d}) "
            f"tensor of the compute dtype {x.dtype} on {x.device}; got {tuple(t.shape)} "
            f"{t.dtype} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}. "
            "Pass w_down_DH.T.to(dtype).contiguous() or None")


def _train_options(policy: FFNPolicy | None, ell_capacity: int | None,
                   dense_row_fraction: float | None, backup_rows: int,
                   with_stats: bool, fn: str = "sparse_ffn_train") -> tuple[int, float]:
    """``sparse_ffn_train``'s ELL capacity KC (0 = the default for H) and dense-row fraction:
    the arguments, or the policy's where None (``FFNPolicy()``'s without a policy), checked
    together with ``backup_rows``; ``fn`` names the caller in the messages.

    Raises:
        ValueError: backup_rows < -1, backup_rows >= 0 with ``with_stats=False``, ell_capacity
            < 0 or dense_row_fraction outside [0, 1].
    """
    policy = policy if policy is not None else FFNPolicy()
    ell_capacity = policy.ell_capacity if ell_capacity is None else ell_capacity
    if dense_row_fraction is None:
        dense_row_fraction = policy.dense_row_fraction
    if backup_rows < -1:
        raise ValueError(f"{fn}: backup_rows must be -1 (measure per call) or a "
                         f"capacity >= 0; got {backup_rows}")
    if backup_rows >= 0 and not with_stats:
        raise ValueError(f"{fn}: backup_rows >= 0 needs with_stats=True (the caller "
                         "checks stats.heavy_rows against the capacity)")
    if ell_capacity < 0 or not 0.0 <= dense_row_fraction <= 1.0:
        raise ValueError(
            f"{fn}: ell_capacity must be >= 0 (0 = default) and dense_row_fraction in [0, 1]; "
            f"got {ell_capacity}, {dense_row_fraction}"
        )
    return ell_capacity, dense_row_fraction


def _check_int32_slots(n: int, kc: int) -> None:
    """Raise ValueError unless N * KC < 2^31: the CSC order's flat ELL slot indices
    (``csc_order``'s perm) are int32."""
    if n * kc >= 2**31:
        raise ValueError(f"sparse_ffn_train: N x ELL capacity = {n} x {kc} must be below 2^31 "
                         "(int32 slot indices); pass fewer rows per call or a smaller ell_capacity")


def _train_stats(out) -> FFNStats:
    """FFNStats of the op's outputs: l1, nnz_N and counts_H of the whole FFN, heavy_rows the
    op's own count (rows above the ELL capacity in the cold units)."""
    st = stats_from_counts(out[1], out[2], out[3])
    st.heavy_rows = out[4].reshape(()).float()
    return st
