"""Convergence: the tiny model trained with ``model.ffn_impl=twell`` (sparse training kernels,
Triton under TRITON_INTERPRET=1 on CPU, else their PyTorch backend) gives the same per-step
losses, L0 and dead fractions as the dense PyTorch path from the same seed (fp32)."""

import json

import pytest

from tests.train_utils import read_metrics, tiny_config, write_tokens
from train.trainer import Trainer


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "train.bin", n_tokens=8_000)


def _losses(cfg, run_dir):
    t = Trainer(cfg, run_dir)
    try:
        t.train()
    finally:
        t.close()
    return read_metrics(run_dir)


@pytest.mark.slow
def test_twell_training_matches_torch_every_step(tokens, tmp_path):
    # L1 on, so its gradient through the sparse kernels is exercised. No held-out data: the
    # end-of-run validation would run the TwELL *inference* kernels in the interpreter (~70 s,
    # most of this test's time) and is not what is compared here.
    over = {"trainer.max_steps": 4, "sparsity.l1_coeff": 0.5, "data.val_fraction": 0.0}
    ref = _losses(tiny_config(tokens, **over), tmp_path / "torch")
    got = _losses(tiny_config(tokens, **over, **{"model.ffn_impl": "twell"}), tmp_path / "twell")
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a["step"], a["loss"], b["loss"])
        assert abs(a["ce"] - b["ce"]) < 1e-5
        assert abs(a["l0_mean"] - b["l0_mean"]) < 1e-3 * max(1.0, b["l0_mean"])
        assert a["dead_frac"] == b["dead_frac"]
    # the run really learned something and the L1 term was live
    assert ref[-1]["ce"] < ref[0]["ce"]


def test_auto_picks_training_path_per_layer_from_l0(tokens, tmp_path):
    """model.ffn_impl=auto: each layer's training path follows its logged L0 against the
    threshold (twell.ops.sparse_train.train_path_for_density), is logged, and survives resume."""
    import twell.ops.sparse_train as st
    from twell.policy import FFNPolicy

    over = {"trainer.max_steps": 2, "trainer.save_every": 1, "model.ffn_impl": "auto"}
    rows = _losses(tiny_config(tokens, **over), tmp_path / "a")
    for r in rows:  # a random-init ReLU FFN is ~50 % dense: every layer goes to dense mode
        assert r["ffn_paths"] == [st.train_path_for_density(l0 / 64, heavy_fraction=hv)
                                  for l0, hv in zip(r["l0_layers"], r["heavy_frac_layers"])]
        # ELL capacity 16 at H = 64: at ~50 % density nearly every token is a heavy row
        assert all(hv > 0.5 for hv in r["heavy_frac_layers"])
        assert r["ffn_paths"] == ["dense", "dense"]
    # dense mode (fused elementwise passes) follows the PyTorch path step for step (fp32)
    ref = _losses(tiny_config(tokens, **{**over, "model.ffn_impl": "torch"}), tmp_path / "t")
    for a, b in zip(rows, ref):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a["step"], a["loss"], b["loss"])
        assert abs(a["l0_mean"] - b["l0_mean"]) < 1e-3 * max(1.0, b["l0_mean"])
        assert a["dead_frac"] == b["dead_frac"]
    assert st.train_path_for_density(0.003) == "ell"
    assert st.train_path_for_density(0.5) == "dense"
    # density alone cannot tell i.i.d. 3 % (rows above the ELL capacity: dense mode wins) from
    # heavy-tailed 3 % (a few heavy rows: the ELL path wins); the heavy-row fraction does
    assert st.train_path_for_density(0.03, heavy_fraction=0.9) == "dense"
    assert st.train_path_for_density(0.03, heavy_fraction=0.02) == "ell"
    with pytest.raises(ValueError, match="heavy_fraction"):
        st.train_path_for_density(0.01, heavy_fraction=1.5)
    assert st.train_path_for_density(0.5, policy=FFNPolicy(train_density_threshold=0.6)) == "ell"
    with pytest.raises(ValueError, match="density"):
        st.train_path_for_density(float("nan"))
    # the choice is part of the trainer state (resume continues with the same paths), also from
    # a trainer state written before the FFN plan (ffn_train_paths, "twell" for the ELL path)
    t = Trainer(tiny_config(tokens, **over), tmp_path / "a")
    try:
        assert t.plan.choose_paths([0.0, 64.0], [0.0, 1.0]) == ["ell", "dense"]
        sd = t.state_dict()
        sd["ffn_plan"] = json.loads(json.dumps(sd["ffn_plan"]))  # plain data
        t.plan.choose_paths([64.0, 64.0], [1.0, 1.0])
        t.load_state_dict(sd)
        assert t.plan.paths == ["ell", "dense"]
        old = {k: v for k, v in sd.items() if k != "ffn_plan"}
        t.load_state_dict({**old, "ffn_train_paths": ["dense", "twell"],
                           "ffn_backup_rows": [-1, 7], "ffn_heavy_hist": [[0.0], [5.0]]})
        assert t.plan.paths == ["dense", "ell"]
        assert [lp.backup_rows for lp in t.plan.layers] == [-1, 7]
        assert t.plan.capacity.hist == [[0.0], [5.0]]
    finally:
        t.close()


@pytest.mark.slow
def test_backup_capacity_check_redoes_an_overflowed_step_exactly(tokens, tmp_path):
    """model.ffn_host_sync=step: with every layer's dense-backup capacity forced to 0 before each
    step (the tiny model's rows are all heavy at ~50 % density), every step overflows, is redone
    with per-call measurement, and the run's losses equal the ffn_host_sync=call run's; the
    redone steps are logged."""
    # no held-out data: skips the end-of-run validation (interpreted inference kernels, ~70 s
    # per run), which is not what this test checks
    over = {"trainer.max_steps": 2, "sparsity.l1_coeff": 0.5, "model.ffn_impl": "twell",
            "data.val_fraction": 0.0}
    ref = _losses(tiny_config(tokens, **over, **{"model.ffn_host_sync": "call"}), tmp_path / "c")
    t = Trainer(tiny_config(tokens, **over), tmp_path / "s")
    orig = t.train_step

    def forced(batches, interval):
        for lp in t.plan.layers:  # the test stands in for the capacity rule
            lp.backup_rows = 0
        orig(batches, interval)
        # most rows heavy: the next capacity is "measure per call"
        assert all(lp.backup_rows == -1 for lp in t.plan.layers)

    t.train_step = forced
    try:
        t.train()
    finally:
        t.close()
    got = read_metrics(tmp_path / "s")
    assert sum(r.get("ffn_backup_redos", 0) for r in got) == 2
    for a, b in zip(got, ref):
        assert a["loss"] == b["loss"] and a["l0_mean"] == b["l0_mean"], (a["step"], a, b)


def test_ffn_host_sync_is_validated_and_compile_measures_per_call(tokens, tmp_path):
    from train.config import ConfigError, ModelConfig, TrainConfig

    with pytest.raises(ConfigError, match="ffn_host_sync"):
        ModelConfig(ffn_host_sync="never")
    assert TrainConfig().model.ffn_host_sync == "step"
    # under torch.compile a capacity changing from step to step would recompile the model
    for compile_, nosync in ((False, True), (True, False)):
        t = Trainer(tiny_config(tokens, **{"model.ffn_impl": "twell",
                                           "trainer.compile": compile_}), tmp_path / str(compile_))
        try:
            assert t.plan.host_sync == ("step" if nosync else "call")
        finally:
            t.close()
