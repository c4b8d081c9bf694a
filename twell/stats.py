"""Per-call activation statistics of a ReLU-gated FFN.

Shape legend: N = tokens (all leading dims flattened), H = FFN hidden width.

Every FFN implementation (``torch``, ``twell``) returns these alongside its
output, computed from quantities the forward already holds (the ReLU'd gate
and ``h``), so the L1 term, L0 and dead-neuron tracking cost no extra pass
over N x H beyond the one the L1 term itself needs.

Source: arXiv 2603.23198, the L1 regularizer and its metrics (L0, L1, dead neurons).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# ELL capacity of the hybrid training layout as a fraction of H: a row denser than this is cheaper
# as a dense row (cost model: ~7 gathers of a 2*D-byte row per non-zero at ~9 TB/s vs ~8 dense
# GEMM rows at ~680 TFLOP/s on H200 breaks even near 1.5-2% of H). 0.0227 * 5632 -> 128, the
# paper's width. Tokens above it are "heavy rows" (FFNStats.heavy_rows).
DEFAULT_MAX_ROW_DENSITY = 0.0227


def default_ell_capacity(h: int) -> int:
    """ELL capacity KC (slots per token row, int) for FFN width ``h`` (int, units):
    ``ceil(0.0227 h)`` rounded up to 16, within [16, h] (at most h); 128 at h = 5632, the
    paper's ELL width (arXiv 2603.23198, "Hybrid (training)"). Raises nothing."""
    return max(1, min(h, max(16, 16 * math.ceil(math.ceil(DEFAULT_MAX_ROW_DENSITY * h) / 16))))


@dataclass
class FFNStats:
    """Activation statistics of one FFN call.

    Attributes:
        l1: scalar tensor (fp32, or fp64 for fp64 input), **differentiable**: mean over the N tokens of
            ``sum_j |h_j|`` (the per-layer L1 term of the paper, code's
            normalisation: no division by H).
        nnz_sum: scalar fp32 tensor, detached: total number of active hidden
            units summed over the N tokens (L0 of the call = nnz_sum / N).
            A unit is active when its ReLU'd gate is > 0 (``h != 0``).
        nnz_max: scalar fp32 tensor, detached: the largest number of active
            units of any single token.
        active_counts: (H,) int32 tensor, detached: for each hidden unit, the
            number of tokens in which it was active (for dead-neuron tracking).
        n_tokens: N, a Python int.
        heavy_rows: scalar fp32 tensor, detached, or None when not measured (inference): tokens
            with more active units than the hybrid training layout's ELL capacity (the capacity
            the ``ell`` path ran with, else ``default_ell_capacity(H)``); the ``ell`` path
            computes them densely. With ``hot_units`` it counts the active cold units only
            (what the ELL part and its dense backup hold). ``ffn.impl=auto`` reads it.
    """

    l1: torch.Tensor
    nnz_sum: torch.Tensor
    nnz_max: torch.Tensor
    active_counts: torch.Tensor
    n_tokens: int
    heavy_rows: torch.Tensor | None = None

    @property
    def l0(self) -> torch.Tensor:
        """Mean active hidden units per token (scalar fp32 tensor)."""
        return self.nnz_sum / max(self.n_tokens, 1)


def stats_from_activations(h_NH: torch.Tensor, active_NH: torch.Tensor,
                           ell_capacity: int = 0) -> FFNStats:
    """Build :class:`FFNStats` from the FFN hidden activations.

    Args:
        h_NH: (N, H) hidden activations ``relu(x Wg^T) * (x Wu^T)`` (any float
            dtype; the L1 sum is accumulated in fp32). Gradient flows to it
            through ``l1``.
        active_NH: (N, H) bool, ``relu(gate) > 0``.
        ell_capacity: ``heavy_rows`` counts the tokens above it (0 = ``default_ell_capacity(H)``).

    Returns:
        FFNStats for the N tokens.
    """
    if h_NH.dim() != 2 or active_NH.shape != h_NH.shape:
        raise ValueError(
            f"h_NH must be 2-D and active_NH the same shape; got {tuple(h_NH.shape)} "
            f"and {tuple(active_NH.shape)}"
        )
    n = h_NH.shape[0]
    acc = torch.promote_types(h_NH.dtype, torch.float32)  # fp32 accumulation at least
    l1_N = torch.linalg.vector_norm(h_NH, ord=1, dim=-1, dtype=acc)
    l1 = l1_N.mean() if n > 0 else l1_N.sum()
    with torch.no_grad():
        nnz_N = active_NH.sum(-1, dtype=torch.int32)
        counts_H = active_NH.sum(0, dtype=torch.int32)
    kc = ell_capacity if ell_capacity > 0 else default_ell_capacity(h_NH.shape[1])
    return stats_from_counts(l1, nnz_N, counts_H, kc)


def stats_from_counts(l1: torch.Tensor, nnz_N: torch.Tensor, counts_H: torch.Tensor,
                      ell_capacity: int | None = None) -> FFNStats:
    """Build :class:`FFNStats` from per-token and per-unit counts (what the kernels produce).

    Args:
        l1: scalar fp32 (or fp64) tensor, mean over tokens of ``sum_j |h_j|`` (keeps its graph).
        nnz_N: (N,) int tensor, active units per token.
        counts_H: (H,) int32 tensor, active tokens per unit.
        ell_capacity: when given, ``heavy_rows`` counts the tokens above it; else None.

    Returns:
        FFNStats for the N tokens (nnz_max 0 when N = 0). Source: arXiv 2603.23198, the L1
        regularizer and its metrics.
    """
    n = nnz_N.shape[0]
    with torch.no_grad():
        nnz_sum = nnz_N.sum().float()
        nnz_max = nnz_N.max().float() if n > 0 else nnz_sum.new_zeros(())
        heavy = None if ell_capacity is None else (nnz_N > ell_capacity).sum().float()
    return FFNStats(l1=l1, nnz_sum=nnz_sum, nnz_max=nnz_max, active_counts=counts_H, n_tokens=n,
                    heavy_rows=heavy)
