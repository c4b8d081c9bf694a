"""The scaling-of-sparsity study at the paper's model sizes, in self-contained pieces.

    from train.scaling import StudySettings, plan_rows, run_study
    rows = plan_rows(["0p5b", "1b", "1p5b", "2b"], [3e-4, 1e-4], reinit_sizes=["1p5b"])
    run_study(rows, StudySettings(), out=Path("out"), runs_dir=Path("runs/scaling"), max_wall=540)

The paper (arXiv 2603.23198, "Results") trains 0.5B / 1B / 1.5B / 2B models (8 / 18 / 28 / 38
layers, hidden 2048, FFN 5632) and finds that larger models keep fewer FFN units active per
token (39 -> 29 -> 24 from 0.5B to 2B at L1 2e-5), that activity forms a hump over depth, that
the first tokens of a sequence fire far more units, and that re-initialising dead gate rows
keeps units alive. A *row* of this study is one size at one L1 coefficient, optionally with the
paper's dead-gate re-initialisation (``sparsity=l1_reinit``); every row trains from scratch on
the same tokens of the data (same seed, steps, batch and sequence length), so the rows differ
only in the model and the sparsity settings.

A row is one piece that fits one call of a GPU machine that keeps nothing between calls:

1. train it (:func:`train.jobs.run_jobs`: ``python -m train`` in ``<runs_dir>/<row>/``; a stopped
   row continues from its checkpoint when started again in the same run directory);
2. profile its final checkpoint on held-out blocks (:func:`train.profile.profile_sparsity`);
3. write ``<out>/<row>.json`` (:func:`row_result`: config, summary, the profile, the curves of
   L0, CE and dead units over training from ``metrics.jsonl``), a few hundred KB.

A row whose result file exists in ``out`` (or in a folder of earlier results) is skipped, so the
same command can run call after call. The run directory keeps the final checkpoint
(``checkpoints/step{N}/``; ``keep`` prunes it) for later commands of the same call.
:mod:`train.scaling_report` merges the result files of several calls and draws the plots.

The training recipe is ``scripts/bench_model.py``'s bench model (L1 3e-4 row = its stage 1):
AdamW lr 1e-3, 10 warmup steps then cosine, micro-batch = global batch = 8 sequences of 2048,
``model.ffn_impl=auto``, 200 steps = 3,276,800 tokens; here without activation recomputation
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from train.jobs import ROOT, Job, run_finished, run_jobs, train_command

PAPER_SIZES = ("0p5b", "1b", "1p5b", "2b")
# Training tokens/ms on one H200 at micro-batch 8 x 2048 without activation recomputation: the
# 1.5B and 2B shapes measured 33.8 and 25.3 (plain transformers step, BENCHMARKS.md, "Whole
# model"); 0.5B and 1B scaled from them by layer count. Used for the time estimate only.
TOKENS_PER_MS = {"0p5b": 100.0, "1b": 50.0, "1p5b": 34.0, "2b": 25.0}
# Per-row seconds besides training: process start, model build, first Triton compilations,
# validation, checkpoint write (12 bytes a parameter: fp32 weights and AdamW's two moments) and
# the profile (reading the weights back). A guess, not measured; each result file records the
# row's measured wall times (``timing``), which the estimate should be checked against.
ROW_START_S = 45.0
CHECKPOINT_BYTES_PER_PARAM = 12
DISK_BYTES_PER_S = 1.5e9
RESULT_FORMAT = 1
KEEP = ("full", "weights", "none")


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
    """

    size: str
    l1_coeff: float
    reinit: bool = False

    @property
    def name(self) -> str:
        """Run directory and result file name, e.g. ``1p5b_l1_3e-4`` or ``1p5b_l1_3e-4_reinit``."""
        return f"{self.size}_l1_{l1_text(self.l1_coeff)}" + ("_reinit" if self.reinit else "")


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
    for what, xs in (("sizes", sizes), ("l1", l1s)):
        if len(set(xs)) != len(xs):
            raise ValueError(f"--{what} lists a value twice: {list(xs)}")
    if any(not (v >= 0 and math.isfinite(v)) for v in l1s):
        raise ValueError(f"--l1 values must be finite and >= 0; got {list(l1s)}")
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


