"""A requeued command finds its run (docs/training.md, "Resuming").

The default run dir is timestamped (``runs/<date>/<time>``), so the same command started again,
by a scheduler that requeues a preempted job or by hand after Ctrl-C, would begin a new run at
step 1. With ``trainer.resume=auto`` (the default) and a timestamped ``hydra.run.dir`` (one whose
last parts are ``${now:...}``), :class:`RequeueCallback` first looks among the folders that
pattern makes (``runs/*/*``) for an *unfinished run of this config*:

- its ``.hydra/config.yaml`` (the composed config, as twell-train records it) equals this
  command's up to the keys a resume may change (``train.rundir.RESUME_SAFE_KEYS``: how a run
  executes, logs, validates, evaluates and saves), so ``trainer.resume=auto`` continues it;
- it holds a checkpoint and no ``summary.json`` (a finished run is not started again);
- no other process holds its lock, and it is a real folder (not a link).

The most recently checkpointed one becomes the run dir, and one line says so; with none, the
new timestamped folder is used as before. ``-m`` sweeps likewise: the newest sweep dir under
the sweep pattern (``runs/multirun/*/*``) whose ``multirun.yaml`` holds this config and these
overrides and whose jobs have not all finished is used again, so every job resumes in its own
folder (finished jobs are not trained again). ``trainer.resume=never`` or a new
``hydra.run.dir`` / ``hydra.sweep.dir`` starts a new run. :func:`override_arg` writes the exact
``hydra.run.dir=...`` of the resume advice.
"""

from __future__ import annotations

import fcntl
import os
import re
import sys
from pathlib import Path

from omegaconf import OmegaConf, open_dict, read_write

from train.config import REMOVED_KEYS, upgrade_override, upgrade_saved
from train.rundir import LOCK_FILE, RESUME_SAFE_KEYS, _matches

TIMESTAMP = "${now:"
_PLAIN = re.compile(r"[\w./+-]+")  # a value neither the shell nor Hydra reads specially


def hydra_override(key: str, value) -> str:
    """``key=value`` as a Hydra override that Hydra reads back as the string ``value`` (in
    Hydra's quotes only when needed)."""
    v = str(value)
    if _PLAIN.fullmatch(v):
        return f"{key}={v}"
    return f"{key}='" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"


def override_arg(key: str, value) -> str:
    """``key=value`` as one command-line argument that the shell and Hydra both read back as
    ``value`` (quoted only when needed)."""
    from train.checkpoint import shell_quote  # $'...' when it holds a newline: one line

    arg = hydra_override(key, value)
    return arg if _PLAIN.fullmatch(str(value)) else shell_quote(arg)


def job_alone_command(job_dir, overrides: list[str], *extra: str) -> str:
    """``twell-train hydra.run.dir=<job_dir> <overrides> <extra>``: one job of a ``-m`` sweep
    run alone in its own folder, the way to train it on or rerun it with another value (a
    ``-m`` command with other values into the sweep's folder is refused as another sweep:
    :func:`other_sweep_in`). ``overrides`` are the job's (Hydra's override strings, as its
    ``.hydra/overrides.yaml`` records them), less ``hydra.*`` ones and the keys ``extra`` sets,
    each as the CLI takes it now (:func:`upgrade_job_override`: a moved FFN key at its new
    place, ``trainer.val_batches`` as the ``trainer.val_sequences`` it validated on) and a
    removed one left out (``train.config.REMOVED_KEYS``: the CLI refuses it); each of
    ``extra`` is one ready argument (``key=value``, quoted as needed)."""
    from train.checkpoint import shell_quote

    replaced = {override_key(e) for e in extra}
    kept = [shell_quote(o) for o in (upgrade_job_override(str(o), job_dir) for o in overrides)
            if not override_key(o).startswith("hydra.") and override_key(o) not in replaced
            and override_key(o) not in REMOVED_KEYS]
    return " ".join(["twell-train", override_arg("hydra.run.dir", job_dir), *kept, *extra])


