"""The dense PyTorch FFN path against transformers' LlamaMLP and hand-computed stats."""

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from twell.nn import SparseGatedMLP


def test_matches_llama_mlp_and_stats():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=40, num_attention_heads=2, hidden_act="relu")
    ref = LlamaMLP(cfg).double()
    ours = SparseGatedMLP(16, 40).double()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    y = ours(x)
    torch.testing.assert_close(y, ref(x), rtol=0, atol=1e-12)
    g = torch.relu(x @ ref.gate_proj.weight.T)
    h = g * (x @ ref.up_proj.weight.T)
    st = ours.last_stats
    assert st.n_tokens == 10
    torch.testing.assert_close(st.l1.double(), h.abs().sum(-1).mean(), rtol=1e-6, atol=0)
    act = (g > 0).reshape(10, 40)
    assert st.nnz_sum.item() == act.sum().item()
    assert st.nnz_max.item() == act.sum(-1).max().item()
    assert torch.equal(st.active_counts, act.sum(0).int())


def test_rejects_unknown_impl():
    import pytest

    with pytest.raises(ValueError, match="ffn impl"):
        SparseGatedMLP(8, 16, impl="cuda")


def test_rejects_bad_sizes():
    import pytest

    for args, name in (((8.0, 16), "hidden_size"), ((8, "16"), "intermediate_size"),
                       ((True, 16), "hidden_size"), ((8, 0), "intermediate_size")):
        with pytest.raises(ValueError, match=rf"^SparseGatedMLP: {name} must be an int >= 1; got"):
            SparseGatedMLP(*args)


def test_names_x_when_its_last_dim_is_wrong():
    """An x whose last dimension is not hidden_size is refused naming x and hidden_size, on
    every impl and with or without gradients (the ``twell`` training path blamed the weights)."""
    import pytest

    for impl in ("torch", "twell"):
        mlp = SparseGatedMLP(8, 16, impl=impl)
        for x in (torch.randn(16, 9), torch.randn(2, 3, 9), torch.tensor(1.0)):
            for grad in (True, False):
                with torch.set_grad_enabled(grad), pytest.raises(
                        ValueError, match=r"^SparseGatedMLP: x's last dimension must be "
                                          r"hidden_size = 8; got x of shape"):
                    mlp(x)


def test_convert_llama_keeps_logits_and_keys():
    from transformers import LlamaForCausalLM

    from twell.nn import convert_mlps

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_hidden_layers=2, vocab_size=100, hidden_act="relu")
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 100, (2, 7))
    keys = set(model.state_dict())
    with torch.no_grad():
        ref = model(ids).logits
    assert convert_mlps(model) == 2
    assert isinstance(model.model.layers[0].mlp, SparseGatedMLP)
    assert set(model.state_dict()) == keys
    with torch.no_grad():
        out = model(ids).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


def test_convert_refuses_silu():
    import pytest
    from transformers import LlamaForCausalLM

    from twell.nn import convert_mlps

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_hidden_layers=1, vocab_size=100, hidden_act="silu")
    with pytest.raises(ValueError, match="not ReLU"):
        convert_mlps(LlamaForCausalLM(cfg))


def test_readme_snippet_runs(tmp_path, monkeypatch):
    # README.md's "Sparse FFNs" snippet as written, with a saved tiny ReLU Llama as its checkpoint
    import re
    from pathlib import Path

    from transformers import LlamaForCausalLM

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the PyTorch backend of the ops
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"## Sparse FFNs.*?```python\n(.*?)```", readme, re.DOTALL).group(1)
    assert '"runs/<run>/checkpoints/step40"' in code
    ckpt = tmp_path / "ckpt"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=40,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 hidden_act="relu")).save_pretrained(ckpt)
    ns = {}
    exec(code.replace('"runs/<run>/checkpoints/step40"', repr(str(ckpt))), ns)  # noqa: S102 (the README's own code)
    assert isinstance(ns["model"].model.layers[0].mlp, SparseGatedMLP)
    assert all(isinstance(layer.mlp, SparseGatedMLP) for layer in ns["llama"].model.layers)
    assert ns["y"].shape == (2, 16, 2048) and ns["mlp"].last_stats.n_tokens == 32
