"""The L1 term, L0 stats, coefficient schedule, dead-neuron tracking and re-init vs references."""

import dataclasses
import math

import pytest
import torch

from train.config import ConfigError, ModelConfig, SparsityConfig
from train.model import build_model, ffn_modules
from train.recompute import enable_grad_checkpointing
from train.sparsity import (
    DeadNeuronTracker,
    L1Schedule,
    collect_stats,
    l1_coeff_at,
    l1_penalty,
    reinit_dead_gates,
)
from twell.stats import stats_from_activations


def test_l1_penalty_hand_computed():
    # layer 0: h rows |1|+|-2|+0 = 3 and 0+0+3 = 3 -> L1 3; active (gate>0): 2 and 1 units
    h0 = torch.tensor([[1.0, -2.0, 0.0], [0.0, 0.0, 3.0]])
    # layer 1: rows 0.5 and 4.5 -> L1 2.5; active 1 and 3 units
    h1 = torch.tensor([[0.5, 0.0, 0.0], [1.0, -1.5, 2.0]])
    stats = [stats_from_activations(h0, h0 != 0), stats_from_activations(h1, h1 != 0)]
    l1, sp = l1_penalty(stats)
    assert l1.item() == pytest.approx((3.0 + 2.5) / 2)
    assert sp.l1_L.tolist() == pytest.approx([3.0, 2.5])
    assert sp.l0_L.tolist() == pytest.approx([1.5, 2.0])
    assert sp.nnz_max_L.tolist() == [2.0, 3.0]
    assert sp.active_LH.tolist() == [[1, 1, 1], [2, 1, 1]]
    assert sp.n_tokens == 2


