"""Hot units of a sparse FFN: the hidden units the sparse ops compute through a dense slice.

Shape legend: N tokens, D model width, H FFN width, k hot units.

Hidden units can be split freely inside an FFN (``y = sum_j h_j Wd[:, j]``), so the ops take a
set S of hot units (``hot_units``, a (k,) int64 device tensor) and compute them with cuBLAS
slices (``x Wu[S]^T``, ``h_S Wd[:, S]^T``, and the backward's products), the rest through the
sparse layout (ELL in training, TwELL in inference). On the activations of a framework-trained
model the hottest 1 % of the units hold 21-36 % of the active entries: in the sparse layout they
make CSC columns thousands of entries long (the weight-gradient kernel's load imbalance) and
push rows over the ELL / tile capacity. Cost model and thresholds:
:attr:`twell.policy.FFNPolicy.hot_unit_fraction` and ``max_hot_units``.

The set is picked from per-unit active counts (``FFNStats.active_counts`` of an earlier call)
in two steps so that the op itself adds no host synchronisation: :func:`hot_unit_count` turns
counts the caller already has on the host into k (an int), and :func:`hot_units_from_counts`
takes the top k on the device.
"""

from __future__ import annotations

import math

import torch

from twell.policy import FFNPolicy

HOT_UNIT_MULTIPLE = 16  # k is rounded up to a multiple of this (cuBLAS tile-friendly slices)


def hot_unit_count(counts_H, n_tokens: int, policy: FFNPolicy | None = None) -> int:
    """k, the number of hot units for per-unit active counts measured over ``n_tokens`` tokens.

    Args:
        counts_H: (H,) active tokens per unit (``FFNStats.active_counts``) as host values: a CPU
            tensor, numpy array or sequence. A CUDA tensor is copied to the host (one sync).
        n_tokens: N, the tokens the counts were measured over (``FFNStats.n_tokens``).
        policy: :class:`twell.policy.FFNPolicy` (``hot_unit_fraction``, ``max_hot_units``);
            the defaults when None.

    Returns:
        k (int): the units with more than ``hot_unit_fraction * n_tokens`` active tokens, rounded
        up to a multiple of 16, capped at ``min(max_hot_units, H)``; 0 when none qualifies.

    Raises:
        ValueError: counts not 1-D, or n_tokens < 0.
    """
    policy = policy if policy is not None else FFNPolicy()
    c = torch.as_tensor(counts_H).detach().cpu()
    if c.dim() != 1:
        raise ValueError(f"hot_unit_count: counts_H must be 1-D (H,); got shape {tuple(c.shape)}")
    if n_tokens < 0:
        raise ValueError(f"hot_unit_count: n_tokens must be >= 0; got {n_tokens}")
    if n_tokens == 0 or c.numel() == 0:
        return 0
    return hot_unit_k(int((c.double() > policy.hot_unit_fraction * n_tokens).sum()), c.numel(),
                      policy)


def hot_unit_k(n_hot: int, h: int, policy: FFNPolicy | None = None) -> int:
    """k for ``n_hot`` units above the hot threshold (a host int the caller counted, e.g. in a
    step's one host sync) in an FFN of width ``h``: ``n_hot`` rounded up to a multiple of 16,
    capped at ``min(max_hot_units, h)``; 0 when ``n_hot`` is 0 (what :func:`hot_unit_count`
    returns for the counts behind ``n_hot``).

    Raises:
        ValueError: n_hot or h < 0.
    """
    if n_hot < 0 or h < 0:
        raise ValueError(f"hot_unit_k: n_hot and h must be >= 0; got {n_hot}, {h}")
    policy = policy if policy is not None else FFNPolicy()
    if n_hot == 0:
        return 0
    k = HOT_UNIT_MULTIPLE * math.ceil(n_hot / HOT_UNIT_MULTIPLE)
    return min(k, policy.max_hot_units, h)


