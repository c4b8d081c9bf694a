"""The L1 activation-sparsity regularizer, its coefficient schedule, L0 and dead neurons.

Source: arXiv 2603.23198, the L1 regularizer (the released code's normalization):

    L1_layer = mean over tokens of sum over hidden units of |h|     (no division by H)
    L1       = mean over layers of L1_layer
    loss     = CE + l1_coeff * L1                                    (paper: 2e-5)

L0 = mean number of active (relu(gate) > 0) hidden units per token. A unit is dead when it is
inactive for every token of a window (default: one optimizer step's tokens, ~1M in the paper).
The paper's fix for dead units (not in its public code): after every step, for each dead gate
row j, ``Wg[j] <- (1 - 0.1) Wg[j] + 0.1 * N(0, 0.02^2)``.

Everything here is computed from the :class:`twell.stats.FFNStats` each FFN leaves in
``last_stats``: no extra pass over tokens x hidden.

Shape legend: L layers, H FFN width, D model width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from twell.nn import SparseGatedMLP
from twell.stats import FFNStats


@dataclass
class SparsityStats:
    """Detached per-layer statistics of one forward (all tensors on the model's device).

    Attributes:
        l1_L: (L,) fp32, per-layer L1 (mean over tokens of sum_j |h_j|).
        nnz_sum_L: (L,) fp32, active units summed over the tokens, per layer.
        nnz_max_L: (L,) fp32, most active units of any single token, per layer.
        active_LH: (L, H) int32, tokens in which each unit was active.
        n_tokens: tokens of the forward (per layer).
        heavy_L: (L,) fp32, tokens above the ELL capacity per layer (``FFNStats.heavy_rows``;
            0 where a path did not measure it).
    """

    l1_L: torch.Tensor
    nnz_sum_L: torch.Tensor
    nnz_max_L: torch.Tensor
    active_LH: torch.Tensor
    n_tokens: int
    heavy_L: torch.Tensor | None = None

    @property
    def l0_L(self) -> torch.Tensor:
        """(L,) mean active units per token, per layer."""
        return self.nnz_sum_L / max(self.n_tokens, 1)


def l1_penalty(stats: list[FFNStats]) -> tuple[torch.Tensor, SparsityStats]:
    """The paper's L1 term (differentiable) and the detached statistics of one forward.

    Args:
        stats: one :class:`FFNStats` per layer (``SparseGatedMLP.last_stats``), same token count.

    Returns:
        (l1, SparsityStats): ``l1`` is a scalar fp32 tensor with graph, the mean over layers of
        each layer's mean-over-tokens sum of ``|h|``; multiply by ``l1_coeff`` and add to CE.

    Raises:
        ValueError: empty ``stats`` (the FFNs did not collect stats).
    """
    if not stats or any(s is None for s in stats):
        raise ValueError("no FFN stats: every SparseGatedMLP needs collect_stats on during "
                         "training (the L1 term is computed from them; FFNPlan.begin_step turns "
                         "it on)")
    l1_L = torch.stack([s.l1 for s in stats])  # fp32 (fp64 for fp64 models)
    sparsity = SparsityStats(
        l1_L=l1_L.detach(),
        nnz_sum_L=torch.stack([s.nnz_sum for s in stats]),
        nnz_max_L=torch.stack([s.nnz_max for s in stats]),
        active_LH=torch.stack([s.active_counts for s in stats]),
        n_tokens=stats[0].n_tokens,
        heavy_L=torch.stack([s.heavy_rows if s.heavy_rows is not None
                             else torch.zeros_like(s.nnz_sum) for s in stats]),
    )
    return l1_L.mean(), sparsity


def collect_stats(mlps: list[SparseGatedMLP]) -> list[FFNStats]:
    """The ``last_stats`` of each FFN (call right after the forward)."""
    return [m.last_stats for m in mlps]


def l1_coeff_at(step: int, cfg) -> float:
    """L1 coefficient for optimizer step ``step`` (0-based: the step being computed).

    ``constant``: ``cfg.l1_coeff`` from step 0. ``linear_warmup``: 0 for steps <= warmup_start,
    then linear, reaching ``cfg.l1_coeff`` at ``warmup_end`` (and after). ``target_l0`` is
    stateful: :class:`L1Schedule`.
    """
    if cfg.schedule in ("constant", "target_l0"):
        return float(cfg.l1_coeff)
    a, b = cfg.warmup_start, cfg.warmup_end
    frac = min(max((step - a) / (b - a), 0.0), 1.0)
    return float(cfg.l1_coeff) * frac


# target_l0: the coefficient stays within [l1_coeff / TARGET_RANGE, l1_coeff * TARGET_RANGE]
TARGET_RANGE = 100.0


class L1Schedule:
    """The L1 coefficient of each optimizer step: :func:`l1_coeff_at`'s, or with
    ``schedule=target_l0`` a multiplicative controller that holds the training L0 at
    ``target_l0`` (ours, not the paper's: it trains a model to a stated sparsity, e.g. a bench
    model at the paper's reported L0 of 29 / 24 non-zeros per token at 1.5B / 2B).

    Controller: ``c = l1_coeff`` for the first ``target_after`` steps; after each step from the
    ``target_after``-th on (the first steered step is step ``target_after + 1``, 1-based),
    ``c <- c * exp(target_gain * clamp((L0 - target) / target, -1, 1))`` within
    ``[l1_coeff / 100, l1_coeff * 100]``, where L0 is the step's mean over layers of active
    units per token (its tokens over all ranks, read at the step's one host sync: no extra
    sync). Every rank computes the same ``c``; it is saved with the trainer's state, so a
    resumed run uses the same coefficients. A checkpoint continued with another
    ``sparsity.l1_coeff`` (``trainer.resume=PATH sparsity.l1_coeff=...``), or one of another
    schedule, starts the controller afresh at the new ``l1_coeff``.

    Args:
        cfg: the :class:`train.config.SparsityConfig` (validated there).
    """

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.coeff = float(cfg.l1_coeff)  # target_l0: the next step's coefficient

    @property
    def steered(self) -> bool:
        return self.cfg.schedule == "target_l0"

    def at(self, step: int) -> float:
        """The coefficient of optimizer step ``step`` (0-based: the step being computed)."""
        return self.coeff if self.steered else l1_coeff_at(step, self.cfg)

    def update(self, step: int, nnz_sum_L: Sequence[float], tokens: int) -> None:
        """After optimizer step ``step`` (0-based) was accepted: steer from its L0.

        Args:
            nnz_sum_L: (L,) host floats, active units summed over the step's ``tokens``.
            tokens: FFN tokens of the step (all ranks).
        """
        cfg = self.cfg
        # steps 0 .. target_after - 1 run at l1_coeff; the one after them is the first steered
        if not self.steered or step + 1 < cfg.target_after or not nnz_sum_L or tokens <= 0:
            return
        l0 = sum(nnz_sum_L) / (len(nnz_sum_L) * tokens)
        err = min(max((l0 - cfg.target_l0) / cfg.target_l0, -1.0), 1.0)
        lo, hi = cfg.l1_coeff / TARGET_RANGE, cfg.l1_coeff * TARGET_RANGE
        # a gain so large that one step crosses the whole range goes bound to bound (math.exp
        # overflows past ~709); any smaller move is left as it is
        span = 2 * math.log(TARGET_RANGE)
        move = min(max(cfg.target_gain * err, -span), span)
        self.coeff = min(max(self.coeff * math.exp(move), lo), hi)

    def state_dict(self) -> dict:
        """The next step's coefficient, and the ``l1_coeff`` and schedule it was steered from."""
        return {"coeff": self.coeff, "l1_coeff": float(self.cfg.l1_coeff),
                "steered": self.steered}

    def load_state_dict(self, d: dict | None) -> None:
        """Restore :meth:`state_dict`'s output. The coefficient is left as it is (a new
        schedule's: ``l1_coeff``) when ``d`` is None (a checkpoint from before the schedule
        existed), was not steered, or was steered from another ``l1_coeff`` (the run continues
        with a new one)."""
        if d is None or not d.get("steered", True):
            return
        if d.get("l1_coeff", self.cfg.l1_coeff) == self.cfg.l1_coeff:
            self.coeff = float(d["coeff"])


class DeadNeuronTracker:
    """Counts, per layer and unit, the tokens in which the unit was active over a window.

    Feed it once per optimizer step with that step's counts summed over micro-steps **and
    ranks** (so the state is identical on every rank). When at least ``window_tokens`` tokens
    have been seen, the window closes: units with zero count are dead, :attr:`dead_LH` and
    :attr:`dead_fraction_L` are set, and the counts restart.

    Args:
        num_layers, hidden: L and H.
        window_tokens: tokens per window (e.g. one step's global tokens).
        device: where the (L, H) int64 counts live.
    """

    def __init__(self, num_layers: int, hidden: int, window_tokens: int, device=None) -> None:
        if window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1; got {window_tokens}")
        self.window_tokens = int(window_tokens)
        self.counts_LH = torch.zeros(num_layers, hidden, dtype=torch.int64, device=device)
        self.seen = 0
        self.dead_LH: torch.Tensor | None = None  # (L, H) bool, of the last closed window
        self.windows = 0

    def update(self, active_LH: torch.Tensor, n_tokens: int) -> torch.Tensor | None:
        """Add one step's counts ((L, H), any int dtype) over ``n_tokens`` tokens.

        Returns the (L, H) bool dead mask when this update closes a window, else None.
        """
        self.counts_LH += active_LH.to(self.counts_LH)
        self.seen += int(n_tokens)
        if self.seen < self.window_tokens:
            return None
        self.dead_LH = self.counts_LH == 0
        self.counts_LH.zero_()
        self.seen = 0
        self.windows += 1
        return self.dead_LH

    @property
    def dead_fraction_L(self) -> torch.Tensor | None:
        """(L,) fraction of dead units per layer in the last closed window (None before one)."""
        return None if self.dead_LH is None else self.dead_LH.float().mean(1)

    def state_dict(self) -> dict:
        return {"window_tokens": self.window_tokens, "counts_LH": self.counts_LH.cpu().clone(),
                "seen": self.seen, "windows": self.windows,
                "dead_LH": None if self.dead_LH is None else self.dead_LH.cpu().clone()}

    def load_state_dict(self, d: dict) -> None:
        if tuple(d["counts_LH"].shape) != tuple(self.counts_LH.shape):
            raise ValueError(f"dead-neuron state has shape {tuple(d['counts_LH'].shape)}, "
                             f"model needs {tuple(self.counts_LH.shape)}")
        self.window_tokens = int(d["window_tokens"])
        self.counts_LH.copy_(d["counts_LH"])
        self.seen = int(d["seen"])
        self.windows = int(d["windows"])
        dead = d["dead_LH"]
        self.dead_LH = None if dead is None else dead.to(self.counts_LH.device)


@torch.no_grad()
def reinit_dead_gates(
    mlps: list[SparseGatedMLP], dead_LH: torch.Tensor, *, lam: float, std: float,
    generator: torch.Generator,
) -> None:
    """Pull each dead unit's gate row towards a fresh init (paper's dead-neuron fix).

    For every layer l and dead unit j: ``W[j] <- (1 - lam) W[j] + lam * N(0, std^2)``, where W is
    ``gate_proj.weight`` (H, D), or ``up_proj.weight`` for the non-gated FFN (its ReLU input).
    Live rows are untouched. Noise is drawn for all rows (no host sync on the dead count);
    ``generator`` (on the weights' device) makes it identical on every rank and on resume. An
    FSDP-sharded weight (a ``DTensor``) draws the same full noise and updates its own rows only,
    so the result is the unsharded one.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    for mlp, dead_H in zip(mlps, dead_LH):
        w_HD = mlp.gate_proj.weight if mlp.gated else mlp.up_proj.weight
        noise_HD = torch.randn(tuple(w_HD.shape), generator=generator, device=w_HD.device,
                               dtype=torch.float32).to(w_HD.dtype) * std
        dead_H1 = dead_H.to(w_HD.device)[:, None]
        if isinstance(w_HD, DTensor):  # this rank's rows of the full tensors (no communication)
            noise_HD, dead_H1 = (distribute_tensor(x, w_HD.device_mesh, w_HD.placements,
                                                   src_data_rank=None) for x in (noise_HD, dead_H1))
        mixed_HD = w_HD * (1 - lam) + noise_HD * lam
        w_HD.copy_(torch.where(dead_H1, mixed_HD, w_HD))
