"""``twell-train`` as a user runs it: a misspelled key, a run that fails or is stopped before
training (its folders removed), a run dir that cannot be written, ``--help``, ``-m`` sweeps in
which jobs fail, the warm-up of a short run, and the command of a finished run run again.
Subprocesses; most stop before training."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from train.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
SMALL = ["model.vocab_size=64", "model.hidden_size=32", "model.intermediate_size=64",
         "model.num_heads=2", "model.seq_len=32", "trainer.global_batch=4",
         "trainer.micro_batch=4", "eval=disabled", "logging.wandb_mode=disabled",
         "trainer.progress=false", "trainer.max_steps=1", "optim.warmup_steps=1"]


def _train_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=ROOT, env=ENV,
                          check=False, capture_output=True, text=True, timeout=timeout)


def _stderr_lines(r) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if ln.strip()]


# ------------------------------------------------------------------ 5: a misspelled key


def test_misspelled_key_gets_our_hint_not_hydras(tmp_path):
    run_dir = tmp_path / "run"
    r = _train_cli("sparsity.l1_coef=1e-3", f"hydra.run.dir={run_dir}")
    assert r.returncode == 2, r.stderr
    err = _stderr_lines(r)
    assert len(err) == 1, err
    assert err[0].startswith("ConfigError: unknown key sparsity.l1_coef; valid keys of sparsity: ")
    assert err[0].endswith("did you mean sparsity.l1_coeff?")
    assert "reinit_lambda" in err[0] and "+sparsity" not in r.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("override, want", [
    ("sparsity.l1_coef=1e-3", "did you mean sparsity.l1_coeff?"),
    ("+sparsity.l1_coef=1e-3", "did you mean sparsity.l1_coeff?"),  # '+' does not dodge it
    ("trainer.max_step=3", "did you mean trainer.max_steps?"),
    ("optim.learning_rate=1", "valid keys of optim: betas, eps,"),
    ("trainr.max_steps=3", "unknown top-level key trainr; did you mean trainer?"),
    ("ffn_impl=torch", "unknown top-level key ffn_impl; did you mean ffn.impl?"),
    ("max_steps=3", "unknown top-level key max_steps; did you mean trainer.max_steps?"),
    ("zzz=3", "unknown top-level key zzz; remove it or fix its spelling."),
    ("model.hidden_size=64 trainer.val_batches=2", "renamed trainer.val_sequences"),
    ("=5", "'=5': an override needs a key: KEY=VALUE, e.g. trainer.max_steps=5."),
])
def test_override_check_names_the_key_and_the_closest_spelling(override, want):
    from train.main import check_overrides

    with pytest.raises(ConfigError) as err:
        check_overrides(override.split())
    assert want in str(err.value) and "\n" not in str(err.value)


def test_an_unknown_top_level_key_names_the_close_dotted_key(tmp_path):
    run_dir = tmp_path / "run"
    r = _train_cli("ffn_impl=torch", f"hydra.run.dir={run_dir}")
    assert r.returncode == 2, r.stderr
    want = "ConfigError: unknown top-level key ffn_impl; did you mean ffn.impl?"
    assert _stderr_lines(r) == [want], r.stderr
    assert not run_dir.exists()


def test_a_misspelt_key_in_an_experiment_yaml_gets_the_closest_key(tmp_path):
    """An experiment file outside configs/ (hydra.searchpath) with a typo two levels down:
    OmegaConf's unknown-key line, then the closest known key."""
    (tmp_path / "sp" / "experiment").mkdir(parents=True)
    (tmp_path / "sp" / "experiment" / "typo.yaml").write_text(
        "# @package _global_\nffn:\n  policy:\n    ell_capacty: 64\n")
    run_dir = tmp_path / "run"
    r = _train_cli("experiment=typo", f"hydra.searchpath=[file://{tmp_path / 'sp'}]",
                   f"hydra.run.dir={run_dir}")
    assert r.returncode == 2, r.stderr[-2000:]
    err = _stderr_lines(r)
    assert len(err) == 1 and err[0].startswith("ConfigError: In 'experiment/typo': "), err
    assert err[0].endswith("Key 'ell_capacty' not in 'FFNPolicy'; did you mean "
                           "ffn.policy.ell_capacity?"), err
    assert not run_dir.exists()


