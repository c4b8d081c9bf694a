"""SDDMM at the ELL non-zeros: the up projection forward (u and the per-row L1) and dh backward.

Shape legend: N tokens, D model width, H FFN width, K ELL width (slots per row), KC ELL
capacity, J entries of one column in CSC order. ELL layout: ``twell.ops.train_backend``.

Source: arXiv 2603.23198, "Hybrid (training)". PyTorch backend of the same math:
``twell.ops.reference.sparse_train_torch.sddmm_fwd`` / ``sddmm_bwd``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twell.ops.launch import CONFIG, check_operand, pow2


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


def _launch(a_ND, w_HD, col_NK, g_NK, u_NK, nnz_N, dg_NK, du_NK, l1, *, backward: bool):
    n, d = a_ND.shape
    _sddmm_kernel[(n,)](
        a_ND, w_HD, col_NK, g_NK, u_NK, nnz_N, dg_NK, du_NK, l1, d, col_NK.shape[1],
        a_ND.stride(0), w_HD.stride(0), BACKWARD=backward, BLOCK_K=CONFIG["sddmm_block_k"],
        BLOCK_D=pow2(d, 16, CONFIG["sddmm_block_d"]), num_warps=CONFIG["sddmm_warps"],
    )


def sddmm_fwd(x_ND, w_up_HD, col_NK, g_NK, nnz_N):
    """u[n, k] = x[n] . Wu[col[n, k]] for k < nnz[n]; returns (u_NK in x's dtype, l1_N fp32)."""
    n, d = x_ND.shape
    k = col_NK.shape[1]
    check_operand("x_ND", x_ND, (n, d))
    check_operand("w_up_HD", w_up_HD, (w_up_HD.shape[0], d))
    check_operand("col_NK", col_NK, (n, k), torch.int32)
    check_operand("g_NK", g_NK, (n, k))
    u = torch.empty((n, k), dtype=x_ND.dtype, device=x_ND.device)
    l1 = torch.zeros((n,), dtype=torch.float32, device=x_ND.device)
    if n == 0 or k == 0:
        return u, l1
    _launch(x_ND, w_up_HD, col_NK, g_NK, u, nnz_N, u, u, l1, backward=False)
    return u, l1


def sddmm_bwd(dy_ND, w_down_t_HD, col_NK, g_NK, u_NK, nnz_N, l1_scale):
    """dh = dy[n] . Wd^T[col] + l1_scale * sign(u); returns (dg_NK, du_NK) fp32."""
    n, d = dy_ND.shape
    k = col_NK.shape[1]
    check_operand("dy_ND", dy_ND, (n, d))
    check_operand("w_down_t_HD", w_down_t_HD, (w_down_t_HD.shape[0], d))
    check_operand("u_NK", u_NK, (n, k))
    dg = torch.empty((n, k), dtype=torch.float32, device=dy_ND.device)
    du = torch.empty((n, k), dtype=torch.float32, device=dy_ND.device)
    if n == 0 or k == 0:
        return dg, du
    scale = l1_scale.reshape(1).to(torch.float32).contiguous()
    _launch(dy_ND, w_down_t_HD, col_NK, g_NK, u_NK, nnz_N, dg, du, scale, backward=True)
    return dg, du
