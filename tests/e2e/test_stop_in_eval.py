"""SIGTERM while the trainer evaluates or validates: the pass ends at its next forward, the step is
checkpointed and the run stops, instead of the evaluation running on until a launcher or scheduler
kills the process with no checkpoint.

In-process runs of the tiny test model with ``evals.evaluate`` replaced by a stand-in that calls the
model once per "item" (as the harness does) and sends the process SIGTERM after its first item; and
an ``accelerate launch`` of two CPU ranks (gloo) that get the launcher's forwarded SIGTERM in the
middle of a slow evaluation (rank 0's) or validation (both ranks').
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.train_utils import (
    datamodule_with_stub_tokenizer,
    no_eval_fit_check,
    read_metrics,
    tiny_config,
    write_tokens,
)
from train import checkpoint as ckpt_io
from train.interrupt import TrainingInterrupted
from train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
ITEMS = 40  # forwards of a whole stand-in evaluation


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "train.bin", n_tokens=8000)


@pytest.fixture
def slow_evals(monkeypatch):
    """``evals.evaluate`` -> a stand-in that runs ITEMS forwards and SIGTERMs this process after
    the first (while ``calls.signal``); ``calls`` counts the forwards that ran."""

    class Calls(list):
        signal = True

    calls = Calls()

    def evaluate(model, tokenizer, tasks="all", limit=None, batch_size=16, device=None, **kw):
        ids = torch.randint(1, 64, (2, 16))
        for i in range(ITEMS):
            with torch.no_grad():
                model(input_ids=ids)
            calls.append(i)
            if i == 0 and calls.signal:
                os.kill(os.getpid(), signal.SIGTERM)
        return {"tasks": {"piqa": {"acc": 0.5, "acc_norm": 0.5, "primary": 0.5, "n": ITEMS}},
                "mean": 0.5, "protocol": {}}

    import evals

    monkeypatch.setattr(evals, "evaluate", evaluate, raising=False)
    no_eval_fit_check(monkeypatch)
    return calls


def _trainer(tokens, run, **over):
    cfg = tiny_config(tokens, **over)
    return Trainer(cfg, run, datamodule=datamodule_with_stub_tokenizer(cfg))


def test_sigterm_in_an_in_loop_evaluation_stops_it_and_checkpoints(tokens, tmp_path,
                                                                   slow_evals):
    run = tmp_path / "run"
    t = _trainer(tokens, run, **{"trainer.max_steps": 8, "eval.every_steps": 2})
    try:
        with pytest.raises(TrainingInterrupted) as err:
            t.train()
    finally:
        t.close()
    assert err.value.signum == signal.SIGTERM and err.value.reported
    assert len(slow_evals) == 1  # the forward after the signal did not run
    ckpt = run / "checkpoints" / "step2"
    assert ckpt_io.verify(ckpt) == [] and t.last_ckpt == ckpt
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert read_metrics(run, "eval") == []  # no result from a cut evaluation
    log = (run / "train.log").read_text()
    assert "step 2: evaluation stopped by SIGTERM (no eval result for this step)" in log
    assert f"received SIGTERM at step 2: checkpoint written to {ckpt}" in log


def test_sigterm_in_the_final_evaluation_leaves_no_summary_and_the_resume_redoes_it(
        tokens, tmp_path, slow_evals):
    run = tmp_path / "run"
    over = {"trainer.max_steps": 3, "eval.at_end": True}
    t = _trainer(tokens, run, **over)
    try:
        with pytest.raises(TrainingInterrupted):
            t.train()
    finally:
        t.close()
    assert len(slow_evals) == 1 and not (run / "summary.json").exists()
    assert ckpt_io.verify(run / "checkpoints" / "step3") == []
    slow_evals.clear()
    slow_evals.signal = False
    t = _trainer(tokens, run, **over)  # resume=auto: at step 3, only the eval is left
    try:
        t.train()
    finally:
        t.close()
    assert len(slow_evals) == ITEMS and [r["step"] for r in read_metrics(run, "eval")] == [3]
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]  # no step trained again
    assert json.loads((run / "summary.json").read_text())["eval"]["eval_mean"] == 0.5


def test_sigterm_in_the_evaluation_before_training_stops_without_a_checkpoint(
        tokens, tmp_path, slow_evals, capsys):
    run = tmp_path / "run"
    t = _trainer(tokens, run, **{"trainer.max_steps": 3, "eval.at_start": True})
    try:
        with pytest.raises(TrainingInterrupted) as err:
            t.train()
    finally:
        t.close()
    assert len(slow_evals) == 1 and not (run / "checkpoints").exists()
    # no step finished: the first signal stops at once (nothing would be lost), and the line
    # twell-train prints for it says so and how to go on
    assert err.value.first and err.value.exit_code == 143
    assert t.interrupted(err.value) == 143
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == ("received SIGTERM: stopped at once (no step finished since the last "
                    "checkpoint, so none is lost) at step 0; newest complete checkpoint: none; "
                    "no checkpoint was written; re-running the same command starts over"), line
    assert read_metrics(run) == []  # not a step trained


def test_sigterm_in_validation_stops_it_and_checkpoints(tokens, tmp_path, monkeypatch):
    run = tmp_path / "run"
    t = _trainer(tokens, run, **{"trainer.max_steps": 8, "trainer.val_every": 2,
                                 "trainer.val_sequences": 64})
    seen = []
    batches = t.data.val_batches

    def signalling_batches(n):
        for i, ids in enumerate(batches(n)):
            seen.append(i)
            if i == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            yield ids

    monkeypatch.setattr(t.data, "val_batches", signalling_batches)
    try:
        with pytest.raises(TrainingInterrupted):
            t.train()
    finally:
        t.close()
    assert len(seen) <= 2  # of 16 micro-batches of 4: the forward after the signal did not run
    assert ckpt_io.verify(run / "checkpoints" / "step2") == []
    assert read_metrics(run, "val") == []
    assert "step 2: validation stopped by SIGTERM" in (run / "train.log").read_text()


# ------------------------------------------------------------------ under accelerate launch

DRIVER = """
import os, time
import torch

