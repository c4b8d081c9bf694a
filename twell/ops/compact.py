"""ReLU + ELL compaction of the gate pre-activation (training forward, first pass after the gate GEMM).

Shape legend: N tokens, D model width, H FFN width, K ELL width (slots per row), KC ELL
capacity, J entries of one column in CSC order. ELL layout: ``twell.ops.train_backend``.

Source: the hybrid layout (arXiv 2603.23198, "Hybrid (training)"). The PyTorch backend of the
same math: ``twell.ops.reference.sparse_train_torch.compact``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twell.ops.launch import CONFIG, check_operand, pow2


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
    BLOCK_H: tl.constexpr,  # columns per step (power of two; CONFIG compact_block_h)
    nnz_eff_ptr=None,  # (N,) int32 out (HEAVY): nnz, or 0 for a row above KC (dense-backup row)
    heavy_ptr=None,  # (1,) int32 in/out (HEAVY), zeroed by the launcher: rows above KC
    HEAVY: tl.constexpr = False,  # also write nnz_eff and count the heavy rows
):
    """ReLU + compaction: per row, slot ``pos = #(active columns before c)`` gets (c, g[n, c]).

    active[n, c] = not (g[n, c] <= 0) (NaN active); nnz[n] = sum_c active (all of them, also past KC); counts[c] +=
    sum_n active. With HEAVY also nnz_eff[n] = nnz[n], or 0 when nnz[n] > KC (the row goes to
    the dense backup), and heavy += the number of such rows.

    A program is one row on one warp by default (8 values per thread at bf16: the row scan and the
    column counts stay inside the warp; more rows on more warps ran 2-4x slower on the H200), two
    column blocks are in flight while one is scanned, a block with no active entry is skipped (no
    scan, stores or atomics), and the per-column counts are relaxed atomics issued only for columns
    active in the block. BENCHMARKS.md, "Training FFN".
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
        # NaN counts as active: a NaN row is heavy and reaches the backup. Compared in fp32, as
        # the other kernels do: Triton's interpreter compares bf16 by its bits (every negative
        # gate would count active), and the CPU tests must see the GPU's counts
        act = ~(g.to(tl.float32) <= 0)
        if tl.sum(tl.sum(act.to(tl.int32), axis=1), axis=0) > 0:  # skip all-zero blocks
            base = _compact_block(g, act, base, rows64, cols, col_ptr, val_ptr, counts_ptr,
                                  H, KC, BLOCK_N, BLOCK_H)
    tl.store(nnz_ptr + rows, base, mask=mrow)
    if HEAVY:  # the training forward's heavy-row bookkeeping
        heavy = (base > KC) & mrow
        tl.store(nnz_eff_ptr + rows, tl.where(heavy, 0, base), mask=mrow)
        tl.atomic_add(heavy_ptr + rows * 0, tl.full([BLOCK_N], 1, tl.int32), mask=heavy,
                      sem="relaxed")


_G_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _compact(g_NH: torch.Tensor, kc: int, heavy: bool):
    if not isinstance(kc, int) or isinstance(kc, bool) or kc < 1:
        raise ValueError(f"kc: the ELL capacity must be an int >= 1; got {kc!r}")
    if g_NH.dim() != 2:
        raise ValueError(f"g_NH: expected a 2-D (N, H) tensor, got shape {tuple(g_NH.shape)}")
    if g_NH.dtype not in _G_DTYPES:
        raise ValueError(f"g_NH: dtype must be float16, bfloat16 or float32; got {g_NH.dtype}")
    n, h = g_NH.shape
    check_operand("g_NH", g_NH, (n, h))
    dev = g_NH.device
    col = torch.empty((n, kc), dtype=torch.int32, device=dev)
    val = torch.empty((n, kc), dtype=g_NH.dtype, device=dev)
    nnz = torch.empty((n,), dtype=torch.int32, device=dev)
    nnz_eff = torch.empty((n,), dtype=torch.int32, device=dev) if heavy else None
    zeros = torch.zeros((h + 1,), dtype=torch.int32, device=dev)  # one fill: counts + n_heavy
    counts, n_heavy = zeros[:h], zeros[h:]
    if n > 0:
        block_n = pow2(CONFIG["compact_block_n"], 1, 16)
        _compact_kernel[(triton.cdiv(n, block_n),)](
            g_NH, col, val, nnz, counts, n, h, g_NH.stride(0), kc,
            BLOCK_N=block_n, BLOCK_H=pow2(h, 16, CONFIG["compact_block_h"]),
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
        ValueError: g_NH not 2-D contiguous fp16 / bf16 / fp32, or kc not an int >= 1.
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
        ValueError: g_NH not 2-D contiguous fp16 / bf16 / fp32, or kc not an int >= 1.
    """
    return _compact(g_NH, kc, heavy=True)
