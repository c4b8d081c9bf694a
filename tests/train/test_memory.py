"""The memory planner (``trainer.memory=auto``, train/memory.py): its choice on hand-made probe
numbers (fits / does not fit, fastest wins, user values kept, accumulation kept, budget default),
the step-down after an out-of-memory error, the batches a redone step reuses, the device probe
on the CPU (state untouched), and the trainer end to end with an injected probe and an injected
out-of-memory error (nothing lost)."""

import json
import math

import pytest
import torch

from tests.train_utils import read_metrics, tiny_config, write_tokens
from train import memory
from train.memory import (
    OOM,
    Candidate,
    Measurement,
    MemoryPlanner,
    StepBatches,
    default_budget_gb,
    describe,
    device_budget_gb,
    micro_batch_candidates,
    micro_batch_sizes,
    micro_batches,
    pending_optimizer_gb,
    recompute_choices,
)
from train.trainer import Trainer

T = 2048


class FakeProbe:
    """Peak ``a + b * micro`` GiB (out of memory above ``oom_gb``) and ``ms = c0 + c1 * micro``
    per mode; records the candidates probed, in order."""

    def __init__(self, lines, times, oom_gb=math.inf, bend=None):
        self.lines, self.times, self.oom_gb, self.bend = lines, times, oom_gb, bend or {}
        self.calls = []

    def peak(self, c):
        a, b = self.lines[c.recompute]
        return a + b * c.micro_batch + self.bend.get(c, 0.0)

    def __call__(self, c):
        self.calls.append(c)
        p = self.peak(c)
        if p > self.oom_gb:
            return OOM
        c0, c1 = self.times[c.recompute]
        return Measurement(p, c0 + c1 * c.micro_batch)


# per mode: peak GiB = a + b * micro (activations shrink with recomputation); time = c0 + c1 * m
LINES = {"none": (30.0, 6.0), "attention": (30.0, 3.0), "full": (30.0, 0.8)}
TIMES = {"none": (20.0, 60.0), "attention": (20.0, 68.0), "full": (20.0, 80.0)}


def _planner(probe, budget=100.0, **kw):
    kw = {"batch_per_rank": 64, "seq_len": T, "budget_gb": budget, **kw}
    return MemoryPlanner(probe, **kw)


def test_micro_batches_and_recompute_choices():
    assert micro_batches(12) == [1, 2, 3, 4, 6, 12]
    assert micro_batches(1) == [1]
    with pytest.raises(ValueError, match="batch_per_rank"):
        micro_batches(0)
    # ceil(64 / a) for a = 1..64: every divisor, and 10, 11, 13, 22 (a = 7, 6, 5, 3)
    assert micro_batch_candidates(64) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 16, 22, 32, 64]
    assert micro_batch_candidates(512)[21:30] == [22, 23, 24, 25, 26, 27, 29, 31, 32]
    with pytest.raises(ValueError, match="batch_per_rank"):
        micro_batch_candidates(0)
    # ceil(P / m) micro-batches, larger first, differing by at most one, summing to P
    assert micro_batch_sizes(512, 24) == [24] * 6 + [23] * 16
    assert micro_batch_sizes(512, 12) == [12] * 39 + [11] * 4
    assert micro_batch_sizes(8, 3) == [3, 3, 2] and micro_batch_sizes(8, 4) == [4, 4]
    assert micro_batch_sizes(64, 30) == [22, 21, 21]  # none above 30; 3 of them either way
    for bad in ((8, 9), (8, 0), (0, 1)):
        with pytest.raises(ValueError, match="micro_batch"):
            micro_batch_sizes(*bad)
    assert recompute_choices(None, None) == ("none", "attention", "full")
    assert recompute_choices(None, None, compile=True) == ("none", "full")
    assert recompute_choices(True, None) == ("attention", "full")
    assert recompute_choices(False, "never") == ("none",)
    assert recompute_choices(True, "auto") == ("attention_ell",)
    assert recompute_choices(None, "always") == ("none", "full")
    with pytest.raises(ValueError, match="checkpoint_ffn"):
        recompute_choices(True, "sometimes")


def test_budget_default_leaves_the_margin():
    # 8 % of the device, at least 2 GiB: an H200's 140.4 GiB -> 129.17, a 10 GiB card -> 8
    assert default_budget_gb(140.4) == pytest.approx(140.4 * 0.92)
    assert default_budget_gb(10.0) == pytest.approx(8.0)
    assert device_budget_gb(torch.device("cpu")) is None


def test_pending_optimizer_state_is_two_moments_per_parameter_until_the_first_step():
    lin = torch.nn.Linear(64, 32)  # 64 * 32 + 32 fp32 parameters
    opt = torch.optim.AdamW(lin.parameters())
    n = 64 * 32 + 32
    assert pending_optimizer_gb(opt) == pytest.approx(2 * 4 * n / 2**30)
    lin(torch.randn(3, 64)).sum().backward()
    opt.step()
    assert pending_optimizer_gb(opt) == 0.0


def test_fastest_that_fits_wins_and_keeps_the_global_batch():
    probe = FakeProbe(LINES, TIMES)
    plan = _planner(probe).choose()
    # fits 100 GiB: none up to micro 11.7 -> 11 (64 = 4 x 11 + 2 x 10); attention up to
    # 23.3 -> 22; full up to 87.5 -> 64. tokens/ms: none 11*T/680 = 33.1, attention
    # 22*T/1516 = 29.7, full 64*T/5140 = 25.5
    assert (plan.micro_batch, plan.recompute, plan.accum) == (11, "none", 6)
    assert sum(micro_batch_sizes(64, plan.micro_batch)) == 64 and plan.fits
    assert plan.peak_gb == pytest.approx(30 + 6 * 11)
    assert plan.tok_per_ms == pytest.approx(11 * T / (20 + 60 * 11))
    # two slope probes per mode at the smallest micro-batches, then one confirmation each
    assert probe.calls == [Candidate(1, "none"), Candidate(2, "none"), Candidate(11, "none"),
                           Candidate(1, "attention"), Candidate(2, "attention"),
                           Candidate(22, "attention"), Candidate(1, "full"), Candidate(2, "full"),
                           Candidate(64, "full")]
    # a smaller budget: none only fits micro 2 (2*T/140 = 29.3 tok/ms), attention 5 (5*T/325
    # = 31.5), full 16 (16*T/1300 = 25.2)
    times = {**TIMES, "attention": (20.0, 61.0)}
    plan = _planner(FakeProbe(LINES, times), budget=45.0).choose()
    assert (plan.micro_batch, plan.recompute, plan.accum) == (5, "attention", 13)
    line = describe(plan, T)
    assert "micro_batch 5 x 2048, recompute attention, accumulation 13" in line
    assert "attention 1: 33.0 GB" in line and "5*: 45.0 GB" in line and "warning" not in line
    assert line.index("| probes none 1: 36.0 GB") < line.index("; attention 1:") < line.index(
        "; full 1:")


