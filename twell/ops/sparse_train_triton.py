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
    BLOCK_N: tl.constexpr,  # rows per program (default 1, on one warp)
    BLOCK_H: tl.constexpr,  # columns per step (power of two, 256 for bf16 rows)
    nnz_eff_ptr=None,  # (N,) int32 out (HEAVY): nnz, or 0 for a row above KC (dense-backup row)
    heavy_ptr=None,  # (1,) int32 in/out (HEAVY), zeroed by the launcher: rows above KC
    HEAVY: tl.constexpr = False,  # also write nnz_eff and count the heavy rows
):
    """ReLU + compaction: per row, slot ``pos = #(active columns before c)`` gets (c, g[n, c]).

    active[n, c] = g[n, c] > 0; nnz[n] = sum_c active (all of them, also past KC); counts[c] +=
    sum_n active. With HEAVY also nnz_eff[n] = nnz[n], or 0 when nnz[n] > KC (the row goes to
    the dense backup), and heavy += the number of such rows.

    A program is one row on one warp by default (8 values per thread at bf16: the row scan and
    the column counts stay inside the warp; more rows on more warps ran 2-4x slower, run E), two
    column blocks are in flight while one is scanned, a block with no active entry is skipped
    (no scan, stores or atomics), and the per-column counts are relaxed atomics issued only for
    columns active in the block. BENCHMARKS.md, runs E and I.
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
        if tl.sum(tl.sum(act.to(tl.int32), axis=1), axis=0) > 0:  # skip all-zero blocks
            base = _compact_block(g, act, base, rows64, cols, col_ptr, val_ptr, counts_ptr,
                                  H, KC, BLOCK_N, BLOCK_H)
    tl.store(nnz_ptr + rows, base, mask=mrow)
    if HEAVY:  # the training forward's heavy-row bookkeeping
        heavy = (base > KC) & mrow
        tl.store(nnz_eff_ptr + rows, tl.where(heavy, 0, base), mask=mrow)
        tl.atomic_add(heavy_ptr + rows * 0, tl.full([BLOCK_N], 1, tl.int32), mask=heavy,
                      sem="relaxed")


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
    BLOCK_D: tl.constexpr,  # model-width slice of one program (the whole row when >= D)
):
    """SpMM ELL x dense: ``out[n, d] = sum_{k < nnz[n]} coef[n, k] * w[col[n, k], d]``.

    Forward down-projection: coef = g * u = h, w = Wd^T, so y = h Wd^T.
    Backward dx: out = sum_k dg * Wg[col] + du * Wu[col] (one pass, both weights).
    Rows with nnz = 0 (dense-backup rows, all-zero rows) are written as zeros.

    Structured like the inference consumer (``twell_ffn.py``): one program per (row, D slice),
    normally the whole D row, a 1-D fp32
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
    """Transposed SpMM (per hidden unit c, over the entries (n, k) with col[n, k] = c)::

        dWg[c]   = sum dg[n, k] x[n]      dWu[c] = sum du[n, k] x[n]   (one gather of x)
        dWd^T[c] = sum g[n, k] u[n, k] dy[n]

    fp32 accumulation; deterministic (one program owns each output slice, CSC order fixed).
    1-D fp32 accumulators (the entry axis is reduced every step inside each thread: with
    BLOCK_D >= 256 * num_warps the warps split D, not the entries); the next step's entry indices
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
# Launch shapes (``CONFIG``; change with ``kernel_config``): each entry's comment gives the one
# measurement behind its default (one H200, N 16384, D 2048, H 5632, i.i.d. 0.3 % unless said;
# BENCHMARKS.md, the run named).

_DEFAULT_CONFIG = {
    # compaction rows per program and warps: 1 row on 1 warp 0.22 ms vs 2 rows on 2 warps 0.67 (run E)
    "compact_block_n": 1,
    "compact_warps": 1,  # at most compact_block_n
    # SDDMM slots per step, model-width chunk, warps: k8 d256 w1 0.172 ms vs k8 w4 0.222 (run F)
    "sddmm_block_k": 8,
    "sddmm_block_d": 256,
    "sddmm_warps": 1,
    # SpMM slots per step for y (one weight) and dx (two): y k4 w4 0.148 ms vs k8 w8 0.193, dx k2 w4
    # 0.276 vs 0.320 (run C); the D slice per program is the whole row at D <= 2048
    "spmm_block_k": 4,
    "spmm_block_k2": 2,
    "spmm_block_d": 2048,
    "spmm_warps": 4,
    # dW entries per step, D slice, warps: j4 d1024 w4 0.577 ms vs j8 d512 w2 0.676 (run E);
    # >= 256 * dw_warps keeps the reduction in-thread
    "dw_block_j": 4,
    "dw_block_d": 1024,
    "dw_warps": 4,
    # dW grid order, 1 = D slice outermost: 0.518 vs 0.578 ms i.i.d. but 0.345 vs 0.288 with hot
    # units (run K), so off
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


@contextlib.contextmanager
def kernel_config(**overrides):
    """Temporarily set launch shapes (keys of ``CONFIG``), e.g. ``with kernel_config(
    spmm_block_k=8): ...``. Not thread-safe (a module-level setting, meant for benchmarks and
    tests).

    Raises:
        ValueError: an unknown key, a non-positive or non-power-of-2 size, dw_d_outer not 0 / 1.
    """
    for key, val in overrides.items():
        if key not in CONFIG:
            raise ValueError(f"kernel_config: unknown key {key!r}; known: {sorted(CONFIG)}")
        if key == "dw_d_outer":
            if val not in (0, 1):
                raise ValueError(f"kernel_config: dw_d_outer must be 0 or 1; got {val!r}")
            continue
        if not isinstance(val, int) or val < 1:
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

def _compact(g_NH: torch.Tensor, kc: int, heavy: bool):
    n, h = g_NH.shape
    _check("g_NH", g_NH, (n, h))
    dev = g_NH.device
    col = torch.empty((n, kc), dtype=torch.int32, device=dev)
    val = torch.empty((n, kc), dtype=g_NH.dtype, device=dev)
    nnz = torch.empty((n,), dtype=torch.int32, device=dev)
    nnz_eff = torch.empty((n,), dtype=torch.int32, device=dev) if heavy else None
    zeros = torch.zeros((h + 1,), dtype=torch.int32, device=dev)  # one fill: counts + n_heavy
    counts, n_heavy = zeros[:h], zeros[h:]
    if n > 0:
        block_n = _pow2(CONFIG["compact_block_n"], 1, 16)
        _compact_kernel[(triton.cdiv(n, block_n),)](
            g_NH, col, val, nnz, counts, n, h, g_NH.stride(0), kc,
            BLOCK_N=block_n, BLOCK_H=_pow2(h, 16, 256),
            nnz_eff_ptr=nnz_eff, heavy_ptr=n_heavy, HEAVY=heavy,
            num_warps=min(CONFIG["compact_warps"], block_n),
        )
    return col, val, nnz, counts, nnz_eff, n_heavy


def compact(g_NH: torch.Tensor, kc: int):
    """ReLU + ELL compaction of the gate pre-activation (``_compact_kernel``).

    Args:
        g_NH: (N, H) contiguous gate pre-activation ``x Wg^T`` (fp16 / bf16 / fp32).
        kc: ELL capacity (slots per row), >= 1.

    Returns:
        col_NKC (int32), val_NKC (g's dtype; relu(g) at the columns), nnz_N (int32, all
        non-zeros of the row, also those past kc), counts_H (int32, tokens per active unit).
        Slots past a row's count are undefined.

    Raises:
        ValueError: g_NH not 2-D contiguous.
    """
    return _compact(g_NH, kc, heavy=False)[:4]


def compact_heavy(g_NH: torch.Tensor, kc: int):
    """:func:`compact` plus the training forward's heavy-row bookkeeping, in the same kernel.

    Args:
        g_NH: (N, H) contiguous gate pre-activation ``x Wg^T`` (fp16 / bf16 / fp32).
        kc: ELL capacity (slots per row), >= 1.

    Returns:
        col_NKC, val_NKC, nnz_N, counts_H as :func:`compact`, then nnz_eff_N (int32: nnz_N, or 0
        where nnz_N > kc, i.e. the row goes to the dense backup) and n_heavy (int32 (1,): the
        number of such rows). Source: the hybrid layout (arXiv 2603.23198, "Hybrid (training)").

    Raises:
        ValueError: g_NH not 2-D contiguous.
    """
    return _compact(g_NH, kc, heavy=True)


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
    block_d = _pow2(d, 16, CONFIG["spmm_block_d"])
    block_k = CONFIG["spmm_block_k2" if two else "spmm_block_k"]
    _spmm_kernel[(n, triton.cdiv(d, block_d))](
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
    block_d = _pow2(d, 16, CONFIG["dw_block_d"])
    n_dchunk = triton.cdiv(d, block_d)
    if order is None:  # longest column first (the training forward passes it precomputed)
        order = torch.argsort(colptr[1:] - colptr[:-1], descending=True)
    _dw_kernel[(h * n_dchunk,)](
        dwg_HD, dwu_HD, dwdt_HD, ag, au, ad, x_ND, dy_ND, perm, colptr, order, dg_NK, du_NK,
        g_NK, u_NK, d, max(k, 1), n_dchunk, x_ND.stride(0), dy_ND.stride(0), dwg_HD.stride(0),
        HAS_ADD=has_add, BLOCK_J=CONFIG["dw_block_j"], BLOCK_D=block_d, H=h,
        D_OUTER=bool(CONFIG["dw_d_outer"]),
        num_warps=max(1, min(CONFIG["dw_warps"], block_d // 256)),
    )


# ---------------------------------------------------------------------------------------------
# Dense-backup elementwise passes: one fused pass each instead of ~4 separate PyTorch ops (the
# unfused version cost ~1.4 ms over dense at 10 % density on H200, M 16384, H 5632; run B).


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
