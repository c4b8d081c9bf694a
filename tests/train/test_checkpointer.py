"""The Checkpointer saves and restores a trainer through its ``Checkpointed`` members alone."""

from __future__ import annotations

from tests.train_utils import tiny_config, train_run, write_tokens
from train import checkpoint as ckpt_io
from train.checkpointer import Checkpointed
from train.trainer import Trainer

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