def test_override_check_lets_valid_overrides_through():
    from train.main import check_overrides

    check_overrides(["model=tiny", "experiment=paper_0p5b", "sparsity.l1_coeff=0,1e-5",
                     "hydra.run.dir=x", "hydra/launcher=basic", "+hydra.job.env_set.A=1",
                     "data.paths=[a.bin,b.bin]", "optim.betas=[0.9,0.95]", "~eval.limit",
                     "~experiment", "~model",
                     "-m", "--cfg", "job", "trainer.resume_allow_changes=true"])


def test_unknown_added_key_in_run_gets_the_hint(tmp_path):
    """``_reject_unknown_keys`` (keys added past the CLI check, e.g. by a Python caller)."""
    from hydra import compose, initialize_config_dir

    from train.main import CONFIG_DIR, run

    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["+trainer.max_step=5"])
    with pytest.raises(ConfigError, match=r"did you mean trainer\.max_steps\?"):
        run(cfg, run_dir=str(tmp_path / "r"))


def test_a_bad_ffn_policy_value_is_one_line_naming_the_config_key(tmp_path):
    run_dir = tmp_path / "run"
    r = _train_cli("ffn.policy.max_hot_units=-16", f"hydra.run.dir={run_dir}", *SMALL)
    assert r.returncode == 2, r.stderr[-3000:]
    err = _stderr_lines(r)
    assert err == [("ConfigError: ffn.policy.max_hot_units must be an integer >= 0; got -16. "
                    "Set ffn.policy.max_hot_units=<int >= 0>.")], err
    assert not run_dir.exists()


# ------------------------------------------------------------------ 7 + 15: a run that fails early


def test_failed_start_leaves_no_new_run_dir_and_one_line(tmp_path):
    """An empty token file: DataError in one line, exit code 2, and the run dir Hydra made for
    this attempt is removed."""
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    run_dir = tmp_path / "runs" / "new"
    r = _train_cli("data=tokens", f"data.paths=[{empty}]", f"hydra.run.dir={run_dir}", *SMALL)
    assert r.returncode == 2, r.stderr[-3000:]
    err = _stderr_lines(r)
    assert len(err) == 1 and err[0].startswith("DataError: ") and str(empty) in err[0], err
    assert not run_dir.exists()


def test_only_a_run_dir_made_for_the_failed_attempt_is_removed(tmp_path):
    """``RunDirCallback`` notes which dirs Hydra is about to create; ``remove_failed_run_dir``
    removes only those, and only while they hold nothing but Hydra's files, the lock and log."""
    from omegaconf import OmegaConf

    from train.rundir import RunDirCallback, remove_failed_run_dir

    def attempt(d, extra=None):  # what Hydra and a failed trainer leave
        RunDirCallback().on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(d)}}}))
        (d / ".hydra").mkdir(parents=True, exist_ok=True)
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
            (d / ".hydra" / name).write_text("x")
        (d / ".lock").write_text("")
        (d / "train.log").write_text("a warning\n")
        if extra:
            (d / extra).write_text("mine")
        return remove_failed_run_dir(d)

    assert attempt(tmp_path / "new") and not (tmp_path / "new").exists()
    old = tmp_path / "old"
    old.mkdir()
    assert not attempt(old) and (old / ".hydra").is_dir()  # existed before: left alone
    assert not attempt(tmp_path / "new2", extra="notes.txt")  # holds something else: kept
    assert (tmp_path / "new2" / "notes.txt").read_text() == "mine"
    sweep = tmp_path / "sweep"  # -m: a sweep dir made for this sweep; job dirs inside it
    RunDirCallback().on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    (sweep / "0" / ".hydra").mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("x")
    assert remove_failed_run_dir(sweep / "0") and sweep.is_dir() and not (sweep / "0").exists()


# ------------------------------------------------------------------ 9: help texts


