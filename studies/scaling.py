"""The scaling-of-sparsity study, in self-contained pieces: the paper's sizes and a depth series.

    from studies.scaling import StudySettings, plan_rows, run_study
    rows = plan_rows(["0p5b", "1b", "1p5b", "2b"], [3e-4, 1e-4], reinit_sizes=["1p5b"])
    run_study(rows, StudySettings(), out=Path("out"), runs_dir=Path("runs/scaling"), max_wall=540)

    # the depth series (docs/scaling.md, "Depth series"): width 512, 8 / 18 / 28 / 38 layers
    s = StudySettings.for_depth_series()
    probe = plan_probe_rows(38, [1e-4, 3e-4, 1e-3], steps=300)
    rows = plan_depth_rows([8, 18, 28, 38], [0.0, 3e-4, 1e-3], steps=s.steps,
                           reinit=[(38, 1e-3)])
    run_study(rows, s, out=Path("out"), runs_dir=Path("runs/depth"), max_wall=540)

The paper (arXiv 2603.23198, "Results") trains 0.5B / 1B / 1.5B / 2B models (8 / 18 / 28 / 38
layers, hidden 2048, FFN 5632) and finds that larger models keep fewer FFN units active per
token (39 -> 29 -> 24 from 0.5B to 2B at L1 2e-5), that activity forms a hump over depth, that
the first tokens of a sequence fire far more units, and that re-initialising dead gate rows
keeps units alive. A *row* of this study is one model at one L1 coefficient, optionally with the
paper's dead-gate re-initialisation (``sparsity=l1_reinit``); every row of a series trains from
scratch on the same tokens of the data (same seed, steps, batch and sequence length), so the
rows differ only in the model and the sparsity settings.

Two series:

* *paper*: the paper's shapes (``configs/model/<size>.yaml``) for 200 steps of 8 x 2048 tokens
  (``scripts/bench_model.py``'s bench-model recipe; 3.3 M tokens: sparsity has not settled).
* *depth*: the paper's four depths at width 512 (``configs/model/depth_w512.yaml``, the one place
  of the shape; the depth is ``model.num_layers``), 1000 steps of 16 x 2048 tokens (32.8 M
  tokens, 1.76 epochs of the offline corpus), every row also with its dense control (L1 = 0)
  and the seven zero-shot tasks with standard errors, so that a row's sparsity can *settle*
  (:func:`settle_check`) and be compared with the same model trained dense. A short *L1 probe*
  (:func:`plan_probe_rows`: the deepest model at a few L1 values for fewer steps) measures which
  L1 values put its L0 in the paper's range before the series runs (:func:`suggest_l1` in
  :mod:`studies.scaling_report`).

A row is one piece that fits one call of a GPU machine that keeps nothing between calls:

1. train it (:func:`studies.jobs.run_jobs`: ``python -m train`` in ``<runs_dir>/<row>/``; a stopped
   row continues from its checkpoint when started again in the same run directory);
2. profile its final checkpoint on held-out blocks (:func:`studies.profile.profile_sparsity`),
   measure the share of the L1 gradient bf16 keeps on it (:func:`l1_gradient_kept`) and, with
   ``StudySettings.evals`` (not for probe rows), score the seven tasks on it
   (:func:`evals.evaluate`, per-item results kept for paired standard errors against the dense
   control);
3. write ``<out>/<row>.json`` (:func:`row_result`: config, summary, the profile, the evals, the
   curves of L0 (per layer), CE and dead units over training from ``metrics.jsonl``, the settle
   check), a few hundred KB.

A row whose result file exists in ``out`` (or in a folder of earlier results) is skipped, so the
same command can run call after call. The run directory keeps the final checkpoint
(``checkpoints/step{N}/``; ``keep`` prunes it) for later commands of the same call.
:mod:`studies.scaling_report` merges the result files of several calls and draws the plots.

The paper-size recipe is ``scripts/bench_model.py``'s bench model (L1 3e-4 row = its stage 1):
AdamW lr 1e-3, 10 warmup steps then cosine, micro-batch = global batch = 8 sequences of 2048,
``ffn.impl=auto``, 200 steps = 3,276,800 tokens; here without activation recomputation
(the same numbers, faster). Dead units are counted over the paper's window, ~1M tokens
(``sparsity.dead_window_tokens=1048576``: 64 steps of 16,384 tokens), not over one step.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from evals.tasks import TASKS
from studies.jobs import ROOT, Job, check_train_overrides, run_finished, run_jobs, train_command
from studies.sizes import (  # the sizes' one table (configs/model/<size>.yaml)
    PAPER_DEPTHS,
    PAPER_L0_RANGE,
    PAPER_SIZES,
    TOKENS_PER_MS,
    size_label,
)

# Per-row seconds besides training: process start, model build, first Triton compilations,
# validation, checkpoint write (12 bytes a parameter: fp32 weights and AdamW's two moments) and
# the profile (reading the weights back). A guess, not measured; each result file records the
# row's measured wall times (``timing``), which the estimate should be checked against.
ROW_START_S = 45.0
CHECKPOINT_BYTES_PER_PARAM = 12
DISK_BYTES_PER_S = 1.5e9
RESULT_FORMAT = 2  # 2: + eval, settle, per-layer L0 curves, depth-series rows; 1 still read
KEEP = ("full", "weights", "none")

# ---- the depth series (docs/scaling.md, "Depth series")
DEPTH_MODEL = "depth_w512"  # configs/model/depth_w512.yaml: the series' one shape definition
DEPTH_STEPS = 1000
DEPTH_PROBE_STEPS = 300
# The probe's L1 grid: the paper's 2e-5 (code normalisation: per-layer sum over units, mean over
# tokens, mean over layers) x ~4 for the 4x narrower FFN (the per-token sum over units of |h|
# shrinks with the number of units) = 8e-5, and up by half-decades because 32.8 M tokens give
# the L1 term 300x fewer tokens than the paper's 10 B to act (measured on one H200 at width
# 2048: 3e-4 reached L0 10-45 within 3-5 M tokens; 1e-3 drove the 0.5B shape to L0 ~1).
DEPTH_PROBE_L1 = (1e-4, 3e-4, 1e-3)
# Effective training FLOP/s of a small model on one H200 (eager PyTorch, bf16, no
# recomputation) for the time estimate of shapes without a measured speed: ~15 % of the H200's
# 989 TFLOP/s, as measured for models of this size on one H200: a SmolLM2-135M-shaped model
# (d 576, 30 layers, seq 1024) trained at 115.8-145.6 k tok/s = 127-160 TFLOP/s, small_l4
# (d 768, 4 layers) at 261.5 tok/ms = ~118 TFLOP/s (BENCHMARKS.md, the whole-model table of
# small_l4). A "40 % MFU of ~790 TFLOP/s" = 316 TFLOP/s would be 2.1x faster; the plan uses the
# measured rate, and the script replaces it by the rate the first results measure.
EFFECTIVE_TFLOPS = 148.0
# The seven tasks' full validation sets with the SmolLM2 tokenizer (evals.tasks.TASKS' sizes):
# task -> (items, requests, tokens of context + continuation). 15,737 items, 57,958 requests,
# 3.66 M tokens; HellaSwag is 87 % of the tokens.
EVAL_SETS = {t.name: t.size for t in TASKS.values()}
EVAL_PAD_FACTOR = 1.5  # padded batch tokens / real tokens (right padding to the batch's longest)
EVAL_EFFICIENCY = 0.5  # eval forwards run at half the training rate (short rows, fp32 log-softmax)
EVAL_BATCH_OVERHEAD_S = 0.01  # host work per scored batch


def row_label(r: dict) -> str:
    """A result's short label: ``2B`` (paper sizes), ``38 L`` (depth series)."""
    row = r["row"]
    return f"{row['layers']} L" if row.get("series") == "depth" else size_label(row["size"])