def upgrade_job_override(override: str, job_dir) -> str:
    """A recorded override of the job in ``job_dir`` as the CLI takes it now: a moved FFN key at
    its new place (``train.config.upgrade_override``), and ``trainer.val_batches=N`` (N
    micro-batches per rank, from before the key was renamed) as ``trainer.val_sequences=`` the
    sequences those were (:func:`val_sequences_of`), so the job validates on the same held-out
    sequences as before; kept as recorded when the job's micro-batch is not known (the CLI
    then refuses it in one line naming the conversion)."""
    override = upgrade_override(override)
    key, eq, value = override.partition("=")
    if not eq or key.lstrip("+") != "trainer.val_batches":
        return override
    try:
        batches = int(value)
    except ValueError:  # an interpolation or a sweep: not a count to convert
        return override
    n = val_sequences_of(job_dir, batches)
    # no '+': the key exists in the schema now, and '+' would add it twice
    return override if n is None else f"trainer.val_sequences={n}"


def val_sequences_of(job_dir, val_batches: int) -> int | None:
    """The held-out sequences that ``trainer.val_batches=<val_batches>`` (micro-batches per
    rank) validated on in the run in ``job_dir``: ``val_batches x trainer.micro_batch x ranks``,
    the micro-batch from its ``.hydra/config.yaml`` (as composed), the ranks from its newest
    checkpoint's ``metadata.json`` (none: 1, the process a printed ``twell-train`` command
    runs). None when the micro-batch is not a number there (no file, a damaged one)."""
    from twell.hf import list_checkpoints, read_metadata

    trainer = (_load(Path(job_dir) / ".hydra" / "config.yaml") or {}).get("trainer")
    micro = trainer.get("micro_batch") if isinstance(trainer, dict) else None
    if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1:
        return None
    ranks = 1
    found = list_checkpoints(job_dir)
    if found:
        try:
            world = read_metadata(found[-1]).get("world_size")
        except (OSError, ValueError):  # a damaged newest checkpoint: its resume says so
            world = None
        if isinstance(world, int) and not isinstance(world, bool) and world >= 1:
            ranks = world
    return val_batches * micro * ranks


def timestamp_root(pattern: str) -> tuple[Path, int] | None:
    """For a run-dir pattern whose last ``depth`` parts are timestamps (``runs/${now:%Y-%m-%d}/
    ${now:%H-%M-%S}``): ``(Path("runs"), 2)``; None for any other pattern."""
    parts = Path(pattern).parts
    stamped = [i for i, p in enumerate(parts) if "${" in p]
    if not stamped or stamped != list(range(stamped[0], len(parts))):
        return None
    if not all(TIMESTAMP in parts[i] and parts[i].count("${") == parts[i].count(TIMESTAMP)
               for i in stamped):
        return None
    return Path(*parts[:stamped[0]]) if stamped[0] else Path("."), len(parts) - stamped[0]


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def recipe(config: dict) -> dict:
    """What makes two composed configs the same run: every key but ``hydra.*`` and the keys a
    resume may change (``RESUME_SAFE_KEYS``), flattened; a saved one read as one saved now
    (``upgrade_saved``: renamed keys at their new places, removed ones dropped), so a sweep's
    ``multirun.yaml`` from before a rename or removal is still its sweep."""
    return {k: v for k, v in _flat(upgrade_saved(config)).items()
            if not k.startswith("hydra.") and not _matches(k, RESUME_SAFE_KEYS)}


def _load(path: Path) -> dict | None:
    """A YAML file of a run folder as a plain dict (interpolations kept), None if unreadable.
    OmegaConf's loader builds plain data only: no code runs."""
    try:
        d = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # noqa: BLE001  (a damaged or foreign file: not this run's)
        return None
    return d if isinstance(d, dict) else None


def _checkpointed(run_dir: Path) -> float | None:
    """When ``run_dir`` last got a complete checkpoint (mtime), None if it holds none."""
    found = [p for p in (run_dir / "checkpoints").glob("step*/metadata.json") if p.is_file()]
    return max(p.stat().st_mtime for p in found) if found else None


