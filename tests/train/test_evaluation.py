"""Validation of a ``trainer.compile`` model (train/evaluation.py): its no-grad, eval-mode
forwards run eagerly instead of compiling graphs of their own, and give the loss an uncompiled
trainer gives on the same weights.

Shape legend: none (the tiny model of tests/train_utils.py).
"""

import pytest
import torch

from tests.train_utils import tiny_config, write_tokens
from train import evaluation
from train.trainer import Trainer


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "train.bin", n_tokens=8_000)


def test_validation_of_a_compiled_model_compiles_nothing(tokens, tmp_path, monkeypatch):
    """trainer.compile=true, with a counting backend in place of inductor: a training step
    compiles the model (at least one graph), validation then compiles none (an eval-mode,
    no-grad forward would be a new graph, and its shorter last batch another) and its loss and
    L0 equal those of an uncompiled trainer loaded with the same weights, to fp32 rounding."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compile_ = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, *a, **kw: compile_(self, backend=counting))
    during_validation = []  # graphs compiled inside each validation pass
    totals = evaluation.validation_totals

    def counted_totals(*a, **kw):
        before = len(graphs)
        out = totals(*a, **kw)
        during_validation.append(len(graphs) - before)
        return out

    monkeypatch.setattr(evaluation, "validation_totals", counted_totals)
    over = {"trainer.max_steps": 1, "trainer.val_sequences": 7, "data.val_fraction": 0.1}
    t = Trainer(tiny_config(tokens, **over, **{"trainer.compile": True}), tmp_path / "c")
    t.train()  # one step, then the run's closing validation
    got = t.validate()
    assert len(graphs) >= 1  # the step ran through the compiled model
    assert during_validation == [0, 0]
    ref = Trainer(tiny_config(tokens, **over), tmp_path / "e")
    ref.acc.unwrap_model(ref.model).load_state_dict(t.acc.unwrap_model(t.model).state_dict())
    want = ref.validate()
    assert got["val_sequences"] == want["val_sequences"] == 7
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
    assert got["val_l0"] == pytest.approx(want["val_l0"], rel=1e-6)
    t.close()
    ref.close()