@dataclass
class StudySettings:
    """What every row shares (the defaults: ``scripts/bench_model.py``'s bench-model recipe).

    Attributes:
        tokens: training tokens per row (rounded to whole steps of ``global_batch * seq_len``).
        micro_batch, global_batch: sequences per forward and per optimizer step.
        seq_len: tokens per sequence (the paper's 2048).
        lr, warmup_steps: AdamW peak learning rate and its linear warmup (then cosine).
        dead_window_tokens: tokens a unit must stay inactive to count as dead (the paper: one
            ~1M-token step; ``sparsity.dead_window_tokens``); also the re-init interval.
        seed: init and data order of every row.
        log_every: steps between metric lines (the L0 / CE / dead curves).
        val_sequences: held-out sequences of the final validation loss.
        profile_tokens: held-out tokens profiled (the first blocks of the validation split).
        ffn_impl: ``model.ffn_impl``.
        cpu: train and profile on the CPU (fp32).
        smoke: tiny shapes for tests (``model=tiny`` at width 32, 1-4 layers by size).
        keep: what stays of a finished row's checkpoint: ``full``, ``weights`` (optimizer state
            deleted) or ``none``.
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
    overrides: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for k in ("tokens", "micro_batch", "global_batch", "seq_len", "dead_window_tokens",
                  "log_every", "val_sequences", "profile_tokens"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"{k} must be >= 1; got {getattr(self, k)}")
        if self.global_batch % self.micro_batch:
            raise ValueError(f"global_batch {self.global_batch} is not a multiple of micro_batch "
                             f"{self.micro_batch}")
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

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def steps(self) -> int:
        """Optimizer steps of every row: ``tokens`` rounded to whole steps (at least one)."""
        return max(1, round(self.tokens / self.tokens_per_step))


def row_overrides(row: StudyRow, s: StudySettings) -> list[str]:
    """The Hydra overrides of one row's training run."""
    if s.smoke:
        layers = {name: i + 1 for i, name in enumerate(PAPER_SIZES)}.get(row.size, 2)
        model = ["model=tiny", "model.name=" + row.size, "model.hidden_size=32",
                 "model.intermediate_size=64", "model.num_heads=2", f"model.num_layers={layers}"]
    else:
        model = [f"model={row.size}"]
    if s.cpu:
        trainer = ["trainer=cpu", "trainer.cpu=true", "trainer.precision=fp32",
                   "trainer.num_threads=1"]
    else:
        trainer = ["trainer=gpu", "trainer.grad_checkpointing=false"]
    return [
        *model, f"model.seq_len={s.seq_len}", f"model.ffn_impl={s.ffn_impl}", *trainer,
        "optim=adamw", f"optim.lr={s.lr!r}", f"optim.warmup_steps={s.warmup_steps}",
        "sparsity=" + ("l1_reinit" if row.reinit else "l1"), f"sparsity.l1_coeff={row.l1_coeff!r}",
        f"sparsity.dead_window_tokens={s.dead_window_tokens}",
        f"trainer.max_steps={s.steps}", f"trainer.micro_batch={s.micro_batch}",
        f"trainer.global_batch={s.global_batch}", f"trainer.seed={s.seed}",
        f"trainer.log_every={s.log_every}", "trainer.val_every=0",
        f"trainer.val_sequences={s.val_sequences}", "trainer.save_every=0", "trainer.keep_last=1",
        "trainer.progress=false", "trainer.resume=auto", "eval=disabled",
        "logging.wandb_mode=disabled", *s.overrides,
    ]


def paper_params(size: str) -> int | None:
    """Parameters of a paper shape (``configs/model/<size>.yaml``; tied embedding counted once),
    or None for another config."""
    if size not in PAPER_SIZES:
        return None
    from omegaconf import OmegaConf

    m = OmegaConf.load(ROOT / "configs" / "model" / f"{size}.yaml")
    d, h, v = m.hidden_size, m.intermediate_size, m.vocab_size
    per_layer = 4 * d * d + (3 if m.gated else 2) * d * h + 2 * d
    return v * d + m.num_layers * per_layer + d


def estimate_seconds(row: StudyRow, s: StudySettings) -> tuple[float, float] | None:
    """(training seconds, whole-row seconds) of a row on one H200 from :data:`TOKENS_PER_MS`,
    :data:`ROW_START_S` and the checkpoint write and read-back; None for a size without a speed
    (or on the CPU)."""
    speed = TOKENS_PER_MS.get(row.size)
    if speed is None or s.cpu:
        return None
    train_s = s.steps * s.tokens_per_step / (speed * 1e3)
    disk_s = (CHECKPOINT_BYTES_PER_PARAM + 4) * paper_params(row.size) / DISK_BYTES_PER_S
    return train_s, train_s + ROW_START_S + disk_s