def series_key(row: dict) -> tuple:
    """The series a result's row belongs to: (L1, re-init, steps). Rows are compared across
    depths (or sizes) only within one series, on equal tokens: a depth trained for more steps
    than the others is a series of its own."""
    return (row["l1_coeff"], bool(row["reinit"]), row.get("steps"))


def several_steps(results: list[dict]) -> bool:
    """Whether the (non-probe) rows of ``results`` trained for more than one step count: then
    every series is named with its steps (:func:`series_text`)."""
    return len({r["row"].get("steps") for r in results if not r["row"].get("probe")}) > 1


def series_text(l1: float, steps: int | None, named: bool) -> str:
    """A series' label: ``L1 6.6e-4``, or ``L1 6.6e-4, 1500 steps`` when ``named`` (the results
    hold several step counts: :func:`several_steps`)."""
    return f"L1 {l1_text(l1)}" + (f", {steps} steps" if named else "")


def l1_text(v: float) -> str:
    """Short text of an L1 coefficient for names and labels: 3e-4, 1.5e-4, 0.01, 0."""
    if v == 0:
        return "0"
    mant, exp = f"{v:e}".split("e")
    mant = mant.rstrip("0").rstrip(".")
    e = int(exp)
    return f"{mant}e{e}" if e < -2 else f"{v:g}"


@dataclass(frozen=True)
class StudyRow:
    """One run of the study.

    Attributes:
        size: model config name (``configs/model/<size>.yaml``).
        l1_coeff: ``sparsity.l1_coeff`` (constant from step 0).
        reinit: ``sparsity=l1_reinit`` (the paper's dead-gate re-initialisation) if True.
        layers: depth-series rows: ``model.num_layers`` (the config's width, another depth);
            None for a paper-size row (the config's own depth).
        steps: depth-series rows: the row's optimizer steps (part of its name, so rows of a
            longer rerun never mix with shorter ones); None for a paper-size row (the
            settings' steps).
        probe: an L1-probe row (:func:`plan_probe_rows`), kept out of the series' comparisons.

    Raises:
        ValueError: ``layers`` without ``steps`` or the reverse, a value < 1, or ``probe`` on
            a paper-size row.
    """

    size: str
    l1_coeff: float
    reinit: bool = False
    layers: int | None = None
    steps: int | None = None
    probe: bool = False

    def __post_init__(self) -> None:
        if (self.layers is None) != (self.steps is None):
            raise ValueError(f"row {self.size}: a depth-series row needs both layers and steps "
                             f"(got layers={self.layers}, steps={self.steps})")
        for k in ("layers", "steps"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"row {self.size}: {k} must be an int >= 1; got {v!r}")
        if self.probe and self.layers is None:
            raise ValueError(f"row {self.size}: only depth-series rows can be probe rows")

    @property
    def series(self) -> str:
        """``depth`` (``layers`` set) or ``paper``."""
        return "paper" if self.layers is None else "depth"

    @property
    def name(self) -> str:
        """Run directory and result file name: ``1p5b_l1_3e-4`` / ``1p5b_l1_3e-4_reinit`` (paper
        sizes), ``depth_w512_l38_s1000_l1_3e-4`` (+ ``_reinit``, ``_probe``) in the depth series."""
        base = self.size if self.layers is None else f"{self.size}_l{self.layers}_s{self.steps}"
        return (f"{base}_l1_{l1_text(self.l1_coeff)}" + ("_reinit" if self.reinit else "")
                + ("_probe" if self.probe else ""))


def _check_l1s(l1s) -> None:
    if len(set(l1s)) != len(l1s):
        raise ValueError(f"--l1 lists a value twice: {list(l1s)}")
    if any(not (v >= 0 and math.isfinite(v)) for v in l1s):
        raise ValueError(f"--l1 values must be finite and >= 0; got {list(l1s)}")


def plan_rows(sizes: list[str], l1s: list[float], reinit_sizes: list[str] = ()) -> list[StudyRow]:
    """The study's rows, most informative first.

    Per L1 strength, in the given order: the smallest and the largest size (the drop the paper
    reports from 0.5B to 2B: two rows give the trend), then each re-init size with its
    re-initialised twin right after it (the pair answers the re-init question), then the other
    sizes from the largest down. Sizes are ordered by their position in :data:`PAPER_SIZES`
    (others after them, in the given order).

    Raises:
        ValueError: no sizes or L1 values, duplicates, a negative L1, or a re-init size that is
            not among ``sizes``.
    """
    if not sizes or not l1s:
        raise ValueError("--sizes and --l1 need at least one value each")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"--sizes lists a value twice: {list(sizes)}")
    _check_l1s(l1s)
    extra = [s for s in reinit_sizes if s not in sizes]
    if extra:
        raise ValueError(f"--reinit-sizes {extra} are not among --sizes {list(sizes)}")
    rank = {s: (PAPER_SIZES.index(s) if s in PAPER_SIZES else len(PAPER_SIZES) + i)
            for i, s in enumerate(sizes)}
    by_size = sorted(sizes, key=rank.get)
    ends = list(dict.fromkeys([by_size[0], by_size[-1]]))
    rest = [s for s in reversed(by_size) if s not in ends and s not in reinit_sizes]
    rows: list[StudyRow] = []
    for l1 in l1s:
        first = [s for s in ends if s not in reinit_sizes]
        rows += [StudyRow(s, l1) for s in first]
        for s in sorted(reinit_sizes, key=rank.get, reverse=True):
            rows += [StudyRow(s, l1), StudyRow(s, l1, reinit=True)]
        rows += [StudyRow(s, l1) for s in rest]
    return rows


def _check_depths(depths) -> list[int]:
    depths = list(depths)
    if not depths:
        raise ValueError("--depths needs at least one value (e.g. 8,18,28,38)")
    if len(set(depths)) != len(depths):
        raise ValueError(f"--depths lists a value twice: {depths}")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in depths):
        raise ValueError(f"--depths must be layer counts >= 1; got {depths}")
    return sorted(depths)


def plan_depth_rows(depths: list[int], l1s: list[float], steps: int,
                    reinit: list[tuple[int, float]] = (), size: str = DEPTH_MODEL
                    ) -> list[StudyRow]:
    """The depth series' rows, most informative first (a call runs them in this order and skips
    a row that does not fit its time left, so the first calls answer the first questions).

    With ``weak`` the smallest nonzero L1 and the others ascending after it:

    1. ``weak`` at the deepest and the shallowest depth (the trend's two ends);
    2. L1 = 0 (the dense controls) at those two depths (does accuracy hold?);
    3. each stronger L1 at the deepest and the shallowest depth;
    4. each re-init row (``(layers, l1)`` of ``reinit``: ``sparsity=l1_reinit``);
    5. the depths between, from the deepest down: ``weak``, then L1 = 0, then the stronger ones.

    Raises:
        ValueError: no depths or L1 values, duplicates, a negative L1, ``steps < 1``, or a
            re-init row whose depth or L1 is not in the series (or whose L1 is 0).
    """
    depths = _check_depths(depths)
    if not l1s:
        raise ValueError("--l1 needs at least one value (e.g. 0,3e-4,1e-3)")
    _check_l1s(l1s)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--steps must be an int >= 1; got {steps!r}")
    for d, v in reinit:
        if d not in depths or v not in l1s or v == 0:
            raise ValueError(f"re-init row {d}:{l1_text(v)} is not a sparse row of the series "
                             f"(depths {depths}, L1 {[l1_text(x) for x in l1s]})")
    nonzero = sorted(v for v in l1s if v > 0)
    order = nonzero[:1] + ([0.0] if 0 in l1s else []) + nonzero[1:]
    ends = list(dict.fromkeys([depths[-1], depths[0]]))
    middle = [d for d in reversed(depths) if d not in ends]

    def row(d, v, re=False):
        return StudyRow(size, float(v), reinit=re, layers=d, steps=steps)

    rows = [row(d, v) for v in order[:2] for d in ends]
    rows += [row(d, v) for v in order[2:] for d in ends]
    rows += [row(d, v, True) for d, v in reinit]
    rows += [row(d, v) for d in middle for v in order]
    return rows