def test_pending_optimizer_state_counts_against_the_budget():
    plan = _planner(FakeProbe(LINES, TIMES), pending_gb=25.0).choose()
    # 25 GiB of AdamW moments to come: none fits micro 7 (97 GiB), no longer 8 (103)
    assert (plan.micro_batch, plan.recompute) == (7, "none")
    assert plan.peak_gb == pytest.approx(30 + 6 * 7 + 25)


def test_the_confirmation_probe_steps_down_when_the_line_is_wrong():
    # micro 11 without recomputation peaks 30 GiB above the line (the line predicts 96 < 100):
    # the line through micro 2 (42) and 11 (126) rises 9.33 a sequence and fits up to 8.2; 8
    # fits (78), then what lies between 8 and 11 is bisected: 10 (90) fits
    probe = FakeProbe(LINES, TIMES, bend={Candidate(11, "none"): 30.0})
    planner = _planner(probe, recompute=("none",))
    plan = planner.choose()
    assert (plan.micro_batch, plan.recompute) == (10, "none")
    assert probe.calls == [Candidate(m, "none") for m in (1, 2, 11, 8, 10)]
    assert planner.step_peak_gb(Candidate(11, "none")) == pytest.approx(126.0)


def test_slope_probes_start_at_the_loss_chunk():
    probe = FakeProbe(LINES, TIMES)
    _planner(probe, recompute=("none",), min_probe_tokens=4096).choose()
    assert probe.calls[:2] == [Candidate(2, "none"), Candidate(4, "none")]


def test_one_slope_point_or_one_fitting_point():
    # the loss chunk asks for the whole step (64 sequences): one slope probe, it fits
    probe = FakeProbe(LINES, TIMES)
    plan = _planner(probe, recompute=("full",), min_probe_tokens=64 * T).choose()
    assert probe.calls == [Candidate(64, "full")] and plan.micro_batch == 64
    # the slope probes at 8 and 16 (chunk of 8 sequences): 8 fits (78 GiB), 16 (126) does not;
    # the line through them fits up to 11.7: 11 fits, 13 (between 11 and 16) does not
    probe = FakeProbe(LINES, TIMES)
    plan = _planner(probe, recompute=("none",), min_probe_tokens=8 * T).choose()
    assert probe.calls == [Candidate(m, "none") for m in (8, 16, 11, 13)]
    assert (plan.micro_batch, plan.accum) == (11, 6)
    # ... and when 16 runs out of memory: no line, bisection over 10, 11, 13 -> 11 fits, 13 not
    probe = FakeProbe(LINES, TIMES, oom_gb=120.0)
    plan = _planner(probe, recompute=("none",), min_probe_tokens=8 * T).choose()
    assert probe.calls == [Candidate(m, "none") for m in (8, 16, 11, 13)]
    assert plan.micro_batch == 11


def test_a_peak_growing_faster_than_linearly_loses_no_fitting_micro_batch():
    # peak 9.3 + 5.3 m + 0.4 m^2 (convex): the chord through a fitting and a failed probe lies
    # above the curve, so micro-batches it rejects may fit; the largest that fits is found
    class Convex(FakeProbe):
        def peak(self, c):
            return 9.3 + 5.3 * c.micro_batch + 0.4 * c.micro_batch ** 2

    for budget in (60.0, 150.0, 420.0):
        plan = _planner(Convex(LINES, TIMES), budget=budget, batch_per_rank=60,
                        recompute=("none",)).choose()
        fitting = [m for m in memory.micro_batch_candidates(60)
                   if 9.3 + 5.3 * m + 0.4 * m * m <= budget]
        assert plan.micro_batch == max(fitting), budget


def test_an_out_of_memory_probe_does_not_fit():
    # the device runs out above 50 GiB although the budget says 100
    probe = FakeProbe(LINES, TIMES, oom_gb=50.0)
    plan = _planner(probe, recompute=("none",)).choose()
    # line from micro 1, 2 predicts 11 fits; 11 runs out, then bisection between 2 (fits) and
    # 11 over the candidates 3-8, 10: 6 runs out, 4 (54 GiB) runs out, 3 (48) fits
    assert (plan.micro_batch, plan.recompute) == (3, "none")
    assert probe.calls == [Candidate(m, "none") for m in (1, 2, 11, 6, 4, 3)]
    assert [c["peak_gb"] for c in plan.candidates] == [36.0, 42.0, 48.0, None, None, None]
    assert "4: oom" in describe(plan, T)


def test_nothing_fits_takes_the_smallest_peak_and_warns():
    plan = _planner(FakeProbe(LINES, TIMES), budget=20.0).choose()
    assert (plan.micro_batch, plan.recompute, plan.fits) == (1, "full", False)
    assert "nothing fits" in plan.why and "warning" in describe(plan, T)


def test_every_probe_out_of_memory_is_an_error():
    with pytest.raises(MemoryError, match="every probe ran out of memory"):
        _planner(FakeProbe(LINES, TIMES, oom_gb=10.0)).choose()


def test_user_values_are_kept_and_only_checked():
    probe = FakeProbe(LINES, TIMES)
    plan = _planner(probe, micro_batch=32).choose()  # recompute still the planner's
    assert probe.calls == [Candidate(32, r) for r in ("none", "attention", "full")]
    assert (plan.micro_batch, plan.recompute, plan.accum) == (32, "full", 2)  # only full fits
    probe = FakeProbe(LINES, TIMES)
    plan = _planner(probe, micro_batch=32, recompute=("none",)).choose()
    assert probe.calls == [Candidate(32, "none")]  # one probe: does it fit?
    assert (plan.micro_batch, plan.recompute, plan.fits) == (32, "none", False)
    assert "set by the user" in plan.why and "warning" in describe(plan, T)
    probe = FakeProbe(LINES, TIMES)
    plan = _planner(probe, recompute=("full",)).choose()  # micro-batch the planner's
    assert (plan.micro_batch, plan.recompute) == (64, "full")
    assert {c.recompute for c in probe.calls} == {"full"}
    # a micro-batch that does not divide the step: ceil(64 / 24) = 3 micro-batches (22, 21, 21)
    plan = _planner(FakeProbe(LINES, TIMES), micro_batch=24).choose()
    assert (plan.micro_batch, plan.recompute, plan.accum) == (24, "full", 3)
    for bad in (0, 65):
        with pytest.raises(ValueError, match="not within 1..64"):
            _planner(probe, micro_batch=bad)


