"""The model: stock transformers ``LlamaForCausalLM`` (ReLU) whose FFNs are ``SparseGatedMLP``.

Source: arXiv 2603.23198, the model and training recipe ("Transformer++"): hidden 2048, FFN 5632,
32 heads, no GQA, RMSNorm eps 1e-5, no biases, init std 0.02, tied embeddings, RoPE theta 1e5,
bos = eos = 0. The gated FFN ``relu(x Wg^T) * (x Wu^T)`` is exactly LlamaMLP with
``hidden_act="relu"``, so a gated checkpoint loads into plain ``LlamaForCausalLM`` and gives the
same logits. The non-gated variant (``relu(x Wu^T)``, no ``gate_proj``) needs :func:`load_model`.
"""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

from twell.hf import (  # noqa: F401 (re-exported: train.model.load_model etc.)
    GATED_KEY,
    ffn_modules,
    install_ffns,
    load_model,
)


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


def build_model(cfg, ffn=None) -> LlamaForCausalLM:
    """A freshly initialised model for a :class:`train.config.ModelConfig` (fp32, on CPU).

    Seed torch before calling for a reproducible init. Returns a ``LlamaForCausalLM`` whose
    ``model.layers[i].mlp`` are :class:`twell.nn.SparseGatedMLP` with ``impl=ffn.impl`` and
    ``policy=ffn.policy`` (``ffn``: a :class:`train.config.FFNConfig`; None = its defaults).
    """
    model = LlamaForCausalLM(llama_config(cfg))
    if ffn is None:  # FFNConfig's defaults: dense PyTorch, the default policy
        install_ffns(model, cfg.gated, "torch")
    else:
        install_ffns(model, cfg.gated, ffn.impl, ffn.policy)
    return model
