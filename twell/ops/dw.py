"""Weight gradients of the ``ell`` training path: transposed SpMM over the CSC-ordered ELL entries.

    dWg[c] = sum dg x[n],  dWu[c] = sum du x[n],  dWd^T[c] = sum g u dy[n]   (over col[n, k] = c)

The CSC order (``perm``, ``colptr``, the longest-column-first ``order``) is built by the forward
(``twell.ops.ffn_train.csc_order``); a first pass reads the entries through it once and writes
their tokens and coefficients in CSC order (``_dw_entries_kernel``), then each (column, D slice)
program streams its column's entries and owns its outputs, so the sums are deterministic: the
entries' coefficients are read once, not once per D slice (measurements and the version this
replaced: BENCHMARKS.md, "dW v2"). Shape legend: N tokens, D model width,
H FFN width, K ELL width, J entries of one column. Source: arXiv 2603.23198, "Hybrid
(training)"; PyTorch backend: ``twell.ops.reference.sparse_train_torch.dw``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twell.ops.launch import CONFIG, check_operand, dw_launch


@triton.jit
def _dw_entries_kernel(
    rows_ptr,  # (NS,) int32 out: token of each CSC entry
    coef_ptr,  # (3, NS) fp32 out: dg, du and g*u of each CSC entry
    perm_ptr,  # (NS,) int32 (or int64) flat ELL index n*K + k, grouped by column (CSC order)
    colptr_ptr,  # (H + 1,) int64; colptr[H] = entries in use
    dg_ptr,  # (N, K) fp32 dL/dgate at the non-zeros
    du_ptr,  # (N, K) fp32 dL/dup at the non-zeros
    g_ptr,  # (N, K) relu(gate)
    u_ptr,  # (N, K) up
    NS,  # slots (N*K): the coefficient rows' stride
    H,  # columns
    K,  # ELL width
    BLOCK: tl.constexpr,
):
    """The CSC entries' tokens and coefficients, read once through ``perm`` (scattered) and
    written in CSC order, so that the dW kernel streams them contiguously for every D slice
    instead of repeating four scattered loads and an int64 division per entry and slice."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < tl.load(colptr_ptr + H)
    e = tl.load(perm_ptr + offs, mask=m, other=0).to(tl.int64)
    tl.store(rows_ptr + offs, (e // K).to(tl.int32), mask=m)
    tl.store(coef_ptr + offs, tl.load(dg_ptr + e, mask=m, other=0.0), mask=m)
    tl.store(coef_ptr + NS + offs, tl.load(du_ptr + e, mask=m, other=0.0), mask=m)
    h = tl.load(g_ptr + e, mask=m, other=0.0).to(tl.float32) * tl.load(
        u_ptr + e, mask=m, other=0.0).to(tl.float32)
    tl.store(coef_ptr + 2 * NS + offs, h, mask=m)


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
    rows_ptr,  # (NS,) int32 token of each CSC entry (``_dw_entries_kernel``)
    coef_ptr,  # (3, NS) fp32 dg, du, g*u of each CSC entry
    colptr_ptr,  # (H + 1,) int64: column c owns entries colptr[c]:colptr[c+1]
    order_ptr,  # (H,) int64: columns, longest first (programs start in this order)
    D,  # model width
    NS,  # the coefficient rows' stride
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
    """Transposed SpMM (per hidden unit c, over its CSC entries j = (n, k))::

        dWg[c]   = sum dg[j] x[n]      dWu[c] = sum du[j] x[n]   (one gather of x)
        dWd^T[c] = sum g[j] u[j] dy[n]

    fp32 accumulation; deterministic (one program owns each output slice, CSC order fixed).
    2-D (BLOCK_J, BLOCK_D) accumulators reduced once at the end, so the warps split the entry
    axis without a cross-warp reduction per step and many gathers are in flight per program;
    programs are issued longest column first (``order``) so that hot units do not form the tail.
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
    accg = tl.zeros([BLOCK_J, BLOCK_D], dtype=tl.float32)
    accu = tl.zeros([BLOCK_J, BLOCK_D], dtype=tl.float32)
    accd = tl.zeros([BLOCK_J, BLOCK_D], dtype=tl.float32)
    offs = tl.arange(0, BLOCK_J)
    for j0 in range(start, end, BLOCK_J):
        j = j0 + offs
        mj = j < end
        n = tl.load(rows_ptr + j, mask=mj, other=0).to(tl.int64)
        dg = tl.load(coef_ptr + j, mask=mj, other=0.0)
        du = tl.load(coef_ptr + NS + j, mask=mj, other=0.0)
        hh = tl.load(coef_ptr + 2 * NS + j, mask=mj, other=0.0)
        m2 = mj[:, None] & md[None, :]
        xf = tl.load(x_ptr + n[:, None] * stride_x + offs_d[None, :], mask=m2,
                     other=0.0).to(tl.float32)
        dyf = tl.load(dy_ptr + n[:, None] * stride_dy + offs_d[None, :], mask=m2,
                      other=0.0).to(tl.float32)
        accg += dg[:, None] * xf
        accu += du[:, None] * xf
        accd += hh[:, None] * dyf
    off = c * stride_w + offs_d
    sg = tl.sum(accg, axis=0)
    su = tl.sum(accu, axis=0)
    sd = tl.sum(accd, axis=0)
    if HAS_ADD:
        sg += tl.load(addg_ptr + off, mask=md, other=0.0).to(tl.float32)
        su += tl.load(addu_ptr + off, mask=md, other=0.0).to(tl.float32)
        sd += tl.load(addd_ptr + off, mask=md, other=0.0).to(tl.float32)
    tl.store(dwg_ptr + off, sg.to(dwg_ptr.dtype.element_ty), mask=md)
    tl.store(dwu_ptr + off, su.to(dwu_ptr.dtype.element_ty), mask=md)
    tl.store(dwdt_ptr + off, sd.to(dwdt_ptr.dtype.element_ty), mask=md)


def dw(dwg_HD, dwu_HD, dwdt_HD, adds, x_ND, dy_ND, perm, colptr, dg_NK, du_NK, g_NK, u_NK,
       order=None):
    """Weight gradients of the ELL part (see ``_dw_kernel``), written into the three outputs.

    Args:
        dwg_HD, dwu_HD, dwdt_HD: (H, D) outputs (dL/dWg, dL/dWu, dL/dWd^T), contiguous, any float
            dtype (fp32 accumulation); every element is written.
        adds: None or three (H, D) tensors added to the outputs (the dense-backup rows' parts).
        x_ND, dy_ND: (N, D) input and upstream gradient (bf16 / fp16 / fp32).
        perm: (N*K,) int32 or int64 flat slot indices ``n*K + k`` in CSC order, unused slots
            last (``twell.ops.ffn_train.csc_order``); colptr: (H + 1,) int64 column starts,
            ``colptr[H]`` = slots in use (read on the device: no host sync).
        dg_NK, du_NK: (N, K) fp32 dL/dgate, dL/dup at the slots; g_NK, u_NK: (N, K) relu(gate)
            and up at the slots.
        order: (H,) int64 launch order of the columns (default: longest first).

    Raises:
        ValueError: an output or ``colptr`` of the wrong shape, a non-contiguous operand, or
            ``perm`` not int32 / int64 (the message names the argument).

    Source: arXiv 2603.23198, "Hybrid (training)" (the transposed SpMM for the weight
    gradients); the pre-gathered entries and the launch are ours.
    """
    h, d = dwg_HD.shape
    k = dg_NK.shape[1]
    for name, t in (("dwg_HD", dwg_HD), ("dwu_HD", dwu_HD), ("dwdt_HD", dwdt_HD)):
        check_operand(name, t, (h, d))
    check_operand("perm", perm, (perm.shape[0],))
    if perm.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"perm: expected dtype torch.int32 or torch.int64, got {perm.dtype}")
    check_operand("colptr", colptr, (h + 1,), torch.int64)
    if h == 0 or d == 0:
        return
    has_add = adds is not None
    ag, au, ad = adds if has_add else (dwg_HD, dwu_HD, dwdt_HD)
    block_d, d_outer = dw_launch(x_ND.shape[0], d, x_ND.element_size() + dy_ND.element_size())
    n_dchunk = triton.cdiv(d, block_d)
    if order is None:  # longest column first (the training forward passes it precomputed)
        order = torch.argsort(colptr[1:] - colptr[:-1], descending=True)
    ns = perm.shape[0]
    rows = torch.empty(ns, dtype=torch.int32, device=x_ND.device)
    coef = torch.empty((3, ns), dtype=torch.float32, device=x_ND.device)
    if ns:
        _dw_entries_kernel[(triton.cdiv(ns, 1024),)](
            rows, coef, perm, colptr, dg_NK, du_NK, g_NK, u_NK, ns, h, max(k, 1), BLOCK=1024,
            num_warps=4)
    _dw_kernel[(h * n_dchunk,)](
        dwg_HD, dwu_HD, dwdt_HD, ag, au, ad, x_ND, dy_ND, rows, coef, colptr, order, d, ns,
        n_dchunk, x_ND.stride(0), dy_ND.stride(0), dwg_HD.stride(0),
        HAS_ADD=has_add, BLOCK_J=CONFIG["dw_block_j"], BLOCK_D=block_d, H=h, D_OUTER=d_outer,
        num_warps=CONFIG["dw_warps"],
    )