def test_step_down_halves_the_micro_batch_then_recomputes_more():
    planner = _planner(FakeProbe(LINES, TIMES))
    plan = planner.choose()
    assert (plan.micro_batch, plan.recompute) == (11, "none")
    steps = []
    while (plan := planner.step_down()) is not None:
        steps.append((plan.micro_batch, plan.recompute, plan.accum))
    # the next smaller divisor first; at micro 1 the next recompute mode at the largest
    # micro-batch its line fits within the budget (attention: 22, but not above the failed
    # one's 1 -> 1)
    assert steps == [(8, "none", 8), (4, "none", 16), (2, "none", 32), (1, "none", 64),
                     (1, "attention", 64), (1, "full", 64)]
    # a user-set micro-batch stays: only the recomputation grows
    planner = _planner(FakeProbe(LINES, TIMES), micro_batch=8)
    planner.choose()
    assert [(p.micro_batch, p.recompute) for p in iter(planner.step_down, None)] == [
        (8, "attention"), (8, "full")]
    planner = _planner(FakeProbe(LINES, TIMES), micro_batch=8, recompute=("full",))
    planner.choose()
    assert planner.step_down() is None


def test_step_batches_replays_the_step_at_another_micro_batch():
    rows = torch.arange(24).reshape(12, 2)  # 12 sequences of 2 tokens
    step = [0]
    it = StepBatches(iter(rows.split(4)), per_step=8, step=lambda: step[0])
    first = [next(it), next(it)]  # step 1 drew 8 sequences in 2 batches of 4
    assert it.step_at == 0
    assert not it.rewind(9)  # more than the step
    assert it.rewind(3)  # 3 does not divide 8: balanced, 3 + 3 + 2
    again = [next(it) for _ in range(3)]
    assert torch.equal(torch.cat(again), torch.cat(first))
    assert [b.shape[0] for b in again] == [3, 3, 2]
    assert it.rewind(2)
    again = [next(it) for _ in range(4)]
    assert torch.equal(torch.cat(again), torch.cat(first))
    assert all(b.shape == (2, 2) for b in again)
    step[0] = 1
    nxt = next(it)  # the next step takes the next rows from the data module
    assert torch.equal(nxt, rows[8:12]) and it.step_at == 1
    assert not it.rewind(2)  # the step is not drawn whole


# ------------------------------------------------------------------------------- trainer


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tok") / "train.bin", n_tokens=8_000)


def _auto_cfg(tokens, **over):
    # memory first: micro_batch / grad_checkpointing null are only valid under memory=auto
    return tiny_config(tokens, **{"trainer.memory": "auto", "trainer.micro_batch": None,
                                  "trainer.grad_checkpointing": None,
                                  "trainer.checkpoint_ffn": None, "trainer.max_steps": 4,
                                  "sparsity.l1_coeff": 0.05, **over})


def test_probe_runner_leaves_the_trainer_as_it_was(tokens, tmp_path):
    tr = Trainer(tiny_config(tokens, **{"trainer.memory": "auto"}), tmp_path / "run")
    try:
        before = {k: v.clone() for k, v in tr.model.state_dict().items()}
        pos = tr.data.position
        for lp in tr.plan.layers:  # as the plan's end_step would set them
            lp.backup_rows = 7
        runner = memory.ProbeRunner(tr, timed_steps=1)
        assert runner.ids_BT.shape == (8, 32)
        assert runner.ids_BT.max() < 64 and runner.ids_BT.min() >= 0
        layers = tr.model.model.layers
        for c in (Candidate(2, "full"), Candidate(4, "none"), Candidate(1, "attention")):
            m = runner(c)
            assert math.isnan(m.peak_gb) and m.ms > 0 and not m.oom  # CPU: no peak counter
            assert m.spread == 0.0  # one timed micro-step: no spread
            assert all(layer.gradient_checkpointing == (c.recompute != "none")
                       for layer in layers)
        assert all(torch.equal(v, before[k]) for k, v in tr.model.state_dict().items())
        assert all(p.grad is None for p in tr.model.parameters())
        assert not tr.optimizer.optimizer.state and tr.data.position == pos
        assert [lp.backup_rows for lp in tr.plan.layers] == [7] * len(tr.mlps)
        m = memory.ProbeRunner(tr, timed_steps=3)(Candidate(2, "none"))
        assert m.spread >= 0.0 and math.isfinite(m.spread)  # (max - min) / median of three
    finally:
        tr.close()


def _fake_device_probe(lines, times, oom_gb=math.inf):
    def make(trainer):
        return FakeProbe(lines, times, oom_gb)
    return make