def test_train_help_lists_real_groups_and_documents_the_keys():
    r = _train_cli("--help", "optim=adamw", timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "data: files, fineweb_edu, offline_mix, tokens" in out and "base_data" not in out
    # every key with its current value (composed with the overrides) and its docstring
    assert "  l1_coeff: 2e-05  # Coefficient of the L1 term" in out
    assert "  lr: 0.001  # Peak learning rate." in out  # optim=adamw's value, not tiny's
    assert "val_sequences" in out and "$TWELL_CACHE" in out


def test_data_help_describes_itself_once_and_points_to_the_real_readme(capsys):
    from train.data.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.count("build, inspect and verify") == 1
    assert "DATA.md" not in out and "train/data/README.md" in out


# ------------------------------------------------------------------ sweeps, failed starts


def _tokens(tmp_path):
    from tests.train_utils import write_tokens

    return write_tokens(tmp_path / "tok.bin", n_tokens=8_000)


def test_sweep_runs_every_job_and_lists_the_failed_ones(tmp_path):
    """-m over a good lr, a diverging one (1e30: NaN at step 2) and a config error (-1): every
    job runs, each failed job's dir holds its reason in error.txt, the sweep ends with the
    failed jobs (labelled by what differs) and exit 2."""
    sweep = tmp_path / "sweep"
    r = _train_cli("-m", "data=tokens", f"data.paths=[{_tokens(tmp_path)}]", *SMALL,
                   "trainer.max_steps=2", "trainer.log_every=1", f"hydra.sweep.dir={sweep}",
                   "optim.lr=5e-4,1e30,-1", timeout=600)
    assert r.returncode == 2, r.stderr[-3000:]
    jobs = {int(p.name): p for p in sweep.iterdir() if p.is_dir()}
    assert sorted(jobs) == [0, 1, 2]
    assert (jobs[0] / "summary.json").is_file() and not (jobs[0] / "error.txt").exists()
    diverged = (jobs[1] / "error.txt").read_text()
    assert diverged.startswith("NonFiniteLossError: non-finite loss or gradient at step 2")
    assert diverged.count("\n") == 1 and not (jobs[1] / "summary.json").exists()
    assert diverged.strip() in (jobs[1] / "train.log").read_text()
    # its facts beside the line, for twell-report: no checkpoint was saved before step 2
    assert json.loads((jobs[1] / "error.json").read_text()) == {
        "error": "NonFiniteLossError", "step": 2, "reason": "non-finite loss or gradient",
        "last_good_checkpoint": None}
    assert (jobs[2] / "error.txt").read_text().startswith("ConfigError: optim.lr must be")
    assert not (jobs[2] / "error.json").exists()
    tail = r.stderr[r.stderr.index("sweep: 2 of 3 jobs failed:"):].splitlines()
    assert len(tail) == 3, tail
    assert tail[1].startswith("  #1 optim.lr=1") and ": NonFiniteLossError: " in tail[1]
    assert " trainer." not in tail[1]  # only the override that differs between the jobs
    assert tail[2].startswith("  #2 optim.lr=-1: ConfigError: optim.lr must be")
    assert tail[2].endswith(f"({jobs[2] / 'error.txt'})")


def test_a_diverged_runs_facts_lead_the_report_to_its_checkpoint(tmp_path):
    """A run that diverges at step 2 after saving step 1 writes its facts to error.json (the
    checkpoint relative to the run dir); twell-report names that checkpoint under the run dir
    after the dir was moved, and not for a resume: step 1's weights (after an update at lr
    1e30) are what step 2 diverged on, so resuming them with a lower lr diverges again at step
    2; with no earlier checkpoint the advice is a new run."""
    import shutil

    from studies.report import IncompleteRunError, load_run

    base = ["data=tokens", f"data.paths=[{_tokens(tmp_path)}]", *SMALL, "trainer.max_steps=3",
            "trainer.save_every=1"]
    r = _train_cli(*base, "optim.lr=1e30", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2 and "NonFiniteLossError: " in r.stderr, r.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "error.json").read_text()) == {
        "error": "NonFiniteLossError", "step": 2, "reason": "non-finite loss or gradient",
        "last_good_checkpoint": "checkpoints/step1"}
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "run", moved)
    (moved / ".lock").unlink(missing_ok=True)
    step1 = moved / "checkpoints" / "step1"
    why = str(pytest.raises(IncompleteRunError, load_run, moved).value)
    assert why.endswith(
        f"diverges again, and so may resuming its last good checkpoint, {step1}, saved 1 step "
        "before the divergence at step 2 (step 2's forward ran on step 1's weights, and the "
        "weights of the steps just before a divergence may already be ruined), with no earlier "
        "checkpoint kept: start a new run (a new hydra.run.dir) with a lower optim.lr or longer "
        "optim.warmup_steps, or leave it out (--skip-incomplete)")
    assert str(tmp_path / "run") not in why.split("diverges again")[1]
    # the advice it replaces: resume step 1 with a lower lr, which diverges again at step 2
    r = _train_cli(*base, f"trainer.resume={step1}", "trainer.resume_allow_changes=true",
                   "optim.lr=1e-4", f"hydra.run.dir={tmp_path / 'resumed'}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert (tmp_path / "resumed" / "error.txt").read_text().startswith(
        "NonFiniteLossError: non-finite loss or gradient at step 2 ")


