"""SpMM ELL x dense: the down projection forward (y = h Wd^T) and dx backward (both weights).

Rows are independent (one program per row and D slice), so no atomics: ``y[n] = sum_k g u
Wd^T[col]`` and ``dx[n] = sum_k dg Wg[col] + du Wu[col]`` over the row's ELL slots
(``twell.ops.train_backend`` has the layout; N tokens, D model width, K ELL width).
Source: arXiv 2603.23198, "Hybrid (training)"; PyTorch backend:
``twell.ops.reference.sparse_train_torch.spmm``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from twell.ops.launch import CONFIG, check_operand, pow2


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


def spmm(out_ND, w1_HD, w2_HD, col_NK, a_NK, b_NK, nnz_N):
    """out[n] = sum_k a*b*w1[col] (w2 None) or sum_k a*w1[col] + b*w2[col]; writes every row."""
    n, d = out_ND.shape
    k = col_NK.shape[1]
    check_operand("out_ND", out_ND, (n, d))
    check_operand("w1_HD", w1_HD, (w1_HD.shape[0], d))
    if n == 0:
        return out_ND
    if k == 0:
        return out_ND.zero_()
    two = w2_HD is not None
    if two:
        check_operand("w2_HD", w2_HD, tuple(w1_HD.shape))
    w2 = w2_HD if two else w1_HD
    block_d = pow2(d, 16, CONFIG["spmm_block_d"])
    block_k = CONFIG["spmm_block_k2" if two else "spmm_block_k"]
    _spmm_kernel[(n, triton.cdiv(d, block_d))](
        out_ND, w1_HD, w2, col_NK, a_NK, b_NK, nnz_N, d, k,
        out_ND.stride(0), w1_HD.stride(0), w2.stride(0),
        TWO_WEIGHTS=two, BLOCK_K=block_k, BLOCK_D=block_d,
        num_warps=max(1, min(CONFIG["spmm_warps"], block_d // 256)),
    )
    return out_ND
