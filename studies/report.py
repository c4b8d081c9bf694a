"""``twell-report``: collect training runs into tables (markdown, CSV) and plots (PNG).

    twell-report runs/scaling                       # every run dir found under it
    twell-report 'runs/multirun/2026-12-01/*' --out report/ --position-batches 2
    twell-report runs/a runs/b --skip-incomplete    # list unfinished runs instead of failing

A run directory is what ``twell-train`` writes (docs/training.md, "The run directory and what a
run logs"): ``config.yaml``,
``metrics.jsonl`` (kind=train|val|eval lines), ``summary.json`` (written only when the run reached
``trainer.max_steps``) and ``checkpoints/step{N}/``. The report reproduces the paper's scaling
table (arXiv 2603.23198, "Results": non-zeros per token fall with model size at L1 = 2e-5, 39 ->
29 -> 24 from 0.5B to 2B) on any family of runs:

- one row per run, labelled by what differs between the runs (:func:`run_labels`, e.g.
  ``sparsity.l1_coeff=0.001``): size, layers, params, tokens, L1 coefficient, sparsity variant,
  FFN impl, final train CE (the last log interval's mean), validation loss, L0 (mean over layers
  and the most active layer), max non-zeros of any token, dead %, the seven task scores
  (percent, the task's primary metric) and their mean, tokens/s; a run whose coefficient was
  steered (``sparsity=target``) is the variant ``steered to L0 X``, its L1 its starting -> final
  coefficient (:attr:`Run.final_l1_coeff`);
- variant pairs: runs that differ only in ``sparsity.*`` from a plain constant-L1 run (dead-gate
  re-init ``sparsity=l1_reinit``, ``sparsity=warmup``, ``sparsity=target``): L0, dead %, val
  loss, accuracy side by side;
- FFN pairs: runs that differ only in ``ffn.impl`` (``twell`` vs ``torch``, same seed):
  max |loss difference| over the logged steps, relative final L0 difference, dead-unit difference;
- plots (runs labelled by what differs; a plot without data is left out and said so): L0 vs
  L1 per size (two L1 values or more), L0 vs model size per L1 (two sizes or more), mean
  accuracy (over the tasks the runs were scored on) and validation loss vs L1 per size (two
  L1 values or more), per-layer L0 profile, training curves (CE, L0, dead % at every logged
  step) and (``--position-batches N``) L0 vs token position, measured from each run's final
  checkpoint on N validation micro-batches (the trainer does not log it).

Errors name the run directory: :class:`IncompleteRunError` (no or a damaged summary.json: with
the hint its cause calls for, from ``error.txt``: diverged (its last good checkpoint from
``error.json``, or an earlier one when that was saved just before the divergence), failed,
failed before training (a sweep job's folder holding only its reason), or crashed / killed /
still running), :class:`MismatchError` (runs compared on different data,
tokens seen or seq_len).

Shape legend: L layers, T sequence positions, H FFN width, B sequences, D model width.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from evals.tasks import ALL_TASKS, TASK_SHORT, TASKS
from train.errors import ERROR_FACTS, ERROR_FILE

# data keys that do not change which tokens a run sees
_DATA_IGNORE = ("cache_dir", "build_if_missing", "verify", "num_proc")


class ReportError(ValueError):
    """A run directory the report cannot use; the message names the directory and the fix."""


class IncompleteRunError(ReportError):
    """The run has no readable summary.json (it diverged, failed, crashed, was killed or is
    still running; or the file was cut off)."""


class MismatchError(ReportError):
    """Runs being compared saw different data, numbers of tokens or sequence lengths."""


@dataclass
class Run:
    """One finished run directory, parsed.

    Attributes:
        dir: the run directory.
        config: the resolved config (``config.yaml``) as a nested dict.
        summary: ``summary.json``.
        train / val / evals: the kind=train / val / eval lines of ``metrics.jsonl``, in order.

    Every number is finite or None: :func:`load_run` replaces NaN / inf (JSON allows them) by
    None with a warning, so no score, mean or comparison is made from one.
    """

    dir: Path
    config: dict
    summary: dict
    train: list[dict] = field(default_factory=list)
    val: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    nonfinite: set[str] = field(default_factory=set)
    """Keys of :attr:`summary` (dotted: ``val_loss``, ``l0_layers.2``, ``eval.eval_piqa``) whose
    value was NaN or inf; :func:`load_run` replaced each by None (and ``eval.eval_mean`` too when
    a task's score was one: a mean over it is no score)."""

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def eval(self) -> dict | None:
        """The final eval result (``eval_mean``, ``eval_<task>`` fractions) or None."""
        return self.summary.get("eval") or (self.evals[-1] if self.evals else None)

    @property
    def target_l0(self) -> float | None:
        """The L0 the run's L1 coefficient was steered to hold (``sparsity.schedule=target_l0``),
        or None (a run of another schedule)."""
        sp = self.config.get("sparsity", {})
        return sp.get("target_l0") if sp.get("schedule") == "target_l0" else None

    @property
    def final_l1_coeff(self) -> float | None:
        """The L1 coefficient the last step ran at: ``summary.json``'s ``final_l1_coeff``, else
        (a run from before the key) the last train line's ``l1_coeff``; None when neither has
        it."""
        final = self.summary.get("final_l1_coeff")
        if final is None and self.train:
            final = self.train[-1].get("l1_coeff")
        return final

    @property
    def variant(self) -> str:
        """Sparsity variant: dense (L1 = 0), l1 (constant), l1_reinit, warmup, and ``steered to
        L0 29`` for a coefficient steered to a target L0 (``sparsity.schedule=target_l0``);
        dead-gate re-init appends ``_reinit`` (``, reinit`` to a steered one)."""
        sp = self.config.get("sparsity", {})
        reinit = bool(sp.get("reinit_dead"))
        if self.target_l0 is not None:
            return f"steered to L0 {self.target_l0:g}" + (", reinit" if reinit else "")
        if sp.get("schedule") == "linear_warmup":
            name = "warmup"
        elif not sp.get("l1_coeff"):
            name = "dense"
        else:
            name = "l1"
        return name + ("_reinit" if reinit else "")


# ---------------------------------------------------------------- finding and loading runs


def _is_run_dir(p: Path) -> bool:
    """A run dir: config.yaml and metrics.jsonl, or only the ``error.txt`` of a run that failed
    before it trained (a sweep job keeps its folder with the reason)."""
    return ((p / "config.yaml").is_file() and (p / "metrics.jsonl").exists()) or \
        (p / ERROR_FILE).is_file()


def find_runs(paths: list[str]) -> list[Path]:
    """Run directories named by ``paths`` (each a run dir, a glob, or a parent searched recursively).

    Raises:
        ReportError: a path matches nothing, or holds no run directory.
    """
    found: list[Path] = []
    for spec in paths:
        matches = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
        if not matches or not all(Path(m).exists() for m in matches):
            raise ReportError(f"{spec}: no such file or directory; pass run directories, their "
                              "parent, or a glob")
        for m in map(Path, matches):
            if not m.is_dir():
                continue
            if _is_run_dir(m):
                found.append(m)
                continue
            sub = sorted({c.parent for name in ("config.yaml", ERROR_FILE)
                          for c in m.rglob(name)
                          if _is_run_dir(c.parent) and "checkpoints" not in c.parts})
            if not sub:
                raise ReportError(f"{m}: no run directory (config.yaml + metrics.jsonl) in or "
                                  "under it")
            found.extend(sub)
    unique = list(dict.fromkeys(p.resolve() for p in found))
    if not unique:
        raise ReportError(f"no run directories in {paths}")
    return unique


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}:{i}: not JSON ({e}); the file is damaged") from None
    return rows


def load_run(run_dir: str | Path, warn=None) -> Run:
    """Parse one run directory. A NaN or inf in ``summary.json`` or ``metrics.jsonl`` becomes
    None (:attr:`Run.nonfinite` names the summary's), each with a line to ``warn`` (default:
    stderr) naming the file and key: no score is made from it.

    Raises:
        ReportError: not a run directory (no config.yaml).
        IncompleteRunError: no summary.json, or a summary of fewer steps than ``max_steps``.
    """
    if warn is None:
        def warn(line: str) -> None:
            print(line, file=sys.stderr)
    d = Path(run_dir)
    config = _read_config(d)
    rows, bad_rows, by_kind = _read_metrics(d, warn)
    max_steps = config.get("trainer", {}).get("max_steps")
    last = by_kind["train"][-1]["step"] if by_kind["train"] else 0
    summary = _read_summary(d, last, max_steps)
    summary, bad = finite_only(summary)
    nonfinite = {k for k, _ in bad}
    if not summary.get("eval") and by_kind["eval"]:
        # Run.eval falls back to the last eval line: its non-finite keys are the eval's
        last = by_kind["eval"][-1]
        nonfinite |= {f"eval.{k}" for r, keys in zip(rows, bad_rows) if r is last
                      for k, _ in keys}
    for key, v in bad:
        warn(f"warning: {d / 'summary.json'}: {key} is {v} (non-finite): shown as "
             f"{NONFINITE} and left out of every mean and comparison")
    run = Run(d, config, summary, by_kind["train"], by_kind["val"], by_kind["eval"], nonfinite)
    ev = run.eval
    tasks = sorted(k for k in nonfinite if k.startswith("eval.eval_") and k != "eval.eval_mean")
    if tasks and isinstance(ev, dict) and ev.get("eval_mean") is not None:
        ev["eval_mean"] = None  # a mean over a non-finite score is none
        run.nonfinite.add("eval.eval_mean")
        warn(f"warning: {d}: eval_mean averages the non-finite {', '.join(t[5:] for t in tasks)}:"
             f" shown as {NONFINITE}")
    return run