def plan_probe_rows(layers: int, l1s: list[float], steps: int = DEPTH_PROBE_STEPS,
                    size: str = DEPTH_MODEL) -> list[StudyRow]:
    """The L1 probe: the model of ``layers`` layers at each nonzero L1 of ``l1s`` (ascending),
    ``steps`` optimizer steps each (a cosine schedule of its own); their held-out L0 tells which
    L1 values put the series' deepest model in the paper's range (:func:`studies.scaling_report.
    suggest_l1`).

    Raises:
        ValueError: no nonzero L1 value, duplicates, a negative L1, ``layers`` or ``steps`` < 1.
    """
    _check_l1s(l1s)
    vals = sorted(v for v in l1s if v > 0)
    if not vals:
        raise ValueError("--probe-l1 needs at least one nonzero value (e.g. 1e-4,3e-4,1e-3)")
    return [StudyRow(size, float(v), layers=_check_depths([layers])[0], steps=steps, probe=True)
            for v in vals]


@dataclass
class StudySettings:
    """What every row shares (the defaults: ``scripts/bench_model.py``'s bench-model recipe; the
    depth series: :meth:`for_depth_series`).

    Attributes:
        tokens: training tokens per row (rounded to whole steps of ``global_batch * seq_len``);
            a depth-series row trains its own ``steps`` instead.
        micro_batch, global_batch: sequences per forward and per optimizer step.
        seq_len: tokens per sequence (the paper's 2048).
        lr, warmup_steps: AdamW peak learning rate and its linear warmup (then cosine).
        dead_window_tokens: tokens a unit must stay inactive to count as dead (the paper: one
            ~1M-token step; ``sparsity.dead_window_tokens``); also the re-init interval.
        seed: init and data order of every row.
        log_every: steps between metric lines (the L0 / CE / dead curves and the settle check).
        val_sequences: held-out sequences of the final validation loss.
        profile_tokens: held-out tokens profiled (the first blocks of the validation split).
        ffn_impl: ``ffn.impl``.
        cpu: train and profile on the CPU (fp32).
        smoke: tiny shapes for tests (``model=tiny`` at width 32, 1-4 layers by size, or the
            row's layers).
        keep: what stays of a finished row's checkpoint: ``full``, ``weights`` (optimizer state
            deleted) or ``none``.
        evals: score the seven zero-shot tasks on every row's final checkpoint (with per-item
            results for paired standard errors).
        eval_limit: items per task (None = the full validation sets).
        eval_batch: sequences per eval forward.
        eval_tokenizer: tokenizer name for the evals when the data has none (``data=tokens``):
            ``smollm2`` (:func:`train.data.tokenizer.load_tokenizer`); None = the data's.
        effective_tflops: training FLOP/s (x 1e12) of the time estimate of a shape without a
            measured speed (:data:`EFFECTIVE_TFLOPS`).
        overrides: extra Hydra overrides for every row (last, so they win).
    """

    tokens: int = 200 * 8 * 2048
    micro_batch: int = 8
    global_batch: int = 8
    seq_len: int = 2048
    lr: float = 1e-3
    warmup_steps: int = 10
    dead_window_tokens: int = 1_048_576
    seed: int = 42
    log_every: int = 4
    val_sequences: int = 256
    profile_tokens: int = 262_144
    ffn_impl: str = "auto"
    cpu: bool = False
    smoke: bool = False
    keep: str = "full"
    evals: bool = False
    eval_limit: int | None = None
    eval_batch: int = 64
    eval_tokenizer: str | None = None
    effective_tflops: float = EFFECTIVE_TFLOPS
    overrides: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for k in ("tokens", "micro_batch", "global_batch", "seq_len", "dead_window_tokens",
                  "log_every", "val_sequences", "profile_tokens", "eval_batch"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"{k} must be >= 1; got {getattr(self, k)}")
        if self.eval_limit is not None and self.eval_limit < 1:
            raise ValueError(f"eval_limit must be >= 1 items per task or None (the full sets); "
                             f"got {self.eval_limit}")
        if not (self.effective_tflops > 0 and math.isfinite(self.effective_tflops)):
            raise ValueError(f"effective_tflops must be a number > 0; got {self.effective_tflops}")
        if self.micro_batch > self.global_batch:  # a non-divisor runs balanced micro-batches
            raise ValueError(f"micro_batch {self.micro_batch} is more than global_batch "
                             f"{self.global_batch}")
        if self.keep not in KEEP:
            raise ValueError(f"keep must be one of {KEEP}; got {self.keep!r}")
        for o in self.overrides:
            if "=" not in o:
                raise ValueError(f"override {o!r} is not a Hydra override key=value")

    @classmethod
    def for_smoke(cls, **kw) -> StudySettings:
        """Tiny CPU settings: 4 steps of 2 x 32 tokens, a 2-step dead window, 4 blocks profiled."""
        base = {"tokens": 4 * 2 * 32, "micro_batch": 2, "global_batch": 2, "seq_len": 32,
                "warmup_steps": 1, "dead_window_tokens": 2 * 2 * 32, "log_every": 1,
                "val_sequences": 2, "profile_tokens": 4 * 32, "ffn_impl": "torch", "cpu": True,
                "smoke": True}
        return cls(**{**base, **kw})

    @classmethod
    def for_depth_series(cls, steps: int = DEPTH_STEPS, **kw) -> StudySettings:
        """The depth series' recipe: ``steps`` (1000) optimizer steps of 16 x 2048 tokens
        (32,768 a step; 32.8 M tokens at 1000 steps, 1.76 epochs of the offline corpus's 18.65 M
        training tokens), micro-batch 16 (no accumulation, no recomputation: the 38-layer model
        at width 512 needs ~50 GB), AdamW lr 1e-3 with 60 warmup steps (the paper's 600 of
        10,000) then cosine to 0, ``ffn.impl=torch`` for every row (one FFN path: ``auto``
        moves layers between paths whose L1 gradients differ under bf16, BENCHMARKS.md), a
        metric line every 10 steps (100 points for the settle check), the paper's 1 M-token
        dead window (32 steps), 256 held-out sequences for the validation loss, 128 held-out
        blocks (262,144 tokens) profiled, and the seven tasks on their full validation sets.
        ``kw`` overrides any field (e.g. ``for_smoke``-like tiny values in tests)."""
        base = {"tokens": steps * 16 * 2048, "micro_batch": 16, "global_batch": 16,
                "warmup_steps": 60, "log_every": 10, "ffn_impl": "torch", "evals": True}
        return cls(**{**base, **kw})

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def steps(self) -> int:
        """Optimizer steps of every row: ``tokens`` rounded to whole steps (at least one)."""
        return max(1, round(self.tokens / self.tokens_per_step))


