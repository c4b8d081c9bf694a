"""Run-directory rules of the trainer: resume paths and config changes, the run-dir
lock, the learning-rate warmup, validation counted in sequences, data errors in one line, and
the run's text log. Tiny fp32 CPU runs of a few steps, validation and evals off unless tested."""

import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tests.train_utils import one_line, read_metrics, tiny_config, train_run, write_tokens
from train.config import ConfigError
from train.data import DataConfig, DataError, build_datamodule
from train.trainer import Trainer


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "train.bin", n_tokens=8000)


def _cosine_lr(step, lr, warmup, max_steps, min_ratio=0.0):
    """Independent reference: linear warmup step/warmup (step 1 = lr/warmup), then cosine from
    the peak at step `warmup` to min_ratio * lr at step max_steps + 1 (one past the last)."""
    if step <= warmup:
        return lr * step / warmup
    p = (step - warmup) / (max_steps - warmup + 1)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


# ------------------------------------------------------------------ 17: warmup starts at step 1


@pytest.mark.parametrize("min_ratio", [0.0, 0.1])
def test_first_step_runs_at_its_warmup_share(tokens, tmp_path, min_ratio):
    """Step s <= warmup_steps runs at lr * s / warmup (step 1 is not wasted at lr 0), then the
    cosine decays; the last step is not wasted either (above min_lr_ratio * lr, also at 0)."""
    cfg = tiny_config(tokens, **{"trainer.max_steps": 7, "optim.warmup_steps": 4,
                                 "optim.min_lr_ratio": min_ratio})
    train_run(cfg, tmp_path / "run")
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run")]
    assert lrs[:4] == pytest.approx([3e-3 / 4, 3e-3 / 2, 3e-3 * 3 / 4, 3e-3], rel=1e-12)
    # steps 5-7: cosine over 4 intervals, its end (min_ratio) one step past the last
    for s, lr in zip((5, 6, 7), lrs[4:]):
        c = 0.5 * (1 + math.cos(math.pi * (s - 4) / 4))
        assert lr == pytest.approx(3e-3 * (min_ratio + (1 - min_ratio) * c), rel=1e-12), s
    assert lrs[-1] > min_ratio * 3e-3 + 1e-4
    assert lrs == pytest.approx([_cosine_lr(s, 3e-3, 4, 7, min_ratio) for s in range(1, 8)],
                                rel=1e-12)


# ------------------------------------------------------------------ 16: validation in sequences


def test_validation_loss_does_not_depend_on_the_micro_batch(tokens, tmp_path):
    """Same weights (same seed, no step), micro-batch 4 vs 8 (and 3: a partial last batch): the
    same trainer.val_sequences held-out sequences and the same token-weighted CE, equal to a
    one-batch reference over the first 12 validation blocks."""
    vals = {}
    for micro in (3, 4, 8):
        cfg = tiny_config(tokens, **{"trainer.global_batch": 24, "trainer.micro_batch": micro,
                                     "trainer.val_sequences": 12})
        t = Trainer(cfg, tmp_path / f"m{micro}")
        vals[micro] = t.validate()
        if micro == 8:
            dm, T = t.data, cfg.model.seq_len
            ids = torch.stack([torch.from_numpy(dm.val_stream.read(i * T, T).astype(np.int64))
                               for i in range(12)])
            with torch.no_grad():
                logits = t.model(input_ids=ids).logits.double()
            ref = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()
        t.close()
    for micro, v in vals.items():
        assert v["val_sequences"] == 12, micro
        assert v["val_loss"] == pytest.approx(ref, rel=1e-6, abs=0), micro
        assert v["val_l0"] == pytest.approx(vals[8]["val_l0"], rel=1e-6), micro


def test_old_val_batches_key_is_refused_with_the_new_name():
    from train.main import check_overrides

    with pytest.raises(ConfigError) as err:
        check_overrides(["trainer.val_batches=2"])
    assert "trainer.val_sequences" in one_line(err)


# ------------------------------------------------------------------ 6: resume paths


def test_resume_path_that_does_not_exist_says_so(tokens, tmp_path):
    nope = tmp_path / "nope" / "checkpoints" / "step3"
    with pytest.raises(ConfigError) as err:
        Trainer(tiny_config(tokens, **{"trainer.resume": str(nope)}), tmp_path / "r")
    msg = one_line(err)
    assert "does not exist" in msg and str(nope) in msg
    assert not (tmp_path / "r").exists()  # a refused run leaves no directory


