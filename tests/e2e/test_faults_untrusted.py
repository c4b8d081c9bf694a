"""Everything a run folder holds is untrusted: checkpoint names, hashes, links, YAML
tags, weights (NaN, integer, other shapes), custom code asked for by a config, and what every
loader that picks "the newest checkpoint" takes; plus out-of-memory and stop signals that lose
no finished step. Tiny fp32 CPU runs, in-process unless the CLI's exit code is what is tested."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.train_utils import one_line, read_metrics, tiny_config, train_run, write_tokens
from train import checkpoint as ckpt_io
from train.config import ConfigError
from train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("loss", "ce", "l1", "l0_mean", "grad_norm", "lr")
SAVE = {"trainer.max_steps": 4, "trainer.save_every": 2, "trainer.keep_last": 3,
        "sparsity.l1_coeff": 0.5}
W0 = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "train.bin", n_tokens=8000)


@pytest.fixture(scope="module")
def saved(tokens, tmp_path_factory):
    """A finished 4-step run with checkpoints step2 and step4 (copy it before changing it)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    train_run(tiny_config(tokens, **SAVE), run)
    return run


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


def _same_metrics(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        for key in KEYS:
            assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-6), (ra["step"], key)


def _rerecord(ckpt: Path) -> None:
    """Record the folder's current files in its metadata.json, as if it had been saved so: the
    damage under test then passes every size and SHA-256 check."""
    meta = json.loads((ckpt / "metadata.json").read_text())
    meta["files"] = ckpt_io.file_records(ckpt)
    (ckpt / "metadata.json").write_text(json.dumps(meta))


def _edit_weights(ckpt: Path, **tensors) -> None:
    """Replace tensors of ``ckpt``'s model.safetensors (names with '/' for '.') and re-record."""
    f = ckpt / "model.safetensors"
    sd = load_file(str(f))
    sd.update({k.replace("/", "."): v for k, v in tensors.items()})
    save_file(sd, str(f), metadata={"format": "pt"})
    _rerecord(ckpt)


def _flip_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))


def _no_tokenizer(monkeypatch):
    """The tokens-source runs save no tokenizer; twell-eval's model loading is what is tested
    (its loader, and its check that ``tokenizer=`` names a tokenizer folder, stubbed)."""
    import evals.models

    monkeypatch.setattr("twell.hf.auto_tokenizer", lambda *a, **k: None)
    monkeypatch.setattr("twell.hf.check_tokenizer_source", lambda value, key: str(value))
    return evals.models


# ------------------------------------------------------------------ 1: the newest, verified


def test_every_newest_picker_skips_a_checkpoint_failing_its_sha256(tokens, saved, tmp_path,
                                                                    capsys, monkeypatch):
    """step4's model.safetensors altered at the same size: twell-eval checkpoint=<run dir>,
    the trainer's picker (reports, studies) and resume=auto all take step2, each with a warning
    naming step4; step4 named directly is refused in one line (exit 2)."""
    from evals.cli import main

    models = _no_tokenizer(monkeypatch)
    run = _copy(saved, tmp_path / "run")
    step2, step4 = run / "checkpoints" / "step2", run / "checkpoints" / "step4"
    _flip_byte(step4 / "model.safetensors")
    assert models.resolve_checkpoint(run) == step2
    err = capsys.readouterr().err
    assert f"skipping damaged checkpoint {step4}" in err and "SHA-256" in err
    assert ckpt_io.latest_checkpoint(run) == step2  # report.py, relufy.py, scaling.py
    assert main([f"checkpoint={step4}", "tasks=arc_easy", "limit=1", "progress=false",
                 f"out={tmp_path / 'out'}"]) == 2
    line = capsys.readouterr().err.strip().splitlines()
    assert len(line) == 1 and "model.safetensors fails its SHA-256 check" in line[0]
    assert not (tmp_path / "out").exists()
    t = Trainer(tiny_config(tokens, **SAVE), run)  # resume=auto
    assert t.step == 2 and t.last_ckpt == step2
    t.close()


# ------------------------------------------------------------------ 5: names and links


