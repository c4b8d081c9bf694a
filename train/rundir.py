"""Run-directory rules: one process per run dir (a lock), what ``trainer.resume`` accepts, which
config changes a resume allows, the clean-up of a run that failed before it trained, and a run
dir starting with ``~`` (the home folder: :class:`HomeDirCallback`).

Resume rules (docs/training.md, "Resuming"):

- ``trainer.resume=auto`` continues the newest intact checkpoint of the run dir (a damaged newer
  one is skipped with a warning naming it) only if its config equals this one up to
  :data:`RESUME_SAFE_KEYS` (how the run executes, logs, validates, evaluates and saves); any
  other difference is a :class:`ConfigError` naming the keys, since the directory then holds
  another run.
- ``trainer.resume=PATH`` (a ``step{N}`` folder or a run dir: its newest intact checkpoint)
  continues that checkpoint with this config, except that the model shape must match, the data
  position must belong to the same data, and the optimizer / schedule keys
  (:data:`RESUME_OPTIM_KEYS`) may differ only with ``trainer.resume_allow_changes=true``, which
  applies them exactly from the next step (``Trainer.resume``). A damaged or incomplete named
  checkpoint is refused in one line with the ways out.
- One line of training per run dir: a PATH older than the run dir's newest checkpoint, or from
  another run while the run dir holds checkpoints, would branch inside it (rotation and
  ``auto`` would then mix the two lines), so it is refused: a branch gets its own
  ``hydra.run.dir``. Only checkpoints that could be resumed count (``_check_branch``): a newer
  one failing its SHA-256 or holding tensors a resume refuses does not, so the way out a
  refusal names (an older intact checkpoint) works in the same run dir. For the same reason ``trainer.resume=never`` is refused in a run dir that
  holds checkpoints. Each checkpoint's ``metadata.json`` names its lineage and the checkpoint
  its line branched from (``train.checkpoint.new_lineage``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from train import checkpoint as ckpt_io
from train.config import ConfigError

LOCK_FILE = ".lock"

# Keys a resume may change without a word beyond the "config changed" note: how the run
# executes (FFN path, precision, device, micro-batch, threads, compile, recomputation, the loss's
# chunking, the memory planner), logs, validates, evaluates and saves. They change no weight,
# optimizer value or data position (micro-batch and precision change the numbers only by
# rounding). Prefixes end with ".".
RESUME_SAFE_KEYS = (
    "trainer.resume", "trainer.resume_allow_changes", "trainer.progress", "trainer.log_every",
    "trainer.val_every", "trainer.val_sequences", "trainer.val_batches", "trainer.save_every",
    "trainer.keep_last", "trainer.num_threads", "trainer.compile", "trainer.compile_scope",
    "trainer.deterministic", "trainer.grad_checkpointing", "trainer.micro_batch",
    "trainer.precision", "trainer.cpu",
    "trainer.checkpoint_ffn", "trainer.recompute_norms", "trainer.recast_attn_weights",
    "trainer.ce_chunk_rows", "trainer.liger", "trainer.norm_out_bf16", "trainer.fused_norm_cast",
    "trainer.memory",
    "trainer.fused_ce", "trainer.lean_norms", "trainer.compile_norms",  # removed; older runs
    "trainer.memory_budget_gb",
    "model.name", "ffn.impl", "ffn.host_sync", "optim.fused",
    "data.num_proc", "data.verify", "data.build_if_missing", "data.cache_dir",
    "logging.", "eval.",
)
# The ffn.policy fields (twell.policy.FFNPolicy) a resume may change; the one list. Each only
# picks the inference path (TwELL, the hybrid ELL forward or dense) or the inference consumer's
# schedule: the no-grad forwards alone read them (validation, evals; the training ops,
# twell/ops/ffn_train.py and ffn_dense_train.py, read none), the paths they choose between
# compute the same FFN up to rounding, and no state saved in a checkpoint depends on them.
# Every other ffn.policy field stays part of the checkpoint's shape
# (Checkpointer.check_resume_config), to be conservative:
# the ELL capacity, all-dense fraction, hot-unit and backup-floor fields decide the FFN plan
# state saved with each checkpoint (capacities, hot units), and the training path's thresholds
# and measured choice made its saved paths and timings. Removed fields (infer_split_long,
# infer_split_parts) are not listed: train.config.upgrade_saved drops them from saved configs.
RESUME_SAFE_POLICY_KEYS = tuple(f"ffn.policy.{name}" for name in (
    "infer_density_threshold", "infer_min_rows", "infer_min_flops", "infer_measure",
    "infer_timed_calls", "infer_twell_margin", "infer_remeasure_factor",  # inference path
    "infer_ell",
    "infer_long_rows", "infer_long_min_nnz", "infer_heavy_first",  # the consumer's schedule
))
RESUME_SAFE_KEYS += RESUME_SAFE_POLICY_KEYS
# Keys of the optimizer and its schedule (trainer.max_steps is the cosine's length): a resume
# changes them only with trainer.resume_allow_changes=true (applied exactly, Trainer.resume).
RESUME_OPTIM_KEYS = ("optim.lr", "optim.min_lr_ratio", "optim.betas", "optim.eps",
                     "optim.weight_decay", "optim.warmup_steps", "optim.schedule",
                     "optim.grad_clip", "trainer.max_steps")


def _matches(key: str, names: tuple[str, ...]) -> bool:
    return any(key == n or (n.endswith(".") and key.startswith(n)) for n in names)


def resume_safe(key: str) -> bool:
    """Whether the dotted config ``key`` is one a resume may change (:data:`RESUME_SAFE_KEYS`:
    how a run executes, logs, evaluates and saves, not what it trains)."""
    return _matches(key, RESUME_SAFE_KEYS)


def split_changes(changes: list[str]) -> tuple[list[str], list[str]]:
    """Split ``config_diff`` lines ('key: a -> b') into (optimizer/schedule, other) changes,
    dropping the :data:`RESUME_SAFE_KEYS`."""
    optim, other = [], []
    for c in changes:
        key = c.split(":", 1)[0]
        if resume_safe(key):
            continue
        (optim if _matches(key, RESUME_OPTIM_KEYS) else other).append(c)
    return optim, other


def resolve_resume(resume: str, warn=None) -> Path:
    """The checkpoint folder ``trainer.resume=PATH`` names: a complete ``step{N}`` folder, or a
    run dir (its newest intact checkpoint, SHA-256 checked; ``warn(line)`` for each damaged
    newer one skipped).

    Raises:
        ConfigError: the path does not exist, or is neither a complete checkpoint nor a run dir
            holding an intact one (one line naming the path and the fix).
    """
    path = Path(resume).expanduser()
    if path.is_symlink():  # a link the user names is the user's choice: judge where it points
        path = path.resolve()
    if not path.exists():
        raise ConfigError(f"trainer.resume={resume!r}: {path} does not exist; give an existing "
                          "step{N} checkpoint folder or run dir, or use auto or never.")
    if (path / "metadata.json").is_file():
        return path
    if ckpt_io.checkpoint_root(path).is_dir():
        try:
            return ckpt_io.latest_checkpoint(path, checksums=True, warn=warn)
        except FileNotFoundError as e:
            raise ConfigError(f"trainer.resume={resume!r}: the run dir holds no intact "
                              f"checkpoint ({e}); give another checkpoint or use never.") from None
    raise ConfigError(f"trainer.resume={resume!r} is neither a complete checkpoint folder (no "
                      "metadata.json) nor a run dir with checkpoints/; give a step{N} folder or "
                      "a run dir, or use auto or never.")


def _step(ckpt: Path) -> int:
    """The step a checkpoint folder records (its name only where it records none; -1: neither,
    e.g. a copy named ``best`` with a damaged metadata.json)."""
    try:
        step = ckpt_io.read_metadata(ckpt).get("step")
    except (OSError, ValueError):
        step = None
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    named = ckpt_io.folder_step(ckpt)
    return -1 if named is None else named


def ways_out(ckpt: Path, problems: list[str]) -> str:
    """The ways to go on from a damaged or incomplete checkpoint: an older intact checkpoint of
    its run dir, and (if its model files are intact) a weights-only start with a fresh optimizer."""
    older = [c for c in ckpt_io.list_checkpoints(ckpt.parent.parent)
             if _step(c) < _step(ckpt) and not ckpt_io.verify(c, checksums=False)]
    q = ckpt_io.shell_quote  # paths in the commands shown: pasted as one shell word
    ways = [f"resume an older intact checkpoint (trainer.resume={q(older[-1])})"] if older else []
    if not any(p.startswith(("model.safetensors", "config.json")) for p in problems):
        ways.append(f"start from its weights alone with a fresh optimizer and schedule "
                    f"(model.init_from={q(ckpt)} in a new hydra.run.dir)")
    return "; or ".join(ways) if ways else "start a new run (a new hydra.run.dir)"


def _check_branch(run_dir: Path, path: Path, own: list[Path]) -> None:
    """Refuse a resume that would put a second line of training into ``run_dir``.

    Only checkpoints that could be resumed count: those passing :func:`ckpt_io.verify` with
    their SHA-256 (``auto`` and a run dir skip a damaged one), and, of ``path``'s own run dir,
    whose tensors would load (:func:`ckpt_io.tensor_problems`: a NaN checkpoint is refused on
    resume with the older ``path`` as the way out, so that way must work). A save of the same
    step replaces such a damaged checkpoint later. Hashing happens only here, for checkpoints
    newer than ``path`` (or, for a ``path`` of another run, every checkpoint of ``run_dir``).
    """
    here = path.resolve()
    same_run = here.parent.parent == run_dir.resolve()
    cands = [c for c in own if c.resolve() != here and (not same_run or _step(c) > _step(path))]
    others = [c for c in cands if not ckpt_io.verify(c, checksums=True)
              and not (same_run and ckpt_io.tensor_problems(c, like=path))]
    if not others:
        return
    names = ", ".join(c.name for c in others[-3:])
    raise ConfigError(
        f"trainer.resume={path}: {run_dir} already holds newer or other checkpoints ({names}); "
        f"training there would put a second line of training into it (rotation and "
        f"trainer.resume=auto would mix them). To continue {run_dir}'s newest checkpoint pass "
        f"trainer.resume=auto; to branch from {path.name}, give the branch a new hydra.run.dir "
        f"({run_dir} stays as it is), or delete {names} under {ckpt_io.checkpoint_root(run_dir)} "
        "first to discard them.")


def check_new_line(run_dir: str | Path) -> None:
    """``trainer.resume=never``: refuse a run dir that holds checkpoints (the new run's would mix
    with them in rotation and ``auto``).

    Raises:
        ConfigError: one line naming the checkpoints and the fixes.
    """
    own = ckpt_io.list_checkpoints(run_dir)
    if own:
        raise ConfigError(
            f"trainer.resume=never: {run_dir} holds checkpoints of an earlier run "
            f"({', '.join(c.name for c in own[-3:])}); a new run there would mix with them. "
            "Use a new hydra.run.dir, trainer.resume=auto to continue that run, or delete "
            f"{ckpt_io.checkpoint_root(run_dir)} first.")


def find_resume_checkpoint(run_dir: str | Path, resume: str, warn=None) -> Path | None:
    """The checkpoint a run with ``trainer.resume=resume`` in ``run_dir`` continues (None: it
    starts from scratch), verified against its metadata.json (sizes and SHA-256).

    ``warn(line)`` gets a line for each damaged checkpoint skipped (``auto`` or a run dir).

    Raises:
        ConfigError: a PATH that would branch inside the run dir (see the module docstring);
            a PATH that is not a checkpoint. (``never`` in a run dir with checkpoints:
            :func:`check_new_line`.)
        train.checkpoint.CheckpointError: the named checkpoint is damaged or incomplete, or
            ``auto`` finds checkpoints but none intact (one line with the ways out).
    """
    run_dir = Path(run_dir)
    own = ckpt_io.list_checkpoints(run_dir)
    if resume == "never":
        return None
    if resume == "auto":
        if not own:
            return None
        try:
            return ckpt_io.latest_checkpoint(run_dir, checksums=True, warn=warn)
        except FileNotFoundError as e:
            newest = own[-1]
            raise ckpt_io.CheckpointError(
                f"trainer.resume=auto: {e}; {ways_out(newest, ckpt_io.verify(newest))}, or "
                f"delete {ckpt_io.checkpoint_root(run_dir)} to start over.") from None
    path = resolve_resume(resume, warn=warn)
    problems = ckpt_io.verify(path)
    if problems:
        raise ckpt_io.CheckpointError(
            f"trainer.resume={resume}: checkpoint {path} is damaged or incomplete "
            f"({'; '.join(problems[:3])}); {ways_out(path, problems)}.")
    _check_branch(run_dir, path, own)
    return path


def finished_run(run_dir: str | Path, cfg, job: list[str] | None = None
                 ) -> tuple[str, dict] | None:
    """``(line, summary)`` when the command that made ``run_dir`` is run again after its run
    finished (``twell-train`` then stops before loading data or model), else None: the run
    dir's ``summary.json`` and newest checkpoint are at ``trainer.max_steps``, the
    checkpoint's config equals ``cfg`` up to :data:`RESUME_SAFE_KEYS` (and the null shape of
    ``model=pretrained``), no process holds its lock (:func:`in_use`), ``trainer.resume`` is
    ``auto`` or names that run dir or checkpoint (the command that extended the run), and no
    final eval is due (``train.loop.final_eval_due``: a rerun with evals turned on runs them).
    A run stopped in its final evals has no ``summary.json``: its resume runs them. The line
    says how to train the run longer (docs/training.md, Resuming). Raises nothing: a file it
    cannot read leaves the decision to the resume, which names the problem. ``job``: the
    overrides of a ``-m`` sweep's job (None: a single run), whose line names the command that
    trains that job on alone in its folder (``train.requeue.job_alone_command``): the same
    ``-m`` command with more steps is refused as another sweep."""
    import json

    from train.checkpointer import config_diff, config_to_dict
    from train.config import upgrade_saved
    from train.loop import final_eval_due

    run_dir, steps = Path(run_dir), cfg.trainer.max_steps
    path = run_dir / "summary.json"
    own = ckpt_io.list_checkpoints(run_dir) if run_dir.is_dir() else []
    if not own or not path.is_file() or path.is_symlink() or in_use(run_dir):
        return None  # in use: the lock refuses this process in one line
    resume = cfg.trainer.resume
    if resume != "auto" and Path(resume).expanduser().resolve() not in (run_dir.resolve(),
                                                                         own[-1].resolve()):
        return None  # never, or another checkpoint: the resume rules decide
    try:
        summary = json.loads(path.read_text())
        saved = upgrade_saved(ckpt_io.load_yaml(own[-1] / "train_config.yaml"))
    except (OSError, ValueError, ckpt_io.CheckpointError):
        return None  # the resume names what is wrong
    if not (isinstance(summary, dict) and summary.get("step") == steps == _step(own[-1])):
        return None
    # a null model key (model=pretrained) is read from the checkpoint when the run resumes
    changes = [c for c in config_diff(saved, config_to_dict(cfg))
               if not (c.startswith("model.") and c.endswith(" -> None"))]
    optim, other = split_changes(changes)
    if optim or other:  # another run, or a changed one: the resume checks say which
        return None
    if cfg.eval.enabled and final_eval_due(cfg.eval, steps, summary.get("eval")):
        return None
    done = (f"run dir {run_dir} already reached trainer.max_steps={steps} (checkpoint "
            f"{own[-1].name}, summary.json): nothing to train.")
    more = "twice its steps here; any larger trainer.max_steps works"  # a value that pastes
    from train.requeue import job_alone_command, override_arg  # (it imports this module)

    if job is not None:
        cmd = job_alone_command(run_dir, job, override_arg("trainer.resume", run_dir),
                                f"trainer.max_steps={2 * steps}",
                                "trainer.resume_allow_changes=true")
        return (f"{done} To train this sweep job longer, run it alone in its folder (a -m sweep "
                "with more steps into the same hydra.sweep.dir is refused as another sweep; "
                f"each job's line names its own command; {more}): {cmd}"), summary
    q = override_arg("trainer.resume", run_dir)  # Hydra reads it back: '=' or ',' in the path
    return (f"{done} To train it longer, run the same command with {q} "
            f"trainer.max_steps={2 * steps} trainer.resume_allow_changes=true ({more})."), summary


class RunDirLock:
    """An exclusive ``flock`` on ``run_dir/.lock`` for the life of a run (the main process).

    The lock file holds the owner's PID; it is not deleted on release (deleting a lock file
    lets a third process lock a new file while a second still holds the old one).

    Raises:
        ConfigError: another process holds the lock (names its PID and the lock file).
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a+")  # noqa: SIM115  (held open for the run's life)
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.seek(0)
            pid = self._f.read().strip() or "unknown"
            self._f.close()
            raise ConfigError(
                f"run dir {self.path.parent} is in use by another twell-train process (PID "
                f"{pid}, holding {self.path}); wait for it to end or use another hydra.run.dir."
            ) from None
        self._f.truncate(0)
        self._f.write(str(os.getpid()))
        self._f.flush()

    @property
    def held(self) -> bool:
        return not self._f.closed

    def release(self) -> None:
        """Unlock (idempotent)."""
        if self._f.closed:
            return
        self._f.truncate(0)
        self._f.flush()
        fcntl.flock(self._f, fcntl.LOCK_UN)
        self._f.close()


