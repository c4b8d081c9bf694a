"""End-to-end trainer behaviour on a tiny model and a learnable synthetic token stream (CPU, fp32)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.train_utils import (
    datamodule_with_stub_tokenizer,
    no_eval_fit_check,
    one_line,
    read_metrics,
    tiny_config,
    write_tokens,
)
from train.checkpoint import latest_checkpoint, list_checkpoints, load_state
from train.trainer import NonFiniteLossError, Trainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "train.bin")


def _run(cfg, run_dir, datamodule=None, **kw):
    t = Trainer(cfg, run_dir, datamodule=datamodule)
    try:
        return t.train(**kw), t
    finally:
        t.close()


@pytest.mark.slow
def test_loss_falls_and_l1_makes_sparser(tokens, tmp_path):
    over = {"trainer.max_steps": 50, "trainer.log_every": 5, "trainer.val_every": 25}
    dense, _ = _run(tiny_config(tokens, **over), tmp_path / "dense")
    sparse, _ = _run(tiny_config(tokens, **over, **{"sparsity.l1_coeff": 1.0}), tmp_path / "l1")
    rows = read_metrics(tmp_path / "dense")
    assert rows[0]["ce"] > math.log(64) - 0.3  # starts near uniform
    assert dense["final_train_ce"] < rows[0]["ce"] - 1.0  # learns the successor table
    assert dense["val_loss"] < rows[0]["ce"] - 1.0
    assert sparse["l0_mean"] < 0.5 * dense["l0_mean"]
    # summary and metrics carry what the brief asks for
    s = json.loads((tmp_path / "l1" / "summary.json").read_text())
    for key in ("final_train_ce", "val_loss", "l0_mean", "dead_pct", "tokens_per_s", "params",
                "tokens_seen"):
        assert s[key] is not None, key
    assert s["tokens_seen"] == 50 * 8 * 32
    assert Path(s["paths"]["checkpoint"]).name == "step50"
    r = read_metrics(tmp_path / "l1")[-1]
    assert len(r["l0_layers"]) == 2 and r["l0_min"] <= r["l0_mean"] <= r["l0_max"] <= r["nnz_max"]
    assert 0 <= r["dead_frac"] <= 1 and r["lr"] > 0 and r["grad_norm"] > 0
    assert read_metrics(tmp_path / "l1", "val")[-1]["step"] == 50


def test_resume_is_exact(tokens, tmp_path):
    """20 steps straight == 10 steps, stop, resume to 20 (losses, L0, dead fractions)."""
    over = {"trainer.max_steps": 20, "trainer.save_every": 5, "trainer.keep_last": 3,
            "sparsity.l1_coeff": 3.0, "sparsity.reinit_dead": True, "sparsity.reinit_lambda": 0.5,
            # a dead-neuron window of 3 steps: the checkpoint at step 10 is mid-window
            "sparsity.dead_window_tokens": 3 * 8 * 32}
    _run(tiny_config(tokens, **over), tmp_path / "straight")
    _run(tiny_config(tokens, **over), tmp_path / "split", stop_at_step=10)
    assert not (tmp_path / "split" / "summary.json").exists()
    assert latest_checkpoint(tmp_path / "split").name == "step10"
    _, t2 = _run(tiny_config(tokens, **over), tmp_path / "split")  # resume=auto
    a = read_metrics(tmp_path / "straight")
    b = read_metrics(tmp_path / "split")
    assert [r["step"] for r in b] == list(range(1, 21))
    for ra, rb in zip(a, b):
        for key in ("loss", "ce", "l1", "l0_mean", "nnz_max", "grad_norm", "lr"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-6), (ra["step"], key)
        assert ra["dead_frac"] == rb["dead_frac"]
    assert any(r["dead_frac"] for r in a)  # the re-init path was exercised
    assert [p.name for p in list_checkpoints(tmp_path / "split")] == ["step10", "step15", "step20"]
    # a constant schedule: the summary's coefficient is l1_coeff; step lines do not repeat it
    assert json.loads((tmp_path / "split" / "summary.json").read_text())["final_l1_coeff"] == 3.0
    log = (tmp_path / "split" / "train.log").read_text()
    assert log.count(": loss ") == 20 and "coeff" not in log
    assert t2.state_dict()["step"] == 20 and t2.state_dict()["tokens_seen"] == 20 * 8 * 32
    again, _ = _run(tiny_config(tokens, **over), tmp_path / "split")  # finished: nothing to do
    assert again["step"] == 20 and again["final_train_ce"] == b[-1]["ce"]
    assert len(read_metrics(tmp_path / "split")) == 20


def test_target_l0_steers_from_each_steps_l0_and_resumes_exactly(tokens, tmp_path):
    """schedule=target_l0 in the trainer: each step's logged coefficient is the controller's
    (recomputed by hand from the logged per-step L0), it rises while L0 is above the target, and
    12 steps straight == 6, stop, resume to 12, bitwise (coefficients, losses, L0s, and the
    coefficient in the final checkpoint)."""
    over = {"trainer.max_steps": 12, "trainer.save_every": 3, "sparsity.l1_coeff": 0.01,
            "sparsity.target_l0": 8.0, "sparsity.target_gain": 0.2, "sparsity.target_after": 2,
            "sparsity.schedule": "target_l0"}
    _run(tiny_config(tokens, **over), tmp_path / "straight")
    _run(tiny_config(tokens, **over), tmp_path / "split", stop_at_step=6)
    _run(tiny_config(tokens, **over), tmp_path / "split")  # resume=auto
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    c, want = 0.01, []
    for r in a:  # r["step"] is 1-based
        want.append(c)
        if r["step"] >= 2:  # steps 1-2 (1-based) at l1_coeff; step 3 the first steered
            err = min(max((r["l0_mean"] - 8.0) / 8.0, -1.0), 1.0)
            c = min(max(c * math.exp(0.2 * err), 1e-4), 1.0)
    assert [r["l1_coeff"] for r in a] == pytest.approx(want, rel=1e-5)
    assert a[0]["l0_mean"] > 8.0 and want[-1] > 0.01 * math.exp(0.2)  # it moved, upwards
    assert [r["step"] for r in b] == list(range(1, 13))
    for ra, rb in zip(a, b):
        for key in ("loss", "ce", "l1", "l0_mean", "l1_coeff", "grad_norm"):
            assert rb[key] == ra[key], (ra["step"], key)  # JSON floats round-trip exactly
    states = [load_state(latest_checkpoint(tmp_path / run), "trainer")["l1"]
              for run in ("straight", "split")]
    assert states[0] == states[1] and states[0]["coeff"] == pytest.approx(c, rel=1e-9)  # step 13
    for run, rows in (("straight", a), ("split", b)):
        # summary.json: the coefficient step 12 ran at (not step 13's), to rerun it fixed
        s = json.loads((tmp_path / run / "summary.json").read_text())
        assert s["final_l1_coeff"] == rows[-1]["l1_coeff"] == pytest.approx(want[-1], rel=1e-5)
        # each printed step line names its coefficient, after the learning rate
        log = (tmp_path / run / "train.log").read_text()
        for r in rows:
            assert (f"step {r['step']}: loss {r['loss']:.4f} " in log
                    and f" lr {r['lr']:.3g} l1 coeff {r['l1_coeff']:.3g} gnorm " in log), r["step"]


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tokens, tmp_path):
    cfg = tiny_config(tokens, **{"trainer.max_steps": 10, "trainer.save_every": 2})
    t = Trainer(cfg, tmp_path / "run")
    t.train(stop_at_step=4)
    with torch.no_grad():
        t.model.model.embed_tokens.weight[:, 0] = float("nan")
    with pytest.raises(NonFiniteLossError, match="at step 5") as err:
        t.train()
    assert "step4" in str(err.value)
    # the facts twell-train writes to error.json: the checkpoint relative to the run dir
    assert err.value.facts(tmp_path / "run") == {
        "error": "NonFiniteLossError", "step": 5, "reason": "non-finite loss or gradient",
        "last_good_checkpoint": "checkpoints/step4"}
    assert latest_checkpoint(tmp_path / "run").name == "step4"
    from train.model import load_model

    good = load_model(latest_checkpoint(tmp_path / "run"))
    assert all(torch.isfinite(p).all() for p in good.parameters())


def test_grad_checkpointing_gives_same_losses(tokens, tmp_path):
    over = {"trainer.max_steps": 4, "sparsity.l1_coeff": 0.05}
    _run(tiny_config(tokens, **over), tmp_path / "a")
    _run(tiny_config(tokens, **over, **{"trainer.grad_checkpointing": True}), tmp_path / "b")
    for ra, rb in zip(read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_cli_run_and_multirun(tokens, tmp_path):
    """`python -m train` (= twell-train) with the brief's exact keys, then a 2-value sweep."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    data = ["data=tokens", f"data.paths=[{tokens}]", "data.vocab_size=64", "eval=disabled",
            "logging.wandb_mode=disabled", "trainer.num_threads=1", "trainer.val_sequences=4",
            "trainer.progress=false"]
    small = ["model.vocab_size=64", "model.hidden_size=32", "model.intermediate_size=64",
             "model.num_heads=2", "model.seq_len=32", "trainer.global_batch=4",
             "trainer.micro_batch=4"]
    run_dir = tmp_path / "one"
    cmd = [sys.executable, "-m", "train", "model=tiny", "trainer.max_steps=20",
           "sparsity.l1_coeff=2e-5", f"hydra.run.dir={run_dir}", *small, *data]
    r = subprocess.run(cmd, cwd=ROOT, env=env, check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["step"] == 20 and (run_dir / "config.yaml").is_file()
    assert f"checkpoint: {run_dir}/checkpoints/step20" in r.stdout
    last = r.stdout.strip().splitlines()[-1]  # the summary line comes last
    assert last.startswith("done: step 20 | train CE ") and "tok/s" in last
    log = (run_dir / "train.log").read_text()  # the printed lines, in the run dir
    assert "step 20: loss" in log and last in log and not (run_dir / "main.log").exists()
    # a bad value: one line on stderr, exit code 2
    bad = subprocess.run(cmd[:-len(small) - len(data)] + small + data + ["model.num_heads=3"],
                         cwd=ROOT, env=env, check=False, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "ConfigError: model.hidden_size=32 is not divisible" in bad.stderr
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "train", "-m", "sparsity.l1_coeff=0,1e-2", "trainer.max_steps=2",
           f"hydra.sweep.dir={sweep}", *small, *data]
    r = subprocess.run(cmd, cwd=ROOT, env=env, check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    from omegaconf import OmegaConf

    coeffs = []
    for job in (0, 1):  # each job has its own directory with config, summary and checkpoint
        assert (sweep / str(job) / "summary.json").is_file()
        coeffs.append(OmegaConf.load(sweep / str(job) / "config.yaml").sparsity.l1_coeff)
    assert coeffs == [0.0, 1e-2]


def test_in_loop_eval_calls_evals_evaluate(tokens, tmp_path, monkeypatch):
    """eval.every_steps / eval.at_end call evals.evaluate(model, tokenizer, ...) and log it."""
    import types

    calls = []

    def fake_evaluate(model, tokenizer, tasks, limit, batch_size, device, **kw):
        calls.append((model.training, tasks, limit, batch_size))
        return {"tasks": {"piqa": {"acc": 0.5, "acc_norm": 0.6, "primary": 0.6, "n": 4}},
                "mean": 0.6, "protocol": {}}

    import evals.tasks  # noqa: F401  (the config checks eval.tasks against it: load it first)

    monkeypatch.setitem(sys.modules, "evals", types.SimpleNamespace(evaluate=fake_evaluate))
    no_eval_fit_check(monkeypatch)
    cfg = tiny_config(tokens, **{"trainer.max_steps": 5, "eval.every_steps": 2,
                                 "eval.at_end": True, "eval.tasks": ["piqa"], "eval.limit": 4})
    summary, _ = _run(cfg, tmp_path / "run", datamodule=datamodule_with_stub_tokenizer(cfg))
    assert calls == [(False, ("piqa",), 4, 16)] * 3  # steps 2, 4 and the end (5)
    assert [r["step"] for r in read_metrics(tmp_path / "run", "eval")] == [2, 4, 5]
    assert summary["eval"]["eval_mean"] == 0.6 and summary["eval"]["eval_piqa"] == 0.6
    # re-running the finished run resumes at the end: no second evaluation, no duplicate row
    _run(cfg, tmp_path / "run", datamodule=datamodule_with_stub_tokenizer(cfg))
    assert len(calls) == 3
    assert [r["step"] for r in read_metrics(tmp_path / "run", "eval")] == [2, 4, 5]


def test_eval_continuation_longer_than_seq_len_stops_in_one_line(tokens, tmp_path, monkeypatch):
    """A model.seq_len shorter than a task's longest choice (PIQA: 151 SmolLM2 tokens in its
    first 200 rows) stops at the eval with one line naming model.seq_len and the fixes, after
    the last checkpoint is written; rerunning with eval=disabled finishes the run."""
    import evals.harness
    from evals.scoring import ContinuationTooLong
    from train.config import ConfigError

    def too_long(*a, **kw):
        raise ContinuationTooLong("piqa row 7: a choice of 151 tokens does not fit the model's 32 "
                                  "positions (max_position_embeddings); score it with ...", 30,
                                  151, 32)

    monkeypatch.setattr(evals.harness, "evaluate", too_long)
    no_eval_fit_check(monkeypatch)  # an eval that meets one all the same (the start's check
    # refuses what it finds: test_a_handed_in_datamodule_gets_the_eval_check_at_start)
    cfg = tiny_config(tokens, **{"trainer.max_steps": 2, "eval.at_end": True,
                                 "eval.tasks": ["piqa"], "eval.limit": 4})
    with pytest.raises(ConfigError) as e:
        _run(cfg, tmp_path / "run", datamodule=datamodule_with_stub_tokenizer(cfg))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("eval at step 2: piqa row 7: a choice of 151 tokens"), msg
    assert "model.seq_len=32 is too short" in msg and "model.seq_len>=151" in msg, msg
    assert "eval=disabled" in msg and "score it with" not in msg, msg
    assert (tmp_path / "run" / "checkpoints" / "step2").is_dir()
    assert not (tmp_path / "run" / "summary.json").exists()
    cfg = tiny_config(tokens, **{"trainer.max_steps": 2, "eval.at_end": False})
    summary, _ = _run(cfg, tmp_path / "run", datamodule=datamodule_with_stub_tokenizer(cfg))
    assert summary["step"] == 2 and (tmp_path / "run" / "summary.json").is_file()


def test_a_handed_in_datamodule_gets_the_eval_check_at_start(tokens, tmp_path):
    """A data module handed to the Trainer (not built from cfg.data) with a real tokenizer:
    evals whose choices do not fit model.seq_len (PIQA row 0: 36 SmolLM2 tokens > 32) are
    refused while the Trainer is built, in the one line of the CLI's check, before any step
    (nothing is written); with evals off the same data module trains."""
    from train.config import ConfigError
    from train.data import build_datamodule
    from train.data.tokenizer import load_tokenizer

    cfg = tiny_config(tokens, **{"trainer.max_steps": 1, "eval.at_end": True,
                                 "eval.tasks": ["piqa"], "eval.limit": 4})
    dm = build_datamodule(cfg.data, seq_len=cfg.model.seq_len,
                          micro_batch=cfg.trainer.micro_batch, seed=cfg.trainer.seed)
    dm.tokenizer = load_tokenizer("smollm2")
    with pytest.raises(ConfigError) as err:
        Trainer(cfg, tmp_path / "run", datamodule=dm)
    assert one_line(err) == (
        "eval.tasks: piqa row 0 has a choice of 36 tokens, more than the model's 32 positions "
        "(model.seq_len=32), so the evals after training would fail on it (piqa holds one "
        "among the first 4 rows, eval.limit); set model.seq_len>=36, eval.tasks without "
        "piqa, or eval=disabled.")
    assert not (tmp_path / "run").exists()
    cfg = tiny_config(tokens, **{"trainer.max_steps": 1, "eval.at_end": False})
    summary, _ = _run(cfg, tmp_path / "run", datamodule=dm)
    assert summary["step"] == 1


@pytest.mark.slow
def test_two_ranks_resume_is_exact(tokens, tmp_path):
    """Data-parallel path on CPU (torchrun, gloo): per-rank data/RNG state, reduced metrics and
    dead-neuron counts; resuming from step 3 reproduces steps 4-6 of the straight run."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = ["data=tokens", f"data.paths=[{tokens}]", "data.vocab_size=64", "trainer.cpu=true",
            "eval=disabled",
            "logging.wandb_mode=disabled", "trainer.num_threads=1", "trainer.val_sequences=4",
            "trainer.progress=false", "model.vocab_size=64", "model.hidden_size=32",
            "model.intermediate_size=64", "model.num_heads=2", "model.num_layers=2",
            "model.seq_len=32", "trainer.global_batch=16", "trainer.micro_batch=4",
            "trainer.log_every=1", "trainer.save_every=3", "trainer.max_steps=6",
            "sparsity.l1_coeff=3.0", "sparsity.reinit_dead=true"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "-m", "train"]
    for extra in ([f"hydra.run.dir={tmp_path / 'a'}"],
                  [f"hydra.run.dir={tmp_path / 'b'}",
                   f"trainer.resume={tmp_path / 'a' / 'checkpoints' / 'step3'}"]):
        r = subprocess.run(torchrun + args + extra, cwd=ROOT, env=env, check=False, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    ckpt = tmp_path / "a" / "checkpoints" / "step6"
    assert (ckpt / "rank0.json").is_file() and (ckpt / "rank1.json").is_file()
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["world_size"] == 2
    a = read_metrics(tmp_path / "a")
    b = read_metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [4, 5, 6]
    for ra, rb in zip(a[3:], b):
        for key in ("loss", "l0_mean", "nnz_max", "grad_norm"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-6), (ra["step"], key)
        assert ra["dead_frac"] == rb["dead_frac"]


def test_bf16_autocast_keeps_fp32_master_weights(tokens, tmp_path):
    """precision=bf16 (autocast; here on CPU) after an fp32 run in the same process (Hydra -m)."""
    _run(tiny_config(tokens, **{"trainer.max_steps": 1}), tmp_path / "fp32")
    summary, t = _run(tiny_config(tokens, **{"trainer.max_steps": 3, "trainer.precision": "bf16",
                                             "sparsity.l1_coeff": 1.0}), tmp_path / "bf16")
    assert t.acc.mixed_precision == "bf16" and summary["precision"] == "bf16"
    assert {p.dtype for p in t.model.parameters()} == {torch.float32}
    assert all(v.dtype == torch.float32 for st in t.optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim() > 0)
    r = read_metrics(tmp_path / "bf16")[-1]
    assert math.isfinite(r["loss"]) and r["l1"] > 0 and r["ce"] < math.log(64) + 0.5


def test_eval_without_tokenizer_is_refused(tokens, tmp_path):
    """eval at the end needs a tokenizer: the tokens source has none, so the run refuses to start."""
    from train.config import ConfigError

    cfg = tiny_config(tokens, **{"eval.at_end": True})
    with pytest.raises(ConfigError, match="eval=disabled"):
        Trainer(cfg, tmp_path / "r")


def test_triton_interpreter_with_ffn_impl_twell_warns(tokens, tmp_path, capsys, monkeypatch):
    """TRITON_INTERPRET=1 (what scripts/test.sh sets without a GPU) left set in a user's shell
    makes a twell run crawl (a validation FFN call takes minutes): the trainer says so."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    Trainer(tiny_config(tokens, **{"ffn.impl": "twell"}), tmp_path / "i").close()
    assert "TRITON_INTERPRET=1 runs ffn.impl=twell through the Triton interpreter" in (
        capsys.readouterr().err)
    for impl, env in [("torch", "1"), ("twell", "0")]:
        monkeypatch.setenv("TRITON_INTERPRET", env)
        Trainer(tiny_config(tokens, **{"ffn.impl": impl}), tmp_path / f"i{impl}").close()
        assert "TRITON_INTERPRET" not in capsys.readouterr().err


def test_warmup_longer_than_run_warns(tokens, tmp_path, capsys):
    Trainer(tiny_config(tokens, **{"trainer.max_steps": 2, "optim.warmup_steps": 5}),
            tmp_path / "w").close()
    err = capsys.readouterr().err
    assert "optim.warmup_steps=5 > trainer.max_steps=2" in err


def test_record_ffn_inputs_keeps_the_named_layers_input(tokens, tmp_path):
    """twell.nn.record: the recorded x of each named layer is that layer's FFN input, equal to
    what an independent forward hook on the same FFN captures (and not another layer's); the
    saved file reads back with its weights and statistics."""
    import numpy as np

    from train.model import load_model
    from twell.nn.record import (
        ffn_input_stats,
        ffn_weights,
        load_ffn_layer,
        record_ffn_inputs,
        save_ffn_layer,
    )

    run = tmp_path / "run"
    t = Trainer(tiny_config(tokens, **{"trainer.max_steps": 1}), run)
    t.train()
    t.close()
    model = load_model(next((run / "checkpoints").glob("step*")), ffn_impl="torch").eval()
    seq = model.config.max_position_embeddings
    ids = np.memmap(tokens, dtype=np.uint16, mode="r")[: 3 * seq]
    blocks = torch.from_numpy(np.asarray(ids, dtype=np.int64)).view(3, seq)
    got = record_ffn_inputs(model, blocks, [1, 0], batch=2)
    seen = {}
    hooks = [model.model.layers[i].mlp.register_forward_hook(
        lambda m, inp, out, i=i: seen.setdefault(i, []).append(inp[0].reshape(-1, inp[0].shape[-1])))
        for i in (0, 1)]
    with torch.no_grad():
        model(input_ids=blocks)  # one batch of 3: another batching than the recorder's
    for hk in hooks:
        hk.remove()
    d = t.cfg.model.hidden_size
    for i in (0, 1):
        assert got[i].shape == (3 * seq, d)
        torch.testing.assert_close(got[i], torch.cat(seen[i]), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got[0], got[1])  # the layers' inputs differ: the test can fail
    wg, wu, wd = ffn_weights(model, 1)
    meta = {"size": "tiny", "layer": 1, **ffn_input_stats(got[1], wg)}
    path = save_ffn_layer(tmp_path / "acts.safetensors", got[1], wg, wu, wd, meta)
    rec = load_ffn_layer(path)
    assert rec.x.dtype == torch.bfloat16 and torch.equal(rec.x, got[1].to(torch.bfloat16))
    assert torch.equal(rec.w_down, wd.to(torch.bfloat16)) and rec.meta["layer"] == 1
    assert rec.meta["gated"] and rec.meta["tokens"] == 3 * seq
    with pytest.raises(ValueError, match="layer 9 out of range"):
        record_ffn_inputs(model, blocks, [9])


def test_a_ready_model_is_the_one_trained(tokens, tmp_path):
    """Trainer(model=...): a prebuilt model (weights other than the seeded init's) is trained as
    given and gets the trainer's FFN plan; together with model.init_from it is refused."""
    from train.config import ConfigError
    from train.model import build_model, ffn_modules

    cfg = tiny_config(tokens, **{"trainer.max_steps": 1, "data.val_fraction": 0.0})
    torch.manual_seed(123)
    model = build_model(cfg.model)
    w0 = model.model.layers[0].mlp.gate_proj.weight.detach().clone()
    t = Trainer(cfg, tmp_path / "given", model=model)
    try:
        assert t.acc.unwrap_model(t.model) is model and t.plan.mlps == ffn_modules(model)
        assert torch.equal(model.model.layers[0].mlp.gate_proj.weight, w0)  # not re-initialised
        seeded = Trainer(cfg, tmp_path / "own")
        w_own = seeded.acc.unwrap_model(seeded.model).model.layers[0].mlp.gate_proj.weight
        assert not torch.equal(w_own, w0)
        seeded.close()
        t.train()
        w1 = model.model.layers[0].mlp.gate_proj.weight
        assert t.step == 1 and not torch.equal(w1, w0) and torch.isfinite(w1).all()
    finally:
        t.close()
    src = tmp_path / "src"
    model.save_pretrained(src)
    cfg2 = tiny_config(tokens, **{"model.init_from": str(src)})
    with pytest.raises(ConfigError, match="model.init_from=.* and a ready model"):
        Trainer(cfg2, tmp_path / "both", model=model)
