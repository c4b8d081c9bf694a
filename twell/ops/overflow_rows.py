"""The no-sync dense backup's overflow rows: heavy rows beyond its capacity, computed whole.

Why: the forward-only hybrid ELL op (``twell.ops.ffn_train.ell_ffn_forward``) in its no-sync
mode (``backup_rows = C >= 0``) gives its dense backup C rows without reading the heavy-row
count R on the host (a sync left the H100 idle 0.26-0.41 ms a call). Heavy rows (more than KC
active units) have an empty ELL part, so the ones beyond the capacity (rank >= C among the heavy
rows, in row order) would get y = 0. This kernel computes those rows densely, reading their
number on the device: ``y[r] = (relu(x[r] Wg^T) * (x[r] Wu^T)) Wd^T`` for each such row r,
recomputing the gate from x and Wg (the op has freed its N x H gate by then). With hot units
(a set S computed by the op as a separate dense slice, added to y afterwards) the gate is zeroed
at S, as the dense backup's is, so those rows hold the cold units only and the slice is not
counted twice: the kernel loads an (H,) cold-unit mask per hidden chunk (a constexpr flag: the
launch without hot units is unchanged). The capacity comes
from a measured count with headroom (``twell.ops.ffn_train.backup_capacity_for``), so overflow is
rare: with none, every program reads the count and returns (one cheap launch); with some, it is
correct, not fast (the gate and up GEMMs are recomputed once per D block of the output).

Shape legend: N tokens, D model width, H FFN width, M overflow slots. PyTorch backend:
``twell.ops.reference.sparse_train_torch.overflow_rows``.

Source: ours; the rows it computes are those of arXiv 2603.23198's dense backup (hybrid ELL +
dense-backup layout).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twell.ops.launch import CONFIG, check_operand, pow2


@triton.jit
def _dot(a, b, acc, F32: tl.constexpr):
    """acc + a b in fp32. F32: operands widened to fp32 and multiplied exactly (IEEE, no TF32):
    the same products as a bf16 / fp16 dot with fp32 accumulation (a product of two 16-bit
    floats is exact in fp32), used for fp32 inputs and for bf16 under the interpreter, whose
    bf16 ``tl.dot`` returns garbage (Triton 3.9: errors ~1e10 on a 16 x 16 product)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