def in_use(run_dir: str | Path) -> bool:
    """Whether another process holds ``run_dir``'s lock: a shared ``flock`` tried on the lock
    file opened read-only (not written, no link followed), released at once."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # none (no holder), or a link (the run's checks refuse it)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock taken
    return False


def try_lock(run_dir: str | Path) -> RunDirLock | None:
    """:class:`RunDirLock` on an existing ``run_dir``, or None while another process holds it."""
    try:
        return RunDirLock(run_dir)
    except ConfigError:
        return None


# ---------------------------------------------------------------- whose run dir it is

_CLAIMED: set[Path] = set()


def claim(run_dir: str | Path) -> None:
    """Note that ``run_dir`` is this process's run: it holds the lock and found the dir new or
    holding this run (the trainer, after its resume checks). Only then (or for a dir that was
    empty when the job started) may a failure write into it (``train.main``); a process refused
    there (another process's lock, another run's config or checkpoints) writes nothing."""
    _CLAIMED.add(Path(run_dir).resolve())


def claimed(run_dir: str | Path) -> bool:
    """Whether :func:`claim` noted ``run_dir`` in this process."""
    return Path(run_dir).resolve() in _CLAIMED


# ---------------------------------------------------------------- failed starts (Hydra runs)

_HYDRA_FILES = {"config.yaml", "hydra.yaml", "overrides.yaml"}
_NEW_DIRS: set[Path] = set()  # run dirs (or sweep dirs) that did not exist when Hydra started


def holds_nothing_else(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds only what a run that never trained leaves: Hydra's ``.hydra/``,
    the lock file and the text log."""
    for p in run_dir.iterdir():
        if p.name == ".hydra" and p.is_dir():
            if {q.name for q in p.iterdir()} - _HYDRA_FILES:
                return False
        elif p.name not in (LOCK_FILE, "train.log", "main.log"):
            return False
    return True