def test_a_checkpoint_renamed_to_a_later_step_is_never_taken_for_it(tokens, tmp_path, capsys):
    """step2's files copied as step99 into a run stopped at step4: resume=auto continues step4
    (not step 2 again), warning about step99; rotation keeps step99 and deletes the real old
    checkpoint only; twell-eval's picker takes the real newest; the run equals a straight one."""
    from evals.models import resolve_checkpoint

    over = {"trainer.max_steps": 8, "trainer.save_every": 2, "trainer.keep_last": 2}
    straight = train_run(tiny_config(tokens, **over), tmp_path / "straight")
    run = tmp_path / "run"
    train_run(tiny_config(tokens, **over), run, stop_at_step=4)
    ckpts = run / "checkpoints"
    shutil.copytree(ckpts / "step2", ckpts / "step99")
    t = Trainer(tiny_config(tokens, **over), run)
    assert t.step == 4 and t.last_ckpt == ckpts / "step4"
    assert "its name says step 99 but metadata.json records step 2" in capsys.readouterr().err
    t.train()
    t.close()
    assert sorted(p.name for p in ckpts.iterdir()) == ["step6", "step8", "step99"]
    assert resolve_checkpoint(run) == ckpts / "step8"
    _same_metrics(read_metrics(tmp_path / "straight"), read_metrics(run))
    assert straight.step == 8
    # the same files with metadata.json edited to claim step 99: the trainer state says 2
    meta = ckpt_io.read_metadata(ckpts / "step99")
    meta["step"] = 99
    (ckpts / "step99" / "metadata.json").write_text(json.dumps(meta))
    assert ckpt_io.verify(ckpts / "step99") == [
        "trainer.json records step 2, metadata.json step 99"]


def test_unrecorded_files_and_links_in_a_checkpoint_fail_it(saved, tmp_path):
    run = _copy(saved, tmp_path / "run")
    step4 = run / "checkpoints" / "step4"
    (step4 / "model.safetensors.index.json").write_text("{}")  # would redirect the loader
    (step4 / "tokenizer.json").symlink_to(tmp_path / "elsewhere.json")
    problems = ckpt_io.verify(step4)
    assert "model.safetensors.index.json is not recorded in metadata.json (added after the " \
           "save)" in problems
    assert "tokenizer.json is a symbolic link" in problems
    assert ckpt_io.latest_checkpoint(run) == run / "checkpoints" / "step2"


@pytest.mark.parametrize("name", ["metrics.jsonl", "train.log", "config.yaml", ".lock",
                                  "summary.json", "checkpoints/step7"])
def test_a_link_in_the_run_dir_is_refused_and_its_target_untouched(tokens, tmp_path, name):
    """A fresh run in a folder where one of the files it writes is a symbolic link elsewhere:
    one line naming it, before anything is written (no lock, no log), the target unchanged."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    (run / name).parent.mkdir(parents=True)
    (run / name).symlink_to(victim)
    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(ckpt_io.CheckpointError) as err:
        Trainer(tiny_config(tokens, **{"trainer.max_steps": 1}), run)
    msg = one_line(err)
    assert msg.startswith(f"{run / name} is a symbolic link (to {victim})")
    assert "new hydra.run.dir" in msg and isinstance(err.value, ConfigError)
    assert victim.read_text() == "precious\n" and sorted(p.name for p in run.iterdir()) == before


def test_run_files_are_written_without_following_links(tmp_path):
    """The writers themselves (a link made after the start check): an append or a truncation
    through a link, a FIFO (without blocking) and a folder are refused; an atomic replace
    replaces the link, never its target."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(victim)
    for mode in ("a", "w"):
        with pytest.raises(ckpt_io.CheckpointError, match="is a symbolic link"):
            ckpt_io.open_run_file(link, mode)
    os.mkfifo(tmp_path / "train.log")
    t0 = time.monotonic()
    with pytest.raises(ckpt_io.CheckpointError, match="not a regular file"):
        ckpt_io.open_run_file(tmp_path / "train.log")
    assert time.monotonic() - t0 < 5
    (tmp_path / ".summary.json.tmp").symlink_to(victim)  # a planted temp file
    ckpt_io.write_atomic(tmp_path / "summary.json", "{}")
    ckpt_io.write_atomic(link, "new\n")
    assert victim.read_text() == "precious\n" and not link.is_symlink()
    assert link.read_text() == "new\n" and (tmp_path / "summary.json").read_text() == "{}"
    with open(tmp_path / "ok.log", "w") as f:
        f.write("a\n")
    with ckpt_io.open_run_file(tmp_path / "ok.log") as f:
        f.write("b\n")
    assert (tmp_path / "ok.log").read_text() == "a\nb\n"


