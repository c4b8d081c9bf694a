"""Whose run dir it is (issue 33): a process refused in another run's folder (a live run's lock,
another run's config or checkpoints, a bad value) writes nothing there (item 4). Subprocesses of
``python -m train`` on the tiny test model (one or two steps)."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train_utils import write_tokens
from train.rundir import RunDirLock

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
SMALL = ["model.vocab_size=64", "data.vocab_size=64", "model.hidden_size=32",
         "model.intermediate_size=64", "model.num_heads=2", "model.num_layers=2",
         "model.seq_len=32", "trainer.global_batch=4", "trainer.micro_batch=4", "eval=disabled",
         "logging.wandb_mode=disabled", "trainer.progress=false", "trainer.max_steps=1",
         "optim.warmup_steps=1", "trainer.num_threads=1", "trainer.cpu=true",
         "trainer.val_sequences=4"]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "tok.bin", n_tokens=4000)


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