def remove_failed_run_dir(run_dir: str | Path) -> bool:
    """Remove the run dir of an attempt that failed before training, if this process's Hydra
    run created it (see :class:`RunDirCallback`) and it holds nothing else. Returns whether it
    was removed; a directory that existed before is never touched."""
    d = Path(run_dir).resolve()
    created = d in _NEW_DIRS or d.parent in _NEW_DIRS
    if not created or not d.is_dir() or not holds_nothing_else(d):
        return False
    shutil.rmtree(d)
    if d.parent in _NEW_DIRS and d.parent.is_dir() and not any(d.parent.iterdir()):
        d.parent.rmdir()  # a sweep dir made for this sweep, now empty
    return True


try:
    from hydra.experimental.callback import Callback
except ImportError:  # Hydra is only needed by the CLI
    Callback = object


def expand_home(config, key: str) -> str | None:
    """Replace a leading ``~`` or ``~user`` of the run-dir ``key`` (``hydra.run.dir`` or
    ``hydra.sweep.dir``) of Hydra's ``config`` by that home folder (``os.path.expanduser``; the
    rest of the value, ``${now:...}`` interpolations included, kept), as a shell would: Hydra
    itself makes a folder named ``~`` in the working directory. Returns the new value; None
    when the value starts with no ``~``.

    Raises:
        ConfigError: a ``~user`` that names no home folder (one line with the fix).
    """
    from omegaconf import OmegaConf, open_dict, read_write

    group, name = key.rsplit(".", 1)
    node = OmegaConf.select(config, group)
    value = str(OmegaConf.to_container(node, resolve=False)[name])
    if not value.startswith("~"):
        value = str(OmegaConf.select(config, key))  # an interpolation that gives a ~ path
        if not value.startswith("~"):
            return None
    home = os.path.expanduser(value)
    if home.startswith("~"):
        user = value.split("/", 1)[0]
        raise ConfigError(f"{key}={value!r}: {user} is no home folder here (no such user); give "
                          "an absolute path or one under ~/.")
    with read_write(node), open_dict(node):
        node[name] = home
    return home