def evaluate(model, tokenizer, tasks="all", limit=None, batch_size=16, device=None, **kw):
    open(os.environ["PASS_MARK"], "w").write("started")
    ids = torch.randint(1, 64, (2, 16))
    for _ in range(600):  # 60 s of evaluation: longer than the launcher's 30 s
        with torch.no_grad():
            model(input_ids=ids)
        time.sleep(0.1)
    return {"tasks": {}, "mean": 0.0, "protocol": {}}

import evals
import evals.harness
evals.evaluate = evaluate  # what the trainer's `from evals import evaluate` gets
evals.harness.long_continuations = lambda *a, **k: {}  # the start's check: the stand-in fits
import train.data
from tests.train_utils import _StubTokenizer
build = train.data.build_datamodule
def with_tokenizer(*a, **k):  # the token files get a stand-in tokenizer: evals may run
    dm = build(*a, **k)
    dm.tokenizer = _StubTokenizer()
    val_batches = dm.val_batches
    def slow_val_batches(n):  # every rank: 0.25 s per micro-batch, as on a big model
        first = next(iter(val_batches(1)))
        open(os.environ["PASS_MARK"], "w").write("started")
        for _ in range(n):
            time.sleep(0.25)
            yield first
    dm.val_batches = slow_val_batches
    return dm
train.data.build_datamodule = with_tokenizer
from train.main import cli
cli()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["evaluation", "validation"])
def test_sigterm_under_accelerate_launch_in_an_eval_pass_checkpoints_in_time(tokens, tmp_path,
                                                                           phase):
    """Two ranks (DDP on gloo) at step 2: rank 0 evaluates (60 s of forwards) while rank 1
    waits, or both validate (37 s of micro-batches each). SIGTERM to the launcher, which
    forwards it, ends the run with the step-2 checkpoint well before the launcher's 30 s kill."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    mark = tmp_path / "pass_started"
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled", "PASS_MARK": str(mark)}
    over = (["eval.every_steps=2", "trainer.val_every=0", "trainer.val_sequences=4"]
            if phase == "evaluation" else
            ["eval=disabled", "trainer.val_every=2", "trainer.val_sequences=1200"])
    env.pop("TRITON_INTERPRET", None)
    accelerate = Path(sys.executable).parent / "accelerate"
    cmd = [str(accelerate), "launch", "--config_file", str(ROOT / "configs/accelerate/ddp.yaml"),
           "--num_processes", "2", "--main_process_port", str(_free_port()), str(driver),
           "data=tokens", f"data.paths=[{tokens}]", "data.vocab_size=64", "model.vocab_size=64",
           "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2",
           "model.num_layers=2", "model.seq_len=32", "trainer.global_batch=8",
           "trainer.micro_batch=4", "trainer.cpu=true", "trainer.num_threads=1",
           "trainer.max_steps=6", "trainer.log_every=1", "logging.wandb_mode=disabled",
           "trainer.progress=false", f"hydra.run.dir={run}", *over]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not mark.exists() and p.poll() is None and time.monotonic() - t0 < 300:
            time.sleep(0.1)
        assert mark.exists(), p.communicate(timeout=60)[0][-3000:]
        time.sleep(1.0)
        sent = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=120)[0]
        took = time.monotonic() - sent
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert took < 25, f"{took:.0f} s:\n{out[-3000:]}"
    assert f"step 2: {phase} stopped by SIGTERM" in out, out[-3000:]
    assert f"received SIGTERM at step 2: checkpoint written to {run / 'checkpoints' / 'step2'}" \
        in out, out[-3000:]
    assert ckpt_io.verify(run / "checkpoints" / "step2") == []
    meta = json.loads((run / "checkpoints" / "step2" / "metadata.json").read_text())
    assert meta["world_size"] == 2