def row_steps(row: StudyRow, s: StudySettings) -> int:
    """Optimizer steps of ``row``: its own (depth series) or the settings' (paper sizes)."""
    return row.steps if row.steps is not None else s.steps


def row_overrides(row: StudyRow, s: StudySettings) -> list[str]:
    """The Hydra overrides of one row's training run."""
    if s.smoke:
        layers = row.layers or {name: i + 1 for i, name in enumerate(PAPER_SIZES)}.get(row.size, 2)
        model = ["model=tiny", "model.name=" + row.size, "model.hidden_size=32",
                 "model.intermediate_size=64", "model.num_heads=2", f"model.num_layers={layers}"]
    else:
        model = [f"model={row.size}"]
        if row.layers is not None:
            model.append(f"model.num_layers={row.layers}")
    if s.cpu:
        trainer = ["trainer=cpu", "trainer.cpu=true", "trainer.precision=fp32",
                   "trainer.num_threads=1"]
    else:
        trainer = ["trainer=gpu", "trainer.grad_checkpointing=false"]
    return [
        *model, f"model.seq_len={s.seq_len}", f"ffn.impl={s.ffn_impl}", *trainer,
        "optim=adamw", f"optim.lr={s.lr!r}", f"optim.warmup_steps={s.warmup_steps}",
        "sparsity=" + ("l1_reinit" if row.reinit else "l1"), f"sparsity.l1_coeff={row.l1_coeff!r}",
        f"sparsity.dead_window_tokens={s.dead_window_tokens}",
        f"trainer.max_steps={row_steps(row, s)}", f"trainer.micro_batch={s.micro_batch}",
        f"trainer.global_batch={s.global_batch}", f"trainer.seed={s.seed}",
        f"trainer.log_every={s.log_every}", "trainer.val_every=0",
        f"trainer.val_sequences={s.val_sequences}", "trainer.save_every=0", "trainer.keep_last=1",
        "trainer.progress=false", "trainer.resume=auto", "eval=disabled",
        "logging.wandb_mode=disabled", *s.overrides,
    ]


def check_row_configs(rows: list[StudyRow], s: StudySettings, skip: set[str] = frozenset()
                      ) -> None:
    """Compose the training config of every row to run (not in ``skip``) with the command
    line's overrides (``s.overrides``) as its ``python -m train`` would
    (:func:`studies.jobs.check_train_overrides`), before any row starts.

    Raises:
        ValueError: one line naming the override (or the row) the config refuses and why.
    """
    own = replace(s, overrides=[])  # the row's own overrides, the user's kept apart to blame
    check_train_overrides({r.name: row_overrides(r, own) for r in rows if r.name not in skip},
                          s.overrides)


def model_shape(size: str, layers: int | None = None):
    """The :class:`train.config.ModelConfig` of ``configs/model/<size>.yaml`` (``layers``
    replacing its depth), or None when there is no such config.

    Raises:
        ValueError: the config has a key :class:`train.config.ModelConfig` does not know."""
    import yaml

    from train.config import ModelConfig

    path = ROOT / "configs" / "model" / f"{size}.yaml"
    if not path.is_file():
        return None
    fields = yaml.safe_load(path.read_text()) or {}
    if layers is not None:
        fields["num_layers"] = layers
    try:
        return ModelConfig(**fields)
    except TypeError as e:
        raise ValueError(f"{path}: {e}") from None


