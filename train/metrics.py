"""Throughput metrics of a training step: model FLOPs per token, the device's peak rate, MFU.

MFU (model FLOPs utilisation; PaLM, Chowdhery et al. 2022, Appendix B; nanoGPT ``model.py``,
``estimate_mfu``) is the model FLOP/s a run achieves over the device's peak FLOP/s. The model
FLOPs of one training step per token (forward + backward; recomputation under gradient
checkpointing is not counted, that would be hardware FLOPs) are::

    F_dense  = 6 * N_matmul + 12 * L * D * T

* ``N_matmul``: weights that multiply activations: per layer the attention projections
  (q and o: D x D each; k and v: D x D_kv each) and the FFN (3 D H gated, 2 D H non-gated), plus
  the LM head (V x D; with tied embeddings it is the embedding, counted once, as nanoGPT's
  ``6 N`` does). Norm weights and the embedding lookup do no matmul. 6 = 2 FLOPs per
  multiply-add x (forward + 2 backward products).
* ``12 L D T``: attention scores ``Q K^T`` and ``A V``, 2 x 2 T D per token and layer in the
  forward, x 3 with the backward (PaLM's ``12 L H Q T`` with H heads x Q head dim = D; the causal
  mask's skipped half is counted, as in PaLM and nanoGPT).

"Useful" FLOPs at a measured L0 (arXiv 2603.23198: the sparse FFN computes the up and down
projections only at the active units; the gate GEMM stays dense)::

    F_useful = F_dense - sum_l 6 * D * H * k * (1 - rho_l),   rho_l = L0_l / H

with ``k = 2`` for the gated FFN (up and down) and ``k = 1`` for the non-gated one (down; its up
projection is the ReLU input and stays dense).

Shape legend: L layers, D model width, H FFN width, V vocabulary, T sequence length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Peak dense bf16 tensor-core rate per device, TFLOP/s (NVIDIA datasheets; without the 2:4
# structured-sparsity doubling). Matched against torch.cuda.get_device_name in order.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100", 989.0),   # SXM / HBM3
    ("H200", 989.0),
    ("GH200", 989.0),
    ("A100", 312.0),
)


def matmul_params(model_cfg) -> int:
    """``N_matmul`` of a :class:`train.config.ModelConfig`: weights that multiply activations
    (attention projections, FFN, LM head once); an int. See the module docstring."""
    d, h, v = model_cfg.hidden_size, model_cfg.intermediate_size, model_cfg.vocab_size
    kv = model_cfg.num_kv_heads or model_cfg.num_heads
    d_kv = d // model_cfg.num_heads * kv
    attn = 2 * d * d + 2 * d * d_kv
    ffn = (3 if model_cfg.gated else 2) * d * h
    return model_cfg.num_layers * (attn + ffn) + v * d


def flops_per_token(model_cfg, l0_L: Sequence[float] | None = None) -> float:
    """Model FLOPs of one training step per token (forward + backward).

    Args:
        model_cfg: a :class:`train.config.ModelConfig` (or any object with its fields).
        l0_L: per-layer L0 (mean active FFN units per token, length L) for the useful FLOPs of
            the sparse FFN; None = dense FLOPs.

    Returns:
        FLOPs per token (float): ``F_dense`` or ``F_useful`` of the module docstring.

    Raises:
        ValueError: ``l0_L`` does not have one value per layer.
    """
    c = model_cfg
    dense = 6.0 * matmul_params(c) + 12.0 * c.num_layers * c.hidden_size * c.seq_len
    if l0_L is None:
        return dense
    l0_L = list(l0_L)
    if len(l0_L) != c.num_layers:
        raise ValueError(f"l0_L has {len(l0_L)} values; the model has {c.num_layers} layers")
    h = c.intermediate_size
    k = 2 if c.gated else 1
    skipped = sum(1.0 - min(max(l0 / h, 0.0), 1.0) for l0 in l0_L)
    return dense - 6.0 * c.hidden_size * h * k * skipped


def device_peak_flops(device: torch.device, precision: str,
                      override_tflops: float | None = None) -> float | None:
    """Peak dense FLOP/s of one device for MFU, or None when unknown (MFU is then omitted).

    Args:
        device: the training device.
        precision: resolved trainer precision, ``bf16`` or ``fp32``.
        override_tflops: ``trainer.peak_tflops`` (TFLOP/s); wins when given.

    Returns:
        FLOP/s: the override, else the bf16 datasheet rate of :data:`PEAK_BF16_TFLOPS` for a
        CUDA device running bf16 whose name matches; None on CPU, for fp32 runs, or for an
        unlisted GPU (set ``trainer.peak_tflops``).
    """
    if override_tflops is not None:
        return float(override_tflops) * 1e12
    if device.type != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def mfu(flops_per_tok: float, tokens_per_s_per_device: float,
        peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: ``flops_per_tok * tokens/s per device / peak FLOP/s`` (a
    fraction, 0.45 = 45 %); None when the peak is unknown."""
    if not peak_flops:
        return None
    return flops_per_tok * tokens_per_s_per_device / peak_flops
