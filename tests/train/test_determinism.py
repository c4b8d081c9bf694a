"""trainer.deterministic (train/determinism.py): torch's flags on for the run and restored by
close(), auto's FFN choices untimed, one line for an op without a deterministic version, and two
runs bitwise equal."""

import os

import pytest
import torch

from tests.train_utils import FakeClock, read_metrics, tiny_config, write_tokens
from train import determinism
from train.config import ConfigError
from train.trainer import Trainer

# measurements: they vary from run to run with or without the key
TIMING_KEYS = {"tokens_per_s", "mfu", "mfu_useful", "peak_mem_gb", "peak_mem_gb_run"}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "t.bin", n_tokens=8000)


@pytest.fixture
def torch_flags():
    """The process's flags as the test found them, put back after it whatever happens."""
    before = determinism.Saved(torch.are_deterministic_algorithms_enabled(),
                               torch.is_deterministic_algorithms_warn_only_enabled(),
                               torch.backends.cudnn.deterministic,
                               torch.backends.cudnn.benchmark,
                               os.environ.get(determinism.CUBLAS_ENV))
    yield before
    determinism.restore(before)
    if before.cublas is not None:
        os.environ[determinism.CUBLAS_ENV] = before.cublas


def _cfg(tokens, deterministic, **over):
    return tiny_config(tokens, **{"ffn.impl": "auto", "trainer.max_steps": 3,
                                  "sparsity.l1_coeff": 0.05, "trainer.deterministic": deterministic,
                                  **over})


@pytest.mark.parametrize("deterministic", [False, True])
def test_auto_is_untimed_under_deterministic(tokens, tmp_path, deterministic, torch_flags):
    """The plan is built with timed=False and every FFN's policy measures nothing, in training
    (a clock injected into the plan's timers never starts) and in inference (the measured
    choice, with a timer, leaves the call to the density rule). The control run without the
    key shows that the same clock and timer would record."""
    from twell.ops.auto import MeasuredChoice

    t = Trainer(_cfg(tokens, deterministic), tmp_path / "run")
    try:
        clock = FakeClock()
        t.plan.clock = clock  # CPU tensors are otherwise never timed
        assert t.plan.timed is (not deterministic)
        policies = [m.policy for m in t.mlps]
        assert len(policies) == 2
        assert all(p.train_measure is (not deterministic) for p in policies)
        assert all(p.infer_measure is (not deterministic) for p in policies)
        assert t.cfg.ffn.policy.infer_measure  # the config itself is unchanged
        t.train()
        assert t.step == 3
        if deterministic:
            assert clock.keys == [] and all(not tm.events for tm in t.plan.timers)
        else:
            assert {k[0] for k in clock.keys} == {0, 1}  # both layers' calls were timed
        # inference auto: a large call (past the size rules) with a timer is timed unless off
        for m in t.mlps:
            path, token = MeasuredChoice(timer=clock).begin(torch.zeros(1), 1 << 20, 0.001,
                                                            m.policy)
            assert (path is None and token is None) is deterministic
    finally:
        t.close()


def test_flags_on_while_training_and_restored_by_close(tokens, tmp_path, torch_flags):
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True  # not torch's default: close() must put it back
    torch.backends.cudnn.deterministic = False
    os.environ.pop(determinism.CUBLAS_ENV, None)
    seen = []
    t = Trainer(_cfg(tokens, True), tmp_path / "run")
    try:
        t.model.register_forward_hook(lambda *_: seen.append((
            torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark, os.environ.get(determinism.CUBLAS_ENV))))
        t.train()
    finally:
        t.close()
    assert len(seen) >= 6  # 3 steps x 2 micro-batches (and the validation)
    assert set(seen) == {(True, True, False, ":4096:8")}
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
    assert determinism.CUBLAS_ENV not in os.environ
    # a run without the key changes nothing
    t = Trainer(_cfg(tokens, False), tmp_path / "plain")
    try:
        assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
    finally:
        t.close()