def _read_config(d: Path) -> dict:
    """The run's resolved ``config.yaml`` as a plain dict, with the keys renamed since it was
    written at their new places (``train.config.upgrade_saved``: a run recorded before the
    ``ffn`` group reads as one recorded after).

    Raises:
        IncompleteRunError: no config.yaml but the error file of a job that failed before it
            trained.
        ReportError: no config.yaml, or a damaged one."""
    from omegaconf import OmegaConf

    from train.config import upgrade_saved

    if not (d / "config.yaml").is_file():
        if (d / ERROR_FILE).is_file():  # a sweep job that failed before it trained
            raise IncompleteRunError(incomplete_reason(d, 0, None))
        raise ReportError(f"{d}: no config.yaml; not a twell-train run directory")
    try:
        config = OmegaConf.to_container(OmegaConf.load(d / "config.yaml"), resolve=True)
    except Exception as e:  # noqa: BLE001  (yaml's and OmegaConf's errors: a damaged file)
        raise ReportError(f"{d / 'config.yaml'}: not a readable config ({type(e).__name__}: "
                          f"{' '.join(str(e).split())}); the file is damaged") from None
    return upgrade_saved(config)


def _read_metrics(d: Path, warn) -> tuple:
    """(rows, each row's non-finite keys, rows by kind ``train``/``val``/``eval``) of the run's
    ``metrics.jsonl`` (none without it); a NaN or inf becomes None, with one line to ``warn``."""
    rows = _read_jsonl(d / "metrics.jsonl") if (d / "metrics.jsonl").is_file() else []
    rows, bad_rows = zip(*(finite_only(r) for r in rows)) if rows else ((), ())  # NaN -> None
    bad = [f"{k} at step {r.get('step')}" for r, keys in zip(rows, bad_rows) for k, _ in keys]
    if bad:
        warn(f"warning: {d / 'metrics.jsonl'}: {len(bad)} non-finite value(s) ({', '.join(bad[:3])}"
             f"{', ...' if len(bad) > 3 else ''}) left out of the curves and comparisons")
    by_kind: dict[str, list[dict]] = {"train": [], "val": [], "eval": []}
    for r in rows:
        by_kind.setdefault(r.get("kind", "train"), []).append(r)
    return rows, bad_rows, by_kind


