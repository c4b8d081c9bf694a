"""Faults and untrusted files: checkpoints that cannot run code, SIGTERM / SIGINT, a full disk,
damaged or incomplete checkpoints, branches, init_from sources that moved, atomic JSON, the
closing line and progress output. Tiny fp32 CPU runs (in-process, or ``python -m train`` in a
subprocess where a signal or the CLI's exit code is tested)."""

import errno
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.train_utils import one_line, read_metrics, tiny_config, train_run, write_tokens
from train import checkpoint as ckpt_io
from train.config import ConfigError
from train.interrupt import StopSignals, TrainingInterrupted
from train.trainer import Trainer, summary_line

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("loss", "ce", "l1", "l0_mean", "nnz_max", "grad_norm", "lr")


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "train.bin", n_tokens=8000)


def _same_metrics(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key in KEYS:
            assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-6), (ra["step"], key)


SAVE = {"trainer.max_steps": 4, "trainer.save_every": 2, "trainer.keep_last": 3,
        "sparsity.l1_coeff": 0.5}


@pytest.fixture(scope="module")
def saved(tokens, tmp_path_factory):
    """A finished 4-step run with checkpoints step2 and step4 (copy it before changing it)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    train_run(tiny_config(tokens, **SAVE), run)
    assert [c.name for c in ckpt_io.list_checkpoints(run)] == ["step2", "step4"]
    return run


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


# ------------------------------------------------------------------ 1: no code from a checkpoint


def test_state_round_trip_keeps_types_and_values(tmp_path):
    """save_state / load_state give back the same containers: int keys, tuples, numpy arrays,
    NaN, empty, 0-d and bool tensors; anything else is refused naming where it is."""
    obj = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.arange(6.0).view(2, 3)},
                     7: {"empty": torch.zeros(0, 4)}},
           "groups": [{"betas": (0.9, 0.95), "params": [0, 7], "lr": float("nan"),
                       "foreach": None}],
           "rng": (3, tuple(range(5)), None),
           "np": ("MT19937", np.arange(4, dtype=np.uint32), 2, 0, 0.5),
           "mask": torch.tensor([True, False]), "__tuple__": "a plain key that looks like a tag",
           "same": None}
    obj["same"] = obj["state"][0]["exp_avg"]  # one tensor named twice
    ckpt_io.save_state(tmp_path, "s", obj)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "s.safetensors"]
    got = ckpt_io.load_state(tmp_path, "s")
    assert set(got["state"]) == {0, 7} and got["groups"][0]["betas"] == (0.9, 0.95)
    assert torch.equal(got["state"][0]["exp_avg"], torch.arange(6.0).view(2, 3))
    assert got["state"][0]["step"].shape == () and got["state"][7]["empty"].shape == (0, 4)
    assert got["rng"] == (3, (0, 1, 2, 3, 4), None) and got["groups"][0]["foreach"] is None
    assert got["np"][1].dtype == np.uint32 and got["np"][1].tolist() == [0, 1, 2, 3]
    assert isinstance(got["np"], tuple) and np.isnan(got["groups"][0]["lr"])
    assert got["mask"].tolist() == [True, False] and got["__tuple__"].startswith("a plain")
    assert torch.equal(got["same"], got["state"][0]["exp_avg"])
    with pytest.raises(TypeError, match="a\\.b: a function"):
        ckpt_io.save_state(tmp_path, "bad", {"a": {"b": lambda: 0}})


def test_checkpoint_holds_no_pickle(saved):
    ckpt = saved / "checkpoints" / "step4"
    names = {p.name for p in ckpt.iterdir()}
    assert not [n for n in names if n.endswith((".pt", ".pkl", ".bin"))], names
    for name in ("optimizer", "scheduler", "trainer", "rank0"):
        doc = json.loads((ckpt / f"{name}.json").read_text())
        assert doc["format"] == ckpt_io.STATE_FORMAT, name
    trainer = ckpt_io.load_state(ckpt, "trainer")
    assert trainer["step"] == 4 and trainer["tokens_seen"] == 4 * 8 * 32


def test_no_unsafe_torch_load_in_the_repository():
    bad = "weights_only=" + "False"  # split: this file must not match itself
    hits = [f"{p.relative_to(ROOT)}:{i}"
            for d in ("train", "twell", "evals", "scripts", "tests", "offline")
            for p in (ROOT / d).rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if bad in line or "pickle" + ".load(" in line]
    assert hits == []


class _RunsCommand:
    """A pickle payload: unpickling it calls os.system (what an attacker would put there)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _to_previous_format(ckpt: Path, poison: Path | None = None, names=(),
                        writer: str = "torch") -> None:
    """Rewrite a checkpoint's state files as the previous format wrote them (torch.save .pt
    files, no file records); ``poison``: every state file in ``names`` runs a command instead
    (written by ``torch.save`` or a bare ``pickle.dump``)."""
    for name in ("optimizer", "scheduler", "trainer", "rank0"):
        obj = ckpt_io.load_state(ckpt, name)
        for ext in (".json", ".safetensors"):
            (ckpt / f"{name}{ext}").unlink(missing_ok=True)
        if poison is not None and name in names:
            payload = {"state": _RunsCommand(poison)}
            if writer == "torch":
                torch.save(payload, ckpt / f"{name}.pt")
            else:
                with (ckpt / f"{name}.pt").open("wb") as f:
                    pickle.dump(payload, f)
        else:
            torch.save(obj, ckpt / f"{name}.pt")
    meta = json.loads((ckpt / "metadata.json").read_text())
    for key in ("files", "lineage"):
        meta.pop(key)
    meta["format_version"] = 1
    (ckpt / "metadata.json").write_text(json.dumps(meta))