def test_a_short_runs_warmup_is_a_note_unless_set_on_the_command_line(tmp_path):
    """A smoke run (trainer.max_steps=2 under optim=tiny's 10 warm-up steps) gets a note among its
    lines and in train.log, no warning; optim.warmup_steps=5 typed beside it is a warning. The
    schedule is the configured one either way (step 2 at 5e-4 * 2 / 10)."""
    from tests.train_utils import read_metrics

    base = ["data=tokens", f"data.paths=[{_tokens(tmp_path)}]", "trainer.max_steps=2",
            *(a for a in SMALL if not a.startswith(("optim.warmup_steps=", "trainer.max_steps=")))]
    r = _train_cli(*base, f"hydra.run.dir={tmp_path / 'smoke'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "optim.warmup_steps" not in r.stderr, r.stderr
    note = ("note: the configured lr warm-up (optim.warmup_steps=10) is longer than this 2-step "
            "run: the lr rises to 1.00e-04 by its last step, short of optim.lr=5.00e-04.")
    assert [ln for ln in r.stdout.splitlines() if "optim.warmup_steps" in ln] == [note], r.stdout
    assert note in (tmp_path / "smoke" / "train.log").read_text()
    assert read_metrics(tmp_path / "smoke")[-1]["lr"] == pytest.approx(1e-4)

    r = _train_cli(*base, "optim.warmup_steps=5", f"hydra.run.dir={tmp_path / 'set'}")
    assert r.returncode == 0, r.stderr[-3000:]
    warning = ("warning: optim.warmup_steps=5 > trainer.max_steps=2: the learning rate never "
               "reaches optim.lr (peak 2.00e-04); lower optim.warmup_steps.")
    assert [ln for ln in r.stderr.splitlines() if "optim.warmup_steps" in ln] == [warning], (
        r.stderr)
    assert "note:" not in r.stdout


def _injected_cli(tmp_path, *args, fail_seed: int):
    """``twell-train`` with Trainer raising an unexpected RuntimeError for trainer.seed ==
    ``fail_seed`` (a bug stand-in), through the real CLI entry point."""
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import sys\n"
        "import train.trainer\n"
        "init = train.trainer.Trainer.__init__\n"
        "def init_or_fail(self, cfg, *a, **k):\n"
        f"    if cfg.trainer.seed == {fail_seed}:\n"
        "        raise RuntimeError('injected bug')\n"
        "    init(self, cfg, *a, **k)\n"
        "train.trainer.Trainer.__init__ = init_or_fail\n"
        "from train.main import cli\n"
        "cli()\n")
    return subprocess.run([sys.executable, str(driver), *args], cwd=ROOT, env=ENV, check=False,
                          capture_output=True, text=True, timeout=600)


