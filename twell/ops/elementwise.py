"""Fused elementwise passes of the dense rows: ``h = relu(g) * u`` forward (with the statistics) and backward.

Shape legend: N tokens, H FFN width, R dense-backup rows.

Used by dense mode (every row, ``dense_fwd`` with per-row L1 / L0 and per-unit counts) and by the
sparse training op's dense backup (its heavy rows, ``backup_fwd``); ``backup_bwd`` is the backward
of both. One fused pass each instead of ~4 separate PyTorch ops (the unfused backup cost ~1.4 ms
over dense at 10 % density on the H200, M 16384, H 5632; BENCHMARKS.md). relu(NaN) = NaN
as in PyTorch (a plain GPU max would return 0). PyTorch backend of the same math:
``twell.ops.reference.sparse_train_torch``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twell.ops.launch import CONFIG, check_operand, pow2


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
    """dh += scale * sign(h) (sign(NaN) = 0, as PyTorch's L1 gradient); dg = dh * u where
    relu(g) is not 0 (a NaN gate passes, as in PyTorch), else exactly 0; du = dh * g; h = g * u."""
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
    tl.store(dh_ptr + offs, tl.where(g <= 0, 0.0, dh * u).to(dh_ptr.dtype.element_ty), mask=m)
    tl.store(du_ptr + offs, (dh * g).to(du_ptr.dtype.element_ty), mask=m)
    tl.store(h_ptr + offs, h, mask=m)


@triton.jit
def _dense_fwd_kernel(
    g_ptr,  # (N, H) gate pre-activation (read only)
    u_ptr,  # (N, H) up
    h_ptr,  # (N, H) out: h = relu(g) * u (dtype of h)
    l1_ptr,  # (N,) fp32 out: sum_j |h_nj| (of the rounded h)
    nnz_ptr,  # (N,) int32 out: active units of the row (not (g <= 0): NaN active)
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
        act = ~(g <= 0)
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
        ValueError: g_NH / u_NH not of one (N, H) shape and dtype, or not contiguous.
    """
    if g_NH.dim() != 2:
        raise ValueError(f"g_NH: expected a 2-D (N, H) tensor, got shape {tuple(g_NH.shape)}")
    n, h = g_NH.shape
    check_operand("g_NH", g_NH, (n, h))
    check_operand("u_NH", u_NH, (n, h), g_NH.dtype)
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
        BLOCK_H=pow2(h, 16, CONFIG["dense_block_h"]), STATS=stats,
        num_warps=CONFIG["dense_warps"],
    )
    if not stats:
        return out, None, None, None
    return out, l1, nnz, cpart.sum(0, dtype=torch.int32)


_EW_BLOCK = 4096


def backup_fwd(g_RH: torch.Tensor, u_RH: torch.Tensor):
    """relu(g) in place; returns (h_RH, l1 fp32 scalar = sum |h|)."""
    check_operand("g_RH", g_RH, tuple(g_RH.shape))
    check_operand("u_RH", u_RH, tuple(g_RH.shape))
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
        check_operand(name, t, tuple(g_RH.shape))
    du = torch.empty_like(dh_RH)
    h = torch.empty_like(g_RH)
    numel = g_RH.numel()
    if numel:
        scale = l1_scale.reshape(1).to(torch.float32).contiguous()
        _backup_bwd_kernel[(triton.cdiv(numel, _EW_BLOCK),)](
            dh_RH, g_RH, u_RH, du, h, scale, numel, BLOCK=_EW_BLOCK, num_warps=8,
        )
    return dh_RH, du, h