class HomeDirCallback(Callback):
    """Hydra callback (``hydra.callbacks`` in configs/train.yaml, first): before Hydra makes the
    run dir (``-m``: the sweep dir), a ``~`` at its start becomes the home folder
    (:func:`expand_home`); one that names none stops the run in one line (exit code 2)."""

    def on_run_start(self, config, **kwargs) -> None:
        self._expand(config, "hydra.run.dir")

    def on_multirun_start(self, config, **kwargs) -> None:
        home = self._expand(config, "hydra.sweep.dir")
        if home is not None:  # each job's config is composed again from the hydra overrides
            from omegaconf import open_dict, read_write

            from train.requeue import hydra_override

            overrides = config.hydra.overrides
            with read_write(overrides), open_dict(overrides):
                overrides.hydra.append(hydra_override("hydra.sweep.dir", home))

    @staticmethod
    def _expand(config, key: str) -> str | None:
        import sys

        try:
            return expand_home(config, key)
        except ConfigError as e:
            print(f"ConfigError: {e}", file=sys.stderr)
            sys.exit(2)


class RunDirCallback(Callback):
    """Hydra callback (``hydra.callbacks`` in configs/train.yaml): notes whether the run dir
    (``-m``: the sweep dir) exists before Hydra creates it, so a run that fails before training
    removes only a directory made for it."""

    def on_run_start(self, config, **kwargs) -> None:
        d = Path(str(config.hydra.run.dir)).resolve()
        if not d.exists():
            _NEW_DIRS.add(d)

    def on_multirun_start(self, config, **kwargs) -> None:
        d = Path(str(config.hydra.sweep.dir)).resolve()
        if not d.exists():
            _NEW_DIRS.add(d)


