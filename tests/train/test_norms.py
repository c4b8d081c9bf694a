"""Memory-lean RMSNorm (``trainer.lean_norms``, train/norms.py) against transformers'
``LlamaRMSNorm``: outputs and gradients bitwise equal in fp32 (odd shapes, zero rows, NaN),
fewer saved tensors (no fp32 normalised copy; one bf16 copy for q/k/v under autocast), bf16
within rounding, the trainer's losses unchanged."""

import types

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tests.train_utils import train_metrics_by_value
from train.config import ConfigError, ModelConfig, TrainerConfig
from train.model import build_model, ffn_modules
from train.norms import _lean_forward, lean_norms, lean_norms_enabled
from train.sparsity import collect_stats, l1_penalty


def _pair(d, seed=0):
    torch.manual_seed(seed)
    ref = LlamaRMSNorm(d, eps=1e-5)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    lean = LlamaRMSNorm(d, eps=1e-5)
    lean.load_state_dict(ref.state_dict())
    lean.forward = types.MethodType(_lean_forward, lean)
    return ref, lean


def _fwd_bwd(norm, x0, g_y, *, autocast=False):
    """y, dx, dw of ``norm``; x also feeds a residual (0.3 x), as in the decoder."""
    x = x0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = norm(x)
    ((y.float() * g_y).sum() + (0.3 * x).sum()).backward()
    return y.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize("shape", [(3, 5, 24), (1, 1, 7), (2, 64, 2048)],
                         ids=["odd", "one-row", "bench-width"])
def test_fp32_output_and_gradients_are_bitwise_the_stock_ones(shape):
    ref, lean = _pair(shape[-1])
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(shape, generator=g) * 3
    x0[0, 0] = 0.0  # an all-zero row: rsqrt(eps)
    g_y = torch.randn(shape, generator=g)
    for a, b, name in zip(_fwd_bwd(ref, x0, g_y), _fwd_bwd(lean, x0, g_y), ("y", "dx", "dw")):
        assert torch.equal(a, b), (name, (a - b).abs().max().item())


def test_nan_propagates_like_the_stock_norm():
    ref, lean = _pair(6)
    x0 = torch.randn(2, 3, 6)
    x0[1, 2, 4] = float("nan")
    g_y = torch.ones(2, 3, 6)
    for a, b in zip(_fwd_bwd(ref, x0, g_y), _fwd_bwd(lean, x0, g_y)):
        assert torch.equal(a.isnan(), b.isnan()) and a.isnan().any()
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def _saved(fn):
    """Tensors saved for backward while ``fn()`` runs: (shape, dtype, data_ptr) each."""
    out = []

    def pack(t):
        out.append((tuple(t.shape), t.dtype, t.data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return out


def test_the_normalised_rows_are_not_kept():
    ref, lean = _pair(16)
    x = torch.randn(4, 16, requires_grad=True)
    full = [s for s in _saved(lambda: ref(x)) if s[0] == (4, 16)]
    kept = [s for s in _saved(lambda: lean(x)) if s[0] == (4, 16)]
    assert {s[2] for s in kept} == {x.data_ptr()}  # only the input itself
    assert len({s[2] for s in full} - {x.data_ptr()}) == 1  # stock: the normalised fp32 copy


def test_eval_and_no_grad_take_the_stock_forward():
    ref, lean = _pair(16)
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(lean(x), ref(x))
    lean.eval()
    assert lean(x.requires_grad_()).grad_fn.__class__.__name__ == "MulBackward0"


def _model(lean, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=2, seq_len=16)
    model = build_model(cfg).train()
    if lean:
        assert lean_norms(model) == 2 * 2 + 1
    return model


def _model_step(lean, autocast):
    model = _model(lean)
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(2))
    saved = []

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ce = model(input_ids=ids, labels=ids).loss
            l1, _ = l1_penalty(collect_stats(ffn_modules(model)))
        saved.append(ce + 0.1 * l1)

    shared = _saved(run)
    saved[0].backward()
    return saved[0].detach(), {n: p.grad for n, p in model.named_parameters()}, shared


def test_autocast_shares_one_bf16_copy_of_each_norm_output():
    """bf16 (N, D) tensors kept for backward: the stock norms' consumers each keep their own
    cast (q, k, v; gate, up of the PyTorch FFN), the lean norm's share one."""
    _, _, stock = _model_step(False, True)
    _, _, lean = _model_step(True, True)
    n_d = (3 * 16, 32)
    copies = [len({s[2] for s in saved if s[1] == torch.bfloat16 and s[0] in (n_d, (3, 16, 32))})
              for saved in (stock, lean)]
    # per layer 2 fewer after input_layernorm (q/k/v) and 1 after post_attention_layernorm
    assert copies[0] - copies[1] == 2 * (2 + 1), copies


def test_autocast_gradients_within_bf16_rounding():
    ref_loss, ref, _ = _model_step(False, True)
    loss, got, _ = _model_step(True, True)
    assert torch.equal(loss, ref_loss)  # the forward is the same, casts included
    for name, g in got.items():  # consumers' bf16 gradients summed in bf16, not fp32
        torch.testing.assert_close(g, ref[name], rtol=2e-2, atol=2e-4, msg=name)
    ref_loss, ref, _ = _model_step(False, False)
    loss, got, _ = _model_step(True, False)  # fp32: the whole model bitwise
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g, ref[n]) for n, g in got.items())


@pytest.mark.parametrize("checkpoint", [None, "never"], ids=["no-recompute", "attention"])
def test_trainer_losses_are_unchanged(tmp_path, checkpoint):
    over = {} if checkpoint is None else {"trainer.grad_checkpointing": True,
                                          "trainer.checkpoint_ffn": checkpoint}
    runs = train_metrics_by_value(tmp_path, "trainer.lean_norms", (False, True), **over)
    for a, b in zip(runs[True], runs[False], strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])


def test_default_and_conflicts():
    def on(setting=None, device_type="cuda", precision="bf16", compile=False,
           compile_norms=False):
        return lean_norms_enabled(setting, device_type=device_type, precision=precision,
                                  compile=compile, compile_norms=compile_norms)

    assert on() and not on(device_type="cpu") and not on(precision="fp32")
    assert not on(compile=True) and not on(compile_norms=True) and on(True, device_type="cpu")
    with pytest.raises(ConfigError, match="trainer.lean_norms=true and trainer.compile_norms"):
        TrainerConfig(lean_norms=True, compile_norms=True)
    with pytest.raises(ValueError, match="model.norm"):
        lean_norms(torch.nn.Linear(2, 2))