def test_trainer_trains_at_the_plan_and_records_it(tokens, tmp_path, monkeypatch):
    # micro-batch 3 with attention recomputation is the fastest that fits 100 GiB (of 8 per step:
    # micro-batches of 3, 3 and 2 sequences); attention 3*T/4, none 1*T/2, full 4*T/7 tokens/ms
    lines = {"none": (30.0, 40.0), "attention": (30.0, 20.0), "full": (30.0, 10.0)}
    times = {"none": (1.0, 1.0), "attention": (1.0, 1.0), "full": (1.0, 1.5)}
    monkeypatch.setattr(memory, "device_probe", _fake_device_probe(lines, times))
    cfg = _auto_cfg(tokens, **{"trainer.memory_budget_gb": 100.0})
    tr = Trainer(cfg, tmp_path / "auto")
    try:
        assert (tr.accum, tr.data.micro_batch) == (3, 3)
        assert all(layer.gradient_checkpointing for layer in tr.model.model.layers)
        summary = tr.train()
    finally:
        tr.close()
    assert summary["memory"]["micro_batch"] == 3 and summary["memory"]["recompute"] == "attention"
    saved = json.loads((tmp_path / "auto" / "summary.json").read_text())["memory"]
    assert saved == summary["memory"] and saved["budget_gb"] == 100.0
    rec = read_metrics(tmp_path / "auto", "memory")
    assert len(rec) == 1 and rec[0]["accum"] == 3 and len(rec[0]["candidates"]) >= 6
    log = (tmp_path / "auto" / "train.log").read_text()
    assert "memory: micro_batch 3 x 32, recompute attention, accumulation 3" in log
    # the same numbers as a run of equal micro-batches of 2 (each micro-batch weighed by its
    # sequences; recomputation changes no number)
    ref = tiny_config(tokens, **{"trainer.micro_batch": 2, "trainer.max_steps": 4,
                                 "sparsity.l1_coeff": 0.05})
    Trainer(ref, tmp_path / "ref").train()
    for a, b in zip(read_metrics(tmp_path / "auto"), read_metrics(tmp_path / "ref"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


def test_without_cuda_nothing_is_measured(tokens, tmp_path):
    tr = Trainer(_auto_cfg(tokens), tmp_path / "cpu")
    try:  # the largest divisor of 8 up to 8, no recomputation
        assert tr.memory.plan.why == "no CUDA device to measure on"
        assert (tr.accum, tr.data.micro_batch, tr.memory.plan.recompute) == (1, 8, "none")
        assert not any(layer.gradient_checkpointing for layer in tr.model.model.layers)
    finally:
        tr.close()


def test_a_budget_with_the_planner_off_is_warned_about(tokens, tmp_path, capsys):
    """trainer.memory_budget_gb under trainer.memory=off changes nothing: one warning line
    (stderr and train.log) names both keys and the fix; without a budget, no line."""
    for budget, warned in ((4.0, True), (None, False)):
        run = tmp_path / f"off_{budget}"
        tr = Trainer(tiny_config(tokens, **{"trainer.memory_budget_gb": budget}), run)
        try:
            assert tr.memory.plan is None and tr.data.micro_batch == 4  # as set
        finally:
            tr.close()
        err = capsys.readouterr().err
        line = ("warning: trainer.memory_budget_gb=4 does nothing with trainer.memory=off (the "
                "micro-batch and recomputation as set); set trainer.memory=auto to plan within "
                "it, or drop it")
        assert (line in err) is warned
        assert (line in (run / "train.log").read_text()) is warned


def _inject_oom(monkeypatch, at_step: int, where: str = "micro_steps"):
    """Raise torch.cuda.OutOfMemoryError once, in the first attempt of step ``at_step``."""
    state = {"raised": 0}
    if where == "micro_steps":
        orig = Trainer._micro_steps

        def flaky(self, ids, coeff):
            if self.step + 1 == at_step and not state["raised"]:
                state["raised"] += 1
                raise torch.cuda.OutOfMemoryError("injected: CUDA out of memory")
            return orig(self, ids, coeff)

        monkeypatch.setattr(Trainer, "_micro_steps", flaky)
    return state


def test_out_of_memory_in_a_step_steps_down_and_loses_nothing(tokens, tmp_path, monkeypatch):
    lines = {"none": (30.0, 10.0), "attention": (30.0, 5.0), "full": (30.0, 2.0)}
    times = {"none": (1.0, 1.0), "attention": (1.0, 2.0), "full": (1.0, 3.0)}
    monkeypatch.setattr(memory, "device_probe", _fake_device_probe(lines, times))
    cfg = _auto_cfg(tokens, **{"trainer.memory_budget_gb": 100.0, "trainer.max_steps": 5})
    state = _inject_oom(monkeypatch, at_step=3)
    tr = Trainer(cfg, tmp_path / "oom")
    try:
        assert (tr.memory.plan.micro_batch, tr.memory.plan.recompute) == (4, "none")
        summary = tr.train()
        assert state["raised"] == 1 and tr.step == 5 and tr.tokens_seen == 5 * 8 * 32
        assert (tr.accum, tr.data.micro_batch) == (4, 2) and tr.data.position == 5 * 8
    finally:
        tr.close()
    assert summary["memory"]["micro_batch"] == 2 and "stepped down" in summary["memory"]["why"]
    assert [r["micro_batch"] for r in read_metrics(tmp_path / "oom", "memory")] == [4, 2]
    log = (tmp_path / "oom" / "train.log").read_text()
    assert log.count("out of memory") == 1
    assert ("step 3: out of memory at micro_batch 4, recompute none; now micro_batch 2, "
            "recompute none, accumulation 4; redoing the step from the same batches") in log
    # an uninterrupted run at micro-batch 4: the same steps on the same batches (steps 3-5 at
    # micro-batch 2 sum the same gradients in another order: fp32 rounding)
    monkeypatch.undo()
    ref = tiny_config(tokens, **{"trainer.micro_batch": 4, "trainer.max_steps": 5,
                                 "sparsity.l1_coeff": 0.05})
    Trainer(ref, tmp_path / "ref").train()
    got, want = read_metrics(tmp_path / "oom"), read_metrics(tmp_path / "ref")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    for a, b in zip(got, want, strict=True):
        exact = a["step"] < 3
        assert a["loss"] == (b["loss"] if exact else pytest.approx(b["loss"], rel=1e-5))
        assert a["tokens"] == b["tokens"]


def test_a_step_down_releases_the_failed_attempt_before_the_redo(tokens, tmp_path, monkeypatch):
    """What the failed attempt held must be gone before the redo's first forward, also without
    Python's cyclic collector running on its own: the graph of its last forward (whose backward
    never ran: the FFNs' statistics hold it), the frames of the error (here in a reference
    cycle: a frame holding the error it raised) and the gradients of its finished micro-step.
    Else the redo runs out of memory again for memory the failed attempt still holds. The run
    then ends as one that chose micro-batch 2 from the start."""
    import gc
    import weakref

    from train import step as step_mod

    lines = {"none": (30.0, 10.0), "attention": (30.0, 5.0), "full": (30.0, 2.0)}
    times = {"none": (1.0, 1.0), "attention": (1.0, 2.0), "full": (1.0, 3.0)}
    monkeypatch.setattr(memory, "device_probe", _fake_device_probe(lines, times))
    cfg = _auto_cfg(tokens, **{"trainer.memory_budget_gb": 100.0})
    orig, held, seen, at = step_mod._forward, [], [], {"tr": None, "calls": 0}

    def flaky(model, ids_BT, mlps):
        tr = at["tr"]
        if held and not seen:  # the redo's first forward: what is left of the failed attempt
            seen.append({"graph": [r() is None for r in held],
                         "grads": all(p.grad is None for p in tr.model.parameters()),
                         "last_stats": all(m.last_stats is None for m in mlps)})
        out = orig(model, ids_BT, mlps)
        at["calls"] += tr.step + 1 == 3
        if at["calls"] == 2 and not held:  # step 3's second micro-batch, after one backward
            held.extend(weakref.ref(x) for x in (out[1], *(m.last_stats for m in mlps)))
            err = torch.cuda.OutOfMemoryError("injected: CUDA out of memory")
            raise err  # the frame holds err, err's traceback the frame: a cycle
        return out

    monkeypatch.setattr(step_mod, "_forward", flaky)
    tr = at["tr"] = Trainer(cfg, tmp_path / "oom")
    gc.collect()
    gc.disable()
    try:
        assert (tr.memory.plan.micro_batch, tr.accum) == (4, 2)
        tr.train()
        assert tr.step == 4 and (tr.accum, tr.data.micro_batch) == (4, 2)
    finally:
        gc.enable()
        tr.close()
    assert len(held) == 1 + cfg.model.num_layers and len(seen) == 1
    assert seen[0] == {"graph": [True] * len(held), "grads": True, "last_stats": True}
    monkeypatch.undo()
    ref = tiny_config(tokens, **{"trainer.micro_batch": 2, "trainer.max_steps": 4,
                                 "sparsity.l1_coeff": 0.05})
    Trainer(ref, tmp_path / "ref").train()
    got, want = read_metrics(tmp_path / "oom"), read_metrics(tmp_path / "ref")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["tokens"] == b["tokens"]


def test_a_non_finite_loss_in_the_redo_is_raised(tokens, tmp_path, monkeypatch):
    """The redo after a step-down is a step like any other: its NaN loss stops the run (not
    taken for another out-of-memory, not swallowed)."""
    from train import step as step_mod
    from train.checkpointer import NonFiniteLossError

    lines = {"none": (30.0, 10.0), "attention": (30.0, 5.0), "full": (30.0, 2.0)}
    times = {"none": (1.0, 1.0), "attention": (1.0, 2.0), "full": (1.0, 3.0)}
    monkeypatch.setattr(memory, "device_probe", _fake_device_probe(lines, times))
    orig, calls = step_mod._forward, []

    def flaky(model, ids_BT, mlps):
        out, ce, l1, sp = orig(model, ids_BT, mlps)
        calls.append(1)
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("injected: CUDA out of memory")
        return out, ce * math.nan, l1, sp

    monkeypatch.setattr(step_mod, "_forward", flaky)
    tr = Trainer(_auto_cfg(tokens, **{"trainer.memory_budget_gb": 100.0}), tmp_path / "nan")
    try:
        with pytest.raises(NonFiniteLossError, match="at step 1"):
            tr.train()
        assert tr.step == 0 and tr.data.micro_batch == 2 and len(calls) == 1 + 4
    finally:
        tr.close()
    assert "step 1: out of memory at micro_batch 4" in (tmp_path / "nan" / "train.log").read_text()


def test_out_of_memory_when_nothing_can_step_down_saves_the_finished_steps(tokens, tmp_path,
                                                                           monkeypatch):
    """memory=off: nothing steps down, so the run stops with one line (a ConfigError: exit 2),
    after saving step 1, which had finished, with the data position before step 2."""
    from train import checkpoint as ckpt_io
    from train.trainer import OutOfMemory

    _inject_oom(monkeypatch, at_step=2)
    tr = Trainer(tiny_config(tokens, **{"trainer.max_steps": 3}), tmp_path / "off")
    try:
        with pytest.raises(OutOfMemory) as err:
            tr.train()
        assert tr.step == 1
    finally:
        tr.close()
    step1 = tmp_path / "off" / "checkpoints" / "step1"
    msg = str(err.value)
    assert msg.startswith("out of memory on the CPU in step 2 (injected: CUDA out of memory); "
                          f"step 1 is in checkpoint {step1}.") and "\n" not in msg
    assert ckpt_io.verify(step1) == []
    assert ckpt_io.load_state(step1, "rank0")["data"]["position"] == 8  # one step of 8 blocks


def test_out_of_memory_saves_after_the_failed_step_is_released(tokens, tmp_path, monkeypatch):
    """The checkpoint of the finished steps is written once the failed attempt is gone: a tensor
    local to the frame that ran out of memory is no longer alive (inside the ``except`` block
    the error's traceback kept it, next to the checkpoint's copies)."""
    import weakref

    from train.trainer import OutOfMemory

    held = {}

    def failing(self, ids, coeff):
        big = torch.ones(1024)  # what the failed attempt holds in its frames
        held["ref"] = weakref.ref(big)
        raise torch.cuda.OutOfMemoryError("injected: CUDA out of memory")

    orig_micro, orig_save = Trainer._micro_steps, Trainer.save_checkpoint
    seen = []

    def micro(self, ids, coeff):
        return failing(self, ids, coeff) if self.step + 1 == 2 else orig_micro(self, ids, coeff)

    def save(self, *a, **k):
        seen.append(held.get("ref") is not None and held["ref"]() is None)
        return orig_save(self, *a, **k)

    monkeypatch.setattr(Trainer, "_micro_steps", micro)
    monkeypatch.setattr(Trainer, "save_checkpoint", save)
    tr = Trainer(tiny_config(tokens, **{"trainer.max_steps": 3}), tmp_path / "off")
    try:
        with pytest.raises(OutOfMemory):
            tr.train()
    finally:
        tr.close()
    assert seen == [True]


def test_out_of_memory_in_the_optimizer_step_propagates(tokens, tmp_path, monkeypatch):
    """An update may be half applied: the step is not redone."""
    lines = {"none": (30.0, 10.0), "attention": (30.0, 5.0), "full": (30.0, 2.0)}
    times = {"none": (1.0, 1.0), "attention": (1.0, 2.0), "full": (1.0, 3.0)}
    monkeypatch.setattr(memory, "device_probe", _fake_device_probe(lines, times))
    tr = Trainer(_auto_cfg(tokens, **{"trainer.memory_budget_gb": 100.0}), tmp_path / "opt")

    def hook(opt, args, kwargs):  # runs inside torch.optim's step wrapper
        raise torch.cuda.OutOfMemoryError("injected in the optimizer")

    tr.optimizer.optimizer.register_step_pre_hook(hook)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError, match="in the optimizer"):
            tr.train()
        assert tr.step == 0 and tr.data.micro_batch == 4
    finally:
        tr.close()


def test_out_of_memory_after_the_optimizer_step_propagates(tokens, tmp_path, monkeypatch):
    """Outside torch.optim but after the update (the L1 controller's update): a redo would
    apply the step's update twice."""
    lines = {"none": (30.0, 10.0), "attention": (30.0, 5.0), "full": (30.0, 2.0)}
    times = {"none": (1.0, 1.0), "attention": (1.0, 2.0), "full": (1.0, 3.0)}
    monkeypatch.setattr(memory, "device_probe", _fake_device_probe(lines, times))
    tr = Trainer(_auto_cfg(tokens, **{"trainer.memory_budget_gb": 100.0}), tmp_path / "l1")

    def update(*a, **k):
        raise torch.cuda.OutOfMemoryError("injected after the update")

    monkeypatch.setattr(tr.l1, "update", update)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError, match="after the update"):
            tr.train()
        assert tr.step == 0 and tr.data.micro_batch == 4
    finally:
        tr.close()