def test_previous_format_checkpoint_resumes_exactly(tokens, saved, tmp_path):
    run = _copy_run(saved, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step4")
    _to_previous_format(run / "checkpoints" / "step2")
    train_run(tiny_config(tokens, **SAVE), run)  # resume=auto from the .pt files
    _same_metrics(read_metrics(saved), read_metrics(run))


@pytest.mark.parametrize("writer", ["torch", "pickle"])
def test_a_pickle_that_runs_code_is_refused_and_never_runs(tokens, saved, tmp_path, writer):
    run = _copy_run(saved, tmp_path / "run")
    marker = tmp_path / "marker"
    shutil.rmtree(run / "checkpoints" / "step4")
    step2 = run / "checkpoints" / "step2"
    _to_previous_format(step2, poison=marker, names=("scheduler",), writer=writer)
    with pytest.raises(ckpt_io.CheckpointError) as err:
        Trainer(tiny_config(tokens, **SAVE), run)
    msg = one_line(err)
    assert msg.startswith(f"{step2 / 'scheduler.pt'}: refused to load")
    assert writer == "pickle" or "it names posix.system" in msg
    assert f"model.init_from={step2}" in msg
    assert not marker.exists()


def test_eval_init_from_and_report_read_no_pickle(tokens, saved, tmp_path, monkeypatch):
    """twell-eval's loader, model.init_from and twell-report (with its checkpoint measurement)
    read only the safetensors and JSON files of a folder whose .pt files would run code."""
    import transformers

    from evals.models import load_checkpoint

    # the tokens-source run saved no tokenizer; the model loading is what is tested
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    from studies import report

    run = _copy_run(saved, tmp_path / "run")
    marker = tmp_path / "marker"
    for ckpt in ckpt_io.list_checkpoints(run):
        _to_previous_format(ckpt, poison=marker,
                            names=("optimizer", "scheduler", "trainer", "rank0"))
    step4 = run / "checkpoints" / "step4"
    model, _ = load_checkpoint(step4, tokenizer=str(step4))  # named: it holds none (patched)
    assert sum(p.numel() for p in model.parameters()) > 0
    t = Trainer(tiny_config(tokens, **{"model.init_from": str(step4)}), tmp_path / "init")
    t.close()
    assert report.main([str(run), "--out", str(tmp_path / "rep"), "--position-batches", "1"]) == 0
    assert not marker.exists()


# ------------------------------------------------------------------ 2 / 18: SIGTERM and SIGINT


def _cli(run_dir: Path, tokens: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "train", "data=tokens", f"data.paths=[{tokens}]",
            "data.vocab_size=64", "eval=disabled", "logging.wandb_mode=disabled",
            "trainer.num_threads=1", "trainer.val_sequences=4", "trainer.cpu=true",
            "model.vocab_size=64", "model.hidden_size=32", "model.intermediate_size=64",
            "model.num_heads=2", "model.num_layers=2", "model.seq_len=32",
            "trainer.global_batch=8", "trainer.micro_batch=4", "trainer.log_every=1",
            "trainer.val_every=0", "trainer.max_steps=60", "sparsity.l1_coeff=0.5",
            f"hydra.run.dir={run_dir}", *extra]


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def _interrupt(cmd: list[str], run_dir: Path, signum: int, after_step: int = 3):
    """Start ``cmd``, send ``signum`` once metrics.jsonl has ``after_step`` train lines, wait."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    metrics, t0 = run_dir / "metrics.jsonl", time.monotonic()
    while time.monotonic() - t0 < 240 and p.poll() is None:
        if metrics.is_file() and metrics.read_text().count('"kind": "train"') >= after_step:
            p.send_signal(signum)
            break
        time.sleep(0.02)
    out, err = p.communicate(timeout=240)
    return p.returncode, out, err


@pytest.mark.slow
@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_finishes_the_step_checkpoints_and_resumes_exactly(tokens, tmp_path, signum,
                                                                  code):
    run = tmp_path / "run"
    rc, out, err = _interrupt(_cli(run, tokens), run, signum)
    assert rc == code, err[-2000:]
    name = signal.Signals(signum).name
    line = next(ln for ln in out.splitlines() if ln.startswith(f"received {name} at step "))
    step = int(line.split(" at step ")[1].split(":")[0])
    ckpt = run / "checkpoints" / f"step{step}"
    assert (f"checkpoint written to {ckpt}; re-run the same command with hydra.run.dir={run} "
            "to resume") in line
    assert 3 <= step < 60 and ckpt_io.verify(ckpt) == []
    assert line in (run / "train.log").read_text() and "Traceback" not in err
    assert [r["step"] for r in read_metrics(run)] == list(range(1, step + 1))
    if signum != signal.SIGTERM:
        return
    r = subprocess.run(_cli(run, tokens), cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    straight = tmp_path / "straight"
    r = subprocess.run(_cli(straight, tokens), cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    _same_metrics(read_metrics(straight), read_metrics(run))
    assert read_metrics(run, "val")[-1]["val_loss"] == pytest.approx(
        read_metrics(straight, "val")[-1]["val_loss"], rel=1e-6)


def test_first_signal_is_recorded_and_a_second_stops_at_once():
    with StopSignals(notify=False) as s:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs between bytecodes of the main thread
        assert s.signum == signal.SIGTERM
        with pytest.raises(TrainingInterrupted) as err:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        assert err.value.signum == signal.SIGINT and err.value.exit_code == 130
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    with StopSignals(grace_s=30.0, notify=False) as s:  # a launcher's forwarded copy
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert s.signum == signal.SIGTERM


def test_a_stop_before_training_names_its_phase_and_restores_sigterm(tmp_path, monkeypatch):
    """Inside ``stops_before_training`` (twell-train until the trainer is set up) SIGTERM stops
    like Ctrl-C, and either leaves as SetupInterrupted naming what the run was doing: the
    innermost set-up function on the traceback, "loading the trainer" in an import, else
    "setting up"; SIGTERM's default action comes back after."""
    from train.interrupt import SetupInterrupted, stops_before_training

    def build_datamodule():
        build_corpus()

    def build_corpus():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    def attach_model():
        raise KeyboardInterrupt  # what Ctrl-C raises

    def ctrl_c():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)

    (tmp_path / "slow_module.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [(build_datamodule, signal.SIGTERM, "building the corpus"),
             (attach_model, signal.SIGINT, "building the model"),
             (lambda: __import__("slow_module"), signal.SIGINT, "loading the trainer"),
             (ctrl_c, signal.SIGINT, "setting up")]
    # Ctrl-C raises KeyboardInterrupt as in a terminal, also where pytest was started in the
    # background of a script (which starts it with SIGINT ignored)
    ctrl_c_was = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for call, signum, phase in cases:
            with pytest.raises(SetupInterrupted) as err, stops_before_training():
                call()
            assert (err.value.signum, err.value.phase) == (signum, phase)
            assert err.value.exit_code == 128 + signum
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, ctrl_c_was)


