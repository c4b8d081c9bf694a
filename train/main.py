"""``twell-train`` / ``python -m train``: compose the config, build the trainer, train.

    twell-train                                        # tiny model, offline corpus, CPU (< 5 min)
    twell-train model=tiny trainer.max_steps=20 sparsity.l1_coeff=2e-5 hydra.run.dir=DIR
    twell-train -m sparsity.l1_coeff=0,1e-5,2e-5       # sweep: one run directory per value
    accelerate launch -m train experiment=paper_0p5b   # the paper recipe on a GPU node

The run directory is Hydra's run dir (``hydra.run.dir``; default ``runs/<date>/<time>``, where
the same command started again continues its unfinished run: ``train.requeue``).
Before Hydra composes the config, :func:`train.config.check_overrides` refuses a key the schema does not
have (one line with the valid keys and the closest spelling, exit code 2) and a config group set
to null (``ffn=null``: one line with its options); Hydra's own errors
are one line with exit code 2 too. A failed run prints one line and writes it to
``<run dir>/error.txt`` (exit code 2) when the run dir is its own (a process refused in another
run's folder writes nothing there); one that fails before it trains removes the run dir and the
folders made for it (``train.rundir``), and so does one stopped by SIGINT / SIGTERM before its
first step (one line, exit code 130 / 143: ``train.interrupt.stops_before_training``). In a
``-m`` sweep a failed
job keeps its run dir with ``error.txt``, the other jobs run, and the sweep ends with the list of
failed jobs (exit code 2).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from train.config import (
    CONFIG_DIR,
    ConfigError,
    TrainConfig,
    check_overrides,
    config_error,
    hydra_error_line,
    register_configs,
    reject_unknown_keys,
)
from train.errors import ERROR_FACTS, ERROR_FILE  # a failed run's reason (twell-report reads it)
from train.interrupt import SetupInterrupted, signal_name, stops_before_training

register_configs()


def run(cfg: DictConfig, run_dir: str | None = None, started=None,
        job: list[str] | None = None) -> dict:
    """Train one run from a composed config; returns the summary dict. ``started(trainer)`` is
    called once the trainer is set up: the run dir is then this run's (locked, and new or
    holding this run), so the caller may write into it. A run dir whose run already finished
    with this config is left as it is: one line, and its ``summary.json`` is returned
    (:func:`train.rundir.finished_run`; ``job``: a ``-m`` sweep job's overrides, for its line).

    Raises:
        train.interrupt.SetupInterrupted: SIGINT / SIGTERM before the trainer was set up
            (nothing trained; a stop while it trains is exit code 130 / 143 with its line).
    """
    with stops_before_training():  # until the first step: one line (_main), nothing trained
        trainer, finished = _set_up(cfg, run_dir, job)
    if trainer is None:
        return finished
    with _deterministic_errors(trainer.cfg.trainer.deterministic):
        try:
            if started is not None:
                started(trainer)
            summary = trainer.train()
        except KeyboardInterrupt as e:  # SIGINT / SIGTERM: 130 / 143, the line says how to resume
            raise SystemExit(trainer.interrupted(e)) from None
        finally:
            trainer.close()
    if trainer.is_main and "paths" in summary and (trainer.run_dir / "summary.json").is_file():
        from train.trainer import summary_line

        # printed after close() (wandb's own output) so these lines come last
        trainer.report([f"checkpoint: {summary['paths']['checkpoint']}",
                        f"metrics:    {summary['paths']['metrics']}",
                        f"summary:    {trainer.run_dir / 'summary.json'}",
                        summary_line(summary)])
    return summary


def _set_up(cfg: DictConfig, run_dir: str | None, job: list[str] | None = None):
    """:func:`run`'s set-up: ``(trainer, None)``, or ``(None, summary)`` for the command of a
    run that already finished (its line printed)."""
    if os.environ.get("RANK", "0") == "0":  # a first line before the slow imports
        print("twell-train: loading the trainer (transformers, accelerate) ...", flush=True)
    from train.trainer import Trainer

    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = HydraConfig.get().runtime.output_dir
    reject_unknown_keys(cfg)
    try:
        tcfg: TrainConfig = OmegaConf.to_object(cfg)  # runs every __post_init__ check
    except ValueError as e:  # ConfigError and the data config's checks: one line, no traceback
        raise config_error(e) from None
    from train.parallel import check_launch

    check_launch(tcfg.trainer.cpu)  # a multi-process launch the accelerator would not join
    from train.rundir import finished_run

    finished = finished_run(run_dir, tcfg, job)  # the command of a finished run, run again
    if finished is not None:
        if os.environ.get("RANK", "0") == "0":
            print(finished[0], flush=True)
        return None, finished[1]
    with _deterministic_errors(tcfg.trainer.deterministic):
        return Trainer(tcfg, run_dir), None


@contextmanager
def _deterministic_errors(deterministic: bool):
    """trainer.deterministic=true: torch's error for an op without a deterministic version
    becomes one ConfigError line naming the op and the fix (train.determinism.error_line)."""
    try:
        yield
    except RuntimeError as e:
        from train.determinism import error_line

        line = error_line(e) if deterministic else None
        if line is None:
            raise
        raise ConfigError(line) from None


_CREATED: set[Path] = set()  # folders Hydra is about to create for this invocation (StartCallback)
_SWEEP: dict[str, list] = {"jobs": [], "failed": []}  # -m, Hydra's basic launcher: job overrides;
# failed jobs as (job index, reason line, error file)


def expected_errors() -> tuple[type[BaseException], ...]:
    """The errors a run reports in one line (exit code 2), without a traceback: bad config, bad
    data or a failed fetch, a damaged checkpoint, a diverged run."""
    from offline.fetch import FetchError
    from train.data import DataError
    from train.trainer import NonFiniteLossError
    from twell.hf import CheckpointError

    return ConfigError, NonFiniteLossError, DataError, FetchError, CheckpointError


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def _main(cfg: DictConfig) -> float | None:
    """One run (or one job of a ``-m`` sweep). A failure is one line on stderr (a traceback for
    an unexpected error) and in ``<run dir>/error.txt``; a single run then exits 2, a sweep job
    returns so the next job runs (:func:`cli` lists the failed jobs at the end).

    Nothing is written into the run dir (``.hydra/``, ``error.txt``, the log) until it is this
    run's: Hydra's own record is off (``hydra.output_subdir: null``) and written here once the
    trainer holds the dir's lock and found it new or holding this run, or, after a failure, when
    the dir was empty at the start (:func:`_after_failure`). A process refused by a live run's
    lock, or by another run's config or checkpoints, leaves that run's folder as it was."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
    run_dir = Path(hc.runtime.output_dir)
    if _is_rank0():
        if run_dir.is_dir() and not any(run_dir.iterdir()):  # made by Hydra now, or left empty
            _EMPTY_AT_START.add(run_dir.resolve())
        if sweep:
            _SWEEP["jobs"].append(list(hc.overrides.task))
    try:
        summary = run(cfg, str(run_dir),
                      started=lambda trainer: _record_start(trainer, run_dir, cfg, hc, sweep),
                      job=list(hc.overrides.task) if sweep else None)
    except SetupInterrupted as e:  # Ctrl-C / SIGTERM before the first step: a sweep stops too
        sys.exit(_stopped_before_training(e, run_dir))
    except Exception as e:  # reported below; only a sweep goes on
        expected = isinstance(e, expected_errors())
        line = f"{type(e).__name__}: {' '.join(str(e).split())}"
        if expected:
            print(line, file=sys.stderr)
        elif sweep:  # a bug: its traceback stays visible, the other jobs still run
            import traceback

            traceback.print_exc()
        written = _after_failure(run_dir, line, keep=sweep, cfg=cfg, facts=_facts(e, run_dir))
        if sweep:
            if _is_rank0():
                where = written or (f"nothing written into {run_dir}: it holds another run or "
                                    "is in use")
                _SWEEP["failed"].append((len(_SWEEP["jobs"]) - 1, line, where))
            return None
        if expected:
            sys.exit(2)
        _TASK_ERRORS.append(e)  # cli() leaves its traceback alone, even for an OmegaConf error
        raise
    return summary.get("val_loss")  # what a Hydra sweeper would minimise


def _facts(e: BaseException, run_dir: Path) -> dict | None:
    """A diverged run's facts for ``error.json`` (step, reason, last good checkpoint); None for
    any other failure."""
    from train.checkpointer import NonFiniteLossError

    return e.facts(run_dir) if isinstance(e, NonFiniteLossError) else None


def _is_rank0() -> bool:
    import os

    return int(os.environ.get("RANK", "0")) == 0


_EMPTY_AT_START: set[Path] = set()  # run dirs that were empty when their job started


def _record_start(trainer, run_dir: Path, cfg: DictConfig, hc, sweep: bool) -> None:
    """Once the run dir is this run's (rank 0): drop an earlier attempt's ``error.txt`` and
    ``error.json`` and write Hydra's record of this invocation. A sweep job's stop line names
    the sweep's folder (the same ``-m`` command with it runs every job on from where it
    stopped)."""
    if sweep:
        from train.requeue import override_arg

        trainer.checkpointer.rerun_arg = override_arg("hydra.sweep.dir",
                                                      Path(hc.sweep.dir).resolve())
    if _is_rank0():
        (run_dir / ERROR_FILE).unlink(missing_ok=True)  # a rerun in the same dir starts clean
        (run_dir / ERROR_FACTS).unlink(missing_ok=True)
        write_hydra_record(run_dir, cfg)


def write_hydra_record(run_dir: Path, cfg: DictConfig) -> None:
    """``run_dir/.hydra/``: ``config.yaml`` (the composed config, interpolations kept),
    ``hydra.yaml`` and ``overrides.yaml`` (the command line's overrides), as Hydra writes them
    with ``hydra.output_subdir=.hydra`` (configs/train.yaml turns that off so that nothing is
    written before the run dir is this run's); each file replaced atomically.

    Raises:
        train.checkpoint.CheckpointError: ``.hydra`` is a symbolic link or not a folder.
    """
    from hydra.core.hydra_config import HydraConfig

    from train.checkpoint import check_run_folder, write_atomic

    hydra_cfg = HydraConfig.instance().cfg
    out = run_dir / ".hydra"
    check_run_folder(out)  # a link would put the record wherever it points
    out.mkdir(exist_ok=True)
    write_atomic(out / "config.yaml", OmegaConf.to_yaml(cfg))
    write_atomic(out / "hydra.yaml", OmegaConf.to_yaml(hydra_cfg))
    write_atomic(out / "overrides.yaml", OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task))


