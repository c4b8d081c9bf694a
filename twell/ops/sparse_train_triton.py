"""Triton kernels of the hybrid (ELL + dense backup) training path of the ReLU-gated FFN.

Shape legend: N tokens, D model width, H FFN width, K ELL width (slots per row), KC ELL
capacity (the widest K allowed), J entries of one column in CSC order.

Layout (arXiv 2603.23198, "Hybrid (training)", see ``shared/PAPER.md``): row n of the ELL part
holds its non-zeros in slots ``k < nnz[n]``::

    col_NK[n, k]  int32   hidden unit (column) of the k-th non-zero of row n, ascending
    g_NK[n, k]    dtype   relu(gate)[n, col] (> 0)
    u_NK[n, k]    dtype   up[n, col] = x[n] . Wu[col]

Slots ``k >= nnz[n]`` are never read (their contents are undefined). Rows with more non-zeros
than the capacity go to the dense backup (handled with cuBLAS by the caller) and have
``nnz[n] = 0`` here, so every kernel below skips them.

All kernels accumulate in fp32 and index with int64 (no wrap past 2^31 elements or 65,536 tokens).
The launchers check contiguity and dtypes; the math lives in the kernel docstrings.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl


@triton.jit
def _compact_kernel(
    g_ptr,  # (N, H) gate pre-activation x Wg^T, row-major, any float dtype
    col_ptr,  # (N, KC) int32 out: columns of the first KC non-zeros of each row
    val_ptr,  # (N, KC) out, dtype of g: relu(g) at those columns
    nnz_ptr,  # (N,) int32 out: non-zeros of each row (all of them, also past KC)
    counts_ptr,  # (H,) int32 in/out, zeroed by the launcher: tokens in which each unit is active
    N,  # rows
    H,  # columns
    stride_g,  # row stride of g (elements)
    KC,  # ELL capacity (slots per row)
    BLOCK_N: tl.constexpr,  # rows per program
    BLOCK_H: tl.constexpr,  # columns per step (power of two)
):
    """ReLU + compaction: per row, slot ``pos = #(active columns before c)`` gets (c, g[n, c]).

    active[n, c] = g[n, c] > 0; nnz[n] = sum_c active; counts[c] += sum_n active (atomics, one
    vector per program and column block, only where non-zero).
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mrow = rows < N
    rows64 = rows.to(tl.int64)
    base = tl.zeros([BLOCK_N], dtype=tl.int32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mcol = cols < H
        m = mrow[:, None] & mcol[None, :]
        g = tl.load(g_ptr + rows64[:, None] * stride_g + cols[None, :], mask=m, other=0.0)
        act = g > 0
        a = act.to(tl.int32)
        pos = base[:, None] + tl.cumsum(a, axis=1) - 1
        keep = act & (pos < KC)
        dst = rows64[:, None] * KC + pos
        tl.store(col_ptr + dst, tl.broadcast_to(cols[None, :], [BLOCK_N, BLOCK_H]), mask=keep)
        tl.store(val_ptr + dst, g, mask=keep)
        base += tl.sum(a, axis=1)
        cnt = tl.sum(a, axis=0)
        tl.atomic_add(counts_ptr + cols, cnt, mask=mcol & (cnt > 0))
    tl.store(nnz_ptr + rows, base, mask=mrow)


@triton.jit
def _sddmm_kernel(
    a_ptr,  # (N, D) row operand: x (forward) or dy (backward)
    w_ptr,  # (H, D) weight rows gathered per non-zero: Wu (forward) or Wd^T (backward)
    col_ptr,  # (N, K) int32 ELL columns
    g_ptr,  # (N, K) relu(gate) at the non-zeros
    u_ptr,  # (N, K) up value at the non-zeros: written (forward) or read (backward)
    nnz_ptr,  # (N,) int32 ELL row lengths (0 for dense-backup rows)
    dg_ptr,  # (N, K) fp32 out (backward): dL/dgate at the non-zeros
    du_ptr,  # (N, K) fp32 out (backward): dL/dup at the non-zeros
    l1_ptr,  # forward: (N,) fp32 out, sum_k |h[n, k]|; backward: (1,) fp32 in, dL/dl1 / N
    D,  # model width
    K,  # ELL width (row stride of the (N, K) operands)
    stride_a,  # row stride of a
    stride_w,  # row stride of w
    BACKWARD: tl.constexpr,  # False: forward up-projection; True: backward dh
    BLOCK_K: tl.constexpr,  # slots per step
    BLOCK_D: tl.constexpr,  # model-width chunk
):
    """SDDMM at the ELL non-zeros: ``v[n, k] = a[n] . w[col[n, k]]``.

    Forward (a = x, w = Wu): u = v (stored in u's dtype), l1[n] = sum_k |g * u|.
    Backward (a = dy, w = Wd^T): dh = v + (dL/dl1 / N) * sign(h), sign(h) = sign(u) as g > 0;
    dg = dh * u, du = dh * g (relu' = 1 at the non-zeros, 0 elsewhere).
    """
    n = tl.program_id(0).to(tl.int64)
    nnz = tl.load(nnz_ptr + n)
    l1acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    if BACKWARD:
        scale = tl.load(l1_ptr)
    for k0 in range(0, nnz, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < nnz
        cols = tl.load(col_ptr + n * K + offs_k, mask=mk, other=0).to(tl.int64)
        acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            md = offs_d < D
            a = tl.load(a_ptr + n * stride_a + offs_d, mask=md, other=0.0).to(tl.float32)
            w = tl.load(
                w_ptr + cols[:, None] * stride_w + offs_d[None, :],
                mask=mk[:, None] & md[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += w * a[None, :]
        v = tl.sum(acc, axis=1)
        g = tl.load(g_ptr + n * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        if BACKWARD:
            u = tl.load(u_ptr + n * K + offs_k, mask=mk, other=0.0).to(tl.float32)
            sgn = tl.where(u > 0, 1.0, tl.where(u < 0, -1.0, 0.0))
            dh = v + scale * sgn
            tl.store(dg_ptr + n * K + offs_k, dh * u, mask=mk)
            tl.store(du_ptr + n * K + offs_k, dh * g, mask=mk)
        else:
            u_st = v.to(u_ptr.dtype.element_ty)
            tl.store(u_ptr + n * K + offs_k, u_st, mask=mk)
            l1acc += tl.abs(g * u_st.to(tl.float32))
    if not BACKWARD:
        tl.store(l1_ptr + n, tl.sum(l1acc, axis=0))


@triton.jit
def _spmm_kernel(
    out_ptr,  # (N, D) out
    w1_ptr,  # (H, D) weight rows: Wd^T (forward) or Wg (backward dx)
    w2_ptr,  # (H, D) weight rows: unused (forward) or Wu (backward dx)
    col_ptr,  # (N, K) int32 ELL columns
    a_ptr,  # (N, K) coefficient: g (forward) or dg (backward)
    b_ptr,  # (N, K) coefficient: u (forward) or du (backward)
    nnz_ptr,  # (N,) int32 ELL row lengths
    D,  # model width
    K,  # ELL width
    stride_out,  # row stride of out
    stride_w1,  # row stride of w1
    stride_w2,  # row stride of w2
    TWO_WEIGHTS: tl.constexpr,  # False: out = sum (a*b) w1; True: out = sum a w1 + b w2
    BLOCK_K: tl.constexpr,  # slots per step
    BLOCK_D: tl.constexpr,  # model-width chunk of one program
):
    """SpMM ELL x dense: ``out[n, d] = sum_{k < nnz[n]} coef[n, k] * w[col[n, k], d]``.

    Forward down-projection: coef = g * u = h, w = Wd^T, so y = h Wd^T.
    Backward dx: out = sum_k dg * Wg[col] + du * Wu[col] (one pass, both weights).
    Rows with nnz = 0 (dense-backup rows, all-zero rows) are written as zeros.
    """
    n = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md = offs_d < D
    nnz = tl.load(nnz_ptr + n)
    acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    for k0 in range(0, nnz, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < nnz
        cols = tl.load(col_ptr + n * K + offs_k, mask=mk, other=0).to(tl.int64)
        a = tl.load(a_ptr + n * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + n * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        m2 = mk[:, None] & md[None, :]
        w1 = tl.load(w1_ptr + cols[:, None] * stride_w1 + offs_d[None, :], mask=m2, other=0.0)
        if TWO_WEIGHTS:
            w2 = tl.load(w2_ptr + cols[:, None] * stride_w2 + offs_d[None, :], mask=m2, other=0.0)
            acc += a[:, None] * w1.to(tl.float32) + b[:, None] * w2.to(tl.float32)
        else:
            acc += (a * b)[:, None] * w1.to(tl.float32)
    out = tl.sum(acc, axis=0)
    tl.store(out_ptr + n * stride_out + offs_d, out.to(out_ptr.dtype.element_ty), mask=md)


@triton.jit
def _dw_kernel(
    dwg_ptr,  # (H, D) out: dL/dWg
    dwu_ptr,  # (H, D) out: dL/dWu
    dwdt_ptr,  # (H, D) out: dL/dWd^T
    addg_ptr,  # (H, D) dense-backup part of dWg (read when HAS_ADD)
    addu_ptr,  # (H, D) dense-backup part of dWu
    addd_ptr,  # (H, D) dense-backup part of dWd^T
    x_ptr,  # (N, D) input
    dy_ptr,  # (N, D) upstream gradient
    perm_ptr,  # (NNZ,) int64 flat ELL index n*K + k, grouped by column (CSC order)
    colptr_ptr,  # (H + 1,) int64: column c owns perm[colptr[c]:colptr[c+1]]
    dg_ptr,  # (N, K) fp32 dL/dgate at the non-zeros
    du_ptr,  # (N, K) fp32 dL/dup at the non-zeros
    g_ptr,  # (N, K) relu(gate)
    u_ptr,  # (N, K) up
    D,  # model width
    K,  # ELL width
    stride_x,  # row stride of x
    stride_dy,  # row stride of dy
    stride_w,  # row stride of the (H, D) outputs and adds
    HAS_ADD: tl.constexpr,  # add the dense-backup contributions
    BLOCK_J: tl.constexpr,  # entries per step
    BLOCK_D: tl.constexpr,  # model-width chunk of one program
):
    """Transposed SpMM (per hidden unit c, over the entries (n, k) with col[n, k] = c)::

        dWg[c]   = sum dg[n, k] x[n]      dWu[c] = sum du[n, k] x[n]   (one gather of x)
        dWd^T[c] = sum g[n, k] u[n, k] dy[n]

    fp32 accumulation; deterministic (one program owns each output element, CSC order fixed).
    """
    c = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md = offs_d < D
    start = tl.load(colptr_ptr + c)
    end = tl.load(colptr_ptr + c + 1)
    accg = tl.zeros([BLOCK_J, BLOCK_D], dtype=tl.float32)
    accu = tl.zeros([BLOCK_J, BLOCK_D], dtype=tl.float32)
    accd = tl.zeros([BLOCK_J, BLOCK_D], dtype=tl.float32)
    for j0 in range(start, end, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        mj = offs_j < end
        e = tl.load(perm_ptr + offs_j, mask=mj, other=0)
        n = e // K
        dg = tl.load(dg_ptr + e, mask=mj, other=0.0)
        du = tl.load(du_ptr + e, mask=mj, other=0.0)
        h = tl.load(g_ptr + e, mask=mj, other=0.0).to(tl.float32) * tl.load(
            u_ptr + e, mask=mj, other=0.0
        ).to(tl.float32)
        m2 = mj[:, None] & md[None, :]
        xr = tl.load(x_ptr + n[:, None] * stride_x + offs_d[None, :], mask=m2, other=0.0)
        dyr = tl.load(dy_ptr + n[:, None] * stride_dy + offs_d[None, :], mask=m2, other=0.0)
        xr = xr.to(tl.float32)
        accg += dg[:, None] * xr
        accu += du[:, None] * xr
        accd += h[:, None] * dyr.to(tl.float32)
    rg = tl.sum(accg, axis=0)
    ru = tl.sum(accu, axis=0)
    rd = tl.sum(accd, axis=0)
    off = c * stride_w + offs_d
    if HAS_ADD:
        rg += tl.load(addg_ptr + off, mask=md, other=0.0).to(tl.float32)
        ru += tl.load(addu_ptr + off, mask=md, other=0.0).to(tl.float32)
        rd += tl.load(addd_ptr + off, mask=md, other=0.0).to(tl.float32)
    tl.store(dwg_ptr + off, rg.to(dwg_ptr.dtype.element_ty), mask=md)
    tl.store(dwu_ptr + off, ru.to(dwu_ptr.dtype.element_ty), mask=md)
    tl.store(dwdt_ptr + off, rd.to(dwdt_ptr.dtype.element_ty), mask=md)


# ---------------------------------------------------------------------------------------------
# Second-generation kernels (kopt-train). The first-generation kernels above stay callable
# (``kernel_config(compact="v1", spmm="tiled", dw="tiled")``) so one GPU run measures both.
#
# H200 profile of the first generation at 0.3 % (M 16384, D 2048, H 5632): SpMM 2.69 ms at
# ~1.2 TB/s of gathered rows, dW 1.60 ms, compaction 0.49 ms, against an SDDMM at ~4 TB/s on the
# same rows. Common causes: short programs made of dependent loads (col -> weight row) with
# little in flight, 2-D fp32 accumulators limiting occupancy, and per-step acq_rel atomics.


@triton.jit
def _compact2_kernel(
    g_ptr,  # (N, H) gate pre-activation x Wg^T, row-major, any float dtype
    col_ptr,  # (N, KC) int32 out: columns of the first KC non-zeros of each row
    val_ptr,  # (N, KC) out, dtype of g: relu(g) at those columns
    nnz_ptr,  # (N,) int32 out: non-zeros of each row (all of them, also past KC)
    cpart_ptr,  # (cdiv(N, BLOCK_N), H) int32 out: active rows per (row block, column)
    N,  # rows
    H,  # columns
    stride_g,  # row stride of g (elements)
    KC,  # ELL capacity (slots per row)
    BLOCK_N: tl.constexpr,  # rows per program
    BLOCK_H: tl.constexpr,  # columns per step (power of two)
):
    """Same outputs as ``_compact_kernel`` except the column counts, which are written as
    per-program partials (plain stores, summed by the launcher) instead of atomics.

    The next column block's load is issued before the current block is scanned (manual
    software pipelining: one gate tile always in flight). With bf16 and BLOCK_H = 256 a warp
    holds one row of the tile, so the row scan (``tl.cumsum``) stays inside a warp.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mrow = rows < N
    rows64 = rows.to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    base = tl.zeros([BLOCK_N], dtype=tl.int32)
    gp = g_ptr + rows64[:, None] * stride_g
    g = tl.load(gp + offs_h[None, :], mask=mrow[:, None] & (offs_h < H)[None, :], other=0.0)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + offs_h
        nxt = cols + BLOCK_H
        g_next = tl.load(gp + nxt[None, :], mask=mrow[:, None] & (nxt < H)[None, :], other=0.0)
        act = g > 0
        a = act.to(tl.int32)
        pos = base[:, None] + tl.cumsum(a, axis=1) - 1
        keep = act & (pos < KC)
        dst = rows64[:, None] * KC + pos
        tl.store(col_ptr + dst, tl.broadcast_to(cols[None, :], [BLOCK_N, BLOCK_H]), mask=keep)
        tl.store(val_ptr + dst, g, mask=keep)
        base += tl.sum(a, axis=1)
        tl.store(cpart_ptr + pid.to(tl.int64) * H + cols, tl.sum(a, axis=0), mask=cols < H)
        g = g_next
    tl.store(nnz_ptr + rows, base, mask=mrow)


@triton.jit
def _compact_block(g, act, base, rows64, cols, col_ptr, val_ptr, counts_ptr, H, KC,
                   BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    """Append one (rows x BLOCK_H) block's active entries to the rows' ELL slots from ``base``
    on (entries past KC are not written; ``base`` keeps counting), add the block's per-column
    counts (relaxed atomics, only where non-zero); returns the new per-row counts."""
    a = act.to(tl.int32)
    pos = base[:, None] + tl.cumsum(a, axis=1) - 1
    keep = act & (pos < KC)
    dst = rows64[:, None] * KC + pos
    tl.store(col_ptr + dst, tl.broadcast_to(cols[None, :], [BLOCK_N, BLOCK_H]), mask=keep)
    tl.store(val_ptr + dst, g, mask=keep)
    cnt = tl.sum(a, axis=0)
    tl.atomic_add(counts_ptr + cols, cnt, mask=(cols < H) & (cnt > 0), sem="relaxed")
    return base + tl.sum(a, axis=1)


@triton.jit
def _compact3_kernel(
    g_ptr,  # (N, H) gate pre-activation x Wg^T, row-major, any float dtype
    col_ptr,  # (N, KC) int32 out: columns of the first KC non-zeros of each row
    val_ptr,  # (N, KC) out, dtype of g: relu(g) at those columns
    nnz_ptr,  # (N,) int32 out: non-zeros of each row (all of them, also past KC)
    counts_ptr,  # (H,) int32 in/out, zeroed by the launcher: tokens in which each unit is active
    N,  # rows
    H,  # columns
    stride_g,  # row stride of g (elements)
    KC,  # ELL capacity (slots per row)
    BLOCK_N: tl.constexpr,  # rows per program (default 1, on one warp)
    BLOCK_H: tl.constexpr,  # columns per step (power of two, 256 for bf16 rows)
    SKIP_EMPTY: tl.constexpr = False,  # "v4": no scan / stores / atomics for an all-zero block
    nnz_eff_ptr=None,  # (N,) int32 out (HEAVY): nnz, or 0 for a row above KC (dense-backup row)
    heavy_ptr=None,  # (1,) int32 in/out (HEAVY), zeroed by the launcher: rows above KC
    HEAVY: tl.constexpr = False,  # also write nnz_eff and count the heavy rows
):
    """Same outputs as ``_compact_kernel``; v3 (see BENCHMARKS.md, ncu of v2 and run E).

    v2 held a 32 x 256 tile plus its prefetched successor on 8 warps (32 values per thread):
    255 registers, 12.5 % occupancy, DRAM < 10 %. Here a program is one row on one warp by
    default (8 values per thread at bf16: the row scan and the column counts stay inside the
    warp, no shared memory or barrier per step; with more rows on more warps the per-step
    column-count reduction crosses warps, and run E measured that 2-4x slower), two column blocks
    are in flight while one is scanned, and the per-column counts are relaxed atomics issued only
    for columns active in the block (no fence, no partial-count buffer to sum afterwards).
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mrow = rows < N
    rows64 = rows.to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    base = tl.zeros([BLOCK_N], dtype=tl.int32)
    gp = g_ptr + rows64[:, None] * stride_g
    g1 = tl.load(gp + offs_h[None, :], mask=mrow[:, None] & (offs_h < H)[None, :], other=0.0)
    c2 = offs_h + BLOCK_H
    g2 = tl.load(gp + c2[None, :], mask=mrow[:, None] & (c2 < H)[None, :], other=0.0)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + offs_h
        g = g1
        g1 = g2
        c2 = cols + 2 * BLOCK_H
        g2 = tl.load(gp + c2[None, :], mask=mrow[:, None] & (c2 < H)[None, :], other=0.0)
        act = g > 0
        if SKIP_EMPTY:
            if tl.sum(tl.sum(act.to(tl.int32), axis=1), axis=0) > 0:
                base = _compact_block(g, act, base, rows64, cols, col_ptr, val_ptr, counts_ptr,
                                      H, KC, BLOCK_N, BLOCK_H)
        else:
            base = _compact_block(g, act, base, rows64, cols, col_ptr, val_ptr, counts_ptr, H, KC,
                                  BLOCK_N, BLOCK_H)
    tl.store(nnz_ptr + rows, base, mask=mrow)
    if HEAVY:  # the training forward's bookkeeping, folded in (was 4 small PyTorch kernels)
        heavy = (base > KC) & mrow
        tl.store(nnz_eff_ptr + rows, tl.where(heavy, 0, base), mask=mrow)
        tl.atomic_add(heavy_ptr + rows * 0, tl.full([BLOCK_N], 1, tl.int32), mask=heavy,
                      sem="relaxed")


@triton.jit
def _spmm_rows_kernel(
    out_ptr,  # (N, D) out
    w1_ptr,  # (H, D) weight rows: Wd^T (forward) or Wg (backward dx)
    w2_ptr,  # (H, D) weight rows: unused (forward) or Wu (backward dx)
    col_ptr,  # (N, K) int32 ELL columns
    a_ptr,  # (N, K) coefficient: g (forward) or dg (backward)
    b_ptr,  # (N, K) coefficient: u (forward) or du (backward)
    nnz_ptr,  # (N,) int32 ELL row lengths
    D,  # model width
    K,  # ELL width
    stride_out,  # row stride of out
    stride_w1,  # row stride of w1
    stride_w2,  # row stride of w2
    TWO_WEIGHTS: tl.constexpr,  # False: out = sum (a*b) w1; True: out = sum a w1 + b w2
    BLOCK_K: tl.constexpr,  # slots per step
    BLOCK_D: tl.constexpr,  # model-width slice of one program (the whole row when >= D)
):
    """Row-wise SpMM, same math as ``_spmm_kernel``, structured like the inference consumer
    (``twell_ffn.py``): one program per (row, D slice), normally the whole D row, a 1-D fp32
    accumulator, each step gathers BLOCK_K weight rows and reduces them at once (the slot axis
    is held inside each thread, so the reduction needs no shared memory), and the next step's
    columns and coefficients are loaded before this step's rows are used (one index load in
    flight behind the gathers instead of a dependent load at the head of every step).
    """
    n = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md = offs_d < D
    nnz = tl.load(nnz_ptr + n)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    row = n * K
    mk = offs_k < nnz
    cols = tl.load(col_ptr + row + offs_k, mask=mk, other=0).to(tl.int64)
    a = tl.load(a_ptr + row + offs_k, mask=mk, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row + offs_k, mask=mk, other=0.0).to(tl.float32)
    for k0 in range(0, nnz, BLOCK_K):
        mk = (k0 + offs_k) < nnz
        m2 = mk[:, None] & md[None, :]
        w1 = tl.load(w1_ptr + cols[:, None] * stride_w1 + offs_d[None, :], mask=m2, other=0.0)
        if TWO_WEIGHTS:
            w2 = tl.load(w2_ptr + cols[:, None] * stride_w2 + offs_d[None, :], mask=m2, other=0.0)
        nk = k0 + BLOCK_K + offs_k
        mk_n = nk < nnz
        cols_n = tl.load(col_ptr + row + nk, mask=mk_n, other=0).to(tl.int64)
        a_n = tl.load(a_ptr + row + nk, mask=mk_n, other=0.0).to(tl.float32)
        b_n = tl.load(b_ptr + row + nk, mask=mk_n, other=0.0).to(tl.float32)
        if TWO_WEIGHTS:
            acc += tl.sum(a[:, None] * w1.to(tl.float32) + b[:, None] * w2.to(tl.float32), axis=0)
        else:
            acc += tl.sum((a * b)[:, None] * w1.to(tl.float32), axis=0)
        cols, a, b = cols_n, a_n, b_n
    tl.store(out_ptr + n * stride_out + offs_d, acc.to(out_ptr.dtype.element_ty), mask=md)


@triton.jit
def _dw_cols_kernel(
    dwg_ptr,  # (H, D) out: dL/dWg
    dwu_ptr,  # (H, D) out: dL/dWu
    dwdt_ptr,  # (H, D) out: dL/dWd^T
    addg_ptr,  # (H, D) dense-backup part of dWg (read when HAS_ADD)
    addu_ptr,  # (H, D) dense-backup part of dWu
    addd_ptr,  # (H, D) dense-backup part of dWd^T
    x_ptr,  # (N, D) input
    dy_ptr,  # (N, D) upstream gradient
    perm_ptr,  # (NNZ,) int64 flat ELL index n*K + k, grouped by column (CSC order)
    colptr_ptr,  # (H + 1,) int64: column c owns perm[colptr[c]:colptr[c+1]]
    order_ptr,  # (H,) int64: columns, longest first (programs start in this order)
    dg_ptr,  # (N, K) fp32 dL/dgate at the non-zeros
    du_ptr,  # (N, K) fp32 dL/dup at the non-zeros
    g_ptr,  # (N, K) relu(gate)
    u_ptr,  # (N, K) up
    D,  # model width
    K,  # ELL width
    N_DCHUNK,  # cdiv(D, BLOCK_D)
    stride_x,  # row stride of x
    stride_dy,  # row stride of dy
    stride_w,  # row stride of the (H, D) outputs and adds
    HAS_ADD: tl.constexpr,  # add the dense-backup contributions
    BLOCK_J: tl.constexpr,  # entries per step
    BLOCK_D: tl.constexpr,  # model-width slice of one program
    H=0,  # columns (read when D_OUTER)
    D_OUTER: tl.constexpr = False,  # grid order: D slice outermost, then columns
):
    """Same math as ``_dw_kernel`` (deterministic: one program per output slice, fixed order).

    Differences: 1-D fp32 accumulators (the entry axis is reduced every step inside each
    thread: with BLOCK_D >= 256 * num_warps the warps split D, not the entries), far fewer
    registers and so more programs and gathers in flight per SM; the next step's entry indices
    are loaded behind this step's x/dy gathers; programs are issued longest column first
    (``order``) so that hot units do not start last and form the tail.
    """
    pid = tl.program_id(0)
    if D_OUTER:  # programs of one D slice run together: that slice of x and dy stays in L2
        c = tl.load(order_ptr + pid % H).to(tl.int64)
        offs_d = (pid // H) * BLOCK_D + tl.arange(0, BLOCK_D)
    else:
        c = tl.load(order_ptr + pid // N_DCHUNK).to(tl.int64)
        offs_d = (pid % N_DCHUNK) * BLOCK_D + tl.arange(0, BLOCK_D)
    md = offs_d < D
    start = tl.load(colptr_ptr + c)
    end = tl.load(colptr_ptr + c + 1)
    accg = tl.zeros([BLOCK_D], dtype=tl.float32)
    accu = tl.zeros([BLOCK_D], dtype=tl.float32)
    accd = tl.zeros([BLOCK_D], dtype=tl.float32)
    offs = tl.arange(0, BLOCK_J)
    e = tl.load(perm_ptr + start + offs, mask=(start + offs) < end, other=0)
    for j0 in range(start, end, BLOCK_J):
        mj = (j0 + offs) < end
        n = e // K
        m2 = mj[:, None] & md[None, :]
        xr = tl.load(x_ptr + n[:, None] * stride_x + offs_d[None, :], mask=m2, other=0.0)
        dyr = tl.load(dy_ptr + n[:, None] * stride_dy + offs_d[None, :], mask=m2, other=0.0)
        dg = tl.load(dg_ptr + e, mask=mj, other=0.0)
        du = tl.load(du_ptr + e, mask=mj, other=0.0)
        h = tl.load(g_ptr + e, mask=mj, other=0.0).to(tl.float32) * tl.load(
            u_ptr + e, mask=mj, other=0.0
        ).to(tl.float32)
        nj = j0 + BLOCK_J + offs
        e = tl.load(perm_ptr + nj, mask=nj < end, other=0)
        xf = xr.to(tl.float32)
        accg += tl.sum(dg[:, None] * xf, axis=0)
        accu += tl.sum(du[:, None] * xf, axis=0)
        accd += tl.sum(h[:, None] * dyr.to(tl.float32), axis=0)
    off = c * stride_w + offs_d
    if HAS_ADD:
        accg += tl.load(addg_ptr + off, mask=md, other=0.0).to(tl.float32)
        accu += tl.load(addu_ptr + off, mask=md, other=0.0).to(tl.float32)
        accd += tl.load(addd_ptr + off, mask=md, other=0.0).to(tl.float32)
    tl.store(dwg_ptr + off, accg.to(dwg_ptr.dtype.element_ty), mask=md)
    tl.store(dwu_ptr + off, accu.to(dwu_ptr.dtype.element_ty), mask=md)
    tl.store(dwdt_ptr + off, accd.to(dwdt_ptr.dtype.element_ty), mask=md)


# ---------------------------------------------------------------------------------------------
# Launchers. BLOCK_D is capped by the next power of two of D so small/odd D (tests) waste little.
#
# Kernel variants and launch shapes (``CONFIG``; change with ``kernel_config``):
#   compact  "v4" (default) "v3" skipping all-zero blocks | "v3" one row per one-warp program,
#            two column blocks in flight, relaxed atomics | "v2" partial-count stores, prefetch |
#            "v1" first generation (atomics)
#   spmm     "rows" (default) whole-D row programs, 1-D acc | "tiled" first generation
#   dw       "cols" (default) 1-D accs, longest column first | "tiled" first generation
# The defaults below are the best shapes measured on one H200 (runs C-H, BENCHMARKS.md); each
# entry's comment quotes the measurement.

_DEFAULT_CONFIG = {
    # run E, 0.3 %: v3 (one row per one-warp program) 0.22 ms, v2 0.45 ms; run I: v4 (v3 that
    # skips all-zero blocks) 0.205 / 0.230 ms at 1 / 3 % vs v3's 0.226 / 0.236
    "compact": "v4",
    "compact_block_n": 32,  # rows per program (v2); 8 warps, one warp per tile row
    # Run E (H200, 0.3 %): v3 with one row on one warp 0.22 ms; 2 rows on 2 warps 0.67, 4 on 4
    # warps 1.02 (cross-warp column-count reductions each step), v2 0.45.
    "compact3_block_n": 1,  # rows per program (v3)
    "compact3_warps": 1,  # warps per program (v3), at most compact3_block_n
    # SDDMM (forward u at 0.3 / 1 % / heavy 0.3 %): run E k8 d256 w4 0.222 / 0.547 / 0.128 ms vs
    # the earlier fixed k16 d256 w4 0.311 / 0.739 / 0.171; run F k8 d256 w1 0.172 / 0.479 / 0.136.
    "sddmm_block_k": 8,  # slots per step (SDDMM, forward u and backward dh)
    "sddmm_block_d": 256,  # model-width chunk per step (SDDMM)
    "sddmm_warps": 1,
    "spmm": "rows",
    # SpMM launch shape measured on one H200 (docs/bench/run2/bench_train2.log, N=16384 D=2048
    # H=5632): y k4 w4 0.148 ms vs k8 w8 0.193 ms at 0.3 %, 0.423 vs 0.487 at 1 %; dx k2 w4
    # 0.276 vs 0.320 ms at 0.3 %, 0.827 vs 0.870 at 1 % (same ranking on heavy-tailed rows).
    "spmm_block_k": 4,  # slots per step, one weight (forward y = h Wd^T)
    "spmm_block_k2": 2,  # slots per step, two weights (backward dx)
    "spmm_block_d": 2048,  # D slice per program (rows); the whole row at D <= 2048
    "spmm_warps": 4,
    "dw": "cols",
    # dW (run E, 0.3 % / 1 % / heavy 0.3 %): j4 d1024 w4 0.577 / 1.461 / 0.284 ms vs j8 d512 w2
    # 0.676 / 1.690 / 0.288 (j2 d2048 w8 won at 0.3 % but lost on heavy rows: 0.372).
    "dw_block_j": 4,  # entries per step (cols)
    "dw_block_d": 1024,  # D slice per program (cols); >= 256 * dw_warps keeps the reduction in-thread
    "dw_warps": 4,
    # dW grid order: 0 = a column's D slices side by side (the whole of x and dy is the working
    # set), 1 = D slice outermost (a slice of x and dy at a time: 32 MiB at d512, fits the L2)
    "dw_d_outer": 0,
    # dense-mode elementwise pass (dense_fwd): rows per program, columns per step, warps
    "dense_block_n": 16,
    "dense_block_h": 256,
    "dense_warps": 4,
}
CONFIG = dict(_DEFAULT_CONFIG)
# sizes used directly as tl.arange extents (others are rounded up to a power of 2 by _pow2)
_POW2_KEYS = ("dense_block_n", "dense_block_h", "sddmm_block_k", "spmm_block_k", "spmm_block_k2",
              "dw_block_j")
_CHOICES = {"compact": ("v1", "v2", "v3", "v4"), "spmm": ("tiled", "rows"), "dw": ("tiled", "cols")}


@contextlib.contextmanager
def kernel_config(**overrides):
    """Temporarily select kernel variants / launch shapes (keys of ``CONFIG``), e.g.
    ``with kernel_config(spmm="tiled"): ...`` runs the first-generation SpMM. Not thread-safe
    (a module-level setting, meant for benchmarks and tests).

    Raises:
        ValueError: an unknown key, an unknown variant name, or a non-positive size.
    """
    for key, val in overrides.items():
        if key not in CONFIG:
            raise ValueError(f"kernel_config: unknown key {key!r}; known: {sorted(CONFIG)}")
        if key in _CHOICES and val not in _CHOICES[key]:
            raise ValueError(f"kernel_config: {key} must be one of {_CHOICES[key]}; got {val!r}")
        if key == "dw_d_outer":
            if val not in (0, 1):
                raise ValueError(f"kernel_config: dw_d_outer must be 0 or 1; got {val!r}")
            continue
        if key not in _CHOICES and (not isinstance(val, int) or val < 1):
            raise ValueError(f"kernel_config: {key} must be a positive int; got {val!r}")
        if key in _POW2_KEYS and val & (val - 1):
            raise ValueError(f"kernel_config: {key} must be a power of 2 (a Triton block size); "
                             f"got {val!r}")
    saved = dict(CONFIG)
    CONFIG.update(overrides)
    try:
        yield CONFIG
    finally:
        CONFIG.clear()
        CONFIG.update(saved)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype | None = None) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (call .contiguous())")


def compact(g_NH: torch.Tensor, kc: int):
    """ReLU + ELL compaction of the gate pre-activation.

    Args:
        g_NH: (N, H) contiguous gate pre-activation ``x Wg^T``.
        kc: ELL capacity (slots per row), >= 1.

    Returns:
        col_NKC (int32), val_NKC (g's dtype; relu(g) at the columns), nnz_N (int32, all
        non-zeros of the row, also those past kc), counts_H (int32, tokens per active unit).
    """
    n, h = g_NH.shape
    _check("g_NH", g_NH, (n, h))
    col = torch.empty((n, kc), dtype=torch.int32, device=g_NH.device)
    val = torch.empty((n, kc), dtype=g_NH.dtype, device=g_NH.device)
    nnz = torch.empty((n,), dtype=torch.int32, device=g_NH.device)
    counts = torch.zeros((h,), dtype=torch.int32, device=g_NH.device)
    if n == 0:
        return col, val, nnz, counts
    block_h = _pow2(h, 16, 256)
    if CONFIG["compact"] == "v1":
        block_n = 16
        _compact_kernel[(triton.cdiv(n, block_n),)](
            g_NH, col, val, nnz, counts, n, h, g_NH.stride(0), kc,
            BLOCK_N=block_n, BLOCK_H=block_h, num_warps=4,
        )
        return col, val, nnz, counts
    if CONFIG["compact"] in ("v3", "v4"):
        block_n = _pow2(CONFIG["compact3_block_n"], 1, 16)
        _compact3_kernel[(triton.cdiv(n, block_n),)](
            g_NH, col, val, nnz, counts, n, h, g_NH.stride(0), kc,
            BLOCK_N=block_n, BLOCK_H=block_h, SKIP_EMPTY=CONFIG["compact"] == "v4",
            num_warps=min(CONFIG["compact3_warps"], block_n),
        )
        return col, val, nnz, counts
    block_n = _pow2(min(n, CONFIG["compact_block_n"]), 1, 1024)
    nprog = triton.cdiv(n, block_n)
    cpart = torch.empty((nprog, h), dtype=torch.int32, device=g_NH.device)
    _compact2_kernel[(nprog,)](
        g_NH, col, val, nnz, cpart, n, h, g_NH.stride(0), kc,
        BLOCK_N=block_n, BLOCK_H=block_h, num_warps=8,
    )
    torch.sum(cpart, 0, dtype=torch.int32, out=counts)
    return col, val, nnz, counts


def compact_heavy(g_NH: torch.Tensor, kc: int):
    """:func:`compact` plus the training forward's heavy-row bookkeeping.

    Args:
        g_NH: (N, H) contiguous gate pre-activation ``x Wg^T`` (fp16 / bf16 / fp32).
        kc: ELL capacity (slots per row), >= 1.

    Returns:
        col_NKC, val_NKC, nnz_N, counts_H as :func:`compact`, then nnz_eff_N (int32: nnz_N, or 0
        where nnz_N > kc, i.e. the row goes to the dense backup) and n_heavy (int32 (1,): the
        number of such rows). Compaction v3 / v4 write the last two from the kernel; v1 / v2 with
        PyTorch ops. Source: the hybrid layout (arXiv 2603.23198, "Hybrid (training)").

    Raises:
        ValueError: g_NH not 2-D contiguous.
    """
    n = g_NH.shape[0]
    if CONFIG["compact"] not in ("v3", "v4") or n == 0:
        col, val, nnz, counts = compact(g_NH, kc)
        heavy = nnz > kc
        return col, val, nnz, counts, torch.where(heavy, 0, nnz), heavy.sum(dtype=torch.int32)[None]
    h = g_NH.shape[1]
    _check("g_NH", g_NH, (n, h))
    dev = g_NH.device
    col = torch.empty((n, kc), dtype=torch.int32, device=dev)
    val = torch.empty((n, kc), dtype=g_NH.dtype, device=dev)
    nnz = torch.empty((n,), dtype=torch.int32, device=dev)
    nnz_eff = torch.empty((n,), dtype=torch.int32, device=dev)
    zeros = torch.zeros((h + 1,), dtype=torch.int32, device=dev)  # one fill: counts + n_heavy
    counts, n_heavy = zeros[:h], zeros[h:]
    block_n = _pow2(CONFIG["compact3_block_n"], 1, 16)
    _compact3_kernel[(triton.cdiv(n, block_n),)](
        g_NH, col, val, nnz, counts, n, h, g_NH.stride(0), kc,
        BLOCK_N=block_n, BLOCK_H=_pow2(h, 16, 256), SKIP_EMPTY=CONFIG["compact"] == "v4",
        nnz_eff_ptr=nnz_eff, heavy_ptr=n_heavy, HEAVY=True,
        num_warps=min(CONFIG["compact3_warps"], block_n),
    )
    return col, val, nnz, counts, nnz_eff, n_heavy


def sddmm_fwd(x_ND, w_up_HD, col_NK, g_NK, nnz_N):
    """u[n, k] = x[n] . Wu[col[n, k]] for k < nnz[n]; returns (u_NK in x's dtype, l1_N fp32)."""
    n, d = x_ND.shape
    k = col_NK.shape[1]
    _check("x_ND", x_ND, (n, d))
    _check("w_up_HD", w_up_HD, (w_up_HD.shape[0], d))
    _check("col_NK", col_NK, (n, k), torch.int32)
    _check("g_NK", g_NK, (n, k))
    u = torch.empty((n, k), dtype=x_ND.dtype, device=x_ND.device)
    l1 = torch.zeros((n,), dtype=torch.float32, device=x_ND.device)
    if n == 0 or k == 0:
        return u, l1
    block_d = _pow2(d, 16, CONFIG["sddmm_block_d"])
    _sddmm_kernel[(n,)](
        x_ND, w_up_HD, col_NK, g_NK, u, nnz_N, u, u, l1, d, k, x_ND.stride(0),
        w_up_HD.stride(0), BACKWARD=False, BLOCK_K=CONFIG["sddmm_block_k"], BLOCK_D=block_d,
        num_warps=CONFIG["sddmm_warps"],
    )
    return u, l1


def sddmm_bwd(dy_ND, w_down_t_HD, col_NK, g_NK, u_NK, nnz_N, l1_scale):
    """dh = dy[n] . Wd^T[col] + l1_scale * sign(u); returns (dg_NK, du_NK) fp32."""
    n, d = dy_ND.shape
    k = col_NK.shape[1]
    _check("dy_ND", dy_ND, (n, d))
    _check("w_down_t_HD", w_down_t_HD, (w_down_t_HD.shape[0], d))
    _check("u_NK", u_NK, (n, k))
    dg = torch.empty((n, k), dtype=torch.float32, device=dy_ND.device)
    du = torch.empty((n, k), dtype=torch.float32, device=dy_ND.device)
    if n == 0 or k == 0:
        return dg, du
    scale = l1_scale.reshape(1).to(torch.float32).contiguous()
    block_d = _pow2(d, 16, CONFIG["sddmm_block_d"])
    _sddmm_kernel[(n,)](
        dy_ND, w_down_t_HD, col_NK, g_NK, u_NK, nnz_N, dg, du, scale, d, k, dy_ND.stride(0),
        w_down_t_HD.stride(0), BACKWARD=True, BLOCK_K=CONFIG["sddmm_block_k"], BLOCK_D=block_d,
        num_warps=CONFIG["sddmm_warps"],
    )
    return dg, du


def spmm(out_ND, w1_HD, w2_HD, col_NK, a_NK, b_NK, nnz_N):
    """out[n] = sum_k a*b*w1[col] (w2 None) or sum_k a*w1[col] + b*w2[col]; writes every row."""
    n, d = out_ND.shape
    k = col_NK.shape[1]
    _check("out_ND", out_ND, (n, d))
    _check("w1_HD", w1_HD, (w1_HD.shape[0], d))
    if n == 0:
        return out_ND
    if k == 0:
        return out_ND.zero_()
    two = w2_HD is not None
    if two:
        _check("w2_HD", w2_HD, tuple(w1_HD.shape))
    w2 = w2_HD if two else w1_HD
    if CONFIG["spmm"] == "tiled":
        block_d = _pow2(d, 16, 256)
        _spmm_kernel[(n, triton.cdiv(d, block_d))](
            out_ND, w1_HD, w2, col_NK, a_NK, b_NK, nnz_N, d, k,
            out_ND.stride(0), w1_HD.stride(0), w2.stride(0),
            TWO_WEIGHTS=two, BLOCK_K=16, BLOCK_D=block_d, num_warps=4,
        )
        return out_ND
    block_d = _pow2(d, 16, CONFIG["spmm_block_d"])
    block_k = CONFIG["spmm_block_k2" if two else "spmm_block_k"]
    _spmm_rows_kernel[(n, triton.cdiv(d, block_d))](
        out_ND, w1_HD, w2, col_NK, a_NK, b_NK, nnz_N, d, k,
        out_ND.stride(0), w1_HD.stride(0), w2.stride(0),
        TWO_WEIGHTS=two, BLOCK_K=block_k, BLOCK_D=block_d,
        num_warps=max(1, min(CONFIG["spmm_warps"], block_d // 256)),
    )
    return out_ND


def dw(dwg_HD, dwu_HD, dwdt_HD, adds, x_ND, dy_ND, perm, colptr, dg_NK, du_NK, g_NK, u_NK,
       order=None):
    """Weight gradients from the CSC-ordered ELL entries (see ``_dw_kernel``), plus ``adds``
    (a triple of (H, D) dense-backup contributions, or None). Writes all three outputs."""
    h, d = dwg_HD.shape
    k = dg_NK.shape[1]
    for name, t in (("dwg_HD", dwg_HD), ("dwu_HD", dwu_HD), ("dwdt_HD", dwdt_HD)):
        _check(name, t, (h, d))
    _check("perm", perm, (perm.shape[0],), torch.int64)
    _check("colptr", colptr, (h + 1,), torch.int64)
    if h == 0 or d == 0:
        return
    has_add = adds is not None
    ag, au, ad = adds if has_add else (dwg_HD, dwu_HD, dwdt_HD)
    if CONFIG["dw"] == "tiled":
        block_d = _pow2(d, 16, 128)
        _dw_kernel[(h, triton.cdiv(d, block_d))](
            dwg_HD, dwu_HD, dwdt_HD, ag, au, ad, x_ND, dy_ND, perm, colptr, dg_NK, du_NK, g_NK,
            u_NK, d, max(k, 1), x_ND.stride(0), dy_ND.stride(0), dwg_HD.stride(0),
            HAS_ADD=has_add, BLOCK_J=16, BLOCK_D=block_d, num_warps=4,
        )
        return
    block_d = _pow2(d, 16, CONFIG["dw_block_d"])
    n_dchunk = triton.cdiv(d, block_d)
    if order is None:  # longest column first (the training forward passes it precomputed)
        order = torch.argsort(colptr[1:] - colptr[:-1], descending=True)
    _dw_cols_kernel[(h * n_dchunk,)](
        dwg_HD, dwu_HD, dwdt_HD, ag, au, ad, x_ND, dy_ND, perm, colptr, order, dg_NK, du_NK,
        g_NK, u_NK, d, max(k, 1), n_dchunk, x_ND.stride(0), dy_ND.stride(0), dwg_HD.stride(0),
        HAS_ADD=has_add, BLOCK_J=CONFIG["dw_block_j"], BLOCK_D=block_d, H=h,
        D_OUTER=bool(CONFIG["dw_d_outer"]),
        num_warps=max(1, min(CONFIG["dw_warps"], block_d // 256)),
    )


# ---------------------------------------------------------------------------------------------
# Dense-backup elementwise passes: one fused pass each instead of ~4 separate PyTorch ops (the
# unfused version cost ~1.4 ms over dense at 10 % density on H200, M 16384, H 5632).


@triton.jit
def _backup_fwd_kernel(
    g_ptr,  # (R*H,) gate pre-activation in, relu(g) out (in place)
    u_ptr,  # (R*H,) up
    h_ptr,  # (R*H,) out: h = relu(g) * u (dtype of g)
    l1_ptr,  # (cdiv(R*H, BLOCK),) fp32 out: per-block sum |h|
    numel,  # R*H
    BLOCK: tl.constexpr,  # elements per program
):
    """g <- relu(g); h = g * u (rounded to g's dtype); l1_part[pid] = sum |h| (fp32)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    g = tl.maximum(tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32), 0.0,
                   propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) = NaN, as in PyTorch
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    h = (g * u).to(h_ptr.dtype.element_ty)
    tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), mask=m)
    tl.store(h_ptr + offs, h, mask=m)
    tl.store(l1_ptr + pid, tl.sum(tl.abs(h.to(tl.float32)), axis=0))


@triton.jit
def _backup_bwd_kernel(
    dh_ptr,  # (R*H,) in: dy Wd; out: dg (in place)
    g_ptr,  # (R*H,) relu(gate) or the gate pre-activation (relu applied on load)
    u_ptr,  # (R*H,) up
    du_ptr,  # (R*H,) out: du
    h_ptr,  # (R*H,) out: h = g * u (for dWd)
    scale_ptr,  # (1,) fp32: dL/dl1 / N
    numel,  # R*H
    BLOCK: tl.constexpr,  # elements per program
):
    """dh += scale * sign(h); dg = dh * u where g > 0 (else 0); du = dh * g; h = g * u."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    s = tl.load(scale_ptr)
    dh = tl.load(dh_ptr + offs, mask=m, other=0.0).to(tl.float32)
    # relu on load: the op's fallback saves relu(g), dense mode the raw pre-activation
    g = tl.maximum(tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32), 0.0,
                   propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) = NaN, as in PyTorch
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    h = (g * u).to(h_ptr.dtype.element_ty)
    hf = h.to(tl.float32)
    dh += s * tl.where(hf > 0, 1.0, tl.where(hf < 0, -1.0, 0.0))
    tl.store(dh_ptr + offs, tl.where(g > 0, dh * u, 0.0).to(dh_ptr.dtype.element_ty), mask=m)
    tl.store(du_ptr + offs, (dh * g).to(du_ptr.dtype.element_ty), mask=m)
    tl.store(h_ptr + offs, h, mask=m)


@triton.jit
def _dense_fwd_kernel(
    g_ptr,  # (N, H) gate pre-activation (read only)
    u_ptr,  # (N, H) up
    h_ptr,  # (N, H) out: h = relu(g) * u (dtype of h)
    l1_ptr,  # (N,) fp32 out: sum_j |h_nj| (of the rounded h)
    nnz_ptr,  # (N,) int32 out: active units of the row (g > 0)
    cpart_ptr,  # (cdiv(N, BLOCK_N), H) int32 out: active tokens per unit within this row block
    N,  # rows
    H,  # columns
    BLOCK_N: tl.constexpr,  # rows per program
    BLOCK_H: tl.constexpr,  # columns per step
    STATS: tl.constexpr = True,  # False: h only (l1 / nnz / cpart not written)
):
    """Dense-mode forward elementwise pass: h, per-row L1 and L0, per-block column counts.

    One pass over g and u (the dense baseline's ReLU and multiply are two, and its L1 / L0 /
    count statistics several more). Deterministic: per-row sums in registers in column order,
    per-block column counts stored (no atomics) and summed by the launcher.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mrow = rows < N
    base = rows.to(tl.int64)[:, None] * H
    l1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    nnz = tl.zeros([BLOCK_N], dtype=tl.int32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = mrow[:, None] & (cols < H)[None, :]
        off = base + cols[None, :]
        g = tl.load(g_ptr + off, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + off, mask=m, other=0.0).to(tl.float32)
        act = g > 0
        # relu(NaN) = NaN as in PyTorch (the GPU max would return 0: a NaN gate would vanish)
        h = (tl.maximum(g, 0.0, propagate_nan=tl.PropagateNan.ALL) * u).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + off, h, mask=m)
        if STATS:
            l1 += tl.sum(tl.abs(h.to(tl.float32)), axis=1)
            a = act.to(tl.int32)
            nnz += tl.sum(a, axis=1)
            tl.store(cpart_ptr + pid.to(tl.int64) * H + cols, tl.sum(a, axis=0), mask=cols < H)
    if STATS:
        tl.store(l1_ptr + rows, l1, mask=mrow)
        tl.store(nnz_ptr + rows, nnz, mask=mrow)


def dense_fwd(g_NH: torch.Tensor, u_NH: torch.Tensor, stats: bool = True):
    """Dense-mode elementwise forward (``_dense_fwd_kernel``); g is not modified.

    Args:
        g_NH: (N, H) gate pre-activation ``x Wg^T``; u_NH: (N, H) up projection, same dtype.
        stats: False skips the statistics (the last three outputs are then None).

    Returns:
        h_NH (g's dtype, ``relu(g) * u`` computed in fp32 and rounded once; relu(NaN) = NaN),
        l1_N (fp32, sum |h| per row), nnz_N (int32, active units per row), counts_H (int32,
        active tokens per unit). Source: the FFN and L1 term of arXiv 2603.23198.

    Raises:
        ValueError: g_NH / u_NH not of one (N, H) shape or not contiguous.
    """
    n, h = g_NH.shape
    _check("g_NH", g_NH, (n, h))
    _check("u_NH", u_NH, (n, h))
    dev = g_NH.device
    out = torch.empty_like(g_NH)
    if n == 0 or h == 0:
        if not stats:
            return out, None, None, None
        return (out, torch.zeros((n,), dtype=torch.float32, device=dev),
                torch.zeros((n,), dtype=torch.int32, device=dev),
                torch.zeros((h,), dtype=torch.int32, device=dev))
    block_n = CONFIG["dense_block_n"]
    nprog = triton.cdiv(n, block_n)
    if stats:
        l1 = torch.empty((n,), dtype=torch.float32, device=dev)
        nnz = torch.empty((n,), dtype=torch.int32, device=dev)
        cpart = torch.empty((nprog, h), dtype=torch.int32, device=dev)
    else:
        l1 = nnz = cpart = out  # never written
    _dense_fwd_kernel[(nprog,)](
        g_NH, u_NH, out, l1, nnz, cpart, n, h, BLOCK_N=block_n,
        BLOCK_H=_pow2(h, 16, CONFIG["dense_block_h"]), STATS=stats,
        num_warps=CONFIG["dense_warps"],
    )
    if not stats:
        return out, None, None, None
    return out, l1, nnz, cpart.sum(0, dtype=torch.int32)


_EW_BLOCK = 4096


def backup_fwd(g_RH: torch.Tensor, u_RH: torch.Tensor):
    """relu(g) in place; returns (h_RH, l1 fp32 scalar = sum |h|)."""
    _check("g_RH", g_RH, tuple(g_RH.shape))
    _check("u_RH", u_RH, tuple(g_RH.shape))
    h = torch.empty_like(g_RH)
    numel = g_RH.numel()
    nb = max(1, triton.cdiv(numel, _EW_BLOCK))
    part = torch.zeros((nb,), dtype=torch.float32, device=g_RH.device)
    if numel:
        _backup_fwd_kernel[(nb,)](g_RH, u_RH, h, part, numel, BLOCK=_EW_BLOCK, num_warps=8)
    return h, part.sum()


def backup_bwd(dh_RH: torch.Tensor, g_RH: torch.Tensor, u_RH: torch.Tensor, l1_scale):
    """Returns (dg_RH (dh's buffer, overwritten), du_RH, h_RH)."""
    for name, t in (("dh_RH", dh_RH), ("g_RH", g_RH), ("u_RH", u_RH)):
        _check(name, t, tuple(g_RH.shape))
    du = torch.empty_like(dh_RH)
    h = torch.empty_like(g_RH)
    numel = g_RH.numel()
    if numel:
        scale = l1_scale.reshape(1).to(torch.float32).contiguous()
        _backup_bwd_kernel[(triton.cdiv(numel, _EW_BLOCK),)](
            dh_RH, g_RH, u_RH, du, h, scale, numel, BLOCK=_EW_BLOCK, num_warps=8,
        )
    return dh_RH, du, h
