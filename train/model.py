"""The model: stock transformers ``LlamaForCausalLM`` (ReLU) whose FFNs are ``SparseGatedMLP``.

Source: arXiv 2603.23198, "Model and recipe" (see ``shared/PAPER.md``): hidden 2048, FFN 5632,
32 heads, no GQA, RMSNorm eps 1e-5, no biases, init std 0.02, tied embeddings, RoPE theta 1e5,
bos = eos = 0. The gated FFN ``relu(x Wg^T) * (x Wu^T)`` is exactly LlamaMLP with
``hidden_act="relu"``, so a gated checkpoint loads into plain ``LlamaForCausalLM`` and gives the
same logits. The non-gated variant (``relu(x Wu^T)``, no ``gate_proj``) needs :func:`load_model`.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from twell.nn import SparseGatedMLP, convert_mlps

GATED_KEY = "twell_gated"  # extra LlamaConfig attribute saved in config.json


def llama_config(cfg) -> LlamaConfig:
    """Build the ``LlamaConfig`` of a :class:`train.config.ModelConfig`."""
    kw = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads or cfg.num_heads,
        "hidden_act": "relu",
        "max_position_embeddings": cfg.seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings is not False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": False,
    }
    kw[GATED_KEY] = bool(cfg.gated)
    config = LlamaConfig(**kw)
    # transformers >= 5 keeps RoPE settings in `rope_parameters`; 4.x reads `rope_theta`.
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict):
        config.rope_parameters = {**rope, "rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    else:
        config.rope_theta = float(cfg.rope_theta)
    return config


def _install_ffns(model: nn.Module, gated: bool, impl: str, policy=None) -> list[SparseGatedMLP]:
    """Swap every LlamaMLP for a SparseGatedMLP (gated: sharing weights; else up/down only)."""
    if gated:
        convert_mlps(model, impl, policy=policy)
    else:
        for layer in model.model.layers:
            old = layer.mlp
            new = SparseGatedMLP(old.up_proj.in_features, old.up_proj.out_features,
                                 gated=False, impl=impl, policy=policy)
            new.to(device=old.up_proj.weight.device, dtype=old.up_proj.weight.dtype)
            new.up_proj.weight = old.up_proj.weight
            new.down_proj.weight = old.down_proj.weight
            layer.mlp = new
    return ffn_modules(model)


def ffn_modules(model: nn.Module) -> list[SparseGatedMLP]:
    """The model's SparseGatedMLP modules in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseGatedMLP)]


def build_model(cfg) -> LlamaForCausalLM:
    """A freshly initialised model for a :class:`train.config.ModelConfig` (fp32, on CPU).

    Seed torch before calling for a reproducible init. Returns a ``LlamaForCausalLM`` whose
    ``model.layers[i].mlp`` are :class:`twell.nn.SparseGatedMLP` with ``impl=cfg.ffn_impl`` and
    ``policy=cfg.ffn_policy``.
    """
    model = LlamaForCausalLM(llama_config(cfg))
    _install_ffns(model, cfg.gated, cfg.ffn_impl, cfg.ffn_policy)
    return model


def load_model(checkpoint_dir: str | Path, ffn_impl: str = "torch", **from_pretrained_kw):
    """Load a saved checkpoint (HF layout: config.json + safetensors) with SparseGatedMLP FFNs.

    Args:
        checkpoint_dir: a ``step{N}`` folder written by the trainer (or any ReLU Llama folder).
        ffn_impl: ``torch`` | ``twell`` | ``auto`` (see :class:`twell.nn.SparseGatedMLP`).
        **from_pretrained_kw: passed to ``LlamaForCausalLM.from_pretrained`` (e.g. ``dtype``,
            ``device_map``) for gated models.

    Returns:
        ``LlamaForCausalLM`` in eval mode.

    Raises:
        FileNotFoundError: no config.json in ``checkpoint_dir``.
        ValueError: unknown ``ffn_impl``; weights that do not match the config.
    """
    d = Path(checkpoint_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d}: no config.json; pass a step{{N}} checkpoint folder")
    config = LlamaConfig.from_pretrained(d)
    if getattr(config, GATED_KEY, True):
        model = LlamaForCausalLM.from_pretrained(d, **from_pretrained_kw)
        _install_ffns(model, True, ffn_impl)
    else:  # no gate_proj: stock from_pretrained would invent one; load the tensors ourselves
        model = LlamaForCausalLM(config)
        _install_ffns(model, False, ffn_impl)
        _load_safetensors(model, d)
    return model.eval()


def _load_safetensors(model: nn.Module, d: Path) -> None:
    from safetensors.torch import load_file

    index = d / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.is_file() else ["model.safetensors"])
    state = {}
    for f in files:
        state.update(load_file(str(d / f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise ValueError(f"{d}: weights do not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")


def enable_grad_checkpointing(model, checkpoint_ffn: str = "always") -> None:
    """Recompute each decoder layer in backward, non-reentrant (the L1 side output of every FFN
    keeps its graph). transformers >= 5.2x calls it ``activation_checkpointing_enable``.

    ``checkpoint_ffn`` (``trainer.checkpoint_ffn``): ``always`` recomputes whole layers;
    ``auto`` / ``never`` recompute only the attention half of layers whose FFN trains on the
    sparse path / of every layer (:mod:`train.recompute`).
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    from train.recompute import enable_selective_recompute

    enable_selective_recompute(model, checkpoint_ffn)