def test_resume_from_a_run_dir_takes_its_newest_complete_checkpoint(tokens, tmp_path):
    over = {"trainer.max_steps": 4, "trainer.save_every": 1, "trainer.keep_last": 4}
    train_run(tiny_config(tokens, **over), tmp_path / "a", stop_at_step=3)
    (tmp_path / "a" / "checkpoints" / ".step4.tmp").mkdir()  # an incomplete one: ignored
    t = Trainer(tiny_config(tokens, **over, **{"trainer.resume": str(tmp_path / "a")}),
                tmp_path / "b")
    assert t.step == 3 and t.last_ckpt.name == "step3"
    t.close()
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError) as err:
        Trainer(tiny_config(tokens, **{"trainer.resume": str(empty)}), tmp_path / "c")
    assert "no complete checkpoint" in one_line(err)


# ------------------------------------------------------------------ 12: a different run's directory


def test_auto_resume_of_a_changed_config_needs_an_explicit_path(tokens, tmp_path):
    run = tmp_path / "run"
    base = {"trainer.max_steps": 3}
    train_run(tiny_config(tokens, **base), run, stop_at_step=2)  # checkpoint step2 (the last step)
    with pytest.raises(ConfigError) as err:
        Trainer(tiny_config(tokens, **base, **{"sparsity.l1_coeff": 0.1}), run)
    msg = one_line(err)
    assert "sparsity.l1_coeff" in msg and f"trainer.resume={run}" in msg
    assert "hydra.run.dir" in msg
    # execution settings are safe to change: resumed without a word beyond the note
    t = Trainer(tiny_config(tokens, **base, **{"ffn.impl": "auto", "trainer.log_every": 5,
                                               "trainer.micro_batch": 8}), run)
    assert t.step == 2
    t.close()
    # the explicit path continues the run with the new L1 coefficient
    t = Trainer(tiny_config(tokens, **base, **{"sparsity.l1_coeff": 0.1,
                                               "trainer.resume": str(run)}), run)
    assert t.step == 2 and t.cfg.sparsity.l1_coeff == 0.1
    t.close()


def test_resume_on_other_data_is_one_line(tokens, tmp_path):
    other = write_tokens(tmp_path / "other.bin", n_tokens=8000, seed=1)
    train_run(tiny_config(tokens, **{"trainer.max_steps": 2}), tmp_path / "a")
    cfg = tiny_config(other, **{"trainer.max_steps": 2,
                                "trainer.resume": str(tmp_path / "a")})
    with pytest.raises(ConfigError) as err:
        Trainer(cfg, tmp_path / "b")
    msg = one_line(err)
    assert "data" in msg and "fingerprint" in msg and "new run" in msg


# ------------------------------------------------------------------ 11: optimizer changes on resume


def test_resume_refuses_optimizer_changes_unless_asked(tokens, tmp_path):
    run = tmp_path / "run"
    train_run(tiny_config(tokens, **{"trainer.max_steps": 2}), run)
    changed = {"optim.lr": 1e-2, "optim.weight_decay": 0.5, "trainer.max_steps": 3,
               "trainer.resume": str(run)}
    with pytest.raises(ConfigError) as err:
        Trainer(tiny_config(tokens, **changed), run)
    msg = one_line(err)
    for key in ("optim.lr", "optim.weight_decay", "trainer.max_steps",
                "trainer.resume_allow_changes=true"):
        assert key in msg, key


def test_resume_applies_new_optimizer_values_exactly(tokens, tmp_path):
    """2 steps of (lr 3e-3, warmup 2, max 4), then resume asking for lr 1e-2, wd 0.5,
    betas (0.8, 0.9), eps 1e-6, warmup 1, max 6, min ratio 0.2: steps 3-6 run at the new
    schedule's values for steps 3-6 and the param groups carry the new values."""
    run = tmp_path / "run"
    train_run(tiny_config(tokens, **{"trainer.max_steps": 4}), run, stop_at_step=2)
    new = {"optim.lr": 1e-2, "optim.weight_decay": 0.5, "optim.betas": [0.8, 0.9],
           "optim.eps": 1e-6, "optim.warmup_steps": 1, "optim.min_lr_ratio": 0.2,
           "trainer.max_steps": 6, "trainer.resume": str(run),
           "trainer.resume_allow_changes": True}
    t = Trainer(tiny_config(tokens, **new), run)
    assert t.step == 2
    groups = t.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    assert all(g["initial_lr"] == 1e-2 and tuple(g["betas"]) == (0.8, 0.9) and g["eps"] == 1e-6
               for g in groups)
    assert t.scheduler.base_lrs == [1e-2, 1e-2]
    t.train()
    t.close()
    lrs = {r["step"]: r["lr"] for r in read_metrics(run)}
    assert lrs[1] == pytest.approx(_cosine_lr(1, 3e-3, 2, 4), rel=1e-12)  # the old run's steps
    for s in range(3, 7):
        assert lrs[s] == pytest.approx(_cosine_lr(s, 1e-2, 1, 6, 0.2), rel=1e-12), s