def _read_summary(d: Path, last: int, max_steps: int | None) -> dict:
    """The run's ``summary.json`` (``last``: the last logged training step, for the message).

    Raises:
        IncompleteRunError: no summary.json, a damaged one, or one of fewer steps than
            ``max_steps``."""
    if not (d / "summary.json").is_file():
        raise IncompleteRunError(incomplete_reason(d, last, max_steps))
    try:
        summary = json.loads((d / "summary.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IncompleteRunError(
            f"{d / 'summary.json'}: not valid JSON ({e}); the file is damaged (cut off while "
            f"written): rerun the same command with {_run_dir_arg(d)} to write it again from the "
            "run's last checkpoint, or leave the run out (--skip-incomplete)") from None
    if not isinstance(summary, dict):
        raise IncompleteRunError(f"{d / 'summary.json'}: holds a JSON {type(summary).__name__}, "
                                 "not an object; the file is damaged: rerun the same command with "
                                 f"{_run_dir_arg(d)} to write it again, or leave the run out "
                                 "(--skip-incomplete)")
    if max_steps is not None and summary.get("step", 0) < max_steps:
        raise IncompleteRunError(f"{d}: incomplete run: summary.json is at step "
                                 f"{summary.get('step')} of trainer.max_steps={max_steps}")
    return summary


NONFINITE = "n/a (non-finite)"  # a table cell whose recorded value was NaN or inf


def finite_only(obj, prefix: str = "") -> tuple:
    """``obj`` (parsed JSON) with every NaN / inf number replaced by None, and the list of
    ``(dotted key, value)`` replaced (``l0_layers.2`` for a list element)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None, [(prefix, obj)]
    bad: list = []
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out[k], b = finite_only(v, f"{prefix}.{k}" if prefix else str(k))
            bad += b
        return out, bad
    if isinstance(obj, list):
        out = []
        for i, v in enumerate(obj):
            x, b = finite_only(v, f"{prefix}.{i}" if prefix else str(i))
            out.append(x)
            bad += b
        return out, bad
    return obj, bad


def incomplete_reason(d: Path, last: int, max_steps) -> str:
    """Why a run has no summary.json and what to do, by its cause: the reason twell-train wrote
    to ``error.txt`` (a diverged run: rerunning repeats the divergence; another failure: fix
    it), else a crashed, killed or still running run (rerunning resumes it)."""
    err = d / ERROR_FILE
    reason = _first_chars(err) if err.is_file() else ""
    at = f"last logged step {last} of {max_steps}"
    fix = "Fix that and run it again, or leave it out (--skip-incomplete)"
    alone = _job_alone(d) if reason and not reason.startswith("NonFiniteLossError") else None
    if alone is not None:  # a -m sweep's job: the sweep's command with another value is refused
        fix = ("Fix that and run this sweep job alone in its folder, any value fixed in this "
               "command (the -m command with another value is refused as another sweep), or "
               f"leave it out (--skip-incomplete): {alone}")
    if reason and not (d / "config.yaml").is_file():
        job = _overrides_text(d)
        return f"{d}: failed before training{f' ({job})' if job else ''}: {reason}. {fix}"
    if reason.startswith("NonFiniteLossError"):
        facts = _error_facts(d)
        if facts is not None and isinstance(facts.get("step"), int):
            # error.txt names the checkpoint by the path the run had when it failed; the facts
            # hold it relative to the run dir (the advice names it where the run is now)
            at = f"at step {facts['step']}; {at}"
            reason = re.sub(r"[;,]?\s*last good checkpoint: .*$", "", reason)
        alone = _diverged_alone(d, reason)  # a -m sweep's job: the -m command is refused
        return (f"{d}: diverged run ({at}): {reason}. Rerunning the same command diverges "
                f"again{_diverged_advice(d, reason, sweep_job=alone is not None)}, or leave it "
                f"out (--skip-incomplete){'' if alone is None else f'. {alone}'}")
    if reason:
        return f"{d}: failed run ({at}): {reason}. {fix}"
    return (f"{d}: incomplete run: no summary.json ({at}); it crashed, was killed or is still "
            f"running: rerun the same command with {_run_dir_arg(d)} to resume it, or leave it "
            "out (--skip-incomplete)")


def _last_good(d: Path, reason: str) -> tuple[str, str | None]:
    """Diverged run ``d``'s last good checkpoint: ``("none", None)`` (it diverged before its
    first save), ``("path", <the path>)`` or ``("unknown", None)``. The checkpoint is the field
    twell-train wrote to ``error.json`` (relative to ``d``, so a moved run dir still names
    it); a run written before that file (or with it damaged): the ``last good checkpoint:
    ...`` that its error line ``reason`` names (shell-quoted there)."""
    import shlex

    facts = _error_facts(d)
    if facts is not None:
        path = facts["last_good_checkpoint"]
        return ("none", None) if path is None else ("path", str(d / path))
    found = re.search(r"last good checkpoint: ('[^']*'|\S+)", reason)
    if not found:
        return "unknown", None
    text = found.group(1).rstrip(".,;")
    if text == "none":
        return "none", None
    try:
        return "path", shlex.split(text)[0]
    except (ValueError, IndexError):  # not shell text after all: the path as written
        return "path", text


# A diverged run's checkpoint saved fewer steps than this before the diverged step is not named
# for a resume: step N's forward ran on step N-1's weights, and the weights of the steps just
# before a divergence may already be ruined, so that resume with a lower lr can diverge again
# (or go on from a ruined loss)
DIVERGED_MARGIN = 5


def _failed_step(d: Path, reason: str) -> int | None:
    """The step at which diverged run ``d`` stopped: ``error.json``'s, else the ``at step N`` /
    ``after step N`` of its error line ``reason``; None when neither names one."""
    facts = _error_facts(d)
    if facts is not None and isinstance(facts.get("step"), int):
        return facts["step"]
    found = re.search(r"\b(?:at|after) step (\d+)\b", reason)
    return int(found.group(1)) if found else None


def _resume_point(d: Path, reason: str) -> tuple[str, str | None, str | None]:
    """Which checkpoint the advice for diverged run ``d`` resumes: ``(kind, path, close)``,
    ``kind`` and ``path`` as :func:`_last_good` gives them, except that a last good checkpoint
    saved fewer than :data:`DIVERGED_MARGIN` steps before the failed step is replaced by the
    newest checkpoint kept in its run dir at least that many steps before (``"path"``), or by none
    (``"none"``); ``close`` then names the replaced one and why (None otherwise)."""
    from train.checkpoint import shell_quote  # (imports torch: not at import time)
    from twell.hf import folder_step, list_checkpoints

    kind, path = _last_good(d, reason)
    failed = _failed_step(d, reason)
    saved = folder_step(path) if kind == "path" else None
    if saved is None or failed is None or failed - saved >= DIVERGED_MARGIN:
        return kind, path, None
    gap = failed - saved
    close = (f"its last good checkpoint, {shell_quote(path)}, saved {gap} step"
             f"{'' if gap == 1 else 's'} before the divergence at step {failed} (step {failed}'s "
             f"forward ran on step {failed - 1}'s weights, and the weights of the steps just "
             "before a divergence may already be ruined)")
    folder = Path(path).parent
    run = folder.parent if folder.name == "checkpoints" and folder.is_dir() else d
    older = [c for c in list_checkpoints(run) if folder_step(c) <= failed - DIVERGED_MARGIN]
    return ("path", str(older[-1]), close) if older else ("none", None, close)


def _lower_lr(d: Path) -> tuple[str | None, str]:
    """The lower ``optim.lr`` that the advice for diverged run ``d`` names: ``(argument,
    words)``, the argument half the run's lr as its ``config.yaml`` records it (``optim.lr=0.0005``
    for 0.001: Hydra reads it as a float) and the words saying so; ``(None, words)`` when that
    file names no positive, finite lr, the words then saying what to set instead."""
    try:
        lr = _read_config(d).get("optim", {}).get("lr")
    except (ReportError, AttributeError):  # no or a damaged config.yaml, or no optim group
        lr = None
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not 0 < lr < math.inf:
        return None, "optim.lr set below the run's"
    half = f"{lr / 2:g}"
    if not re.search(r"[.eE]", half):  # 5, not a float to Hydra: 5.0
        half += ".0"
    return f"optim.lr={half}", f"any lr below the run's {lr:g} works; half of it here"


def _new_run_dir(d: Path, lr_arg: str | None) -> Path:
    """A folder beside run ``d`` for a resume with a lower lr: ``<d>_lr<value>`` (``<d>_lower_lr``
    without one), numbered ``_2``, ``_3``, ... when that name is taken."""
    base = f"{d.name}_lr{lr_arg.partition('=')[2]}" if lr_arg else f"{d.name}_lower_lr"
    new, n = d.parent / base, 1
    while new.exists():
        n += 1
        new = d.parent / f"{base}_{n}"
    return new


def _diverged_advice(d: Path, reason: str, sweep_job: bool = False) -> str:
    """What to do about diverged run ``d``, by the checkpoint to resume (:func:`_resume_point`):
    none: start again with a lower ``optim.lr``; a checkpoint: resume that one with a lower
    ``optim.lr`` (an earlier one than the last good, too close to the divergence: in a new
    run dir beside ``d``, :func:`_new_run_dir`, where the newer checkpoints refuse no branch);
    not known: either, the checkpoint to resume named in words. The arguments it gives paste
    as they are: the lower lr is half the run's (:func:`_lower_lr`). A ``-m`` sweep's job
    (``sweep_job``) is told what to do in words: :func:`_diverged_alone` gives its command
    (the sweep's ``-m`` command with another lr is refused as another sweep)."""
    from train.checkpoint import shell_quote  # (imports torch: not at import time)
    from train.requeue import override_arg

    kind, path, close = _resume_point(d, reason)
    ckpt = shell_quote(path) if path else None
    too_close = "" if close is None else f", and so may resuming {close}"
    if sweep_job:
        if kind == "none":
            return (f"{too_close}, with no earlier checkpoint kept: " if close else
                    ", and it has no good checkpoint to resume: ") + (
                "start it again with a lower optim.lr or longer optim.warmup_steps")
        named = (f"an earlier checkpoint, {ckpt}," if close else
                 f"its last good checkpoint, {ckpt}," if ckpt else "its last good checkpoint")
        return (f"{too_close}: resume {named} with a lower optim.lr or start a new sweep (a new "
                "hydra.sweep.dir) with a lower optim.lr or longer optim.warmup_steps")
    fresh = ("start a new run (a new hydra.run.dir) with a lower optim.lr or longer "
             "optim.warmup_steps")
    if kind == "none":
        if close:
            return f"{too_close}, with no earlier checkpoint kept: {fresh}"
        return f", and it has no good checkpoint to resume: {fresh}"
    lr_arg, lr_words = _lower_lr(d)
    lr = f" {lr_arg}" if lr_arg else f" and {lr_words}"  # the argument, else what to set
    lr_words = f"{lr_words}: " if lr_arg else ""
    resume = override_arg("trainer.resume", path) if path else None  # Hydra reads it back
    if close:
        new = override_arg("hydra.run.dir", _new_run_dir(d, lr_arg))
        return (f"{too_close}: resume an earlier checkpoint, {ckpt}, with a lower optim.lr in a "
                f"new hydra.run.dir ({lr_words}{resume} "
                f"trainer.resume_allow_changes=true {new}{lr}) or {fresh}")
    if ckpt is None:
        return (f": resume its last good checkpoint with a lower optim.lr ({lr_words}trainer."
                "resume set to its step folder under checkpoints/, trainer.resume_allow_changes="
                f"true{lr}) or {fresh}")
    return (f": resume its last good checkpoint, {ckpt}, with a lower optim.lr ({lr_words}"
            f"{resume} trainer.resume_allow_changes=true{lr}) or {fresh}")


def _diverged_alone(d: Path, reason: str) -> str | None:
    """For diverged ``-m`` sweep job ``d``: the sentence giving the command that runs it alone
    in its folder with a lower ``optim.lr`` (half the run's: :func:`_lower_lr`; its recorded
    overrides: :func:`_job_overrides`), resuming the checkpoint :func:`_resume_point` names
    (its folder's newer checkpoints set aside: a resume must continue the folder's newest), or,
    with none, started again (its files and checkpoints set aside: :func:`_fresh_alone`); None
    for a run that is no sweep's job. The command pastes as it is; what it cannot name (the
    lr of a run whose config names none, a checkpoint not known) the sentence says in words."""
    overrides = _job_overrides(d)
    if overrides is None:
        return None
    from train.checkpoint import shell_quote  # (torch: not at import time)
    from train.requeue import job_alone_command, override_arg, override_key
    from train.rundir import set_aside_command
    from twell.hf import folder_step, list_checkpoints

    lr_arg, lr_words = _lower_lr(d)
    why = "the -m command with another value is refused as another sweep"
    why = f"{lr_words}; {why}" if lr_arg else why
    kind, path, close = _resume_point(d, reason)
    # what the command leaves to the user, said in words (key: words); the job's recorded
    # values of those keys are left out of it too
    left = {} if lr_arg else {"optim.lr": lr_words}
    if kind != "none" and path is None:
        left = {"trainer.resume": "trainer.resume set to its last good checkpoint's step folder "
                                  "under checkpoints/", **left}
    overrides = [o for o in overrides if override_key(str(o)) not in left]
    added = f", by this command with {' and '.join(left.values())} added" if left else ""
    lower = (lr_arg,) if lr_arg else ()
    own = list_checkpoints(d)
    if kind == "none":
        aside = " (its checkpoints set aside too)" if own else ""
        return (f"This sweep job started again alone in its folder{aside} with a lower optim.lr "
                f"({why}){added}: {_fresh_alone(d, overrides, *lower)}")
    resume = (override_arg("trainer.resume", path),) if path else ()
    cmd = job_alone_command(d, overrides, *resume, "trainer.resume_allow_changes=true", *lower)
    if close is None:
        return (f"This sweep job resumed alone in its folder with a lower optim.lr ({why})"
                f"{added}: {cmd}")
    here = Path(path).parent.parent.resolve() == d.resolve()
    newer = tuple(f"checkpoints/{c.name}" for c in own
                  if not here or folder_step(c) > folder_step(path))
    if newer:
        cmd = f"{set_aside_command(d, newer)} && {cmd}"
    return (f"This sweep job resumed alone in its folder from {shell_quote(path)}"
            f"{' (its newer checkpoints set aside)' if newer else ''} with a lower optim.lr "
            f"({why}){added}: {cmd}")


def _error_facts(d: Path) -> dict | None:
    """The facts of a diverged run from its ``error.json`` (twell-train's ``{"error", "step",
    "reason", "last_good_checkpoint"}``); None when the file is missing, damaged or lacks a
    ``last_good_checkpoint`` that is a path or null (a run written before the file)."""
    path = d / ERROR_FACTS
    if not path.is_file():
        return None
    try:
        facts = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(facts, dict) or "last_good_checkpoint" not in facts:
        return None
    return facts if isinstance(facts["last_good_checkpoint"], str | None) else None


def _run_dir_arg(d: Path) -> str:
    """``hydra.run.dir=<d>`` as one shell argument (the folder of a timestamped run is not
    what the same command alone would pick); a ``-m`` sweep's job: ``hydra.sweep.dir=<its
    sweep's folder>`` (the same sweep command with it resumes every job there)."""
    from train.requeue import override_arg  # (train.rundir imports torch: not at import time)

    if d.name.isdigit() and (d.parent / "multirun.yaml").is_file():
        return override_arg("hydra.sweep.dir", d.parent.resolve())
    return override_arg("hydra.run.dir", d)


def _job_overrides(d: Path) -> list | None:
    """The recorded overrides (``.hydra/overrides.yaml``) of ``-m`` sweep job ``d``; None for a
    run that is no sweep's job (:func:`_run_dir_arg`'s test) or has none recorded."""
    from omegaconf import OmegaConf

    if not (d.name.isdigit() and (d.parent / "multirun.yaml").is_file()):
        return None
    f = d / ".hydra" / "overrides.yaml"
    try:
        overrides = OmegaConf.to_container(OmegaConf.load(f)) if f.is_file() else None
    except Exception:  # noqa: BLE001  (a damaged file: no command to give)
        return None
    return overrides if isinstance(overrides, list) else None


def _fresh_alone(d: Path, overrides: list, *extra: str) -> str:
    """The command that starts sweep job ``d`` again alone in its folder (with ``extra``
    arguments): its files set aside first when it started (``train.rundir.set_aside_command``,
    its log kept: a run dir holding another config and no checkpoint is refused), and its
    checkpoints too when it saved any (``trainer.resume=auto`` would continue the newest)."""
    from train.requeue import job_alone_command  # (torch: not at import time)
    from train.rundir import SET_ASIDE, set_aside_command
    from twell.hf import list_checkpoints

    cmd = job_alone_command(d, overrides, *extra)
    names = SET_ASIDE + tuple(f"checkpoints/{c.name}" for c in list_checkpoints(d))
    if (d / "config.yaml").is_file() or len(names) > len(SET_ASIDE):
        return f"{set_aside_command(d, names)} && {cmd}"
    return cmd


def _job_alone(d: Path) -> str | None:
    """The command that runs failed ``-m`` sweep job ``d`` again alone in its folder, with its
    recorded overrides (:func:`_job_overrides`; ``train.requeue.job_alone_command``); None for
    a run that is no sweep's job or has no overrides recorded. A job with a checkpoint
    resumes it (``trainer.resume=<d>``: ``auto`` refuses a changed value); one that started
    but saved none has its files set aside first (:func:`_fresh_alone`); one that failed
    before it started runs as it is."""
    overrides = _job_overrides(d)
    if overrides is None:
        return None
    from train.requeue import job_alone_command, override_arg  # (torch: not at import time)
    from twell.hf import list_checkpoints

    if list_checkpoints(d):
        return job_alone_command(d, overrides, override_arg("trainer.resume", d),
                                 "trainer.resume_allow_changes=true")
    return _fresh_alone(d, overrides)


def _first_chars(path: Path, n: int = 2000) -> str:
    """The first ``n`` characters of a run folder's text file, whitespace collapsed (a file of
    any size or encoding reads as text)."""
    with path.open("rb") as f:
        return " ".join(f.read(4 * n).decode("utf-8", errors="replace").split())[:n]


def _overrides_text(d: Path) -> str:
    """A run folder's command-line overrides (``.hydra/overrides.yaml``) as one string, "" if
    none are recorded."""
    ovs = _overrides_of(d)
    return " ".join(ovs) if ovs else ""


def load_runs(run_dirs: list[Path], *, skip_incomplete: bool = False
              ) -> tuple[list[Run], list[tuple[Path, str]]]:
    """Load every run; incomplete ones raise, or with ``skip_incomplete`` come back as
    ``(dir, reason)`` in the second list."""
    runs, skipped = [], []
    for d in run_dirs:
        try:
            runs.append(load_run(d))
        except IncompleteRunError as e:
            if not skip_incomplete:
                raise
            skipped.append((Path(d), str(e)))
    return runs, skipped


def comparison_key(run: Run) -> dict:
    """What must be equal for runs to be compared: data, tokens seen, sequence length."""
    data = {k: v for k, v in run.config.get("data", {}).items() if k not in _DATA_IGNORE}
    return {"data": data, "tokens seen": run.summary.get("tokens_seen"),
            "seq_len": run.config.get("model", {}).get("seq_len")}


def check_comparable(runs: list[Run]) -> None:
    """Raise :class:`MismatchError` naming the first run whose data, tokens seen or seq_len differ
    from the first run's."""
    if not runs:
        return
    ref = comparison_key(runs[0])
    for r in runs[1:]:
        key = comparison_key(r)
        for what in ref:
            if key[what] != ref[what]:
                a, b = ref[what], key[what]
                if what == "data":
                    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                    a = {k: a.get(k) for k in diff}
                    b = {k: b.get(k) for k in diff}
                raise MismatchError(
                    f"runs are not comparable: {what} differs: {runs[0].dir}: {a} vs {r.dir}: {b}"
                    "; compare runs trained on the same data, tokens and seq_len (or pass "
                    "--allow-mismatch)")


# ---------------------------------------------------------------- the table


COLUMNS = (["run", "setting", "size", "layers", "params_M", "nonemb_params_M", "tokens_M", "l1_coeff",
            "variant", "ffn_impl", "seed", "train_ce", "val_loss", "l0_mean", "l0_layer_max",
            "nnz_max", "dead_pct"] + [f"acc_{t}" for t in ALL_TASKS] + ["acc_mean", "tokens_per_s"])


# a summary key (Run.nonfinite, up to its first dot) -> the row columns computed from it
_FROM_SUMMARY = {"final_train_ce": ("train_ce",), "val_loss": ("val_loss",),
                 "l0_mean": ("l0_mean",), "l0_layers": ("l0_layer_max", "l0_layers"),
                 "nnz_max": ("nnz_max",), "dead_pct": ("dead_pct",),
                 "tokens_per_s": ("tokens_per_s",), "tokens_seen": ("tokens_M",),
                 "params": ("params_M", "nonemb_params_M"),
                 **{f"eval.eval_{t}": (f"acc_{t}",) for t in ALL_TASKS},
                 "eval.eval_mean": ("acc_mean",)}


def nonfinite_columns(run: Run) -> set[str]:
    """The :func:`run_row` columns whose value came from a NaN / inf of the run's summary."""
    cols = set()
    for key in run.nonfinite:
        head = key if key.startswith("eval.") else key.split(".")[0]
        cols.update(_FROM_SUMMARY.get(head, ()))
    return cols


def run_row(run: Run) -> dict:
    """One table row of a run (accuracies in percent; None where the run has no value, and
    ``nonfinite`` the columns whose recorded value was NaN / inf: shown as
    :data:`NONFINITE`). A value is never computed from a non-finite one (the layers' maximum
    of an L0 list holding one is None too)."""
    s, m, cfg = run.summary, run.config.get("model", {}), run.config
    l0_layers = s.get("l0_layers") or []
    ev = run.eval or {}
    params = s.get("params")
    emb = m.get("vocab_size", 0) * m.get("hidden_size", 0)  # tied: counted once in params

    def pct(v):
        return None if v is None else 100.0 * v

    return {
        "run": run.name,
        "size": m.get("name"),
        "layers": m.get("num_layers"),
        "params_M": None if params is None else params / 1e6,
        "nonemb_params_M": None if params is None else (params - emb) / 1e6,
        "tokens_M": None if s.get("tokens_seen") is None else s["tokens_seen"] / 1e6,
        "l1_coeff": cfg.get("sparsity", {}).get("l1_coeff"),
        "l1_final": run.final_l1_coeff,
        "target_l0": run.target_l0,
        "variant": run.variant,
        "ffn_impl": ffn_impl(run),
        "seed": cfg.get("trainer", {}).get("seed"),
        "train_ce": s.get("final_train_ce"),
        "val_loss": s.get("val_loss"),
        "l0_mean": s.get("l0_mean"),
        "l0_layer_max": max(l0_layers) if l0_layers and None not in l0_layers else None,
        "l0_layers": list(l0_layers) or None,
        "nnz_max": s.get("nnz_max"),
        "dead_pct": s.get("dead_pct"),
        **{f"acc_{t}": pct(ev.get(f"eval_{t}")) for t in ALL_TASKS},
        "acc_mean": pct(ev.get("eval_mean")),
        "tokens_per_s": s.get("tokens_per_s"),
        "nonfinite": nonfinite_columns(run),
    }


def sort_key(row: dict):
    """Table order: model size, then sparsity variant, FFN impl, L1 coefficient, run name."""
    return (row["nonemb_params_M"] or 0, row["variant"], row["ffn_impl"], row["l1_coeff"] or 0,
            row["run"])


def _fmt(v, col: str = "") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and not math.isfinite(v):  # never printed as nan / inf
        return NONFINITE
    if isinstance(v, float):
        if col == "l1_coeff":
            return "0" if v == 0 else f"{v:.3g}"
        if col == "tokens_per_s":
            return f"{v:,.0f}"
        if col in ("train_ce", "val_loss"):
            return f"{v:.4f}"
        if col.endswith("_M"):
            return f"{v:.1f}" if abs(v) >= 1 else f"{v:.3g}"
        return f"{v:.1f}" if abs(v) >= 10 or col.startswith("acc_") else f"{v:.3g}"
    return str(v)


_HEAD = {"run": "run", "setting": "differs", "size": "size", "layers": "layers", "params_M": "params (M)",
         "nonemb_params_M": "non-emb. (M)", "tokens_M": "tokens (M)", "l1_coeff": "L1",
         "variant": "sparsity", "ffn_impl": "FFN", "seed": "seed", "train_ce": "train CE",
         "val_loss": "val loss", "l0_mean": "L0 mean", "l0_layer_max": "L0 max layer",
         "nnz_max": "max nnz/token", "dead_pct": "dead %", "acc_mean": "mean acc",
         "tokens_per_s": "tok/s", **{f"acc_{t}": TASK_SHORT[t] for t in ALL_TASKS}}


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A GitHub markdown table of ``rows`` (dicts) over ``columns`` (default :data:`COLUMNS`)."""
    cols = list(columns or COLUMNS)
    out = ["| " + " | ".join(_HEAD.get(c, c) for c in cols) + " |",
           "|" + "|".join("---" for _ in cols) + "|"]
    out += ["| " + " | ".join(_cell(r, c) for c in cols) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _cell(row: dict, col: str) -> str:
    """A table cell: :data:`NONFINITE` where the run recorded NaN / inf, else :func:`_fmt`;
    the L1 of a steered run (``target_l0`` set) is its starting and its final coefficient,
    ``0.0003 -> 0.00038`` (the start alone when the final one is not known)."""
    if col == "l1_coeff" and row.get("target_l0") is not None and row.get("l1_final") is not None:
        return f"{_fmt(row.get(col), col)} -> {_fmt(row['l1_final'], col)}"
    return NONFINITE if col in row.get("nonfinite", ()) else _fmt(row.get(col), col)


def csv_header() -> dict[str, str]:
    """CSV column name per :data:`COLUMNS` key: a task's score column is named by its primary
    metric (``acc_norm_hellaswag``, ``acc_winogrande``; :data:`evals.tasks.TASKS`), the mean of
    them ``primary_mean``; ``l0_layers`` holds the final L0 of every layer, ``;``-separated;
    ``l1_coeff`` is the configured (starting) coefficient, ``l1_coeff_final`` the last step's,
    ``target_l0`` the L0 a steered run held its coefficient to (empty for other schedules)."""

    return {**{c: c for c in COLUMNS}, **{f"acc_{t}": f"{TASKS[t].primary}_{t}" for t in ALL_TASKS},
            "acc_mean": "primary_mean", "l0_layers": "l0_layers", "l1_final": "l1_coeff_final",
            "target_l0": "target_l0"}


def csv_text(rows: list[dict]) -> str:
    """All :data:`COLUMNS` and the per-layer L0 as CSV, headed by :func:`csv_header` (full
    precision; accuracies in percent; empty = no value, or a NaN / inf the run recorded: the
    report's warnings name those)."""
    head = csv_header()
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(head.values())
    for r in rows:
        w.writerow(["" if r.get(c) is None else
                    ";".join("" if v is None else f"{v:g}" for v in r[c]) if c == "l0_layers"
                    else r[c] for c in head])
    return buf.getvalue()


def l0_layer_table(rows: list[dict]) -> str:
    """Markdown table of the final L0 of every layer, one row per run (``rows`` from
    :func:`run_row` with their ``setting`` labels); a run with fewer layers gets n/a."""
    n = max((len(r["l0_layers"]) for r in rows if r.get("l0_layers")), default=0)
    table = []
    for r in rows:
        layers = r.get("l0_layers") or []
        nan = "l0_layers" in r.get("nonfinite", ())  # its None layers were NaN / inf
        table.append({"run": r["run"], "setting": r.get("setting"),
                      **{f"layer {i}": layers[i] if i < len(layers) else None for i in range(n)},
                      "nonfinite": {f"layer {i}" for i, v in enumerate(layers)
                                    if nan and v is None}})
    return markdown_table(table, ["run", "setting"] + [f"layer {i}" for i in range(n)])


# ---------------------------------------------------------------- pairs


def flatten(d: dict, prefix: str = "") -> dict:
    """A nested dict (a run's config) as ``{"group.key": value}``; lists stay values."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _config_diff(a: Run, b: Run) -> set[str]:
    fa, fb = flatten(a.config), flatten(b.config)
    return {k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k)}


# config keys that do not tell runs apart (bookkeeping, not the recipe)
_LABEL_IGNORE = ("logging.", "trainer.progress", "trainer.resume", "data.cache_dir",
                 "data.build_if_missing", "data.verify", "data.num_proc")
_MODEL_SHAPE = ("model.vocab_size", "model.hidden_size", "model.intermediate_size",
                "model.num_layers", "model.num_heads", "model.num_kv_heads", "model.seq_len")


def _value_text(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


MAX_LABEL = 60  # characters of a run label in tables and legends; a longer one is cut, numbered,
# and spelled out in the report's label legend


def _overrides_of(d: Path) -> list[str] | None:
    """A run folder's command-line overrides (``.hydra/overrides.yaml``) without bookkeeping
    ones, renamed keys at their new places (``train.config.upgrade_override``), the recipe's
    first (:func:`_label_order`), or None when it has none saved."""
    from omegaconf import OmegaConf

    f = d / ".hydra" / "overrides.yaml"
    try:
        found = OmegaConf.to_container(OmegaConf.load(f)) if f.is_file() else None
    except Exception:  # noqa: BLE001  (a damaged file: fall back to the config)
        return None
    if not isinstance(found, list):
        return None
    from train.config import upgrade_override

    kept = [upgrade_override(str(o)) for o in found  # a run saved before the ffn group too
            if not str(o).lstrip("+~").startswith(("hydra.", *_LABEL_IGNORE))]
    return sorted(kept, key=lambda o: _label_order(o.lstrip("+~").split("=", 1)[0]))


def _overrides(run: Run) -> list[str] | None:
    """:func:`_overrides_of` the run's folder."""
    return _overrides_of(run.dir)


# keys that set how a run is evaluated, logged or saved, not what it trains: a label names them
# after the recipe's keys, so a label cut at MAX_LABEL keeps the difference that matters
_LABEL_LAST = ("eval", "logging", "trainer.progress", "trainer.log_every", "trainer.val_every",
               "trainer.val_sequences", "trainer.save_every", "trainer.keep_last",
               "trainer.num_threads")


def _label_order(key: str) -> int:
    """0 for a key (or group) of the recipe, 1 for one in :data:`_LABEL_LAST`."""
    return int(any(key == k or key.startswith((k + ".", k + "/")) for k in _LABEL_LAST))


def full_labels(runs: list[Run]) -> dict[Path, str]:
    """A label per run directory naming what sets it apart, uncut (see :func:`run_labels`)."""
    ovs = {r.dir: _overrides(r) for r in runs}
    if len(runs) > 1 and all(v is not None for v in ovs.values()):
        common = set.intersection(*(set(v) for v in ovs.values()))
        by_overrides = {d: " ".join(o for o in v if o not in common) for d, v in ovs.items()}
        if all(by_overrides.values()) and len(set(by_overrides.values())) == len(runs):
            return by_overrides
    flats = {r.dir: {k: v for k, v in flatten(r.config).items() if not k.startswith(_LABEL_IGNORE)}
             for r in runs}
    keys = sorted({k for f in flats.values() for k in f
                   if len({repr(g.get(k)) for g in flats.values()}) > 1},
                  key=lambda k: (_label_order(k), k))  # the recipe's keys first
    if "model.name" in keys:
        keys = [k for k in keys if k not in _MODEL_SHAPE]
    labels = {r.dir: ", ".join(f"{k}={_value_text(flats[r.dir].get(k))}" for k in keys) or r.name
              for r in runs}
    counts: dict[str, int] = {}
    for lab in labels.values():
        counts[lab] = counts.get(lab, 0) + 1
    return {d: (f"{lab} ({d.name})" if counts[lab] > 1 and lab != d.name else lab)
            for d, lab in labels.items()}


def run_labels(runs: list[Run]) -> dict[Path, str]:
    """A label per run directory naming what sets it apart, at most :data:`MAX_LABEL` long.

    When every run was started by twell-train and their command lines tell them apart: the
    overrides not shared by all of them (``model=small_l4 sparsity.l1_coeff=1e-3``). Otherwise
    ``key=value`` for every config key whose value differs between the runs
    (``sparsity.l1_coeff=0.001``), in key order. Either way what sets how a run is evaluated,
    logged or saved (:data:`_LABEL_LAST`: ``eval.*``, ...) comes after the recipe's keys, so a
    cut label still shows what was trained differently. Bookkeeping keys (logging, progress bars,
    resume, data cache) are left out, and so are the shape keys of ``model`` when
    ``model.name`` already differs; runs with identical configs (or a single run) are labelled
    by their directory name, equal labels get it appended. A longer label is cut and numbered
    (``[2] model.hidden_size=...``); :func:`label_legend` spells it out.
    """
    return {d: _cut(i, lab) for i, (d, lab) in enumerate(full_labels(runs).items(), 1)}


def _cut(i: int, label: str) -> str:
    return label if len(label) <= MAX_LABEL else f"[{i}] {label[:MAX_LABEL - 6].rstrip()}\u2026"


def label_legend(runs: list[Run]) -> list[str]:
    """``[i] full label`` for each label :func:`run_labels` cut (same numbering)."""
    return [f"[{i}] {lab}" for i, lab in enumerate(full_labels(runs).values(), 1)
            if len(lab) > MAX_LABEL]


def _coeff_in_force(run: Run) -> float:
    """The coefficient a run is compared at: a steered run's final one where known, else
    ``sparsity.l1_coeff``."""
    final = run.final_l1_coeff if run.target_l0 is not None else None
    return run.config.get("sparsity", {}).get("l1_coeff") if final is None else final


def variant_pairs(runs: list[Run]) -> list[tuple[Run, Run]]:
    """(baseline, variant) pairs: configs differ only in ``sparsity.*``, the baseline is a plain
    constant-L1 run and the variant is l1_reinit / warmup / steered (same coefficient preferred:
    a steered run's final one)."""
    pairs = []
    bases = [r for r in runs if r.variant == "l1"]
    for v in runs:
        if v.variant in ("l1", "dense"):
            continue
        cands = [b for b in bases if all(k.startswith("sparsity.") for k in _config_diff(b, v))]
        if not cands:
            continue
        coeff = _coeff_in_force(v)
        cands.sort(key=lambda b: abs(math.log(b.config["sparsity"]["l1_coeff"] / coeff))
                   if coeff else 0.0)
        pairs.append((cands[0], v))
    return pairs


def variant_rows(pairs: list[tuple[Run, Run]]) -> list[dict]:
    """One row per (baseline, variant) pair: L0, dead %, val loss, mean accuracy of both (L1:
    a steered variant's final coefficient where known)."""
    out = []
    for b, v in pairs:
        rb, rv = run_row(b), run_row(v)
        out.append({"size": rv["size"], "variant": rv["variant"],
                    "l1": f"{_fmt(rb['l1_coeff'], 'l1_coeff')} -> "
                          f"{_fmt(_coeff_in_force(v), 'l1_coeff')}",
                    **{k: f"{_cell(rb, k)} -> {_cell(rv, k)}"
                       for k in ("l0_mean", "dead_pct", "val_loss", "acc_mean")},
                    "runs": f"{b.name} / {v.name}"})
    return out


def ffn_impl(run: Run) -> str:
    """The run's ``ffn.impl`` (``torch`` where its config has none)."""
    return (run.config.get("ffn") or {}).get("impl", "torch")


def ffn_pairs(runs: list[Run]) -> list[tuple[Run, Run]]:
    """(torch, other impl) pairs whose configs differ only in ``ffn.impl``."""
    pairs = []
    for a in runs:
        if ffn_impl(a) != "torch":
            continue
        for b in runs:
            if b is not a and _config_diff(a, b) == {"ffn.impl"}:
                pairs.append((a, b))
    return pairs


def ffn_pair_row(ref: Run, other: Run) -> dict:
    """Issue-6 check of one FFN pair: max |loss difference| over the steps both logged, final L0
    relative difference, dead units (count) difference, val loss and tokens/s of both."""
    # steps with a logged loss (a NaN / inf one was made None by load_run: not compared)
    loss_a = {r["step"]: r["loss"] for r in ref.train if r.get("loss") is not None}
    loss_b = {r["step"]: r["loss"] for r in other.train if r.get("loss") is not None}
    common = sorted(set(loss_a) & set(loss_b))
    max_diff = max((abs(loss_a[s] - loss_b[s]) for s in common), default=None)
    worst = max(common, key=lambda s: abs(loss_a[s] - loss_b[s])) if common else None
    H = ref.config["model"]["intermediate_size"]

    def dead_units(run):
        layers = run.train[-1].get("dead_layers") if run.train else None
        return None if layers is None or None in layers else round(sum(layers) * H)

    la, lb = ref.summary.get("l0_mean"), other.summary.get("l0_mean")
    da, db = dead_units(ref), dead_units(other)
    ta, tb = ref.summary.get("tokens_per_s"), other.summary.get("tokens_per_s")
    return {
        "size": ref.config["model"].get("name"),
        "impls": f"torch vs {ffn_impl(other)}",
        "steps_compared": len(common),
        "max_abs_loss_diff": max_diff,
        "at_step": worst,
        "l0_torch": la, "l0_other": lb,
        "l0_rel_diff": None if not la or lb is None else abs(lb - la) / la,
        "dead_torch": da, "dead_other": db,
        "dead_diff": None if da is None or db is None else db - da,
        "val_loss_torch": ref.summary.get("val_loss"), "val_loss_other": other.summary.get("val_loss"),
        "speed_ratio": None if not ta or tb is None else tb / ta,
        "runs": f"{ref.name} / {other.name}",
    }


# ---------------------------------------------------------------- L0 per token position


def l0_by_position(run_dir: str | Path, *, batches: int = 2, device: str | None = None,
                   checkpoint: str | Path | None = None):
    """Mean active FFN units per token position, per layer, from a run's final checkpoint.

    Loads the checkpoint with :func:`train.model.load_model`, feeds ``batches`` validation
    micro-batches of the run's own data (``config.yaml``'s data section, seq_len, micro-batch and
    seed) and, through a forward pre-hook on every ``SparseGatedMLP``, counts ``relu(x Wg^T) > 0``
    (``x Wu^T`` for the non-gated FFN) per token: the same test the FFN's own stats use.
    On CUDA the forward runs under bf16 autocast when the run trained in bf16.

    Args:
        run_dir: a finished run directory.
        batches: validation micro-batches to average over (>= 1).
        device: ``cpu`` / ``cuda`` / None (CUDA if available).
        checkpoint: a ``step{N}`` folder; default the newest complete one of the run.

    Returns:
        ``(l0_LT, n_seqs)``: float64 numpy array (L, T), mean active units at each position over
        the ``n_seqs`` sequences seen.

    Raises:
        ReportError: no checkpoint, no validation data, or ``batches`` < 1.
    """
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from transformers.utils import logging as hf_logging

    from train.checkpoint import latest_checkpoint
    from train.data import DataConfig, build_datamodule
    from train.model import load_model

    hf_logging.disable_progress_bar()  # no "Loading weights" bar per run
    d = Path(run_dir)
    if batches < 1:
        raise ReportError(f"batches must be >= 1 for the L0-by-position measurement; got {batches}")
    try:
        ckpt = Path(checkpoint) if checkpoint else latest_checkpoint(d)
    except FileNotFoundError as e:
        raise ReportError(f"{d}: no checkpoint to measure L0 by position ({e})") from None
    cfg = OmegaConf.to_container(OmegaConf.load(d / "config.yaml"), resolve=True)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_model(ckpt).to(dev)
    data = build_datamodule(DataConfig(**cfg["data"]), seq_len=cfg["model"]["seq_len"],
                            micro_batch=cfg["trainer"]["micro_batch"] or 8,  # null: planned
                            seed=cfg["trainer"]["seed"])
    bf16 = dev.type == "cuda" and cfg["trainer"].get("precision") in ("auto", "bf16")
    sums_LT, n_seqs = _active_by_position(model, data.val_batches(batches), cfg["model"]["seq_len"],
                                          dev, bf16)
    if n_seqs == 0:
        raise ReportError(f"{d}: the run's data has no validation batches; cannot measure L0 "
                          "by position")
    return (sums_LT / n_seqs).cpu().numpy().astype(np.float64), n_seqs


def _active_by_position(model, batches_BT, T: int, dev, bf16: bool):
    """(sums_LT, n_seqs): per layer and position, the active FFN units (``relu(x Wg^T) > 0``,
    ``x Wu^T`` non-gated, counted by a forward pre-hook on every FFN) summed over the sequences of
    ``batches_BT`` (float64 (L, T) on ``dev``), and how many sequences that is; bf16 autocast
    with ``bf16``."""
    import torch
    import torch.nn.functional as F

    from train.model import ffn_modules
    from twell.nn import FFNPlan

    mlps = ffn_modules(model)
    FFNPlan(mlps).set_collect_stats(False)  # the hooks below count; no statistics pass
    sums_LT = torch.zeros(len(mlps), T, dtype=torch.float64, device=dev)
    current: list = [None] * len(mlps)

    def make_hook(i, mlp):
        def hook(_module, args):
            x_BTD = args[0]
            w_HD = mlp.gate_proj.weight if mlp.gated else mlp.up_proj.weight
            current[i] = (F.linear(x_BTD, w_HD) > 0).sum(-1, dtype=torch.int64)  # (B, T)
        return hook

    handles = [m.register_forward_pre_hook(make_hook(i, m)) for i, m in enumerate(mlps)]
    n_seqs = 0
    try:
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            for ids_BT in batches_BT:
                ids_BT = ids_BT.to(dev)
                model(input_ids=ids_BT)
                sums_LT[:, :ids_BT.shape[1]] += torch.stack(current).sum(1).double()
                n_seqs += ids_BT.shape[0]
    finally:
        for h in handles:
            h.remove()
    return sums_LT, n_seqs


# ---------------------------------------------------------------- plots


def _symlog_x(ax, values):
    pos = sorted(v for v in values if v > 0)
    if pos:
        ax.set_xscale("symlog", linthresh=pos[0] / 2)
    ax.set_xticks(sorted(set(values)))
    ax.set_xticklabels([_fmt(float(v), "l1_coeff") for v in sorted(set(values))])
    ax.minorticks_off()


def _value_axis(ax, values, axis: str = "y") -> None:
    """Log scale when the positive ``values`` span at least a decade, else linear; tick labels
    plain numbers (``168``, not ``1.68x10^2``)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    pos = [v for v in values if v is not None and v > 0]
    a = ax.yaxis if axis == "y" else ax.xaxis
    if pos and max(pos) >= 10 * min(pos):
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
        a.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        a.set_minor_formatter(NullFormatter())
    else:
        a.get_major_formatter().set_useOffset(False)


_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "v", "D", "x", "+", "*")


def _style(i: int) -> dict:
    """Line style of the i-th run: overlapping curves stay distinguishable."""
    return {"ls": _STYLES[i % len(_STYLES)], "marker": _MARKERS[i % len(_MARKERS)], "ms": 3}


@dataclass
class _PlotInput:
    """What every plot stage reads: the runs, their labels and table rows, the plain runs
    (constant L1 or dense, torch FFN) and their (non-embedding params, size name) pairs."""

    runs: list[Run]
    labels: dict[Path, str]
    rows: dict[Path, dict]
    plain: list[Run]
    sizes: list[tuple]


def write_plots(runs: list[Run], out_dir: Path, position: dict | None = None,
                notes: list[str] | None = None) -> list[Path]:
    """PNG plots (matplotlib, Agg) into ``out_dir``; returns the files written.

    Runs are labelled by :func:`run_labels` (what differs between them). A plot or panel
    without data to show is not drawn; ``notes`` (if given) receives one line per plot left
    out and why.

    - ``l0_vs_l1.png``: final L0 (mean over layers; the most active layer dashed) vs L1, one
      line per size (plain-L1/dense runs, torch FFN); needs two L1 values or more.
    - ``l0_vs_size.png``: final L0 vs non-embedding params, one line per L1 (plain-L1/dense
      runs, torch FFN); needs two model sizes or more.
    - ``acc_loss_vs_l1.png``: mean accuracy (%) and validation loss vs L1, one line per size;
      needs two L1 values or more; the accuracy panel only when evals ran, its axis naming the
      tasks the runs were scored on (a note when they differ).
    - ``l0_per_layer.png``: per-layer final L0 of every run, one panel per L1.
    - ``train_curves.png``: train CE (with validation loss as crosses), L0 and dead units (%)
      at every logged step, and (two runs or more) each run's CE minus the first run's, which
      separates curves that overlap.
    - ``l0_by_position.png``: when ``position`` maps run names to ((L, T), n) measurements.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    notes = [] if notes is None else notes
    rows = {r.dir: run_row(r) for r in runs}
    plain = [r for r in runs if r.variant in ("l1", "dense")
             and ffn_impl(r) == "torch"]
    sizes = sorted({(rows[r.dir]["nonemb_params_M"], rows[r.dir]["size"]) for r in plain})
    inp = _PlotInput(runs, run_labels(runs), rows, plain, sizes)
    stages = [("l0_vs_l1.png", _plot_l0_vs_l1), ("l0_vs_size.png", _plot_l0_vs_size),
              ("acc_loss_vs_l1.png", _plot_acc_loss_vs_l1),
              ("l0_per_layer.png", _plot_l0_per_layer), ("train_curves.png", _plot_train_curves)]
    if position:
        stages.append(("l0_by_position.png",
                       lambda inp, notes: _plot_l0_by_position(inp, position)))
    written = []
    for name, draw in stages:
        fig = draw(inp, notes)
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(out_dir / name)
    return written


def _left_out(inp: _PlotInput) -> str:
    """Why the L1 and size plots leave runs out ('' when they leave none): a steered run's L1
    moved, a warmup / re-init run is no plain L1, a run on another ``ffn.impl``."""
    plain = {r.dir for r in inp.plain}
    rest = [r for r in inp.runs if r.dir not in plain]
    why = []
    if any(r.target_l0 is not None for r in rest):
        why.append("steered runs are left out: their L1 moved")
    if any(r.target_l0 is None and r.variant not in ("l1", "dense") for r in rest):
        why.append("warmup / re-init runs are left out: the variant table compares them")
    impls = sorted({ffn_impl(r) for r in rest if r.variant in ("l1", "dense")})
    if impls:
        why.append(f"runs on ffn.impl={' / '.join(impls)} are left out")
    return "; ".join(why)


def _not_drawn(name: str, inp: _PlotInput, short: str, left_out_would_fill: bool) -> str:
    """The note of an L1 / size plot the plain runs cannot fill: ``short`` (why not), and the
    runs left out when there is no plain run or they would have filled it."""
    left = _left_out(inp)
    if left and not inp.plain:
        return f"{name}: not drawn ({left}; no plain-L1 run)"
    return f"{name}: not drawn ({short}" + (f"; {left}" if left and left_out_would_fill
                                              else "") + ")"


def _plot_l0_vs_size(inp: _PlotInput, notes: list[str]):
    """L0 vs model size, one line per L1 coefficient (None: fewer than two sizes)."""
    import matplotlib.pyplot as plt

    rows, plain = inp.rows, inp.plain
    if len(inp.sizes) < 2:
        sizes_all = {inp.rows[r.dir]["size"] for r in inp.runs}
        notes.append(_not_drawn("l0_vs_size.png", inp, "one model size; it needs two or more",
                                len(sizes_all) > 1))
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    l0s = []
    for coeff in sorted({rows[r.dir]["l1_coeff"] for r in plain}):
        pts = sorted((rows[r.dir]["nonemb_params_M"], rows[r.dir]["l0_mean"],
                      rows[r.dir]["layers"]) for r in plain
                     if rows[r.dir]["l1_coeff"] == coeff and rows[r.dir]["l0_mean"] is not None)
        if pts:
            l0s += [p[1] for p in pts]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-",
                    label=f"L1 = {_fmt(float(coeff), 'l1_coeff')}")
            for x, y, layers in pts:
                ax.annotate(f"{layers}L", (x, y), textcoords="offset points", xytext=(3, 3),
                            fontsize=7)
    ax.set_xlabel("non-embedding parameters (M)")
    ax.set_ylabel("L0: active FFN units per token\n(final, mean over layers)")
    _value_axis(ax, l0s)
    _value_axis(ax, [p[0] for p in inp.sizes], "x")
    ax.set_title("Active units vs model size")
    ax.legend(fontsize=8)
    return fig


def _plot_acc_loss_vs_l1(inp: _PlotInput, notes: list[str]):
    """Mean accuracy and validation loss vs L1, one line per size (None: one L1 value, or
    neither accuracy nor validation loss)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    rows, plain = inp.rows, inp.plain
    coeffs_plain = sorted({rows[r.dir]["l1_coeff"] for r in plain})
    has_acc = any(rows[r.dir]["acc_mean"] is not None for r in plain)
    has_val = any(rows[r.dir]["val_loss"] is not None for r in plain)
    if len(coeffs_plain) < 2 or not (has_acc or has_val):
        notes.append(_not_drawn("acc_loss_vs_l1.png", inp, (
            "one L1 value; it needs two or more" if len(coeffs_plain) < 2
            else "no accuracy or validation loss"),
            len({_coeff_in_force(r) for r in inp.runs}) > 1))
        return None
    panels = [p for p, has in (("acc", has_acc), ("val", has_val)) if has]
    if not has_acc:
        notes.append("acc_loss_vs_l1.png: no accuracy panel (no run has eval results)")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    ax_of = dict(zip(panels, axes[0]))
    for _, size in inp.sizes or [(None, rows[r.dir]["size"]) for r in plain[:1]]:
        rs = sorted((rows[r.dir] for r in plain if rows[r.dir]["size"] == size),
                    key=lambda x: x["l1_coeff"])
        for panel, key in (("acc", "acc_mean"), ("val", "val_loss")):
            pts = [(x["l1_coeff"], x[key]) for x in rs if x[key] is not None]
            if panel in ax_of and pts:
                ax_of[panel].plot(*zip(*pts), "o-", label=size)
    for ax in ax_of.values():
        _symlog_x(ax, coeffs_plain)
        ax.set_xlabel("L1 coefficient")
        ax.legend(fontsize=8)
    if "acc" in ax_of:
        ax_of["acc"].set_ylabel(_mean_accuracy_label([rows[r.dir] for r in plain], notes))
        ax_of["acc"].yaxis.set_major_formatter(PercentFormatter(xmax=100))
        ax_of["acc"].set_title("Downstream accuracy vs L1")
    if "val" in ax_of:
        _value_axis(ax_of["val"], [])  # plain labels: no "+1.01e1" offset
        ax_of["val"].set_ylabel("validation loss (CE)")
        ax_of["val"].set_title("Validation loss vs L1")
    return fig


def evaluated_tasks(row: dict) -> tuple[str, ...]:
    """The tasks a run's eval scored (a :func:`run_row` row), in :data:`ALL_TASKS` order."""
    return tuple(t for t in ALL_TASKS if row.get(f"acc_{t}") is not None)


def _mean_accuracy_label(rows: list[dict], notes: list[str]) -> str:
    """The accuracy axis's label: the mean over the tasks the runs were scored on (their
    number, and their names when fewer than all seven); runs scored on different tasks are
    noted (their means are not comparable)."""
    sets = sorted({evaluated_tasks(r) for r in rows if r.get("acc_mean") is not None})
    if len(sets) == 1:
        tasks = sets[0]
        if len(tasks) == len(ALL_TASKS):
            return f"mean accuracy, {len(tasks)} tasks"
        short = ", ".join(TASK_SHORT[t] for t in tasks)
        return f"mean accuracy, {len(tasks)} task{'s' if len(tasks) != 1 else ''} ({short})"
    counts = sorted({len(t) for t in sets})
    notes.append("acc_loss_vs_l1.png: the runs were scored on different tasks ("
                 + "; ".join(", ".join(TASK_SHORT[t] for t in ts) for ts in sets)
                 + "): their means are not comparable")
    span = f"{counts[0]}-{counts[-1]}" if len(counts) > 1 else str(counts[0])
    return f"mean accuracy over each run's tasks ({span})"


def _plot_l0_vs_l1(inp: _PlotInput, notes: list[str]):
    """Final L0 (mean over layers, and the most active layer dashed) vs the L1 coefficient,
    one line per size: what an L1 sweep asks (None: fewer than two L1 values)."""
    import matplotlib.pyplot as plt

    rows, plain = inp.rows, inp.plain
    with_l0 = [r for r in plain if rows[r.dir]["l0_mean"] is not None]
    coeffs = sorted({rows[r.dir]["l1_coeff"] for r in with_l0})
    if len(coeffs) < 2:
        logged = [r for r in inp.runs if rows[r.dir]["l0_mean"] is not None]
        notes.append(_not_drawn("l0_vs_l1.png", inp, (
            "one L1 value; it needs two or more" if coeffs
            else "no plain-L1 run logged L0" if logged else "no run logged L0"),
            len({_coeff_in_force(r) for r in logged}) > 1))
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    vals = []
    for i, (_, size) in enumerate(inp.sizes or [(None, rows[with_l0[0].dir]["size"])]):
        rs = sorted((rows[r.dir] for r in with_l0 if rows[r.dir]["size"] == size),
                    key=lambda x: x["l1_coeff"])
        if not rs:
            continue
        xs = [x["l1_coeff"] for x in rs]
        line, = ax.plot(xs, [x["l0_mean"] for x in rs], "o-", label=f"{size}: mean over layers")
        vals += [x["l0_mean"] for x in rs]
        top = [(x["l1_coeff"], x["l0_layer_max"]) for x in rs if x["l0_layer_max"] is not None]
        if top:
            ax.plot(*zip(*top), "^--", color=line.get_color(), ms=4, lw=0.8,
                    label=f"{size}: most active layer")
            vals += [v for _, v in top]
    _symlog_x(ax, coeffs)
    _value_axis(ax, vals)
    ax.set_xlabel("L1 coefficient")
    ax.set_ylabel("L0: active FFN units per token (final)")
    ax.set_title("Active units vs L1")
    ax.legend(fontsize=7)
    return fig


def _plot_l0_per_layer(inp: _PlotInput, notes: list[str]):
    """Per-layer final L0, one panel per L1 coefficient or, for steered runs, per target L0
    (one shared panel when every panel would hold one run); None when no run logged per-layer
    L0."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    with_layers = [r for r in inp.runs if r.summary.get("l0_layers")]
    if not with_layers:
        return None

    def panel(r: Run) -> tuple:  # a steered run's panel is its target L0, not its start L1
        t = r.target_l0
        return (0, inp.rows[r.dir]["l1_coeff"] or 0.0) if t is None else (1, float(t))

    keys = sorted({panel(r) for r in with_layers})
    if max(sum(panel(r) == k for r in with_layers) for k in keys) == 1:
        keys = [None]  # one run per panel (a plain L1 sweep): one shared panel
    fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        vals = []
        for i, r in enumerate(with_layers):
            if key is not None and panel(r) != key:
                continue
            layers = r.summary["l0_layers"]
            vals += layers
            ax.plot(range(len(layers)), layers, label=inp.labels[r.dir], **_style(i))
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("L0 (active units per token, final)")
        _value_axis(ax, vals)
        ax.set_title("Final L0 per layer" if key is None
                     else f"L1 = {_fmt(key[1], 'l1_coeff')}" if key[0] == 0
                     else f"steered to L0 {key[1]:g}")
        ax.legend(fontsize=7)
    return fig


def _plot_train_curves(inp: _PlotInput, notes: list[str]):
    """Train CE (+ validation), L0, dead units and the CE difference to the first run at every
    logged step; None when no run logged a step."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    labels = inp.labels
    curves = [r for r in inp.runs if r.train]
    if not curves:
        return None
    has_dead = any(x.get("dead_frac") is not None for r in curves for x in r.train)
    ref_ce = {x["step"]: x["ce"] for x in curves[0].train if x.get("ce") is not None}
    has_diff = len(curves) > 1 and any(x["step"] in ref_ce for r in curves[1:] for x in r.train)
    n = 2 + has_dead + has_diff
    fig, grid = plt.subplots((n + 1) // 2, 2, figsize=(10.4, 4 * ((n + 1) // 2)), squeeze=False)
    panels = list(grid.flat)
    for extra in panels[n:]:
        extra.remove()
    panels = panels[:n]  # CE, L0, [dead], [CE difference]
    l0_vals = _draw_train_curves(panels, curves, labels, ref_ce, has_dead, has_diff)
    _label_train_panels(panels, curves, labels, l0_vals, has_dead, has_diff)
    for ax in panels:
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    panels[0].legend(fontsize=7)  # the CE panel's
    return fig


def _draw_train_curves(panels: list, curves: list[Run], labels: dict, ref_ce: dict,
                       has_dead: bool, has_diff: bool) -> list[float]:
    """Each run's curves into ``panels`` (CE with validation points, L0, [dead %], [CE minus the
    first run's, ``ref_ce``]); returns the L0 values drawn."""
    ax_ce, ax_l0 = panels[0], panels[1]
    l0_vals = []
    for i, r in enumerate(curves):
        st = _style(i)
        steps = [x["step"] for x in r.train]
        line, = ax_ce.plot(steps, [x["ce"] for x in r.train], lw=1, label=labels[r.dir], **st)
        val = [(x["step"], x["val_loss"]) for x in r.val if x.get("val_loss") is not None]
        if val:
            ax_ce.plot(*zip(*val), "x", color=line.get_color(), ms=7, mew=1.5)
        l0 = [x.get("l0_mean") for x in r.train]
        l0_vals += [v for v in l0 if v is not None]
        ax_l0.plot(steps, l0, lw=1, label=labels[r.dir], **st)
        if has_diff and i > 0:  # curves that overlap in CE: their difference to the first
            diff = [(x["step"], x["ce"] - ref_ce[x["step"]]) for x in r.train
                    if x["step"] in ref_ce and x.get("ce") is not None]
            if diff:
                panels[-1].plot(*zip(*diff), lw=1, label=labels[r.dir], color=line.get_color(),
                                **st)
        if has_dead:
            panels[2].plot(steps, [None if x.get("dead_frac") is None else 100 * x["dead_frac"]
                                   for x in r.train], lw=1, label=labels[r.dir], **st)
    return l0_vals


def _label_train_panels(panels: list, curves: list[Run], labels: dict, l0_vals: list[float],
                        has_dead: bool, has_diff: bool) -> None:
    """Titles, axis labels and ranges of the training-curve panels."""
    from matplotlib.ticker import PercentFormatter

    ax_ce, ax_l0 = panels[0], panels[1]
    _value_axis(ax_ce, [])
    ax_ce.set_title("Train CE (x: validation loss)")
    ax_ce.set_ylabel("cross-entropy (nats)")
    ax_l0.set_title("L0: active FFN units per token")
    ax_l0.set_ylabel("L0 (mean over layers)")
    _value_axis(ax_l0, l0_vals)
    if has_dead:
        top = max((100 * x["dead_frac"] for r in curves for x in r.train
                   if x.get("dead_frac") is not None), default=0.0)
        panels[2].set_title("Dead FFN units")
        panels[2].set_ylabel("dead units (mean over layers)")
        panels[2].yaxis.set_major_formatter(PercentFormatter(xmax=100))
        panels[2].set_ylim(0, max(5.0, 1.1 * top))  # 0-5 % at least: none dead looks so
    if has_diff:
        panels[-1].axhline(0, color="0.6", lw=0.8)
        _value_axis(panels[-1], [])
        panels[-1].set_title("Train CE minus the first run's")
        panels[-1].set_ylabel(f"CE - CE({labels[curves[0].dir]})"[:60])
        panels[-1].legend(fontsize=7)


def _plot_l0_by_position(inp: _PlotInput, position: dict):
    """Mean L0 over layers vs token position, one line per measured run."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    label_of_name = {r.name: inp.labels[r.dir] for r in inp.runs}
    fig, ax = plt.subplots(figsize=(7, 4))
    vals = []
    for i, (name, (l0_LT, n)) in enumerate(position.items()):
        mean_T = l0_LT.mean(0)
        vals += [float(v) for v in mean_T]
        ax.plot(range(1, len(mean_T) + 1), mean_T, lw=1,
                label=f"{label_of_name.get(name, name)} ({n} seqs)", ls=_STYLES[i % 4])
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    _value_axis(ax, vals)
    ax.set_xlabel("token position in the sequence")
    ax.set_ylabel("L0 (mean over layers)")
    ax.set_title("Active units vs token position")
    ax.legend(fontsize=7)
    return fig


# ---------------------------------------------------------------- the whole report


@dataclass
class Report:
    """The collected runs, their rows and pairs; ``markdown()`` renders it."""

    runs: list[Run]
    rows: list[dict]
    skipped: list[tuple[Path, str]]
    variant_rows: list[dict]
    ffn_rows: list[dict]
    position: dict
    plots: list[Path] = field(default_factory=list)
    plot_notes: list[str] = field(default_factory=list)
    legend: list[str] = field(default_factory=list)  # the labels run_labels cut, in full

    def markdown(self, image_prefix: str = "") -> str:
        acc_cols = [f"acc_{t}" for t in ALL_TASKS] + ["acc_mean"]
        no_acc = all(r.get(c) is None for r in self.rows for c in acc_cols)
        cols = [c for c in COLUMNS if not (no_acc and c in acc_cols)]
        md = ["## Runs", "", markdown_table(self.rows, cols),
              ("L0: mean active FFN units per token (final logged step; `L0 mean` averages the "
              "layers, `L0 max layer` is the most active layer); dead %: units inactive over a "
              "whole optimizer step's tokens; task scores: percent, each task's primary metric "
              "(acc or acc_norm)" + (", not shown: no run has eval results" if no_acc else "")
              + "; tok/s: training tokens per second of the run."
              + (" L1 of a run steered to a target L0: its starting -> final coefficient."
                 if any(r.get("target_l0") is not None for r in self.rows) else "")), ""]
        if self.legend:
            md += [f"Labels cut at {MAX_LABEL} characters, in full:", ""]
            md += [f"- {x}" for x in self.legend] + [""]
        if any(r.get("l0_layers") for r in self.rows):
            md += ["## L0 per layer", "", l0_layer_table(self.rows),
                   "Final logged L0 (active FFN units per token) of each layer, layer 0 first.",
                   ""]
        if self.variant_rows:
            md += ["## Sparsity variants (baseline -> variant)", "",
                   markdown_table(self.variant_rows, ["size", "variant", "l1", "l0_mean",
                                                      "dead_pct", "val_loss", "acc_mean", "runs"]),
                   ""]
        if self.ffn_rows:
            cols = ["size", "impls", "steps_compared", "max_abs_loss_diff", "at_step", "l0_torch",
                    "l0_other", "l0_rel_diff", "dead_torch", "dead_other", "dead_diff",
                    "val_loss_torch", "val_loss_other", "speed_ratio", "runs"]
            md += ["## FFN implementations (same seed and config)", "", markdown_table(
                [{k: (f"{v:.3g}" if isinstance(v, float) and math.isfinite(v) else v)
                  for k, v in r.items()} for r in self.ffn_rows], cols), ""]
        if self.skipped:
            md += ["## Incomplete runs (left out)", ""]
            md += [f"- `{d}`: {why}" for d, why in self.skipped] + [""]
        if self.plots:
            md += ["## Plots", ""]
            md += [f"![{p.stem}]({image_prefix}{p.name})" for p in self.plots] + [""]
            md += [f"- {n}" for n in self.plot_notes] + ([""] if self.plot_notes else [])
        return "\n".join(md)


def build_report(paths: list[str], *, skip_incomplete: bool = False, allow_mismatch: bool = False,
                 position_batches: int = 0, position_l1: float | None = None,
                 device: str | None = None, plot_dir: Path | None = None) -> Report:
    """Collect runs, check them, compute the rows, pairs, optional L0-by-position, plots.

    Raises:
        ReportError / IncompleteRunError / MismatchError: naming the run directory.
    """
    runs, skipped = load_runs(find_runs(paths), skip_incomplete=skip_incomplete)
    if not runs:
        raise ReportError("no finished run to report: " + "; ".join(w for _, w in skipped))
    if not allow_mismatch:
        check_comparable(runs)
    runs.sort(key=lambda r: sort_key(run_row(r)))
    position = {}
    if position_batches:
        for r in runs:
            if position_l1 is not None and not math.isclose(
                    r.config["sparsity"]["l1_coeff"], position_l1, rel_tol=1e-9, abs_tol=1e-15):
                continue
            position[r.name] = l0_by_position(r.dir, batches=position_batches, device=device)
    labels = run_labels(runs)
    rep = Report(runs, [{**run_row(r), "setting": labels[r.dir]} for r in runs], skipped,
                 variant_rows(variant_pairs(runs)),
                 [ffn_pair_row(a, b) for a, b in ffn_pairs(runs)], position,
                 legend=label_legend(runs))
    if plot_dir is not None:
        rep.plots = write_plots(runs, plot_dir, position or None, notes=rep.plot_notes)
    return rep


def csv_rows(rep: Report) -> list[dict]:
    """The report's rows for ``runs.csv``: each ``setting`` the full label (:func:`full_labels`;
    the markdown table's may be cut and numbered)."""
    full = full_labels(rep.runs)
    return [{**row, "setting": full[r.dir]} for row, r in zip(rep.rows, rep.runs, strict=True)]


def write_outputs(rep: Report, out_dir: Path, image_prefix: str = "") -> dict[str, Path]:
    """``report.md``, ``runs.csv``, ``position_l0.json`` (if measured) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"markdown": out_dir / "report.md", "csv": out_dir / "runs.csv"}
    files["markdown"].write_text(rep.markdown(image_prefix))
    files["csv"].write_text(csv_text(csv_rows(rep)))
    if rep.position:
        files["position"] = out_dir / "position_l0.json"
        files["position"].write_text(json.dumps(
            {k: {"n_seqs": n, "l0_LT": [[round(float(x), 3) for x in row] for row in a]}
             for k, (a, n) in rep.position.items()}))
    return files


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``twell-report``."""
    p = argparse.ArgumentParser(prog="twell-report", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories, their parents, or globs")
    p.add_argument("--out", type=Path, default=None,
                   help="write report.md, runs.csv and the PNGs here (default: print only)")
    p.add_argument("--image-prefix", default="", help="prefix of the image links in report.md")
    p.add_argument("--skip-incomplete", action="store_true",
                   help="list unfinished runs instead of failing on them")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="report runs trained on different data/tokens/seq_len together")
    p.add_argument("--position-batches", type=int, default=0,
                   help="measure L0 per token position on N validation micro-batches per run "
                        "(loads each final checkpoint; 0 = off)")
    p.add_argument("--position-l1", type=float, default=None,
                   help="measure L0 by position only for runs at this L1 coefficient")
    p.add_argument("--device", default=None, help="device of the position measurement")
    p.add_argument("--csv", action="store_true", help="print CSV instead of markdown")
    a = p.parse_args(argv)
    try:
        rep = build_report(a.runs, skip_incomplete=a.skip_incomplete,
                           allow_mismatch=a.allow_mismatch, position_batches=a.position_batches,
                           position_l1=a.position_l1, device=a.device, plot_dir=a.out)
    except ReportError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if a.out is not None:
        files = write_outputs(rep, a.out, a.image_prefix)
        print("\n".join(f"{k}: {v}" for k, v in files.items()))
        print("\n".join(f"plot: {p}" for p in rep.plots))
    print(csv_text(csv_rows(rep)) if a.csv else rep.markdown(a.image_prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