def test_a_resumed_run_plans_again(tokens, tmp_path, monkeypatch):
    """A run started with fixed values continues under the planner (the memory keys are
    execution keys of a resume) at the planned micro-batch, from the checkpoint's data position."""
    over = {"trainer.max_steps": 4, "sparsity.l1_coeff": 0.05}
    first = Trainer(tiny_config(tokens, **over), tmp_path / "run")
    first.train(stop_at_step=2)
    first.close()
    lines = {"none": (30.0, 10.0), "attention": (30.0, 5.0), "full": (30.0, 2.0)}
    times = {"none": (1.0, 1.0), "attention": (1.0, 2.0), "full": (1.0, 3.0)}
    monkeypatch.setattr(memory, "device_probe", _fake_device_probe(lines, times))
    tr = Trainer(_auto_cfg(tokens, **{"trainer.memory_budget_gb": 45.0}), tmp_path / "run")
    try:
        assert tr.step == 2 and tr.data.position == 2 * 8
        assert (tr.memory.plan.micro_batch, tr.memory.plan.recompute) == (1, "none")
        assert tr.memory.planner.pending_gb == 0.0  # the optimizer state came with the checkpoint
        tr.train()
    finally:
        tr.close()
    Trainer(tiny_config(tokens, **over), tmp_path / "ref").train()
    got, want = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "ref")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


