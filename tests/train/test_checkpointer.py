"""The Checkpointer saves and restores a trainer through its ``Checkpointed`` members alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.train_utils import one_line, tiny_config, train_run, write_tokens
from train import checkpoint as ckpt_io
from train.checkpointer import Checkpointed
from train.config import ConfigError
from train.rundir import RESUME_SAFE_POLICY_KEYS
from train.trainer import Trainer
from twell.policy import FFNPolicy

MEMBERS = set(Checkpointed.__annotations__) | {"state_dict", "load_state_dict"}


class OnlyCheckpointed:
    """A trainer seen through the members ``Checkpointed`` declares: any other read fails, so
    a Checkpointer that reaches further into the trainer fails this test."""

    def __init__(self, trainer: Trainer) -> None:
        object.__setattr__(self, "_trainer", trainer)

    def __getattr__(self, name: str):
        if name not in MEMBERS:
            raise AttributeError(f"the Checkpointer read {name!r}, not a Checkpointed member")
        return getattr(self._trainer, name)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"the Checkpointer set {name!r} on the trainer")


def test_checkpointer_resumes_and_saves_through_checkpointed_members_only(tmp_path):
    tok = write_tokens(tmp_path / "t.bin", n_tokens=8_000)
    cfg = {"trainer.max_steps": 2}
    a = train_run(tiny_config(tok, **cfg), tmp_path / "a")  # saves step2 at its last step
    step2 = tmp_path / "a" / "checkpoints" / "step2"
    assert a.last_ckpt == step2 and a.saved_step == 2

    b = Trainer(tiny_config(tok, **cfg), tmp_path / "b")  # a fresh run, then restored by hand
    try:
        latest = b.checkpointer.resume(OnlyCheckpointed(b), step2)
        assert b.step == 2 and b.tokens_seen == a.tokens_seen
        assert latest == {}  # b's own metrics.jsonl: nothing logged there yet
        assert b.last_ckpt == step2 and b.saved_step == 2
        saved = b.checkpointer.save(OnlyCheckpointed(b))
        assert saved == tmp_path / "b" / "checkpoints" / "step2" == b.last_ckpt
        assert ckpt_io.verify(saved) == []
        assert (saved / "model.safetensors").read_bytes() == \
            (step2 / "model.safetensors").read_bytes()
        # a checkpoint of another run dir: b's save starts a branch of a's line
        assert b.lineage["parent"]["lineage"] == ckpt_io.lineage_id(step2)
        assert ckpt_io.lineage_id(saved) == b.lineage["id"] != ckpt_io.lineage_id(step2)
    finally:
        b.close()


def test_a_resume_may_change_ffn_policys_inference_knobs_but_not_the_others(tmp_path):
    """ffn.policy's inference-only knobs (the inference path and the consumer's schedule) may
    change on resume, with trainer.resume=auto too; the others stay part of the checkpoint's
    shape (train.rundir.RESUME_SAFE_POLICY_KEYS)."""
    fields = {f.name for f in dataclasses.fields(FFNPolicy)}
    names = [k.removeprefix("ffn.policy.") for k in RESUME_SAFE_POLICY_KEYS]
    assert set(names) <= fields  # a misspelt name would refuse its knob without a word
    assert "infer_heavy_first" in names and "ell_capacity" not in names

    tok = write_tokens(tmp_path / "t.bin", n_tokens=8_000)
    run = tmp_path / "run"
    a = train_run(tiny_config(tok, **{"trainer.max_steps": 1}), run)
    step1 = run / "checkpoints" / "step1"
    assert a.last_ckpt == step1
    want = {k: v.detach().clone() for k, v in a.model.state_dict().items()}

    def config(**policy):
        return tiny_config(tok, **{"trainer.max_steps": 1, "ffn.policy": FFNPolicy(**policy)})

    speed = {"infer_long_min_nnz": 64, "infer_timed_calls": 2, "infer_heavy_first": True,
             "infer_long_rows": 8, "infer_min_rows": 16}
    t = Trainer(config(**speed), run)  # trainer.resume=auto
    try:
        assert t.step == 1 and t.last_ckpt == step1
        got = t.model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
        assert len(t.plan.mlps) == 2
        for m in t.plan.mlps:  # the new values are the ones the layers run with
            assert (m.policy.infer_long_min_nnz, m.policy.infer_timed_calls,
                    m.policy.infer_heavy_first, m.policy.infer_long_rows,
                    m.policy.infer_min_rows) == (64, 2, True, 8, 16)
    finally:
        t.close()

    # the ELL capacity and the training path's thresholds are the checkpoint's: refused, and
    # only they are named (not the inference knob changed with them)
    with pytest.raises(ConfigError) as err:
        Trainer(config(ell_capacity=16, infer_long_rows=4), run)
    assert one_line(err) == (f"checkpoint {step1} has another model shape "
                             "(ffn.policy.ell_capacity: 0 -> 16); use the same model config or "
                             "a new hydra.run.dir.")
    with pytest.raises(ConfigError) as err:
        Trainer(tiny_config(tok, **{"trainer.max_steps": 1, "trainer.resume": str(step1),
                                    "ffn.policy": FFNPolicy(train_density_threshold=0.05)}),
                tmp_path / "other")
    assert one_line(err) == (f"checkpoint {step1} has another model shape "
                             "(ffn.policy.train_density_threshold: 0.1 -> 0.05); use the same "
                             "model config or another trainer.resume.")


def test_a_run_saved_with_the_removed_split_keys_resumes(tmp_path, monkeypatch):
    """A run saved before the split_long consumer was deleted has ffn.policy.infer_split_long /
    infer_split_parts in its config.yaml and its checkpoints' train_config.yaml: it resumes
    (trainer.resume=auto, and an explicit path from another run dir) as if they were not there
    (train.config.upgrade_saved drops them), instead of "another model shape"."""
    import train.trainer as trainer_mod
    from train.checkpointer import config_to_dict

    def yesterdays(cfg):  # the config dict yesterday's code saved: the two keys set
        d = config_to_dict(cfg)
        d["ffn"]["policy"].update(infer_split_long=32, infer_split_parts=8)
        return d

    tok = write_tokens(tmp_path / "t.bin", n_tokens=8_000)
    run = tmp_path / "run"
    with monkeypatch.context() as mp:
        mp.setattr(trainer_mod, "config_to_dict", yesterdays)
        train_run(tiny_config(tok, **{"trainer.max_steps": 1}), run)
    step1 = run / "checkpoints" / "step1"
    for saved in (run / "config.yaml", step1 / "train_config.yaml"):
        assert ckpt_io.load_yaml(saved)["ffn"]["policy"]["infer_split_long"] == 32
    assert ckpt_io.verify(step1) == []

    for resume, run_dir in (("auto", run), (str(step1), tmp_path / "other")):
        t = Trainer(tiny_config(tok, **{"trainer.max_steps": 1, "trainer.resume": resume}),
                    run_dir)
        try:
            assert t.step == 1 and t.last_ckpt == step1
        finally:
            t.close()
