"""Run training jobs as subprocesses: the one runner behind the study and comparison scripts.

    from studies.jobs import Job, run_jobs, train_command
    run_dir = Path("runs/study/l1_1e-3")
    job = Job("l1_1e-3", train_command(["sparsity.l1_coeff=1e-3"], run_dir), run_dir=run_dir)
    run_jobs([job], parallel=2, deadline=time.monotonic() + 540)
    job.status                     # "done" | "failed (exit N)" | "stopped" | "not started"

Each job runs in its own process group and writes stdout and stderr to its log file (default
``<run_dir>.log``). At the deadline every running job gets SIGTERM: the trainer finishes its
optimizer step, writes a checkpoint and exits; SIGKILL follows after ``grace_s``. A job whose run
directory holds a checkpoint continues from it when started again (``trainer.resume=auto``), so a
study runs in pieces of any length: call the script again and the stopped rows go on, the done
ones are skipped by the caller (:func:`run_finished`).

Before a study starts its jobs, :func:`check_train_overrides` composes each row's training config
with the command line's overrides, so a bad override is one line at the start (a dry run too),
not a failed job per row on the device.

Jobs start in list order, at most ``parallel`` at a time (several small runs can share one GPU).
While they run, a line per ``progress_every`` seconds shows each job's last logged step, CE, L0
and tokens/s (read from its ``metrics.jsonl``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# the repository root (the folder holding the train package): children run `python -m train`
# from there, so a checkout that is not pip-installed (a bare GPU machine) runs too
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Job:
    """One subprocess: a training run, an evaluation, or any command.

    Attributes:
        name: label in logs and results.
        cmd: the argv (e.g. from :func:`train_command`).
        run_dir: the training run's directory (progress is read from its ``metrics.jsonl``);
            None for other commands.
        log_path: where stdout and stderr go; default ``<run_dir>.log``, required without
            ``run_dir``.
        env: extra environment variables for this job (a None value removes the variable).
        status: ``pending``, ``running``, ``done``, ``failed (exit N)``, ``stopped`` (by the
            deadline) or ``not started`` (the deadline came first).
        rc: exit code (None until it ends). wall_s: seconds it ran.
    """

    name: str
    cmd: list[str]
    run_dir: Path | None = None
    log_path: Path | None = None
    env: dict[str, str | None] = field(default_factory=dict)
    status: str = "pending"
    rc: int | None = None
    wall_s: float | None = None
    popen: subprocess.Popen | None = field(default=None, repr=False)
    t0: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if self.log_path is None:
            if self.run_dir is None:
                raise ValueError(f"job {self.name!r}: give log_path or run_dir")
            self.log_path = Path(f"{self.run_dir}.log")

    @property
    def ok(self) -> bool:
        """The job ran to its end with exit code 0."""
        return self.status == "done"


def train_command(overrides: list[str], run_dir: Path, *, python: str | None = None) -> list[str]:
    """``python -m train <overrides> hydra.run.dir=<run_dir>``: a training run in ``run_dir``.

    Raises:
        ValueError: an override that is not ``key=value`` (or ``+key=value`` / ``~key``), or one
            that sets ``hydra.run.dir`` (this function sets it).
    """
    for o in overrides:
        if "=" not in o and not o.startswith("~"):
            raise ValueError(f"override {o!r} is not key=value")
        if o.split("=", 1)[0].lstrip("+~") == "hydra.run.dir":
            raise ValueError(f"override {o!r}: hydra.run.dir is the job's run_dir; remove it")
    return [python or sys.executable, "-m", "train", *overrides, f"hydra.run.dir={run_dir}"]


def check_train_overrides(rows: dict[str, list[str]], extra: list[str] = ()) -> None:
    """Compose each row's training config (``rows``: name -> the row's own overrides, then
    ``extra``, the overrides every row gets from the command line) as ``python -m train``
    composes it (:func:`train.config.composer`), so that an override the trainer would refuse
    stops a study at its start, a dry run included, instead of every row on the device.

    ``extra`` is checked alone first (parse and key: a typo is named whichever row comes
    first); then every distinct row's config, where a value one row's config refuses (a shape,
    a schedule) is blamed on the override whose removal lets the row compose.

    Raises:
        ValueError: one line naming the override of ``extra`` that is refused and why (the
            config's or Hydra's reason, which names the key and the fix); or the row whose own
            overrides do not compose (a study flag's value); or, when no single override is
            to blame, all of ``extra`` with the row's reason.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from train.config import ConfigError, check_overrides, composer, hydra_error_line

    extra = list(extra)
    for o in extra:
        try:
            OverridesParser.create().parse_overrides([o])
            check_overrides([o])
        except OverrideParseException as e:
            raise ValueError(_refused(o, hydra_error_line(e), "the training config")) from None
        except ConfigError as e:
            raise ValueError(_refused(o, str(e), "the training config")) from None
    seen = set()
    with composer() as compose_one:
        for name, own in rows.items():
            if tuple(own) in seen:  # the same config: composed once
                continue
            seen.add(tuple(own))
            why = _compose_error(compose_one, [*own, *extra])
            if why is not None:
                raise ValueError(_blame(compose_one, name, list(own), extra, why))


def _compose_error(compose_one, overrides: list[str]) -> str | None:
    """Why ``overrides`` do not compose (the one-line :class:`train.config.ConfigError`), or
    None when they do."""
    from train.config import ConfigError

    try:
        compose_one(overrides)
    except ConfigError as e:
        return str(e)
    return None


def _refused(override: str, why: str, where: str) -> str:
    """One line: ``override`` is refused by ``where``, because ``why`` (as it is when ``why``
    names the override itself: Hydra's parse errors)."""
    return why if repr(override) in why else f"override {override!r} is refused by {where}: {why}"


def _blame(compose_one, name: str, own: list[str], extra: list[str], why: str) -> str:
    """The line of row ``name`` whose config (``own`` + ``extra``) failed with ``why``: its own
    overrides alone, or the one override of ``extra`` without which it composes, or all of
    ``extra`` (the overrides refused only together)."""
    alone = _compose_error(compose_one, own)
    if alone is not None:  # nothing of extra's doing: the study's own flags make the row
        return f"row {name}'s own overrides do not compose (a value of the study's flags?): {alone}"
    where = f"row {name}'s training config"
    culprits = [o for i, o in enumerate(extra)
                if _compose_error(compose_one, [*own, *extra[:i], *extra[i + 1:]]) is None]
    if len(culprits) == 1:
        return _refused(culprits[0], why, where)
    return f"the overrides {' '.join(extra)} are refused together by {where}: {why}"


def job_env(n_parallel: int, extra: dict[str, str | None] | None = None) -> dict[str, str]:
    """The environment of a child: this process's, with CPU threads split between the jobs
    that run at once, no tokenizer threads, expandable CUDA segments (several processes share
    one GPU without fragmenting it), no model hub, unbuffered output and the repository on
    PYTHONPATH; then ``extra`` (a None value removes the variable)."""
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // max(n_parallel, 1))),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTORCH_CUDA_ALLOC_CONF": env.get("PYTORCH_CUDA_ALLOC_CONF",
                                           "expandable_segments:True"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    })
    env.update(extra or {})
    return {k: v for k, v in env.items() if v is not None}