def test_l1_penalty_rejects_missing_stats():
    with pytest.raises(ValueError, match="collect_stats"):
        l1_penalty([None])


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_l1_and_grad_match_fp64_reference(gated, grad_ckpt):
    """L1 of a tiny model and d(CE + c L1)/dparams vs an independent fp64 computation of h."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=3,
                      num_heads=2, seq_len=12, gated=gated)
    model = build_model(cfg).double().train()
    if grad_ckpt:
        enable_grad_checkpointing(model)
    mlps = ffn_modules(model)
    xs = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: xs.append(args[0])) for m in mlps]
    ids = torch.randint(0, 50, (2, 12))
    out = model(input_ids=ids, labels=ids)
    for h in hooks:
        h.remove()
    xs = xs[:3]  # the first forward (checkpointing may not re-run it here)
    l1, _ = l1_penalty(collect_stats(mlps))
    ref_layers = []
    for m, x in zip(mlps, xs):  # independent fp64 formula on the captured FFN inputs
        x_ND = x.reshape(-1, 16)
        up = x_ND @ m.up_proj.weight.T
        h = torch.relu(x_ND @ m.gate_proj.weight.T) * up if gated else torch.relu(up)
        ref_layers.append(h.abs().sum(-1).mean())
    ref = torch.stack(ref_layers).mean()
    assert l1.dtype == torch.float64
    torch.testing.assert_close(l1, ref, rtol=1e-12, atol=0)
    params = list(model.parameters())
    w_up = [m.up_proj.weight for m in mlps]
    g_l1 = torch.autograd.grad(l1, w_up, retain_graph=True)
    assert min(g.abs().max().item() for g in g_l1) > 0  # the L1 term reaches every FFN
    coeff = 0.3
    g = torch.autograd.grad(out.loss + coeff * l1, params, retain_graph=True)
    g_ref = torch.autograd.grad(out.loss + coeff * ref, params)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_l1_coeff_schedule():
    const = SparsityConfig(l1_coeff=2e-5)
    assert [l1_coeff_at(s, const) for s in (0, 7, 10_000)] == [2e-5] * 3
    warm = SparsityConfig(l1_coeff=3e-4, schedule="linear_warmup", warmup_start=5000,
                          warmup_end=10000)
    got = [l1_coeff_at(s, warm) for s in (0, 4999, 5000, 6250, 7500, 10000, 20000)]
    want = [0.0, 0.0, 0.0, 0.75e-4, 1.5e-4, 3e-4, 3e-4]
    assert got == pytest.approx(want, abs=1e-15)


def test_target_l0_controller_hand_computed():
    """schedule=target_l0: l1_coeff for the first target_after steps (3 here: steps 0, 1, 2),
    then after each step c *= exp(gain * clamp(err, -1, 1))
    with err = (L0 - target) / target, L0 = sum of the layers' active counts / (L * tokens),
    kept within [l1_coeff / 100, l1_coeff * 100]."""
    cfg = SparsityConfig(l1_coeff=1e-3, target_l0=20.0, target_gain=0.1, target_after=3,
                         schedule="target_l0")
    s = L1Schedule(cfg)
    tokens = 100
    # (step, per-layer active sums over 100 tokens): L0 30 (err +0.5), 10 (-0.5), 100 (+4 -> 1)
    s.update(0, [3000.0, 3000.0], tokens)  # before target_after: no change
    s.update(1, [3000.0, 3000.0], tokens)
    assert s.at(2) == 1e-3
    s.update(2, [2000.0, 4000.0], tokens)  # L0 (20 + 40) / 2 = 30
    assert s.at(3) == pytest.approx(1e-3 * math.exp(0.05), rel=1e-12)
    s.update(3, [1000.0, 1000.0], tokens)  # L0 10: back down
    assert s.at(4) == pytest.approx(1e-3, rel=1e-12)
    s.update(4, [10000.0, 10000.0], tokens)  # L0 100: clamped to +1
    assert s.at(5) == pytest.approx(1e-3 * math.exp(0.1), rel=1e-12)
    for step in range(5, 200):  # held far above target: the coefficient stops at 100x
        s.update(step, [10000.0, 10000.0], tokens)
    assert s.at(200) == pytest.approx(0.1, rel=1e-12)
    for step in range(200, 500):  # L0 0 (err -1, clamped): down to the l1_coeff / 100 floor
        s.update(step, [0.0, 0.0], tokens)
    assert s.at(500) == pytest.approx(1e-5, rel=1e-12)
    s.update(500, [2000.0, 2000.0], tokens)  # L0 20, on target: err 0, no change
    assert s.at(501) == s.at(500)
    s.update(501, [2500.0, 2500.0], tokens)  # L0 25 (err +0.25): up from the floor
    assert s.at(502) == pytest.approx(1e-5 * math.exp(0.025), rel=1e-12)
    state = s.state_dict()
    t = L1Schedule(cfg)
    t.load_state_dict(state)
    assert t.at(502) == s.at(502)
    t.load_state_dict(None)  # a checkpoint from before the schedule: keeps what it holds
    assert t.at(502) == s.at(502)
    # continued with another l1_coeff, or from a run that was not steered: afresh at l1_coeff
    other = L1Schedule(dataclasses.replace(cfg, l1_coeff=2e-3))
    other.load_state_dict(state)
    assert other.at(0) == 2e-3
    other.load_state_dict({**state, "l1_coeff": 2e-3, "steered": False})
    assert other.at(0) == 2e-3
    # a gain so large that exp would overflow goes bound to bound
    huge = L1Schedule(dataclasses.replace(cfg, target_gain=1e4))
    huge.update(2, [3000.0, 3000.0], tokens)
    assert huge.at(3) == pytest.approx(0.1, rel=1e-12)
    huge.update(3, [0.0, 0.0], tokens)
    assert huge.at(4) == pytest.approx(1e-5, rel=1e-12)
    # other schedules ignore the L0s
    const = L1Schedule(SparsityConfig(l1_coeff=2e-5))
    const.update(5, [10000.0], tokens)
    assert const.at(6) == 2e-5


@pytest.mark.parametrize("over, field", [
    ({}, "target_l0"), ({"target_l0": 0.0}, "target_l0"), ({"target_l0": float("nan")}, "target_l0"),
    ({"target_l0": 5.0, "l1_coeff": 0.0}, "l1_coeff"),
    ({"target_l0": 5.0, "target_gain": 0.0}, "target_gain"),
    ({"target_l0": 5.0, "target_after": -1}, "target_after")])
def test_target_l0_config_errors_name_the_field(over, field):
    kw = {"l1_coeff": 1e-3, **over}
    with pytest.raises(ConfigError, match=f"sparsity.{field}") as err:
        SparsityConfig(schedule="target_l0", **kw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("schedule", ["constant", "linear_warmup"])
def test_a_target_l0_without_the_steering_schedule_is_refused(schedule):
    """sparsity.target_l0 given to a schedule that ignores it (the default group's constant,
    say, when sparsity=target was forgotten): one line naming the key and the fix."""
    with pytest.raises(ConfigError) as err:
        SparsityConfig(schedule=schedule, target_l0=20.0, warmup_start=1, warmup_end=3)
    msg = str(err.value)
    assert "\n" not in msg and "sparsity.target_l0=20.0" in msg and "sparsity=target" in msg
    assert f"this run: {schedule}" in msg


def test_dead_tracker_window_and_state():
    tr = DeadNeuronTracker(num_layers=2, hidden=3, window_tokens=8)
    assert tr.update(torch.tensor([[0, 1, 0], [2, 0, 0]], dtype=torch.int32), 4) is None
    assert tr.dead_fraction_L is None
    state = tr.state_dict()  # mid-window
    dead = tr.update(torch.tensor([[0, 0, 0], [1, 0, 3]]), 4)
    assert dead.tolist() == [[True, False, True], [False, True, False]]
    assert tr.dead_fraction_L.tolist() == pytest.approx([2 / 3, 1 / 3])
    assert tr.counts_LH.sum().item() == 0 and tr.seen == 0  # next window starts empty
    # next window: everything fires once -> nobody dead
    assert tr.update(torch.ones(2, 3, dtype=torch.int64), 8).sum().item() == 0
    # restoring the mid-window state reproduces the first window's result
    tr2 = DeadNeuronTracker(num_layers=2, hidden=3, window_tokens=8)
    tr2.load_state_dict(state)
    assert torch.equal(tr2.update(torch.tensor([[0, 0, 0], [1, 0, 3]]), 4), dead)
    with pytest.raises(ValueError, match="shape"):
        DeadNeuronTracker(3, 3, 8).load_state_dict(state)


@pytest.mark.parametrize("gated", [True, False])
def test_reinit_dead_gates_hand_computed(gated):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=20, hidden_size=8, intermediate_size=6, num_layers=2,
                      num_heads=2, seq_len=8, gated=gated)
    mlps = ffn_modules(build_model(cfg))
    name = "gate_proj" if gated else "up_proj"
    before = [getattr(m, name).weight.detach().clone() for m in mlps]
    others = [m.down_proj.weight.detach().clone() for m in mlps]
    dead = torch.tensor([[True, False, False, False, False, True],
                         [False, False, False, False, False, False]])
    lam, std = 0.1, 0.02
    reinit_dead_gates(mlps, dead, lam=lam, std=std,
                      generator=torch.Generator().manual_seed(123))
    gen = torch.Generator().manual_seed(123)
    for layer, (m, w0) in enumerate(zip(mlps, before)):
        noise = torch.randn(w0.shape, generator=gen, dtype=torch.float32)  # same draw order
        w = getattr(m, name).weight.detach()
        for j in range(6):
            if dead[layer, j]:
                expect = (1 - lam) * w0[j] + lam * std * noise[j]
                torch.testing.assert_close(w[j], expect, rtol=0, atol=1e-7)
                assert not torch.equal(w[j], w0[j])
            else:
                assert torch.equal(w[j], w0[j])
        assert torch.equal(m.down_proj.weight.detach(), others[layer])
    assert math.isfinite(sum(getattr(m, name).weight.sum().item() for m in mlps))


def test_dead_tracker_window_of_many_steps():
    """The paper's window (~1M tokens) over steps of 16,384 tokens: 64 updates per window; a
    unit active in any one step of the window is alive, the mask holds until the next closes."""
    tr = DeadNeuronTracker(num_layers=1, hidden=3, window_tokens=1_048_576)
    for step in range(1, 64):
        active = torch.tensor([[int(step == 40), 0, 1]])  # unit 0 fires at step 40 only
        assert tr.update(active, 16_384) is None, step
    assert tr.dead_LH is None and tr.dead_fraction_L is None and tr.seen == 63 * 16_384
    dead = tr.update(torch.tensor([[0, 0, 1]]), 16_384)  # step 64: 1,048,576 tokens
    assert dead.tolist() == [[False, True, False]] and tr.windows == 1
    for _ in range(63):  # second window: unit 0 never fires; the first window's mask stays
        assert tr.update(torch.tensor([[0, 2, 0]]), 16_384) is None
        assert tr.dead_fraction_L.tolist() == pytest.approx([1 / 3])
    assert tr.update(torch.tensor([[0, 0, 0]]), 16_384).tolist() == [[True, False, True]]
    # a window that is not a multiple of the step closes at the first step reaching it
    tr = DeadNeuronTracker(num_layers=1, hidden=2, window_tokens=10)
    assert tr.update(torch.tensor([[1, 0]]), 4) is None
    assert tr.update(torch.tensor([[0, 0]]), 4) is None
    assert tr.update(torch.tensor([[0, 0]]), 4).tolist() == [[False, True]]


def _reinit_pair(tokens, tmp_path, state_for):
    """Two tiny trainers on the same seed and data, with and without sparsity.reinit_dead, a
    2-step dead-neuron window; ``state_for(trainer)`` prepares each before one step."""
    from tests.train_utils import tiny_config
    from train.trainer import Trainer

    out = []
    for reinit in (True, False):
        cfg = tiny_config(tokens, **{"trainer.max_steps": 3, "sparsity.l1_coeff": 0.1,
                                     "sparsity.reinit_dead": reinit,
                                     "sparsity.dead_window_tokens": 2 * 8 * 32})
        t = Trainer(cfg, tmp_path / f"reinit_{reinit}")
        try:
            state_for(t)
            t.train(stop_at_step=1)
        finally:
            t.close()
        out.append(t)
    return out


def test_l1_reinit_hits_exactly_the_tracker_dead_units(tmp_path):
    """sparsity.reinit_dead in the trainer: a hand-made tracker state one step before its window
    closes; gate rows that are zero never fire. Dead = zero rows whose window count was 0; only
    those rows differ from the run without re-init, each by the rule's lam * N(0, std^2)."""
    from tests.train_utils import write_tokens

    tokens = write_tokens(tmp_path / "tok.bin", n_tokens=20_000)
    zero_rows = [(0, 1), (0, 4), (1, 7)]
    counts = torch.ones(2, 64, dtype=torch.int64)
    counts[0, 1] = counts[1, 7] = 0  # (0, 4) was active earlier in the window: alive
    want_dead = torch.zeros(2, 64, dtype=torch.bool)
    want_dead[0, 1] = want_dead[1, 7] = True

    def prepare(t):
        with torch.no_grad():
            for layer, j in zero_rows:
                t.mlps[layer].gate_proj.weight[j].zero_()
        t.tracker.load_state_dict({"window_tokens": 512, "counts_LH": counts.clone(),
                                   "seen": 256, "windows": 0, "dead_LH": None})

    a, b = _reinit_pair(tokens, tmp_path, prepare)
    assert torch.equal(a.tracker.dead_LH.cpu(), want_dead)
    assert torch.equal(b.tracker.dead_LH.cpu(), want_dead)
    gen = torch.Generator().manual_seed(a.cfg.trainer.seed * 1_000_003 + 1)  # the trainer's seed
    for layer, (ma, mb) in enumerate(zip(a.mlps, b.mlps)):
        wa, wb = ma.gate_proj.weight.detach(), mb.gate_proj.weight.detach()
        noise = torch.randn(tuple(wa.shape), generator=gen, dtype=torch.float32) * 0.02
        for j in range(64):
            if want_dead[layer, j]:
                assert torch.equal(wb[j], torch.zeros_like(wb[j]))  # no gradient: stays zero
                torch.testing.assert_close(wa[j], 0.9 * wb[j] + 0.1 * noise[j], rtol=0,
                                           atol=1e-9)
                assert wa[j].abs().max() > 0
            else:
                assert torch.equal(wa[j], wb[j]), (layer, j)
    for (na, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        if "gate_proj" not in na:
            assert torch.equal(pa, pb), na


def test_l1_reinit_waits_for_the_window(tmp_path):
    """A 2-step window: after step 1 no window has closed, so re-init changed nothing and
    dead_frac is not logged yet."""
    from tests.train_utils import read_metrics, write_tokens

    tokens = write_tokens(tmp_path / "tok.bin", n_tokens=20_000)

    def prepare(t):
        with torch.no_grad():
            t.mlps[0].gate_proj.weight[3].zero_()  # dead for sure, but the window is open

    a, b = _reinit_pair(tokens, tmp_path, prepare)
    assert a.tracker.dead_LH is None and a.tracker.seen == 256
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert [m["dead_frac"] for m in read_metrics(a.run_dir)] == [None]


def test_sparsity_target_group_composes_and_a_missing_target_is_one_line():
    """configs/sparsity/target.yaml: the steered schedule at the 1.5B paper L0, from step 100;
    the README's sweep over sparsity.target_l0; schedule=target_l0 alone is refused."""
    from train.config import compose

    sp = compose(["sparsity=target"]).sparsity
    assert (sp.schedule, sp.target_l0, sp.target_gain, sp.target_after, sp.l1_coeff) == (
        "target_l0", 29.0, 0.05, 100, 3e-4)
    assert compose(["sparsity=target", "sparsity.target_l0=20"]).sparsity.target_l0 == 20.0
    with pytest.raises(ConfigError, match="sparsity.target_l0") as err:
        compose(["sparsity.schedule=target_l0"])
    assert "\n" not in str(err.value)


def test_a_target_l0_above_the_ffn_width_is_one_line_naming_the_fix():
    """sparsity.target_l0 above model.intermediate_size (units per token: model=tiny has 352)
    can never be reached: refused in one line naming both keys and the bound; the width itself
    is a reachable target. A null width (from model.init_from) is checked once it is read
    (tests/train/test_pretrained.py); a target given to another schedule is refused as such."""
    from train.config import TrainConfig, compose

    with pytest.raises(ConfigError) as err:
        compose(["sparsity=target", "sparsity.target_l0=400"])
    assert str(err.value) == (
        "sparsity.target_l0=400 is more than the 352 FFN units a token has "
        "(model.intermediate_size=352), so it can never be reached; set sparsity.target_l0 "
        "<= 352.")
    assert compose(["sparsity=target", "sparsity.target_l0=352"]).sparsity.target_l0 == 352.0
    sp = compose(["sparsity=target", "sparsity.target_l0=400", "model.intermediate_size=512"])
    assert (sp.model.intermediate_size, sp.sparsity.target_l0) == (512, 400.0)
    pre = ModelConfig(name="pretrained", init_from="smollm2", vocab_size=None, hidden_size=None,
                      intermediate_size=None, num_layers=None, num_heads=None, seq_len=None)
    big = SparsityConfig(l1_coeff=3e-4, schedule="target_l0", target_l0=1e6)
    assert TrainConfig(model=pre, sparsity=big).sparsity.target_l0 == 1e6  # width not known yet
    with pytest.raises(ConfigError, match="used only by sparsity.schedule=target_l0"):
        SparsityConfig(l1_coeff=3e-4, schedule="constant", target_l0=1e6)


def test_a_target_schedule_that_never_steers_is_warned(tmp_path):
    """sparsity.target_after >= trainer.max_steps: the run stays at l1_coeff; one warning."""
    from tests.train_utils import tiny_config, write_tokens
    from train.setup import config_warnings

    tokens = write_tokens(tmp_path / "tok.bin", n_tokens=2_000)
    over = {"sparsity.l1_coeff": 0.01, "sparsity.target_l0": 8.0, "sparsity.target_after": 10,
            "sparsity.schedule": "target_l0", "trainer.max_steps": 10}
    got = [w for w in config_warnings(tiny_config(tokens, **over), torch.device("cpu"))
           if "target_after" in w]
    assert got == [("warning: sparsity.target_after=10 >= trainer.max_steps=10: the L1 "
                   "coefficient is never steered (it stays sparsity.l1_coeff=0.01); lower "
                   "sparsity.target_after.")]
    over["sparsity.target_after"] = 9
    assert not [w for w in config_warnings(tiny_config(tokens, **over), torch.device("cpu"))
                if "target_after" in w]


def test_an_l1_warmup_that_never_starts_is_warned():
    """sparsity=warmup (coefficient 0 through step warmup_start + 1) in a run that ends first:
    every step trains without L1; one warning naming the keys. A run whose last step gets some
    L1 (0-based step max_steps - 1 > warmup_start) and a warm-up of a zero coefficient get none."""
    from train.config import compose
    from train.setup import config_warnings

    def warned(*over: str) -> list[str]:
        cfg = compose(["sparsity=warmup", "eval=disabled", *over])
        return [w for w in config_warnings(cfg, torch.device("cpu")) if "warmup_start" in w]

    assert warned("trainer.max_steps=2") == [
        ("warning: sparsity.warmup_start=5000 with trainer.max_steps=2: the L1 warm-up never "
        "starts (the coefficient is 0 through step 5001, so the whole run trains without L1); "
        "lower sparsity.warmup_start and sparsity.warmup_end, raise trainer.max_steps, or use "
        "sparsity.schedule=constant.")]
    assert len(warned("trainer.max_steps=5001")) == 1  # its last step is 0-based 5000: still 0
    assert warned("trainer.max_steps=5002") == []  # step 5002 trains at l1_coeff / 5000
    assert warned("trainer.max_steps=2", "sparsity.l1_coeff=0") == []
