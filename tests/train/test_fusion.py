"""``trainer.compile_norms``: the compiled RMSNorms give the eager model's loss and gradients
(fp32; under checkpointing, selective recomputation included) with one graph for all norms.
On CPU the compile backend is aot_eager (the same captured graphs, no inductor code)."""

import pytest
import torch
from torch._dynamo.utils import counters

from train import fusion
from train.config import ModelConfig
from train.model import build_model, enable_grad_checkpointing, ffn_modules
from train.sparsity import collect_stats, l1_penalty
from twell.nn import FFNPlan


@pytest.fixture(autouse=True)
def cpu_backend(monkeypatch):
    monkeypatch.setattr(fusion, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(fusion, "_compiled", {})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # sparse op: its PyTorch backend
    torch._dynamo.reset()
    counters.clear()


def _grads(compiled, checkpoint):
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                    num_layers=3, num_heads=2, seq_len=16)).train()
    mlps = ffn_modules(model)
    FFNPlan(mlps).pin("ell", [0])  # layer 0 trains on the ELL kernels
    if checkpoint:
        enable_grad_checkpointing(model, checkpoint)
    if compiled:
        assert fusion.compile_norms(model) == 2 * 3 + 1
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss + 0.2 * l1_penalty(collect_stats(mlps))[0]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpoint", [None, "always", "auto"])
def test_compiled_norms_match_eager(checkpoint):
    ref_loss, ref = _grads(False, checkpoint)
    loss, got = _grads(True, checkpoint)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name, g in got.items():
        torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: n)
    assert counters["stats"]["unique_graphs"] == 1  # one graph for the 7 norms


def test_eval_uses_the_eager_forward():
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                    num_layers=2, num_heads=2, seq_len=8)).eval()
    ids = torch.randint(1, 64, (2, 8))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        fusion.compile_norms(model)
        torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=0, atol=0)
    assert not counters["stats"]["unique_graphs"]
