"""Is stage 1 reproducible? Train the bench model's recipe twice from the same seed and compare
the two runs bit for bit: the training L0 of every step and a digest of the final weights.

The benchmark's headline (best sparse / best dense) depends on the bench model's sparsity, so a
second fresh benchmark must time the same model. ``scripts/bench_model.py
--deterministic`` trains stage 1 with ``trainer.deterministic=true``; this check says whether that
holds on the machine at hand (an op without a deterministic kernel stops the run with one line
instead) and, as a control, whether two runs without it differ there.
"""

from __future__ import annotations

import hashlib
import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from studies.bench.recipe import Recipe, stage1_overrides
from studies.bench.source import SettleRule, train_bench_model


@dataclass(frozen=True)
class RunPrint:
    """What one training run left, for a bitwise comparison.

    Attributes:
        l0: the training L0 of every step (``trainer.log_every=1``), as Python floats.
        digest: SHA-256 (hex) of the final weights (name, dtype, shape and bytes of every
            tensor of the state dict, in name order).
    """

    l0: tuple[float, ...]
    digest: str


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of a state dict: each tensor's name, dtype, shape and raw bytes, in name
    order, so any changed bit of any weight changes it."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def first_difference(a: RunPrint, b: RunPrint) -> str | None:
    """None when the runs are bitwise the same; else one line naming the first step whose L0
    differs (or, with equal L0s, the weights)."""
    for i, (x, y) in enumerate(zip(a.l0, b.l0)):
        same = x == y or (math.isnan(x) and math.isnan(y))
        if not same:
            return f"training L0 differs first at step {i + 1}: {x!r} vs {y!r}"
    if len(a.l0) != len(b.l0):
        return f"the runs logged {len(a.l0)} and {len(b.l0)} steps"
    if a.digest != b.digest:
        return "equal L0 at every step, but the final weights differ"
    return None


def train_once(size: str, recipe: Recipe, config: list[str], device: torch.device,
               smoke_tokens: Path | None = None) -> RunPrint:
    """One stage-1 run of ``recipe`` (its ``steps`` steps, L0 logged every step, no time box)."""
    from train.config import compose
    from train.data import build_datamodule

    recipe = replace(recipe, log_every=1)
    cfg = compose(stage1_overrides(size, recipe, config, smoke_tokens))
    data = build_datamodule(cfg.data, seq_len=cfg.model.seq_len, micro_batch=recipe.micro_batch,
                            seed=cfg.trainer.seed)
    with tempfile.TemporaryDirectory(prefix="twell_determinism_") as work:
        bm = train_bench_model(cfg, data, Path(work) / "run", device, size=size,
                               rule=SettleRule(), budget_s=math.inf)
    return RunPrint(tuple(float(v) for _, v in bm.history), weights_digest(bm.weights))