def hot_units_from_counts(counts_H: torch.Tensor, n_tokens: int, k: int | None = None,
                          policy: FFNPolicy | None = None) -> torch.Tensor:
    """The k most active units, on the counts' device, for the ops' ``hot_units`` argument.

    Args:
        counts_H: (H,) int tensor of active tokens per unit (``FFNStats.active_counts``; any
            device).
        n_tokens: N, the tokens the counts were measured over.
        k: hot units to return (from :func:`hot_unit_count` on host values the caller already
            has: no sync here). None = ``hot_unit_count(counts_H, n_tokens, policy)``, which
            copies the counts to the host (one sync on CUDA).
        policy: used when ``k`` is None.

    Returns:
        (k,) int64 unit indices in ascending order (unique; the k largest counts, ties broken
        by ``torch.topk``); empty when k = 0.

    Raises:
        ValueError: counts not 1-D, or k outside [0, H].
    """
    if counts_H.dim() != 1:
        raise ValueError(f"hot_units_from_counts: counts_H must be 1-D (H,); got shape "
                         f"{tuple(counts_H.shape)}")
    h = counts_H.shape[0]
    if k is None:
        k = hot_unit_count(counts_H, n_tokens, policy)
    if not 0 <= k <= h:
        raise ValueError(f"hot_units_from_counts: k must be in [0, H={h}]; got {k}")
    if k == 0:
        return torch.empty((0,), dtype=torch.int64, device=counts_H.device)
    idx = torch.topk(counts_H.to(torch.int64), k, sorted=False).indices
    return torch.sort(idx).values  # ascending: the weight-row gathers walk memory in order


def check_hot_units(hot_units: torch.Tensor | None, h: int, device: torch.device,
                    fn: str) -> torch.Tensor | None:
    """``hot_units`` as a contiguous int64 tensor, or None for an empty / absent set.

    Unit indices must be unique and in [0, H) (as :func:`hot_units_from_counts` returns them).
    On a CPU tensor that is checked here (not under torch.compile); on CUDA it is not (it would
    need a host sync): an out-of-range index raises inside the gathers, a repeated one counts
    the unit twice in the forward and makes the Triton backward's row scatters of its weight
    gradients race (``twell.ops.add_rows``: one add lost, not deterministic).

    Raises:
        ValueError: not a 1-D integer tensor on ``device``, more than H entries, or (CPU) an
            index out of range or repeated; the message names ``fn``.
    """
    if hot_units is None:
        return None
    if not isinstance(hot_units, torch.Tensor) or hot_units.dim() != 1 or (
            hot_units.is_floating_point() or hot_units.is_complex()
            or hot_units.dtype == torch.bool):
        raise ValueError(f"{fn}: hot_units must be a 1-D integer tensor of unit indices (e.g. "
                         f"from hot_units_from_counts); got {hot_units!r:.80}")
    if hot_units.device != device:
        raise ValueError(f"{fn}: hot_units must be on the device of x ({device}); got "
                         f"{hot_units.device}")
    k = hot_units.shape[0]
    if k > h:
        raise ValueError(f"{fn}: hot_units has {k} entries, more than H = {h} units")
    if k == 0:
        return None
    hot = hot_units.to(torch.int64).contiguous()
    if hot.device.type == "cpu" and not torch.compiler.is_compiling():  # data-dependent check
        lo, hi = int(hot.min()), int(hot.max())
        if lo < 0 or hi >= h:
            raise ValueError(f"{fn}: hot_units must be unit indices in [0, {h}); got values in "
                             f"[{lo}, {hi}]")
        if torch.unique(hot).numel() != k:
            raise ValueError(f"{fn}: hot_units has repeated units (each unit at most once)")
    return hot


__all__ = ["HOT_UNIT_MULTIPLE", "check_hot_units", "hot_unit_count", "hot_unit_k",
           "hot_units_from_counts"]
