"""The bench model: trained in-process (the stage-1 recipe, optionally until its sparsity
settles) or loaded from a trainer checkpoint (e.g. the scaling study's ``checkpoints/step200``),
then profiled on held-out blocks (the L0 every row names) and checked against plain
transformers (logits, losses).

Settling (:func:`l0_settled`): the training L0 (mean active FFN units per token, from the
trainer's metric lines) moved by less than ``tolerance`` relative over the last
``window_steps`` optimizer steps, time-boxed by the caller's budget. A stated L0 is the
recipe's (``Recipe.target_l0``: the trainer's ``sparsity.schedule=target_l0`` holds it).

Shape legend: N blocks, T sequence length.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from studies.bench.recipe import SMOKE_SIZE
from studies.bench.steps import build_hf, build_ours, cpu_weights, eval_loss, free_memory, log


@dataclass
class BenchModel:
    """The weights every configuration is timed with, and where they came from.

    Attributes:
        size: the model config name (``configs/model/<size>.yaml``) or ``smoke``.
        model_cfg: its :class:`train.config.ModelConfig` (stage 1's).
        weights: fp32 CPU state dict (page-locked on CUDA machines).
        plan_state: the trained :meth:`twell.nn.plan.FFNPlan.state_dict` (auto's per-layer paths
            and dense-backup capacities), or None (a checkpoint without one).
        source: one line: trained in-process (steps, why it stopped) or the checkpoint path.
        steps: optimizer steps the model was trained for.
        history: (step, training L0) of each metric line.
        ffn_cfg: stage 1's :class:`train.config.FFNConfig` (its ``policy`` every build of these
            weights keeps); None = the defaults.
    """

    size: str
    model_cfg: object
    weights: dict
    plan_state: dict | None
    source: str
    steps: int | None
    history: list[tuple[int, float]] = field(default_factory=list)
    ffn_cfg: object = None


@dataclass(frozen=True)
class SettleRule:
    """When in-process training stops before its last step.

    Attributes:
        until_settled: stop once :func:`l0_settled` holds.
        window_steps, tolerance: :func:`l0_settled`'s window and relative tolerance.
    """

    until_settled: bool = False
    window_steps: int = 50
    tolerance: float = 0.05

    def stop(self, history: list[tuple[int, float]]) -> str | None:
        """Why training should stop now (``"settled ..."``), or None."""
        if not history:
            return None
        step, l0 = history[-1]
        if self.until_settled and l0_settled(history, self.window_steps, self.tolerance):
            return (f"L0 settled at step {step} (moved < {100 * self.tolerance:g} % over "
                    f"{self.window_steps} steps; L0 {l0:.1f})")
        return None


def l0_settled(history: list[tuple[int, float]], window_steps: int = 50,
               tolerance: float = 0.05) -> bool:
    """Has the L0 moved by less than ``tolerance`` (relative) over the last ``window_steps``?

    Args:
        history: (step, L0) in step order (the metric lines of a run).
        window_steps: the window, in optimizer steps.
        tolerance: relative change allowed between the last value and the latest one at least
            ``window_steps`` steps before it.

    Returns:
        False while the history is shorter than the window or either value is not finite.
    """
    if not history:
        return False
    step, l0 = history[-1]
    then = [v for s, v in history if s <= step - window_steps]
    if not then or not (math.isfinite(l0) and math.isfinite(then[-1])) or then[-1] <= 0:
        return False
    return abs(l0 - then[-1]) / then[-1] < tolerance


def train_bench_model(cfg, data, run_dir: Path, device, *, size: str, rule: SettleRule,
                      budget_s: float, save: bool = False) -> BenchModel:
    """Train the bench model with the trainer's own ``run_step`` and ``log_metrics`` (the
    weights stay in memory; ``save``: also a trainer checkpoint ``run_dir/checkpoints/step{N}``
    that ``--model-from`` reads, for a later run on the same machine): up to
    ``cfg.trainer.max_steps`` steps, until ``rule`` says stop, or ``budget_s`` seconds. The model
    is initialised on ``device``."""
    from accelerate.utils import set_seed

    from train.model import build_model
    from train.trainer import Trainer

    set_seed(cfg.trainer.seed)
    with torch.device(device):
        model = build_model(cfg.model, cfg.ffn)
    tr = Trainer(cfg, run_dir, datamodule=data, model=model)
    try:
        history, reason = _train_loop(tr, rule, budget_s)
        if save:
            log(f"stage 1: bench model saved to {tr.save_checkpoint()}")
        weights = cpu_weights(tr.acc.unwrap_model(tr.model), pin=tr.device.type == "cuda")
        state = tr.plan.state_dict()
        steps, coeff = tr.step, tr.l1.at(max(tr.step - 1, 0))  # the last step's (summary.json's)
    finally:
        tr.close()
        tr.acc.free_memory()
    del tr, model
    free_memory(device)
    sp = cfg.sparsity
    l1 = (f"L1 {sp.l1_coeff:g} steered to hold training L0 {sp.target_l0:g} after step "
          f"{sp.target_after} (its last step at {coeff:.3g})" if sp.schedule == "target_l0"
          else f"L1 {sp.l1_coeff:g}")
    return BenchModel(size, cfg.model, weights, state, f"trained in-process: {steps} steps at "
                      f"{l1} ({reason})", steps, history, cfg.ffn)


def _train_loop(tr, rule: SettleRule, budget_s: float) -> tuple[list, str]:
    """Optimizer steps until the last one, the rule or the time box; (L0 history, reason)."""
    t = tr.cfg.trainer
    batches = iter(tr.data.train_batches())
    interval = tr.new_interval()
    history: list[tuple[int, float]] = []
    t0 = time.monotonic()
    reason = None
    while reason is None:
        tr.run_step(batches, interval)  # timed: the interval's tokens/s (log_metrics)
        over = time.monotonic() - t0 > budget_s
        if tr.step % t.log_every == 0 or tr.step >= t.max_steps or over:
            m = tr.log_metrics(interval)
            interval = tr.new_interval()
            history.append((tr.step, m["l0_mean"]))
            paths = tr.plan.paths
            log(f"stage 1 step {tr.step}: ce {m['ce']:.4f} l0 {m['l0_mean']:.1f} "
                f"[{m['l0_min']:.1f}-{m['l0_max']:.1f}] l1 coeff {m['l1_coeff']:.3g} "
                f"{m['tokens_per_s']:.0f} tok/s, ell layers {paths.count('ell')}/{len(paths)}")
            reason = rule.stop(history)
        if reason is None and tr.step >= t.max_steps:
            reason = f"{t.max_steps} steps"
        elif reason is None and over:
            reason = f"time box of {budget_s:.0f} s at step {tr.step}"
    return history, reason


def check_shape(saved: dict, model_cfg, where: Path) -> None:
    """Refuse a checkpoint (its ``config.json``: ``saved``) of another shape than ``model_cfg``.

    Raises:
        ValueError: one line naming the first differing field, both values and the fix.
    """
    from twell.hf import GATED_KEY

    pairs = [("hidden_size", "hidden_size"), ("intermediate_size", "intermediate_size"),
             ("num_hidden_layers", "num_layers"), ("num_attention_heads", "num_heads"),
             ("vocab_size", "vocab_size")]
    smoke = model_cfg.name == SMOKE_SIZE  # one shape: no other size to pass
    size = "the --smoke shape" if smoke else f"--sizes {model_cfg.name}"
    fix = ("pass a checkpoint of that shape" if smoke
           else "pass the size the checkpoint was trained at")
    for hf_key, key in pairs:
        if saved.get(hf_key) != getattr(model_cfg, key):
            raise ValueError(f"--model-from {where}: {hf_key} is {saved.get(hf_key)}, {size} has "
                             f"model.{key}={getattr(model_cfg, key)}; {fix}")
    if bool(saved.get(GATED_KEY, True)) != bool(model_cfg.gated):
        raise ValueError(f"--model-from {where}: gated={saved.get(GATED_KEY, True)}, {size} "
                         f"has model.gated={model_cfg.gated}; {fix}")


def load_bench_model(ckpt: Path, model_cfg, *, size: str, pin: bool,
                     ffn_cfg=None) -> BenchModel:
    """The bench model from a trainer checkpoint folder (``step{N}``): its weights (fp32), its
    trained FFN plan state (``trainer`` state's ``ffn_plan``; None if it has none) and the L0
    lines of its run's ``metrics.jsonl`` when the run directory is there. ``ffn_cfg``: the
    :class:`train.config.FFNConfig` its builds use (:attr:`BenchModel.ffn_cfg`).

    Raises:
        FileNotFoundError: no ``config.json`` in ``ckpt``.
        ValueError: another model shape (:func:`check_shape`).
        train.checkpoint.CheckpointError: a damaged weight or state file.
    """
    from safetensors.torch import load_file

    from train import checkpoint as ckpt_io
    from twell.hf import read_config_json, safetensors_files

    ckpt = Path(ckpt)
    check_shape(read_config_json(ckpt), model_cfg, ckpt)
    weights = {}
    for f in safetensors_files(ckpt):
        try:
            weights.update({k: v.float() for k, v in load_file(str(f)).items()})
        except Exception as e:  # noqa: BLE001  (SafetensorError, OSError: one line)
            raise ckpt_io.CheckpointError(f"{f} is damaged ({e})") from None
    if pin:
        weights = {k: v.pin_memory() for k, v in weights.items()}
    state = ckpt_io.load_state(ckpt, "trainer")
    history = []
    metrics = ckpt.parent.parent / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("kind", "train") == "train" and r.get("l0_mean") is not None:
                history.append((int(r["step"]), float(r["l0_mean"])))
    plan = state.get("ffn_plan")
    steps = int(state["step"])
    note = "" if plan is not None else "; no FFN plan state: auto starts dense"
    return BenchModel(size, model_cfg, weights, plan, f"checkpoint {ckpt} ({steps} steps{note})",
                      steps, history, ffn_cfg)


def heldout_blocks(data, n_blocks: int) -> tuple[torch.Tensor, str]:
    """(<= n_blocks, T) int64 held-out blocks (the validation split in stream order), else the
    first training blocks; and which of the two."""
    got, source = [], "validation"
    for b in data.val_batches():
        got.append(b)
        if sum(x.shape[0] for x in got) >= n_blocks:
            break
    if not got:
        source = "training"
        for b in data.train_batches():
            got.append(b)
            if sum(x.shape[0] for x in got) >= n_blocks:
                break
    return torch.cat(got)[:n_blocks], source


def reference_checks(bm: BenchModel, blocks_NT: torch.Tensor, device, *, bf16: bool,
                     profile_batch: int) -> dict:
    """Plain transformers against our model with the same weights, and the held-out profile.

    Returns a dict: ``logits_rel_err`` (fp32, eval, one block of up to 256 tokens: ||ours -
    hf|| / ||hf||), ``hf_loss_fp32`` / ``hf_loss_bf16`` on the first two blocks (the loss
    check's references), ``loss_tol`` = max(4 x their difference, 0.2 % of the loss),
    ``profile`` (per-layer rows of :func:`studies.profile.profile_sparsity` on ``blocks_NT``) and
    ``l0`` (their mean over layers: the held-out L0 every row names).
    """
    from studies.profile import profile_sparsity

    cfg = bm.model_cfg
    hf = build_hf(cfg, bm.weights, device).eval()
    ours = build_ours(cfg, bm.weights, device, impl="torch", ffn=bm.ffn_cfg).eval()
    out = {}
    with torch.no_grad():
        small = blocks_NT[:1, :256].to(device)
        lh, lo = hf(input_ids=small).logits.float(), ours(input_ids=small).logits.float()
        out["logits_rel_err"] = ((lo - lh).norm() / lh.norm()).item()
        del lh, lo
    check = blocks_NT[:2]
    out["hf_loss_fp32"] = eval_loss(hf, check, bf16=False)
    out["hf_loss_bf16"] = eval_loss(hf, check, bf16=bf16)
    noise = abs(out["hf_loss_bf16"] - out["hf_loss_fp32"])
    out["loss_tol"] = max(4 * noise, 2e-3 * abs(out["hf_loss_fp32"]))
    del hf
    free_memory(device)
    prof = profile_sparsity(ours, blocks_NT, batch=profile_batch, bf16=bf16)
    out["profile"] = prof.layer_rows()
    out["l0"] = prof.l0_mean
    out["profile_tokens"] = prof.n_tokens
    del ours
    free_memory(device)
    return out


def pick_layers(profile_rows: list[dict]) -> list[int]:
    """The layers with the lowest, median and highest held-out L0 (distinct, in that order)."""
    order = sorted(profile_rows, key=lambda r: r["l0"])
    picks = [order[0]["layer"], order[len(order) // 2]["layer"], order[-1]["layer"]]
    return list(dict.fromkeys(picks))


def record_layers(bm: BenchModel, blocks_NT: torch.Tensor, layers: list[int], out_dir: Path,
                  device, *, batch: int) -> list[Path]:
    """Record the FFN inputs of ``layers`` on ``blocks_NT`` (fp32 model, eval) with their weights
    as ``twell.nn.record`` files, ``<out_dir>/acts_<size>_l<layer>.safetensors`` plus a JSON of
    the statistics beside each (for ``scripts/bench_real_layers.py``, ``bench_ffn*.py --acts``).
    Returns the safetensors paths."""
    from twell.nn.record import ffn_input_stats, ffn_weights, record_ffn_inputs, save_ffn_layer

    model = build_ours(bm.model_cfg, bm.weights, device, impl="torch", ffn=bm.ffn_cfg).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for layer, x in record_ffn_inputs(model, blocks_NT, layers, batch=batch).items():
        wg, wu, wd = ffn_weights(model, layer)
        meta = {"size": bm.size, "layer": layer, "source": f"bench_model {bm.source}",
                **ffn_input_stats(x.to(device), wg if wg is not None else wu)}
        name = f"acts_{bm.size}_l{layer}"
        paths.append(save_ffn_layer(out_dir / f"{name}.safetensors", x, wg, wu, wd, meta))
        (out_dir / f"{name}.json").write_text(json.dumps(meta, indent=1))
        log(f"recorded layer {layer} -> {paths[-1]}: L0 {meta['l0_mean']:.1f}")
    del model
    free_memory(device)
    return paths


__all__ = ["BenchModel", "SettleRule", "check_shape", "heldout_blocks", "l0_settled",
           "load_bench_model", "pick_layers", "record_layers", "reference_checks",
           "train_bench_model"]
