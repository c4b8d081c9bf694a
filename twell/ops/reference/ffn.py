"""PyTorch references: the dense FFN (``gated_ffn_torch``) and the TwELL FFN (``twell_ffn_torch``).

Shape legend: N tokens, D model width, H FFN width.

``gated_ffn_torch`` is the ``torch`` path of :class:`twell.nn.SparseGatedMLP` and the oracle of
every kernel test (in float64). ``twell_ffn_torch`` is the CPU path without Triton and the
inference kernels' oracle. Same format and same overflow rule as the Triton kernels (``twell.format``):
pack the gate pre-activation, compute the up projection only at the usable
slots, scatter-add ``h * WdT_c`` into y; overflowed (row, tile) pairs are
computed densely from the pre-activation of that tile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twell.format import TILE, pack
from twell.stats import FFNStats, stats_from_activations


def gated_ffn_torch(x_ND: torch.Tensor, w_gate_HD: torch.Tensor | None, w_up_HD: torch.Tensor,
                    w_down_DH: torch.Tensor, *, with_stats: bool = True,
                    ell_capacity: int = 0) -> tuple[torch.Tensor, FFNStats | None]:
    """Dense PyTorch reference of the (gated or non-gated) ReLU FFN.

    Args:
        x_ND: (N, D) input, float (autocast applies as usual).
        w_gate_HD: (H, D) gate weight, or None for the non-gated FFN.
        w_up_HD: (H, D) up weight.
        w_down_DH: (D, H) down weight.
        with_stats: also return :class:`FFNStats` (the L1 term keeps its graph).
        ell_capacity: the capacity ``stats.heavy_rows`` counts against (0 =
            ``twell.stats.default_ell_capacity(H)``).

    Returns:
        (y_ND, stats or None), y in the autocast / input dtype.
    """
    if w_gate_HD is not None:
        g_NH = F.relu(F.linear(x_ND, w_gate_HD))
        h_NH = g_NH * F.linear(x_ND, w_up_HD)
    else:
        g_NH = h_NH = F.relu(F.linear(x_ND, w_up_HD))
    y_ND = F.linear(h_NH, w_down_DH)
    stats = stats_from_activations(h_NH, ~(g_NH <= 0), ell_capacity) if with_stats else None
    return y_ND, stats


def twell_ffn_torch(
    x_ND: torch.Tensor,
    w_gate_HD: torch.Tensor | None,
    w_up_HD: torch.Tensor,
    w_down_DH: torch.Tensor,
    *,
    factor: int = 8,
    hot_units: torch.Tensor | None = None,
) -> dict:
    """Reference sparse FFN through the TwELL format, in PyTorch.

    Args:
        x_ND: (N, D) float input; weights (H, D), (H, D), (D, H), same dtype.
        w_gate_HD: None for the non-gated FFN (``h = relu(x Wu^T)``).
        factor: TwELL compression factor.
        hot_units: (k,) int64 unique units computed densely from the unrounded pre-activation
            (their columns are zeroed before the pack: TwELL holds the cold units); None = none.

    Returns:
        dict with ``y`` (N, D) in x's dtype (fp32 accumulation, fp64 for
        fp64 input), ``tw`` (the TwELL of the cold units), ``l1_rows`` (N,) fp32 sum |h|,
        ``active_counts`` (H,) int32, ``nnz_rows`` (N,) int32 active units per row (both of
        the whole FFN), ``overflow_rows`` (N,) bool.
    """
    acc_dt = torch.promote_types(x_ND.dtype, torch.float32)
    gated = w_gate_HD is not None
    pre = x_ND @ (w_gate_HD if gated else w_up_HD).T  # (N, H) in x's dtype, like cuBLAS
    n, h = pre.shape
    g_S = None
    if hot_units is not None and hot_units.numel():
        g_S = pre[:, hot_units].to(acc_dt)
        pre = pre.index_fill(1, hot_units, 0)
    tw = pack(pre, factor)
    valid, cols, vals, _ = tw.slots()
    rows = torch.arange(n, device=x_ND.device).view(n, 1, 1).expand_as(cols)[valid]
    c = cols[valid]
    v = vals[valid].to(acc_dt)
    if gated:
        u = (x_ND[rows].to(acc_dt) * w_up_HD[c].to(acc_dt)).sum(-1)
        hv = v * u
    else:
        hv = v
    wdt = w_down_DH.T.to(acc_dt)
    y = torch.zeros(n, w_down_DH.shape[0], dtype=acc_dt, device=x_ND.device)
    y.index_add_(0, rows, hv[:, None] * wdt[c])
    l1 = torch.zeros(n, dtype=acc_dt, device=x_ND.device).index_add_(0, rows, hv.abs())
    ovf_t = tw.overflow_tiles()
    ovf_r = ovf_t.any(1)
    if bool(ovf_r.any()):
        r = ovf_r.nonzero().squeeze(1)
        col_ovf = ovf_t[r].repeat_interleave(TILE, dim=1)[:, :h]
        g = pre[r].to(acc_dt)
        act = ~(g <= 0) & col_ovf
        if gated:
            hd = torch.where(act, g * (x_ND[r].to(acc_dt) @ w_up_HD.T.to(acc_dt)), 0.0)
        else:
            hd = torch.where(act, g, 0.0)
        y[r] += hd @ wdt
        l1[r] += hd.abs().sum(-1)
    counts = (~(pre <= 0)).sum(0, dtype=torch.int32)
    nnz_rows = (~(pre <= 0)).sum(1, dtype=torch.int32)
    if g_S is not None:  # the hot units, dense (relu(NaN) = NaN; NaN counts as active)
        act = ~(g_S <= 0)
        hs = g_S.clamp(min=0)
        if gated:
            hs = hs * (x_ND.to(acc_dt) @ w_up_HD[hot_units].T.to(acc_dt))
        y += hs @ wdt[hot_units]
        l1 += hs.abs().sum(-1)
        counts.index_add_(0, hot_units, act.sum(0, dtype=torch.int32))
        nnz_rows += act.sum(1, dtype=torch.int32)
    return {
        "y": y.to(x_ND.dtype), "tw": tw, "l1_rows": l1.float(), "active_counts": counts,
        "nnz_rows": nnz_rows, "overflow_rows": ovf_r,
    }


__all__ = ["gated_ffn_torch", "twell_ffn_torch"]