def _after_failure(run_dir: Path, line: str, *, keep: bool = False,
                   cfg: DictConfig | None = None, facts: dict | None = None) -> str | None:
    """After a failed run (rank 0 only): a run that failed before it trained leaves no run dir
    behind (:func:`_remove_made_dirs`); a run dir that stays (``keep``: a sweep job's) gets the
    reason in ``error.txt`` and ``train.log`` and Hydra's record, and a diverged run's
    ``facts`` (step, reason, last good checkpoint) in ``error.json`` (an older one removed).

    Only a run dir that is this run's is touched (:func:`_own_lock`). A process refused by a
    live run's lock, by another run's config or checkpoints, or by a bad value aimed at another
    run's folder writes nothing there (its line on stderr is all). Returns the error file
    written, or None."""
    import time

    from train.checkpoint import open_run_file, write_atomic, write_json

    lock = _own_lock(run_dir)
    if lock is None:
        return None
    try:
        if not keep and _remove_made_dirs(run_dir):
            return None
        try:  # nothing is written through a symbolic link (a refused run touches nothing)
            if cfg is not None:
                write_hydra_record(run_dir, cfg)
            if facts is None:
                (run_dir / ERROR_FACTS).unlink(missing_ok=True)
            else:  # before the line: a reader that sees error.txt finds its facts
                write_json(run_dir / ERROR_FACTS, facts, indent=2)
            write_atomic(run_dir / ERROR_FILE, line + "\n")
            log = run_dir / "train.log"
            if log.is_file() and not log.is_symlink():
                with open_run_file(log) as f:
                    f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}\n")
        except (OSError, ValueError):  # a full or read-only disk, a link: the stderr line is all
            return None
        return str(run_dir / ERROR_FILE)
    finally:
        lock.release()


