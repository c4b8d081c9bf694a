"""Row scatter-add without atomics: ``dst[idx[i], :] += src[i, :]`` for distinct rows ``idx[i]``.

Why: the sparse training op adds its dense-backup rows into y and dx, and the hot units' weight
gradients into dWg, dWu and dWd^T, at distinct rows. PyTorch's CUDA ``index_add_`` makes one
atomic add per element, and the no-sync backup's unused slots, all clamped to row N - 1, piled
hundreds of rows of them onto that one row: 133 us a call, 64 calls a step (1.5B model,
micro-batch 16 x 2048, an H100 80 GB step profile: BENCHMARKS.md, the ``add_rows`` entry of
"Built after the calls"). With distinct rows each element has one writer, so
a plain load, add and store is exact and deterministic, and an unused slot (index N) is skipped.
Predicted bytes at R = 2048 used slots of 2560, D = 2048, bf16: 24 MiB (the used slots' src and
dst rows read, dst rows written) against ~26 MiB for ``index_add_`` (all 2560 src rows) plus its
5.2 M element atomics, 1 M of them on row N - 1's 2048 elements: the gain is the atomics, not
the bytes (not yet timed).

Shape legend: N destination rows, D row width, R slots. PyTorch backend:
``twell.ops.reference.sparse_train_torch.add_rows``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twell.ops.launch import CONFIG, pow2
from twell.ops.reference.sparse_train_torch import check_add_rows


@triton.jit
def _add_rows_kernel(
    dst_ptr,  # (N, D) in and out, unit column stride
    idx_ptr,  # (R,) int32 / int64: destination row of each slot; outside [0, N): unused slot
    src_ptr,  # (R, D) rows to add, dst's dtype, unit column stride
    N,  # destination rows
    D,  # row width
    stride_dst,  # row stride of dst
    stride_src,  # row stride of src
    stride_idx,  # element stride of idx
    BLOCK_D: tl.constexpr,  # columns per program
    F64: tl.constexpr,  # fp64 dst: add in fp64 (else fp32)
):
    """``dst[idx[i], c] = round(dst[idx[i], c] + src[i, c])`` in fp32 (fp64 for fp64), one
    rounding to dst's dtype: the value ``index_add_`` gives at a row indexed once. Slots whose
    index is outside [0, N) read and write nothing. Grid (R, cdiv(D, BLOCK_D)); no atomics: the
    caller's indices are distinct, so each element has one writer."""
    slot = tl.program_id(0)
    row = tl.load(idx_ptr + slot.to(tl.int64) * stride_idx).to(tl.int64)
    if (row < 0) | (row >= N):  # unused slot
        return
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = cols < D
    d_ptrs = dst_ptr + row * stride_dst + cols
    s = tl.load(src_ptr + slot.to(tl.int64) * stride_src + cols, mask=m)
    d = tl.load(d_ptrs, mask=m)
    if F64:
        v = d.to(tl.float64) + s.to(tl.float64)
    else:  # exact for two bf16 / fp16 values, so one rounding at the store (as index_add_)
        v = d.to(tl.float32) + s.to(tl.float32)
    tl.store(d_ptrs, v.to(dst_ptr.dtype.element_ty), mask=m)


def add_rows(dst_ND: torch.Tensor, idx_R: torch.Tensor, src_RD: torch.Tensor) -> torch.Tensor:
    """``dst[idx[i]] += src[i]`` for every slot i with ``0 <= idx[i] < N``, in place, no atomics.

    Precondition (not checked: it would need a host sync): the indices in [0, N) are
    distinct, as ``nonzero_static`` rows or a set of unit indices are. A repeated row would be
    a race (one add lost, not deterministic): use ``index_add_`` there.

    Args:
        dst_ND: (N, D) float tensor (fp32, bf16, fp16 or fp64), unit column stride, any row
            stride; updated in place.
        idx_R: (R,) int32 / int64 destination rows, any stride; an entry outside [0, N) marks
            an unused slot (the no-sync dense backup's fill value N), whose src row is not read.
        src_RD: (R, D) rows of dst's dtype (as ``index_add_``), unit column stride, any row
            stride; NaN and inf reach dst.

    Returns:
        dst_ND. Each updated element is ``dst + src`` computed in fp32 (fp64 for fp64) and
        rounded once: bit for bit ``dst.index_add_(0, idx, src)`` over the used slots.
        Deterministic.

    Source: ours; the rows it adds are the dense backup of arXiv 2603.23198's hybrid training
    layout and the hot units' slices.

    Raises:
        ValueError: a shape, dtype, device or stride mismatch, or a dst that shares memory
            with src or idx (``twell.ops.reference.sparse_train_torch.check_add_rows``).
    """
    check_add_rows(dst_ND, idx_R, src_RD)
    (n, d), r = dst_ND.shape, idx_R.shape[0]
    if r == 0 or d == 0 or n == 0:
        return dst_ND
    block = pow2(d, 16, CONFIG["add_rows_block_d"])
    _add_rows_kernel[(r, triton.cdiv(d, block))](
        dst_ND, idx_R, src_RD, n, d, dst_ND.stride(0), src_RD.stride(0), idx_R.stride(0),
        BLOCK_D=block,
        F64=dst_ND.dtype == torch.float64, num_warps=CONFIG["add_rows_warps"],
    )
    return dst_ND