class PathProbe(FakeProbe):
    """FakeProbe whose lines are ``dense`` while the trainer's FFNs train densely and ``ell``
    once most of them are on the ELL path (its activations are smaller)."""

    def __init__(self, trainer, dense, ell, times):
        super().__init__(dense, times)
        self.tr, self.dense, self.ell = trainer, dense, ell

    def __call__(self, c):
        paths = self.tr.plan.paths
        self.lines = self.ell if paths.count("ell") * 2 >= len(paths) else self.dense
        return super().__call__(c)


# one sequence of dense activations costs 30 GiB, of ELL ones 10 (peak = 30 + b * micro)
DENSE = {"none": (30.0, 30.0), "attention": (30.0, 20.0), "attention_ell": (30.0, 20.0),
         "full": (30.0, 10.0)}
ELL = {"none": (30.0, 10.0), "attention": (30.0, 8.0), "attention_ell": (30.0, 8.0),
       "full": (30.0, 5.0)}
STEP_TIMES = {"none": (1.0, 1.0), "attention": (1.0, 1.2), "attention_ell": (1.0, 1.3),
              "full": (1.0, 1.5)}


def _settling_run(tokens, tmp_path, monkeypatch, name, impl="auto", initial=False, **over):
    from twell.policy import FFNPolicy

    monkeypatch.setattr(memory, "device_probe",
                        lambda tr: PathProbe(tr, DENSE, ELL, STEP_TIMES))
    if not initial:  # a fresh model starts dense (~50 % active): the first choice comes later
        monkeypatch.setattr(memory, "choose_initial_paths", lambda *a, **k: None)
    # the ELL op's PyTorch backend (read per call): these runs test the planner, not the
    # kernels, which took ~14 min a test through triton's interpreter
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # every layer goes to ell after step 1 (no density limit; an ELL capacity of H: no heavy row)
    cfg = _auto_cfg(tokens, **{"trainer.memory_budget_gb": 100.0, "trainer.max_steps": 6,
                               "ffn.impl": impl,
                               "ffn.policy": FFNPolicy(ell_capacity=64,
                                                             train_density_threshold=1.0),
                               **over})
    tr = Trainer(cfg, tmp_path / name)
    tr.memory.replan_after_steps = 2
    try:
        start = tr.memory.plan
        tr.train()
    finally:
        tr.close()
    return tr, start


def test_the_planner_plans_again_once_the_ffn_paths_settle(tokens, tmp_path, monkeypatch):
    tr, start = _settling_run(tokens, tmp_path, monkeypatch, "settle")
    # step 0, dense: without recomputation micro 2 fits (90 GiB) and is fastest (64 / 3 tok/ms)
    assert (start.micro_batch, start.recompute, start.accum) == (2, "none", 4)
    # ell from step 1; paths unchanged for 2 more steps -> re-plan after step 3: micro 4 fits
    # now (70 GiB; 8: 110) at 128 / 5 = 25.6 tok/ms against micro 2's 21.3 measured now
    plan = tr.memory.plan
    assert (plan.micro_batch, plan.recompute, plan.accum) == (4, "none", 2)
    assert "re-planned at step 3, 2 of 2 FFN layers on ell" in plan.why
    assert (tr.data.micro_batch, tr.accum, tr.plan.rows_per_call) == (4, 2, 4 * 32)
    assert tr.step == 6 and tr.tokens_seen == 6 * 8 * 32 and tr.data.position == 6 * 8
    assert {c["recompute"] for c in plan.candidates} >= {"attention_ell"}  # joins the re-plan
    recs = read_metrics(tmp_path / "settle", "memory")
    assert [(r["step"], r["micro_batch"]) for r in recs] == [(0, 2), (3, 4)]
    log = (tmp_path / "settle" / "train.log").read_text()
    assert log.count("re-planned at step 3") == 1  # once
    assert [r["step"] for r in read_metrics(tmp_path / "settle")] == [1, 2, 3, 4, 5, 6]