# ------------------------------------------------------------------ 3: disk full while saving


def test_full_disk_while_saving_is_one_line_and_keeps_the_previous_checkpoint(
        tokens, tmp_path, monkeypatch):
    """An injected ENOSPC while the step-4 checkpoint is written: the partial folder is removed,
    step2 stays intact, the error is one line naming the path, the full device and the resume."""
    run = tmp_path / "run"
    real = ckpt_io.save_state

    def full_at_step4(folder, name, obj):
        if Path(folder).name == ".step4.tmp" and name == "trainer":
            (Path(folder) / "trainer.json").write_text("{")  # a partial file, then the error
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "trainer.json"))
        return real(folder, name, obj)

    monkeypatch.setattr(ckpt_io, "save_state", full_at_step4)
    t = Trainer(tiny_config(tokens, **SAVE), run)
    with pytest.raises(ckpt_io.CheckpointError) as err:
        t.train()
    t.close()
    msg = one_line(err)
    assert "no space left on the device of" in msg and ".step4.tmp/trainer.json" in msg
    assert f"the previous checkpoint {run / 'checkpoints' / 'step2'} is intact" in msg
    assert f"re-run the same command with hydra.run.dir={run} to resume" in msg
    assert isinstance(err.value, ConfigError)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step2"]
    assert ckpt_io.verify(run / "checkpoints" / "step2") == []


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, check=False)
    return r.returncode == 0