def last_train_record(run_dir: Path | None) -> dict | None:
    """The last ``"kind": "train"`` line of ``run_dir/metrics.jsonl`` (None if there is none
    yet; a line being written is skipped)."""
    if run_dir is None:
        return None
    path = Path(run_dir) / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for ln in reversed(lines):
        try:
            r = json.loads(ln)
        except ValueError:
            continue
        if r.get("kind") == "train":
            return r
    return None


def run_finished(run_dir: Path, max_steps: int | None = None) -> bool:
    """Did the training run in ``run_dir`` finish (``summary.json`` written at its last step;
    at ``max_steps`` when given)? A stopped or failed run has no summary."""
    try:
        s = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return max_steps is None or s.get("step") == max_steps


def _start(job: Job, env: dict[str, str], cwd: Path) -> None:
    job.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(job.log_path, "a") as fh:  # appended: a resumed job keeps its earlier pieces
        child_env = {k: v for k, v in {**env, **job.env}.items() if v is not None}
        job.popen = subprocess.Popen(job.cmd, cwd=cwd, env=child_env, stdout=fh,
                                     stderr=subprocess.STDOUT, start_new_session=True)
    job.t0 = time.monotonic()
    job.status = "running"


def stop(job: Job, grace_s: float = 60.0) -> None:
    """SIGTERM the job's process group (the trainer checkpoints at the end of its step and
    exits), SIGKILL if it is still there after ``grace_s`` seconds."""
    if job.popen is None or job.popen.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(job.popen.pid, sig)
            job.popen.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def _progress_line(running: list[Job], now: float) -> str:
    parts = []
    for j in running:
        r = last_train_record(j.run_dir)
        if r:
            parts.append(f"{j.name} step {r['step']} ce {r['ce']:.3f} l0 {r['l0_mean']:.1f} "
                         f"{r['tokens_per_s'] / 1e3:.1f}k tok/s")
        else:
            parts.append(f"{j.name} {now - j.t0:.0f}s")
    return "running: " + " | ".join(parts)


