"""Distillation in the trainer (``sparsity.distill_from=source``): the logged loss is CE +
l1_coeff * L1 + w T^2 KL computed independently with stock transformers on the first step's
batches, the teacher is frozen (no gradients, bitwise unchanged, in no checkpoint), a resumed
run over several epochs of a small corpus continues exactly, config errors, and the same
losses under trainer.compile."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from tests.train.test_pretrained import _cfg, _save_source
from tests.train_utils import read_metrics, write_tokens
from train.config import ConfigError, SparsityConfig, TrainConfig
from train.trainer import Trainer

L1, W, T = 0.05, 0.7, 2.0


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "train.bin", n_tokens=12_000)


@pytest.fixture(scope="module")
def silu_dir(tmp_path_factory):
    """The tiny SiLU source with a 40x embedding (tied: the LM head too), so its logits are far
    from uniform and the switch to ReLU changes them: a KL well above 0."""
    d = _save_source(tmp_path_factory.mktemp("silu"), "silu", seed=1)
    m = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(40)
    m.save_pretrained(d)
    return d


def _distill_cfg(tokens, src, *, steps=2, **trainer_kw):
    c = _cfg(tokens, src, hidden_act_from="silu")
    c.trainer = dataclasses.replace(c.trainer, max_steps=steps, **trainer_kw)
    c.sparsity = dataclasses.replace(c.sparsity, l1_coeff=L1, distill_from="source",
                                     distill_weight=W, distill_temperature=T)
    c.__post_init__()
    return c


def _run(cfg, run_dir, **kw):
    t = Trainer(cfg, run_dir)
    try:
        return t.train(**kw), t
    finally:
        t.close()


def _reference_step(cfg, src):
    """CE, L1, KL of step 1 (before any update) from stock LlamaForCausalLM: the student is the
    source with hidden_act=relu, the teacher the source as stored (SiLU); L1 from the inputs of
    the down projections (h = relu(gate) * up); the trainer's first micro-batches."""
    from train.data import build_datamodule

    dm = build_datamodule(cfg.data, seq_len=cfg.model.seq_len, micro_batch=cfg.trainer.micro_batch,
                          seed=cfg.trainer.seed)
    batches = dm.train_batches()
    student = LlamaForCausalLM.from_pretrained(src, hidden_act="relu", dtype=torch.float64).eval()
    teacher = LlamaForCausalLM.from_pretrained(src, dtype=torch.float64).eval()
    hs = []
    for layer in student.model.layers:
        layer.mlp.down_proj.register_forward_hook(lambda m, inp, out: hs.append(inp[0]))
    ce, l1, kl = [], [], []
    for _ in range(cfg.trainer.global_batch // cfg.trainer.micro_batch):
        ids = next(batches)
        hs.clear()
        with torch.no_grad():
            z, u = student(input_ids=ids).logits[:, :-1], teacher(input_ids=ids).logits[:, :-1]
        ce.append(F.cross_entropy(z.reshape(-1, z.shape[-1]), ids[:, 1:].reshape(-1)))
        kl.append(F.kl_div(F.log_softmax(z / T, -1), F.log_softmax(u / T, -1), log_target=True,
                           reduction="none").sum(-1).mean())
        l1.append(torch.stack([h.abs().sum(-1).mean() for h in hs]).mean())
    def mean(xs):
        return torch.stack(xs).mean().item()

    return mean(ce), mean(l1), mean(kl)


def test_logged_loss_is_ce_plus_l1_plus_kl_computed_independently(tokens, silu_dir, tmp_path):
    cfg = _distill_cfg(tokens, silu_dir)
    _run(cfg, tmp_path / "r")
    m = read_metrics(tmp_path / "r")[0]
    ce, l1, kl = _reference_step(cfg, silu_dir)
    assert kl > 0.01  # the switch to ReLU moved the student away from the teacher
    assert m["ce"] == pytest.approx(ce, rel=1e-5)
    assert m["l1"] == pytest.approx(l1, rel=1e-5)
    assert m["distill_kl"] == pytest.approx(kl, rel=1e-5)
    assert m["loss"] == pytest.approx(ce + L1 * l1 + W * T ** 2 * kl, rel=1e-5)
    assert "kl " in (tmp_path / "r" / "train.log").read_text()  # the printed line has it


def test_teacher_is_frozen_unchanged_and_in_no_checkpoint(tokens, silu_dir, tmp_path):
    summary, t = _run(_distill_cfg(tokens, silu_dir), tmp_path / "r")
    source = LlamaForCausalLM.from_pretrained(silu_dir, dtype=torch.float32).state_dict()
    teacher = t.teacher.state_dict()
    assert teacher.keys() == source.keys() and t.teacher.config.hidden_act == "silu"
    for k, v in source.items():
        assert torch.equal(teacher[k], v), k  # bitwise: no update reached it
    assert all(not p.requires_grad and p.grad is None for p in t.teacher.parameters())
    opt_ids = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    assert not opt_ids & {id(p) for p in t.teacher.parameters()}
    # the student trained (its gates moved) and its checkpoint holds the student only
    student = t.acc.unwrap_model(t.model)
    assert not torch.equal(student.model.layers[0].mlp.gate_proj.weight.detach(),
                           source["model.layers.0.mlp.gate_proj.weight"])
    saved = load_file(str(summary["paths"]["checkpoint"] + "/model.safetensors"))
    assert set(saved) == set(student.state_dict()) - {"lm_head.weight"}


def test_resume_with_distillation_over_several_epochs_is_exact(silu_dir, tmp_path):
    """A corpus of 22 blocks of 32 tokens (1 held out), 8 blocks a step: 6 steps read 2.3
    epochs; 6 straight == 3, stop, resume to 6 (the data position, L1 and KL continue)."""
    small = write_tokens(tmp_path / "small.bin", n_tokens=22 * 32)

    def cfg():
        return _distill_cfg(small, silu_dir, steps=6, save_every=3, keep_last=3)

    _, t = _run(cfg(), tmp_path / "straight")
    assert t.data.position / t.data.blocks_per_epoch > 2  # the run went past two epochs
    _run(cfg(), tmp_path / "split", stop_at_step=3)
    _run(cfg(), tmp_path / "split")
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [r["step"] for r in b] == list(range(1, 7))
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "ce", "l1", "distill_kl", "grad_norm"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-7), (ra["step"], key)