def test_an_unexpected_error_in_one_sweep_job_leaves_the_others_running(tmp_path):
    sweep = tmp_path / "sweep"
    r = _injected_cli(tmp_path, "-m", "data=tokens", f"data.paths=[{_tokens(tmp_path)}]", *SMALL,
                      f"hydra.sweep.dir={sweep}", "trainer.seed=1,7,3", fail_seed=7)
    assert r.returncode == 2, r.stderr[-3000:]
    assert (sweep / "0" / "summary.json").is_file() and (sweep / "2" / "summary.json").is_file()
    assert (sweep / "1" / "error.txt").read_text() == "RuntimeError: injected bug\n"
    assert "Traceback" in r.stderr  # a bug keeps its traceback
    assert "sweep: 1 of 3 jobs failed:\n  #1 trainer.seed=7: RuntimeError: injected bug" in r.stderr


def test_a_failed_start_removes_the_folders_it_made_and_nothing_else(tmp_path):
    """An unexpected error before training (not only our one-line errors) removes the run dir
    Hydra made and the parents made for it (runs/<date>/), never a folder that existed."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "keep.txt").write_text("mine")
    run_dir = tmp_path / "runs" / "2026-12-01" / "10-00-00"
    r = _injected_cli(tmp_path, "data=tokens", f"data.paths=[{_tokens(tmp_path)}]", *SMALL,
                      f"hydra.run.dir={run_dir}", "trainer.seed=7", fail_seed=7)
    assert r.returncode == 1 and "RuntimeError: injected bug" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "runs" / "2026-12-01").exists()
    assert (tmp_path / "runs" / "keep.txt").read_text() == "mine"
    empty = tmp_path / "empty"  # an existing empty folder as the run dir: left in place
    empty.mkdir()
    r = _train_cli("model.seq_len=1", f"hydra.run.dir={empty}")
    assert r.returncode == 2 and empty.is_dir()
    assert _stderr_lines(r) == [("ConfigError: model.seq_len=1 leaves no next-token target in a "
                                 "block (the loss would be NaN); set model.seq_len>=2.")]


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder the process cannot write: a read-only tmpfs (as root), else chmod 555."""
    import os

    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() == 0:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)],
                           check=False, capture_output=True)
        if r.returncode:
            pytest.skip("running as root without mount: no read-only folder to test")
        yield d
        subprocess.run(["umount", str(d)], check=False)
    else:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)


def test_read_only_run_dir_is_one_line(read_only_dir):
    for run_dir in (read_only_dir, read_only_dir / "runs" / "x"):
        r = _train_cli(f"hydra.run.dir={run_dir}", "trainer.max_steps=1")
        assert r.returncode == 2, r.stderr[-2000:]
        err = _stderr_lines(r)
        assert len(err) == 1 and "Traceback" not in r.stderr, err
        assert err[0].startswith(f"ConfigError: the run dir {run_dir} cannot be written")
        assert err[0].endswith("set hydra.run.dir to a writable folder.")
    r = _train_cli("-m", f"hydra.sweep.dir={read_only_dir / 's'}", "trainer.seed=1,2")
    assert r.returncode == 2 and "set hydra.sweep.dir to a writable folder." in r.stderr


def test_a_run_dir_no_file_can_be_made_in_is_one_line_also_for_root(tmp_path, monkeypatch,
                                                                    capsys):
    """The run dir is probed by creating a file in it: ``os.access`` says yes to root (as
    simulated here) even where nothing can be created (/proc, for every user)."""
    from train import main

    monkeypatch.setattr(os, "access", lambda *a, **k: True)
    monkeypatch.setattr(main, "_CREATED", set())
    afile = tmp_path / "afile"
    afile.write_text("x")
    for run_dir, why in ((Path("/proc/twell-test/run"), "its parent /proc is not writable: "),
                         (afile / "run", f"its parent {afile} is not a folder")):
        with pytest.raises(SystemExit) as err:
            main.check_writable(str(run_dir), "hydra.run.dir")
        assert err.value.code == 2
        line = capsys.readouterr().err
        assert line.startswith(f"ConfigError: the run dir {run_dir} cannot be written ({why}")
        assert line.endswith("); set hydra.run.dir to a writable folder.\n") and line.count(
            "\n") == 1, line
    main.check_writable(str(tmp_path / "new" / "run"), "hydra.run.dir")  # writable: no exit
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # the probe left nothing
    r = _train_cli("hydra.run.dir=/proc/twell-test/run", "trainer.max_steps=1", "eval=disabled")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert _stderr_lines(r) == [(
        "ConfigError: the run dir /proc/twell-test/run cannot be written (its parent /proc is "
        "not writable: No such file or directory); set hydra.run.dir to a writable folder.")]