def _cli(run_dir: Path, tokens: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "train", "data=tokens", f"data.paths=[{tokens}]",
            "data.vocab_size=64", "eval=disabled", "logging.wandb_mode=disabled",
            "trainer.num_threads=1", "trainer.val_sequences=4", "trainer.cpu=true",
            "model.vocab_size=64", "model.hidden_size=32", "model.intermediate_size=64",
            "model.num_heads=2", "model.num_layers=2", "model.seq_len=32",
            "trainer.global_batch=8", "trainer.micro_batch=4", "trainer.max_steps=2",
            f"hydra.run.dir={run_dir}", *extra]


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def test_the_cli_refuses_a_linked_train_log_and_writes_nothing_through_it(tokens, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").symlink_to(victim)
    r = subprocess.run(_cli(run, tokens), cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"CheckpointError: {run / 'train.log'} is a symbolic link")
    assert victim.read_text() == "precious\n" and "Traceback" not in r.stderr


# ------------------------------------------------------------------ 2 / 10: what the weights hold


@pytest.mark.parametrize("damage", ["nan", "int32", "shape", "optimizer_nan"])
def test_a_checkpoint_whose_tensors_do_not_fit_is_refused_in_one_line(tokens, saved, tmp_path,
                                                                       damage):
    """step4 re-recorded (its hashes pass) with one NaN weight, a weight stored as int32, a
    weight of another shape, or a NaN Adam moment: resuming it names the tensor and the older
    intact checkpoint; twell-eval's loader refuses the same weights."""
    from evals.models import load_checkpoint
    from twell.hf import CheckpointError, load_model

    run = _copy(saved, tmp_path / "run")
    step2, step4 = run / "checkpoints" / "step2", run / "checkpoints" / "step4"
    w = load_file(str(step4 / "model.safetensors"))[W0]
    if damage == "nan":
        bad = w.clone()
        bad[3, 1] = float("nan")
        _edit_weights(step4, **{W0: bad})
        want = f"{W0} (1 of {w.numel()}) holds NaN or inf"
    elif damage == "int32":
        _edit_weights(step4, **{W0: (w * 100).to(torch.int32)})
        want = f"{W0} (int32) is not stored as a floating-point number"
    elif damage == "shape":
        _edit_weights(step4, **{W0: w[:-1].clone()})
        want = f"other shape {W0} {tuple(w[:-1].shape)} (model: {tuple(w.shape)})"
    else:
        opt = ckpt_io.load_state(step4, "optimizer")
        opt["state"][0]["exp_avg"][0, 0] = float("inf")
        ckpt_io.save_state(step4, "optimizer", opt)
        _rerecord(step4)
        want = "optimizer state does not fit the model (parameter 0 exp_avg: NaN or inf values)"
    with pytest.raises(ckpt_io.CheckpointError) as err:
        Trainer(tiny_config(tokens, **SAVE, **{"trainer.resume": str(step4)}), tmp_path / "b")
    msg = one_line(err)
    assert want in msg and f"trainer.resume={step2}" in msg, msg
    if damage == "optimizer_nan":
        return
    for load in (load_model, lambda d: load_checkpoint(d, tokenizer=str(d))):
        with pytest.raises(CheckpointError) as err:
            load(step4)
        assert want in one_line(err)


def test_a_checkpoint_altered_to_another_step_is_refused_by_its_records(tokens, saved,
                                                                       tmp_path):
    """step4's trainer state and metadata.json both edited to step 3 (and re-recorded): the
    folder's name no longer matches what it records, so resuming it by name is refused with the
    way out, and auto takes step2."""
    run = _copy(saved, tmp_path / "run")
    step2, step4 = run / "checkpoints" / "step2", run / "checkpoints" / "step4"
    state = ckpt_io.load_state(step4, "trainer")
    state["step"] = 3
    ckpt_io.save_state(step4, "trainer", state)
    meta = ckpt_io.read_metadata(step4)
    meta["step"] = 3
    (step4 / "metadata.json").write_text(json.dumps(meta))
    _rerecord(step4)
    want = ("its name says step 4 but metadata.json records step 3 (renamed or copied: rename "
            "it back to step3 or delete it)")
    assert ckpt_io.verify(step4) == [want]
    with pytest.raises(ckpt_io.CheckpointError) as err:
        Trainer(tiny_config(tokens, **SAVE, **{"trainer.resume": str(step4)}), tmp_path / "b")
    msg = one_line(err)
    assert want in msg and f"trainer.resume={step2}" in msg
    t = Trainer(tiny_config(tokens, **SAVE), run)
    assert t.step == 2
    t.close()


# ------------------------------------------------------------------ 9: no code from a checkpoint


def _custom_code_folder(src: Path, dst: Path, marker: Path, where: str) -> Path:
    """A copy of checkpoint ``src`` whose ``where`` (config.json or tokenizer_config.json) asks
    for a class in the folder's own Python file, which would create ``marker`` when imported."""
    d = shutil.copytree(src, dst, ignore=shutil.ignore_patterns("metadata.json"))
    (d / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                               "from transformers import LlamaForCausalLM as Evil\n")
    f = d / where
    doc = json.loads(f.read_text()) if f.is_file() else {}
    doc["auto_map"] = {"AutoModelForCausalLM": "evil.Evil", "AutoConfig": "evil.Evil",
                       "AutoTokenizer": ["evil.Evil", None]}
    f.write_text(json.dumps(doc))
    return d


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_a_checkpoint_asking_for_custom_code_is_refused_without_a_prompt(tokens, saved,
                                                                         tmp_path, where):
    marker = tmp_path / "ran"
    d = _custom_code_folder(saved / "checkpoints" / "step4", tmp_path / "evil", marker, where)
    r = subprocess.run([sys.executable, "-m", "evals.cli", f"checkpoint={d}", "tasks=arc_easy",
                        "limit=1", "progress=false", f"out={tmp_path / 'out'}"], cwd=ROOT,
                       env=ENV, input="y\n", capture_output=True, text=True, timeout=300,
                       check=False)
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    assert err[0].startswith(f"twell-eval: CheckpointError: {d / where} asks for custom code "
                             "(auto_map: AutoConfig, AutoModelForCausalLM, AutoTokenizer)")
    assert "[y/N]" not in r.stdout + r.stderr and not marker.exists()
    cfg = tiny_config(tokens, **{"model.init_from": str(d)})
    with pytest.raises(ConfigError) as e:
        Trainer(cfg, tmp_path / "r")
    assert f"{d / where} asks for custom code" in one_line(e) and not marker.exists()


def test_no_transformers_auto_load_outside_twell_hf():
    """Every Auto* load goes through twell.hf (trust_remote_code=False, auto_map refused) or
    passes trust_remote_code=False itself."""
    import re

    def arguments(text: str, start: int) -> str:  # up to the call's closing parenthesis
        depth = 0
        for i in range(start, len(text)):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
        return text[start:]

    hits, calls = [], 0
    for d in ("train", "twell", "evals", "scripts", "offline"):
        for p in (ROOT / d).rglob("*.py"):
            text = p.read_text()
            for m in re.finditer(r"Auto\w+\.from_pretrained(?=\()", text):
                calls += 1
                if "trust_remote_code=False" not in arguments(text, m.end()):
                    hits.append(f"{p.relative_to(ROOT)}: {text[m.start():m.end() + 40]}")
    assert hits == [] and calls >= 3  # twell.hf's two and lm-eval's cross-check


# ------------------------------------------------------------------ 10: previous format, YAML


def _to_previous_format(ckpt: Path) -> None:
    for name in ("optimizer", "scheduler", "trainer", "rank0"):
        obj = ckpt_io.load_state(ckpt, name)
        for ext in (".json", ".safetensors"):
            (ckpt / f"{name}{ext}").unlink(missing_ok=True)
        torch.save(obj, ckpt / f"{name}.pt")
    meta = json.loads((ckpt / "metadata.json").read_text())
    for key in ("files", "lineage"):
        meta.pop(key)
    meta["format_version"] = 1
    (ckpt / "metadata.json").write_text(json.dumps(meta))


def test_a_truncated_previous_format_state_is_skipped_and_named_damaged(tokens, saved, tmp_path,
                                                                        capsys):
    run = _copy(saved, tmp_path / "run")
    step2, step4 = run / "checkpoints" / "step2", run / "checkpoints" / "step4"
    _to_previous_format(step2)
    _to_previous_format(step4)
    f = step4 / "optimizer.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert any(p.startswith("optimizer.pt is not a complete torch.save archive")
               for p in ckpt_io.verify(step4, checksums=False))
    t = Trainer(tiny_config(tokens, **SAVE), run)  # auto: step2, with a warning
    assert t.step == 2
    t.close()
    assert f"skipping damaged checkpoint {step4}" in capsys.readouterr().err
    with pytest.raises(ckpt_io.CheckpointError) as err:
        ckpt_io.load_state(step4, "optimizer")
    msg = one_line(err)
    assert msg.startswith(f"{f}: refused to load: optimizer.pt is not a complete torch.save "
                          "archive") and "could run code" not in msg


