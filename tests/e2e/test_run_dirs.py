"""Whose run dir it is: a process refused in another run's folder (a live run's lock, another run's
config or checkpoints, a bad value) writes nothing there; the same command started again after
SIGTERM finds its timestamped run, and the stop line names it. Subprocesses of ``python -m train``
on the tiny test model (a few steps), and run folders made by hand."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train_utils import SMALL_CLI as SMALL
from tests.train_utils import write_tokens
from train.rundir import RunDirLock

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "tok.bin", n_tokens=4000)


def _guard(*targets: str) -> str:
    """The start of a set-aside command (train.rundir.set_aside_command): it stops, moving
    nothing, when a new name is taken (the command run twice)."""
    return (f"for f in {' '.join(targets)}; do [ ! -e \"$f\" ] || {{ echo \"$f exists (set "
            "aside before?): nothing moved\" >&2; exit 1; }; done && ")


def _train(tokens: Path, *args: str, cwd: Path = ROOT, env: dict | None = None):
    flags = [a for a in args if a.startswith("-")]  # -m before the overrides (argparse)
    over = [a for a in args if not a.startswith("-")]
    return subprocess.run([sys.executable, "-m", "train", *flags, "data=tokens",
                           f"data.paths=[{tokens}]", *SMALL, *over], cwd=cwd, env=env or ENV,
                          capture_output=True, text=True, timeout=300, check=False)


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> SHA-256 of its bytes)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _stderr_lines(r) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if ln.strip()]


# ------------------------------------------------------------------ 4: a refused process


def test_a_refused_process_writes_nothing_into_another_runs_folder(tokens, tmp_path):
    """Two sweeps into one folder: the second sweep's jobs are refused (each job dir holds the
    first sweep's run, another L1) and leave its record, overrides and files as they were (a
    report then labels every run with its own L1); a process refused by a live run's lock, or
    by a bad value aimed at that folder, writes nothing there either."""
    sweep = tmp_path / "sweep"
    r = _train(tokens, "-m", f"hydra.sweep.dir={sweep}", "sparsity.l1_coeff=0.5,0.25")
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = [sweep / "0", sweep / "1"]
    for job, l1 in zip(jobs, ("0.5", "0.25")):
        assert (job / "summary.json").is_file() and (job / "checkpoints" / "step1").is_dir()
        # the record names this job's own override
        assert (job / ".hydra" / "overrides.yaml").read_text().split()[-1] == \
            f"sparsity.l1_coeff={l1}"
    before = _snapshot(sweep)
    r = _train(tokens, "-m", f"hydra.sweep.dir={sweep}", "sparsity.l1_coeff=0.1,0.2")
    assert r.returncode == 2, r.stderr[-3000:]
    assert _stderr_lines(r) == [
        (f"ConfigError: hydra.sweep.dir={sweep} holds another sweep (its job 0 is "
        "sparsity.l1_coeff=0.5, this sweep's job 0 sparsity.l1_coeff=0.1); its jobs' folders "
        "would be refused one by one and its multirun.yaml overwritten: give this sweep its own "
        "hydra.sweep.dir.")]
    assert _snapshot(sweep) == before  # multirun.yaml included

    (sweep / "multirun.yaml").unlink()  # no record of the sweep: each job is refused on its own
    before = {job: _snapshot(job) for job in jobs}
    r = _train(tokens, "-m", f"hydra.sweep.dir={sweep}", "sparsity.l1_coeff=0.1,0.2")
    assert r.returncode == 2, r.stderr[-3000:]
    tail = r.stderr[r.stderr.index("sweep: 2 of 2 jobs failed:"):].splitlines()
    assert tail[1].startswith("  #0 sparsity.l1_coeff=0.1: ConfigError: ")
    assert "holds a run with another config" in tail[1]
    assert tail[1].endswith(f"(nothing written into {jobs[0]}: it holds another run or is in "
                            "use)")
    assert {job: _snapshot(job) for job in jobs} == before

    lock = RunDirLock(jobs[0])  # a live run in job 0: the same command is refused by its lock
    try:
        before = _snapshot(jobs[0])
        r = _train(tokens, f"hydra.run.dir={jobs[0]}", "sparsity.l1_coeff=0.5")
        assert r.returncode == 2, r.stderr[-3000:]
        err = _stderr_lines(r)
        assert err[-1].startswith(f"ConfigError: run dir {jobs[0]} is in use by another "
                                  f"twell-train process (PID {os.getpid()}")
        assert _snapshot(jobs[0]) == before
    finally:
        lock.release()
    before = _snapshot(jobs[1])
    r = _train(tokens, f"hydra.run.dir={jobs[1]}", "optim.lr=-1")  # a bad value, no trainer
    assert r.returncode == 2 and _stderr_lines(r)[-1].startswith("ConfigError: optim.lr must be")
    assert _snapshot(jobs[1]) == before


# ------------------------------------------------------------------ 6: a requeued command


def _find_run_dir(runs: Path) -> Path | None:
    found = [m.parent for m in runs.glob("*/*/metrics.jsonl")]
    return found[0] if len(found) == 1 else None


def test_a_requeued_command_continues_its_run_and_the_advice_names_it(tokens, tmp_path):
    """The default, timestamped run dir: SIGTERM's line names the exact hydra.run.dir, and the
    same command started again (as a scheduler requeues it) continues that run to its end
    instead of starting a new one at step 1. 40 steps: with 6 the tiny run could finish between
    the poll that saw its second step and the signal (CI, 2026-12-03)."""
    work = tmp_path / "work"
    work.mkdir()
    steps = 40
    cmd = [sys.executable, "-m", "train", "data=tokens", f"data.paths=[{tokens}]", *SMALL,
           f"trainer.max_steps={steps}", "trainer.log_every=1"]
    p = subprocess.Popen(cmd, cwd=work, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 240 and p.poll() is None:
        run = _find_run_dir(work / "runs")
        if run is not None and (run / "metrics.jsonl").read_text().count('"kind": "train"') >= 2:
            p.send_signal(signal.SIGTERM)
            break
        time.sleep(0.02)
    out, err = p.communicate(timeout=240)
    assert p.returncode == 143, err[-3000:]
    run = _find_run_dir(work / "runs")
    line = next(ln for ln in out.splitlines() if ln.startswith("received SIGTERM at step "))
    step = int(line.split(" at step ")[1].split(":")[0])
    assert step < steps and (f"re-run the same command with hydra.run.dir={run} to resume from "
                         f"{run / 'checkpoints' / f'step{step}'}") in line

    r = subprocess.run(cmd, cwd=work, env=ENV, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"this config's unfinished run is {run}: continuing it" in r.stdout
    assert f"resumed from {run / 'checkpoints' / f'step{step}'} at step {step}" in r.stdout
    assert sorted((work / "runs").glob("*/*")) == [run]  # no new run dir
    assert json.loads((run / "summary.json").read_text())["step"] == steps
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(x)["kind"] == "train"] == list(range(1, steps + 1))


def _fake_run(d: Path, config: dict, *, step: int | None = 2, finished: bool = False) -> Path:
    """A run folder as twell-train leaves it: its config record, a checkpoint, a summary."""
    from omegaconf import OmegaConf

    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(config))
    if step is not None:
        (d / "checkpoints" / f"step{step}").mkdir(parents=True)
        (d / "checkpoints" / f"step{step}" / "metadata.json").write_text("{}")
    if finished:
        (d / "summary.json").write_text("{}")
    return d


def test_the_unfinished_run_of_this_config_is_found_and_nothing_else(tmp_path):
    from train.requeue import find_unfinished_run, timestamp_root

    assert timestamp_root("runs/${now:%Y-%m-%d}/${now:%H-%M-%S}") == (Path("runs"), 2)
    assert timestamp_root("/x/out-${now:%s}") == (Path("/x"), 1)
    assert timestamp_root("runs/fixed") is None
    assert timestamp_root("runs/${now:%Y}/${oc.env:USER}") is None  # not only timestamps
    mine = {"model": {"hidden_size": 32}, "ffn": {"impl": "torch"}, "sparsity": {"l1_coeff": 0.5},
            "eval": {"limit": 200}, "trainer": {"resume": "auto", "max_steps": 6}}
    other = {**mine, "sparsity": {"l1_coeff": 0.25}}
    safe = {**mine, "eval": {"limit": 7}, "ffn": {"impl": "twell"}}
    root = tmp_path / "runs"
    assert find_unfinished_run(mine, root, 2) is None  # no runs folder yet
    _fake_run(root / "d1" / "10-00-00", mine, finished=True)  # finished: not again
    _fake_run(root / "d1" / "10-00-01", other)  # another L1
    _fake_run(root / "d1" / "10-00-02", mine, step=None)  # nothing to resume
    (root / "d1" / "10-00-03").symlink_to(_fake_run(tmp_path / "elsewhere", mine))  # a link
    assert find_unfinished_run(mine, root, 2) is None
    want = _fake_run(root / "d2" / "11-00-00", safe)  # differs only in resume-safe keys
    assert find_unfinished_run(mine, root, 2) == want
    newer = _fake_run(root / "d2" / "12-00-00", mine)
    os.utime(want / "checkpoints" / "step2" / "metadata.json", (1e9, 1e9))  # checkpointed long ago
    assert find_unfinished_run(mine, root, 2) == newer
    lock = RunDirLock(newer)  # in use by a live process: the older one
    try:
        assert find_unfinished_run(mine, root, 2) == want
    finally:
        lock.release()
    # recorded before the ffn group (model.ffn_impl): the same run (train.config.upgrade_saved)
    old = {k: v for k, v in safe.items() if k != "ffn"}
    old["model"] = {"hidden_size": 32, "ffn_impl": "twell"}
    assert find_unfinished_run(mine, tmp_path / "old", 2) is None
    saved_old = _fake_run(tmp_path / "old" / "d" / "09-00-00", old)
    assert find_unfinished_run(mine, tmp_path / "old", 2) == saved_old


def test_a_sweep_that_extends_a_sweep_dir_is_let_in_and_another_is_not(tmp_path):
    from omegaconf import OmegaConf

    from train.requeue import other_sweep_in

    mine = {"sparsity": {"l1_coeff": 0.5}, "trainer": {"max_steps": 6}}
    d = tmp_path / "sweep"
    d.mkdir()
    assert other_sweep_in(d, mine, ["sparsity.l1_coeff=0.5,0.25"]) is None  # no record
    (d / "multirun.yaml").write_text(OmegaConf.to_yaml(
        {**mine, "hydra": {"overrides": {"task": ["sparsity.l1_coeff=0.5,0.25"]}}}))
    for same in (["sparsity.l1_coeff=0.5,0.25"], ["sparsity.l1_coeff=0.5,0.25,0.1"],
                 ["sparsity.l1_coeff=0.5,0.25", "trainer.progress=false"]):  # again, more, safe
        assert other_sweep_in(d, mine, same) is None, same
    assert other_sweep_in(d, mine, ["sparsity.l1_coeff=0.25,0.5"]) == (
        "its job 0 is sparsity.l1_coeff=0.5, this sweep's job 0 sparsity.l1_coeff=0.25")
    assert other_sweep_in(d, {**mine, "trainer": {"max_steps": 9}},
                          ["sparsity.l1_coeff=0.5,0.25"]) == (
        "its config differs in trainer.max_steps")


def test_only_a_refused_sweep_of_more_steps_is_told_to_train_the_jobs_on(tmp_path):
    """The refusal names commands training the sweep's jobs on only when the -m command
    differs from it in the optimizer or its schedule alone and every job has a checkpoint; the
    guard itself refuses every such command still (other_sweep_in)."""
    from omegaconf import OmegaConf

    from train.requeue import other_sweep_in, train_on_commands

    mine = {"sparsity": {"l1_coeff": 0.5}, "trainer": {"max_steps": 6}}
    d = tmp_path / "sweep"
    d.mkdir()
    (d / "multirun.yaml").write_text(OmegaConf.to_yaml(
        {**mine, "hydra": {"overrides": {"task": ["sparsity.l1_coeff=0.5,0.25",
                                                  "trainer.max_steps=6"]}}}))
    more = {**mine, "trainer": {"max_steps": 9}}
    over = ["sparsity.l1_coeff=0.5,0.25", "trainer.max_steps=9"]
    assert other_sweep_in(d, more, over) == "its config differs in trainer.max_steps"
    for i in (0, 1):
        (d / str(i) / "checkpoints" / "step6").mkdir(parents=True)
    assert train_on_commands(d, more, over) is None  # no checkpoint yet
    for i in (0, 1):
        (d / str(i) / "checkpoints" / "step6" / "metadata.json").write_text("{}")
    assert train_on_commands(d, more, over) == "; ".join(
        f"twell-train hydra.run.dir={d / str(i)} sparsity.l1_coeff={l1} trainer.max_steps=9 "
        f"trainer.resume={d / str(i)} trainer.resume_allow_changes=true"
        for i, l1 in ((0, "0.5"), (1, "0.25")))
    assert train_on_commands(d, more, ["sparsity.l1_coeff=0.5,0.1", "trainer.max_steps=9"]) \
        is None  # another job 1
    assert train_on_commands(d, {**more, "sparsity": {"l1_coeff": 0.1}}, over) is None
    assert train_on_commands(d, more, ["sparsity.l1_coeff=0.5,0.25,0.1", "trainer.max_steps=9"]) \
        is None  # a third job, not in the sweep


def test_train_on_commands_name_the_jobs_they_checked(tmp_path, monkeypatch):
    """train_on_commands split the command's sweep twice: once for the jobs it checked against
    the saved sweep's, again for the jobs its commands name. Two splits of a shuffle() sweep
    come out in two orders, so a check that passed could name each folder with another
    folder's value. Hydra's shuffle is replaced by one whose third call reverses (as a random
    shuffle may): one split of each override list leaves it two calls, in one order."""
    import hydra.core.override_parser.types as hydra_types
    from omegaconf import OmegaConf

    from train.requeue import train_on_commands

    calls = []

    def shuffle(lst):
        calls.append(list(lst))
        if len(calls) >= 3:
            lst.reverse()

    monkeypatch.setattr(hydra_types, "shuffle", shuffle)
    mine = {"sparsity": {"l1_coeff": 0.5}, "trainer": {"max_steps": 6}}
    d = tmp_path / "sweep"
    for i in (0, 1):
        (d / str(i) / "checkpoints" / "step6").mkdir(parents=True)
        (d / str(i) / "checkpoints" / "step6" / "metadata.json").write_text("{}")
    (d / "multirun.yaml").write_text(OmegaConf.to_yaml(
        {**mine, "hydra": {"overrides": {"task": ["sparsity.l1_coeff=shuffle(0.5,0.25)",
                                                  "trainer.max_steps=6"]}}}))
    on = train_on_commands(d, {**mine, "trainer": {"max_steps": 9}},
                           ["sparsity.l1_coeff=shuffle(0.5,0.25)", "trainer.max_steps=9"])
    assert on == "; ".join(
        f"twell-train hydra.run.dir={d / str(i)} sparsity.l1_coeff={l1} trainer.max_steps=9 "
        f"trainer.resume={d / str(i)} trainer.resume_allow_changes=true"
        for i, l1 in ((0, "0.5"), (1, "0.25")))
    assert calls == [[0.5, 0.25], [0.5, 0.25]]  # the saved sweep's, the command's


def test_the_unfinished_sweep_of_this_command_is_found(tmp_path):
    from omegaconf import OmegaConf

    from train.requeue import find_unfinished_sweep

    mine = {"sparsity": {"l1_coeff": 0.5}, "trainer": {"max_steps": 6}}
    over = ["sparsity.l1_coeff=0.5,0.25", "trainer.max_steps=6"]
    root = tmp_path / "runs" / "multirun"

    def sweep(name: str, done: tuple[int, ...], overrides=over) -> Path:
        d = root / "day" / name
        d.mkdir(parents=True)
        (d / "multirun.yaml").write_text(OmegaConf.to_yaml(
            {**mine, "hydra": {"overrides": {"task": overrides}, "sweep": {"dir": str(d)}}}))
        for i in done:
            (d / str(i)).mkdir()
            (d / str(i) / "summary.json").write_text("{}")
        return d

    sweep("a", (0, 1))  # every job finished
    sweep("b", (0,), overrides=["sparsity.l1_coeff=0.5,0.1", "trainer.max_steps=6"])  # another
    assert find_unfinished_sweep(mine, over, root, 2) is None
    c = sweep("c", (0,))  # job 1 never ran
    assert find_unfinished_sweep(mine, over, root, 2) == c


def test_a_requeued_sweep_continues_in_its_own_sweep_dir(tokens, tmp_path):
    """``-m`` with the default, timestamped sweep dir, stopped by SIGTERM in its job 1: the stop
    line names the sweep's folder, and the same command started again resumes the jobs there
    (job 0, finished, is not trained again). 40 steps a job: with 6 the tiny job could finish
    between the poll that saw its second step and the signal (1 run in 6 failed)."""
    work = tmp_path / "work"
    work.mkdir()
    steps = 40
    cmd = [sys.executable, "-m", "train", "-m", "data=tokens", f"data.paths=[{tokens}]", *SMALL,
           f"trainer.max_steps={steps}", "trainer.log_every=1", "sparsity.l1_coeff=0.5,0.25"]
    p = subprocess.Popen(cmd, cwd=work, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 240 and p.poll() is None:
        job1 = list((work / "runs" / "multirun").glob("*/*/1/metrics.jsonl"))
        if job1 and job1[0].read_text().count('"kind": "train"') >= 2:
            p.send_signal(signal.SIGTERM)
            break
        time.sleep(0.02)
    out, err = p.communicate(timeout=240)
    assert p.returncode == 143, err[-3000:]
    (sweep,) = (work / "runs" / "multirun").glob("*/*")
    line = next(ln for ln in out.splitlines() if ln.startswith("received SIGTERM at step "))
    step = int(line.split(" at step ")[1].split(":")[0])
    assert step < steps and f"re-run the same command with hydra.sweep.dir={sweep} to resume" in line
    assert (sweep / "0" / "summary.json").is_file() and not (sweep / "1" / "summary.json").exists()

    r = subprocess.run(cmd, cwd=work, env=ENV, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"this sweep's unfinished run is {sweep}: continuing its jobs" in r.stdout
    assert list((work / "runs" / "multirun").glob("*/*")) == [sweep]
    # job 0 had finished: it says so and loads nothing
    assert f"run dir {sweep / '0'} already reached trainer.max_steps={steps} " in r.stdout
    assert f"resumed from {sweep / '1' / 'checkpoints' / f'step{step}'} at step {step}" in r.stdout
    assert f"training steps {step + 1}-{steps} of {steps}" in r.stdout  # job 1's rest only
    assert r.stdout.count("training steps") == 1
    assert json.loads((sweep / "1" / "summary.json").read_text())["step"] == steps


def _follow(line: str, cwd: Path = ROOT):
    """Run the shell command ``line`` as a user pastes it, ``twell-train`` being this checkout's
    ``python -m train``."""
    return subprocess.run(["bash", "-c", 'twell-train() { "$PY" -m train "$@"; }; ' + line],
                          cwd=cwd, env={**ENV, "PY": sys.executable}, capture_output=True,
                          text=True, timeout=300, check=False)


def _steps(job: Path) -> int:
    return json.loads((job / "summary.json").read_text())["step"]


def test_a_finished_sweeps_jobs_are_trained_on_by_the_commands_it_names(tokens, tmp_path):
    """A finished sweep run again: each job's line names the command that trains that job on
    alone in its folder (the same -m command with more steps is refused as another sweep); the
    refusal of that -m command names one line training every job on. Both, pasted, work."""
    sweep = tmp_path / "sweep"
    cmd = ["-m", f"hydra.sweep.dir={sweep}", "sparsity.l1_coeff=0.5,0.25"]
    assert _train(tokens, *cmd).returncode == 0
    r = _train(tokens, *cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if "already reached" in ln]
    job = ["data=tokens", f"'data.paths=[{tokens}]'",  # as Hydra records the job's overrides
           *(o.replace("=false", "=False").replace("=true", "=True") for o in SMALL)]
    assert lines == [
        (f"run dir {sweep / str(i)} already reached trainer.max_steps=1 (checkpoint step1, "
         "summary.json): nothing to train. To train this sweep job longer, run it alone in its "
         "folder (a -m sweep with more steps into the same hydra.sweep.dir is refused as another "
         "sweep; each job's line names its own command; twice its steps here; any larger "
         "trainer.max_steps works): twell-train "
         f"hydra.run.dir={sweep / str(i)} {' '.join(o for o in job if 'max_steps' not in o)} "
         f"sparsity.l1_coeff={l1} trainer.resume={sweep / str(i)} "
         "trainer.max_steps=2 trainer.resume_allow_changes=true")
        for i, l1 in ((0, "0.5"), (1, "0.25"))]
    r = _train(tokens, *cmd, "trainer.max_steps=2")
    assert r.returncode == 2, r.stderr[-3000:]
    (refusal,) = _stderr_lines(r)
    head, on = refusal.split("; or, to train that sweep's jobs on with these values, run each "
                             "alone in its folder: ")
    assert head.startswith(f"ConfigError: hydra.sweep.dir={sweep} holds another sweep (its "
                           "config differs in trainer.max_steps)")
    r = _follow(on)
    assert r.returncode == 0 and r.stdout.count("training steps 2-2 of 2") == 2, r.stderr[-3000:]
    assert [_steps(sweep / str(i)) for i in (0, 1)] == [2, 2]
    # the printed command as it is (max_steps 2, reached above) but for a larger value
    r = _follow(lines[1].split("max_steps works): ")[1].replace("max_steps=2", "max_steps=3"))
    assert r.returncode == 0 and "training steps 3-3 of 3" in r.stdout, r.stderr[-3000:]
    assert [_steps(sweep / str(i)) for i in (0, 1)] == [2, 3]


def test_a_failed_sweep_job_runs_again_by_the_command_the_report_names(tokens, tmp_path):
    """A sweep job that failed on a bad value: the same -m command with the value fixed is
    refused as another sweep; the report names the command that runs that job alone in its
    folder, and, with the value fixed in it, that command trains the job there."""
    from studies.report import IncompleteRunError, load_run

    sweep = tmp_path / "sweep"
    r = _train(tokens, "-m", f"hydra.sweep.dir={sweep}", "sparsity.l1_coeff=0.5,-1")
    assert r.returncode == 2 and (sweep / "1" / "error.txt").is_file(), r.stderr[-3000:]
    r = _train(tokens, "-m", f"hydra.sweep.dir={sweep}", "sparsity.l1_coeff=0.5,0.25")
    assert r.returncode == 2 and "holds another sweep" in r.stderr, r.stderr[-3000:]
    why = str(pytest.raises(IncompleteRunError, load_run, sweep / "1").value)
    alone = why.split("(--skip-incomplete): ", 1)[1]
    assert alone.startswith(f"twell-train hydra.run.dir={sweep / '1'} data=tokens ")
    assert alone.endswith(" sparsity.l1_coeff=-1")
    r = _follow(alone.replace("sparsity.l1_coeff=-1", "sparsity.l1_coeff=0.25"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert _steps(sweep / "1") == 1 and not (sweep / "1" / "error.txt").exists()
    assert load_run(sweep / "1").config["sparsity"]["l1_coeff"] == 0.25


def test_a_diverged_sweep_job_trains_on_by_the_command_the_report_names(tokens, tmp_path):
    """Two sweep jobs diverge at step 2 (their L1 coefficient, 0 at step 1, is 1e300 from
    step 2 on), one after saving step 1, one before any save: the sweep's -m command with
    another value is refused as another sweep; the report names for each the command that runs
    it alone in its folder with half the run's optim.lr (optim=tiny's 5e-4), and, pasted as
    printed (but for the L1, fixed), it starts the job again (its files set aside, and step 1, whose weights
    step 2 diverged on, too; the old ones kept) and trains it to the end."""
    from studies.report import IncompleteRunError, load_run

    sweep = tmp_path / "sweep"
    l1 = ["sparsity.schedule=linear_warmup", "sparsity.warmup_end=1", "sparsity.l1_coeff=1e300"]
    cmd = ["-m", f"hydra.sweep.dir={sweep}", "trainer.max_steps=3", *l1]
    r = _train(tokens, *cmd, "trainer.save_every=1,100")
    assert r.returncode == 2 and "sweep: 2 of 2 jobs failed:" in r.stderr, r.stderr[-3000:]
    for job in ("0", "1"):
        assert (sweep / job / "error.txt").read_text().startswith(
            "NonFiniteLossError: non-finite loss or gradient at step 2 ")
    assert [p.name for p in (sweep / "0" / "checkpoints").iterdir()] == ["step1"]
    assert not (sweep / "1" / "checkpoints").exists()
    r = _train(tokens, *cmd, "trainer.save_every=1,100", "optim.lr=1e-4")
    assert r.returncode == 2 and "holds another sweep" in r.stderr, r.stderr[-3000:]
    def aside(job: str, more: str = "", *taken: str) -> str:
        return (f"(cd {sweep / job} && " + _guard(
            "config.yaml.old", "metrics.jsonl.old", "error.txt.old", "error.json.old", *taken)
            + "mv config.yaml config.yaml.old && mv metrics.jsonl metrics.jsonl.old && mv "
            f"error.txt error.txt.old && mv error.json error.json.old{more}) && ")

    for job, head, tail in (
            ("0", aside("0", " && mv checkpoints/step1 checkpoints/step1.old",
                        "checkpoints/step1.old"),
             "trainer.save_every=1 optim.lr=0.00025"),
            ("1", aside("1"), "trainer.save_every=100 optim.lr=0.00025")):
        why = str(pytest.raises(IncompleteRunError, load_run, sweep / job).value)
        alone = why.split("lower optim.lr (any lr below the run's 0.0005 works; half of it here; "
                          "the -m command with another value is refused as another sweep): ",
                          1)[1]
        assert alone.startswith(f"{head}twell-train hydra.run.dir={sweep / job} data=tokens ")
        assert alone.endswith(f" sparsity.l1_coeff=1e+300 {tail}"), alone  # as Hydra records it
        r = _follow(alone.replace("l1_coeff=1e+300", "l1_coeff=0"))
        assert r.returncode == 0 and "training steps 1-3 of 3" in r.stdout, r.stderr[-3000:]
        assert _steps(sweep / job) == 3 and not (sweep / job / "error.txt").exists()
        cfg = load_run(sweep / job).config
        assert (cfg["optim"]["lr"], cfg["sparsity"]["l1_coeff"]) == (2.5e-4, 0)
        assert (sweep / job / "error.txt.old").read_text().startswith("NonFiniteLossError: ")
    assert (sweep / "0" / "checkpoints" / "step1.old" / "metadata.json").is_file()


def test_a_diverged_sweep_job_resumes_an_earlier_checkpoint_it_kept(tokens, tmp_path):
    """A sweep job diverges at step 7 (its L1 coefficient, 0 through step 6, is 1e300 from
    step 7 on) having kept steps 1-6: those fewer than 5 steps before the divergence are not
    resumed, so the report names step 2, and its command (half the run's optim.lr), pasted as
    printed (but for the L1, fixed), sets steps 3-6 aside (a resume of an older checkpoint than the
    folder's newest is refused) and resumes step 2 in the job's folder to the end."""
    from studies.report import IncompleteRunError, load_run
    from twell.hf import list_checkpoints

    sweep = tmp_path / "sweep"
    job = sweep / "0"
    r = _train(tokens, "-m", f"hydra.sweep.dir={sweep}", "trainer.max_steps=8",
               "trainer.save_every=1", "trainer.keep_last=10", "sparsity.schedule=linear_warmup",
               "sparsity.warmup_start=5", "sparsity.warmup_end=6", "sparsity.l1_coeff=1e300")
    assert r.returncode == 2 and "sweep: 1 of 1 jobs failed:" in r.stderr, r.stderr[-3000:]
    assert (job / "error.txt").read_text().startswith(
        "NonFiniteLossError: non-finite loss or gradient at step 7 ")
    assert [c.name for c in list_checkpoints(job)] == [f"step{i}" for i in range(1, 7)]
    step2, step6 = job / "checkpoints" / "step2", job / "checkpoints" / "step6"
    why = str(pytest.raises(IncompleteRunError, load_run, job).value)
    assert (f"diverges again, and so may resuming its last good checkpoint, {step6}, saved 1 "
            f"step before the divergence at step 7 (step 7's forward ran on step 6's weights, "
            "and the weights of the steps just before a divergence may already be ruined): "
            f"resume an earlier checkpoint, {step2}, with a lower optim.lr or start a new "
            "sweep") in why
    alone = why.split("lower optim.lr (any lr below the run's 0.0005 works; half of it here; "
                      "the -m command with another value is refused as another sweep): ", 1)[1]
    moves = " && ".join(f"mv checkpoints/step{i} checkpoints/step{i}.old" for i in range(3, 7))
    taken = _guard(*(f"checkpoints/step{i}.old" for i in range(3, 7)))
    assert alone.startswith(f"(cd {job} && {taken}{moves}) && twell-train "
                            f"hydra.run.dir={job} data=tokens ")
    assert alone.endswith(f" sparsity.l1_coeff=1e+300 trainer.resume={step2} "
                          "trainer.resume_allow_changes=true optim.lr=0.00025"), alone
    r = _follow(alone.replace("l1_coeff=1e+300", "l1_coeff=0"))
    assert r.returncode == 0 and f"resumed from {step2} at step 2" in r.stdout, r.stderr[-3000:]
    assert "training steps 3-8 of 8" in r.stdout
    assert _steps(job) == 8 and not (job / "error.txt").exists()
    cfg = load_run(job).config
    assert (cfg["optim"]["lr"], cfg["sparsity"]["l1_coeff"]) == (2.5e-4, 0)
    assert all((job / "checkpoints" / f"step{i}.old" / "metadata.json").is_file()
               for i in range(3, 7))
    # the same line again (from the shell's history): it stops before it moves anything, the
    # resumed line's step3 not moved into step3.old, nothing trained
    before = _snapshot(job)
    r = _follow(alone.replace("l1_coeff=1e+300", "l1_coeff=0"))
    assert r.returncode != 0 and "training steps" not in r.stdout
    assert r.stderr.strip() == "checkpoints/step3.old exists (set aside before?): nothing moved"
    assert _snapshot(job) == before and not (job / "checkpoints" / "step3.old" / "step3").exists()


def test_a_run_dir_without_a_checkpoint_is_reused_by_setting_its_files_aside(tokens, tmp_path):
    """A run that diverged before its first save holds another config and no checkpoint: a run
    with a lower lr is refused there, and the refusal's advice (it was "delete that
    directory", which deleted the log too), pasted into bash, renames only the files the new
    run would refuse, write over or drop; the new run then trains there, the old files and the
    old log lines kept."""
    run = tmp_path / "my run"
    r = _train(tokens, f"hydra.run.dir={run}", "trainer.max_steps=2", "optim.lr=1e30")
    assert r.returncode == 2 and "NonFiniteLossError" in r.stderr, r.stderr[-3000:]
    assert not (run / "checkpoints").exists()
    before = {n: (run / n).read_bytes() for n in ("config.yaml", "metrics.jsonl", "error.txt",
                                                  "error.json", "train.log")}
    r = _train(tokens, f"hydra.run.dir={run}", "trainer.max_steps=2", "optim.lr=5e-4")
    assert r.returncode == 2, r.stderr[-3000:]
    (line,) = _stderr_lines(r)
    head, advice = line.split(" and run again: ")
    assert head.startswith(f"ConfigError: {run} holds a different run's config (optim.lr: ")
    assert head.endswith("and no checkpoint to resume; use a new hydra.run.dir, or set that "
                         "run's files aside (its log stays)")
    assert advice == (f"(cd '{run}' && " + _guard(
        "config.yaml.old", "metrics.jsonl.old", "error.txt.old", "error.json.old")
        + "mv config.yaml config.yaml.old && mv metrics.jsonl metrics.jsonl.old && mv "
        "error.txt error.txt.old && mv error.json error.json.old)")
    assert {n: (run / n).read_bytes() for n in before} == before  # the refusal wrote nothing
    assert _follow(advice).returncode == 0
    r = _train(tokens, f"hydra.run.dir={run}", "trainer.max_steps=2", "optim.lr=5e-4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _steps(run) == 2 and (run / "checkpoints" / "step2").is_dir()
    for n in ("config.yaml", "metrics.jsonl", "error.txt", "error.json"):
        assert (run / f"{n}.old").read_bytes() == before[n], n
    assert not (run / "error.txt").exists()
    assert (run / "train.log").read_bytes().startswith(before["train.log"])


@pytest.mark.parametrize("value", ["/runs/2026-12-01/10-00-00", "/a b/c,d", "/it's/x=y",
                                   "/x/${now:%H}"])
def test_override_arg_reads_back_as_the_value(value):
    """The advice's ``hydra.run.dir=...`` survives the shell and Hydra's override parser."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from train.requeue import override_arg

    (arg,) = shlex.split(override_arg("hydra.run.dir", value))
    (o,) = OverridesParser.create().parse_overrides([arg])
    assert o.key_or_group == "hydra.run.dir" and o.value() == value


def test_a_refused_trainer_leaves_no_lock_file_behind(tokens, tmp_path):
    """A folder copied without its .lock, holding another run: the trainer refused there does
    not leave the lock file it made."""
    import shutil

    from tests.train_utils import tiny_config, train_run
    from train.config import ConfigError
    from train.trainer import Trainer

    train_run(tiny_config(tokens, **{"trainer.max_steps": 1}), tmp_path / "src")
    run = tmp_path / "run"
    shutil.copytree(tmp_path / "src", run, ignore=shutil.ignore_patterns(".lock"))
    before = _snapshot(run)
    with pytest.raises(ConfigError, match="holds a run with another config"):
        Trainer(tiny_config(tokens, **{"trainer.max_steps": 1, "sparsity.l1_coeff": 0.5}), run)
    assert _snapshot(run) == before and not (run / ".lock").exists()


def test_a_run_or_sweep_dir_under_tilde_is_made_in_the_home_folder(tokens, tmp_path):
    """``hydra.run.dir='~/x'`` (``hydra.sweep.dir`` of ``-m`` too) is the home folder's ``x``, as
    in a shell: Hydra made a folder named ``~`` in the working directory. A ``~user`` that is no
    home folder is one line (exit 2), nothing made."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    env = {**ENV, "HOME": str(home)}
    r = _train(tokens, "hydra.run.dir='~/x'", cwd=cwd, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (home / "x" / "checkpoints" / "step1").is_dir() and _steps(home / "x") == 1
    assert f"summary:    {home / 'x' / 'summary.json'}" in r.stdout
    assert list(cwd.iterdir()) == []
    # the same command again: the same run, finished (it is found in the home folder)
    r = _train(tokens, "hydra.run.dir='~/x'", cwd=cwd, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"run dir {home / 'x'} already reached trainer.max_steps=1" in r.stdout, r.stdout

    r = _train(tokens, "-m", "hydra.sweep.dir='~/s'", "sparsity.l1_coeff=0.5,0.25", cwd=cwd,
               env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    for job in ("0", "1"):
        assert _steps(home / "s" / job) == 1
    assert list(cwd.iterdir()) == []

    r = _train(tokens, "hydra.run.dir='~no_such_user_of_twell/x'", cwd=cwd, env=env)
    assert r.returncode == 2, r.stderr[-3000:]
    assert _stderr_lines(r) == [
        ("ConfigError: hydra.run.dir='~no_such_user_of_twell/x': ~no_such_user_of_twell is no "
         "home folder here (no such user); give an absolute path or one under ~/.")]
    assert list(cwd.iterdir()) == [] and sorted(p.name for p in home.iterdir()) == ["s", "x"]
