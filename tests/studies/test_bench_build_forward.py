"""The whole-model benchmark's forward models (``studies.bench.core.build_forward``): our impls
get the trainer's Liger-Kernel setup with the norms through ``rms_norm_cast`` and the residual
joins (``train.residual_join``), through the function ``train.setup.prepare_model`` installs
them with (``train.setup.use_fused_ops``); the stock baselines get neither. On the CPU (no
Liger-Kernel there: its switch is faked on, the run's device named cuda, and the installs
recorded, not run)."""

from types import SimpleNamespace

import pytest
import torch

from studies.bench import core
from train import setup
from train.config import ModelConfig
from train.model import build_model

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                  seq_len=16)


def _run(device="cuda", **trainer):
    settings = {"norm_out_bf16": None, "fused_norm_cast": None} | trainer
    return SimpleNamespace(device=torch.device(device), bf16=True,
                           bm=SimpleNamespace(model_cfg=CFG, weights={}),
                           cfg1=SimpleNamespace(ffn=None, trainer=SimpleNamespace(**settings)))


@pytest.fixture
def installs(monkeypatch):
    """What build_forward installs, by call; models built tiny, Liger-Kernel's switch on."""
    calls = []
    monkeypatch.setattr(core, "liger_enabled", lambda *a, **kw: True)
    monkeypatch.setattr(core, "build_ours", lambda *a, **kw: build_model(CFG))
    monkeypatch.setattr(core, "build_hf", lambda *a, **kw: build_model(CFG))
    monkeypatch.setattr(setup, "use_liger", lambda model, **kw: calls.append(("liger", kw)))
    monkeypatch.setattr(setup, "use_fused_joins", lambda model: calls.append(("joins", {})))
    return calls


@pytest.mark.parametrize("impl", ["torch", "twell", "auto"])
def test_our_impls_join_the_residual_adds(impl, installs):
    stack = core.build_forward(_run(), impl)
    assert not stack.training and type(stack).__name__ == "LlamaModel"
    assert installs == [("liger", {"fused_linear_ce": False, "norm_out_autocast": True,
                                   "fused_norm_cast": True}), ("joins", {})]


@pytest.mark.parametrize("trainer", [{"fused_norm_cast": False}, {"norm_out_bf16": False}])
def test_the_trainers_switches_turn_the_joins_off(trainer, installs):
    core.build_forward(_run(**trainer), "auto")
    assert [name for name, _ in installs] == ["liger"] and not installs[0][1]["fused_norm_cast"]


def test_no_joins_off_cuda_as_in_training(installs):
    # the trainer joins only where rms_norm_cast runs (CUDA); the bench installs the same
    core.build_forward(_run(device="cpu"), "auto")
    assert [name for name, _ in installs] == ["liger"] and installs[0][1]["fused_norm_cast"]


@pytest.mark.parametrize("impl", ["hf", "liger", "compile"])
def test_baselines_stay_stock(impl, installs):
    core.build_forward(_run(), impl)
    assert installs == []
