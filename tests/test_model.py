"""The model builder: Llama config facts, stock-Llama compatibility of checkpoints, load_model."""

import subprocess
import sys

import pytest
import torch
from transformers import LlamaForCausalLM

from train.config import FFN_IMPLS, ModelConfig
from train.model import build_model, ffn_modules, load_model
from twell.nn import FFN_IMPLS as NN_IMPLS
from twell.nn import SparseGatedMLP

CFG = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 40, "num_layers": 2, "num_heads": 4,
           "seq_len": 16}


def test_paper_config_facts():
    torch.manual_seed(0)
    model = build_model(ModelConfig(**CFG))
    c = model.config
    assert c.hidden_act == "relu" and c.tie_word_embeddings and c.bos_token_id == 0 == c.eos_token_id
    assert c.rms_norm_eps == 1e-5 and c.initializer_range == 0.02 and c.max_position_embeddings == 16
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(n.endswith("bias") for n, _ in model.named_parameters())
    assert all(isinstance(layer.mlp, SparseGatedMLP) for layer in model.model.layers)
    assert len(ffn_modules(model)) == 2
    # RoPE base 1e5: inv_freq_i = 1e5^(-2i/head_dim), head_dim 8
    inv = model.model.rotary_emb.inv_freq
    ref = 1.0 / (1e5 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    torch.testing.assert_close(inv.double(), ref, rtol=1e-6, atol=0)
    # init std 0.02 on the projections
    w = torch.cat([m.gate_proj.weight.flatten() for m in ffn_modules(model)])
    assert abs(w.std().item() - 0.02) < 0.002


def test_impl_names_in_sync():
    assert FFN_IMPLS == NN_IMPLS


def test_checkpoint_loads_into_stock_llama_with_same_logits(tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**CFG)).eval()
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    stock = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert not any(isinstance(m, SparseGatedMLP) for m in stock.modules())
    with torch.no_grad():
        torch.testing.assert_close(stock(ids).logits, ref, rtol=0, atol=0)
        ours = load_model(tmp_path)
        assert all(isinstance(layer.mlp, SparseGatedMLP) for layer in ours.model.layers)
        torch.testing.assert_close(ours(ids).logits, ref, rtol=0, atol=0)


def test_non_gated_variant_roundtrip(tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**CFG, gated=False)).eval()
    mlp = ffn_modules(model)[0]
    assert not mlp.gated and not hasattr(mlp, "gate_proj")
    assert not any("gate_proj" in n for n, _ in model.named_parameters())
    x = torch.randn(3, 32)
    torch.testing.assert_close(mlp(x), torch.relu(x @ mlp.up_proj.weight.T) @ mlp.down_proj.weight.T)
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert not ffn_modules(loaded)[0].gated
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref, rtol=0, atol=0)


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    build_model(ModelConfig(**CFG)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="ffn impl"):
        load_model(tmp_path, ffn_impl="cuda")


def test_import_twell_imports_neither_train_nor_evals():
    code = ("import sys, twell, twell.nn, twell.stats; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('train', 'evals')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