def _free(run_dir: Path) -> bool:
    """Whether no process holds ``run_dir``'s lock (a folder without a lock file is free).
    Probed with a shared lock, released at once: the ranks of one launch, probing together,
    do not see each other as the holder (and all pick the same run)."""
    path = run_dir / LOCK_FILE
    if not path.is_file():
        return True
    try:
        with path.open("rb") as f:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
    except BlockingIOError:
        return False
    except OSError:  # unreadable: not a run to continue
        return False
    return True


def _folders(root: Path, depth: int) -> list[Path]:
    """The real folders (no links, at no level) ``depth`` levels under ``root``."""
    level = [root] if root.is_dir() and not root.is_symlink() else []
    for _ in range(depth):
        nxt = []
        for p in level:
            try:
                nxt += [c for c in sorted(p.iterdir()) if c.is_dir() and not c.is_symlink()]
            except OSError:  # unreadable: nothing of ours in it
                continue
        level = nxt
    return level


def find_unfinished_run(config: dict, root: Path, depth: int) -> Path | None:
    """The most recently checkpointed unfinished run of ``config`` (a composed config as a
    dict, ``hydra`` left out) among the folders ``depth`` levels under ``root``, whose lock is
    free; None if there is none (module docstring)."""
    mine = recipe(config)
    found = []
    for d in _folders(root, depth):
        try:
            when = _checkpointed(d)
            if when is None or (d / "summary.json").exists():
                continue
            saved = _load(d / ".hydra" / "config.yaml")
            if saved is not None and recipe(upgrade_saved(saved)) == mine and _free(d):
                found.append((when, str(d)))
        except OSError:  # an unreadable folder is no run to continue
            continue
    return Path(max(found)[1]) if found else None


def sweep_jobs(overrides: list[str]) -> int | None:
    """How many jobs Hydra's basic sweeper makes of a ``-m`` command's overrides (None when
    it cannot tell)."""
    jobs = sweep_job_overrides(overrides)
    return None if jobs is None else len(jobs)


def find_unfinished_sweep(config: dict, overrides: list[str], root: Path,
                          depth: int) -> Path | None:
    """The newest sweep dir (``depth`` levels under ``root``) of this config and these ``-m``
    overrides (its ``multirun.yaml``) with a job that has not finished (no ``summary.json``)
    and no job in use; None if there is none."""
    mine, n_jobs = recipe(config), sweep_jobs(overrides)
    found = []
    for d in _folders(root, depth):
        saved = _load(d / "multirun.yaml")
        if saved is None or recipe(saved) != mine:
            continue
        if saved.get("hydra", {}).get("overrides", {}).get("task") != list(overrides):
            continue
        try:
            jobs = [d / str(i) for i in range(n_jobs)] if n_jobs else \
                [j for j in d.iterdir() if j.name.isdigit() and j.is_dir()]
            if all((j / "summary.json").exists() for j in jobs):
                continue
            if all(not j.exists() or (j.is_dir() and not j.is_symlink() and _free(j))
                   for j in jobs):
                found.append((max(j.stat().st_mtime for j in [d, *[j for j in jobs
                                                                     if j.exists()]]), str(d)))
        except OSError:  # an unreadable folder is no sweep to continue
            continue
    return Path(max(found)[1]) if found else None


def _sweep_jobs_all(overrides: list[str]) -> list[list[str]] | None:
    """Every override of each job Hydra's basic sweeper makes of a ``-m`` command's overrides
    (None when it cannot tell)."""
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides(list(overrides))
        return [list(job) for job in BasicSweeper.split_arguments(parsed, None)[0]]
    except Exception:  # noqa: BLE001  (another sweep syntax: no check)
        return None