@pytest.mark.slow
def test_full_tmpfs_exits_2_with_one_line(tokens, tmp_path):
    """A real full device (a 4 MiB tmpfs, root only): twell-train exits 2 with one line."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "4m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        run = disk / "run"
        r = subprocess.run(_cli(run, tokens, "trainer.max_steps=2"), cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=300,
                           check=False)
        assert r.returncode == 0, r.stderr[-2000:]
        step2 = run / "checkpoints" / "step2"
        size = sum(p.stat().st_size for p in step2.iterdir())
        free = shutil.disk_usage(disk).free
        with (disk / "ballast").open("wb") as f:  # leave room for logs, not for a checkpoint
            f.write(b"\0" * max(free - size // 3, 0))
        r = subprocess.run(_cli(run, tokens, "trainer.max_steps=4", f"trainer.resume={run}",
                                "trainer.resume_allow_changes=true"),
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
                           check=False)
        assert r.returncode == 2, r.stderr[-2000:]
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("CheckpointError: no space left on the device of "), last
        assert f"checkpoint {run / 'checkpoints' / 'step4'}" in last
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step2"]
        (disk / "ballast").unlink()
        assert ckpt_io.verify(step2) == []
    finally:
        subprocess.run(["umount", str(disk)], check=False)


# ------------------------------------------------------------------ 4 / 10: damaged checkpoints


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_damaged_newest_checkpoint_falls_back_with_a_warning(tokens, saved, tmp_path, capsys):
    run = _copy_run(saved, tmp_path / "run")
    step2, step4 = run / "checkpoints" / "step2", run / "checkpoints" / "step4"
    _truncate(step4 / "model.safetensors")
    warned = []
    assert ckpt_io.latest_checkpoint(run, warn=warned.append) == step2
    assert str(step4) in warned[0] and "model.safetensors has" in warned[0]
    t = Trainer(tiny_config(tokens, **SAVE), run)  # resume=auto
    assert t.step == 2 and t.last_ckpt == step2
    t.train()
    t.close()
    err = capsys.readouterr().err
    assert f"warning: skipping damaged checkpoint {step4}" in err
    _same_metrics(read_metrics(saved), read_metrics(run))  # steps 3-4 redone, the same
    assert ckpt_io.verify(step4) == []  # rewritten


def test_damaged_named_checkpoint_is_refused_in_one_line(tokens, saved, tmp_path):
    run = _copy_run(saved, tmp_path / "run")
    step4 = run / "checkpoints" / "step4"
    _truncate(step4 / "model.safetensors")
    with pytest.raises(ckpt_io.CheckpointError) as err:
        Trainer(tiny_config(tokens, **SAVE, **{"trainer.resume": str(step4)}), tmp_path / "b")
    msg = one_line(err)
    assert f"checkpoint {step4} is damaged or incomplete (model.safetensors has" in msg
    assert f"trainer.resume={run / 'checkpoints' / 'step2'}" in msg
    assert not (tmp_path / "b").exists()


def test_same_size_corruption_fails_the_checksum(saved, tmp_path):
    ckpt = _copy_run(saved, tmp_path / "run") / "checkpoints" / "step4"
    f = ckpt / "optimizer.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    assert ckpt_io.verify(ckpt, checksums=False) == []  # sizes alone cannot see it
    assert ckpt_io.verify(ckpt) == ["optimizer.safetensors fails its SHA-256 check"]


@pytest.mark.parametrize("previous_format", [False, True])
def test_missing_optimizer_or_trainer_state_names_it_and_the_ways_out(
        tokens, saved, tmp_path, previous_format):
    run = _copy_run(saved, tmp_path / "run")
    step2, step4 = run / "checkpoints" / "step2", run / "checkpoints" / "step4"
    if previous_format:
        _to_previous_format(step4)
        (step4 / "trainer.pt").unlink()
        want = "trainer.pt (trainer state"
    else:
        (step4 / "optimizer.json").unlink()
        (step4 / "optimizer.safetensors").unlink()
        want = "optimizer.json (optimizer state) is missing"
    with pytest.raises(ckpt_io.CheckpointError) as err:
        Trainer(tiny_config(tokens, **SAVE, **{"trainer.resume": str(step4)}), tmp_path / "b")
    msg = one_line(err)
    assert want in msg and f"trainer.resume={step2}" in msg
    assert f"model.init_from={step4}" in msg  # the weights are intact: a weights-only start
    t = Trainer(tiny_config(tokens, **SAVE), run)  # auto: the older complete one
    assert t.step == 2
    t.close()


# ------------------------------------------------------------------ 7 / 18: branches


BRANCH = {**SAVE, "sparsity.l1_coeff": 1e-3}


def test_branch_into_the_run_dir_is_refused_and_run_dir_kept(tokens, saved, tmp_path):
    run = _copy_run(saved, tmp_path / "run")
    step2 = run / "checkpoints" / "step2"
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError) as err:
        Trainer(tiny_config(tokens, **BRANCH, **{"trainer.resume": str(step2)}), run)
    msg = one_line(err)
    assert "step4" in msg and "new hydra.run.dir" in msg and "trainer.resume=auto" in msg
    with pytest.raises(ConfigError, match="trainer.resume=never: .* holds checkpoints"):
        Trainer(tiny_config(tokens, **SAVE, **{"trainer.resume": "never"}), run)
    assert [c.name for c in ckpt_io.list_checkpoints(run)] == ["step2", "step4"]
    assert (run / "metrics.jsonl").read_text() == before


def test_branch_in_its_own_run_dir_keeps_lineage_and_resumes_itself(tokens, saved, tmp_path):
    run = _copy_run(saved, tmp_path / "run")
    step2 = run / "checkpoints" / "step2"
    branch_cfg = {**BRANCH, "trainer.resume": str(step2), "trainer.save_every": 1,
                  "trainer.keep_last": 1}
    straight = train_run(tiny_config(tokens, **branch_cfg), tmp_path / "straight")
    t = train_run(tiny_config(tokens, **branch_cfg), tmp_path / "b", stop_at_step=3)
    b = tmp_path / "b"
    meta = ckpt_io.read_metadata(b / "checkpoints" / "step3")
    assert meta["lineage"]["parent"]["checkpoint"] == str(step2.resolve())
    assert meta["lineage"]["parent"]["lineage"] == ckpt_io.lineage_id(step2)
    assert meta["lineage"]["id"] != ckpt_io.lineage_id(step2)
    # the advice continues the branch's own newest checkpoint, not the folder it started from
    assert t.resume_advice() == (f"re-run the same command with hydra.run.dir={b} "
                                 "trainer.resume=auto (instead of "
                                 f"trainer.resume={step2}) to resume from "
                                 f"{b / 'checkpoints' / 'step3'}")
    with pytest.raises(ConfigError, match="pass trainer.resume=auto"):  # the old advice's run
        Trainer(tiny_config(tokens, **branch_cfg), b)
    train_run(tiny_config(tokens, **{**branch_cfg, "trainer.resume": "auto"}), b)
    _same_metrics(read_metrics(tmp_path / "straight"), read_metrics(b))
    assert [c.name for c in ckpt_io.list_checkpoints(run)] == ["step2", "step4"]  # untouched
    assert ckpt_io.lineage_id(b / "checkpoints" / "step4") == meta["lineage"]["id"]
    assert straight.step == 4


def test_rotation_deletes_only_its_own_lineage(tmp_path):
    a, b = ckpt_io.new_lineage(), ckpt_io.new_lineage()
    for step, lin in ((1, a), (2, b), (3, a), (4, a)):
        tmp, final = ckpt_io.begin(tmp_path, step)
        (tmp / "model.safetensors").write_bytes(b"x" * step)
        ckpt_io.finish(tmp, final, step=step, world_size=1, keep_last=2, lineage=lin)
    assert [c.name for c in ckpt_io.list_checkpoints(tmp_path)] == ["step2", "step3", "step4"]
    assert ckpt_io.lineage_id(tmp_path / "checkpoints" / "step2") == b["id"]


# ------------------------------------------------------------------ 8: init_from source moved


def test_resuming_an_init_from_run_does_not_need_the_source(tokens, saved, tmp_path):
    src = _copy_run(saved, tmp_path / "src") / "checkpoints" / "step4"
    over = {"model.init_from": str(src), "trainer.max_steps": 4, "trainer.save_every": 2}
    train_run(tiny_config(tokens, **over), tmp_path / "straight")
    train_run(tiny_config(tokens, **over), tmp_path / "split", stop_at_step=2)
    src.rename(tmp_path / "moved")
    t = train_run(tiny_config(tokens, **over), tmp_path / "split")
    assert t.step == 4 and t.init_info["init_from"] == str(src)  # the record of the run's start
    _same_metrics(read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split"))


# ------------------------------------------------------------------ 14: atomic JSON


@pytest.mark.parametrize("name", ["summary.json", "metrics.jsonl", "config.yaml"])
def test_run_files_are_replaced_atomically(tokens, tmp_path, monkeypatch, name):
    """A rewrite that fails half-way (a full disk) leaves the previous file whole: summary.json
    of a finished run re-summarised, metrics.jsonl and config.yaml rewritten by a resume."""
    run = tmp_path / "run"
    train_run(tiny_config(tokens, **{"trainer.max_steps": 2}), run)
    before = (run / name).read_text()
    real = os.fdopen

    class HalfThenFull:  # the temp file of a write_atomic: half the text, then a full disk
        def __init__(self, f, path):
            self.f, self.path = f, path

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)

    def fdopen(fd, *a, **kw):
        path = os.readlink(f"/proc/self/fd/{fd}")
        f = real(fd, *a, **kw)
        return HalfThenFull(f, path) if name in Path(path).name else f

    monkeypatch.setattr(os, "fdopen", fdopen)
    with pytest.raises(OSError):  # finished: the resume rewrites the files, train re-summarises
        train_run(tiny_config(tokens, **{"trainer.max_steps": 2}), run)
    assert (run / name).read_text() == before
    assert [p.name for p in run.iterdir() if name in p.name] == [name]  # no temp file left


# ------------------------------------------------------------------ 23 / 24: closing line, progress


def test_closing_line_without_dead_window_and_tokens_per_s_of_the_last_segment(tokens, tmp_path):
    over = {"trainer.max_steps": 4, "trainer.save_every": 2,
            "sparsity.dead_window_tokens": 10**9}  # no dead-unit window completes
    run = tmp_path / "run"
    train_run(tiny_config(tokens, **over), run, stop_at_step=2)
    time_at_2 = ckpt_io.load_state(run / "checkpoints" / "step2", "trainer")["train_time"]
    t = Trainer(tiny_config(tokens, **over), run)
    s = t.train()
    t.close()
    assert s["dead_pct"] is None
    line = summary_line(s)
    assert "| dead n/a |" in line and "n/a%" not in line
    # independent: 2 steps of 8 x 32 tokens over the time the trainer state added since step 2
    assert s["tokens_per_s"] == pytest.approx(2 * 8 * 32 / (s["train_time_s"] - time_at_2),
                                              rel=1e-9)
    assert s["tokens_per_s_all"] == pytest.approx(4 * 8 * 32 / s["train_time_s"], rel=1e-9)
    assert s["segment_steps"] == [3, 4]
    assert line.endswith(f"{s['tokens_per_s']:.0f} tok/s (steps 3-4)")
    again = Trainer(tiny_config(tokens, **over), run)  # finished: the checkpoint's segment
    s2 = again.train()
    again.close()
    assert s2["segment_steps"] == [3, 4] and s2["tokens_per_s"] == pytest.approx(
        s["tokens_per_s"], rel=1e-9)


def test_progress_without_a_terminal_is_a_line_per_interval(tokens, tmp_path, capfd):
    t = Trainer(tiny_config(tokens, **{"trainer.max_steps": 4, "trainer.log_every": 2,
                                       "trainer.progress": True}), tmp_path / "run")
    assert not t.show_bars  # pytest's stderr is no terminal
    t.train()
    t.close()
    out, err = capfd.readouterr()
    lines = out.splitlines()
    assert "\r" not in err and "it/s" not in err and "step/s" not in err  # no tqdm bar
    assert lines[0].startswith(f"run dir {tmp_path / 'run'}: loading data.source=tokens")
    assert any(ln.startswith("model: ") and "parameters" in ln for ln in lines[:3])
    steps = [ln for ln in lines if ln.startswith("step ") and ": loss " in ln]
    assert len(steps) == 2 and steps[0].endswith(" | step 2/4, eta " + steps[0].split()[-1])


# ------------------------------------------------------------------ rewriting an existing step{N}


def _weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


def _files(ckpt: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(ckpt.iterdir())}


@pytest.mark.parametrize("fail", [None, "write", "swap"])
def test_saving_an_existing_step_replaces_it_whole_or_not_at_all(tokens, saved, tmp_path,
                                                                 monkeypatch, fail):
    """Saving step4 again where step4 exists (the finished run's trainer, weights changed): while
    the new folder is written the old step4 is complete and unchanged; on success step4 holds
    the new weights with verified metadata and nothing else is left; a failure while writing
    the files or while swapping the folders leaves the old step4 byte for byte."""
    run = _copy_run(saved, tmp_path / "run")
    ckpts = run / "checkpoints"
    step4 = ckpts / "step4"
    old_files, old_w = _files(step4), _weights(step4)
    t = Trainer(tiny_config(tokens, **SAVE), run)  # finished: resumed at step 4
    assert t.step == 4
    model = t.acc.unwrap_model(t.model)
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)
    real_save, real_rename = ckpt_io.save_state, Path.rename
    checked = []

    def save_state(folder, name, obj):
        if Path(folder).name == ".step4.tmp" and name == "trainer":  # the last state file
            assert _files(step4) == old_files and ckpt_io.verify(step4) == []
            checked.append(name)
            if fail == "write":
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(Path(folder) / name))
        return real_save(folder, name, obj)

    def rename(self, target):
        if fail == "swap" and self.name == ".step4.tmp":
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(self))
        return real_rename(self, target)

    monkeypatch.setattr(ckpt_io, "save_state", save_state)
    monkeypatch.setattr(Path, "rename", rename)
    try:
        if fail is None:
            assert t.save_checkpoint() == step4
        else:
            with pytest.raises(OSError, match=os.strerror(errno.EIO)):
                t.save_checkpoint()
    finally:
        t.close()
    assert checked == ["trainer"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step2", "step4"]  # no .tmp / .old left
    assert ckpt_io.verify(ckpts / "step2") == []
    if fail is not None:
        assert _files(step4) == old_files
        return
    assert ckpt_io.verify(step4, checksums=True) == []
    meta = ckpt_io.read_metadata(step4)
    assert meta["step"] == 4 and sorted(meta["files"]) == sorted(
        p.name for p in step4.iterdir() if p.name != "metadata.json")
    new_w = _weights(step4)
    torch.testing.assert_close(new_w["model.norm.weight"], old_w["model.norm.weight"] + 0.5,
                               rtol=0, atol=1e-6)
    assert all(torch.equal(v, old_w[k]) for k, v in new_w.items() if k != "model.norm.weight")
    assert ckpt_io.latest_checkpoint(run, checksums=True) == step4
