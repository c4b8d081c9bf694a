"""A tiny llama GGUF written with gguf.GGUFWriter from a saved LlamaForCausalLM (F32 tensors, the
llama.cpp tensor names and q/k permutation that transformers' GGUF loader undoes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import LlamaForCausalLM


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k permutation (the GGUF loader undoes it)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path: Path, hf_dir: Path, tokens: list[str], rope_theta: float,
                    skip: tuple[str, ...] = (), merges: list[str] | None = None) -> Path:
    """An F32 llama GGUF of a saved LlamaForCausalLM, written with gguf.GGUFWriter; the GGUF
    tensor names in ``skip`` (e.g. ``blk.0.ffn_gate.weight``) are left out. ``merges``: the BPE
    merges (``"a b"`` strings) of a byte-level tokenizer, so that transformers' GGUF loader
    rebuilds it (without them only the token list is written)."""
    from gguf import GGUFWriter

    m = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = m.config
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-test")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    if merges is not None:
        w.add_token_merges(merges)
    sd = {k: v.numpy() for k, v in m.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj":
             "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(c.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = _permute(t, c.num_attention_heads)
            elif gg == "attn_k":
                t = _permute(t, c.num_key_value_heads)
            if f"blk.{i}.{gg}.weight" not in skip:
                w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