def override_key(o: str) -> str:
    """The key an override sets: a Hydra override as recorded (``+a.b=1``, ``++a.b=1``,
    ``~a.b`` -> ``a.b``) or one ready for the shell (``'a.b=/x y'``, ``"a.b=1"``,
    ``$'a.b=...'``, ``'+a.b=1'``: quotes stripped; no key holds a quote or ``$``)."""
    return re.sub(r"[$'\"]", "", o.split("=", 1)[0]).lstrip("+~")


def sweep_job_overrides(overrides: list[str]) -> list[list[str]] | None:
    """The overrides of each job Hydra's basic sweeper makes of a ``-m`` command's overrides,
    without ``hydra.*`` and the resume-safe keys (None when it cannot tell)."""
    jobs = _sweep_jobs_all(overrides)
    return None if jobs is None else _recipe_overrides(jobs)


def _recipe_overrides(jobs: list[list[str]]) -> list[list[str]]:
    """Each job's overrides without ``hydra.*`` and the resume-safe keys."""
    def kept(o: str) -> bool:
        return not override_key(o).startswith("hydra.") and not _matches(override_key(o), RESUME_SAFE_KEYS)

    return [[o for o in job if kept(o)] for job in jobs]


def train_on_commands(sweep_dir: Path, config: dict, overrides: list[str]) -> str | None:
    """When a ``-m`` command that :func:`other_sweep_in` refuses differs from the sweep in
    ``sweep_dir`` only in the optimizer or its schedule (``train.rundir.RESUME_OPTIM_KEYS``:
    ``trainer.max_steps=<more>`` to train its jobs longer) and each of its jobs' folders holds
    a checkpoint: the commands, joined by ``; `` (one shell line), that train each job on alone
    in its folder with these values (:func:`job_alone_command`); else None."""
    from train.rundir import RESUME_OPTIM_KEYS
    from twell.hf import list_checkpoints

    saved = _load(sweep_dir / "multirun.yaml")
    if saved is None:
        return None
    mine, theirs = recipe(config), recipe(saved)
    if any(not _matches(k, RESUME_OPTIM_KEYS) for k in set(mine) | set(theirs)
           if mine.get(k) != theirs.get(k)):
        return None
    old = sweep_job_overrides(saved.get("hydra", {}).get("overrides", {}).get("task") or [])
    # one split: the jobs checked against the sweep's are the jobs the commands name (two
    # splits of a shuffle() sweep come out in two orders)
    jobs = _sweep_jobs_all(overrides)
    new = None if jobs is None else _recipe_overrides(jobs)
    if old is None or new is None or jobs is None or len(new) > len(old):
        return None

    def recipe_of(job: list[str]) -> list[str]:
        return sorted(o for o in job if not _matches(override_key(o), RESUME_OPTIM_KEYS))

    if any(recipe_of(a) != recipe_of(b) for a, b in zip(old, new)):
        return None  # another job: another sweep
    dirs = [sweep_dir / str(i) for i in range(len(jobs))]
    if not all(list_checkpoints(d) for d in dirs):
        return None
    return "; ".join(job_alone_command(d, job, override_arg("trainer.resume", d),
                                       "trainer.resume_allow_changes=true")
                     for d, job in zip(dirs, jobs))


def other_sweep_in(sweep_dir: Path, config: dict, overrides: list[str]) -> str | None:
    """Why ``sweep_dir`` holds another sweep than this one (its ``multirun.yaml`` records
    another config, or a job number of it trains other values than this sweep's job of that
    number), or None (no record, the same sweep, or this one extends it with more jobs)."""
    saved = _load(sweep_dir / "multirun.yaml")
    if saved is None:
        return None
    mine, theirs = recipe(config), recipe(saved)
    if mine != theirs:
        keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        return "its config differs in " + ", ".join(keys[:4]) + (", ..." if len(keys) > 4 else "")
    old = sweep_job_overrides(saved.get("hydra", {}).get("overrides", {}).get("task") or [])
    new = sweep_job_overrides(overrides)
    if old is None or new is None:
        return None
    for i, (a, b) in enumerate(zip(old, new)):
        if sorted(a) != sorted(b):  # name what differs, not the overrides they share
            theirs, ours = [o for o in a if o not in b], [o for o in b if o not in a]
            return (f"its job {i} is {' '.join(theirs) or 'the defaults'}, this sweep's job {i} "
                    f"{' '.join(ours) or 'the defaults'}")
    return None


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _task_config(config) -> dict:
    d = OmegaConf.to_container(config, resolve=False)
    d.pop("hydra", None)
    return d


