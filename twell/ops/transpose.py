"""Transposing cast: ``out = src^T`` in another (or the same) float dtype, one tiled pass.

Why: the training op (``twell.ops.ffn_train``) needs Wd^T as (H, D) rows in the compute dtype
twice a call (the forward's SpMM, the backward's SDDMM) and hands dWd back in Wd's (D, H)
layout. PyTorch's ``copy_`` from a transposed view runs its non-vectorised elementwise kernel,
one side of which is strided by a whole row: 75.5 us for each of these three copies of a
(2048, 5632) bf16 tensor on one H200 (46 MB moved, 0.6 TB/s; BENCHMARKS.md, "Built after the
calls: the training op's copies"). Here each program loads a (BLOCK, BLOCK) tile along the
source's rows and stores it along the output's rows, so both sides are coalesced (Triton moves
the tile through shared memory). Shape legend: R source rows, C source columns.
PyTorch backend: ``twell.ops.reference.sparse_train_torch.transposed``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twell.ops.launch import CONFIG


@triton.jit
def _transpose_kernel(
    src_ptr,  # (R, C) source, unit column stride
    out_ptr,  # (C, R) out, unit column stride
    R,  # source rows
    C,  # source columns
    stride_src,  # row stride of src
    stride_out,  # row stride of out
    N_CBLOCKS,  # cdiv(C, BLOCK)
    BLOCK: tl.constexpr,  # tile side
    VIA_F32: tl.constexpr,  # fp64 source, 16-bit out: round to fp32 first
):
    """``out[c, r] = src[r, c]``, cast to out's dtype (round to nearest even; NaN and inf kept).

    One program per (BLOCK, BLOCK) tile, a 1-D grid (no 65,535 limit on either side)."""
    pid = tl.program_id(0)
    offs_r = (pid // N_CBLOCKS) * BLOCK + tl.arange(0, BLOCK)
    offs_c = (pid % N_CBLOCKS) * BLOCK + tl.arange(0, BLOCK)
    mr = offs_r < R
    mc = offs_c < C
    tile = tl.load(src_ptr + offs_r[:, None].to(tl.int64) * stride_src + offs_c[None, :],
                   mask=mr[:, None] & mc[None, :])
    if VIA_F32:  # PyTorch casts fp64 to fp16 / bf16 through fp32 (two roundings); the direct
        # cast rounds once (and the interpreter's fp64 -> bf16 reads the bits as fp32's)
        tile = tile.to(tl.float32)
    out = tl.trans(tile.to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + offs_c[:, None].to(tl.int64) * stride_out + offs_r[None, :], out,
             mask=mc[:, None] & mr[None, :])


def transposed(src_RC: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``src^T`` as a new contiguous (C, R) tensor of ``dtype``, in one pass.

    Args:
        src_RC: (R, C) float tensor with unit column stride (any row stride), on CUDA (or CPU
            under ``TRITON_INTERPRET=1``).
        dtype: the output's float dtype (the same as src's, or a cast).

    Returns:
        (C, R) contiguous tensor of ``dtype``: the values of ``src_RC.t().to(dtype)`` bit for
        bit (the cast rounds to nearest even as PyTorch's does, fp64 to 16 bits through fp32
        as PyTorch's does; NaN and inf pass through).

    Raises:
        ValueError: src not 2-D or not floating point, its columns not contiguous (stride(1) != 1
            with C > 1), or ``dtype`` not a float dtype.
    """
    if src_RC.dim() != 2:
        raise ValueError(f"src_RC: expected a 2-D tensor, got shape {tuple(src_RC.shape)}")
    if not src_RC.is_floating_point():
        raise ValueError(f"src_RC: expected a float tensor, got {src_RC.dtype}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: the output's dtype must be a float torch.dtype; got {dtype!r}")
    r, c = src_RC.shape
    if c > 1 and src_RC.stride(1) != 1:
        raise ValueError(f"src_RC: columns must be contiguous (stride(1) == 1), got strides "
                         f"{src_RC.stride()}; pass a contiguous tensor")
    out = torch.empty((c, r), dtype=dtype, device=src_RC.device)
    if r == 0 or c == 0:
        return out
    block = CONFIG["transpose_block"]
    n_cblocks = triton.cdiv(c, block)
    via_f32 = src_RC.dtype == torch.float64 and dtype in (torch.float16, torch.bfloat16)
    _transpose_kernel[(triton.cdiv(r, block) * n_cblocks,)](
        src_RC, out, r, c, src_RC.stride(0), out.stride(0), n_cblocks, BLOCK=block,
        VIA_F32=via_f32, num_warps=CONFIG["transpose_warps"],
    )
    return out
