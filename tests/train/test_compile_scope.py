"""``trainer.compile_scope`` (train/setup.py ``compile_model``): ``layers`` compiles each decoder
layer and the loss apart. It trains with the eager run's losses (dense and sparse FFN paths), its
layers share one compiled graph however many there are (none recompiles per layer or falls back
to eager), and its checkpoints hold the stock parameter names, as the whole-model scope's do.

Shape legend: none (the tiny model of tests/train_utils.py, fp32 on the CPU).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.train_utils import one_line, read_metrics, tiny_config, train_run, write_tokens
from train.config import ConfigError, TrainerConfig

STEPS, MICRO = 3, 2  # optimizer steps of each run; micro-batches a step (global 8, micro 4)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "train.bin", n_tokens=8_000)


def _cfg(tokens, scope=None, layers=2, **over):
    """The tiny config of ``layers`` decoder layers (L1 on, so the FFN statistics feed the
    loss), compiled at ``scope`` (None: eager)."""
    if scope is not None:
        over = {"trainer.compile": True, "trainer.compile_scope": scope, **over}
    return tiny_config(tokens, **{"model.num_layers": layers, "trainer.max_steps": STEPS,
                                  "sparsity.l1_coeff": 0.05, **over})


def _assert_same_losses(got: list[dict], want: list[dict], rel: float = 1e-5) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, b in zip(got, want, strict=True):
        for key in ("loss", "ce", "l1", "l0_mean", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=rel), (a["step"], key)


def test_compile_scope_is_checked():
    with pytest.raises(ConfigError) as e:
        TrainerConfig(compile=True, compile_scope="layer")
    assert one_line(e) == "trainer.compile_scope='layer' is unknown; use one of model, layers."
    TrainerConfig(compile_scope="layers")  # no effect without trainer.compile: not refused


@pytest.mark.parametrize("impl", ["torch", "twell"])
def test_layers_scope_trains_with_the_eager_losses(tokens, tmp_path, monkeypatch, impl):
    """Inductor on 3 layers, dense (torch) and sparse (twell: the ELL training op) FFNs: the
    per-step loss, CE, L1, L0 and gradient norm of the eager run, to fp32 rounding."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the sparse op's PyTorch version
    eager = read_metrics(train_run(_cfg(tokens, layers=3, **{"ffn.impl": impl}),
                                   tmp_path / "eager").run_dir)
    t = train_run(_cfg(tokens, "layers", layers=3, **{"ffn.impl": impl}), tmp_path / "layers")
    layers = t.acc.unwrap_model(t.model).model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    _assert_same_losses(read_metrics(t.run_dir), eager)


def _count_graphs(tokens, run_dir, layers: int, impl: str) -> list[int]:
    """Train ``layers`` layers at compile_scope=layers with a backend that counts the graphs
    dynamo makes and their calls; returns each graph's number of calls."""
    calls: list[int] = []

    def counting(gm, example_inputs):
        i = len(calls)
        calls.append(0)

        def run(*args):
            calls[i] += 1
            return gm.forward(*args)

        return run

    compile_ = torch.compile
    torch._dynamo.reset()  # nothing compiled by an earlier run is reused
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "compile", lambda fn=None, **kw: compile_(fn, backend=counting))
            train_run(_cfg(tokens, "layers", layers, **{"ffn.impl": impl}), run_dir)
    finally:
        torch._dynamo.reset()
    return calls


@pytest.mark.parametrize("impl", ["torch", "twell"])
def test_layers_share_one_graph_at_any_depth(tokens, tmp_path, monkeypatch, impl):
    """2 and 10 layers (more than dynamo's recompile limit of 8) compile the same graphs: no
    layer recompiles for its own attributes or falls back to eager. Dense FFNs: one graph of
    the layer, called by every layer in every forward, and one of the loss."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the sparse op's PyTorch version
    assert torch._dynamo.config.recompile_limit < 10
    two = _count_graphs(tokens, tmp_path / "2", 2, impl)
    ten = _count_graphs(tokens, tmp_path / "10", 10, impl)
    assert len(two) == len(ten) >= 2
    if impl == "torch":
        forwards = STEPS * MICRO
        assert sorted(two) == [forwards, 2 * forwards]
        assert sorted(ten) == [forwards, 10 * forwards]


@pytest.mark.parametrize("scope", ["model", "layers"])
def test_compiled_checkpoints_hold_stock_names_and_resume(tokens, tmp_path, scope):
    """A compiled run saves the eager run's parameter names (no ``_orig_mod.``), and a run
    resumed from its step-2 checkpoint at the other scope (a resume may change it) finishes
    with the eager run's losses."""
    over = {"trainer.save_every": 2}
    eager = train_run(_cfg(tokens, **over), tmp_path / "eager")
    train_run(_cfg(tokens, scope, **over), tmp_path / "c", stop_at_step=2)
    saved = tmp_path / "c" / "checkpoints" / "step2" / "model.safetensors"
    names = set(load_file(str(saved)))
    assert names == set(load_file(str(eager.run_dir / "checkpoints/step2/model.safetensors")))
    assert not any("_orig_mod" in n for n in names)
    other = "model" if scope == "layers" else "layers"
    t = train_run(_cfg(tokens, other, **over), tmp_path / "c")  # resumes at step 3
    assert t.step == STEPS
    _assert_same_losses(read_metrics(t.run_dir), read_metrics(eager.run_dir))