def _set(config, key: str, value: str) -> None:
    node = OmegaConf.select(config, key.rsplit(".", 1)[0])
    with read_write(node), open_dict(node):
        node[key.rsplit(".", 1)[1]] = value


try:
    from hydra.experimental.callback import Callback
except ImportError:  # Hydra is only needed by the CLI
    Callback = object


class RequeueCallback(Callback):
    """Hydra callback (``hydra.callbacks`` in configs/train.yaml, after the ``~`` expansion of
    ``train.rundir.HomeDirCallback``): before Hydra makes the timestamped run dir (``-m``: sweep
    dir), put this config's unfinished run (sweep) in its place (module docstring). A named sweep dir that holds another sweep (:func:`other_sweep_in`)
    stops the sweep before anything is written (one line, exit code 2)."""

    def on_run_start(self, config, **kwargs) -> None:
        """Hydra hook before a single run: with the timestamped default run dir and
        ``trainer.resume=auto``, point ``hydra.run.dir`` at the newest unfinished run of the
        same config (one line says which); else leave it."""
        pattern = OmegaConf.to_container(config.hydra.run, resolve=False)["dir"]
        where = timestamp_root(str(pattern))
        if where is None or str(config.trainer.resume) != "auto":
            return
        found = find_unfinished_run(_task_config(config), *where)
        found = found and found.resolve()
        if found is not None:
            _set(config, "hydra.run.dir", str(found))
            if _is_rank0():
                print(f"twell-train: this config's unfinished run is {found}: continuing it "
                      "(trainer.resume=never or another hydra.run.dir starts a new run)",
                      flush=True)

    def on_multirun_start(self, config, **kwargs) -> None:
        """Hydra hook before a sweep: a timestamped sweep dir continues the newest unfinished
        sweep of the same config and overrides; a named one holding another sweep stops the
        sweep (one line, exit code 2)."""
        pattern = OmegaConf.to_container(config.hydra.sweep, resolve=False)["dir"]
        where = timestamp_root(str(pattern))
        if where is None:  # a named sweep dir: refused up front if it holds another sweep
            d = Path(str(config.hydra.sweep.dir))
            why = other_sweep_in(d, _task_config(config), list(config.hydra.overrides.task))
            if why is not None:
                on = train_on_commands(d, _task_config(config), list(config.hydra.overrides.task))
                print(f"ConfigError: hydra.sweep.dir={d} holds another sweep ({why}); its jobs' "
                      "folders would be refused one by one and its multirun.yaml overwritten: "
                      "give this sweep its own hydra.sweep.dir" + (
                          "." if on is None else
                          "; or, to train that sweep's jobs on with these values, run each "
                          f"alone in its folder: {on}"), file=sys.stderr)
                sys.exit(2)
            return
        if str(config.trainer.resume) != "auto":
            return
        found = find_unfinished_sweep(_task_config(config), list(config.hydra.overrides.task),
                                      *where)
        found = found and found.resolve()
        if found is not None:
            _set(config, "hydra.sweep.dir", str(found))  # the sweep's own folder
            # each job's config is composed again from the command's hydra overrides
            hydra_overrides = config.hydra.overrides
            with read_write(hydra_overrides), open_dict(hydra_overrides):
                hydra_overrides.hydra.append(hydra_override("hydra.sweep.dir", found))
            if _is_rank0():
                print(f"twell-train: this sweep's unfinished run is {found}: continuing its "
                      "jobs (trainer.resume=never or another hydra.sweep.dir starts a new sweep)",
                      flush=True)
