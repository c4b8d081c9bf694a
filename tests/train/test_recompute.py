"""Selective recomputation (``trainer.checkpoint_ffn``): the loss and every parameter gradient
equal those of full checkpointing and of no checkpointing, for twell / auto / torch layers mixed
in one model, fp32 and bf16 autocast; layers on the ``ell`` path run their FFN once per step."""

import gc
import weakref

import pytest
import torch

from tests.train_utils import tiny_config, write_tokens
from train.config import CHECKPOINT_FFN_MODES, ConfigError, ModelConfig
from train.memory import release_failed_step
from train.model import build_model, ffn_modules
from train.recompute import RECOMPUTE_MODES as PLANNER_MODES
from train.recompute import _recast_weights, enable_grad_checkpointing, set_recompute
from train.sparsity import collect_stats, l1_penalty
from twell.nn import FFNPlan, trains_ell

# per layer, the training path: ELL (as impl=twell, or auto on its ELL path) twice; dense mode
# (auto's dense path); PyTorch
MIXED = ["ell", "ell", "dense", "torch"]


def _model(checkpoint):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                      num_heads=2, seq_len=16)
    model = build_model(cfg).train()  # impl torch (inference dense); training paths pinned
    mlps = ffn_modules(model)
    plan = FFNPlan(mlps)
    for k, path in enumerate(MIXED):
        plan.pin(path, [k])
    for mlp in mlps:
        with torch.no_grad():  # 24 live units of 64: ~12 active per token around the ELL
            mlp.gate_proj.weight[24:] = 0  # capacity (16), so light and heavy rows both occur
    if checkpoint is not None:
        enable_grad_checkpointing(model, checkpoint)
    return model, mlps, plan


def _step(checkpoint, autocast):
    """Loss CE + 0.3 L1 and all gradients of one micro-step; FFN forward calls per layer."""
    model, mlps, _ = _model(checkpoint)
    return _step_of(model, mlps, autocast)