def test_a_failed_setup_restores_the_flags(tokens, tmp_path, torch_flags):
    torch.use_deterministic_algorithms(False)
    cfg = _cfg(tokens, True, **{"eval.at_end": True})  # refused: the data has no tokenizer
    with pytest.raises(ConfigError, match="has no tokenizer"):
        Trainer(cfg, tmp_path / "run")
    assert not torch.are_deterministic_algorithms_enabled()
    assert determinism.CUBLAS_ENV not in os.environ or torch_flags.cublas is not None


def test_a_cublas_workspace_that_is_not_deterministic_is_refused(monkeypatch, torch_flags):
    torch.use_deterministic_algorithms(False)
    monkeypatch.setenv(determinism.CUBLAS_ENV, ":0:0")
    with pytest.raises(ConfigError) as err:
        determinism.enable(cuda=True)
    assert str(err.value) == (
        "trainer.deterministic=true: CUBLAS_WORKSPACE_CONFIG=':0:0' makes cuBLAS "
        "non-deterministic; unset it (the trainer then sets :4096:8) or set it to :4096:8 or "
        ":16:8.")
    assert not torch.are_deterministic_algorithms_enabled()  # nothing changed
    saved = determinism.enable(cuda=False)  # no cuBLAS on the CPU: the value does not matter
    assert torch.are_deterministic_algorithms_enabled()
    determinism.restore(saved)
    assert os.environ[determinism.CUBLAS_ENV] == ":0:0"  # the user's value stays
    monkeypatch.setenv(determinism.CUBLAS_ENV, ":16:8")
    determinism.restore(determinism.enable(cuda=True))
    assert os.environ[determinism.CUBLAS_ENV] == ":16:8"


def test_an_op_without_a_deterministic_version_is_one_line(torch_flags):
    """torch's own error (put_ has no deterministic version, also on the CPU) becomes one line
    naming the op and the fix, through the CLI's run() wrapper too."""
    from train.main import _deterministic_errors

    torch.use_deterministic_algorithms(True)

    def nondeterministic_op():
        torch.zeros(3).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))

    with pytest.raises(RuntimeError) as err:
        nondeterministic_op()
    line = determinism.error_line(err.value)
    assert line == ("trainer.deterministic=true: put_ has no deterministic implementation in "
                    "PyTorch (torch.use_deterministic_algorithms); set trainer.deterministic="
                    "false to run it (non-deterministic within bf16 noise), or change the "
                    "setting that uses it.")
    assert determinism.error_line(RuntimeError("CUDA out of memory")) is None
    assert determinism.error_line(ValueError(str(err.value))) is None
    with pytest.raises(ConfigError, match="^trainer.deterministic=true: put_ has no"), \
            _deterministic_errors(True):
        nondeterministic_op()
    # the key off: as raised
    with pytest.raises(RuntimeError, match="put_ does not have"), _deterministic_errors(False):
        nondeterministic_op()


def test_two_deterministic_runs_are_bitwise_equal(tokens, tmp_path, torch_flags):
    """Two tiny auto runs with the key: the same losses, metrics (measurements aside) and
    weights, bit for bit. On the CPU this holds without the key too (no timings, no
    non-deterministic kernels): the test runs the whole deterministic setup end to end."""
    runs = []
    for name in ("a", "b"):
        t = Trainer(_cfg(tokens, True, **{"trainer.max_steps": 4, "trainer.val_every": 2}),
                    tmp_path / name)
        try:
            t.train()
            weights = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
        finally:
            t.close()
        runs.append((read_metrics(tmp_path / name), read_metrics(tmp_path / name, "val"),
                     weights))
    (train_a, val_a, w_a), (train_b, val_b, w_b) = runs
    assert [r["step"] for r in train_a] == [1, 2, 3, 4] and len(val_a) == 2
    assert all(r["loss"] > 0 for r in train_a) and train_a[0]["loss"] != train_a[-1]["loss"]
    for x, y in zip(train_a, train_b, strict=True):
        assert {k: v for k, v in x.items() if k not in TIMING_KEYS} == \
            {k: v for k, v in y.items() if k not in TIMING_KEYS}
    assert val_a == val_b
    assert w_a.keys() == w_b.keys()
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)
