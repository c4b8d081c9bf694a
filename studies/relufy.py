"""The ReLUfication study of SmolLM2-135M (docs/relufy.md): its rows, their training commands,
the scoring of their checkpoints, the results table, the study's targets and the GPU-time
estimate, and the loop that runs the rows in pieces of a few minutes (scripts/relufy_study.py
is its command line).

    from studies.relufy import Study, StudyPlan, default_rows, run_study
    study = Study(out, work, StudyPlan(tokens=40e6), default_rows())
    run_study(study, parallel=1, max_wall=570)    # resumable: call again to go on

Rows (:class:`RowSpec`; ``kind`` as in the results): ``silu_original`` (the SiLU source, scored
only), ``silu_control`` (the source fine-tuned with its SiLU gate kept, L1 = 0: the same tokens
and recipe, so the ReLU switch's cost is dense ReLU against it, not against the untouched
original), ``dense_relu`` (gate switched to ReLU at load, L1 = 0) and ``sparse`` (ReLU with an
L1 strength, each with and without distillation to the SiLU original). A row may train on a
multiple of the plan's tokens (``RowSpec.tokens_scale``, its own warmup and cosine over them):
``dense_relu_2x``, dense ReLU on twice the tokens, shows where the ReLU switch's cost settles;
the targets compare the rows on the plan's tokens.

Two folders: OUT (small; what comes back from the GPU machine) holds ``study.json`` (the plan,
the source, every invocation's command and each row's last status), ``results.csv``
(:data:`CSV_COLUMNS`, the rows scored so far) and ``rows/<row>/`` (the run's summary.json,
metrics.jsonl, config.yaml, the tail of its log, and score.json); WORK (large; stays there)
holds the converted source (``source_hf/``) and each row's run directory
(``runs/<row>/checkpoints``) and logs. A row is trained by ``python -m train`` in its own run
directory (``trainer.resume=auto``: a stopped row continues from its last checkpoint), then
scored by ``python -m studies.relufy score`` (:func:`score_rows`: the seven tasks' full
validation sets under the trainer's precision, stock transformers modules); a row whose
score.json is in OUT is done and skipped.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from evals.tasks import ALL_TASKS
from studies.jobs import (
    Job,
    check_train_overrides,
    last_train_record,
    run_finished,
    run_jobs,
    train_command,
)

KINDS = ("silu_original", "silu_control", "dense_relu", "sparse")
TASK_COLUMN = {t: "csqa" if t == "commonsense_qa" else t for t in ALL_TASKS}  # results.csv
CSV_COLUMNS = ["row", "kind", "l1_coeff", "distill", "tokens_m", "l0", "l0_pct", "dead_pct",
               "val_loss", *(TASK_COLUMN[t] for t in ALL_TASKS), "mean", "stderr"]
# L1 strengths of the sweep. At 3.6 M tokens (the earlier study, 16 k-token steps, no warmup)
# 0.03 -> L0 177 (11.5 % of 1536), 0.1 -> 55.7 (3.6 %), 0.3 -> 2.4 (0.16 %): the 1-10 % band
# lies between 0.03 and 0.3, and L0 falls faster above 0.1. Seven steps of ~1.4x span it.
DEFAULT_L1 = (0.03, 0.05, 0.07, 0.1, 0.14, 0.2, 0.3)
L1_CENTER = 0.1  # run first (L0 3.6 % at 3.6 M tokens: the middle of the band), then outwards
DEFAULT_TOKENS = 40e6  # per trained row: 2.15 epochs of the corpus
CORPUS_TRAIN_TOKENS = 18_650_289  # the offline corpus's training split (its manifest)
# one H200, a model of SmolLM2-135M's shape, seq 1024, micro-batch 64, trainer.compile, one
# process (measured before this study was set up); the study's target is 250 k
MEASURED_TOKENS_PER_S = 290.5e3
TARGET_TOKENS_PER_S = 250e3
# Estimates, not measurements: a distilled step also runs the teacher's forward (~1/3 of a
# training step's FLOPs) and its LM head; a row's process start, compilation (warm cache),
# final validation and checkpoint writes; one full-set scoring of the seven tasks (57,958
# requests: ~15-30 s of tokenization on the host plus ~15-30 s of forwards on the H200)
DISTILL_COST = 1.4
ROW_START_S = 45.0
# seconds a piece must have left to start a row of the plan's tokens: its training job as
# measured on the H200 (255-284 s: conversion, compilation, 40 M tokens, validation); its
# scoring (~1 min) may fall to the next piece
MIN_START_S = 290.0
SCORE_S = 45.0
# a fresh machine: the GGUF's conversion (34 s) and the first, cold compilation (~85 s from
# a row's start to step 10 on an H200: BENCHMARKS.md, "Calls 4-6: the ReLUfication study's
# first piece")
PIECE_START_S = 120.0


@dataclass(frozen=True)
class RowSpec:
    """One row of the study.

    Attributes:
        name: the row's label (results, folders): ``silu_original``, ``silu_control``,
            ``dense_relu``, ``l1_<coeff>`` and ``l1_<coeff>_kd`` (distilled).
        kind: one of :data:`KINDS`.
        l1_coeff: the L1 strength (0 for the controls, None for the untrained original).
        distill: trained with the distillation term to the SiLU original.
        tokens_scale: its steps as a multiple of the plan's (:meth:`StudyPlan.row_steps`; 2:
            twice a plan row's tokens, with its own warmup and cosine over them). A study.json
            written before this field holds rows without it: 1.
    """

    name: str
    kind: str
    l1_coeff: float | None = None
    distill: bool = False
    tokens_scale: float = 1.0

    @property
    def trains(self) -> bool:
        return self.kind != "silu_original"


# dense ReLU on twice a plan row's tokens: the 40 M-token row still falls where the SiLU control
# has flattened (validation loss 1.747 -> 1.736 over its last quarter against 1.673 -> 1.675)
LONG_DENSE = RowSpec("dense_relu_2x", "dense_relu", 0.0, tokens_scale=2.0)


def sparse_row(l1: float, distill: bool) -> RowSpec:
    """The ``sparse`` row of one L1 strength (> 0), plain or distilled."""
    if not l1 > 0:
        raise ValueError(f"an L1 strength of a sparse row must be > 0; got {l1}")
    return RowSpec(f"l1_{l1:g}" + ("_kd" if distill else ""), "sparse", float(l1), distill)


def default_rows(l1s=DEFAULT_L1, center: float = L1_CENTER) -> list[RowSpec]:
    """The study's rows in the order they run (what a partial study gets first): the SiLU
    original, dense ReLU, the SiLU control, the L1 strength nearest ``center`` (log scale),
    plain then distilled, dense ReLU on twice the tokens (:data:`LONG_DENSE`: where the ReLU
    switch's cost settles), then the other L1 strengths from ``center`` outwards."""
    base = [RowSpec("silu_original", "silu_original"), RowSpec("dense_relu", "dense_relu", 0.0),
            RowSpec("silu_control", "silu_control", 0.0)]
    order = sorted(l1s, key=lambda v: (abs(math.log(v / center)), v))
    sparse = [sparse_row(v, kd) for v in order for kd in (False, True)]
    return base + sparse[:2] + [LONG_DENSE] + sparse[2:]


def study_rows(recorded: list[RowSpec]) -> list[RowSpec]:
    """The rows of a study from the ones its study.json records: a study made with the whole
    default set of its L1 strengths (every :func:`default_rows` row at the plan's tokens)
    gains the default rows added since (:data:`LONG_DENSE`), all in the default order, its own
    records kept; any other study keeps its rows as recorded."""
    have = {r.name: r for r in recorded}
    l1s = sorted({r.l1_coeff for r in recorded if r.kind == "sparse"})
    defaults = default_rows(l1s)
    if not l1s or any(r.name not in have for r in defaults if r.tokens_scale == 1.0):
        return list(recorded)
    names = {r.name for r in defaults}
    return [have.get(r.name, r) for r in defaults] + [r for r in recorded if r.name not in names]


def select_rows(rows: list[RowSpec], names: str) -> list[RowSpec]:
    """``all`` or a comma list of row names (run in that order).

    Raises:
        ValueError: an unknown or repeated name (the message lists the known ones).
    """
    if names.strip() == "all":
        return list(rows)
    by = {r.name: r for r in rows}
    want = [n.strip() for n in names.split(",") if n.strip()]
    bad = [n for n in want if n not in by]
    if bad or len(set(want)) != len(want) or not want:
        raise ValueError(f"--rows {names!r}: unknown or repeated {bad or want}; the rows are "
                         f"{', '.join(by)} (or all)")
    return [by[n] for n in want]


@dataclass
class StudyPlan:
    """The recipe every trained row shares (scripts/relufy_study.py's arguments).

    Attributes:
        tokens: training tokens per row (rounded up to whole steps).
        seq_len, global_batch, micro_batch: tokens a step = global_batch x seq_len.
        lr, warmup_frac: peak lr, its linear warmup as a fraction of the steps (then cosine).
        l1_warmup: (start, end) of the L1 coefficient's linear warmup as fractions of the steps
            (``sparsity.schedule=linear_warmup``), for sparse rows with L1 >= ``l1_warmup_min``.
        distill_weight, distill_temperature: the distilled rows' w and T.
        save_every: checkpoint every N steps (a stopped row loses at most that).
        val_sequences: held-out sequences of the final validation (520: all 517 blocks).
        eval_limit: items per task when scoring (None = full validation sets).
        eval_batch: sequences per scoring forward.
        seed: trainer.seed of every row.
        cpu: the CPU smoke test (fp32, no compile, 1 thread a process).
        overrides: Hydra overrides added to every row (e.g. the data source).
    """

    tokens: float = DEFAULT_TOKENS
    seq_len: int = 1024
    global_batch: int = 64
    micro_batch: int = 64
    lr: float = 1e-3
    warmup_frac: float = 0.1
    l1_warmup: tuple[float, float] = (0.1, 0.3)
    l1_warmup_min: float = 0.0
    distill_weight: float = 1.0
    distill_temperature: float = 1.0
    save_every: int = 200
    val_sequences: int = 520
    eval_limit: int | None = None
    eval_batch: int = 64
    seed: int = 42
    cpu: bool = False
    overrides: list[str] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def steps(self) -> int:
        """Optimizer steps of a trained row: ``ceil(tokens / tokens_per_step)``."""
        return max(1, math.ceil(self.tokens / self.tokens_per_step))

    def row_steps(self, row: RowSpec) -> int:
        """Optimizer steps of ``row``: ``round(row.tokens_scale x steps)`` (its warmup, cosine
        and L1 warmup are fractions of these)."""
        return max(1, round(row.tokens_scale * self.steps))

    def row_tokens(self, row: RowSpec) -> int:
        """Training tokens of ``row``: its steps x tokens a step."""
        return self.row_steps(row) * self.tokens_per_step

    def train_overrides(self, row: RowSpec, source: Path) -> list[str]:
        """The Hydra overrides of a trained row (``python -m train`` adds its run dir). A row
        of more steps validates at the plan row's interval (its curve has points at the same
        steps, then beyond)."""
        if not row.trains:
            raise ValueError(f"{row.name} is not trained")
        steps = self.row_steps(row)
        over = ["experiment=relufy_smollm2", f"model.init_from={source}",
                "model.hidden_act_from=silu",
                f"model.hidden_act={'silu' if row.kind == 'silu_control' else 'relu'}",
                f"model.seq_len={self.seq_len}", f"trainer.global_batch={self.global_batch}",
                f"trainer.micro_batch={self.micro_batch}", f"trainer.max_steps={steps}",
                f"optim.lr={self.lr!r}",
                f"optim.warmup_steps={max(1, round(self.warmup_frac * steps))}",
                f"trainer.val_every={max(1, self.steps // 4)}",
                f"trainer.val_sequences={self.val_sequences}",
                f"trainer.save_every={self.save_every}", "trainer.keep_last=1",
                f"trainer.seed={self.seed}", "trainer.progress=false", "trainer.resume=auto",
                "logging.wandb_mode=disabled", "eval.at_start=false", "eval.at_end=false",
                f"sparsity.l1_coeff={row.l1_coeff!r}"]
        a, b = (round(f * steps) for f in self.l1_warmup)
        if row.kind == "sparse" and row.l1_coeff >= self.l1_warmup_min:
            over += ["sparsity.schedule=linear_warmup", f"sparsity.warmup_start={a}",
                     f"sparsity.warmup_end={max(a + 1, b)}"]
        else:
            over += ["sparsity.schedule=constant"]
        if row.distill:
            over += ["sparsity.distill_from=source",
                     f"sparsity.distill_weight={self.distill_weight!r}",
                     f"sparsity.distill_temperature={self.distill_temperature!r}"]
        if self.cpu:
            over += ["trainer.cpu=true", "trainer.compile=false", "trainer.precision=fp32",
                     "trainer.num_threads=1"]
        return over + list(self.overrides)


# ---------------------------------------------------------------------------------- results

def mean_stderr(tasks: dict) -> float | None:
    """Binomial standard error of the mean of the seven tasks' primary accuracies (fractions):
    ``sqrt(sum_i p_i (1 - p_i) / n_i) / 7``, the tasks independent. ``tasks``: name ->
    ``{"primary", "n"}``; None if a task is missing or has no item."""
    if any(t not in tasks or not tasks[t].get("n") for t in ALL_TASKS):
        return None
    var = sum(tasks[t]["primary"] * (1 - tasks[t]["primary"]) / tasks[t]["n"] for t in ALL_TASKS)
    return math.sqrt(var) / len(ALL_TASKS)


def result_row(row: RowSpec, score: dict, summary: dict | None, ffn_width: int) -> dict:
    """The :data:`CSV_COLUMNS` values of a scored row (accuracies, mean and stderr in %, i.e.
    points; L0 = active FFN units per token on the held-out blocks at the end, None for SiLU
    rows, whose FFN has no zeros; dead % of the last closed 1 M-token window)."""
    s = summary or {}
    relu = row.kind in ("dense_relu", "sparse")
    l0 = s.get("val_l0") if relu else None
    tasks = score["tasks"]
    se = mean_stderr(tasks)
    out = {"row": row.name, "kind": row.kind, "l1_coeff": row.l1_coeff,
           "distill": None if not row.trains else int(row.distill),
           "tokens_m": (s.get("tokens_seen") or 0) / 1e6, "l0": l0,
           "l0_pct": None if l0 is None else 100 * l0 / ffn_width,
           "dead_pct": s.get("dead_pct") if relu else None,
           "val_loss": s.get("val_loss") if row.trains else score.get("val_loss"),
           "mean": 100 * score["mean"], "stderr": None if se is None else 100 * se}
    out.update({TASK_COLUMN[t]: 100 * tasks[t]["primary"] for t in ALL_TASKS})
    return out


def csv_text(rows: list[dict]) -> str:
    """The results as CSV (:data:`CSV_COLUMNS`; None as an empty cell, floats to 6 digits)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else f"{r[k]:.6g}" if isinstance(r[k], float)
                        else r[k]) for k in CSV_COLUMNS})
    return buf.getvalue()


def read_results(path: Path) -> list[dict]:
    """:func:`csv_text`'s rows back (numbers as float, empty cells as None).

    Raises:
        ValueError: a file whose header is not :data:`CSV_COLUMNS` (names the file).
    """
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != CSV_COLUMNS:
            raise ValueError(f"{path}: columns {reader.fieldnames} are not the study's "
                             f"{CSV_COLUMNS}")
        rows = []
        for r in reader:
            rows.append({k: (None if v == "" else v if k in ("row", "kind") else float(v))
                         for k, v in r.items()})
    return rows


@dataclass
class Target:
    """One of the study's targets evaluated on the results: ``status`` met | missed | pending
    (the rows it needs are not scored yet), ``text`` one line with the numbers."""

    name: str
    status: str
    text: str


def _diff(a: dict, b: dict) -> tuple[float, float | None]:
    """(a's mean - b's mean, the standard error of that difference) in points."""
    se = (None if a.get("stderr") is None or b.get("stderr") is None
          else math.hypot(a["stderr"], b["stderr"]))
    return a["mean"] - b["mean"], se


def _pm(se: float | None) -> str:
    return "" if se is None else f" +- {se:.2f}"


def _sparse_target(name, sparse, dense, max_pct, within) -> Target:
    cands = [r for r in sparse if r.get("l0_pct") is not None and r["l0_pct"] <= max_pct]
    if dense is None or not cands:
        what = "dense ReLU row" if dense is None else f"sparse row with L0 <= {max_pct:g} %"
        return Target(name, "pending", f"{name}: pending (no {what} scored yet).")
    ok = [r for r in cands if r["mean"] - dense["mean"] >= -within]
    r = min(ok, key=lambda r: r["l0_pct"]) if ok else max(cands, key=lambda r: r["mean"])
    d, se = _diff(r, dense)
    pick = "the sparsest row within it" if ok else "the best of them"
    return Target(name, "met" if ok else "missed",
                  f"{name}: **{'met' if ok else 'missed'}**: {len(cands)} row(s) with L0 <= "
                  f"{max_pct:g} %; {pick}: {r['row']} (L0 {r['l0']:.1f} = {r['l0_pct']:.2f} %), "
                  f"mean {r['mean']:.2f} vs dense ReLU {dense['mean']:.2f}: {d:+.2f}{_pm(se)} "
                  f"points (target >= -{within:g}).")


def evaluate_targets(rows: list[dict]) -> list[Target]:
    """The study's three targets on :func:`result_row` dicts (points = percentage points of the
    mean accuracy, +- the standard error of the difference): dense ReLU within 1.0 of the SiLU
    control; a sparse row with L0 <= 5 % within 1.0 of dense ReLU (the sparsest such row
    reported); one with L0 <= 2 % within 2.0. Dense ReLU is the ``dense_relu`` row, on the
    control's tokens; a row of more tokens (:data:`LONG_DENSE`) is left to
    :func:`longer_row_lines`."""
    by = {r["row"]: r for r in rows}
    control, dense = by.get("silu_control"), by.get("dense_relu")
    sparse = [r for r in rows if r["kind"] == "sparse"]
    name = "Dense ReLU within 1.0 point of the SiLU control"
    if control is None or dense is None:
        t1 = Target(name, "pending", f"{name}: pending (needs both rows scored).")
    else:
        d, se = _diff(dense, control)
        ok = d >= -1.0
        t1 = Target(name, "met" if ok else "missed",
                    f"{name}: **{'met' if ok else 'missed'}**: {dense['mean']:.2f} vs "
                    f"{control['mean']:.2f}: {d:+.2f}{_pm(se)} points (target >= -1).")
    return [t1, _sparse_target("A row with L0 <= 5 % within 1.0 point of dense ReLU", sparse,
                               dense, 5.0, 1.0),
            _sparse_target("A row with L0 <= 2 % within 2.0 points of dense ReLU", sparse,
                           dense, 2.0, 2.0)]


def longer_row_lines(rows: list[dict], specs: list[RowSpec]) -> list[str]:
    """One line per dense ReLU row of more tokens than the plan's among ``specs``: its mean
    against the SiLU control's (the first target's comparison, at the row's tokens) and
    against dense ReLU on the control's tokens, with the validation losses; pending until it
    and the control are scored."""
    by = {r["row"]: r for r in rows}
    control, dense, out = by.get("silu_control"), by.get("dense_relu"), []
    for spec in (s for s in specs if s.kind == "dense_relu" and s.tokens_scale != 1.0):
        r = by.get(spec.name)
        base = f" ({control['tokens_m']:.2f} M)" if control else ""
        name = f"Dense ReLU at {spec.tokens_scale:g}x tokens against the SiLU control{base}"
        if r is None or control is None:
            what = spec.name if r is None else "silu_control"
            out.append(f"{name}: pending ({what} not scored yet).")
            continue
        d, se = _diff(r, control)
        line = (f"{name}: {r['mean']:.2f} at {r['tokens_m']:.2f} M tokens vs "
                f"{control['mean']:.2f}: {d:+.2f}{_pm(se)} points (the first target's bar: "
                f">= -1)")
        if dense is not None:
            d2, se2 = _diff(r, dense)
            line += f"; against dense ReLU on the control's tokens: {d2:+.2f}{_pm(se2)}"
        if r.get("val_loss") is not None:
            others = [f"{who} {x['val_loss']:.4f}" for who, x in (("control", control),
                                                                  ("dense ReLU", dense))
                      if x is not None and x.get("val_loss") is not None]
            line += f"; val loss {r['val_loss']:.4f}" + (f" ({', '.join(others)})" if others
                                                          else "")
        out.append(line + ".")
    return out


def estimate(plan: StudyPlan, train_rows: list[RowSpec], score_rows_: list[RowSpec],
             tokens_per_s: float, tokens_done: dict[str, float] | None = None,
             piece_s: float = 600.0) -> dict:
    """GPU time (seconds) of what is left at ``tokens_per_s`` for one process, and the pieces
    of ``piece_s`` it needs: each row's tokens still to train (its own: :meth:`StudyPlan.
    row_tokens`; a distilled row at
    :data:`DISTILL_COST` x), :data:`ROW_START_S` per row, :data:`SCORE_S` per row to score
    (an upper bound: scoring runs beside the next row's training), :data:`PIECE_START_S` per
    piece. ``tokens_done``: row name -> tokens a stopped row has trained already."""
    done = tokens_done or {}
    train_s = sum(max(0.0, plan.row_tokens(r) - done.get(r.name, 0.0)) / tokens_per_s
                  * (DISTILL_COST if r.distill else 1.0) for r in train_rows)
    rest = train_s + ROW_START_S * len(train_rows) + SCORE_S * len(score_rows_)
    pieces = math.ceil(rest / (piece_s - PIECE_START_S)) if rest > 0 else 0
    return {"train_s": train_s, "start_s": ROW_START_S * len(train_rows),
            "score_s": SCORE_S * len(score_rows_), "pieces": pieces,
            "total_s": rest + PIECE_START_S * pieces, "tokens_per_s": tokens_per_s}


def estimate_line(est: dict) -> str:
    """One line of :func:`estimate`'s numbers (minutes)."""
    piece = est["total_s"] - est["train_s"] - est["start_s"] - est["score_s"]
    return (f"{est['total_s'] / 60:.1f} min of GPU at {est['tokens_per_s'] / 1e3:.1f} k tokens/s "
            f"(training {est['train_s'] / 60:.1f}, row starts {est['start_s'] / 60:.1f}, scoring "
            f"{est['score_s'] / 60:.1f}, piece starts {piece / 60:.1f}): {est['pieces']} "
            "piece(s) of 10 min")


# ---------------------------------------------------------------------------------- the study

def _read_json(path: Path) -> dict | None:
    """A row's small JSON file (summary, score, the source's marker); None when it is missing
    or unreadable: the row (or the source) is then not done yet and is made again."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _damaged(path: Path, why: str) -> ValueError:
    return ValueError(f"{path}: {why}; restore it (e.g. from the copy the study came back in) "
                      "or choose a new --out")


def _study_shape(state) -> str | None:
    """What keeps ``state`` (study.json's content) from being a study as :meth:`Study.save`
    writes it, None if nothing: an object whose ``plan`` is an object with ``overrides`` a
    list of strings, whose ``rows`` map names to objects with a :class:`RowSpec` ``spec``,
    whose ``invocations`` are a list and ``source`` an object (each of them optional)."""
    if not isinstance(state, dict):
        return f"a JSON {type(state).__name__}, not a study's object"
    plan, rows = state.get("plan", {}), state.get("rows", {})
    if not isinstance(plan, dict):
        return f"its plan is {plan!r}, not an object"
    over = plan.get("overrides", [])
    if not isinstance(over, list) or not all(isinstance(o, str) for o in over):
        return f"its plan's overrides are {over!r}, not a list of strings"
    if not isinstance(rows, dict):
        return f"its rows are {rows!r}, not an object"
    for name, row in rows.items():
        try:
            RowSpec(**row["spec"])
        except (TypeError, KeyError) as e:
            return f"its row {name!r} has no valid spec ({type(e).__name__}: {e})"
    if not isinstance(state.get("invocations", []), list):
        return "its invocations are not a list"
    if not isinstance(state.get("source") or {}, dict):
        return "its source is not an object"
    return None


def _read_study(path: Path) -> dict | None:
    """The content of a study.json; None when there is none (a new study).

    Raises:
        ValueError: one that exists but cannot be read, is not JSON or not a study's shape
            (:func:`_study_shape`); one line naming the file and the fix (restore it or choose
            a new --out), so that a damaged study is not taken for none and overwritten.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise _damaged(path, f"cannot be read ({type(e).__name__}: {e})") from None
    try:
        state = json.loads(text)
    except ValueError as e:
        raise _damaged(path, f"not valid JSON ({e})") from None
    why = _study_shape(state)
    if why:
        raise _damaged(path, why)
    return state


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def compose_config(overrides: list[str]):
    """The resolved :class:`train.config.TrainConfig` of ``python -m train <overrides>``
    (:func:`train.config.compose`: the trainer's own checks, so an override the rows would
    refuse, such as an unknown ``+key``, is refused here too).

    Raises:
        train.config.ConfigError: an unknown key, a bad value or Hydra's error, in one line.
    """
    from train.config import compose

    return compose(overrides)


# Override keys that change how a row runs, not what it trains, validates or scores (a later
# piece may change them: compilation, the corpus's folder, logging, the checkpoint interval,
# which a resume accepts and --save-every changes freely). Narrower than what a resume accepts
# (train.rundir.RESUME_SAFE_KEYS also lets through eval.*, the validation set's size and the
# micro-batch, which change the study's columns or numerics).
RUN_ONLY_KEYS = ("trainer.compile", "trainer.compile_scope", "trainer.progress",
                 "trainer.save_every", "ffn.host_sync", "data.num_proc", "data.verify",
                 "data.build_if_missing", "data.cache_dir", "logging", "logging.")


def run_only(override: str) -> bool:
    """Whether a Hydra ``key=value`` override (or its bare key) sets one of
    :data:`RUN_ONLY_KEYS` (the group ``logging`` included)."""
    key = override.split("=", 1)[0].lstrip("+~")
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RUN_ONLY_KEYS)


def override_map(overrides: list[str]) -> dict[str, str]:
    """What Hydra overrides set, as ``key -> value`` (for comparing plans: their order does not
    matter). The value is Hydra's parse of it, as its ``repr`` (``True`` and ``true`` alike,
    ``1e-3`` and ``0.001`` alike, ``'1'`` quoted apart from ``1``); ``+key`` and ``++key`` set
    the key as ``key`` does (the config refuses the one that does not apply), ``~key`` is
    ``deleted``; of a key given twice the last wins, as in Hydra. An override Hydra cannot
    parse keeps the ``repr`` of its text after ``=``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser, out = OverridesParser.create(), {}
    for text in overrides:
        try:
            o = parser.parse_overrides([text])[0]
        except HydraException:
            key, _, value = text.partition("=")
            out[key.lstrip("+~")] = repr(value)
            continue
        key = o.key_or_group + (f"@{o.package}" if o.package is not None else "")
        out[key] = "deleted" if o.is_delete() else repr(o.value())
    return out


def plan_changes(old: dict, new: dict, fields) -> list[str]:
    """How plan ``new`` differs from ``old`` (both as saved in study.json) in ``fields``: one
    ``field: old -> new`` each, and for ``overrides`` one ``override KEY: old -> new`` per key
    that differs (:func:`override_map`; ``unset`` where a plan lacks the key), the
    :func:`run_only` keys left out, so a later piece may change how the rows run."""
    out = []
    for k in fields:
        if k != "overrides":
            if old.get(k) != new.get(k):
                out.append(f"{k}: {old.get(k)!r} -> {new.get(k)!r}")
            continue
        was, now = ({key: v for key, v in override_map(p.get(k) or []).items()
                     if not run_only(key)} for p in (old, new))
        out += [f"override {key}: {was.get(key, 'unset')} -> {now.get(key, 'unset')}"
                for key in sorted(was.keys() | now.keys()) if was.get(key) != now.get(key)]
    return out


def source_dir(work: Path) -> Path:
    """The converted source under the work folder ``work``: every row starts from it."""
    return Path(work) / "source_hf"


class Study:
    """A study's folders and state: OUT (``study.json``, ``results.csv``, ``rows/<row>/``) and
    WORK (``source_hf/``, ``runs/<row>/``, ``logs/``); see the module docstring.

    Args:
        out, work: the two folders (created as needed).
        plan: the recipe; a study.json in OUT with another plan is refused
            (:func:`plan_changes`: the overrides as key -> value, in any order, the
            :func:`run_only` ones aside, e.g. ``trainer.compile_scope``).
        rows: the rows this invocation runs, in order (earlier invocations' rows stay in the
            results).

    Raises:
        ValueError: OUT holds a study with another plan (the differing fields are named), or
            a study.json that is damaged (not JSON, not a study's shape: one line naming the
            file and the fix).
    """

    PLAN_FIXED = ("tokens", "seq_len", "global_batch", "micro_batch", "lr", "warmup_frac",
                  "l1_warmup", "l1_warmup_min", "distill_weight", "distill_temperature",
                  "val_sequences", "eval_limit", "seed", "cpu", "overrides")

    def __init__(self, out: Path, work: Path, plan: StudyPlan, rows: list[RowSpec]) -> None:
        self.out, self.work, self.plan, self.rows = Path(out), Path(work), plan, list(rows)
        self.state = _read_study(self.out / "study.json") or {}
        old = self.state.get("plan")
        if old is not None:
            diff = plan_changes(old, json.loads(json.dumps(asdict(plan))), self.PLAN_FIXED)
            if diff:
                raise ValueError(f"{self.out} holds a study with another plan ({'; '.join(diff)}"
                                 "); pass the same arguments to continue it, or a new --out")
        self.state["plan"] = json.loads(json.dumps(asdict(plan)))
        specs = self.state.setdefault("rows", {})
        for r in self.rows:
            specs.setdefault(r.name, {})["spec"] = asdict(r)

    @classmethod
    def open(cls, out: Path, work: Path) -> Study:
        """The study saved in ``out/study.json``: its plan and rows (:func:`study_rows`: a
        study made with the whole default set gains the default rows added since).

        Raises:
            FileNotFoundError: no study.json in ``out``.
            ValueError: a damaged study.json (one line naming it and the fix).
        """
        path = Path(out) / "study.json"
        state = _read_study(path)
        if state is None:
            raise FileNotFoundError(f"no study.json in {out}; run scripts/relufy_study.py first")
        try:
            p = dict(state["plan"])
            p["l1_warmup"] = tuple(p["l1_warmup"])
            plan = StudyPlan(**p)
        except (KeyError, TypeError) as e:
            raise _damaged(path, f"its plan is not a study's ({type(e).__name__}: {e})") from None
        rows = study_rows([RowSpec(**v["spec"]) for v in state.get("rows", {}).values()])
        return cls(out, work, plan, rows)

    # ------------------------------------------------------------------ paths and status

    @property
    def source_dir(self) -> Path:
        return source_dir(self.work)

    def row_out(self, name: str) -> Path:
        return self.out / "rows" / name

    def run_dir(self, name: str) -> Path:
        return self.work / "runs" / name

    def spec(self, name: str) -> RowSpec:
        return RowSpec(**self.state["rows"][name]["spec"])

    def status(self, row: RowSpec) -> str:
        """``scored`` (done: score.json in OUT, and for a trained row its summary at the
        row's last step), ``trained`` (its run finished; to score), ``started`` (a checkpoint
        to resume from) or ``new``."""
        if (self.row_out(row.name) / "score.json").is_file():
            s = _read_json(self.row_out(row.name) / "summary.json")
            if not row.trains or (s is not None and s.get("step") == self.plan.row_steps(row)):
                return "scored"
        if not row.trains:
            return "new"
        if run_finished(self.run_dir(row.name), self.plan.row_steps(row)):
            return "trained"
        from train.checkpoint import list_checkpoints

        return "started" if list_checkpoints(self.run_dir(row.name)) else "new"

    def tokens_done(self) -> dict[str, float]:
        """Tokens each row's run has logged so far (resumable rows)."""
        out = {}
        for r in self.rows:
            rec = last_train_record(self.run_dir(r.name)) if r.trains else None
            if rec:
                out[r.name] = float(rec.get("tokens") or 0)
        return out

    def measured_tokens_per_s(self) -> float | None:
        """The median training speed (summary.json's tokens/s) of this study's finished rows
        without distillation, None before one (the estimate's speed once there is one)."""
        speeds = sorted(s["tokens_per_s"] for n, v in self.state["rows"].items()
                        if not v["spec"]["distill"] and v["spec"]["kind"] != "silu_original"
                        for s in [_read_json(self.row_out(n) / "summary.json") or {}]
                        if s.get("tokens_per_s"))
        return speeds[len(speeds) // 2] if speeds else None

    def start_need_s(self, row: RowSpec, min_start: float) -> float:
        """Seconds a piece must have left to start ``row``: ``min_start`` (what a row of the
        plan's tokens needs) plus the training time of the tokens it has beyond a plan row's,
        at this study's measured speed (:data:`MEASURED_TOKENS_PER_S` before one; a
        distilled row at :data:`DISTILL_COST` x)."""
        extra = self.plan.row_tokens(row) - self.plan.steps * self.plan.tokens_per_step
        if not row.trains or extra <= 0:
            return min_start
        speed = self.measured_tokens_per_s() or MEASURED_TOKENS_PER_S
        return min_start + extra / speed * (DISTILL_COST if row.distill else 1.0)

    # ------------------------------------------------------------------ jobs

    def train_job(self, row: RowSpec) -> Job:
        run_dir = self.run_dir(row.name)
        return Job(f"train:{row.name}", train_command(self.plan.train_overrides(
            row, self.source_dir), run_dir), run_dir=run_dir,
            log_path=self.work / "logs" / f"{row.name}.log")

    def score_job(self, rows: list[RowSpec]) -> Job:
        names = ",".join(r.name for r in rows)
        return Job(f"score:{names}", [sys.executable, "-m", "studies.relufy", "score", "--out",
                                      str(self.out), "--work", str(self.work), "--rows", names],
                   log_path=self.work / "logs" / f"score_{time.strftime('%H%M%S')}.log")

    def on_done(self, job: Job) -> None:
        """Record a finished job: a training row's small files and status into OUT (its log
        tail when it did not finish), a scoring job's status; then :meth:`save`."""
        kind, names = job.name.split(":", 1)
        rec = {"status": job.status, "rc": job.rc, "wall_s": round(job.wall_s or 0.0, 1),
               "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if not job.ok:
            rec["log_tail"] = _tail(job.log_path)
        if kind == "train":
            d = self.row_out(names)
            d.mkdir(parents=True, exist_ok=True)
            for f in ("summary.json", "metrics.jsonl", "config.yaml", "train.log"):
                if (job.run_dir / f).is_file():
                    shutil.copy2(job.run_dir / f, d / f)
            (d / "log.txt").write_text(_tail(job.log_path, 100_000))
            self.state["rows"][names]["train"] = rec
        else:
            for n in names.split(","):
                self.state["rows"][n]["score"] = {**rec, "scored": (
                    self.row_out(n) / "score.json").is_file()}
        self.save()

    # ------------------------------------------------------------------ results

    def results(self) -> list[dict]:
        """:func:`result_row` of every scored row this OUT knows (all invocations), in the
        order kinds, L1, plain before distilled, fewer tokens first."""
        width = (self.state.get("source") or {}).get("ffn") or 1536
        specs = sorted((self.spec(n) for n in self.state["rows"]),
                       key=lambda r: (KINDS.index(r.kind), r.l1_coeff or 0.0, r.distill,
                                      r.tokens_scale))
        out = []
        for r in specs:
            if self.status(r) != "scored":
                continue
            score = _read_json(self.row_out(r.name) / "score.json")
            summary = _read_json(self.row_out(r.name) / "summary.json")
            out.append(result_row(r, score, summary, width))
        return out

    def save(self) -> None:
        """study.json and results.csv in OUT, each written atomically."""
        _write_atomic(self.out / "study.json", json.dumps(self.state, indent=1, default=str))
        _write_atomic(self.out / "results.csv", csv_text(self.results()))


# ---------------------------------------------------------------------------------- source

def _base_overrides(plan: StudyPlan) -> list[str]:
    """Overrides of the data and precision view every row shares (prepare and scoring)."""
    over = ["experiment=relufy_smollm2", f"model.seq_len={plan.seq_len}",
            f"trainer.global_batch={plan.global_batch}", f"trainer.micro_batch={plan.micro_batch}",
            f"trainer.val_sequences={plan.val_sequences}", f"trainer.seed={plan.seed}"]
    if plan.cpu:
        over += ["trainer.cpu=true", "trainer.compile=false", "trainer.precision=fp32"]
    return over + list(plan.overrides)


def check_overrides(plan: StudyPlan, rows: list[RowSpec] | None = None,
                    source: Path = Path("source_hf")) -> None:
    """Compose every trained row's config (:meth:`StudyPlan.train_overrides` from ``source``,
    the converted source folder: only its path is composed, nothing is read) and the shared
    view that prepares the source and scores ``silu_original`` with ``plan.overrides`` now
    (:func:`studies.jobs.check_train_overrides`), so that a bad override (an unknown key, a
    value some row's config refuses) stops the study at its start, a dry run included, not
    each row on the device. ``rows``: the rows of this invocation (default: all).

    Raises:
        ValueError: one line naming the override (or the row) the config refuses and why.
    """
    rows = default_rows() if rows is None else rows
    own = replace(plan, overrides=[])  # the rows' own overrides: the user's kept apart to blame
    configs = {r.name: own.train_overrides(r, source) for r in rows if r.trains}
    configs["silu_original"] = _base_overrides(own)
    check_train_overrides(configs, plan.overrides)


def prepare_source(study: Study, spec: str, sha256: str | None = None, log=print) -> dict:
    """Convert the SiLU source (``spec``: a .gguf file, ``smollm2`` or a Hugging Face Llama
    folder) once into ``WORK/source_hf`` (fp32 safetensors with the corpus tokenizer), the
    folder every row starts from and the distilled rows' teacher; check that its vocabulary is
    the corpus tokenizer's. Skipped when that folder was made from the same file already.
    Returns the source record (also ``study.state["source"]``).

    Raises:
        ValueError: the file's SHA256 is not ``sha256`` (when given).
        train.config.ConfigError: the vocabularies differ, or not a Llama checkpoint.
    """
    from train.pretrained import check_vocab, inspect_checkpoint, load_source_model

    marker = study.source_dir / "prepared.json"
    done = _read_json(marker)
    if done is not None and done.get("spec") == spec:
        study.state["source"] = done
        return done
    t0 = time.monotonic()
    from train.data import build_datamodule

    plan = study.plan
    cfg = compose_config(_base_overrides(plan))
    dm = build_datamodule(cfg.data, seq_len=plan.seq_len, micro_batch=plan.micro_batch,
                          seed=plan.seed)
    src = inspect_checkpoint(spec)
    digest = None
    if src.kind == "gguf":
        from offline.fetch import sha256_file

        digest = sha256_file(src.path)
        if sha256 and digest != sha256:
            raise ValueError(f"--gguf {src.path}: SHA256 {digest} is not the expected {sha256} "
                             "(a truncated or another file?); pass --gguf-sha256 none to accept")
    vocab = check_vocab(src, dm.vocab_size, getattr(dm, "tokenizer", None))
    model = load_source_model(src)
    if study.source_dir.exists():
        shutil.rmtree(study.source_dir)
    model.save_pretrained(study.source_dir)
    if getattr(dm, "tokenizer", None) is not None:
        dm.tokenizer.save_pretrained(study.source_dir)
    c = src.config
    info = {"spec": spec, "path": str(src.path), "format": src.kind, "sha256": digest,
            "hidden_act": src.hidden_act, "vocab_check": vocab, "layers": c.num_hidden_layers,
            "hidden": c.hidden_size, "ffn": c.intermediate_size, "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads, "vocab": c.vocab_size,
            "data": {**dm.info, "fingerprint": dm.fingerprint},
            "seconds": round(time.monotonic() - t0, 1)}
    _write_atomic(marker, json.dumps(info, indent=1, default=str))
    study.state["source"] = info
    log(f"source: {src.path} ({src.kind}, {src.hidden_act}, {c.num_hidden_layers} layers, FFN "
        f"{c.intermediate_size}, tokenizer {vocab}) -> {study.source_dir} in {info['seconds']} s")
    return info


# ---------------------------------------------------------------------------------- scoring

def validation_loss(model, dm, val_sequences: int, device, autocast) -> float:
    """Token-weighted mean CE of ``model`` on the first ``val_sequences`` held-out sequences of
    ``dm`` (the trainer's validation: the same blocks, the same weighting)."""
    import torch

    total, n_targets, left = 0.0, 0, val_sequences
    with torch.no_grad():
        for ids in dm.val_batches(-(-val_sequences // dm.micro_batch)):
            ids = ids[:left].to(device)
            left -= ids.shape[0]
            if not ids.shape[0]:
                break
            with autocast():
                ce = model(input_ids=ids, labels=ids).loss.double().item()
            n = ids.shape[0] * (ids.shape[1] - 1)
            total, n_targets = total + ce * n, n_targets + n
            if left <= 0:
                break
    return total / n_targets if n_targets else float("nan")


def score_model(path: Path, *, device, bf16: bool, limit: int | None, batch_size: int,
                dm=None, val_sequences: int = 0) -> dict:
    """The seven tasks (``evals.evaluate``, no prefix token) of a checkpoint folder loaded into
    stock transformers modules (``evals.models.load_checkpoint(ffn_impl="none")``: ReLU rows
    as ``LlamaForCausalLM(hidden_act="relu")``, SiLU rows as ``hidden_act="silu"``), fp32
    weights, under bf16 autocast when ``bf16`` (the trainer's precision on GPU). With ``dm``
    also :func:`validation_loss`. Returns ``{"mean", "tasks": {task: {"primary", "n",
    "primary_metric"}}, "hidden_act", "precision", "seconds", ["val_loss"]}``."""
    from contextlib import nullcontext

    import torch

    from evals import evaluate
    from evals.models import load_checkpoint

    t0 = time.monotonic()
    model, tok = load_checkpoint(path, ffn_impl="none", dtype="float32")
    model.to(device).eval()

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else nullcontext()

    res = {"checkpoint": str(path), "hidden_act": model.config.hidden_act,
           "precision": "bf16 autocast" if bf16 else "fp32"}
    if dm is not None:
        res["val_loss"] = validation_loss(model, dm, val_sequences, device, autocast)
    with autocast():
        out = evaluate(model, tok, tasks="all", limit=limit, batch_size=batch_size,
                       device=device)
    res["mean"] = out["mean"]
    res["tasks"] = {k: {kk: v[kk] for kk in ("primary", "n", "primary_metric")}
                    for k, v in out["tasks"].items()}
    res["protocol"] = {k: out["protocol"][k] for k in ("limit", "prefix_token", "batch_size")}
    res["seconds"] = round(time.monotonic() - t0, 1)
    return res


def score_rows(study: Study, names: list[str], log=print) -> None:
    """Score the rows ``names`` (each trained row's newest checkpoint; the SiLU original's
    converted source, with its validation loss), writing ``OUT/rows/<row>/score.json`` as each
    is done (a stopped scoring keeps the rows it finished)."""
    import torch

    from train.checkpoint import latest_checkpoint

    plan = study.plan
    device = torch.device("cuda" if torch.cuda.is_available() and not plan.cpu else "cpu")
    if plan.cpu:
        torch.set_num_threads(1)
    dm = None
    for name in names:
        row = study.spec(name)
        if row.trains:
            path = latest_checkpoint(study.run_dir(name))
        else:
            path = study.source_dir
            if dm is None:
                from train.data import build_datamodule

                cfg = compose_config(_base_overrides(plan))
                dm = build_datamodule(cfg.data, seq_len=plan.seq_len,
                                      micro_batch=plan.micro_batch, seed=plan.seed)
        res = score_model(path, device=device, bf16=device.type == "cuda", limit=plan.eval_limit,
                          batch_size=plan.eval_batch, dm=None if row.trains else dm,
                          val_sequences=plan.val_sequences)
        res["row"] = name
        _write_atomic(study.row_out(name) / "score.json", json.dumps(res, indent=1))
        log(f"scored {name}: mean {100 * res['mean']:.2f} ({res['seconds']} s, {path})")


# ---------------------------------------------------------------------------------- the loop

def _waits_line(wave: list[RowSpec], need: float, left: float, grace_s: float) -> str:
    """Why ``wave`` waits for the next piece: the seconds it needs before the deadline, those
    left, and the ``--max-wall`` of a piece that starts with it (:func:`run_study`'s deadline is
    ``max_wall - grace_s - 15``)."""
    return (f"{', '.join(r.name for r in wave)}: not started: {need:.0f} s needed before the "
            f"deadline, {left:.0f} s left (a piece starting with it needs --max-wall >= "
            f"{need + grace_s + 15:.0f})")


def run_study(study: Study, *, parallel: int = 1, max_wall: float = math.inf,
              min_start: float = MIN_START_S, grace_s: float = 45.0, command: str = "",
              log=print) -> dict:
    """Run what is left of ``study.rows`` within ``max_wall`` seconds (default: no limit; a
    device call's limit is the script's ``--max-wall``): rows in order,
    ``parallel`` training processes at a time (waves), each wave beside the scoring of the rows
    trained before it (one scoring process); a wave starts only with ``min_start`` seconds
    left, more for a row of more tokens (:meth:`Study.start_need_s`; a wave that waits for the
    next piece is logged once, with the ``max_wall`` a piece starting with it needs); at the
    deadline (``max_wall - grace_s - 15``) running jobs get SIGTERM (the trainer checkpoints
    and exits; SIGKILL after ``grace_s``). Done rows are skipped; a stopped row
    continues from its checkpoint next time; a failed one is logged with its log tail and
    tried again next time. Returns ``{"status": {row: status}, "not_started": [rows],
    "failed": [jobs]}``.

    Raises:
        ValueError: ``parallel < 1``.
    """
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1; got {parallel}")
    t0 = time.monotonic()
    deadline = t0 + max_wall - grace_s - 15.0
    inv = {"command": command, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "rows": [r.name for r in study.rows], "parallel": parallel}
    study.state.setdefault("invocations", []).append(inv)
    status = {r.name: study.status(r) for r in study.rows}
    for name, s in status.items():
        if s == "scored":
            log(f"{name}: done (scored), skipped")
    to_train = [r for r in study.rows if r.trains and status[r.name] in ("new", "started")]
    to_score = [r for r in study.rows if status[r.name] == "trained"
                or (not r.trains and status[r.name] == "new")]
    study.save()
    waves = [to_train[i:i + parallel] for i in range(0, len(to_train), parallel)]

    failed, said = [], False

    def done(job: Job) -> None:
        study.on_done(job)
        if not job.ok and job.status != "stopped":
            failed.append(job.name)
            log(f"{job.name} {job.status}; log tail ({job.log_path}):\n{_tail(job.log_path, 2000)}")

    while waves or to_score:
        left = deadline - time.monotonic()
        need = max(study.start_need_s(r, min_start) for r in waves[0]) if waves else 0.0
        wave = waves.pop(0) if waves and left >= need else []
        if waves and not wave and not said:  # why the next rows wait for the next piece
            said = True
            log(_waits_line(waves[0], need, left, grace_s))
        if not wave and (not to_score or left < 30):
            break
        jobs = [study.train_job(r) for r in wave] + ([study.score_job(to_score)] if to_score
                                                      else [])
        run_jobs(jobs, parallel=len(jobs), deadline=deadline, on_done=done, grace_s=grace_s,
                 log=log)
        to_score = [r for r in wave if study.status(r) == "trained"]
        if any(j.status == "stopped" for j in jobs):
            break
    inv["not_started"] = [r.name for w in waves for r in w]
    inv["failed"] = failed
    inv["wall_s"] = round(time.monotonic() - t0, 1)
    study.save()
    return {"status": {r.name: study.status(r) for r in study.rows},
            "not_started": inv["not_started"], "failed": failed}


def report_lines(study: Study) -> list[str]:
    """What the driver prints last: each row's status, the scored rows (mean +- stderr, L0 %),
    the targets, and the estimate of what is left."""
    lines, rows = ["", "row | status | mean | stderr | L0 % | val loss"], study.results()
    by = {r["row"]: r for r in rows}
    for r in study.rows:
        res = by.get(r.name, {})

        def f(k, spec=".2f", res=res):
            return "" if res.get(k) is None else format(res[k], spec)
        lines.append(f"{r.name} | {study.status(r)} | {f('mean')} | {f('stderr')} | "
                     f"{f('l0_pct')} | {f('val_loss', '.4f')}")
    lines += ["", *(t.text for t in evaluate_targets(rows)),
              *longer_row_lines(rows, study.rows)]
    left_train = [r for r in study.rows if r.trains and study.status(r) in ("new", "started")]
    left_score = [r for r in study.rows if study.status(r) != "scored"]
    if left_score:
        speed = study.measured_tokens_per_s() or MEASURED_TOKENS_PER_S
        est = estimate(study.plan, left_train, left_score, speed, study.tokens_done())
        lines.append(f"left: {len(left_score)} row(s): {estimate_line(est)}")
    else:
        lines.append("all rows scored")
    lines.append(f"results: {study.out / 'results.csv'} ({len(rows)} rows); report: python "
                 f"scripts/relufy_report.py {study.out} --doc docs/relufy.md")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m studies.relufy score --out OUT --work WORK --rows a,b``: the study's scoring
    process (:func:`score_rows`; the plan is read from OUT/study.json)."""
    p = argparse.ArgumentParser(prog="python -m studies.relufy")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("score", help="score rows of a study (the driver starts this)")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--work", type=Path, required=True)
    s.add_argument("--rows", required=True, help="comma list of row names")
    a = p.parse_args(argv)
    study = Study.open(a.out, a.work)
    score_rows(study, [n for n in a.rows.split(",") if n], log=lambda m: print(m, flush=True))
    return 0


__all__ = [
    "CSV_COLUMNS",
    "DEFAULT_L1",
    "DEFAULT_TOKENS",
    "KINDS",
    "LONG_DENSE",
    "MEASURED_TOKENS_PER_S",
    "TARGET_TOKENS_PER_S",
    "RowSpec",
    "Study",
    "StudyPlan",
    "Target",
    "compose_config",
    "csv_text",
    "default_rows",
    "estimate",
    "estimate_line",
    "evaluate_targets",
    "longer_row_lines",
    "mean_stderr",
    "override_map",
    "plan_changes",
    "prepare_source",
    "read_results",
    "report_lines",
    "result_row",
    "run_study",
    "score_model",
    "score_rows",
    "select_rows",
    "source_dir",
    "sparse_row",
    "study_rows",
    "validation_loss",
]


if __name__ == "__main__":
    sys.exit(main())
