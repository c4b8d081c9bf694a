"""RMSNorm whose output leaves the kernel in the compute dtype: fp32 residual stream in, bf16
out, and in backward bf16 output gradient in, fp32 input gradient out.

Why: under bf16 autocast over fp32 master weights the residual stream is fp32, and every norm
of a decoder layer feeds bf16 GEMMs. Liger-Kernel's RMSNorm returns its input's dtype, so the
trainer's ``norm_out_bf16`` (``train.liger``) casts its fp32 output once for all consumers: a
second pass over the row in forward (read 4 + write 2 bytes an element, after the kernel wrote
4) and, in backward, the cast's own backward (read 2, write 4) before the norm's backward reads
the fp32 gradient again. Here the cast is the store's and the gradient's widening is the load's:
16 bytes an element less per norm and step (forward 14 -> 6, backward 18 -> 10 with Liger's
backward), two kernels less, and 8 more where ``trainer.recompute_norms`` runs the forward again
in backward. The math is Liger's ``llama`` casting mode in fp32 (``y = (x * rstd) * w`` rounded
once to the output dtype; ``dx = rstd * (m - x * rstd^2 * mean(m * x))`` with ``m = dy * w``;
``dw = sum over rows of dy * x * rstd``), the same order of operations and forward launch (a
row's sum of squares in one block of Liger's warps). The backward's launch is not Liger's
(:func:`bwd_launch`: several programs an SM, each over a contiguous run of rows, where Liger's
one program an SM waits on each row's loads and sum); dW is still per-program partial rows
summed at the end, no atomics: run to run the same bits. Not the same bits as Liger's kernel
and a cast: the bf16 store and load let Triton give each thread 8 columns where Liger's all-fp32
kernel gives 4, so the row sums round differently (one H200, 4096 x 2048: 21 of 8.4 M bf16
outputs one bf16 step apart, most dx elements one fp32 ulp); with an fp32 output the forward's
bits are Liger's, and dW's partial sums are taken over other runs of rows than Liger's. Liger's
launch for rows of at most 256 columns (several rows a program) is not reproduced.

Source: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019), as transformers'
``LlamaRMSNorm`` computes it; Liger-Kernel's ``LigerRMSNormFunction`` for the launch shape.
Shape legend: N rows (tokens), D the normalised width.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.libdevice import rsqrt

_MAX_BLOCK = 65536  # one row in one block: 64 K fp32 columns at most


@triton.jit
def _rms_norm_cast_fwd_kernel(
    x_ptr,  # (N, D) input, unit column stride
    w_ptr,  # (D,) weight
    y_ptr,  # (N, D) output, contiguous, y's dtype
    rstd_ptr,  # (N,) fp32: 1 / sqrt(mean(x^2) + eps), kept for backward
    D,
    stride_x,
    eps,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,  # CUDA: libdevice's rsqrt, as Liger's kernel
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / D
    if LIBDEVICE:
        rstd = rsqrt(mean_square + eps)
    else:  # the interpreter has no libdevice
        rstd = tl.rsqrt(mean_square + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * D + cols, ((x * rstd) * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_cast_bwd_kernel(
    dy_ptr,  # (N, D) output gradient, unit column stride, any float dtype
    x_ptr,  # (N, D) forward input
    w_ptr,  # (D,)
    rstd_ptr,  # (N,) fp32 from forward
    dx_ptr,  # (N, D) input gradient, contiguous, dx's dtype
    dw_ptr,  # (P, D) fp32 partial weight gradients, one row per program
    N,
    D,
    stride_dy,
    stride_x,
    tiles_per_program,
    ROWS: tl.constexpr,  # rows a tile: loads of several rows in flight before the row sums
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    first = pid * tiles_per_program
    for tile in range(first, first + tiles_per_program):
        r = tile * ROWS + rows
        rmask = r < N
        mask = rmask[:, None] & cmask[None, :]
        dy = tl.load(dy_ptr + r[:, None] * stride_dy + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        x = tl.load(x_ptr + r[:, None] * stride_x + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=rmask, other=0.0)[:, None]
        m = dy * w
        # Liger's order of operations
        dx = rstd * m
        dx += rstd * (-(1 / D) * rstd * rstd * tl.sum(m * x, axis=1)[:, None] * x)
        tl.store(dx_ptr + r[:, None] * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)
        dw += dy * (x * rstd)
    tl.store(dw_ptr + pid * D + cols, tl.sum(dw, axis=0), mask=cmask)


def _launch(d: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for width ``d``: the row in one power-of-two block; Liger's warps."""
    block = triton.next_power_of_2(d)
    if block > _MAX_BLOCK:
        raise ValueError(f"rms_norm_cast: width {d} is over the {_MAX_BLOCK} columns one block "
                         "holds; use Liger's or transformers' RMSNorm for wider rows")
    return block, 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4


class BwdLaunch(NamedTuple):
    """How the backward kernel is launched: ``rows`` a tile, ``per_sm`` programs an SM (each
    loops over a contiguous run of tiles and writes one partial dW row), ``warps`` a program."""

    rows: int
    per_sm: int
    warps: int


