"""``trainer.autocast_cache=false``: under gradient checkpointing autocast's cast cache keeps every
layer's bf16 weight casts alive until the forward ends (and never hits: each weight is cast once
per forward); without it no cast outlives its layer, and the losses are bitwise the same."""

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.train_utils import read_metrics, tiny_config, write_tokens
from train.config import ModelConfig
from train.model import build_model
from train.recompute import enable_grad_checkpointing


class _WeightCasts(TorchDispatchMode):
    """Weak references to every bf16 cast of a parameter made under it."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16
                and isinstance(args[0], torch.nn.Parameter)):
            self.refs.append(weakref.ref(out))
        return out


@pytest.mark.parametrize("cache", [True, False])
def test_cast_cache_holds_every_layer_weight_cast_under_checkpointing(cache):
    torch.manual_seed(0)
    layers = 3
    model = build_model(ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                    num_layers=layers, num_heads=2, seq_len=8)).train()
    enable_grad_checkpointing(model)
    ids = torch.randint(0, 97, (2, 8))
    casts = _WeightCasts()
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
        with casts:
            model.model(input_ids=ids)
        gc.collect()
        alive = sum(r() is not None for r in casts.refs)
    weight_casts = 7 * layers  # q, k, v, o, gate, up, down per layer
    assert len(casts.refs) == weight_casts  # each weight cast exactly once: nothing to reuse
    assert alive == (weight_casts if cache else 0)


def test_trainer_autocast_cache_false_same_losses(tmp_path):
    tok = write_tokens(tmp_path / "t.bin", n_tokens=8_000)
    runs, seen = {}, {}
    for cache in (True, False):
        cfg = tiny_config(tok, **{"trainer.max_steps": 2, "trainer.precision": "bf16",
                                  "trainer.grad_checkpointing": True,
                                  "trainer.autocast_cache": cache})
        from train.trainer import Trainer

        t = Trainer(cfg, tmp_path / str(cache))
        layer = t.acc.unwrap_model(t.model).model.layers[0]

        def record(mod, args, c=cache):
            seen.setdefault(c, torch.is_autocast_cache_enabled())

        layer.register_forward_pre_hook(record)
        try:
            t.train()
        finally:
            t.close()
        runs[cache] = read_metrics(tmp_path / str(cache))
    assert seen == {True: True, False: False}
    assert [r["loss"] for r in runs[False]] == [r["loss"] for r in runs[True]]
