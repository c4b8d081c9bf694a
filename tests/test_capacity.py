"""The no-sync dense-backup capacity rules (``trainer.backup_capacity``): hand-computed values,
exact state round trip, and the offline simulation's redo rates."""

import math

import pytest

from twell.nn.capacity import CAPACITY_RULES, BackupCapacity


def test_window_rule_is_todays():
    b = BackupCapacity(2, "window")
    assert b.update([0, 1]) == [0, 18]  # none heavy: no backup; ceil(1.25) + 16
    assert b.update([100, 0]) == [141, 18]  # ceil(125) + 16; the 1 of the last 16 steps
    for _ in range(15):
        b.update([0, 0])
    assert b.update([0, 0]) == [0, 0]  # 16 steps later both have dropped out of the window
    b.overflowed([0])  # no effect on this rule
    assert b.margin == [1.25, 1.25]


def test_adaptive_rule_hand_computed():
    b = BackupCapacity(2, "adaptive")
    assert b.update([100, 0]) == [192, 0]  # ceil(1.25 * 100) + 16 = 141 -> 192 (x 64)
    b.overflowed([0])  # layer 0 caused a redo: margin 1.25 -> 1.875
    assert b.margin[0] == pytest.approx(1.875)
    caps = b.update([100, 0])  # decays 1 % of the way back: 1.25 + 0.625 * 0.99 = 1.86875
    assert b.margin[0] == pytest.approx(1.86875)
    assert caps == [64 * math.ceil((math.ceil(1.86875 * 100) + 16) / 64), 0] == [256, 0]
    for _ in range(10):
        b.overflowed([1])
    assert b.margin[1] == 4.0  # capped
    b2 = BackupCapacity(1, "adaptive")  # the 128-step window remembers a heavy batch
    b2.update([1000])
    for _ in range(127):
        cap = b2.update([10])[0]
    assert cap == 64 * math.ceil((1250 + 16) / 64)
    assert b2.update([10])[0] == 64  # 1000 left the window: ceil(12.5) + 16 -> 64


@pytest.mark.parametrize("rule", CAPACITY_RULES)
def test_state_round_trip_gives_the_same_capacities(rule):
    a = BackupCapacity(3, rule)
    for i in range(40):
        a.update([i % 7, 3 * i, 0])
        if i % 9 == 0:
            a.overflowed([1])
    b = BackupCapacity(3, rule)
    b.load_state_dict(a.state_dict())
    for i in range(20):
        assert a.update([i, 2 * i, i % 3]) == b.update([i, 2 * i, i % 3])
        assert a.margin == b.margin


def test_bad_rule_is_refused():
    with pytest.raises(ValueError, match="backup capacity rule"):
        BackupCapacity(2, "max")


def test_simulated_redo_rates():
    """On the synthetic 1.5B-like traces the adaptive rule redoes <= 1 step in 100 where the
    window rule redoes more (scripts/capacity_policy_sim.py)."""
    from scripts.capacity_policy_sim import make_trace, replay

    for scenario in ("docs", "early"):
        trace = make_trace(scenario, steps=1200, accum=1, seed=0)
        old = replay(trace, "window", warm=200)
        new = replay(trace, "adaptive", warm=200)
        assert new["redo_per_100"] <= 1.0 < old["redo_per_100"], (scenario, old, new)


def test_trainer_checkpoints_the_rule_state(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the op's PyTorch backend: fast
    from tests.train_utils import tiny_config, write_tokens
    from train.trainer import Trainer

    tok = write_tokens(tmp_path / "t.bin", n_tokens=8_000)
    cfg = tiny_config(tok, **{"trainer.max_steps": 2, "trainer.save_every": 2,
                              "model.ffn_impl": "twell", "trainer.backup_capacity": "adaptive"})
    t = Trainer(cfg, tmp_path / "run")
    try:
        t.train()
        t.plan.capacity.overflowed([0])  # a state that only a checkpoint of it could reproduce
        t.save_checkpoint()
        saved = t.plan.capacity.state_dict()
    finally:
        t.close()
    assert len(saved["hist"][0]) == 2 and saved["hist"][0][0] > 0
    r = Trainer(cfg, tmp_path / "run")
    try:
        assert r.step == 2 and r.plan.capacity.state_dict() == saved
    finally:
        r.close()
