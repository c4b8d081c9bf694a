"""The PyTorch backend of the sparse training ops: the same sparse math as the Triton kernels.

Shape legend: N tokens, D model width, H FFN width, K ELL width, KC ELL capacity, R dense-backup
rows. Same names and arguments as the Triton backend (``twell.ops.train_backend.triton_backend``:
the launchers of ``compact.py``, ``sddmm.py``, ``spmm.py``, ``dw.py``, ``elementwise.py``,
``transpose.py``, ``add_rows.py``), so the
training ops (``twell.ops.ffn_train``, ``twell.ops.ffn_dense_train``) run either; this one runs on
CPU without Triton and in float64 (the kernels' tests compare both against fp64 autograd).
Gathers are chunked over rows so a gathered (n, K, D) block stays near ``_CHUNK_ELEMS`` elements.
"""

from __future__ import annotations

import torch

_CHUNK_ELEMS = 1 << 22  # rows per chunk chosen so a gathered (n, K, D) block fits


def _rows_per_chunk(k: int, d: int) -> int:
    return max(1, _CHUNK_ELEMS // max(1, k * d))


def compact(g_NH: torch.Tensor, kc: int):
    """ReLU + ELL compaction (as ``twell.ops.compact.compact``; unused slots are zero)."""
    act = ~(g_NH <= 0)  # NaN counts as active
    nnz = act.sum(1, dtype=torch.int32)
    counts = act.sum(0, dtype=torch.int32)
    pos = act.cumsum(1) - 1
    keep = act & (pos < kc)
    rows, cols = keep.nonzero(as_tuple=True)
    col = torch.zeros((g_NH.shape[0], kc), dtype=torch.int32, device=g_NH.device)
    val = torch.zeros((g_NH.shape[0], kc), dtype=g_NH.dtype, device=g_NH.device)
    col[rows, pos[rows, cols]] = cols.int()
    val[rows, pos[rows, cols]] = g_NH[rows, cols]
    return col, val, nnz, counts


def compact_heavy(g_NH: torch.Tensor, kc: int):
    """:func:`compact` plus nnz_eff (0 on rows above kc) and the heavy-row count (int32 (1,))."""
    col, val, nnz, counts = compact(g_NH, kc)
    heavy = nnz > kc
    return col, val, nnz, counts, torch.where(heavy, 0, nnz), heavy.sum(dtype=torch.int32)[None]


def dense_fwd(g_NH: torch.Tensor, u_NH: torch.Tensor):
    """Dense mode forward: (h = relu(g) * u, per-row sum |h|, per-row L0, per-unit counts)."""
    act = ~(g_NH <= 0)
    h = g_NH.clamp(min=0) * u_NH
    acc = torch.promote_types(h.dtype, torch.float32)
    return (h, torch.linalg.vector_norm(h, ord=1, dim=1, dtype=acc), act.sum(1, dtype=torch.int32),
            act.sum(0, dtype=torch.int32))


def _sign(t: torch.Tensor) -> torch.Tensor:
    """sign(t) with sign(NaN) = 0: the L1 gradient of PyTorch's ``vector_norm(ord=1)`` (and of the
    Triton kernels)."""
    return (t > 0).to(t.dtype) - (t < 0).to(t.dtype)


def valid_slots(nnz_N: torch.Tensor, k: int) -> torch.Tensor:
    """(N, k) bool: slot j of row n holds a non-zero (j < nnz[n])."""
    return torch.arange(k, device=nnz_N.device)[None, :] < nnz_N[:, None]


def _gather_dot(a_ND, w_HD, col_NK):
    """v[n, k] = a[n] . w[col[n, k]] (fp32 or fp64 accumulation), chunked over rows."""
    n, k = col_NK.shape
    acc = torch.promote_types(a_ND.dtype, torch.float32)
    out = torch.empty((n, k), dtype=acc, device=a_ND.device)
    step = _rows_per_chunk(k, a_ND.shape[1])
    for s in range(0, n, step):
        w = w_HD[col_NK[s:s + step].long()].to(acc)  # (n', K, D)
        out[s:s + step] = torch.einsum("nkd,nd->nk", w, a_ND[s:s + step].to(acc))
    return out


def _width(nnz_N: torch.Tensor, k: int) -> int:
    """Slots in use (the ELL buffers are capacity-wide; the PyTorch backend gathers only these)."""
    return min(k, int(nnz_N.max())) if nnz_N.numel() else 0


def _pad(v_NK: torch.Tensor, k: int) -> torch.Tensor:
    return torch.nn.functional.pad(v_NK, (0, k - v_NK.shape[1]))


def sddmm_fwd(x_ND, w_up_HD, col_NK, g_NK, nnz_N):
    """u[n, k] = x[n] . Wu[col[n, k]] at the valid slots (0 elsewhere); returns (u_NK, l1_N)."""
    k = col_NK.shape[1]
    kk = _width(nnz_N, k)
    col_NK, g_NK = col_NK[:, :kk], g_NK[:, :kk]
    valid = valid_slots(nnz_N, kk)
    u = (_gather_dot(x_ND, w_up_HD, col_NK) * valid).to(x_ND.dtype)
    acc = torch.promote_types(x_ND.dtype, torch.float32)
    l1 = (g_NK.to(acc) * u.to(acc) * valid).abs().sum(1)
    return _pad(u, k), l1


def sddmm_bwd(dy_ND, w_down_t_HD, col_NK, g_NK, u_NK, nnz_N, l1_scale):
    """dh = dy . Wd^T[col] + l1_scale sign(u); returns (dg = dh u, du = dh g) at the valid slots."""
    k = col_NK.shape[1]
    kk = _width(nnz_N, k)
    col_NK, g_NK, u_NK = col_NK[:, :kk], g_NK[:, :kk], u_NK[:, :kk]
    valid = valid_slots(nnz_N, kk)
    acc = torch.promote_types(dy_ND.dtype, torch.float32)
    u = torch.where(valid, u_NK.to(acc), 0)
    dh = _gather_dot(dy_ND, w_down_t_HD, col_NK) + l1_scale.to(acc) * _sign(u)
    return _pad(dh * u * valid, k), _pad(dh * torch.where(valid, g_NK.to(acc), 0), k)


def spmm(out_ND, w1_HD, w2_HD, col_NK, a_NK, b_NK, nnz_N):
    """out[n] = sum_k a b w1[col] (w2 None) or sum_k a w1[col] + b w2[col]; writes every row."""
    k = _width(nnz_N, col_NK.shape[1])
    col_NK, a_NK, b_NK = col_NK[:, :k], a_NK[:, :k], b_NK[:, :k]
    n = col_NK.shape[0]
    acc = torch.promote_types(out_ND.dtype, torch.float32)
    valid = valid_slots(nnz_N, k)
    a = torch.where(valid, a_NK.to(acc), 0)
    b = torch.where(valid, b_NK.to(acc), 0)
    step = _rows_per_chunk(k, out_ND.shape[1])
    for s in range(0, n, step):
        c = col_NK[s:s + step].long()
        if w2_HD is None:
            r = torch.einsum("nk,nkd->nd", a[s:s + step] * b[s:s + step], w1_HD[c].to(acc))
        else:
            r = torch.einsum("nk,nkd->nd", a[s:s + step], w1_HD[c].to(acc))
            r += torch.einsum("nk,nkd->nd", b[s:s + step], w2_HD[c].to(acc))
        out_ND[s:s + step] = r.to(out_ND.dtype)
    return out_ND


def dw(dwg_HD, dwu_HD, dwdt_HD, adds, x_ND, dy_ND, perm, colptr, dg_NK, du_NK, g_NK, u_NK,
          order=None):  # order: the Triton launch order, unused here
    """Weight gradients from the CSC-ordered ELL entries plus ``adds`` (dense-backup parts)."""
    h, d = dwg_HD.shape
    k = max(dg_NK.shape[1], 1)
    # the widest of the three outputs' dtypes: dWg, dWu come in the weights' dtypes and dWd^T
    # in the compute dtype, so fp64 inputs with fp32 weights still sum in fp64
    acc = torch.float32
    for out in (dwg_HD, dwu_HD, dwdt_HD):
        acc = torch.promote_types(acc, out.dtype)
    bufs = [torch.zeros((h, d), dtype=acc, device=x_ND.device) for _ in range(3)]
    col_of = torch.repeat_interleave(
        torch.arange(h, device=x_ND.device), colptr[1:] - colptr[:-1]
    )  # column of each CSC entry
    perm = perm[: col_of.numel()]  # drop the invalid slots (sorted last)
    step = max(1, _CHUNK_ELEMS // max(d, 1))
    hh = g_NK.to(acc) * u_NK.to(acc)
    for s in range(0, perm.numel(), step):
        e = perm[s:s + step]
        c = col_of[s:s + step]
        n = e // k
        xr = x_ND[n].to(acc)
        bufs[0].index_add_(0, c, dg_NK.reshape(-1)[e].to(acc)[:, None] * xr)
        bufs[1].index_add_(0, c, du_NK.reshape(-1)[e].to(acc)[:, None] * xr)
        bufs[2].index_add_(0, c, hh.reshape(-1)[e][:, None] * dy_ND[n].to(acc))
    for out, buf, add in zip((dwg_HD, dwu_HD, dwdt_HD), bufs, adds or (None,) * 3):
        if add is not None:
            buf += add.to(acc)
        out.copy_(buf)


def transposed(src_RC, dtype):
    """``src^T`` as a new contiguous (C, R) tensor of ``dtype`` (one copy that transposes and
    casts)."""
    return torch.empty((src_RC.shape[1], src_RC.shape[0]), dtype=dtype,
                       device=src_RC.device).copy_(src_RC.t())


def backup_fwd(g_RH, u_RH):
    """relu(g) in place; returns (h = g * u, sum |h|)."""
    g_RH.relu_()
    h = g_RH * u_RH
    return h, torch.linalg.vector_norm(h, ord=1, dtype=torch.promote_types(h.dtype, torch.float32))


def backup_bwd(dh_RH, g_RH, u_RH, l1_scale):
    """Returns (dg, du, h) of the dense rows from dh = dy Wd (g relu'd or raw)."""
    g_RH = g_RH.clamp(min=0)  # dense mode saves the raw pre-activation
    h = g_RH * u_RH
    dh = dh_RH + (l1_scale * _sign(h)).to(dh_RH.dtype)
    return torch.where(g_RH <= 0, 0, dh * u_RH), dh * g_RH, h


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` byte addresses of a non-empty ``t``'s elements (strides >= 0)."""
    first = t.data_ptr()
    last = first + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) * t.element_size()
    return first, last + t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a``'s and ``b``'s byte spans (on one device) intersect: addresses only, no
    host sync. Conservative: two interleaved views of one tensor (its even and odd columns, say)
    count as overlapping."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def check_add_rows(dst_ND: torch.Tensor, idx_R: torch.Tensor, src_RD: torch.Tensor) -> None:
    """Raise ValueError naming the argument unless dst (N, D) and src (R, D) are float tensors of
    one dtype with unit column stride (any row stride) and idx is a 1-D int32 / int64 tensor of
    R entries, all on one device, and dst shares no memory with src or idx (the kernel would
    read what it writes; judged by byte spans, so interleaved views of one tensor are refused
    too). Both backends' ``add_rows`` call it (it lives here, where nothing imports triton)."""
    if dst_ND.dim() != 2 or src_RD.dim() != 2 or idx_R.dim() != 1:
        raise ValueError(f"add_rows: expected dst (N, D), idx (R,), src (R, D); got shapes "
                         f"{tuple(dst_ND.shape)}, {tuple(idx_R.shape)}, {tuple(src_RD.shape)}")
    r, d = src_RD.shape
    if idx_R.shape[0] != r or dst_ND.shape[1] != d:
        raise ValueError(f"add_rows: src (R, D) must match idx (R,) and dst (N, D); got src "
                         f"{tuple(src_RD.shape)}, idx {tuple(idx_R.shape)}, dst "
                         f"{tuple(dst_ND.shape)}")
    if not dst_ND.is_floating_point():
        raise ValueError(f"add_rows: dst must be a float tensor (fp32, bf16, fp16 or fp64); got "
                         f"{dst_ND.dtype}: pass a float dst")
    if src_RD.dtype != dst_ND.dtype:
        raise ValueError(f"add_rows: src must have dst's float dtype (as index_add_); got src "
                         f"{src_RD.dtype}, dst {dst_ND.dtype}: cast src first")
    if idx_R.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"add_rows: idx must be int32 or int64; got {idx_R.dtype}")
    if len({t.device for t in (dst_ND, idx_R, src_RD)}) != 1:
        raise ValueError(f"add_rows: dst, idx and src must be on one device; got "
                         f"{dst_ND.device}, {idx_R.device}, {src_RD.device}")
    for name, t in (("dst", dst_ND), ("src", src_RD)):
        if d > 1 and t.stride(1) != 1:
            raise ValueError(f"add_rows: {name}'s columns must be contiguous (stride(1) == 1); "
                             f"got strides {t.stride()}: pass a contiguous tensor")
    for name, t in (("src", src_RD), ("idx", idx_R)):
        if _overlap(dst_ND, t):
            raise ValueError(f"add_rows: dst shares memory with {name} (the kernel would read "
                             f"what it writes); pass a separate dst or {name}.clone()")


def add_rows(dst_ND, idx_R, src_RD):
    """``dst[idx[i]] += src[i]`` for the slots with ``0 <= idx[i] < N`` (others skipped), in
    place, returns dst (as ``twell.ops.add_rows.add_rows``: same checks; ``index_add_`` here,
    so a repeated row adds twice). Selecting the used slots reads their count (a host sync on
    CUDA; this backend syncs in its other passes too)."""
    check_add_rows(dst_ND, idx_R, src_RD)
    used = (idx_R >= 0) & (idx_R < dst_ND.shape[0])
    return dst_ND.index_add_(0, idx_R[used], src_RD[used])


def overflow_rows(y_ND, x_ND, w_gate_HD, w_up_HD, w_down_t_HD, idx_M, n_heavy, skip,
                  hot_k=None):
    """The no-sync backup's overflow rows (as ``twell.ops.overflow_rows.overflow_rows``): the
    dense FFN stored into ``y[idx_M[i]]`` for ``i < n_heavy - skip`` with ``idx_M[i]`` in
    [0, N); returns the (M,) per-slot ``sum |h|`` in fp32 (fp64 for fp64). Dense math on the
    gathered rows, g, u and h rounded to x's dtype as the dense backup's; with hot units
    ``hot_k`` ((k,) int64) the gate is zero-filled at them, as the backup's (h = relu(0) u
    there: the rows' cold part, the op adds the hot slice). Selecting the used slots reads their
    count (a host sync on CUDA; this backend syncs elsewhere too)."""
    n, m = x_ND.shape[0], idx_M.shape[0]
    acc = torch.promote_types(x_ND.dtype, torch.float32)
    l1 = torch.zeros((m,), dtype=acc, device=x_ND.device)
    used = int(n_heavy.reshape(-1)[0]) - int(skip)
    used = max(0, min(used, m))
    slots = torch.arange(used, device=x_ND.device)
    slots = slots[(idx_M[:used] >= 0) & (idx_M[:used] < n)]
    if slots.numel() == 0:
        return l1
    rows = idx_M[slots]
    x_R = x_ND[rows]
    g_R = torch.matmul(x_R, w_gate_HD.t())
    if hot_k is not None and hot_k.numel():
        g_R.index_fill_(1, hot_k, 0)
    h_R = torch.relu(g_R) * torch.matmul(x_R, w_up_HD.t())
    y_ND[rows] = torch.matmul(h_R, w_down_t_HD)
    l1[slots] = h_R.abs().sum(1, dtype=acc)
    return l1