@pytest.mark.parametrize("where", ["checkpoint", "run"])
def test_a_python_tag_in_a_yaml_file_is_one_line_naming_it(tokens, saved, tmp_path, where):
    run = _copy(saved, tmp_path / "run")
    marker = tmp_path / "ran"
    f = (run / "checkpoints" / "step4" / "train_config.yaml" if where == "checkpoint"
         else run / "config.yaml")
    f.write_text(f"!!python/object/apply:os.system ['touch {marker}']\n")
    if where == "checkpoint":
        _rerecord(run / "checkpoints" / "step4")  # recorded so: only its content is wrong
    else:
        shutil.rmtree(run / "checkpoints")  # a run dir with its config.yaml only
    with pytest.raises(ckpt_io.CheckpointError) as err:
        Trainer(tiny_config(tokens, **SAVE), run)
    assert one_line(err).startswith(f"{f} is not plain YAML data (ConstructorError")
    assert not marker.exists()


# ------------------------------------------------------------------ 10: memory, signals, paths


def test_out_of_memory_on_the_cpu_saves_the_finished_steps(tokens, tmp_path, monkeypatch):
    """A real CPU allocation failure inside step 3 of a run that saves only at its end: one
    line (exit code 2) naming the CPU and what to lower; steps 1-2 are in checkpoint step2 with
    the data position of step 2, so the resumed run equals a straight one."""
    over = {"trainer.max_steps": 4, "sparsity.l1_coeff": 0.5}
    train_run(tiny_config(tokens, **over), tmp_path / "straight")
    real = Trainer._micro_steps

    def oom_at_step_3(self, ids, coeff):
        if self.step == 2:
            real(self, ids[:1], coeff)  # half a step of gradients, then no memory
            torch.empty(2**50, dtype=torch.uint8)
        return real(self, ids, coeff)

    monkeypatch.setattr(Trainer, "_micro_steps", oom_at_step_3)
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        train_run(tiny_config(tokens, **over), run)
    msg = one_line(err)
    step2 = run / "checkpoints" / "step2"
    assert msg.startswith("out of memory on the CPU in step 3 (")
    assert f"steps 1-2 are in checkpoint {step2}" in msg and "trainer.micro_batch (now 4)" in msg
    assert "step-down works on CUDA only" in msg and "re-run the same command" in msg
    assert ckpt_io.verify(step2) == []
    monkeypatch.setattr(Trainer, "_micro_steps", real)
    train_run(tiny_config(tokens, **over), run)
    _same_metrics(read_metrics(tmp_path / "straight"), read_metrics(run))