def run_jobs(jobs: list[Job], *, parallel: int = 1, deadline: float | None = None,
             on_done: Callable[[Job], None] | None = None, progress_every: float = 30.0,
             grace_s: float = 60.0, poll_s: float = 0.5, log: Callable[[str], None] = print,
             cwd: Path | None = None, env: dict[str, str | None] | None = None) -> list[Job]:
    """Run ``jobs`` (at most ``parallel`` at once, in list order) until all have ended or
    ``deadline`` (``time.monotonic()`` seconds) passes: then running jobs are stopped
    (:func:`stop`, status ``stopped``) and pending ones marked ``not started``. ``on_done(job)``
    is called as each job ends (stopped ones included). Returns ``jobs``.

    Raises:
        ValueError: ``parallel < 1``.
    """
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1; got {parallel}")
    base_env = job_env(min(parallel, max(len(jobs), 1)), env)
    cwd = ROOT if cwd is None else cwd
    pending = [j for j in jobs if j.status == "pending"]
    running: list[Job] = []
    last_print = time.monotonic()

    def finish(j: Job, status: str) -> None:
        j.rc, j.wall_s, j.status = j.popen.returncode, time.monotonic() - j.t0, status
        running.remove(j)
        log(f"{status}: {j.name} ({j.wall_s:.0f} s)")
        if on_done is not None:
            on_done(j)

    while pending or running:
        if deadline is not None and time.monotonic() > deadline:
            for j in list(running):  # noqa: PERF101 (finish() removes j from running)
                stop(j, grace_s)
                finish(j, "stopped")
            for j in pending:
                j.status = "not started"
            break
        while pending and len(running) < parallel:
            j = pending.pop(0)
            _start(j, base_env, cwd)
            running.append(j)
            log(f"started {j.name}: {' '.join(j.cmd)}")
        for j in list(running):  # noqa: PERF101 (finish() removes j from running)
            rc = j.popen.poll()
            if rc is not None:
                finish(j, "done" if rc == 0 else f"failed (exit {rc})")
        now = time.monotonic()
        if running and now - last_print >= progress_every:
            last_print = now
            log(_progress_line(running, now))
        if pending or running:
            time.sleep(poll_s)
    return jobs


__all__ = [
    "ROOT",
    "Job",
    "check_train_overrides",
    "job_env",
    "last_train_record",
    "run_finished",
    "run_jobs",
    "stop",
    "train_command",
]