def _stopped_before_training(e: SetupInterrupted, run_dir: Path) -> int:
    """The exit code (130 for SIGINT, 143 for SIGTERM) of a run stopped before its first step,
    after one line on stderr (rank 0) and the removal of the run dir when it was made for this
    run and holds nothing else (:func:`_remove_made_dirs`, as after a failed start)."""
    lock = _own_lock(run_dir)
    removed = False
    if lock is not None:
        try:
            removed = _remove_made_dirs(run_dir)
        finally:
            lock.release()
    if _is_rank0():
        what = (f"nothing was trained and the run dir {run_dir} was removed" if removed else
                f"no step was trained, {run_dir} is kept")
        print(f"{signal_name(e.signum)}: interrupted before the first step ({e.phase}); {what}; "
              f"rerun the same command to continue (exit code {e.exit_code})", file=sys.stderr)
    return e.exit_code


def _own_lock(run_dir: Path):
    """The lock of ``run_dir`` when a failed or stopped start may touch it (rank 0 only): a run
    dir the trainer claimed (``train.rundir.claim``) or that was empty when the job started, that
    no other process holds; else None."""
    from train import rundir

    if not _is_rank0() or not run_dir.is_dir():
        return None
    if not (rundir.claimed(run_dir) or run_dir.resolve() in _EMPTY_AT_START):
        return None
    return rundir.try_lock(run_dir)  # None: another process came in meanwhile, its folder now


