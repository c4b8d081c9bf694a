"""The sparsity profile of a trained model on held-out blocks: L0 per layer, position and token.

    from studies.profile import profile_sparsity
    prof = profile_sparsity(model, blocks_BT, batch=8)     # a LlamaForCausalLM with SparseGatedMLP
    prof.l0_L, prof.nnz_max_L, prof.dead_L, prof.hot_share_L(), prof.l0_T, prof.token_table()
    json.dumps(prof.to_dict())                             # compact, for result files

What the paper reports about activation sparsity (arXiv 2603.23198, "The L1 regularizer" and
"Results"): L0, the mean number of active FFN units per token, per layer; the largest number of
active units of one token, often > 10x the mean within a layer; the first tokens of a sequence
far more active than later ones; the least and most active tokens, leaving out tokens rarer than
1 in 2^14 of the profiled tokens; dead units. This module measures each of them on given blocks.

Counting: a forward pre-hook on every :class:`twell.nn.SparseGatedMLP` takes the FFN's input x
and computes ``relu(x Wg^T) > 0`` itself (``x Wu^T`` for the non-gated FFN), so the counts are
exact and do not depend on which FFN path the module runs; the module's own flags are not
touched. The forward runs the decoder only (no LM head), in eval mode without gradients, under
bf16 autocast on CUDA (the precision the model trained in), so the gate GEMM is the one training
computed.

Shape legend: L layers, H FFN width, N blocks, B blocks per forward, T positions, V vocabulary,
K position bins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from twell.hf import ffn_modules
from twell.stats import default_ell_capacity

# The paper's frequency filter for the least / most active tokens: tokens rarer than 1 in 2^14 of
# the profiled tokens are left out (arXiv 2603.23198, "Results").
MIN_TOKEN_FREQUENCY = 2.0**-14
# "hot units": the share of the active entries held by the hottest 1 % of a layer's units.
HOT_FRACTION = 0.01


def position_bins(seq_len: int) -> list[tuple[int, int]]:
    """Log2 bins of the positions 0..T-1: ``[(0, 1), (1, 2), (2, 4), (4, 8), ...]``, the last one
    cut at ``seq_len`` (start inclusive, end exclusive; position 0 is the first token).

    Raises:
        ValueError: ``seq_len < 1``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1; got {seq_len}")
    bins, start = [(0, 1)], 1
    while start < seq_len:
        bins.append((start, min(2 * start, seq_len)))
        start *= 2
    return bins