def test_the_command_of_a_finished_run_run_again_says_so_before_loading_anything(tmp_path):
    """A finished run's command run again: one line saying the run reached trainer.max_steps
    and how to train it longer, exit 0, before the data or model is loaded, the run dir left as
    it was; the way it names trains on. Not "finished": a run stopped in its final evals (no
    summary.json), a rerun with evals due, another config, trainer.resume=never, more steps."""
    from train.config import compose
    from train.rundir import RunDirLock, finished_run

    run = tmp_path / "run"
    base = ["data=tokens", f"data.paths=[{_tokens(tmp_path)}]", *SMALL, f"hydra.run.dir={run}"]
    assert _train_cli(*base).returncode == 0
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    r = _train_cli(*base)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    assert r.stdout.splitlines()[1:] == [
        (f"run dir {run} already reached trainer.max_steps=1 (checkpoint step1, summary.json): "
        f"nothing to train. To train it longer, run the same command with trainer.resume={run} "
        "trainer.max_steps=2 trainer.resume_allow_changes=true (twice its steps here; any larger "
        "trainer.max_steps works).")], r.stdout
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before
    more = ["trainer.max_steps=2", f"trainer.resume={run}", "trainer.resume_allow_changes=true"]
    r = _train_cli(*base, *more)
    assert r.returncode == 0 and "training steps 2-2 of 2" in r.stdout, r.stderr[-2000:]
    assert "already reached" in _train_cli(*base, *more).stdout  # that command again: finished

    def finished(*over: str) -> bool:
        cfg = compose([o for o in base if not o.startswith("hydra.")] + [*more, *over])
        return finished_run(run, cfg) is not None

    assert finished() and finished("trainer.resume=auto", "trainer.log_every=5")
    assert not finished("trainer.max_steps=3")
    assert not finished("sparsity.l1_coeff=1e-3")  # another run: the resume refuses it
    assert not finished("trainer.resume=never")
    assert not finished("eval.at_end=true")  # the evals are due: the resume runs them
    lock = RunDirLock(run)  # in use (an extension training): its lock refuses the process
    try:
        assert not finished()
    finally:
        lock.release()
    (run / "summary.json").unlink()  # as a stop in the final evals leaves it
    assert not finished()
    init = tmp_path / "init"  # model=pretrained: the shape's nulls are the checkpoint's
    pre = [o for o in base if not o.startswith("hydra.")] + [
        "model=pretrained", f"model.init_from={run / 'checkpoints' / 'step2'}"]
    assert _train_cli(*pre, f"hydra.run.dir={init}").returncode == 0
    assert compose(pre).model.num_layers is None
    assert finished_run(init, compose(pre)) is not None


