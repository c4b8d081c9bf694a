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
once to the output dtype for an fp32 ``x``; a bf16 / fp16 ``x * rstd`` is rounded to x's dtype
before the weight's product, as transformers' ``LlamaRMSNorm`` and Liger's kernel round it;
``dx = rstd * (m - x * rstd^2 * mean(m * x))`` with ``m = dy * w``; ``dw = sum over rows of
dy * x * rstd``), the same order of operations and forward launch (a row's sum of squares in one
block of Liger's warps). The backward's launch is not Liger's
(:func:`bwd_launch`: several programs an SM, each over a contiguous run of rows, where Liger's
one program an SM waits on each row's loads and sum); dW is still per-program partial rows
summed at the end, no atomics: run to run the same bits. Not the same bits as Liger's kernel
and a cast: the bf16 store and load let Triton give each thread 8 columns where Liger's all-fp32
kernel gives 4, so the row sums round differently (one H200, 4096 x 2048: 21 of 8.4 M bf16
outputs one bf16 step apart, most dx elements one fp32 ulp); with an fp32 output the forward's
bits are Liger's, and dW's partial sums are taken over other runs of rows than Liger's. Liger's
launch for rows of at most 256 columns (several rows a program) is not reproduced.

The fused residual add (:func:`add_rms_norm_cast`) runs the same two kernels with the add folded
in: the forward adds the branch output to the residual as it loads them and writes the fp32 sum
beside the norm's output; the backward adds the sum's own gradient to the norm's input gradient
before its store and writes that total twice, fp32 for the residual and in the branch's dtype.
At a decoder layer's residual join this replaces PyTorch's mixed-dtype add, the gradient sum
autograd makes where the sum has two consumers and the cast back to the branch's dtype: forward
16 -> 12 bytes an element, backward ~28 -> 16 (BENCHMARKS.md, "A fused residual add and norm").
Without autograd the residual may also be bf16 / fp16 (a bf16 model's inference forward): the
sum is then stored, and normalised, in that dtype, as PyTorch's add rounds it (forward 8 bytes
an element where the add (6) and Liger's norm (4) move 10).

Source: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019), as transformers'
``LlamaRMSNorm`` computes it; Liger-Kernel's ``LigerRMSNormFunction`` for the launch shape; the
add's fusion as vLLM's ``fused_add_rms_norm`` and Liger-Kernel's ``LigerFusedAddRMSNorm`` do it
(written here, not copied: theirs keep the sum in the inputs' dtype, and Liger-Kernel 0.8.5's
returns one gradient tensor for both inputs, in that dtype).
Shape legend: N rows (tokens), D the normalised width.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.libdevice import rsqrt

_MAX_BLOCK = 65536  # one row in one block: 64 K fp32 columns at most
# the residual's (and so the sum's) dtypes of add_rms_norm_cast: bf16 / fp16 without autograd
_SUM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_cast_fwd_kernel(
    x_ptr,  # (N, D) input, unit column stride (HAS_DELTA: the residual, the sum's dtype)
    delta_ptr,  # (N, D) HAS_DELTA: added to x, unit column stride, any float dtype
    sum_ptr,  # (N, D) HAS_DELTA: x + delta, contiguous, x's dtype
    w_ptr,  # (D,) weight
    y_ptr,  # (N, D) output, contiguous, y's dtype
    rstd_ptr,  # (N,) fp32: 1 / sqrt(mean(x^2) + eps), kept for backward
    D,
    stride_x,
    stride_delta,
    eps,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,  # CUDA: libdevice's rsqrt, as Liger's kernel
    HAS_DELTA: tl.constexpr,  # normalise x + delta (and write it) instead of x
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        # the norm reads the sum as it stores it (rounded to a bf16 / fp16 residual's dtype,
        # as PyTorch's add): its output is the unfused norm's of that sum
        x += tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * D + cols, x, mask=mask)
        x = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / D
    if LIBDEVICE:
        rstd = rsqrt(mean_square + eps)
    else:  # the interpreter has no libdevice
        rstd = tl.rsqrt(mean_square + eps)
    tl.store(rstd_ptr + row, rstd)
    # x * rstd in the input's dtype before the weight's product, as transformers' LlamaRMSNorm
    # and Liger's llama mode round it (nothing to round for an fp32 input)
    x = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * D + cols, (x * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_cast_bwd_kernel(
    dy_ptr,  # (N, D) output gradient, unit column stride, any float dtype
    x_ptr,  # (N, D) forward input
    w_ptr,  # (D,)
    rstd_ptr,  # (N,) fp32 from forward
    dx_ptr,  # (N, D) input gradient, contiguous, dx's dtype
    dw_ptr,  # (P, D) fp32 partial weight gradients, one row per program
    dsum_ptr,  # (N, D) HAS_DSUM: gradient reaching x besides the norm's, unit column stride
    dx2_ptr,  # (N, D) HAS_DX2: a second copy of dx, contiguous, in its own dtype
    N,
    D,
    stride_dy,
    stride_x,
    stride_dsum,
    tiles_per_program,
    ROWS: tl.constexpr,  # rows a tile: loads of several rows in flight before the row sums
    BLOCK: tl.constexpr,
    HAS_DSUM: tl.constexpr,  # dx += dsum (x is a sum also used outside the norm)
    HAS_DX2: tl.constexpr,  # also store dx to dx2 (the add's other input, another dtype)
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
        if HAS_DSUM:
            dx += tl.load(dsum_ptr + r[:, None] * stride_dsum + cols[None, :], mask=mask,
                          other=0.0).to(tl.float32)
        tl.store(dx_ptr + r[:, None] * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)
        if HAS_DX2:
            tl.store(dx2_ptr + r[:, None] * D + cols[None, :], dx.to(dx2_ptr.dtype.element_ty),
                     mask=mask)
        dw += dy * (x * rstd)
    tl.store(dw_ptr + pid * D + cols, tl.sum(dw, axis=0), mask=cmask)


def _launch(d: int, op: str = "rms_norm_cast") -> tuple[int, int]:
    """(BLOCK, num_warps) for width ``d``: the row in one power-of-two block; Liger's warps.
    ``op`` names the caller in the error."""
    block = triton.next_power_of_2(d)
    if block > _MAX_BLOCK:
        raise ValueError(f"{op}: width {d} is over the {_MAX_BLOCK} columns one block "
                         "holds; use Liger's or transformers' RMSNorm for wider rows")
    return block, 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4


class BwdLaunch(NamedTuple):
    """How the backward kernel is launched: ``rows`` a tile, ``per_sm`` programs an SM (each
    loops over a contiguous run of tiles and writes one partial dW row), ``warps`` a program.
    Rows and warps must be powers of two, ``per_sm`` >= 1 (else the backward raises
    ``ValueError``)."""

    rows: int
    per_sm: int
    warps: int


def bwd_launch(d: int) -> BwdLaunch:
    """The backward's launch for width ``d``. Liger's (one program an SM looping over single
    rows) keeps one row's loads in flight an SM and waits on each row sum: latency-bound.
    Eight programs an SM keep eight rows' loads in flight. Measured on one H100
    (``scripts/bench_norm.py``, 36 launches; BENCHMARKS.md, "The norm backward's launch"): at
    32768 x 2048 Liger's launch 369 us, this one 257 us, the best of the 36 252; at 16384 x 576
    this one is the best (55 us; Liger's 123). Rows wider than 2048 keep the forward's warps
    (4 warps would give a thread 32 or more columns: not measured)."""
    block, warps = _launch(d)
    return BwdLaunch(rows=1, per_sm=8, warps=4 if block <= 2048 else warps)


def _programs(x: torch.Tensor, n_tiles: int, per_sm: int) -> int:
    """Backward programs: ``per_sm`` an SM on CUDA, a few under the interpreter; never more
    than the tiles."""
    if x.is_cuda:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        return max(1, min(n_tiles, per_sm * sms))
    return max(1, min(n_tiles, 4))


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """``t`` as (N, d) rows with unit column stride (the kernels' loads), copied only if not."""
    t_ND = t.reshape(-1, d)
    if d > 1 and t_ND.stride(1) != 1:
        t_ND = t_ND.contiguous()
    return t_ND


def _backward(dy_ND, x_ND, weight, rstd, launch, dx_dtype, dsum_ND=None, dx2_dtype=None):
    """(dx (N, D) in ``dx_dtype``, its copy in ``dx2_dtype`` or None, dW (D,) fp32): the one
    backward kernel's launch; ``dsum_ND`` (N, D), if given, is added to dx before the stores."""
    n, d = x_ND.shape
    block, _ = _launch(d)
    launch = launch or bwd_launch(d)
    if not all(v >= 1 for v in launch) or any(v & (v - 1) for v in (launch.rows, launch.warps)):
        raise ValueError(f"BwdLaunch: rows and warps must be powers of two and per_sm >= 1; "
                         f"got {launch}")
    n_tiles = triton.cdiv(n, launch.rows) if n else 0
    p = _programs(x_ND, n_tiles, launch.per_sm)
    dx = torch.empty((n, d), dtype=dx_dtype, device=x_ND.device)
    dx2 = None if dx2_dtype is None else torch.empty((n, d), dtype=dx2_dtype, device=x_ND.device)
    dw_part = torch.zeros((p, d), dtype=torch.float32, device=x_ND.device)
    if n:
        # the pointers a False flag leaves unread are dx's: any tensor of the device would do
        _rms_norm_cast_bwd_kernel[(p,)](
            dy_ND, x_ND, weight, rstd, dx, dw_part,
            dx if dsum_ND is None else dsum_ND, dx if dx2 is None else dx2,
            n, d, dy_ND.stride(0), x_ND.stride(0), 0 if dsum_ND is None else dsum_ND.stride(0),
            triton.cdiv(n_tiles, p), ROWS=launch.rows, BLOCK=block,
            HAS_DSUM=dsum_ND is not None, HAS_DX2=dx2 is not None, num_warps=launch.warps)
    return dx, dx2, dw_part.sum(0)


def rms_norm_cast_backward(dy_ND: torch.Tensor, x_ND: torch.Tensor, weight: torch.Tensor,
                           rstd: torch.Tensor, launch: BwdLaunch | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx (N, D) in x's dtype, dW (D,) fp32) of :func:`rms_norm_cast` from the output gradient
    ``dy_ND`` (N, D), its forward input ``x_ND`` (N, D; unit column strides) and the forward's
    fp32 ``rstd`` (N,). ``launch``: :func:`bwd_launch`'s unless given (the norm benchmark's
    variants); a launch fixes the dW partial sums' order, so the bits are the same run to run.
    ``weight`` (D,) is read with unit stride. The math: Liger-Kernel's ``llama`` mode backward
    (module docstring); Zhang & Sennrich (2019). Bytes an element: read dy's size + x's, write
    dx's.

    Raises:
        ValueError: D over 65536, or a launch whose rows or warps are not powers of two or
            whose ``per_sm`` is below 1."""
    dx, _, dw = _backward(dy_ND, x_ND, weight, rstd, launch, x_ND.dtype)
    return dx, dw


class _RMSNormCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype):
        d = x.shape[-1]
        x_ND = _rows(x, d)
        n = x_ND.shape[0]
        block, warps = _launch(d)
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)  # not a view: in-place ok
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        if n:
            # delta and sum are not read without HAS_DELTA: x stands in
            _rms_norm_cast_fwd_kernel[(n,)](x_ND, x_ND, x_ND, weight, y, rstd, d, x_ND.stride(0),
                                            0, eps, BLOCK=block, LIBDEVICE=x.is_cuda,
                                            HAS_DELTA=False, num_warps=warps)
        ctx.save_for_backward(x_ND, weight, rstd)
        ctx.shape = x.shape
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x_ND, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_cast_backward(_rows(dy, x_ND.shape[1]), x_ND, weight, rstd)
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
        (..., D) contiguous tensor of ``out_dtype``: the fp32 result rounded once (a bf16 /
        fp16 x: ``x * rstd`` rounded to x's dtype first, as transformers' ``LlamaRMSNorm``
        rounds it; with weight and out_dtype of x's dtype, its forward up to the row sum's
        order). Autograd: dx in x's dtype, dweight in weight's (accumulated in fp32); the
        output gradient may be any float dtype (widened to fp32 as it is loaded). NaN and inf
        propagate as in PyTorch's RMSNorm (a NaN makes its row NaN; an inf makes its row's
        rstd 0: NaN where it was).

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


def add_rms_norm_cast_backward(g_sum_ND: torch.Tensor | None, g_normed_ND: torch.Tensor,
                               sum_ND: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                               delta_dtype: torch.dtype | None,
                               launch: BwdLaunch | None = None,
                               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(grad_residual (N, D) fp32, grad_delta (N, D) in ``delta_dtype``, dW (D,) fp32) of
    :func:`add_rms_norm_cast`, in one kernel: ``g_total = g_sum + (the norm's input gradient
    from g_normed)``, stored fp32 and, where ``delta_dtype`` is another dtype, a second time in
    it. ``g_sum_ND`` (N, D), the gradient of ``sum`` (None: nothing reads ``sum``), and
    ``g_normed_ND`` (N, D) any float dtype with unit column strides; ``sum_ND`` (N, D) fp32,
    ``rstd`` (N,) fp32 from the forward. ``delta_dtype`` None: no grad_delta (returned None);
    fp32: grad_delta is grad_residual, the same tensor, as PyTorch's add gives both inputs one
    gradient. ``launch`` as in :func:`rms_norm_cast_backward`, dW's bits the same run to run.
    Bytes an element: read g_normed's size + 4 (sum) + 4 (g_sum), write 4 + delta's size.
    ``weight`` (D,) is read with unit stride. Source as :func:`add_rms_norm_cast`.

    Raises:
        ValueError: as :func:`rms_norm_cast_backward` (width, launch)."""
    cast = delta_dtype if delta_dtype not in (None, sum_ND.dtype) else None
    g_total, g_delta, dw = _backward(g_normed_ND, sum_ND, weight, rstd, launch, sum_ND.dtype,
                                     dsum_ND=g_sum_ND, dx2_dtype=cast)
    if delta_dtype == sum_ND.dtype:
        g_delta = g_total
    return g_total, g_delta, dw


class _AddRMSNormCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, delta, weight, eps, out_dtype):
        # a gradient autograd leaves undefined stays None: no zeros to write and read back
        ctx.set_materialize_grads(False)
        d = residual.shape[-1]
        r_ND, delta_ND = _rows(residual, d), _rows(delta, d)
        n = r_ND.shape[0]
        block, warps = _launch(d, "add_rms_norm_cast")
        # the outputs in residual's shape (contiguous: the kernel's (N, D) rows), not views of
        # (N, D) tensors: autograd refuses in-place ops on a function's view outputs
        s = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
        y = torch.empty(residual.shape, dtype=out_dtype, device=residual.device)
        rstd = torch.empty(n, dtype=torch.float32, device=residual.device)
        if n:
            _rms_norm_cast_fwd_kernel[(n,)](r_ND, delta_ND, s, weight, y, rstd, d,
                                            r_ND.stride(0), delta_ND.stride(0), eps,
                                            BLOCK=block, LIBDEVICE=residual.is_cuda,
                                            HAS_DELTA=True, num_warps=warps)
        ctx.save_for_backward(s, weight, rstd)
        ctx.shape, ctx.delta_dtype = residual.shape, delta.dtype
        return s, y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_sum, g_normed):
        s, weight, rstd = ctx.saved_tensors
        s = s.view(-1, s.shape[-1])
        need_residual, need_delta, need_weight = ctx.needs_input_grad[:3]
        delta_dtype = ctx.delta_dtype if need_delta else None
        if g_normed is None:  # only ``sum`` was used: the add's backward alone
            if g_sum is None:
                return None, None, None, None, None
            g_delta = g_sum.to(delta_dtype) if need_delta else None
            return g_sum if need_residual else None, g_delta, None, None, None
        d = s.shape[1]
        g_sum_ND = None if g_sum is None else _rows(g_sum, d)
        g_total, g_delta, dw = add_rms_norm_cast_backward(
            g_sum_ND, _rows(g_normed, d), s, weight, rstd, delta_dtype)
        g_residual = g_total.view(ctx.shape)
        # one tensor for both, as PyTorch's add: autograd then gives two leaves' .grad their own
        # storage, where two views of one buffer would both be taken as .grad
        if g_delta is g_total:
            g_delta = g_residual
        elif g_delta is not None:
            g_delta = g_delta.view(ctx.shape)
        return (g_residual if need_residual else None, g_delta,
                dw.to(weight.dtype) if need_weight else None, None, None)


def _check_add_args(residual, delta, weight, out_dtype) -> None:
    """:func:`add_rms_norm_cast`'s argument checks: all its ValueErrors but the width's."""
    if residual.dim() == 0:
        raise ValueError("add_rms_norm_cast: residual must have a last dimension to normalise, "
                         "got a 0-dim tensor")
    if delta.shape != residual.shape:
        raise ValueError(f"add_rms_norm_cast: delta must have residual's shape "
                         f"{tuple(residual.shape)}, got {tuple(delta.shape)}")
    d = residual.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"add_rms_norm_cast: weight must be ({d},) for residual of shape "
                         f"{tuple(residual.shape)}, got {tuple(weight.shape)}")
    if delta.device != residual.device or weight.device != residual.device:
        raise ValueError(f"add_rms_norm_cast: residual on {residual.device}, delta on "
                         f"{delta.device}, weight on {weight.device}: one device expected")
    if residual.dtype not in _SUM_DTYPES:
        raise ValueError(f"add_rms_norm_cast: residual must be float32, or bfloat16 / float16 "
                         f"without autograd (the sum is in its dtype), got {residual.dtype}")
    if residual.dtype != torch.float32 and torch.is_grad_enabled() and any(
            t.requires_grad for t in (residual, delta, weight)):
        # the backward kernel's total and its residual gradient are in the sum's dtype: only
        # fp32 is the gradient autograd would give
        raise ValueError(f"add_rms_norm_cast: a {residual.dtype} residual has no backward here "
                         "(its sum is in its dtype); run it under torch.no_grad() or pass the "
                         "fp32 residual stream")
    if not (delta.is_floating_point() and weight.is_floating_point()
            and out_dtype.is_floating_point):
        raise ValueError(f"add_rms_norm_cast: float tensors and dtype expected, got delta "
                         f"{delta.dtype}, weight {weight.dtype}, out_dtype {out_dtype}")


def add_rms_norm_cast(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                      eps: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum = residual + delta`` (in residual's dtype: fp32 in training) and ``normed =
    rms_norm_cast(sum, weight, eps, out_dtype)`` in one kernel each way: a decoder layer's
    residual join and the next norm.

    Forward: reads residual (its size: 4 bytes an element in fp32) and delta (its size), writes
    sum (residual's size) and normed (out_dtype's size), plus rstd (4 bytes a row). ``normed``
    is the same bits as :func:`rms_norm_cast` of ``sum`` with the same output dtype (the same
    kernel, fed the sum it stores; on CUDA a delta narrower than the output may change how
    Triton splits the row between threads, hence the row sums' rounding). Saved for backward:
    sum, weight, rstd (not residual or delta). Backward (:func:`add_rms_norm_cast_backward`):
    reads normed's gradient (its size), sum (4) and sum's gradient (4), writes residual's
    gradient (4) and delta's (its size); dW as :func:`rms_norm_cast`'s, run to run the same
    bits. Where only ``sum`` is used, the backward is the add's (sum's gradient passed on, cast
    for delta); where only ``normed`` is, sum's gradient is not read.

    Args:
        residual: (..., D) float32 tensor (the residual stream), on CUDA (or CPU under
            ``TRITON_INTERPRET=1``); its last dimension contiguous or copied so. bfloat16 /
            float16 only where no gradient is needed (none of the inputs requires grad, or
            grad mode is off: a bf16 model's inference).
        delta: the branch output added to it, residual's shape and device, any float dtype
            (bf16 under autocast); converted to fp32 as it is loaded, the fp32 sum rounded once
            to residual's dtype (an fp64 delta is narrowed).
        weight: (D,) float tensor on residual's device (fp32 master weight).
        eps: added to the mean square (the norm's ``variance_epsilon``).
        out_dtype: normed's float dtype (bf16 under autocast).

    Returns:
        (sum, normed): contiguous (..., D) tensors, sum in residual's dtype (PyTorch's
        ``residual + delta`` for a delta of that dtype, or fp32 one), normed ``out_dtype``
        (:func:`rms_norm_cast`'s rounding of that sum). Autograd (fp32 residual): residual's
        gradient fp32, delta's in delta's dtype (the one fp32 total, rounded once), weight's in
        weight's dtype (accumulated in fp32); the gradients of sum and normed may be any float
        dtype, or absent. ``sum`` is saved for backward: modifying it in place makes backward
        raise (autograd's version check). NaN and inf propagate as in PyTorch's add and RMSNorm
        (a NaN in residual or delta makes its row of normed NaN; an inf makes that row's rstd
        0: NaN where the inf was, 0 beside it).

    Raises:
        ValueError: residual 0-dim, not float32 / bfloat16 / float16, or not float32 where a
            gradient is needed; delta of another shape or device; weight not (D,) or on another
            device; D over 65536; a dtype that is not floating point.

    Source: Zhang & Sennrich (2019) for the norm; the fusion as vLLM's ``fused_add_rms_norm``
    and Liger-Kernel's ``LigerFusedAddRMSNorm`` (module docstring).
    """
    _check_add_args(residual, delta, weight, out_dtype)
    _launch(residual.shape[-1], "add_rms_norm_cast")
    return _AddRMSNormCast.apply(residual, delta, weight.contiguous(), float(eps), out_dtype)


__all__ = ["BwdLaunch", "add_rms_norm_cast", "add_rms_norm_cast_backward", "bwd_launch",
           "rms_norm_cast", "rms_norm_cast_backward"]