def row_params(row: StudyRow) -> int | None:
    """Parameters of a row's model (tied embedding counted once), or None without a config."""
    m = model_shape(row.size, row.layers)
    if m is None:
        return None
    d, h, v = m.hidden_size, m.intermediate_size, m.vocab_size
    kv = (m.num_kv_heads or m.num_heads) * (d // m.num_heads)
    per_layer = 2 * d * d + 2 * d * kv + (3 if m.gated else 2) * d * h + 2 * d
    return v * d + m.num_layers * per_layer + d


def paper_params(size: str) -> int | None:
    """Parameters of a paper shape (``configs/model/<size>.yaml``; tied embedding counted once),
    or None for another config."""
    return row_params(StudyRow(size, 0.0)) if size in PAPER_SIZES else None


def eval_seconds(fwd_flops_per_token: float, s: StudySettings) -> float:
    """Estimated seconds of the seven tasks (``s.eval_limit`` items each, or the full sets) for
    a model of ``fwd_flops_per_token`` forward FLOPs a token: the requests' tokens
    (:data:`EVAL_SETS`) x :data:`EVAL_PAD_FACTOR` at :data:`EVAL_EFFICIENCY` of the training
    rate, plus :data:`EVAL_BATCH_OVERHEAD_S` per batch of ``s.eval_batch`` requests; 0 without
    ``s.evals``."""
    if not s.evals:
        return 0.0
    tokens = requests = 0.0
    for items, reqs, toks in EVAL_SETS.values():
        frac = 1.0 if s.eval_limit is None else min(s.eval_limit, items) / items
        tokens, requests = tokens + frac * toks, requests + frac * reqs
    rate = EVAL_EFFICIENCY * s.effective_tflops * 1e12
    return (tokens * EVAL_PAD_FACTOR * fwd_flops_per_token / rate
            + math.ceil(requests / s.eval_batch) * EVAL_BATCH_OVERHEAD_S)


def estimate_seconds(row: StudyRow, s: StudySettings) -> tuple[float, float] | None:
    """(training seconds, whole-row seconds) of a row on one H200; None on the CPU or for a
    model without a config.

    Training: the paper sizes at their measured :data:`TOKENS_PER_MS`; other shapes from their
    FLOPs a token (:func:`train.metrics.flops_per_token`: ``6 N + 12 L D T``) at
    ``s.effective_tflops``. The whole row adds :data:`ROW_START_S`, the checkpoint's write and
    read-back (16 bytes a parameter at :data:`DISK_BYTES_PER_S`), the profile's forward over
    ``s.profile_tokens`` and the evals (:func:`eval_seconds`; none for a probe row)."""
    from train.metrics import flops_per_token

    m = model_shape(row.size, row.layers)
    if s.cpu or m is None:
        return None
    m.seq_len = s.seq_len
    tokens = row_steps(row, s) * s.tokens_per_step
    fwd = flops_per_token(m) / 3
    speed = TOKENS_PER_MS.get(row.size) if row.layers is None else None
    if speed is not None:
        train_s = tokens / (speed * 1e3)
        rate = speed * 1e3 * 3 * fwd  # FLOP/s of the measured speed
    else:
        rate = s.effective_tflops * 1e12
        train_s = tokens * 3 * fwd / rate
    disk_s = (CHECKPOINT_BYTES_PER_PARAM + 4) * row_params(row) / DISK_BYTES_PER_S
    post_s = s.profile_tokens * fwd / rate + (0.0 if row.probe else eval_seconds(fwd, s))
    return train_s, train_s + ROW_START_S + disk_s + post_s


def checkpoint_gb(row: StudyRow, keep: str) -> float | None:
    """GB a finished row leaves on disk with ``keep`` (the full checkpoint while it is written:
    ``keep="full"``); None for a model without a config."""
    params = row_params(row)
    per_param = {"full": CHECKPOINT_BYTES_PER_PARAM, "weights": 4, "none": 0}[keep]
    return None if params is None else per_param * params / 1e9


def plan_text(rows: list[StudyRow], s: StudySettings, skip: set[str],
              free_gb: float | None = None) -> str:
    """The printed plan: each row with its estimate, the totals, and a warning when the
    checkpoints left behind (``s.keep``) would not fit ``free_gb``."""
    steps = sorted({row_steps(r, s) for r in rows}) or [s.steps]
    st = "/".join(map(str, steps))
    lines = [(f"study: {len(rows)} rows, {st} steps x {s.global_batch} x {s.seq_len} = "
              f"{'/'.join(f'{n * s.tokens_per_step:,}' for n in steps)} tokens each, dead "
              f"window {s.dead_window_tokens:,} tokens, seed {s.seed}"
              + (f", evals on {'the full sets' if s.eval_limit is None else f'{s.eval_limit} items a task'}"
                 if s.evals else ""))]
    total_train = total = disk = 0.0
    for i, r in enumerate(rows, 1):
        est = estimate_seconds(r, s)
        if r.name in skip:
            lines.append(f"  {i:2d}. {r.name:36s} result exists: skipped")
            continue
        if est is None:
            lines.append(f"  {i:2d}. {r.name:36s} (no speed estimate)")
            continue
        total_train, total = total_train + est[0], total + est[1]
        disk += checkpoint_gb(r, s.keep)
        evals = " and evals" if s.evals and not r.probe else ""
        lines.append(f"  {i:2d}. {r.name:36s} ~{est[0]:4.0f} s training, ~{est[1]:4.0f} s with "
                     f"start, checkpoint, profile{evals} (checkpoint "
                     f"{checkpoint_gb(r, 'full'):.1f} GB)")
    if total:
        speeds = ("H200 speeds " + str(TOKENS_PER_MS) + " tok/ms" if all(
            r.layers is None for r in rows) else f"{s.effective_tflops:g} TFLOP/s effective")
        lines.append(f"estimated GPU time of the rows to run: ~{total_train:.0f} s training, "
                     f"~{total:.0f} s in all ({speeds}); checkpoints left on disk "
                     f"(--keep {s.keep}): ~{disk:.0f} GB")
        biggest = max(checkpoint_gb(r, "full") or 0 for r in rows)
        if free_gb is not None and disk + biggest > free_gb:
            lines.append(f"WARNING: ~{disk + biggest:.0f} GB of checkpoints may be needed, "
                         f"{free_gb:.0f} GB free: use --keep weights or --keep none")
    return "\n".join(lines)


def pack_calls(rows: list[StudyRow], s: StudySettings, max_wall: float
               ) -> list[list[tuple[StudyRow, float]]]:
    """How :func:`run_study` would spread ``rows`` over device calls of ``max_wall`` seconds
    each when every estimate holds: per call, the rows in order, each started when its
    whole-row estimate fits the time left (a later, shorter row may fill a gap); a row longer
    than a whole call gets a call of its own (it resumes from its checkpoint in the next).
    Returns per call the ``(row, estimated seconds)`` pairs; rows without an estimate are left
    out."""
    todo = [(r, e[1]) for r in rows if (e := estimate_seconds(r, s)) is not None]
    calls = []
    while todo:
        left, call = max_wall, []
        for item in list(todo):
            if item[1] <= left or not call and item[1] > max_wall:
                call.append(item)
                left -= item[1]
                todo.remove(item)
        calls.append(call)
    return calls


def result_names(folders: list[Path]) -> set[str]:
    """Row names that have a result file (``<row>.json``) in any of ``folders``."""
    names = set()
    for d in folders:
        if Path(d).is_dir():
            names |= {p.stem for p in Path(d).glob("*.json")}
    return names


@dataclass
class RowOutcome:
    """What became of one row in :func:`run_study`: ``status`` is ``done``, ``skipped``,
    ``not started`` (it would not fit the wall-clock budget), ``stopped`` (the deadline stopped
    its training: resumable from its run dir), ``failed (...)``; ``result`` and ``checkpoint``
    are paths when done."""

    row: StudyRow
    status: str
    result: Path | None = None
    checkpoint: Path | None = None


def run_study(rows: list[StudyRow], s: StudySettings, *, out: Path, runs_dir: Path,
              max_wall: float, skip_results: list[Path] = (), log=print) -> list[RowOutcome]:
    """Run ``rows`` one after another within ``max_wall`` seconds; see the module docstring.

    A row whose estimate (:func:`estimate_seconds`) does not fit the time left is not started
    (a later, shorter one may be), except a row longer than a whole ``max_wall`` when nothing
    else has run in this call and no later row fits: it starts and resumes from its checkpoint
    in the next call (only on a machine still warm, so a row that fits goes first: a call of
    235 s once started a 307 s row and lost it, with 189 s rows waiting).
    Training gets SIGTERM 60 s before the deadline (10 s on the CPU) plus the row's estimated
    profile and eval time, which leaves time for them: the trainer writes a checkpoint and the
    row resumes from it when run again in the same ``runs_dir``. Rows whose result file is in
    ``out`` or in ``skip_results`` are skipped. Returns one :class:`RowOutcome` per row.
    """
    t0 = time.monotonic()
    deadline = t0 + max_wall
    out.mkdir(parents=True, exist_ok=True)
    runs_dir.mkdir(parents=True, exist_ok=True)
    have = result_names([out, *skip_results])
    outcomes = []
    started = False
    ests = {row.name: estimate_seconds(row, s) for row in rows if row.name not in have}
    for i, row in enumerate(rows):
        if row.name in have:
            outcomes.append(RowOutcome(row, "skipped"))
            continue
        est = ests[row.name]
        left = deadline - time.monotonic()
        # a later row that fits what is left (it would finish; this one would stop part-way)
        later_fits = any(e is not None and e[1] <= left for r in rows[i + 1:]
                         if (e := ests.get(r.name)) is not None)
        if est is not None and est[1] > left and (started or est[1] <= max_wall or later_fits):
            log(f"{row.name}: not started: needs ~{est[1]:.0f} s, {left:.0f} s left")
            outcomes.append(RowOutcome(row, "not started"))
            continue
        started = True
        post = 0.0 if est is None else est[1] - est[0] - ROW_START_S
        outcomes.append(run_row(row, s, out=out, runs_dir=runs_dir, deadline=deadline, log=log,
                                post_s=post))
    return outcomes


def run_row(row: StudyRow, s: StudySettings, *, out: Path, runs_dir: Path, deadline: float,
            log=print, post_s: float = 0.0) -> RowOutcome:
    """Train (or resume, or find finished) one row, profile it (and score the evals), write its
    result file. Training stops ``post_s`` seconds (the estimated profile and evals) plus a
    reserve before ``deadline``."""
    run_dir = runs_dir / row.name
    t0 = time.monotonic()
    steps = row_steps(row, s)
    if not run_finished(run_dir, steps):
        job = Job(row.name, train_command(row_overrides(row, s), run_dir), run_dir=run_dir)
        reserve = (10.0 if s.cpu else 60.0) + post_s  # profile, evals and result after training
        run_jobs([job], deadline=deadline - reserve, log=log)
        if not job.ok or not run_finished(run_dir, steps):
            if job.status == "stopped":
                log(f"{row.name}: stopped by the deadline; it resumes from its checkpoint when "
                    f"the same command runs again with --runs-dir {runs_dir}")
            else:
                log(f"{row.name}: {job.status}; log {job.log_path}:\n{_log_tail(job.log_path)}")
            return RowOutcome(row, job.status if not job.ok else "failed (no summary)")
    train_s = time.monotonic() - t0
    t1 = time.monotonic()
    try:
        ckpt = final_checkpoint(run_dir)
        prof, ev = post_train(run_dir, ckpt, s if not row.probe else  # probe: L0 only
                              StudySettings(**{**asdict(s), "evals": False}), log=log)
        timing = {"train_wall_s": round(train_s, 1),
                  "profile_wall_s": round(time.monotonic() - t1, 1)}
        if ev is not None:
            timing["eval_wall_s"] = ev["seconds"]
        result = row_result(row, run_dir, ckpt, prof, s, timing, evals=ev)
    except Exception as e:  # noqa: BLE001  (one row's failure must not end the other rows)
        log(f"{row.name}: profile failed:\n{traceback.format_exc()}")
        return RowOutcome(row, f"failed (profile: {type(e).__name__})")
    path = write_json_atomic(out / f"{row.name}.json", result)
    prune_checkpoint(ckpt, s.keep)
    pm = prof["l0_mean"]
    sm = result["summary"]
    st = result["settle"]
    ev_txt = "" if ev is None else (f", seven-task mean {100 * ev['mean']:.1f} +- "
                                    f"{100 * ev['mean_stderr']:.1f}")
    log(f"{row.name}: done in {time.monotonic() - t0:.0f} s: held-out L0 {_num(pm, '.1f')}, "
        f"dead {_num(sm.get('dead_pct'), '.1f')} % (last window), val loss "
        f"{_num(sm.get('val_loss'), '.4f')}{ev_txt}; settled {st['settled']} (largest L0 change over "
        f"the last fifth of a layer failing the rule, else of any layer {_num(st['change_pct'], '.1f')} %); result {path}")
    kept = {"full": "", "weights": " (weights only: --keep weights)",
            "none": " (deleted: --keep none)"}[s.keep]
    log(f"{row.name}: checkpoint {ckpt}{kept}")
    return RowOutcome(row, "done", path, ckpt)


def _num(v, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def _log_tail(path: Path | None, n: int = 2000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except (OSError, TypeError):
        return ""


def final_checkpoint(run_dir: Path) -> Path:
    """The newest intact ``checkpoints/step{N}/`` of a finished run (FileNotFoundError if
    there is none)."""
    from train.checkpoint import latest_checkpoint

    return latest_checkpoint(run_dir)


def profile_run(run_dir: Path, ckpt: Path, s: StudySettings) -> dict:
    """The sparsity profile of :func:`post_train` alone (no evals)."""
    return post_train(run_dir, ckpt, StudySettings(**{**asdict(s), "evals": False}))[0]


def post_train(run_dir: Path, ckpt: Path, s: StudySettings, log=print) -> tuple[dict, dict | None]:
    """Profile a run's checkpoint on the first ``s.profile_tokens`` held-out tokens of its own
    data (its ``config.yaml``; the validation split, else the first training blocks) and, with
    ``s.evals``, score the seven tasks on it (:func:`row_evals`), one model load for both.

    Returns:
        (profile, evals): the JSON-ready :meth:`studies.profile.SparsityProfile.to_dict`, token
        texts decoded with the data's tokenizer when it has one, and the :func:`row_evals` dict
        (None without ``s.evals``).

    Raises:
        ValueError: the data has no blocks to profile; evals asked for without a tokenizer
            (neither the data's nor ``s.eval_tokenizer``).
    """
    import torch
    from omegaconf import OmegaConf
    from transformers.utils import logging as hf_logging

    from studies.profile import profile_sparsity
    from train.data import DataConfig, build_datamodule
    from train.model import load_model

    hf_logging.disable_progress_bar()  # no "Loading weights" bar per row
    cfg = OmegaConf.to_container(OmegaConf.load(Path(run_dir) / "config.yaml"), resolve=True)
    data = build_datamodule(DataConfig(**cfg["data"]), seq_len=cfg["model"]["seq_len"],
                            micro_batch=cfg["trainer"]["micro_batch"], seed=cfg["trainer"]["seed"])
    tok = getattr(data, "tokenizer", None)
    eval_tok = tok
    if s.evals and eval_tok is None:
        if s.eval_tokenizer is None:
            raise ValueError("evals need a tokenizer and the run's data has none (data=tokens): "
                             "set eval_tokenizer (--eval-tokenizer smollm2) or evals off (--no-evals)")
        from train.data.tokenizer import load_tokenizer

        eval_tok = load_tokenizer(s.eval_tokenizer)
    n_blocks = max(1, s.profile_tokens // cfg["model"]["seq_len"])
    blocks_BT = _first_blocks(data, n_blocks)
    dev = torch.device("cuda" if torch.cuda.is_available() and not s.cpu else "cpu")
    model = load_model(ckpt).to(dev)
    try:
        prof = profile_sparsity(model, blocks_BT, batch=s.micro_batch)
        coeff, kept = float(cfg["sparsity"]["l1_coeff"]), None
        if coeff > 0:
            try:  # a diagnostic: its failure (e.g. out of memory) must not cost the row
                kept = l1_gradient_kept(model, blocks_BT[:L1_KEPT_BLOCKS], coeff,
                                        bf16=dev.type == "cuda")
            except Exception as e:  # noqa: BLE001
                log(f"L1-gradient check failed ({type(e).__name__}: {e}); recorded as None")
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        ev = row_evals(model, eval_tok, s, dev, log=log) if s.evals else None
    finally:
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    d = prof.to_dict(decode=None if tok is None else (lambda i: tok.decode([i])))
    d["source"] = "validation" if getattr(data, "val_blocks", 0) else "training"
    d["l1_grad_kept"] = kept
    return d, ev


# held-out blocks of the L1-gradient check (four forwards and backwards, two of them in fp32:
# one block keeps the fp32 activations of the paper's 2B shape within an H200's memory)
L1_KEPT_BLOCKS = 1


def l1_gradient_kept(model, blocks_BT, coeff: float, *, bf16: bool = True) -> float | None:
    """The share of the L1 term's gradient that the training precision keeps, on ``blocks_BT``.

    Under bf16 autocast the PyTorch FFN path adds ``coeff / N * sign(h)`` to a bf16 dh where it
    is below bf16's resolution, so part of it is rounded away (BENCHMARKS.md, "Training FFN":
    ~15 % kept in one case), and the part kept depends on ``coeff / L`` against the CE gradient,
    i.e. on the depth: a confound for a depth series. This measures it on the trained model:
    the gate and up weight gradients of ``CE + coeff * L1`` minus those of ``CE`` alone, under
    bf16 autocast (``bf16``; else fp32, which keeps all of it) and in fp32, and returns
    ``<d_bf16, d_fp32> / |d_fp32|^2`` over every layer (1.0 = all of it kept; None when the fp32
    difference is zero). The model's gradients are cleared afterwards; its mode is restored.

    Args:
        model: a ``LlamaForCausalLM`` with :class:`twell.nn.SparseGatedMLP` FFNs (their
            ``last_stats`` give the L1 term).
        blocks_BT: (B, T) held-out token ids.
        coeff: the run's ``sparsity.l1_coeff`` (> 0).
    """
    import torch

    from train.sparsity import collect_stats, l1_penalty
    from twell.hf import ffn_modules

    mlps = ffn_modules(model)
    dev = next(model.parameters()).device
    ids = blocks_BT.to(dev, torch.int64)
    was_training = model.training
    model.train()

    def grads(c: float, autocast: bool) -> list:
        model.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, labels=ids)
            l1, _ = l1_penalty(collect_stats(mlps))
            loss = out.loss.float() + c * l1.float()
        loss.backward()
        return [w.grad.double().clone() for m in mlps
                for w in ((m.gate_proj.weight,) if m.gated else ()) + (m.up_proj.weight,)]

    try:
        ref = [a - b for a, b in zip(grads(coeff, False), grads(0.0, False))]
        got = [a - b for a, b in zip(grads(coeff, bf16), grads(0.0, bf16))]
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    den = sum(float((r * r).sum()) for r in ref)
    return None if den == 0 else sum(float((g * r).sum()) for g, r in zip(got, ref)) / den


def row_evals(model, tokenizer, s: StudySettings, device, log=print) -> dict:
    """The seven zero-shot tasks on ``model`` (:func:`evals.evaluate`: ``s.eval_limit`` items a
    task or the full sets, bf16 autocast on CUDA as in training), reduced to what the report
    needs.

    Returns:
        ``{"tasks": {name: {"primary", "stderr", "metric", "n", "chance"}}, "mean",
        "mean_stderr", "correct": {name: "0110..."}, "limit", "seconds"}``: fractions in [0, 1];
        ``stderr`` the binomial standard error of the task's primary metric, ``mean`` the
        unweighted mean of the primary metrics, ``mean_stderr`` its standard error
        ``sqrt(sum stderr^2) / n_tasks`` (tasks independent); ``correct`` the per-item
        correctness of the primary metric, in item order (the paired difference against
        another row on the same items: :func:`studies.scaling_report.paired_diff`).
    """
    import torch

    from evals import evaluate

    t0 = time.monotonic()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = evaluate(model, tokenizer, tasks="all", limit=s.eval_limit,
                       batch_size=s.eval_batch, device=device, log_samples=True)
    tasks, correct = {}, {}
    for name, r in out["tasks"].items():
        metric = r["primary_metric"]
        pick = "pred_norm" if metric == "acc_norm" else "pred"
        correct[name] = "".join("1" if x[pick] == x["label"] else "0" for x in r["samples"])
        tasks[name] = {"primary": r["primary"], "stderr": r[f"{metric}_stderr"],
                       "metric": metric, "n": r["n"], "chance": r["chance"]}
    ses = [t["stderr"] for t in tasks.values()]
    mean_se = (math.sqrt(sum(x * x for x in ses)) / len(ses)
               if all(math.isfinite(x) for x in ses) else None)
    ev = {"tasks": tasks, "mean": out["mean"], "mean_stderr": mean_se, "correct": correct,
          "limit": s.eval_limit, "seconds": round(time.monotonic() - t0, 1)}
    per_task = ", ".join(f"{k} {100 * v['primary']:.1f}" for k, v in tasks.items())
    log(f"evals: mean {100 * ev['mean']:.2f} % ({per_task}) in {ev['seconds']:.0f} s")
    return ev


def _first_blocks(data, n_blocks: int):
    import torch

    got = []
    source = data.val_batches() if getattr(data, "val_blocks", 0) else data.train_batches()
    for b in source:
        got.append(b)
        if sum(x.shape[0] for x in got) >= n_blocks:
            break
    if not got:
        raise ValueError("the run's data has no blocks to profile")
    return torch.cat(got)[:n_blocks]


def read_train_lines(run_dir: Path) -> list[dict]:
    """The ``kind=train`` lines of ``metrics.jsonl`` (a damaged line is skipped)."""
    lines = []
    for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        try:
            r = json.loads(ln)
        except ValueError:
            continue
        if r.get("kind", "train") == "train":
            lines.append(r)
    return lines


# The settle rule: a row has settled when no layer's L0 moves by 5 % or more over
# the last fifth of its training. Each end of that window is the mean of its first / last fifth
# of logged points (a logged point is already the mean over log_every steps' tokens), so one
# noisy line does not decide; a change below SETTLE_ABS_UNITS active units a token counts as
# settled (5 % of a near-dead layer's L0 ~1 is below what 32 k tokens resolve).
SETTLE_FRACTION = 0.2
SETTLE_TOL = 0.05
SETTLE_ABS_UNITS = 0.5


def settle_check(steps: list[int], l0_SL: list[list[float] | float | None], total_steps: int,
                 *, fraction: float = SETTLE_FRACTION, tol: float = SETTLE_TOL,
                 abs_units: float = SETTLE_ABS_UNITS) -> dict:
    """Has a run's per-layer L0 settled over the last ``fraction`` of its ``total_steps``?

    Args:
        steps: (S,) the logged optimizer steps, ascending.
        l0_SL: (S, L) per-layer training L0 at those steps (a float per step: the mean over
            layers, for result files that did not keep the layers); None entries are skipped.
        total_steps: the run's optimizer steps; the window is ``step > (1 - fraction) *
            total_steps``.

    Returns:
        ``{"settled", "change_pct", "layer", "start", "end", "window", "points", "basis"}``:
        ``start`` / ``end`` (L,) the mean L0 of the window's first / last ``k = max(1, n // 5)``
        of its n points; per layer the relative change ``|end - start| / start``; ``settled``
        True when every layer's change is below ``tol`` or below ``abs_units`` in absolute
        terms, None when the window holds fewer than 2 points; ``change_pct`` the largest
        relative change in % of a layer that fails the rule (when none fails, the largest finite
        one: a near-dead layer's large relative move under ``abs_units`` does not decide), 0-based
        ``layer`` where it is, ``window`` [first, last] step of
        the window, ``basis`` ``per-layer`` or ``mean`` (one value a step).

    Raises:
        ValueError: ``steps`` and ``l0_SL`` differ in length, or rows of different lengths.
    """
    if len(steps) != len(l0_SL):
        raise ValueError(f"steps ({len(steps)}) and l0_SL ({len(l0_SL)}) differ in length")
    pts = [(st, [v] if not isinstance(v, list) else v) for st, v in zip(steps, l0_SL)
           if v is not None and st > (1 - fraction) * total_steps]
    basis = "mean" if any(not isinstance(v, list) for v in l0_SL if v is not None) else "per-layer"
    if len({len(v) for _, v in pts}) > 1:
        raise ValueError("l0_SL rows differ in length (layers)")
    out = {"settled": None, "change_pct": None, "layer": None, "start": None, "end": None,
           "window": [pts[0][0], pts[-1][0]] if pts else None, "points": len(pts),
           "basis": basis}
    if len(pts) < 2:
        return out
    k = max(1, len(pts) // 5)
    L = len(pts[0][1])
    start = [sum(v[i] for _, v in pts[:k]) / k for i in range(L)]
    end = [sum(v[i] for _, v in pts[-k:]) / k for i in range(L)]
    rel = [abs(b - a) / a if a > 0 else (0.0 if b == a else math.inf) for a, b in zip(start, end)]
    ok = [r < tol or abs(b - a) < abs_units for r, a, b in zip(rel, start, end)]
    failing = [i for i in range(L) if not ok[i]]
    # none failing: the largest finite move (a layer from 0 units moves by inf %, under 0.5 units)
    finite = [i for i in range(L) if math.isfinite(rel[i])]
    worst = max(failing or finite or range(L), key=lambda i: rel[i])
    out.update(settled=all(ok), change_pct=100 * rel[worst], layer=worst, start=start, end=end)
    return out


def row_result(row: StudyRow, run_dir: Path, ckpt: Path, profile: dict, s: StudySettings,
               timing: dict, evals: dict | None = None) -> dict:
    """The result file of a finished row: what the report needs, without the run directory."""
    import torch
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.load(Path(run_dir) / "config.yaml"), resolve=True)
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    train = read_train_lines(run_dir)
    curves = {k: [r.get(k) for r in train] for k in ("step", "tokens", "ce", "l0_mean",
                                                     "dead_frac", "tokens_per_s", "mfu")}
    curves["l0_layers"] = [[round(v, 3) for v in r["l0_layers"]] if r.get("l0_layers") else None
                           for r in train]
    last_dead = next((r["dead_layers"] for r in reversed(train) if r.get("dead_layers")), None)
    steps = config["trainer"]["max_steps"]
    settle = settle_check(curves["step"], [c if c is not None else m for c, m in
                                           zip(curves["l0_layers"], curves["l0_mean"])], steps)
    dev = "cpu"
    if torch.cuda.is_available() and not s.cpu:
        dev = torch.cuda.get_device_name(0)
    m = config["model"]
    return {
        "format": RESULT_FORMAT,
        "row": {**asdict(row), "name": row.name, "layers": m["num_layers"],
                "hidden": m["hidden_size"], "steps": steps, "series": row.series},
        "settings": asdict(s),
        "config": config,
        "summary": {k: v for k, v in summary.items() if k != "paths"},
        "checkpoint": str(ckpt),
        "profile": profile,
        "evals": evals,
        "settle": settle,
        "curves": curves,
        "dead_layers_last_window": last_dead,
        "timing": timing,
        "device": dev,
        "torch": torch.__version__,
    }


def most_dead_row(folders: list[Path], steps: int, size: str = DEPTH_MODEL
                  ) -> tuple[int, float, float] | None:
    """The depth-series row where most units die: ``(layers, l1_coeff, dead %)`` of the sparse,
    not re-initialised, non-probe row of ``size`` at ``steps`` steps with the highest dead % of
    training's last dead-neuron window (``summary.dead_pct``), among the result files in
    ``folders``; None when there is none (run the sparse rows first)."""
    best = None
    for d in folders:
        for p in sorted(Path(d).glob("*.json")) if Path(d).is_dir() else []:
            try:
                r = json.loads(p.read_text())
                row, dead = r["row"], r["summary"].get("dead_pct")
            except (ValueError, KeyError, TypeError):
                continue
            if (row.get("series") != "depth" or row["size"] != size or row.get("steps") != steps
                    or row["reinit"] or row.get("probe") or row["l1_coeff"] <= 0 or dead is None):
                continue
            if best is None or dead > best[2]:
                best = (row["layers"], row["l1_coeff"], dead)
    return best


def reinit_rows(spec: str, depths: list[int], l1s: list[float], steps: int,
                folders: list[Path], log=print) -> list[tuple[int, float]]:
    """The depth series' re-initialisation rows (``scripts/scaling_study.py --reinit-rows``) as
    ``(layers, l1)`` pairs: ``LAYERS:L1,...`` as given, or ``auto``: once every sparse row of
    ``depths`` x ``l1s`` at the deepest and the shallowest depth has a result file in
    ``folders`` (the rows the plan runs before the re-init row), the row where most units die
    (:func:`most_dead_row`; so the pick does not change from call to call); until then none.
    ``log`` gets one line on the pick (or why there is none yet).

    Raises:
        ValueError: an entry that is not ``LAYERS:L1``."""
    spec = spec.strip()
    if not spec:
        return []
    if spec == "auto":
        ends = {min(depths), max(depths)}
        need = [r.name for r in plan_depth_rows(depths, l1s, steps)
                if r.layers in ends and r.l1_coeff > 0]
        missing = [n for n in need if n not in result_names(folders)]
        got = None if missing else most_dead_row(folders, steps)
        if got is None:
            log("re-init row: none yet (--reinit-rows auto picks the sparse row where most units "
                "die once the sparse rows at the deepest and shallowest depth have results; "
                f"missing {len(missing)} of {len(need)})")
            return []
        log(f"re-init row: {got[0]} layers at L1 {l1_text(got[1])} ({got[2]:.1f} % dead units at "
            "the end of training, the most of the series' sparse rows)")
        return [(got[0], got[1])]
    out = []
    for item in spec.split(","):
        try:
            layers, l1 = item.split(":")
            out.append((int(layers), float(l1)))
        except ValueError:
            raise ValueError(f"--reinit-rows entry {item!r} is not LAYERS:L1 (e.g. 38:1e-3) or "
                             "'auto'") from None
    return out


def measured_tflops(folders: list[Path], size: str = DEPTH_MODEL) -> tuple[float, int] | None:
    """The slowest training rate the depth-series results in ``folders`` measured, in TFLOP/s,
    and how many results it comes from: per result its last training segment's tokens/s
    (``summary.tokens_per_s``) x :func:`train.metrics.flops_per_token` of its model. The
    estimate of later rows uses it instead of :data:`EFFECTIVE_TFLOPS` (the script's default when
    ``--tflops`` is not given); None without such a result."""
    from train.config import ModelConfig
    from train.metrics import flops_per_token

    rates = []
    for d in folders:
        for p in sorted(Path(d).glob("*.json")) if Path(d).is_dir() else []:
            try:
                r = json.loads(p.read_text())
                row, tok_s = r["row"], r["summary"].get("tokens_per_s")
                m = r["config"]["model"]
            except (ValueError, KeyError, TypeError):
                continue
            if row.get("series") != "depth" or row["size"] != size or not tok_s:
                continue
            shape = ModelConfig(**{k: m[k] for k in ("name", "vocab_size", "hidden_size",
                                                     "intermediate_size", "num_layers",
                                                     "num_heads", "num_kv_heads", "seq_len",
                                                     "gated") if k in m})
            rates.append(tok_s * flops_per_token(shape) / 1e12)
    return (min(rates), len(rates)) if rates else None


def write_json_atomic(path: Path, obj: dict) -> Path:
    """Write ``obj`` as JSON to ``path`` through a temporary file and a rename (no half file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, separators=(",", ":")))
    os.replace(tmp, path)
    return path


def prune_checkpoint(ckpt: Path, keep: str) -> None:
    """``full``: nothing; ``weights``: delete the optimizer state (the bulk: 8 bytes a
    parameter; the run can no longer be resumed, its weights still load); ``none``: delete the
    run's ``checkpoints/`` folder."""
    if keep == "weights":
        (Path(ckpt) / "optimizer.pt").unlink(missing_ok=True)
    elif keep == "none":
        shutil.rmtree(Path(ckpt).parent, ignore_errors=True)


__all__ = [
    "DEPTH_MODEL",
    "DEPTH_PROBE_L1",
    "DEPTH_PROBE_STEPS",
    "DEPTH_STEPS",
    "EFFECTIVE_TFLOPS",
    "KEEP",
    "PAPER_DEPTHS",
    "PAPER_L0_RANGE",
    "PAPER_SIZES",
    "TOKENS_PER_MS",
    "RowOutcome",
    "StudyRow",
    "StudySettings",
    "check_row_configs",
    "checkpoint_gb",
    "estimate_seconds",
    "eval_seconds",
    "final_checkpoint",
    "l1_gradient_kept",
    "l1_text",
    "measured_tflops",
    "model_shape",
    "most_dead_row",
    "pack_calls",
    "paper_params",
    "plan_depth_rows",
    "plan_probe_rows",
    "plan_rows",
    "plan_text",
    "post_train",
    "profile_run",
    "prune_checkpoint",
    "read_train_lines",
    "reinit_rows",
    "result_names",
    "row_evals",
    "row_overrides",
    "row_params",
    "row_result",
    "row_steps",
    "run_row",
    "run_study",
    "series_key",
    "series_text",
    "settle_check",
    "several_steps",
    "write_json_atomic",
]