def checkpoint_gb(row: StudyRow, keep: str) -> float | None:
    """GB a finished row leaves on disk with ``keep`` (the full checkpoint while it is written:
    ``keep="full"``); None for a size that is not a paper shape."""
    params = paper_params(row.size)
    per_param = {"full": CHECKPOINT_BYTES_PER_PARAM, "weights": 4, "none": 0}[keep]
    return None if params is None else per_param * params / 1e9


def plan_text(rows: list[StudyRow], s: StudySettings, skip: set[str],
              free_gb: float | None = None) -> str:
    """The printed plan: each row with its estimate, the totals, and a warning when the
    checkpoints left behind (``s.keep``) would not fit ``free_gb``."""
    lines = [(f"study: {len(rows)} rows, {s.steps} steps x {s.global_batch} x {s.seq_len} = "
              f"{s.steps * s.tokens_per_step:,} tokens each, dead window "
              f"{s.dead_window_tokens:,} tokens, seed {s.seed}")]
    total_train = total = disk = 0.0
    for i, r in enumerate(rows, 1):
        est = estimate_seconds(r, s)
        if r.name in skip:
            lines.append(f"  {i:2d}. {r.name:24s} result exists: skipped")
            continue
        if est is None:
            lines.append(f"  {i:2d}. {r.name:24s} (no speed estimate)")
            continue
        total_train, total = total_train + est[0], total + est[1]
        disk += checkpoint_gb(r, s.keep)
        lines.append(f"  {i:2d}. {r.name:24s} ~{est[0]:4.0f} s training, ~{est[1]:4.0f} s with "
                     f"start, checkpoint and profile (checkpoint "
                     f"{checkpoint_gb(r, 'full'):.0f} GB)")
    if total:
        lines.append(f"estimated GPU time of the rows to run: ~{total_train:.0f} s training, "
                     f"~{total:.0f} s in all (H200 speeds {TOKENS_PER_MS} tok/ms); "
                     f"checkpoints left on disk (--keep {s.keep}): ~{disk:.0f} GB")
        biggest = max(checkpoint_gb(r, "full") or 0 for r in rows)
        if free_gb is not None and disk + biggest > free_gb:
            lines.append(f"WARNING: ~{disk + biggest:.0f} GB of checkpoints may be needed, "
                         f"{free_gb:.0f} GB free: use --keep weights or --keep none")
    return "\n".join(lines)


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
    (a later, shorter one may be). Training gets SIGTERM 60 s before the deadline (10 s on the
    CPU), which leaves time for the profile: the trainer writes a checkpoint and the row resumes
    from it when run again in the same ``runs_dir``. Rows whose result file is in ``out`` or in
    ``skip_results`` are skipped. Returns one :class:`RowOutcome` per row.
    """
    t0 = time.monotonic()
    deadline = t0 + max_wall
    out.mkdir(parents=True, exist_ok=True)
    runs_dir.mkdir(parents=True, exist_ok=True)
    have = result_names([out, *skip_results])
    outcomes = []
    for row in rows:
        if row.name in have:
            outcomes.append(RowOutcome(row, "skipped"))
            continue
        est = estimate_seconds(row, s)
        left = deadline - time.monotonic()
        if est is not None and est[1] > left:
            log(f"{row.name}: not started: needs ~{est[1]:.0f} s, {left:.0f} s left")
            outcomes.append(RowOutcome(row, "not started"))
            continue
        outcomes.append(run_row(row, s, out=out, runs_dir=runs_dir, deadline=deadline, log=log))
    return outcomes


def run_row(row: StudyRow, s: StudySettings, *, out: Path, runs_dir: Path, deadline: float,
            log=print) -> RowOutcome:
    """Train (or resume, or find finished) one row, profile it, write its result file."""
    run_dir = runs_dir / row.name
    t0 = time.monotonic()
    if not run_finished(run_dir, s.steps):
        job = Job(row.name, train_command(row_overrides(row, s), run_dir), run_dir=run_dir)
        reserve = 10.0 if s.cpu else 60.0  # profile and result after training
        run_jobs([job], deadline=deadline - reserve, log=log)
        if not job.ok or not run_finished(run_dir, s.steps):
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
        prof = profile_run(run_dir, ckpt, s)
        timing = {"train_wall_s": round(train_s, 1),
                  "profile_wall_s": round(time.monotonic() - t1, 1)}
        result = row_result(row, run_dir, ckpt, prof, s, timing)
    except Exception as e:  # noqa: BLE001  (one row's failure must not end the other rows)
        log(f"{row.name}: profile failed:\n{traceback.format_exc()}")
        return RowOutcome(row, f"failed (profile: {type(e).__name__})")
    path = write_json_atomic(out / f"{row.name}.json", result)
    prune_checkpoint(ckpt, s.keep)
    pm = prof["l0_mean"]
    sm = result["summary"]
    log(f"{row.name}: done in {time.monotonic() - t0:.0f} s: held-out L0 {_num(pm, '.1f')}, "
        f"dead {_num(sm.get('dead_pct'), '.1f')} % (last window), val loss "
        f"{_num(sm.get('val_loss'), '.4f')}; result {path}")
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
    """Profile a run's checkpoint on the first ``s.profile_tokens`` held-out tokens of its own
    data (its ``config.yaml``; the validation split, else the first training blocks): the
    JSON-ready :meth:`train.profile.SparsityProfile.to_dict`, token texts decoded with the data's
    tokenizer when it has one.

    Raises:
        ValueError: the data has no blocks to profile.
    """
    import torch
    from omegaconf import OmegaConf
    from transformers.utils import logging as hf_logging

    from train.data import DataConfig, build_datamodule
    from train.model import load_model
    from train.profile import profile_sparsity

    hf_logging.disable_progress_bar()  # no "Loading weights" bar per row
    cfg = OmegaConf.to_container(OmegaConf.load(Path(run_dir) / "config.yaml"), resolve=True)
    data = build_datamodule(DataConfig(**cfg["data"]), seq_len=cfg["model"]["seq_len"],
                            micro_batch=cfg["trainer"]["micro_batch"], seed=cfg["trainer"]["seed"])
    n_blocks = max(1, s.profile_tokens // cfg["model"]["seq_len"])
    blocks_BT = _first_blocks(data, n_blocks)
    dev = torch.device("cuda" if torch.cuda.is_available() and not s.cpu else "cpu")
    model = load_model(ckpt).to(dev)
    try:
        prof = profile_sparsity(model, blocks_BT, batch=s.micro_batch)
    finally:
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    tok = getattr(data, "tokenizer", None)
    d = prof.to_dict(decode=None if tok is None else (lambda i: tok.decode([i])))
    d["source"] = "validation" if getattr(data, "val_blocks", 0) else "training"
    return d


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


def row_result(row: StudyRow, run_dir: Path, ckpt: Path, profile: dict, s: StudySettings,
               timing: dict) -> dict:
    """The result file of a finished row: what the report needs, without the run directory."""
    import torch
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.load(Path(run_dir) / "config.yaml"), resolve=True)
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    train = read_train_lines(run_dir)
    curves = {k: [r.get(k) for r in train] for k in ("step", "tokens", "ce", "l0_mean",
                                                     "dead_frac", "tokens_per_s")}
    last_dead = next((r["dead_layers"] for r in reversed(train) if r.get("dead_layers")), None)
    dev = "cpu"
    if torch.cuda.is_available() and not s.cpu:
        dev = torch.cuda.get_device_name(0)
    return {
        "format": RESULT_FORMAT,
        "row": {**asdict(row), "name": row.name, "layers": config["model"]["num_layers"]},
        "settings": asdict(s),
        "config": config,
        "summary": {k: v for k, v in summary.items() if k != "paths"},
        "checkpoint": str(ckpt),
        "profile": profile,
        "curves": curves,
        "dead_layers_last_window": last_dead,
        "timing": timing,
        "device": dev,
        "torch": torch.__version__,
    }


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
    "KEEP",
    "PAPER_SIZES",
    "TOKENS_PER_MS",
    "RowOutcome",
    "StudyRow",
    "StudySettings",
    "checkpoint_gb",
    "estimate_seconds",
    "final_checkpoint",
    "l1_text",
    "paper_params",
    "plan_rows",
    "plan_text",
    "profile_run",
    "prune_checkpoint",
    "read_train_lines",
    "result_names",
    "row_overrides",
    "row_result",
    "run_row",
    "run_study",
    "write_json_atomic",
]