def test_a_signal_during_the_first_step_stops_at_once(tokens, tmp_path, monkeypatch):
    """A step that takes long (a far too long model.seq_len) and a SIGTERM before any step
    finished: nothing would be lost, so the run stops at once (not after the step), with no
    checkpoint and the line saying so; a signal after a finished unsaved step still waits."""
    from train.interrupt import TrainingInterrupted

    real = Trainer._micro_steps
    slept = []

    def slow(self, ids, coeff):
        if self.step == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            t0 = time.monotonic()
            time.sleep(3)  # the handler raises here if it stops at once
            slept.append(time.monotonic() - t0)
        return real(self, ids, coeff)

    def signal_in_step_2(self, ids, coeff):
        if self.step == 1:  # step 1 finished and is not saved (save_every=0)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, ids, coeff)

    monkeypatch.setattr(Trainer, "_micro_steps", slow)
    run = tmp_path / "run"
    t = Trainer(tiny_config(tokens, **{"trainer.max_steps": 4}), run)
    with pytest.raises(TrainingInterrupted) as err:
        t.train()
    assert err.value.first and not err.value.reported and slept == []
    assert t.step == 0 and not (run / "checkpoints").exists()
    assert t.interrupted(err.value) == 143
    t.close()
    assert ("received SIGTERM: stopped at once (no step finished since the last checkpoint, so "
            "none is lost) at step 0") in (run / "train.log").read_text()
    t = Trainer(tiny_config(tokens, **{"trainer.max_steps": 4}), run)
    monkeypatch.setattr(Trainer, "_micro_steps", signal_in_step_2)
    with pytest.raises(TrainingInterrupted) as err:
        t.train()
    t.close()
    assert err.value.reported and not err.value.first and t.step == 2  # after step 2, saved
    assert ckpt_io.verify(run / "checkpoints" / "step2") == []


def test_a_run_dir_with_a_newline_is_quoted_in_the_advice(tokens, tmp_path):
    run = tmp_path / "a\nb c"
    t = train_run(tiny_config(tokens, **{"trainer.max_steps": 2, "trainer.save_every": 1}), run,
                  stop_at_step=1)
    advice = t.resume_advice()
    assert "\n" not in advice
    assert advice.endswith(f" to resume from $'{tmp_path}/a\\nb c/checkpoints/step1'"), advice
    assert advice.startswith("re-run the same command with $'hydra.run.dir="), advice


def test_a_metrics_line_cut_short_is_dropped_on_resume(tokens, tmp_path, capsys):
    """A crash in the middle of an append leaves half a JSON line in metrics.jsonl: the resume
    drops it with a warning (it was a traceback) and the run's metrics equal a straight run's."""
    over = {"trainer.max_steps": 4, "trainer.save_every": 2}
    train_run(tiny_config(tokens, **over), tmp_path / "straight")
    run = tmp_path / "run"
    train_run(tiny_config(tokens, **over), run, stop_at_step=2)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 3, "loss": 1.2')
    train_run(tiny_config(tokens, **over), run)
    assert f"warning: {run / 'metrics.jsonl'}: dropped 1 damaged line(s)" in capsys.readouterr().err
    _same_metrics(read_metrics(tmp_path / "straight"), read_metrics(run))


def test_a_hard_linked_run_file_is_refused_and_the_other_name_untouched(tokens, tmp_path):
    """A hard link shares the bytes: an append to train.log would change the other file."""
    other = tmp_path / "other.log"
    other.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    os.link(other, run / "train.log")
    with pytest.raises(ckpt_io.CheckpointError) as err:
        Trainer(tiny_config(tokens, **{"trainer.max_steps": 1}), run)
    assert one_line(err).startswith(f"{run / 'train.log'} is a hard link (2 names share")
    with pytest.raises(ckpt_io.CheckpointError, match="is a hard link"):
        ckpt_io.open_run_file(run / "train.log")
    assert other.read_text() == "precious\n"