def _signalled_cli(tmp_path, where: str, signum: int, *args):
    """``twell-train`` (the real entry point) sending itself ``signum`` when the trainer's set-up
    reaches ``where``: ``build_corpus`` (train.data.corpus) or ``build_datamodule``
    (train.data), each replaced by a stand-in of that name."""
    module = "train.data.corpus" if where == "build_corpus" else "train.data"
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import os, signal, sys, time\n"
        # Ctrl-C as in a terminal, also under a test run started in the background of a script
        # (its children inherit SIGINT ignored)
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"import {module}\n"
        f"def {where}(*a, **k):\n"
        f"    os.kill(os.getpid(), {int(signum)})\n"
        "    time.sleep(60)\n"
        "    raise AssertionError('the signal did not stop the run')\n"
        f"{module}.{where} = {where}\n"
        "from train.main import cli\n"
        "cli()\n")
    return subprocess.run([sys.executable, str(driver), *args], cwd=ROOT, env=ENV, check=False,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_while_the_corpus_builds_is_one_line_and_removes_the_new_run_dir(tmp_path,
                                                                                signum):
    """Ctrl-C or SIGTERM before the first step (here: building the corpus of a fresh
    data.cache_dir): the shell's exit code, one line saying what it was doing, that nothing
    was trained and how to go on; the run dir and the folders made for it are removed."""
    (tmp_path / "runs").mkdir()
    run_dir = tmp_path / "runs" / "2026-12-01" / "10-00-00"
    r = _signalled_cli(tmp_path, "build_corpus", signum, f"hydra.run.dir={run_dir}",
                       f"data.cache_dir={tmp_path / 'corpus'}", "trainer.max_steps=2",
                       "eval=disabled", "logging.wandb_mode=disabled")
    code = 128 + int(signum)
    assert r.returncode == code, r.stderr[-3000:]
    assert _stderr_lines(r) == [
        (f"{signal.Signals(signum).name}: interrupted before the first step (building the "
        f"corpus); nothing was trained and the run dir {run_dir} was removed; rerun the same "
        f"command to continue (exit code {code})")], r.stderr[-3000:]
    assert list((tmp_path / "runs").iterdir()) == []


def test_a_stop_while_a_resume_loads_its_data_keeps_the_run_and_the_rerun_continues(tmp_path):
    """SIGTERM while the resume of a run loads its data: exit 143, one line, the run dir kept as
    it was (its checkpoint, its summary); the same command run again trains on."""
    run = tmp_path / "run"
    base = ["data=tokens", f"data.paths=[{_tokens(tmp_path)}]", *SMALL, f"hydra.run.dir={run}"]
    assert _train_cli(*base).returncode == 0
    more = [*base, "trainer.max_steps=2", f"trainer.resume={run}",
            "trainer.resume_allow_changes=true"]
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    r = _signalled_cli(tmp_path, "build_datamodule", signal.SIGTERM, *more)
    assert r.returncode == 143, r.stderr[-3000:]
    assert _stderr_lines(r) == [
        (f"SIGTERM: interrupted before the first step (loading the data); no step was trained, "
        f"{run} is kept; rerun the same command to continue (exit code 143)")]
    assert {p: p.read_bytes() for p in run.rglob("*")
            if p.is_file() and p.name != ".lock"} == before
    r = _train_cli(*more)
    assert r.returncode == 0 and "training steps 2-2 of 2" in r.stdout, r.stderr[-3000:]


def test_evals_with_a_choice_longer_than_the_model_are_refused_before_training(tmp_path):
    """model.seq_len=64 with the default evals (the seven tasks' first 200 rows): refused at the
    start in one line naming the longest choice (PIQA row 142, 151 SmolLM2 tokens) and the
    fixes, not after training; the run dir made for it is removed. At 151 positions (and at the
    default 256) the same evals fit."""
    import json

    from train.config import compose
    from train.data.tokenizer import load_tokenizer
    from train.evaluation import check_eval_fits

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"Document {i} is about the weather and the "
                                                f"sea, the wind and the boats, number {i * 7}."})
                            + "\n" for i in range(200)))
    run_dir = tmp_path / "run"
    r = _train_cli("data=files", f"data.paths=[{docs}]", "data.decontaminate=false",
                   f"data.cache_dir={tmp_path / 'corpus'}", "model.seq_len=64",
                   "trainer.max_steps=2", "logging.wandb_mode=disabled",
                   f"hydra.run.dir={run_dir}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr  # above the line: the corpus build's progress bars
    assert _stderr_lines(r)[-1:] == [(
        "ConfigError: eval.tasks: piqa row 142 has a choice of 151 tokens, more than the "
        "model's 64 positions (model.seq_len=64), so the evals after training would fail on it "
        "(piqa holds one among the first 200 rows, eval.limit); set model.seq_len>=151, "
        "eval.tasks without piqa, or eval=disabled.")], r.stderr[-3000:]
    assert "training steps" not in r.stdout and not run_dir.exists()
    smol = load_tokenizer("smollm2")
    check_eval_fits(compose(["model.seq_len=151"]), smol, 151)  # no error
    check_eval_fits(compose([]), smol, 256)