def _remove_made_dirs(run_dir: Path) -> bool:
    """Remove the run dir of a start that trained nothing, if this invocation made it and it
    holds nothing but Hydra's files, the lock and the log (``train.rundir.remove_failed_run_dir``),
    and the empty folders made for it (``runs/<date>/``); returns whether it was removed."""
    from train import rundir

    if not rundir.remove_failed_run_dir(run_dir):
        return False
    parent = run_dir.resolve().parent
    while parent in _CREATED and parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent
    return True


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover (hydra is imported above)
    Callback = object


class StartCallback(Callback):
    """Hydra callback (``hydra.callbacks`` in configs/train.yaml), before Hydra creates the run
    dir (``-m``: the sweep dir): a folder that cannot be written is one ConfigError line (exit
    2) instead of Hydra's traceback, and every folder about to be created (``runs/<date>/``
    too) is noted, so that a failed start removes what it made and nothing else."""

    def on_run_start(self, config, **kwargs) -> None:
        check_writable(str(config.hydra.run.dir), "hydra.run.dir")

    def on_multirun_start(self, config, **kwargs) -> None:
        check_writable(str(config.hydra.sweep.dir), "hydra.sweep.dir")


def check_writable(run_dir: str, key: str) -> None:
    """Exit 2 with one line when ``run_dir`` (or, if it does not exist yet, its nearest existing
    parent) cannot be written; note the missing folders in between (:data:`_CREATED`).

    The folder is probed by creating a file in it (:func:`train.rundir.write_problem`), not by
    ``os.access``, which says yes to root even on ``/proc`` or ``/sys``."""
    d = Path(run_dir).resolve()
    p = d
    while not p.exists():
        _CREATED.add(p)
        p = p.parent
    from train.rundir import write_problem

    problem = write_problem(p)
    if problem is not None:
        where = "it" if p == d else f"its parent {p}"
        print(f"ConfigError: the run dir {d} cannot be written ({where} {problem}); set {key} "
              "to a writable folder.", file=sys.stderr)
        sys.exit(2)


def cli() -> None:
    """Console entry point ``twell-train`` (Hydra parses sys.argv). A ``-m`` sweep in which a job
    failed ends with the list of failed jobs and exit code 2 (with Hydra's basic launcher, the
    default, which runs the jobs in this process; under another launcher the reasons are in the
    jobs' ``error.txt`` only). Hydra's own errors (a value of the wrong type, an unknown group
    option, an override it cannot parse) are one ``ConfigError`` line with exit code 2 like
    twell's (:func:`hydra_error_line`; ``HYDRA_FULL_ERROR=1`` keeps Hydra's traceback)."""
    try:
        check_overrides(sys.argv[1:])
    except ConfigError as e:
        print(f"ConfigError: {e}", file=sys.stderr)
        sys.exit(2)
    from train.parallel import end_process_group

    full = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its errors to us instead of printing them
    try:
        _main()
    except SystemExit as e:
        if e.code in (0, None, 130, 143):  # finished, or stopped at a step by SIGINT / SIGTERM
            # the exception's frames (and its KeyboardInterrupt's) hold the stopped trainer:
            # dropped, so that end_process_group frees it before the group (SystemExit prints
            # no traceback)
            e.__traceback__ = e.__context__ = None
            end_process_group()
        raise
    except Exception as e:
        if full == "1" or any(e is t for t in _TASK_ERRORS) or not _is_hydra_error(e):
            raise  # a bug in the run keeps its traceback
        print(f"ConfigError: {hydra_error_line(e)}", file=sys.stderr)
        sys.exit(2)
    else:
        end_process_group()
    finally:
        if full is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = full
    if _SWEEP["failed"]:
        print(sweep_failures(_SWEEP["jobs"], _SWEEP["failed"]), file=sys.stderr)
        sys.exit(2)


_TASK_ERRORS: list[BaseException] = []  # unexpected errors of runs, re-raised by _main


def _is_hydra_error(e: BaseException) -> bool:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return isinstance(e, HydraException | OmegaConfBaseException)


def sweep_failures(jobs: list[list[str]], failed: list[tuple[int, str, str]]) -> str:
    """The closing lines of a sweep with failed jobs: each by its number and the overrides that
    differ between the sweep's jobs (all of them when only one job ran), its reason and the
    file holding it (or why nothing was written)."""
    varying = [o for o in dict.fromkeys(o for job in jobs for o in job)
               if not all(o in job for job in jobs)] if len(jobs) > 1 else None
    lines = [f"sweep: {len(failed)} of {len(jobs)} jobs failed:"]
    for i, line, where in failed:
        label = " ".join(o for o in jobs[i] if varying is None or o in varying)
        lines.append(f"  #{i} {label}: {line} ({where})")
    return "\n".join(lines)


if __name__ == "__main__":
    cli()