def test_distillation_config_errors(tokens, silu_dir):
    with pytest.raises(ConfigError, match="add sparsity.distill_from=source"):
        SparsityConfig(distill_weight=0.5)
    with pytest.raises(ConfigError, match="sparsity.distill_from='teacher' is unknown"):
        SparsityConfig(distill_from="teacher", distill_weight=0.5)
    with pytest.raises(ConfigError, match="distill_temperature must be a finite number > 0"):
        SparsityConfig(distill_from="source", distill_weight=0.5, distill_temperature=0.0)
    with pytest.raises(ConfigError, match="model.init_from is not set"):
        TrainConfig(sparsity=SparsityConfig(distill_from="source", distill_weight=0.5))
    assert not TrainConfig(sparsity=SparsityConfig(distill_from=None)).distill
    cfg = _distill_cfg(tokens, silu_dir)
    assert cfg.distill and not dataclasses.replace(
        cfg, sparsity=dataclasses.replace(cfg.sparsity, distill_weight=0.0)).distill


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["model", "layers"])
def test_distillation_under_compile_gives_the_eager_losses(tokens, silu_dir, tmp_path, scope):
    """trainer.compile=true: the model compiles around the eager fused CE + KL (a graph break;
    compile_scope=layers: the student's and the teacher's decoder layers); the same per-step
    losses and KL as eager (fp32, CPU inductor)."""
    eager, _ = _run(_distill_cfg(tokens, silu_dir), tmp_path / "eager")
    _, t = _run(_distill_cfg(tokens, silu_dir, compile=True, compile_scope=scope),
                tmp_path / "compiled")
    if scope == "layers":
        assert all(layer._compiled_call_impl is not None for layer in t.teacher.model.layers)
    a, b = read_metrics(tmp_path / "eager"), read_metrics(tmp_path / "compiled")
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "ce", "l1", "distill_kl"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4), (ra["step"], key)
    val = [json.loads(ln) for ln in (tmp_path / "compiled" / "metrics.jsonl").read_text()
           .splitlines() if '"kind": "val"' in ln]
    assert val and val[-1]["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-4)


def test_a_checkpoint_saved_before_the_new_keys_still_resumes(tokens, silu_dir, tmp_path):
    """A run dir whose saved configs lack model.hidden_act and sparsity.distill_* (written
    before those keys existed) resumes with trainer.resume=auto: a missing key counts as its
    default, the behaviour that run had; a key whose saved value differs still refuses."""
    import yaml

    from train.checkpoint import file_records
    from train.trainer import config_diff

    c = _cfg(tokens, silu_dir, hidden_act_from="silu")
    c.trainer = dataclasses.replace(c.trainer, max_steps=2, save_every=1)
    _, t = _run(c, tmp_path / "r", stop_at_step=1)
    old = dict(t.config_dict)
    old["model"] = {k: v for k, v in old["model"].items() if k != "hidden_act"}
    old["sparsity"] = {k: v for k, v in old["sparsity"].items() if not k.startswith("distill")}
    assert config_diff(old, t.config_dict) == []
    for f in [tmp_path / "r" / "config.yaml",
              *(tmp_path / "r" / "checkpoints").glob("step*/train_config.yaml")]:
        f.write_text(yaml.safe_dump(old))
    for ck in (tmp_path / "r" / "checkpoints").glob("step*"):  # as that run would have recorded
        meta = json.loads((ck / "metadata.json").read_text())
        meta["files"] = file_records(ck)
        (ck / "metadata.json").write_text(json.dumps(meta))
    _run(c, tmp_path / "r")
    assert [r["step"] for r in read_metrics(tmp_path / "r")] == [1, 2]
    assert config_diff({**old, "model": {**old["model"], "hidden_act": "silu"}},
                       t.config_dict) == ["model.hidden_act: 'silu' -> 'relu'"]


@pytest.mark.parametrize("other", ["weights", "vocabulary"])
def test_resume_refuses_a_replaced_teacher_and_takes_the_original_back(tokens, silu_dir,
                                                                       tmp_path, other):
    """The folder at model.init_from is replaced between a distillation run's stop and its
    resume: by another model of the same shape (the resume trained against it without a word)
    or of another vocabulary (a traceback). The run records the source's SHA-256 (init record,
    trainer state) and refuses in one line naming the file and the ways out; with the original
    back, the resumed run equals a straight one."""
    import shutil

    from tests.train.test_pretrained import SRC, _source_config

    src = shutil.copytree(silu_dir, tmp_path / "src")

    def cfg():
        return _distill_cfg(tokens, src, steps=4, save_every=2, keep_last=2)

    _run(cfg(), tmp_path / "straight")
    _, t = _run(cfg(), tmp_path / "run", stop_at_step=2)
    recorded = t.init_info["sha256"]
    assert recorded == {n: hashlib.sha256((silu_dir / n).read_bytes()).hexdigest()
                        for n in ("config.json", "model.safetensors")}
    shutil.move(src, tmp_path / "original")
    if other == "weights":
        _save_source(src, "silu", seed=5)
    else:
        torch.manual_seed(0)
        c = _source_config("silu")
        c.vocab_size = SRC["vocab_size"] + 16
        LlamaForCausalLM(c).save_pretrained(src)
    with pytest.raises(ConfigError) as err:
        Trainer(cfg(), tmp_path / "run")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(
        f"model.init_from='{src}' is not the source this run started from, whose weights are its "
        "distillation teacher (")
    name = "config.json" if other == "vocabulary" else "model.safetensors"
    assert f"({name}: SHA-256 " in msg and f"recorded {recorded[name][:16]}..." in msg
    assert f"Put the original back at {src}" in msg
    assert f"trainer.resume={tmp_path / 'run'} and model.init_from set to it, or" in msg
    shutil.rmtree(src)
    shutil.move(tmp_path / "original", src)
    _run(cfg(), tmp_path / "run")
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "run")
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "ce", "distill_kl"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-7), (ra["step"], key)