@dataclass
class SparsityProfile:
    """Activation counts of every FFN on ``n_seqs`` blocks of ``seq_len`` tokens (CPU tensors).

    Attributes:
        n_seqs, seq_len: blocks profiled and their length T; ``n_tokens = n_seqs * seq_len``.
        ell_capacity: the ELL capacity the heavy rows are counted against (units per token).
        nnz_sum_L: (L,) float64, active units summed over all tokens, per layer.
        nnz_max_L: (L,) int64, the most active units of any one token, per layer.
        heavy_L: (L,) int64, tokens with more active units than ``ell_capacity``, per layer.
        nonfinite_L: (L,) int64, gate pre-activations that were NaN or inf, per layer.
        active_LH: (L, H) int64, tokens in which each unit was active.
        nnz_pos_LT: (L, T) float64, active units at each position summed over the blocks.
        token_count_V: (V,) int64, occurrences of each token id in the blocks.
        token_nnz_V: (V,) float64, per token id, the sum over its occurrences of the token's
            active units averaged over the layers.
    """

    n_seqs: int
    seq_len: int
    ell_capacity: int
    nnz_sum_L: torch.Tensor
    nnz_max_L: torch.Tensor
    heavy_L: torch.Tensor
    nonfinite_L: torch.Tensor
    active_LH: torch.Tensor
    nnz_pos_LT: torch.Tensor
    token_count_V: torch.Tensor
    token_nnz_V: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return self.n_seqs * self.seq_len

    @property
    def num_layers(self) -> int:
        return self.active_LH.shape[0]

    @property
    def hidden(self) -> int:
        """H, the FFN width."""
        return self.active_LH.shape[1]

    @property
    def l0_L(self) -> torch.Tensor:
        """(L,) float64, mean active units per token; NaN for a layer with a non-finite gate."""
        l0_L = self.nnz_sum_L / max(self.n_tokens, 1)
        return torch.where(self.nonfinite_L > 0, torch.nan, l0_L)

    @property
    def l0_mean(self) -> float:
        """Mean over layers of :attr:`l0_L` (NaN propagates)."""
        return float(self.l0_L.mean())

    @property
    def dead_L(self) -> torch.Tensor:
        """(L,) int64, units active on none of the profiled tokens, per layer."""
        return (self.active_LH == 0).sum(1)

    @property
    def dead_frac_L(self) -> torch.Tensor:
        """(L,) float64, :attr:`dead_L` as a fraction of H."""
        return self.dead_L.double() / self.hidden

    def hot_share_L(self, fraction: float = HOT_FRACTION) -> torch.Tensor:
        """(L,) float64, share of a layer's active entries (token, unit) held by its
        ``max(1, floor(fraction * H))`` most often active units (0 for a layer with none)."""
        k = max(1, int(fraction * self.hidden))
        top_L = torch.topk(self.active_LH.double(), k, dim=1).values.sum(1)
        return top_L / self.active_LH.sum(1).double().clamp_min(1)

    @property
    def l0_LT(self) -> torch.Tensor:
        """(L, T) float64, mean active units at each position."""
        return self.nnz_pos_LT / max(self.n_seqs, 1)

    @property
    def l0_T(self) -> torch.Tensor:
        """(T,) float64, mean active units at each position, averaged over the layers."""
        return self.l0_LT.mean(0)

    def l0_by_position_bins(self) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """(bins, l0_LK): the :func:`position_bins` and the (L, K) float64 mean active units per
        token of the positions in each bin."""
        bins = position_bins(self.seq_len)
        l0_LT = self.l0_LT
        l0_LK = torch.stack([l0_LT[:, a:b].mean(1) for a, b in bins], dim=1)
        return bins, l0_LK

    def token_table(self, min_frequency: float = MIN_TOKEN_FREQUENCY
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids seen at least ``min_frequency * n_tokens`` times (the paper's filter), ordered
        from the least to the most active: ``(ids, counts, l0)``, int64 / int64 / float64, ``l0``
        the token's active units averaged over its occurrences and the layers."""
        need = max(1, math.ceil(min_frequency * self.n_tokens))
        ids = torch.nonzero(self.token_count_V >= need).flatten()
        counts = self.token_count_V[ids]
        l0 = self.token_nnz_V[ids] / counts.double()
        order = torch.argsort(l0, stable=True)
        return ids[order], counts[order], l0[order]

    def layer_rows(self) -> list[dict]:
        """One dict per layer: layer, tokens, l0, l0_max, dead_pct (units never active),
        hot1_share, heavy_frac (tokens above the ELL capacity / tokens)."""
        l0, share = self.l0_L.tolist(), self.hot_share_L().tolist()
        dead = self.dead_frac_L.tolist()
        return [{"layer": i, "tokens": self.n_tokens, "l0": l0[i],
                 "l0_max": float(self.nnz_max_L[i]), "dead_pct": 100 * dead[i],
                 "hot1_share": share[i], "heavy_frac": float(self.heavy_L[i]) / max(self.n_tokens, 1)}
                for i in range(self.num_layers)]

    def to_dict(self, decode=None, min_frequency: float = MIN_TOKEN_FREQUENCY) -> dict:
        """JSON-ready summary (a few hundred KB at most): per-layer values, L0 per position
        averaged over layers, per-layer L0 per log2 position bin, the frequency-filtered token
        table (``decode(id) -> str`` adds the token text). The (L, H) counts are not included."""
        bins, l0_LK = self.l0_by_position_bins()
        ids, counts, l0 = self.token_table(min_frequency)
        tokens = {"min_frequency": min_frequency, "ids": ids.tolist(), "count": counts.tolist(),
                  "l0": [round(v, 4) for v in l0.tolist()]}
        if decode is not None:
            tokens["text"] = [decode(i) for i in tokens["ids"]]

        def r(xs, nd=4):
            return [None if not math.isfinite(v) else round(v, nd) for v in xs]

        return {
            "n_seqs": self.n_seqs, "seq_len": self.seq_len, "n_tokens": self.n_tokens,
            "layers": self.num_layers, "hidden": self.hidden, "ell_capacity": self.ell_capacity,
            "l0_mean": None if not math.isfinite(self.l0_mean) else self.l0_mean,
            "l0_L": r(self.l0_L.tolist()), "nnz_max_L": self.nnz_max_L.tolist(),
            "dead_L": self.dead_L.tolist(), "hot1_share_L": r(self.hot_share_L().tolist()),
            "heavy_frac_L": r((self.heavy_L.double() / max(self.n_tokens, 1)).tolist(), 6),
            "nonfinite_L": self.nonfinite_L.tolist(),
            "l0_T": r(self.l0_T.tolist(), 3),
            "position_bins": [list(b) for b in bins],
            "l0_LK": [r(row, 3) for row in l0_LK.tolist()],
            "tokens": tokens,
        }


def _check_blocks(blocks_BT: torch.Tensor, vocab_size: int) -> None:
    if blocks_BT.dim() != 2 or blocks_BT.shape[0] < 1 or blocks_BT.shape[1] < 1:
        raise ValueError(f"blocks_BT must be a non-empty 2-D (blocks, positions) tensor of token "
                         f"ids; got shape {tuple(blocks_BT.shape)}")
    if blocks_BT.dtype.is_floating_point or blocks_BT.dtype == torch.bool:
        raise ValueError(f"blocks_BT must hold integer token ids; got dtype {blocks_BT.dtype}")
    lo, hi = int(blocks_BT.min()), int(blocks_BT.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"blocks_BT holds token ids in [{lo}, {hi}], outside the model's "
                         f"vocabulary [0, {vocab_size}); pass blocks of this model's tokenizer")


@torch.no_grad()
def profile_sparsity(model, blocks_BT: torch.Tensor, *, batch: int = 8, bf16: bool | None = None,
                     ell_capacity: int = 0, mlps=None, device=None) -> SparsityProfile:
    """Count the active FFN units of ``model`` on ``blocks_BT`` per layer, unit, position, token.

    Args:
        model: a ``LlamaForCausalLM`` whose FFNs are :class:`twell.nn.SparseGatedMLP` (e.g.
            :func:`train.model.load_model`); left in its training mode afterwards.
        blocks_BT: (N, T) integer token ids, held-out blocks (all of one length T).
        batch: blocks per forward.
        bf16: bf16 autocast; None = on CUDA only.
        ell_capacity: heavy rows are tokens with more active units than this; 0 =
            :func:`twell.stats.default_ell_capacity` of H (128 at H 5632).
        mlps: the FFN modules (default: :func:`twell.hf.ffn_modules` of ``model``).
        device: where the forward runs (default: the model's parameters' device).

    Returns:
        :class:`SparsityProfile` (CPU tensors).

    Raises:
        ValueError: ``batch < 1``, no FFN module, blocks not a non-empty 2-D integer tensor, or
            ids outside the vocabulary.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got {batch}")
    mlps = list(ffn_modules(model) if mlps is None else mlps)
    if not mlps:
        raise ValueError("model has no SparseGatedMLP FFN to profile; build it with "
                         "train.model.build_model or load it with train.model.load_model")
    vocab = model.get_input_embeddings().num_embeddings
    _check_blocks(blocks_BT, vocab)
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    bf16 = dev.type == "cuda" if bf16 is None else bf16
    L, H, (N, T) = len(mlps), mlps[0].intermediate_size, blocks_BT.shape
    cap = ell_capacity or default_ell_capacity(H)
    active_LH = torch.zeros(L, H, dtype=torch.int64, device=dev)
    nonfinite_L = torch.zeros(L, dtype=torch.int64, device=dev)
    sums = _zero_sums(L, T, vocab, dev)
    nnz_BT: list = [None] * L  # each layer's hook writes its (B, T) counts here
    hooks = [_gate_hook(i, m, nnz_BT, active_LH, nonfinite_L) for i, m in enumerate(mlps)]
    _forward_blocks(model, mlps, hooks, nnz_BT, blocks_BT, batch, dev, bf16, sums, cap)
    return SparsityProfile(
        n_seqs=N, seq_len=T, ell_capacity=cap, nnz_sum_L=sums["nnz_L"].cpu(),
        nnz_max_L=sums["max_L"].cpu(), heavy_L=sums["heavy_L"].cpu(),
        nonfinite_L=nonfinite_L.cpu(), active_LH=active_LH.cpu(), nnz_pos_LT=sums["pos_LT"].cpu(),
        token_count_V=sums["count_V"].cpu(), token_nnz_V=sums["tok_V"].cpu())


def _gate_hook(i: int, mlp, nnz_BT: list, active_LH: torch.Tensor, nonfinite_L: torch.Tensor):
    """Forward pre-hook of FFN ``i``: from its input, the gate pre-activation's active units per
    token into ``nnz_BT[i]`` (int64 (B, T)), added per unit to ``active_LH[i]``, its non-finite
    entries counted into ``nonfinite_L[i]``."""
    def hook(_module, args):
        w_HD = mlp.gate_proj.weight if mlp.gated else mlp.up_proj.weight
        g_BTH = F.linear(args[0], w_HD)  # the gate pre-activation, in the forward's dtype
        active_BTH = g_BTH > 0
        nnz_BT[i] = active_BTH.sum(-1)  # int64
        active_LH[i] += active_BTH.reshape(-1, active_BTH.shape[-1]).sum(0)
        nonfinite_L[i] += (~torch.isfinite(g_BTH)).sum()
    return hook


def _zero_sums(L: int, T: int, vocab: int, dev) -> dict[str, torch.Tensor]:
    """The profile's running sums (:func:`_accumulate`), zero: per layer, position and token id."""
    return {"nnz_L": torch.zeros(L, dtype=torch.float64, device=dev),
            "max_L": torch.zeros(L, dtype=torch.int64, device=dev),
            "heavy_L": torch.zeros(L, dtype=torch.int64, device=dev),
            "pos_LT": torch.zeros(L, T, dtype=torch.float64, device=dev),
            "count_V": torch.zeros(vocab, dtype=torch.int64, device=dev),
            "tok_V": torch.zeros(vocab, dtype=torch.float64, device=dev)}


def _forward_blocks(model, mlps: list, hooks: list, nnz_BT: list, blocks_BT: torch.Tensor,
                    batch: int, dev, bf16: bool, sums: dict, cap: int) -> None:
    """The decoder's forward over ``blocks_BT``, ``batch`` blocks at a time, with ``hooks`` on
    ``mlps`` (writing ``nnz_BT``), each batch's counts added to ``sums``; the model in eval mode
    meanwhile, the hooks removed and its mode restored after."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    handles = [m.register_forward_pre_hook(h) for m, h in zip(mlps, hooks, strict=True)]
    was_training = model.training
    model.eval()
    try:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            for s in range(0, blocks_BT.shape[0], batch):
                ids_BT = blocks_BT[s:s + batch].to(dev, torch.int64)
                decoder(input_ids=ids_BT)
                _accumulate(sums, torch.stack(nnz_BT), ids_BT, cap)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)


def _accumulate(sums: dict, nnz_LBT: torch.Tensor, ids_BT: torch.Tensor, cap: int) -> None:
    """Add one forward's per-token counts (L, B, T) to the running sums."""
    sums["nnz_L"] += nnz_LBT.sum((1, 2)).double()
    sums["max_L"] = torch.maximum(sums["max_L"], nnz_LBT.amax((1, 2)))
    sums["heavy_L"] += (nnz_LBT > cap).sum((1, 2))
    sums["pos_LT"] += nnz_LBT.sum(1).double()
    ids_N = ids_BT.flatten()
    sums["count_V"] += torch.bincount(ids_N, minlength=sums["count_V"].numel())
    sums["tok_V"] += torch.bincount(ids_N, weights=nnz_LBT.double().mean(0).flatten(),
                                    minlength=sums["tok_V"].numel())


def sparsity_profile(model, mlps, blocks_BT, batch: int, dev, bf16: bool) -> list[dict]:
    """:func:`profile_sparsity` as per-layer rows (:meth:`SparsityProfile.layer_rows`): the form
    ``scripts/bench_model.py`` writes to its ``sparsity_profile.csv``."""
    return profile_sparsity(model, blocks_BT, batch=batch, bf16=bf16, mlps=mlps,
                            device=dev).layer_rows()


__all__ = ["HOT_FRACTION", "MIN_TOKEN_FREQUENCY", "SparsityProfile", "position_bins",
           "profile_sparsity", "sparsity_profile"]
