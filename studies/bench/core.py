"""The state of one size's benchmark and its first stages: the settings of a run, the bench
model with its held-out L0 and checks (:func:`prepare`), the forward of every inference impl
(:func:`measure_forward`), and the helpers the per-budget stages (``studies.bench.stages``)
build their rows and searches with.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from studies.bench.recipe import (
    BASELINE_PATHS,
    EXPERIMENTS,
    FFN_OF_IMPL,
    FORWARD_IMPL,
    PATH_FFNS,
    PATHS,
    SMOKE_SIZE,
    Recipe,
    default_overrides,
    split_profile_path,
    stage1_overrides,
)
from studies.bench.search import SATURATION_TOKENS, Budget, Choice, FakeMemory, SharedProbe, search
from studies.bench.source import (
    BenchModel,
    SettleRule,
    heldout_blocks,
    load_bench_model,
    pick_layers,
    record_layers,
    reference_checks,
    train_bench_model,
)
from studies.bench.steps import (
    STATIC_BYTES_PER_PARAM,
    Clock,
    build_hf,
    build_ours,
    free_memory,
    log,
    time_steps,
)
from studies.sizes import check_sizes
from train.liger import liger_enabled
from train.memory import Candidate
from train.setup import use_fused_ops


@dataclass
class BenchSettings:
    """Everything one run does (``scripts/bench_model.py``'s options).

    Attributes:
        sizes: model config names, one after another (``configs/model``).
        paths: the paths to time (:data:`studies.bench.recipe.PATHS`).
        budgets: the cards, in timing order (:class:`studies.bench.search.Budget`); the cheaper
            card first by default, so that under the deadline its rows are complete first.
        model_from: a trainer checkpoint folder to bench (one size), instead of training.
        recipe: stage 1 when the model is trained here (``recipe.steps``: the most steps).
        settle: when stage 1 stops early (settled L0 or a target L0).
        train_budget_s: stage 1's time box (default 0.45 x ``deadline_s``: none without one).
        steps, warmup: timed and untimed steps per row.
        search_batch: the micro-batch (= global batch) our trainer is built with; the rows
            then time the searched micro-batch, one per step.
        candidate_batch: sequences per step on one rank whose micro-batch candidates the
            search tries (``ceil(P / a)``, :func:`train.memory.micro_batch_candidates`): 512,
            the paper experiments' global batch, so the paths are searched over the
            micro-batches the default run's planner tries (with 48 the search skipped 20 and
            40, where the 1.5B default ran faster than ``ell``; BENCHMARKS.md).
        saturation_tokens: :data:`studies.bench.search.SATURATION_TOKENS` (0: every mode).
        probe_steps: timed forward+backward micro-steps per probe (after one warm-up).
        equal_micro: the micro-batch of the equal-micro-batch memory ratio (probed, ``none``).
        fwd_batch, fwd_steps, fwd_warmup: the forward measurement; ``fwd_warmup`` applies to
            ``auto`` (>= 8: the measured inference ``auto`` times both of its paths on each
            layer's first calls), the other impls warm up with 2 calls.
        profile_tokens: held-out tokens of the sparsity profile (the L0 every row names).
        pool_sequences: held-out sequences the timed steps draw from.
        acts_dir, acts_tokens: record the FFN inputs (``acts_tokens`` held-out tokens) of the
            layers with the lowest, median and highest L0 there (None: not recorded).
        deadline_s: seconds for the whole run, outputs included (default: no limit; the
            driver script passes its ``--deadline``).
        config: Hydra overrides for stage 1 and our trainer (data location and the like).
        out: output folder; work_dir: trainer run folders (a temporary folder if None).
        plots: write the PNGs.
        smoke: the tiny CPU run (``fake_memory`` stands in for CUDA memory).
        profile_micro: micro-batches at which to profile one step of each of
            ``profile_paths`` (:func:`studies.bench.step_profile.profile_paths`; CUDA only)
            before the search; empty: no profile.
        profile_only: profile, then skip the search and the timed rows (with
            ``profile_forward``: the forward and its profile, then stop).
        profile_forward: after the forward, profile one forward of each inference impl it
            timed (:func:`studies.bench.forward_profile.profile_forward`; CUDA only):
            ``forward_profile_<size>.md`` / ``.csv``, GPU time by op family and the longest
            kernels by name.
        save_model: keep the bench model trained here as a checkpoint in ``work_dir`` (for a
            later run's ``model_from`` on the same machine).
    """

    sizes: list[str] = field(default_factory=lambda: ["1p5b"])
    paths: tuple[str, ...] = PATHS
    budgets: list[Budget] = field(default_factory=lambda: [Budget(80.0), Budget(139.0)])
    model_from: Path | None = None
    recipe: Recipe = field(default_factory=Recipe)
    settle: SettleRule = field(default_factory=SettleRule)
    train_budget_s: float | None = None
    steps: int = 50
    warmup: int = 3
    search_batch: int = 48
    candidate_batch: int = 512
    saturation_tokens: int = SATURATION_TOKENS
    probe_steps: int = 1
    equal_micro: int = 8
    fwd_batch: int = 16
    fwd_steps: int = 8
    fwd_warmup: int = 10
    profile_tokens: int = 65536
    pool_sequences: int = 256
    acts_dir: Path | None = None
    acts_tokens: int = 16384
    deadline_s: float = math.inf
    config: list[str] = field(default_factory=list)
    out: Path = Path("docs/model_bench")
    work_dir: Path | None = None
    plots: bool = True
    smoke: bool = False
    fake_memory: FakeMemory | None = None
    profile_micro: tuple[int, ...] = ()
    profile_paths: tuple[str, ...] = ("hf", "liger", "dense", "ell", "auto", "dense-noliger",
                                      "ell-noliger")
    profile_only: bool = False
    profile_forward: bool = False
    save_model: bool = False

    def __post_init__(self) -> None:
        bad = [p for p in self.paths if p not in PATHS]
        if not self.paths:
            raise ValueError(f"--paths: give at least one of {', '.join(PATHS)}")
        if bad:
            raise ValueError(f"--paths: unknown {bad}; use some of {', '.join(PATHS)}")
        for p in self.profile_paths:
            split_profile_path(p)  # ValueError naming an unknown path or a bad override
        if not self.sizes:
            raise ValueError("--sizes: no size given; name one or more configs/model/<size>")
        if not self.smoke:  # an unknown size: named with the known ones, before what needs one
            check_sizes(self.sizes, "--sizes")
        if self.model_from is not None and len(self.sizes) != 1:
            raise ValueError(f"--model-from holds one model; give one --sizes (got {self.sizes})")
        for k in ("steps", "search_batch", "candidate_batch", "probe_steps", "equal_micro",
                  "fwd_batch",
                  "fwd_steps", "pool_sequences", "profile_tokens"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1; got {getattr(self, k)}")
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s (--deadline) must be > 0 seconds; got {self.deadline_s}")
        if self.recipe.l1 is not None and not (math.isfinite(self.recipe.l1)
                                               and self.recipe.l1 >= 0):
            raise ValueError(f"recipe.l1 (--l1) must be a number >= 0; got {self.recipe.l1}")
        if not (math.isfinite(self.recipe.lr) and self.recipe.lr > 0):
            raise ValueError(f"recipe.lr (--lr) must be a number > 0; got {self.recipe.lr}")
        if not (math.isfinite(self.settle.tolerance) and self.settle.tolerance > 0):
            raise ValueError("settle.tolerance (--settle-tolerance) must be a number > 0; got "
                             f"{self.settle.tolerance}")
        if self.train_budget_s is not None and not self.train_budget_s > 0:
            raise ValueError("train_budget_s (--train-budget) must be > 0 seconds; got "
                             f"{self.train_budget_s}")
        for k in ("warmup", "saturation_tokens"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k} (--{k.replace('_', '-')}) must be >= 0; got "
                                 f"{getattr(self, k)}")
        if self.model_from is not None and not (Path(self.model_from) / "config.json").is_file():
            raise FileNotFoundError(f"--model-from {self.model_from}: not a checkpoint folder (no "
                                    "config.json; a trainer's checkpoints/step<N>)")
        if "default" in self.paths and not self.smoke:
            missing = [s for s in self.sizes if s not in EXPERIMENTS]
            if missing:
                raise ValueError(f"sizes {missing} have no paper experiment for the default "
                                 f"path ({', '.join(EXPERIMENTS)}); leave default out of --paths")

    @classmethod
    def for_smoke(cls, out: Path, recipe: dict | None = None, **kw) -> BenchSettings:
        """The ``--smoke`` run: tiny shape, fp32 on the CPU, synthetic tokens, a fake memory
        model, 6 training steps, 3 timed steps per row; ``recipe``: :class:`Recipe` fields
        that replace the smoke's (e.g. ``steps``, ``deterministic``, ``target_l0``)."""
        smoke_recipe = Recipe(l1=0.05, warmup_steps=2, micro_batch=4, steps=6, log_every=2)
        base = {"sizes": [SMOKE_SIZE],
                "recipe": dataclasses.replace(smoke_recipe, **(recipe or {})),
                "steps": 3, "warmup": 1, "search_batch": 8, "candidate_batch": 8, "equal_micro": 4,
                "fwd_batch": 4,
                "fwd_steps": 2, "fwd_warmup": 1, "profile_tokens": 256, "pool_sequences": 16,
                "deadline_s": 600.0, "smoke": True, "fake_memory": FakeMemory(), "out": out}
        return cls(**{**base, **kw})


@dataclass
class SizeRun:
    """The state of one size's benchmark (built by :func:`prepare`)."""

    size: str
    s: BenchSettings
    clock: Clock
    device: torch.device
    bf16: bool
    cfg1: object
    data: object
    bm: BenchModel
    checks: dict
    pool_NT: torch.Tensor
    work: Path
    smoke_tokens: Path | None
    fwd: dict = field(default_factory=dict)
    choices: dict = field(default_factory=dict)  # (ffn, Budget) -> Choice
    timed: dict = field(default_factory=dict)  # (path, *Choice.key) -> the row first timed
    default_rows: dict = field(default_factory=dict)  # (ffn, micro, recompute) -> row
    rows: list = field(default_factory=list)
    probes: list = field(default_factory=list)
    capacity_trace: list = field(default_factory=list)  # capacity_trace.csv's rows
    meta: dict = field(default_factory=dict)
    builds: int = 0

    @property
    def seq_len(self) -> int:
        return self.cfg1.model.seq_len

    @property
    def n_params(self) -> int:
        return sum(v.numel() for k, v in self.bm.weights.items() if k != "lm_head.weight")

    def est_step_s(self, micro: int, tok_per_ms: float | None) -> float:
        """A training step's seconds from a probe's forward+backward tokens/ms (+ 20 %: clip,
        optimizer, the step's statistics)."""
        if not tok_per_ms:
            return 1.0
        return 1.2 * micro * self.seq_len / (tok_per_ms * 1e3)

    def est_build_s(self) -> float:
        return 2.0 + 4.0 * self.n_params / 1.5e9 if self.device.type == "cuda" else 1.0


# ---------------------------------------------------------------- stage 1: the model


def prepare(s: BenchSettings, size: str, clock: Clock, work: Path,
            smoke_tokens: Path | None) -> SizeRun:
    """The data module, the bench model, held-out blocks, checks and profile of one size."""
    from train.config import compose
    from train.data import build_datamodule

    t0 = clock.elapsed()
    dev = torch.device("cuda" if torch.cuda.is_available() and not s.smoke else "cpu")
    cfg1 = compose(stage1_overrides(size, s.recipe, s.config, smoke_tokens))
    data = build_datamodule(cfg1.data, seq_len=cfg1.model.seq_len,
                            micro_batch=s.recipe.micro_batch, seed=cfg1.trainer.seed)
    if s.model_from is not None:
        bm = load_bench_model(s.model_from, cfg1.model, size=size, pin=dev.type == "cuda",
                              ffn_cfg=cfg1.ffn)
    else:
        budget = s.train_budget_s if s.train_budget_s is not None else 0.45 * s.deadline_s
        bm = train_bench_model(cfg1, data, work / f"{size}_stage1", dev, size=size,
                               rule=s.settle, budget_s=min(budget, clock.left() - 60),
                               save=s.save_model)
    log(f"{size}: bench model: {bm.source}")
    clock.mark("model", t0)
    t1 = clock.elapsed()
    n = max(s.pool_sequences, s.profile_tokens // cfg1.model.seq_len, 2)
    blocks_NT, source = heldout_blocks(data, n)
    bf16 = dev.type == "cuda" and cfg1.trainer.precision in ("auto", "bf16")
    prof_n = max(1, s.profile_tokens // cfg1.model.seq_len)
    checks = reference_checks(bm, blocks_NT[:prof_n], dev, bf16=bf16,
                              profile_batch=s.recipe.micro_batch)
    if s.acts_dir is not None:
        blocks = blocks_NT[:max(1, s.acts_tokens // cfg1.model.seq_len)]
        record_layers(bm, blocks, pick_layers(checks["profile"]), s.acts_dir, dev,
                      batch=s.recipe.micro_batch)
    clock.mark("checks and profile", t1)
    run = SizeRun(size, s, clock, dev, bf16, cfg1, data, bm, checks, blocks_NT, work,
                  smoke_tokens)
    run.meta.update({
        "source": bm.source, "steps": bm.steps, "l0": checks["l0"],
        "l0_source": f"{checks['profile_tokens']} {source} tokens",
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "n_params": run.n_params, "static_gb": STATIC_BYTES_PER_PARAM * run.n_params / 2**30,
        "checks": {k: v for k, v in checks.items() if k not in ("profile",)},
        "history": bm.history, "budgets": [b.card_gb for b in s.budgets],
        "planner_budgets_gb": [round(b.planner_gb, 2) for b in s.budgets]})
    if "default" in s.paths:
        over = [*default_overrides(size, smoke_tokens), *s.config]
        impl = compose(over).ffn.impl
        run.meta["default"] = {"overrides": over, "ffn_impl": impl, "ffn": FFN_OF_IMPL[impl]}
    log(f"{size}: held-out L0 {checks['l0']:.1f} ({run.meta['l0_source']}); logits vs plain "
        f"transformers rel err {checks['logits_rel_err']:.2e}; hf loss fp32 "
        f"{checks['hf_loss_fp32']:.4f} bf16 {checks['hf_loss_bf16']:.4f}")
    return run


# ---------------------------------------------------------------- stage 2: forward


def measure_forward(run: SizeRun) -> None:
    """Forward tokens/ms of each inference impl the paths need (``run.fwd``, by impl)."""
    s, dev = run.s, run.device
    impls = forward_impls(run)
    ids = forward_ids(run)
    est = len(impls) * (run.est_build_s() + (s.fwd_warmup + s.fwd_steps) * ids.numel()
                        * 2 * run.n_params / 3e14)
    if not run.clock.fits(est if dev.type == "cuda" else 0, f"{run.size} forward"):
        return
    t0 = run.clock.elapsed()
    for impl in impls:
        try:
            decoder = build_forward(run, impl)
            with torch.no_grad():
                w = time_steps(lambda d=decoder: d(input_ids=ids), forward_warmup(run, impl),
                               s.fwd_steps, dev)
            run.fwd[impl] = ids.numel() / statistics.median(w.step_ms)
            log(f"{run.size} forward {impl}: {run.fwd[impl]:.1f} tok/ms ({s.fwd_batch} x "
                f"{run.seq_len})")
        except Exception as e:  # noqa: BLE001  (one impl's failure keeps the others)
            log(f"{run.size} forward {impl} FAILED: {type(e).__name__}: {str(e)[:200]}")
            run.meta.setdefault("errors", []).append(f"forward {impl}: {type(e).__name__}: {e}")
        decoder = None
        free_memory(dev)
    run.clock.mark("forward", t0)


def forward_impls(run: SizeRun) -> list[str]:
    """The inference impls whose forward the run's paths report
    (:data:`studies.bench.recipe.FORWARD_IMPL`), in the paths' order, each once."""
    return list(dict.fromkeys(FORWARD_IMPL[f] for p in run.s.paths for f in _ffns_of(run, p)))


def forward_ids(run: SizeRun) -> torch.Tensor:
    """The forward's (fwd_batch, T) int64 token ids on the run's device: held-out sequences
    (repeated when fwd_batch exceeds the pool)."""
    s = run.s
    ids = run.pool_NT.repeat(math.ceil(s.fwd_batch / run.pool_NT.shape[0]), 1)[:s.fwd_batch]
    return ids.to(run.device)


def forward_warmup(run: SizeRun, impl: str) -> int:
    """Untimed forwards before timing ``impl``: ``fwd_warmup`` for ``auto`` (its measured
    choice times both paths on each layer's first calls), at most 2 for the others."""
    return run.s.fwd_warmup if impl == "auto" else min(2, run.s.fwd_warmup)


def build_forward(run: SizeRun, impl: str):
    """The decoder stack (no LM head) of the bench model in eval mode for inference impl
    ``impl``: stock transformers for the baselines (``hf``, ``liger``, ``compile``), else our
    model of ``ffn.impl=impl`` without the FFNs' statistics, with Liger-Kernel where our
    trainer would run it and then what its setup installs (:func:`train.setup.use_fused_ops`):
    the norms through ``rms_norm_cast`` and each residual add joined to the norm after it
    (``train.residual_join``: in this no-grad bf16 forward the sum is bf16); bf16 when the run
    is."""
    from twell.hf import ffn_modules
    from twell.nn.plan import FFNPlan

    dev = run.device
    dtype = torch.bfloat16 if run.bf16 else None
    if impl in BASELINE_PATHS:
        model = build_hf(run.bm.model_cfg, run.bm.weights, dev, dtype, variant=impl)
    else:
        model = build_ours(run.bm.model_cfg, run.bm.weights, dev, dtype, ffn=run.cfg1.ffn,
                           impl=impl)
        FFNPlan(ffn_modules(model)).set_collect_stats(False)  # no counting pass
        if liger_enabled(None, device_type=dev.type, precision="bf16" if run.bf16 else "fp32",
                         compile=False):
            # what our trainer installs (no loss here)
            use_fused_ops(model, run.cfg1.trainer, device_type=dev.type, fused_linear_ce=False)
    return model.eval().model


def _ffns_of(run: SizeRun, path: str) -> tuple[str, ...]:
    if path == "default":
        return (run.meta.get("default", {}).get("ffn") or "torch",)
    return PATH_FFNS[path]


# ---------------------------------------------------------------- rows


def new_row(run: SizeRun, path: str, budget: Budget, **kw) -> dict:
    """A ``best_configs.csv`` row with the size's columns filled (held-out L0, forward)."""
    ffn = kw.get("ffn")
    fwd = run.fwd.get(FORWARD_IMPL.get(ffn, "")) if ffn else None
    row = {"size": run.size, "budget_gb": budget.card_gb, "path": path, "l0": run.checks["l0"],
           "fwd_tok_per_ms": fwd, "is_default": path == "default"}
    row.update(kw)
    return row


def add_row(run: SizeRun, row: dict) -> None:
    run.rows.append(row)
    speed = row.get("train_tok_per_ms_wall")
    log(f"{run.size} {row['budget_gb']:g} GB {row['path']:>7} ({row.get('ffn')}): micro "
        f"{row.get('micro_batch')} x {row.get('recompute')}: " + (
            f"{row['train_tok_per_ms']:.1f} tok/ms median, {speed:.1f} wall, peak "
            f"{row['peak_gb'] or float('nan'):.1f} GB, redos {row.get('redos', 0)}"
            if speed else (row.get("notes") or "not timed")))


def skipped_row(run: SizeRun, path: str, budget: Budget, why: str, choice: Choice | None = None,
                **kw) -> dict:
    extra = {} if choice is None else {"ffn": choice.ffn, "micro_batch": choice.micro_batch,
                                       "recompute": choice.recompute,
                                       "predicted_peak_gb": choice.step_peak_gb,
                                       "probe_tok_per_ms": choice.probe_tok_per_ms}
    return new_row(run, path, budget, notes=why, **{**extra, **kw})


def timed_fields(run: SizeRun, window, micro: int, choice: Choice | None) -> dict:
    out = window.stats(micro * run.seq_len)
    out["peak_gb"] = window.peak_gb
    if window.peak_gb is None and run.s.fake_memory is not None and choice is not None:
        out["peak_gb"] = choice.step_peak_gb  # no CUDA: the fake model's prediction
    return out


def record_probes(run: SizeRun, ffn: str, probe: SharedProbe, pending_gb: float) -> None:
    for c, m in sorted(probe.measured.items()):
        run.probes.append({"size": run.size, "ffn": ffn, "micro_batch": c.micro_batch,
                           "recompute": c.recompute, "peak_gb": None if m.oom else m.peak_gb,
                           "step_peak_gb": None if m.oom else m.peak_gb + pending_gb,
                           "ms": None if m.oom else m.ms,
                           "tok_per_ms": None if m.oom or not m.ms > 0
                           else c.micro_batch * run.seq_len / m.ms})


def search_ffn(run: SizeRun, ffn: str, probe_fn, pending_gb: float, modes: tuple[str, ...],
               min_probe_tokens: int) -> None:
    """Search one FFN path for every budget (``run.choices``), probe its equal-micro-batch
    point, record every probe."""
    s = run.s
    if s.fake_memory is not None:
        probe_fn = s.fake_memory.probe(ffn, probe_fn)
    probe = SharedProbe(probe_fn)
    t0 = time.monotonic()
    got = search(probe, ffn=ffn, budgets=s.budgets, batch_per_rank=s.candidate_batch,
                 seq_len=run.seq_len, pending_gb=pending_gb, modes=modes,
                 min_probe_tokens=min_probe_tokens, saturation_tokens=s.saturation_tokens)
    probe(Candidate(s.equal_micro, "none"))  # the equal-micro-batch memory ratio
    for b, c in got.items():
        run.choices[(ffn, b)] = c
        log(f"{run.size} search {ffn} {b.label} GB: " + (
            f"micro {c.micro_batch} x {c.recompute}, predicted peak {c.step_peak_gb:.1f} GB, "
            f"probe {c.probe_tok_per_ms:.1f} tok/ms" if c.fits else c.why))
    record_probes(run, ffn, probe, pending_gb)
    log(f"{run.size} search {ffn}: {len(probe.measured)} probes in "
        f"{time.monotonic() - t0:.1f} s")


def reuse(run: SizeRun, path: str, b: Budget, choice: Choice) -> dict | None:
    """The row of the same configuration timed for an earlier budget, as this budget's row."""
    first = run.timed.get((path, *choice.key))
    if first is None:
        return None
    return {**first, "budget_gb": b.card_gb, "predicted_peak_gb": choice.step_peak_gb,
            "is_default": False,  # this card's default run decides (stages.mark_default)
            "notes": f"the configuration of the {first['budget_gb']:g} GB card: timed once"}


__all__ = ["BenchSettings", "SizeRun", "add_row", "build_forward", "forward_ids", "forward_impls",
           "forward_warmup", "measure_forward", "new_row", "prepare",
           "record_probes", "reuse", "search_ffn", "skipped_row", "timed_fields"]