def test_stripped_records_are_no_previous_format_and_every_loader_checks(saved, tmp_path):
    """metadata.json's file records removed (and its version): the state files are of the
    current format, so this is damage, not a previous-format checkpoint; twell.hf.load_model
    (reports, record_acts) refuses a folder failing its metadata.json like the pickers do."""
    from twell.hf import CheckpointError, load_model

    run = _copy(saved, tmp_path / "run")
    step2, step4 = run / "checkpoints" / "step2", run / "checkpoints" / "step4"
    meta = ckpt_io.read_metadata(step4)
    del meta["files"], meta["format_version"]
    (step4 / "metadata.json").write_text(json.dumps(meta))
    assert ckpt_io.verify(step4)[-1].startswith("metadata.json records no files, but its state")
    assert ckpt_io.latest_checkpoint(run) == step2
    _flip_byte(step2 / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_model(step2)
    assert one_line(err).startswith(f"{step2} is damaged or incomplete (model.safetensors fails "
                                    "its SHA-256 check)")


def test_a_link_the_user_names_is_followed_to_an_intact_checkpoint(tokens, saved, tmp_path,
                                                                   monkeypatch):
    """Links inside a run dir are refused; a path the user gives that is a link (runs/x/best ->
    checkpoints/step4) is the user's choice: it is judged by the folder it points to."""
    models = _no_tokenizer(monkeypatch)
    run = _copy(saved, tmp_path / "run")
    best = tmp_path / "best"
    best.symlink_to(run / "checkpoints" / "step4")
    assert models.resolve_checkpoint(best) == run / "checkpoints" / "step4"
    t = Trainer(tiny_config(tokens, **SAVE, **{"trainer.resume": str(best)}), tmp_path / "b")
    assert t.step == 4
    t.close()


def test_a_damaged_checkpoint_copied_under_another_name_is_one_line(tokens, saved, tmp_path):
    """trainer.resume=<run>/checkpoints/best, a damaged copy of step4: the ways out were
    computed from the folder's name (step{N}), a ValueError traceback for any other name."""
    run = _copy(saved, tmp_path / "run")
    best = shutil.copytree(run / "checkpoints" / "step4", run / "checkpoints" / "best")
    _flip_byte(best / "model.safetensors")
    with pytest.raises(ckpt_io.CheckpointError) as err:
        Trainer(tiny_config(tokens, **SAVE, **{"trainer.resume": str(best)}), tmp_path / "b")
    msg = one_line(err)
    assert f"checkpoint {best} is damaged or incomplete (model.safetensors fails its SHA-256" in msg
    # it records step 4: an older intact checkpoint of its run dir is the way out
    assert msg.endswith(f"resume an older intact checkpoint (trainer.resume="
                        f"{run / 'checkpoints' / 'step2'}).")


def test_weights_that_became_nan_are_never_saved_as_a_good_checkpoint(tokens, tmp_path):
    """A step whose loss and gradient were finite can still leave inf weights (an update too
    large): the save refuses them in one line naming the tensor and the last good checkpoint,
    and writes nothing, so no NaN checkpoint is ever named "last good" or resumed."""
    from train.trainer import NonFiniteLossError

    run = tmp_path / "run"
    over = {"trainer.max_steps": 4, "trainer.save_every": 2}
    t = Trainer(tiny_config(tokens, **over), run)
    t.train(stop_at_step=2)
    model = t.acc.unwrap_model(t.model)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("inf")
    t.step = 3  # as after a third step
    with pytest.raises(NonFiniteLossError) as err:
        t.save_checkpoint()
    t.close()
    msg = one_line(err)
    assert msg.startswith(f"weights hold NaN or inf after step 3 ({W0} (1 of 2048))")
    assert msg.endswith(f"last good checkpoint: {run / 'checkpoints' / 'step2'}")
    assert err.value.facts(run) == {"error": "NonFiniteLossError", "step": 3,
                                    "reason": "non-finite weights",
                                    "last_good_checkpoint": "checkpoints/step2"}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step2"]


# ------------------------------------------------------------------ 33: where a run writes


@pytest.mark.parametrize("name", [".hydra", "wandb"])
def test_a_linked_folder_the_run_writes_into_is_refused(tokens, tmp_path, name):
    """.hydra/ (twell-train's record of the config) or wandb/ (an offline wandb run) as a link
    to a folder elsewhere: one line naming it before anything is written; the folder it points
    to stays empty (the run wrote config.yaml, hydra.yaml, overrides.yaml or wandb's run there)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(outside, target_is_directory=True)
    cfg = tiny_config(tokens, **{"trainer.max_steps": 1, "logging.wandb_mode": "offline"})
    with pytest.raises(ckpt_io.CheckpointError) as err:
        train_run(cfg, run)
    assert one_line(err).startswith(f"{run / name} is a symbolic link (to {outside})")
    assert list(outside.iterdir()) == [] and sorted(p.name for p in run.iterdir()) == [name]
    (run / name).unlink()
    (run / name).write_text("not a folder")  # Hydra's mkdir would fail with a traceback
    with pytest.raises(ckpt_io.CheckpointError, match=f"{run / name} is not a folder"):
        train_run(cfg, run)


def test_the_cli_writes_no_hydra_record_through_a_link(tokens, tmp_path):
    """The CLI (which writes .hydra/ once the run dir is its own) refuses a linked .hydra in
    one line with exit code 2 and writes nothing into the folder it points to."""
    outside = tmp_path / "outside"
    outside.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / ".hydra").symlink_to(outside, target_is_directory=True)
    r = subprocess.run(_cli(run, tokens), cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"CheckpointError: {run / '.hydra'} is a symbolic link (to {outside})")
    assert list(outside.iterdir()) == [] and "Traceback" not in r.stderr


def _outside_index(ckpt: Path, outside: Path, how: str) -> str:
    """Move ``ckpt``'s weights out of the folder and record an index naming them there
    (``abs``: the absolute path, ``up``: a ``../`` path, ``link``: a link in the folder to them);
    re-recorded, so the folder passes its SHA-256 checks. Returns the name the index holds."""
    target = outside / "outside.safetensors"
    shutil.move(ckpt / "model.safetensors", target)
    name = {"abs": str(target), "up": os.path.relpath(target, ckpt),
            "link": "model-00001-of-00001.safetensors"}[how]
    if how == "link":
        (ckpt / name).symlink_to(target)
    keys = load_file(str(target)).keys()
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(keys, name)}))
    if how != "link":  # a link fails verification anyway; the loaders refuse it themselves too
        _rerecord(ckpt)
    return name


@pytest.mark.parametrize("how", ["abs", "up", "link"])
def test_an_index_naming_weights_outside_the_checkpoint_is_refused(tokens, saved, tmp_path,
                                                                    capsys, monkeypatch, how):
    """A recorded model.safetensors.index.json whose weight_map names a file outside the folder
    (absolute, ../, or through a link): twell.hf.load_model, twell-eval and model.init_from
    refuse it in one line, before any weight is read (they loaded the outside file, covered by
    no hash)."""
    from evals.cli import main
    from twell.hf import CheckpointError, load_model, safetensors_files

    _no_tokenizer(monkeypatch)
    outside = tmp_path / "outside"
    outside.mkdir()
    step4 = _copy(saved, tmp_path / "run") / "checkpoints" / "step4"
    name = _outside_index(step4, outside, how)
    index = step4 / "model.safetensors.index.json"
    want = (f"{step4 / name} is a symbolic link" if how == "link" else
            f"{index} names the weight file {name!r}, which is not a plain file name inside "
            f"{step4}")
    with pytest.raises(CheckpointError) as err:
        safetensors_files(step4)
    assert one_line(err).startswith(want)
    if how != "link":  # verified: these pass metadata.json; the name is what is refused
        assert ckpt_io.verify(step4) == []
        with pytest.raises(CheckpointError) as err:
            load_model(step4)
        assert one_line(err).startswith(want)
        assert main([f"checkpoint={step4}", "tasks=arc_easy", "limit=1", "progress=false",
                     f"tokenizer={step4}", f"out={tmp_path / 'out'}"]) == 2
        line = capsys.readouterr().err.strip().splitlines()
        assert len(line) == 1 and line[0].startswith(f"twell-eval: CheckpointError: {want}")
        with pytest.raises(ConfigError) as err:
            Trainer(tiny_config(tokens, **{"model.init_from": str(step4)}), tmp_path / "init")
        assert one_line(err).startswith(f"model.init_from={str(step4)!r}: {want}")
    assert not (tmp_path / "out").exists() and not (tmp_path / "init").exists()


# ------------------------------------------------------------------ 33: the advice works


def test_resume_from_the_run_dir_continues_past_a_damaged_newest_checkpoint(tokens, saved,
                                                                              tmp_path, capsys):
    """step4 fails its SHA-256: trainer.resume=<the run dir> in that run dir (docs/training.md,
    Resuming: its newest intact checkpoint) resumes step2 with a warning naming step4 (it was
    refused: "already holds newer or other checkpoints (step4)"), and the save of step 4
    replaces the damaged one with an intact checkpoint."""
    run = _copy(saved, tmp_path / "run")
    step2, step4 = run / "checkpoints" / "step2", run / "checkpoints" / "step4"
    _flip_byte(step4 / "model.safetensors")
    t = Trainer(tiny_config(tokens, **SAVE, **{"trainer.resume": str(run)}), run)
    assert t.step == 2 and t.last_ckpt == step2
    assert f"skipping damaged checkpoint {step4}" in capsys.readouterr().err
    t.train()
    t.close()
    assert ckpt_io.verify(step4) == [] and ckpt_io.latest_checkpoint(run) == step4
    assert ckpt_io.lineage_id(step4) == ckpt_io.lineage_id(step2)  # the run's own line


def test_the_advice_after_a_nan_checkpoint_works_in_the_same_run_dir(tokens, saved, tmp_path):
    """step4 holds a NaN weight (hashes re-recorded): resume=auto refuses it naming
    trainer.resume=<step2>; that command, in the same run dir, resumes step2 (it was refused
    because of the NaN step4) and trains to a finite step4. An intact newer checkpoint still
    refuses the branch."""
    run = _copy(saved, tmp_path / "run")
    step2, step4 = run / "checkpoints" / "step2", run / "checkpoints" / "step4"
    w = load_file(str(step4 / "model.safetensors"))[W0]
    w[0, 0] = float("nan")
    _edit_weights(step4, **{W0: w})
    nan4 = shutil.copytree(step4, tmp_path / "nan4")
    with pytest.raises(ckpt_io.CheckpointError) as err:
        Trainer(tiny_config(tokens, **SAVE), run)
    assert f"resume an older intact checkpoint (trainer.resume={step2})" in one_line(err)
    t = train_run(tiny_config(tokens, **SAVE, **{"trainer.resume": str(step2)}), run)
    assert t.step == 4 and ckpt_io.verify(step4) == []
    assert ckpt_io.tensor_problems(step4, like=step2) == []
    assert ckpt_io.tensor_problems(nan4, like=step2) == [
        f"model.safetensors: tensor {W0} holds NaN or inf values"]
    with pytest.raises(ConfigError, match=r"already holds newer or other checkpoints \(step4\)"):
        Trainer(tiny_config(tokens, **SAVE, **{"trainer.resume": str(step2)}), run)


# ------------------------------------------------------------------ 33: what is not ours


@pytest.mark.parametrize("what", ["file", "junk", "link_inside"])
def test_a_step_entry_no_save_made_is_refused_and_left_as_it_is(tokens, saved, tmp_path, what):
    """checkpoints/step4 as a regular file in a run that resumes step2 and would save step 4
    (a traceback, exit 1 and a .step4.old left behind), or a step2/ folder of junk files or
    holding a link in a fresh run dir (deleted at the save): refused in one line before
    anything is written, the entry as it was."""
    if what == "file":
        run = _copy(saved, tmp_path / "run")
        shutil.rmtree(run / "checkpoints" / "step4")
        entry = run / "checkpoints" / "step4"
        entry.write_text("mine\n")
        want = f"{entry} is a file: not a checkpoint twell saved"
    else:
        run = tmp_path / "run"
        entry = run / "checkpoints" / "step2"
        entry.mkdir(parents=True)
        (entry / "notes.txt").write_text("mine\n")
        if what == "link_inside":
            (entry / "data").symlink_to(tmp_path)
        want = f"{entry} is a folder without metadata.json: not a checkpoint twell saved"
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    with pytest.raises(ckpt_io.CheckpointError) as err:
        train_run(tiny_config(tokens, **SAVE), run)
    msg = one_line(err)
    assert msg.startswith(want) and "move it out of" in msg and isinstance(err.value, ConfigError)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    assert (entry if what == "file" else entry / "notes.txt").read_text() == "mine\n"


def test_a_save_refuses_a_step_entry_made_during_the_run(tmp_path):
    """An entry made after the start check: the save of that step refuses it and writes
    nothing (no .stepN.tmp, the entry kept); leftovers of an earlier save (a .stepN.tmp file,
    a .stepN.old link) are removed as what they are, never followed."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "step3").write_text("mine\n")
    with pytest.raises(ckpt_io.CheckpointError, match="step3 is a file: not a checkpoint"):
        ckpt_io.begin(tmp_path, 3)
    assert sorted(p.name for p in root.iterdir()) == ["step3"]
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    (root / ".step5.tmp").write_text("left over")
    tmp, final = ckpt_io.begin(tmp_path, 5)
    (tmp / "model.safetensors").write_bytes(b"x")
    ckpt_io.finish(tmp, final, step=5, world_size=1, keep_last=3)
    (root / ".step5.old").symlink_to(victim)
    tmp, final = ckpt_io.begin(tmp_path, 5)
    (tmp / "model.safetensors").write_bytes(b"y")
    ckpt_io.finish(tmp, final, step=5, world_size=1, keep_last=3)
    assert (final / "model.safetensors").read_bytes() == b"y" and ckpt_io.verify(final) == []
    assert (victim / "keep").read_text() == "x"
    assert sorted(p.name for p in root.iterdir()) == ["step3", "step5"]