# ------------------------------------------------------------------ 13: one process per run dir


def test_second_trainer_in_a_locked_run_dir_fails_at_once(tokens, tmp_path):
    run = tmp_path / "run"
    a = Trainer(tiny_config(tokens), run)
    with pytest.raises(ConfigError) as err:
        Trainer(tiny_config(tokens), run)
    msg = one_line(err)
    assert f"PID {os.getpid()}" in msg and ".lock" in msg
    a.close()  # released: the next one may start
    Trainer(tiny_config(tokens), run).close()


def test_run_dir_locked_by_another_process(tokens, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    script = ("import fcntl, os, time\n"
              f"f = open({str(run / '.lock')!r}, 'a+')\n"
              "fcntl.flock(f, fcntl.LOCK_EX)\n"
              "f.truncate(0); f.write(str(os.getpid())); f.flush()\n"
              "print('locked', flush=True)\n"
              "time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as err:
            Trainer(tiny_config(tokens), run)
        assert f"PID {holder.pid}" in one_line(err)
        assert time.monotonic() - t0 < 30  # fails at once, does not wait for the lock
    finally:
        holder.kill()
        holder.wait()
    assert run.is_dir()  # a directory it did not create is left alone


# ------------------------------------------------------------------ 15: data errors in one line


@pytest.mark.parametrize("n_tokens, seq_len, val_fraction, what", [
    (0, 32, 0.01, "empty"), (0, 32, 0.0, "empty"), (300, 256, 0.01, "model.seq_len"),
    (8000, 200_000, 0.01, "model.seq_len"), (8000, 200_000, 0.0, "model.seq_len")])
def test_too_little_token_data_is_a_data_error(tmp_path, n_tokens, seq_len, val_fraction, what):
    path = tmp_path / "t.bin"
    (np.arange(n_tokens) % 50).astype("<u2").tofile(path)
    cfg = DataConfig(source="tokens", paths=[str(path)], val_fraction=val_fraction)
    with pytest.raises(DataError) as err:
        build_datamodule(cfg, seq_len=seq_len, micro_batch=2, seed=0)
    msg = one_line(err)
    assert str(path) in msg and what in msg, msg


def test_bad_jsonl_inputs_are_data_errors(tmp_path):
    from train.data.build import _files_docs

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a fine first document"}\n{"text": broken\n')
    for path, what in ((empty, "no documents"), (blank, "no documents"), (bad, "not valid")):
        with pytest.raises(DataError) as err:
            list(_files_docs(str(path), "text", tmp_path / "cache"))
        msg = one_line(err)
        assert str(path) in msg and what in msg, msg


def test_token_ids_beyond_the_model_vocab_name_the_files_not_a_tokenizer(tmp_path):
    path = tmp_path / "big_ids.bin"
    ids = np.full(4000, 7, dtype=np.uint16)
    ids[100] = 60000
    ids.tofile(path)
    cfg = tiny_config(path, **{"data.vocab_size": None})
    with pytest.raises(ConfigError) as err:
        Trainer(cfg, tmp_path / "r")
    msg = one_line(err)
    assert "tokenizer" not in msg and "data.paths" in msg and "60000" in msg
    assert "model.vocab_size>=60001" in msg


# ------------------------------------------------------------------ 4: the run's text log


def test_run_writes_its_text_log_and_a_summary_line(tokens, tmp_path):
    from train.trainer import summary_line

    t = Trainer(tiny_config(tokens, **{"trainer.max_steps": 2, "trainer.val_every": 2,
                                       "trainer.val_sequences": 2}), tmp_path / "run")
    summary = t.train()
    t.close()
    log = (tmp_path / "run" / "train.log").read_text().splitlines()
    assert any("step 2: loss" in ln for ln in log) and any("val_loss" in ln for ln in log)
    line = summary_line(summary)
    assert "\n" not in line and f"train CE {summary['final_train_ce']:.4f}" in line
    assert f"val loss {summary['val_loss']:.4f}" in line and "tok/s" in line
    assert "eval mean n/a" in line