def test_the_re_plan_keeps_user_values_and_needs_ell_layers(tokens, tmp_path, monkeypatch):
    # the user's micro-batch stays; only the recomputation could change (none stays fastest)
    tr, start = _settling_run(tokens, tmp_path, monkeypatch, "user",
                              **{"trainer.micro_batch": 2})
    assert tr.memory.plan.micro_batch == start.micro_batch == 2
    assert "re-planned at step 3" in tr.memory.plan.why and "kept" in tr.memory.plan.why
    assert all(c["micro_batch"] == 2 for c in tr.memory.plan.candidates)
    # dense FFNs (impl torch): the paths never move to ell, no re-plan
    tr, start = _settling_run(tokens, tmp_path, monkeypatch, "torch", impl="torch")
    assert tr.memory.plan is start
    assert len(read_metrics(tmp_path / "torch", "memory")) == 1


def test_an_already_sparse_model_is_planned_on_its_sparse_paths(tokens, tmp_path, monkeypatch):
    # the same run as above, the measuring forward left on: every layer's density is below the
    # threshold (1.0), so the plan at step 0 probes the ELL step and takes micro 4 at once
    tr, start = _settling_run(tokens, tmp_path, monkeypatch, "sparse", initial=True)
    assert (start.micro_batch, start.recompute, start.accum) == (4, "none", 2)
    log = (tmp_path / "sparse" / "train.log").read_text()
    assert "ffn: 2 of 2 layers start on ell" in log
    recs = read_metrics(tmp_path / "sparse", "memory")
    assert recs[0]["step"] == 0 and recs[0]["micro_batch"] == 4
    assert tr.step == 6 and tr.tokens_seen == 6 * 8 * 32


def _mlp_inputs(tr, ids):
    """Each FFN's input rows (fp64) of a forward of ``ids``, by hooks (the reference)."""
    got = []
    hooks = [m.register_forward_hook(lambda m, a, out: got.append(a[0].detach().double()))
             for m in tr.mlps]
    try:
        with torch.no_grad():
            tr.model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return [x.reshape(-1, x.shape[-1]) for x in got]


def test_initial_paths_come_from_each_layers_own_l0(tokens, tmp_path):
    tr = Trainer(tiny_config(tokens, **{"ffn.impl": "auto"}), tmp_path / "l0")
    try:
        seen = []

        def chooser(m):  # records what the plan's chooser is given
            seen.append(m)
            return "ell" if m.layer == 0 else "dense"

        tr.plan.chooser = chooser
        ids = memory.probe_batch(tr.data, 8, tr.cfg.model.vocab_size, 0)
        layer0 = tr.model.model.layers[0]
        ckpt = []  # the measuring forward checkpoints whole layers (keeps no activations)
        hook = layer0.register_forward_pre_hook(lambda mod, a: ckpt.append(
            mod.gradient_checkpointing))
        try:
            line = memory.choose_initial_paths(tr, ids)
        finally:
            hook.remove()
        assert ckpt and all(ckpt)
        assert all(m.last_stats is None for m in tr.mlps)  # the forward's graph is not kept
        assert tr.plan.paths == ["ell", "dense"] and "1 of 2 layers start on ell" in line
        # L0 = active units per token of relu(x Wg^T), fp64 from the FFN inputs
        ref = [float(((x @ m.gate_proj.weight.double().T) > 0).sum(1).double().mean())
               for x, m in zip(_mlp_inputs(tr, ids[:memory.INITIAL_PATH_SEQUENCES]), tr.mlps)]
        assert [m.layer for m in seen] == [0, 1]
        assert [m.l0 for m in seen] == pytest.approx(ref, rel=1e-6)
        assert all(0.0 <= m.heavy_fraction <= 1.0 for m in seen)
        assert all(p.grad is None for p in tr.model.parameters())  # forward only
        # a resumed plan (it has seen steps) keeps its paths unless forced (the bench)
        tr.plan.steps = 3
        tr.plan.chooser = lambda m: "dense"
        assert memory.choose_initial_paths(tr, ids) is None
        assert tr.plan.paths == ["ell", "dense"]
        assert "0 of 2" in memory.choose_initial_paths(tr, ids, force=True)
        # a pinned layer is not chosen
        tr.plan.chooser = lambda m: "ell"
        tr.plan.pin("dense", [1])
        memory.choose_initial_paths(tr, ids, force=True)
        assert tr.plan.paths == ["ell", "dense"]
    finally:
        tr.close()


def test_a_fresh_model_starts_dense(tokens, tmp_path):
    # the default policy's density threshold: a fresh ReLU FFN (~half its units active) is dense
    tr = Trainer(tiny_config(tokens, **{"ffn.impl": "auto"}), tmp_path / "fresh")
    try:
        ids = memory.probe_batch(tr.data, 8, tr.cfg.model.vocab_size, 0)
        assert "0 of 2 layers start on ell" in memory.choose_initial_paths(tr, ids)
        assert tr.plan.paths == ["dense", "dense"]
    finally:
        tr.close()


def test_a_resume_from_a_plan_state_without_steps_keeps_its_paths(tokens, tmp_path):
    # a restored plan state with auto's paths but no steps counted (0): the trainer's step
    # says it is a resume, no measuring forward
    tr = Trainer(tiny_config(tokens, **{"ffn.impl": "auto"}), tmp_path / "v1")
    try:
        tr.plan.choose_paths([0.0, 0.0], [0.0, 0.0])  # as such a state's paths restore
        tr.step = 4  # as Trainer.resume restores it
        assert tr.plan.steps == 0 and tr.plan.paths == ["ell", "ell"]
        ids = memory.probe_batch(tr.data, 8, tr.cfg.model.vocab_size, 0)
        assert memory.choose_initial_paths(tr, ids) is None
        assert tr.plan.paths == ["ell", "ell"]  # a fresh model's density would choose dense
        assert "0 of 2" in memory.choose_initial_paths(tr, ids, force=True)
    finally:
        tr.close()