# M and SKIP follow the backup's capacity, which follows the layer's heavy-row counts: not
# specialised (divisibility, == 1), so a new capacity never compiles the kernel again
@triton.jit(do_not_specialize=["M", "SKIP"])
def _overflow_rows_kernel(
    y_ptr,  # (N, D) out, contiguous: the overflow rows are stored (not added)
    x_ptr,  # (N, D) contiguous
    wg_ptr,  # (H, D) contiguous, x's dtype
    wu_ptr,  # (H, D) contiguous, x's dtype
    wdt_ptr,  # (H, D) contiguous Wd^T, x's dtype
    idx_ptr,  # (M,) int64 rows; entries outside [0, N) are unused
    count_ptr,  # (1,) int32: heavy rows in all; the used slots are the first count - SKIP
    l1_ptr,  # (M,) fp32 out, zeroed by the launcher: sum_j |h[r, j]| per slot
    cold_ptr,  # (H,) uint8, 0 at the hot units (read only with HAS_HOT)
    N, D, H, M,
    SKIP,  # heavy rows held by the dense backup (its capacity)
    BM: tl.constexpr,  # overflow rows per tile
    BD: tl.constexpr,  # output columns per tile
    BH: tl.constexpr,  # hidden units per step
    BK: tl.constexpr,  # model-width chunk of the gate / up dot products
    F32: tl.constexpr,  # dots in fp32 IEEE (``_dot``): fp32 inputs, or bf16 off CUDA
    HAS_HOT: tl.constexpr,  # zero the gate at the hot units (cold_ptr)
):
    """Programs loop over (row tile, D block) work items up to a bound read on the device, so a
    launch with no overflow does nothing past one load. Per item: for each H chunk,
    g = x_rows Wg[chunk]^T, u = x_rows Wu[chunk]^T (fp32 accumulation, rounded to x's dtype as
    the dense backup's cuBLAS outputs are), g = 0 at the hot units (HAS_HOT: as the backup's
    gate, zero-filled there, so NaN / inf in a hot unit's gate is dropped), h = relu(g) u
    (rounded to x's dtype, as the backup's elementwise pass), acc += h Wd^T[chunk, block];
    y[rows, block] = acc in y's dtype. relu keeps NaN (``g < 0 ? 0 : g``), as ``torch.relu``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    used = tl.load(count_ptr) - SKIP
    used = tl.minimum(tl.maximum(used, 0), M)
    n_db = tl.cdiv(D, BD)
    n_items = tl.cdiv(used, BM) * n_db
    dt = x_ptr.dtype.element_ty
    for item in range(pid, n_items, nprog):
        tile = item // n_db
        db = item % n_db
        slots = tile * BM + tl.arange(0, BM)
        rows = tl.load(idx_ptr + slots, mask=slots < used, other=N)
        mrow = (rows >= 0) & (rows < N)
        rows = tl.where(mrow, rows, 0).to(tl.int64)
        cols = db * BD + tl.arange(0, BD)
        mcol = cols < D
        acc = tl.zeros((BM, BD), dtype=tl.float32)
        l1 = tl.zeros((BM,), dtype=tl.float32)
        for h0 in range(0, H, BH):
            hs = h0 + tl.arange(0, BH)
            mh = hs < H
            g = tl.zeros((BM, BH), dtype=tl.float32)
            u = tl.zeros((BM, BH), dtype=tl.float32)
            for k0 in range(0, D, BK):
                ks = k0 + tl.arange(0, BK)
                mk = ks < D
                xk = tl.load(x_ptr + rows[:, None] * D + ks[None, :],
                             mask=mrow[:, None] & mk[None, :], other=0.0)
                # (BK, BH) tiles of Wg^T, Wu^T read from the (H, D) rows
                w_off = hs[None, :].to(tl.int64) * D + ks[:, None]
                wm = mk[:, None] & mh[None, :]
                wgk = tl.load(wg_ptr + w_off, mask=wm, other=0.0)
                wuk = tl.load(wu_ptr + w_off, mask=wm, other=0.0)
                g = _dot(xk, wgk, g, F32)
                u = _dot(xk, wuk, u, F32)
            g = g.to(dt).to(tl.float32)
            u = u.to(dt).to(tl.float32)
            if HAS_HOT:  # the hot slice is the op's: a zero gate here, as in the dense backup
                cold = tl.load(cold_ptr + hs, mask=mh, other=0)
                g = tl.where(cold[None, :] != 0, g, 0.0)
            hv = (tl.where(g < 0, 0.0, g) * u).to(dt)
            l1 += tl.sum(tl.abs(hv.to(tl.float32)), axis=1)
            wd = tl.load(wdt_ptr + hs[:, None].to(tl.int64) * D + cols[None, :],
                         mask=mh[:, None] & mcol[None, :], other=0.0)
            acc = _dot(hv, wd, acc, F32)
        tl.store(y_ptr + rows[:, None] * D + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mrow[:, None] & mcol[None, :])
        if db == 0:  # one writer per slot: no atomics
            tl.store(l1_ptr + slots, l1, mask=mrow)


def _programs(device: torch.device) -> int:
    """The launch's program cap: two per SM on CUDA (the loop covers the rest), 4 elsewhere."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def overflow_rows(y_ND: torch.Tensor, x_ND: torch.Tensor, w_gate_HD: torch.Tensor,
                  w_up_HD: torch.Tensor, w_down_t_HD: torch.Tensor, idx_M: torch.Tensor,
                  n_heavy: torch.Tensor, skip: int,
                  hot_k: torch.Tensor | None = None) -> torch.Tensor:
    """Store the dense FFN rows ``y[r] = (relu(x[r] Wg^T) * (x[r] Wu^T)) Wd^T`` for the overflow
    rows r = ``idx_M[i]``, ``i < n_heavy - skip``, with no host synchronisation; with hot units
    ``hot_k`` = S, the gate is zero at S (the rows' cold part: the caller adds the hot slice).

    Args:
        y_ND: (N, D) contiguous output of x's dtype; the overflow rows are overwritten (the
            caller's ELL SpMM left zeros there), the others untouched.
        x_ND: (N, D) contiguous fp32 / bf16 / fp16 input.
        w_gate_HD, w_up_HD, w_down_t_HD: (H, D) contiguous, x's dtype (Wd^T as rows).
        idx_M: (M,) int64 rows, the heavy rows after the first ``skip`` in row order (e.g.
            ``nonzero_static(heavy_N, size=N, fill_value=N)[skip:]``); entries outside
            [0, N) are skipped. Rows must be distinct (each is written by one program).
        n_heavy: (1,) int32 device count of heavy rows (read by the kernel, not the host).
        skip: heavy rows the dense backup holds (its capacity); ``n_heavy - skip`` slots are
            used, clamped to [0, M].
        hot_k: optional (k,) contiguous int64 hot-unit indices in [0, H) on x's device (the
            op's ``hot_units``); the gate is taken as 0 there, as the dense backup's
            zero-filled columns, so h = relu(0) u = 0 (a NaN / inf gate of a hot unit does not
            reach the row; a non-finite u there does, 0 * u, as in the backup). None or empty:
            no hot units. Builds an (H,) uint8 cold mask (two small launches) for the kernel.
            Indices are not range-checked here (no host sync): one at or above H raises in
            the mask's ``index_fill_``, and a negative one in [-H, 0) wraps (unit H + i), as
            ``index_fill_`` takes it (the op's ``check_hot_units`` refuses both on CPU).

    Returns:
        (M,) fp32 ``sum_j |h[r, j]|`` per slot (0 on unused ones): the rows' L1 terms (the
        cold units' with ``hot_k``: the hot slice's L1 is the caller's). h is rounded to x's
        dtype before its sum and the down GEMM, as the dense backup's; y is accumulated in
        fp32 and rounded once. NaN / inf in a row reach that row's y.

    Raises:
        ValueError: a shape, dtype, device or contiguity mismatch.
    """
    n, d = x_ND.shape
    h = w_gate_HD.shape[0]
    m = idx_M.shape[0]
    for name, t, shape in (("y_ND", y_ND, (n, d)), ("w_gate_HD", w_gate_HD, (h, d)),
                           ("w_up_HD", w_up_HD, (h, d)), ("w_down_t_HD", w_down_t_HD, (h, d))):
        check_operand(f"overflow_rows: {name}", t, shape, x_ND.dtype)
    if not x_ND.is_contiguous() or x_ND.dtype not in (torch.float32, torch.bfloat16,
                                                      torch.float16):
        raise ValueError(f"overflow_rows: x_ND must be contiguous fp32 / bf16 / fp16; got "
                         f"{x_ND.dtype}")
    if idx_M.dtype != torch.int64 or idx_M.dim() != 1 or not idx_M.is_contiguous():
        raise ValueError(f"overflow_rows: idx_M must be a contiguous (M,) int64 tensor; got "
                         f"{tuple(idx_M.shape)} {idx_M.dtype}")
    if n_heavy.dtype != torch.int32 or n_heavy.numel() != 1:
        raise ValueError(f"overflow_rows: n_heavy must be a (1,) int32 tensor; got "
                         f"{tuple(n_heavy.shape)} {n_heavy.dtype}")
    if hot_k is not None and (hot_k.dtype != torch.int64 or hot_k.dim() != 1
                              or not hot_k.is_contiguous() or hot_k.shape[0] > h):
        raise ValueError(f"overflow_rows: hot_k must be a contiguous (k,) int64 tensor of unit "
                         f"indices, k <= H = {h}; got {tuple(hot_k.shape)} {hot_k.dtype}")
    if hot_k is not None and hot_k.device != x_ND.device:
        raise ValueError(f"overflow_rows: hot_k must be on x_ND's device ({x_ND.device}); got "
                         f"{hot_k.device}")
    if len({t.device for t in (y_ND, x_ND, w_gate_HD, w_up_HD, w_down_t_HD, idx_M,
                               n_heavy)}) != 1:
        raise ValueError("overflow_rows: all tensors must be on one device")
    l1 = torch.zeros((m,), dtype=torch.float32, device=x_ND.device)
    if m == 0 or n == 0 or d == 0 or h == 0:
        return l1
    # tl.dot takes no dimension below 16 on a GPU: a smaller configured block is raised to 16
    bm = pow2(CONFIG["overflow_block_m"], 16, 256)
    bh, bk = CONFIG["overflow_block_h"], CONFIG["overflow_block_k"]
    bd = pow2(d, 16, CONFIG["overflow_block_d"])
    bh, bk = pow2(h, 16, bh), pow2(d, 16, bk)
    has_hot = hot_k is not None and hot_k.numel() > 0
    cold = idx_M  # never read without hot units
    if has_hot:
        cold = torch.ones((h,), dtype=torch.uint8, device=x_ND.device).index_fill_(0, hot_k, 0)
    work = triton.cdiv(m, bm) * triton.cdiv(d, bd)
    grid = (max(1, min(work, _programs(x_ND.device))),)
    _overflow_rows_kernel[grid](
        y_ND, x_ND, w_gate_HD, w_up_HD, w_down_t_HD, idx_M, n_heavy, l1, cold, n, d, h, m,
        int(skip), BM=bm, BD=bd, BH=bh, BK=bk,
        # fp32: no TF32, so GPU and interpreter agree; bf16 off CUDA: the interpreter's bf16 dot
        F32=x_ND.dtype == torch.float32 or (x_ND.dtype == torch.bfloat16 and not x_ND.is_cuda),
        HAS_HOT=has_hot,
        num_warps=CONFIG["overflow_warps"],
    )
    return l1