def undo_failed_setup(run_dir: Path, lock: RunDirLock | None, *, made_dir: bool,
                      had_lock_file: bool) -> None:
    """After a ``Trainer`` construction failed: release ``lock`` (this process's, or None) and
    leave ``run_dir`` as found: its lock file removed when the run was refused in another
    run's folder (``made_dir``, ``had_lock_file``: how it was before), the folder removed when
    the construction made it and left nothing else there."""
    if not (made_dir or had_lock_file or claimed(run_dir)) and lock is not None:
        # refused in another run's folder: leave it as found (removed while held)
        (run_dir / LOCK_FILE).unlink(missing_ok=True)
    if lock is not None:
        lock.release()
    if made_dir and run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {LOCK_FILE}:
        (run_dir / LOCK_FILE).unlink(missing_ok=True)
        run_dir.rmdir()


# the files of a run that a new run in its folder refuses (config.yaml: another config), writes
# over (metrics.jsonl, summary.json), drops (error.txt, error.json: a rerun starts clean) or
# continues (wandb_id.txt: the wandb run); train.log is appended to and stays as it is
SET_ASIDE = ("config.yaml", "metrics.jsonl", "summary.json", "error.txt", "error.json",
             "wandb_id.txt")


def set_aside_command(run_dir: str | Path, names: tuple[str, ...] = SET_ASIDE) -> str:
    """The shell command that renames the entries ``names`` (paths relative to ``run_dir``;
    default the files of :data:`SET_ASIDE`) present in ``run_dir`` to ``<name>.old``
    (``.old2``, ... when one is taken), so that a new run can start there and nothing is lost:
    the log, ``.hydra/``, ``wandb/`` and the set-aside files stay, and no report reads the
    renamed files as a run (e.g. ``(cd runs/x && for f in config.yaml.old metrics.jsonl.old;
    do ...; done && mv config.yaml config.yaml.old && mv metrics.jsonl metrics.jsonl.old)``).
    A checkpoint folder among ``names`` (``checkpoints/step5``) renamed so is no checkpoint to
    resume, rotate or refuse a resume by (its name is no longer ``step{N}``): an older
    checkpoint can then be resumed there.

    The new names are free when the command is made; one taken when it runs (the command run
    a second time, from the shell's history, after the run it preceded wrote its own files)
    stops it before anything moves, in one line on stderr with a non-zero status (so a
    following ``&& twell-train ...`` does not run): ``mv`` would write a file over its
    set-aside copy (the earlier run's record lost) and move a folder into its ``.old``
    folder."""
    d = Path(run_dir)
    present = [n for n in names if (d / n).exists()]
    k = 1
    while any((d / f"{n}.old{k if k > 1 else ''}").exists() for n in present):
        k += 1
    suffix = f".old{k if k > 1 else ''}"
    q = ckpt_io.shell_quote
    targets = " ".join(q(n + suffix) for n in present)
    guard = (f"for f in {targets}; do [ ! -e \"$f\" ] || {{ echo \"$f exists (set aside "
             "before?): nothing moved\" >&2; exit 1; }; done")
    moves = " && ".join(f"mv {q(n)} {q(n + suffix)}" for n in present)
    return f"(cd {ckpt_io.shell_quote(d)} && {guard} && {moves})"


def start_fresh(run_dir: Path, config_yaml: str) -> None:
    """A fresh run's files (the main process): ``config.yaml`` (the resolved config as YAML
    text) and an empty ``metrics.jsonl``, each written atomically."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_io.write_atomic(run_dir / "config.yaml", config_yaml)
    ckpt_io.write_atomic(run_dir / "metrics.jsonl", "")


def write_problem(folder: Path) -> str | None:
    """Why no file can be created in ``folder`` (a :class:`pathlib.Path`): "is not a folder",
    "is not writable: <reason>"; or None when a probe file could be (an unnamed temporary file where the system allows it,
    removed at once: nothing shows in the folder). A probe, not ``os.access``, which says yes to
    root even on ``/proc`` or ``/sys``. Raises nothing."""
    import tempfile

    if not folder.is_dir():
        return "is not a folder"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return f"is not writable: {e.strerror or type(e).__name__}"
    return None