def bwd_launch(d: int) -> BwdLaunch:
    """The backward's launch for width ``d``. Liger's (one program an SM looping over single
    rows) keeps one row's loads in flight an SM and waits on each row sum: latency-bound, 359 us
    at 1.5B (micro-batch 16, one H100) where its bytes need ~200. Several programs an SM keep
    several rows' loads in flight; tiles of several rows do the same inside a program for
    narrow rows (a 576-wide row is one small load)."""
    block, warps = _launch(d)
    rows = max(1, min(4, 2048 // block))
    return BwdLaunch(rows=rows, per_sm=4, warps=warps if rows == 1 else 4)


def _programs(x: torch.Tensor, n_tiles: int, per_sm: int) -> int:
    """Backward programs: ``per_sm`` an SM on CUDA, a few under the interpreter; never more
    than the tiles."""
    if x.is_cuda:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        return max(1, min(n_tiles, per_sm * sms))
    return max(1, min(n_tiles, 4))


def rms_norm_cast_backward(dy_ND: torch.Tensor, x_ND: torch.Tensor, weight: torch.Tensor,
                           rstd: torch.Tensor, launch: BwdLaunch | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx (N, D) in x's dtype, dW (D,) fp32) of :func:`rms_norm_cast` from the output gradient
    ``dy_ND`` (N, D), its forward input ``x_ND`` (N, D; unit column strides) and the forward's
    fp32 ``rstd`` (N,). ``launch``: :func:`bwd_launch`'s unless given (the norm benchmark's
    variants); a launch fixes the dW partial sums' order, so the bits are the same run to run."""
    n, d = x_ND.shape
    block, _ = _launch(d)
    launch = launch or bwd_launch(d)
    n_tiles = triton.cdiv(n, launch.rows) if n else 0
    p = _programs(x_ND, n_tiles, launch.per_sm)
    dx = torch.empty((n, d), dtype=x_ND.dtype, device=x_ND.device)
    dw_part = torch.zeros((p, d), dtype=torch.float32, device=x_ND.device)
    if n:
        _rms_norm_cast_bwd_kernel[(p,)](dy_ND, x_ND, weight, rstd, dx, dw_part, n, d,
                                        dy_ND.stride(0), x_ND.stride(0), triton.cdiv(n_tiles, p),
                                        ROWS=launch.rows, BLOCK=block, num_warps=launch.warps)
    return dx, dw_part.sum(0)


class _RMSNormCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype):
        d = x.shape[-1]
        x_ND = x.reshape(-1, d)
        if d > 1 and x_ND.stride(1) != 1:
            x_ND = x_ND.contiguous()
        n = x_ND.shape[0]
        block, warps = _launch(d)
        y = torch.empty((n, d), dtype=out_dtype, device=x.device)
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        if n:
            _rms_norm_cast_fwd_kernel[(n,)](x_ND, weight, y, rstd, d, x_ND.stride(0), eps,
                                            BLOCK=block, LIBDEVICE=x.is_cuda, num_warps=warps)
        ctx.save_for_backward(x_ND, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x_ND, weight, rstd = ctx.saved_tensors
        d = x_ND.shape[1]
        dy_ND = dy.reshape(-1, d)
        if d > 1 and dy_ND.stride(1) != 1:
            dy_ND = dy_ND.contiguous()
        dx, dw = rms_norm_cast_backward(dy_ND, x_ND, weight, rstd)
        dw = dw.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(ctx.shape), dw, None, None


def rms_norm_cast(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """``(x * rsqrt(mean(x^2, -1) + eps) * weight).to(out_dtype)`` in one kernel each way.

    Args:
        x: (..., D) float tensor (the fp32 residual stream; bf16 / fp16 work too), its last
            dimension contiguous or copied so; on CUDA (or CPU under ``TRITON_INTERPRET=1``).
            The kernels compute in fp32 whatever the dtype (fp64 too).
        weight: (D,) float tensor on x's device (fp32 master weight).
        eps: added to the mean square (the norm's ``variance_epsilon``).
        out_dtype: the output's float dtype (bf16 under autocast).

    Returns:
        (..., D) contiguous tensor of ``out_dtype``: the fp32 result rounded once. Autograd:
        dx in x's dtype, dweight in weight's (accumulated in fp32); the output gradient may be
        any float dtype (widened to fp32 as it is loaded). NaN and inf propagate as in PyTorch's
        RMSNorm (a NaN makes its row NaN; an inf makes its row's rstd 0: NaN where it was).

    Raises:
        ValueError: x 0-dim, x and weight disagree on D or device, D over 65536, or a dtype
            that is not floating point.
    """
    if x.dim() == 0:
        raise ValueError("rms_norm_cast: x must have a last dimension to normalise, got a "
                         "0-dim tensor")
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm_cast: weight must be ({d},) for x of shape "
                         f"{tuple(x.shape)}, got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"rms_norm_cast: x on {x.device}, weight on {weight.device}")
    if not (x.is_floating_point() and weight.is_floating_point() and out_dtype.is_floating_point):
        raise ValueError(f"rms_norm_cast: float tensors and dtype expected, got x {x.dtype}, "
                         f"weight {weight.dtype}, out_dtype {out_dtype}")
    _launch(d)
    # the kernels read the weight with unit stride
    return _RMSNormCast.apply(x, weight.contiguous(), float(eps), out_dtype)


__all__ = ["BwdLaunch", "bwd_launch", "rms_norm_cast", "rms_norm_cast_backward"]