def test_below_races_the_largest_fitting_against_a_smaller_candidate():
    # without recomputation 11 fits (96 GiB of 100); below 0.85 adds 8 (0.85 * 11 = 9.35 -> the
    # largest candidate <= 9.35 of 64 per rank is 8). Times: 20 + 60 m ms, so 11 (33.1 tok/ms)
    # beats 8 (33.0) and stays; with 11 slowed to 800 ms (28.2 tok/ms) 8 wins
    probe = FakeProbe(LINES, TIMES)
    plan = _planner(probe, recompute=("none",), below=0.85).choose()
    assert probe.calls == [Candidate(m, "none") for m in (1, 2, 11, 8)]
    assert plan.micro_batch == 11

    class SlowAt11(FakeProbe):
        def __call__(self, c):
            m = super().__call__(c)
            return Measurement(m.peak_gb, 800.0) if c == Candidate(11, "none") else m

    probe = SlowAt11(LINES, TIMES)
    plan = _planner(probe, recompute=("none",), below=0.85).choose()
    assert (plan.micro_batch, plan.accum) == (8, 8)
    assert plan.tok_per_ms == pytest.approx(8 * T / (20 + 60 * 8))
    with pytest.raises(ValueError, match="below must be in"):
        _planner(probe, below=1.0)


@pytest.mark.parametrize("lead, micro", [(0.01, 11), (0.021, 11), (0.05, 8)])
def test_below_wins_only_by_more_than_the_probes_noise(lead, micro):
    # 8 probed faster than 11 by 1 % or 2.1 %: within PROBE_NOISE (3 %), the larger
    # micro-batch stays; by 5 %: 8 wins. 11's time is set so that 8's tokens/ms is
    # (1 + lead) x 11's
    assert memory.PROBE_NOISE == 0.03
    t8 = 20 + 60 * 8
    t11 = 11 * t8 * (1 + lead) / 8

    class Paced(FakeProbe):
        def __call__(self, c):
            m = super().__call__(c)
            return Measurement(m.peak_gb, t11) if c == Candidate(11, "none") else m

    plan = _planner(Paced(LINES, TIMES), recompute=("none",), below=0.85).choose()
    assert plan.micro_batch == micro
    assert plan.tok_per_ms == pytest.approx(micro * T / (t8 if micro == 8 else t11))
    assert ("largest micro-batch within 3% of the fastest that fits (8 x none"
            in plan.why) == (micro == 11)


class Speeds(FakeProbe):
    """Peak ``20 + 5 m`` GiB without recomputation (micro 16 fits 100 GiB, 17 does not) and
    the given tokens/ms (and relative spread) per micro-batch; 30 tok/ms elsewhere."""

    def __init__(self, tok, spread=None):
        super().__init__({"none": (20.0, 5.0)}, {"none": (0.0, 1.0)})
        self.tok, self.spread = tok, spread or {}

    def __call__(self, c):
        self.calls.append(c)
        ms = c.micro_batch * T / self.tok.get(c.micro_batch, 30.0)
        return Measurement(self.peak(c), ms, self.spread.get(c.micro_batch, 0.0))


@pytest.mark.parametrize("tok13, tok16, spread, micro", [
    (53.5, 52.4, 0.0, 16),  # 2 % apart (the 2B bench's probes): noise, the larger
    (60.0, 52.0, 0.0, 13),  # 15 %: 13 is faster
    (55.0, 52.4, 0.0, 13),  # 5 %: beyond PROBE_NOISE
    (55.0, 52.4, 0.06, 16),  # ... within a probe's own spread of 6 %
    (60.0, 52.0, 0.30, 13),  # a spread of 30 % counts at most PROBE_NOISE_MAX (10 %)
])
def test_the_planner_takes_the_larger_micro_batch_within_the_probes_noise(
        tok13, tok16, spread, micro):
    # 512 sequences per rank: micro 16 (accumulation 32) is the largest that fits, raced
    # against 13 (accumulation 40: the largest candidate <= 0.85 x 16), as the 2B bench's
    # default row was
    probe = Speeds({13: tok13, 16: tok16}, {13: spread})
    plan = _planner(probe, batch_per_rank=512, recompute=("none",), below=0.85).choose()
    assert probe.calls[-2:] == [Candidate(16, "none"), Candidate(13, "none")]
    assert (plan.micro_batch, plan.accum) == (micro, 512 // micro + (512 % micro > 0))
    assert plan.tok_per_ms == pytest.approx({13: tok13, 16: tok16}[micro])
    if spread:  # the log line shows a probe's own noise: +- half its spread
        mark = "*" if micro == 13 else ""
        assert f"13{mark}: 85.0 GB {tok13:.1f} tok/ms +-{50 * spread:.1f} %" in describe(plan, T)
    if micro == 16:
        assert plan.why.startswith("largest micro-batch within")
        assert "(13 x none: " in plan.why and "the probes' noise" in plan.why
        assert plan.why in describe(plan, T)
    else:
        assert plan.why == "fastest that fits"


def test_choose_within_noise_rule():
    c = Candidate
    # the larger micro-batch within 3 %; among equals the order of the options does not matter
    for opts in ([(c(13, "none"), 53.5, 0.0), (c(16, "none"), 52.4, 0.0)],
                 [(c(16, "none"), 52.4, 0.0), (c(13, "none"), 53.5, 0.0)]):
        i, note = memory.choose_within_noise(opts)
        assert opts[i][0] == c(16, "none")
        assert note == ("largest micro-batch within 3% of the fastest that fits (13 x none: "
                        "53.5 tok/ms; the probes' noise)")
    i, note = memory.choose_within_noise([(c(13, "none"), 60.0, 0.0), (c(16, "none"), 52.0, 0.0)])
    assert (i, note) == (0, "")
    # across recomputations the fastest decides; within its mode the larger
    # micro-batch: attention 24 (53.0) is fastest, none 32 (52.5) within noise stays out,
    # attention 29 (51.8, 2.3 % slower) is taken
    opts = [(c(32, "none"), 52.5, 0.0), (c(24, "attention"), 53.0, 0.0)]
    assert memory.choose_within_noise(opts) == (1, "")
    opts.append((c(29, "attention"), 51.8, 0.0))
    assert memory.choose_within_noise(opts)[0] == 2
    # nothing timed (nan): the first by recomputation
    assert memory.choose_within_noise([(c(8, "full"), math.nan, 0.0),
                                       (c(4, "none"), math.nan, 0.0)])[0] == 1
    with pytest.raises(ValueError, match="no options"):
        memory.choose_within_noise([])