def _step_of(model, mlps, autocast):
    calls = [0] * len(mlps)
    hooks = [mlp.register_forward_pre_hook(  # counts every FFN forward (one gate GEMM each)
        lambda mod, args, i=i: calls.__setitem__(i, calls[i] + 1)) for i, mlp in enumerate(mlps)]
    ids = torch.randint(1, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ce = model(input_ids=ids, labels=ids).loss
        l1, _ = l1_penalty(collect_stats(mlps))
        loss = ce + 0.3 * l1
    loss.backward()
    for h in hooks:
        h.remove()
    heavy = [float(m.last_stats.heavy_rows) for m in mlps[:2]]  # the ELL layers
    assert max(heavy) > 0 and max(heavy) < ids.numel() / 2, heavy  # light and heavy ELL rows
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, calls


@pytest.fixture
def torch_backend(monkeypatch):
    """The sparse training op's PyTorch backend (the same math as its Triton kernels, which
    tests/ops/test_ffn_train.py checks): what is tested here is the recomputation, fast."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_selective_recompute_matches_full_and_no_checkpointing(autocast, torch_backend):
    ref_loss, ref_grads, ref_calls = _step(None, autocast)
    assert ref_calls == [1, 1, 1, 1]
    expected_calls = {"always": [2, 2, 2, 2], "auto": [1, 1, 2, 2], "never": [1, 1, 1, 1]}
    for mode in CHECKPOINT_FFN_MODES:
        loss, grads, calls = _step(mode, autocast)
        assert calls == expected_calls[mode], (mode, calls)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            assert g is not None and torch.isfinite(g).all(), (mode, name)
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-6, atol=1e-9,
                                       msg=lambda m, n=name, k=mode: f"{k} {n}: {m}")
        assert any(g.abs().max() > 0 for n, g in grads.items() if "gate_proj" in n)


def test_set_recompute_switches_modes_on_one_model(torch_backend):
    """The memory planner probes several modes on one model: each switch takes effect (FFN calls
    per step) and gives the same loss and gradients as no checkpointing."""
    ref_loss, ref_grads, _ = _step(None, False)
    model, mlps, _ = _model(None)
    expected = {"none": [1, 1, 1, 1], "attention": [1, 1, 1, 1], "attention_ell": [1, 1, 2, 2],
                "full": [2, 2, 2, 2]}
    assert set(expected) == set(PLANNER_MODES)
    for mode in ("attention", "full", "none", "attention_ell", "full", "attention", "none"):
        set_recompute(model, mode)
        assert all(layer.gradient_checkpointing == (mode != "none") for layer in model.model.layers)
        loss, grads, calls = _step_of(model, mlps, False)
        assert calls == expected[mode], (mode, calls)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-6, atol=1e-9,
                                       msg=lambda m, n=name, k=mode: f"{k} {n}: {m}")
    with pytest.raises(ValueError, match="recompute must be one of"):
        set_recompute(model, "some")


def test_trains_ell_follows_the_plan():
    _, mlps, plan = _model(None)
    assert [trains_ell(m) for m in mlps] == [True, True, False, False]
    plan.pin("ell", [2])  # auto switched this layer to the ELL path between steps
    assert trains_ell(mlps[2]) and plan.trains_ell(2)
    plan.pin("dense", [0])
    assert [plan.trains_ell(k) for k in range(4)] == [False, True, True, False]


def test_recast_weights_recasts_in_backward():
    """The bf16 cast of a weight is not kept: backward recasts the fp32 parameter (so an
    in-place change in between is caught rather than silently mixing two weights)."""
    for op in ("linear", "mul"):  # linear saves the cast's transpose, mul the cast itself
        w = torch.randn(3, 4, requires_grad=True)
        x = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
        with _recast_weights([w]):
            w16 = w.to(torch.bfloat16)
            y = torch.nn.functional.linear(x, w16) if op == "linear" else x * w16
        y.float().sum().backward(retain_graph=True)
        ones = torch.ones_like(y)
        ref = ones @ w16.detach() if op == "linear" else w16.detach()
        torch.testing.assert_close(x.grad, ref, rtol=0, atol=0)
        with torch.no_grad():
            w.add_(1.0)
        with pytest.raises(RuntimeError, match="modified in place"):
            y.float().sum().backward()


def test_checkpoint_ffn_is_validated(tmp_path):
    tok = write_tokens(tmp_path / "t.bin", n_tokens=2000)
    with pytest.raises(ConfigError, match="trainer.checkpoint_ffn='sometimes' is unknown"):
        tiny_config(tok, **{"trainer.checkpoint_ffn": "sometimes"})
    with pytest.raises(ConfigError, match="checkpoint_ffn=never needs trainer.grad_checkpointing"):
        tiny_config(tok, **{"trainer.checkpoint_ffn": "never"})
    # auto without checkpointing has nothing to select (trainer=gpu sets it; a run that turns
    # checkpointing off must still start)
    assert tiny_config(tok, **{"trainer.checkpoint_ffn": "auto"}).trainer.checkpoint_ffn == "auto"
    cfg = tiny_config(tok, **{"trainer.grad_checkpointing": True})
    cfg.trainer.checkpoint_ffn, cfg.trainer.compile = "always", True
    cfg.trainer.__post_init__()  # compile alone is fine
    for mode in ("auto", "never"):  # saved-tensor hooks are eager-only
        cfg.trainer.checkpoint_ffn = mode
        with pytest.raises(ConfigError) as e:
            cfg.trainer.__post_init__()
        msg = str(e.value)
        assert f"does not support trainer.checkpoint_ffn={mode} (" in msg, msg
        assert "add trainer.checkpoint_ffn=always, or drop trainer.compile" in msg, msg


def test_trainer_losses_equal_with_checkpoint_ffn_auto(tmp_path, torch_backend):
    """Whole trainer, ffn.impl=twell (no-sync backup path), L1 on: the same losses and gradient
    norms per step with checkpoint_ffn=auto as with always (fp32, same seed)."""
    from tests.train_utils import read_metrics
    from train.trainer import Trainer

    tok = write_tokens(tmp_path / "t.bin", n_tokens=8_000)
    runs = {}
    for mode in ("always", "auto"):
        cfg = tiny_config(tok, **{"trainer.max_steps": 3, "sparsity.l1_coeff": 0.5,
                                  "ffn.impl": "twell", "trainer.grad_checkpointing": True,
                                  "trainer.checkpoint_ffn": mode})
        t = Trainer(cfg, tmp_path / mode)
        try:
            t.train()
        finally:
            t.close()
        runs[mode] = read_metrics(tmp_path / mode)
    assert len(runs["auto"]) == 3
    for a, b in zip(runs["auto"], runs["always"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5, abs=0)
        assert a["l0_mean"] == b["l0_mean"]


def test_eval_mode_runs_transformers_forward():
    """Inference is untouched: eval / no-grad forward gives the unpatched model's logits."""
    ref, _, _ = _model(None)
    got, mlps, _ = _model("never")  # FFNs of impl=torch: dense PyTorch inference in both
    assert {m.impl for m in [*ffn_modules(ref), *mlps]} == {"torch"}
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(got.eval()(input_ids=ids).logits,
                                   ref.eval()(input_ids=ids).logits, rtol=0, atol=0)


def _watch_outputs(model) -> list:
    """A list that each decoder layer's forward appends a weak reference to its output to."""
    outputs = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    return outputs


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_a_graph_without_backward_is_freed(autocast, torch_backend):
    """A training forward whose backward never runs (a loss check; an attempt that ran out of
    memory) is freed with its loss: the FFN outside the checkpoint saves through the recast
    hooks, and an op saving its own output (ReLU) must not hold its own node there (a cycle in
    C++, which no collection frees, kept the model's weights and activations)."""
    model, mlps, plan = _model("never")
    ids = torch.randint(1, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    outputs = _watch_outputs(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(input_ids=ids, labels=ids).loss.item()
    release_failed_step(torch.device("cpu"), mlps=mlps)  # the L1 side output's graph
    assert len(outputs) == len(MIXED) and all(r() is None for r in outputs)
    params = [weakref.ref(p) for p in model.parameters()]
    del model, mlps, plan
    gc.collect()
    assert sum(r() is not None for r in params) == 0


@pytest.mark.parametrize("hooks", ["recast", "lean"])
def test_a_saved_tensor_modified_in_place_raises_as_autograd_does(hooks):
    """Autograd checks the version of what it saves itself, not of what saved-tensor hooks
    keep: the hooks check it (the same error as without them), instead of a wrong gradient."""
    from train.lean_saves import _LayerSaves
    from train.recompute import _recast_weights

    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    ctx = _recast_weights([w]) if hooks == "recast" else _LayerSaves(False, [])
    with ctx:
        y = (x @ w).exp()  # exp saves its output
    with torch.no_grad():
        y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    with ctx:  # unmodified: the gradients of the hook-free graph, exactly
        y2 = (x @ w).exp()
    gx, gw = torch.autograd.grad(y2.sum(), (x, w))
    rx, rw = torch.autograd.grad((x @ w).exp().sum(), (x, w))
    assert torch.equal(gx, rx) and torch.equal(gw, rw)
