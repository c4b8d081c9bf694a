"""The FFN execution plan (twell.nn.plan): the step protocol's accept / redo decisions and next
capacities on hand-made statistics, auto's choices, pins, the profiling context, the JSON state,
the module reading its entry, and a real tiny run whose layer switches between ELL and dense."""

import json
import math

import pytest
import torch

from tests.train_utils import FakeClock, read_metrics, tiny_config, write_tokens
from twell.nn import FFNPlan, PlanOptions, SparseGatedMLP, StepStats, trains_ell
from twell.nn.chooser import LayerMeasure, density_rule
from twell.nn.plan import default_path, layer_plan
from twell.ops.reference import gated_ffn_torch
from twell.policy import FFNPolicy

H = 64  # FFN width of the hand-made layers (ELL capacity 16)


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    """The sparse training op's PyTorch backend (its Triton kernels: test_ffn_train.py)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _mlps(n, impl="twell", gated=True, h=H):
    torch.manual_seed(0)
    return [SparseGatedMLP(16, h, impl=impl, gated=gated) for _ in range(n)]


def _stats(heavy_max, nnz=None, heavy=None, rows=256, tokens=512):
    n = len(heavy_max)
    return StepStats(list(heavy_max), list(nnz or [0.0] * n), list(heavy or [0.0] * n),
                     rows_per_call=rows, tokens=tokens)


def _step(plan, stats):
    plan.begin_step()
    return plan.end_step(stats)


def test_accept_sets_next_capacities_by_the_rule():
    plan = FFNPlan(_mlps(3))
    assert plan.paths == ["ell"] * 3 and [lp.backup_rows for lp in plan.layers] == [-1] * 3
    out = _step(plan, _stats([5, 0, 200]))
    assert out.accepted and out.redo == ()
    # window rule from one step (cold margin 1 + 1 - 1/4 = 1.75): ceil(1.25 * 1.75 * 5) + 16 =
    # 27; no heavy row: the floor, ceil(256 / 256) = 1 row (no sequences given); 200 of 256 rows
    # heavy (> half): the op runs the call densely, which needs the measurement
    assert [lp.backup_rows for lp in plan.layers] == [27, 1, -1]
    # the next step holds its heavy rows: accepted, capacities from the 16-step window (two
    # steps: cold margin 1 + 1/sqrt(2) - 1/4)
    out = _step(plan, _stats([23, 0, 250]))
    assert out.accepted
    cold = 1 + 2 ** -0.5 - 0.25
    assert [lp.backup_rows for lp in plan.layers] == [math.ceil(1.25 * cold * 23) + 16, 1, -1]


def test_redo_when_a_layer_exceeds_its_capacity_then_measured_step_is_accepted():
    plan = FFNPlan(_mlps(3), PlanOptions(capacity_rule="adaptive"))
    _step(plan, _stats([5, 0, 200]))
    caps = [lp.backup_rows for lp in plan.layers]
    # adaptive: ceil(1.25 * 1.91 * 5) + 16 = 28 -> 64 (multiples of 64; cold margin
    # 1 + 1 - 1/sqrt(128) = 1.91)
    assert caps == [64, 1, -1]
    margin = plan.capacity.margin[1]
    out = _step(plan, _stats([64, 2, 256]))  # layer 1 had 2 heavy rows and capacity 1 (floor)
    assert not out.accepted and out.redo == (1,)
    assert [lp.backup_rows for lp in plan.layers] == [-1, -1, -1]  # the redo measures per call
    assert plan.capacity.margin[1] == pytest.approx(margin * 1.5)  # the rule learnt of it
    assert plan.capacity.hist == [[5.0], [0.0], [200.0]]  # the redone attempt is not recorded
    out = _step(plan, _stats([64, 2, 256]))  # the redone step: every layer measured
    assert out.accepted and plan.capacity.hist[1] == [0.0, 2.0]


def test_capacity_is_checked_against_the_rows_of_a_call():
    """The op's backup holds at most rows_per_call - 1 rows (all rows: the all-dense fallback,
    which needs the measurement), so a capacity above that is checked against it."""
    plan = FFNPlan(_mlps(1))
    _step(plan, _stats([10], rows=256))
    assert plan.layers[0].backup_rows == 38  # ceil(1.25 * 1.75 * 10) + 16
    assert _step(plan, _stats([9], rows=10)).accepted  # 9 <= min(38, 9)
    plan.layers[0].backup_rows = 29
    assert _step(plan, _stats([10], rows=10)).redo == (0,)  # 10 > min(29, 9)


def test_micro_batch_check_finds_the_overflowed_layers_and_the_step_is_accepted():
    plan = FFNPlan(_mlps(3), PlanOptions(host_sync="micro_batch", capacity_rule="adaptive"))
    plan.begin_step()  # every layer measures per call: nothing to check, no host sync
    assert plan.call_overflow(torch.tensor([500.0, 500.0, 500.0]), rows=256) == []
    plan.end_step(_stats([5, 0, 200]))
    assert [lp.backup_rows for lp in plan.layers] == [64, 1, -1]  # as under host_sync=step
    margin = plan.capacity.margin[1]
    plan.begin_step()
    # layer 1 has 2 heavy rows over its capacity 1; layer 0 holds 64 of 64; layer 2 measures
    assert plan.call_overflow(torch.tensor([64.0, 2.0, 250.0]), rows=256) == [1]
    assert plan.call_overflow(torch.tensor([64.0, 2.0, 250.0]), rows=40) == [0, 1]  # min(64, 39)
    plan.overflowed_in_call([1])
    assert [lp.backup_rows for lp in plan.layers] == [64, -1, -1]  # layer 1 now measures
    assert plan.capacity.margin[1] == pytest.approx(margin * 1.5)  # the rule learnt of it
    assert plan.call_overflow(torch.tensor([64.0, 9.0, 250.0]), rows=256) == []
    out = plan.end_step(_stats([64, 2, 250]))  # the step's exact counts: accepted, not redone
    assert out.accepted and plan.capacity.hist[1] == [0.0, 2.0]


def _trace_steps(plan):
    """Steps on hand-made statistics: one accepted, one redone (layer 1 over its floor of 1)
    and its retry, one with a forward rerun of layer 0 (host_sync=micro_batch's check)."""
    _step(plan, _stats([5, 0, 200]))
    _step(plan, _stats([5, 2, 250]))
    _step(plan, _stats([5, 2, 250]))
    plan.begin_step()
    plan.overflowed_in_call([0])
    plan.end_step(StepStats([99.0, 1.0, 3.0], [0.0] * 3, [0.0] * 3, rows_per_call=256,
                            tokens=512, sequences_per_call=2))


def test_capacity_trace_records_each_attempt_and_rerun_and_changes_nothing():
    plan = FFNPlan(_mlps(3), PlanOptions(host_sync="micro_batch"))
    assert plan.capacity_trace is None  # off by default: nothing recorded
    plan.capacity_trace = trace = []
    _trace_steps(plan)
    assert [r["kind"] for r in trace] == ["step", "step", "step", "forward_rerun", "step"]
    first, redo, retry, rerun, last = trace
    # the first step measured every layer; then the window rule's [27, 1, measured]
    assert first == {"kind": "step", "step": 0, "rows_per_call": 256, "sequences_per_call": 0,
                     "paths": ["ell"] * 3, "heavy_max": [5.0, 0.0, 200.0],
                     "capacity": [None] * 3, "redo": [], "rerun": []}
    assert (redo["step"], redo["capacity"], redo["redo"]) == (1, [27, 1, None], [1])
    assert redo["heavy_max"] == [5.0, 2.0, 250.0]
    assert (retry["step"], retry["capacity"], retry["redo"]) == (1, [None] * 3, [])  # measured
    cap0 = math.ceil(1.25 * (1 + 2 ** -0.5 - 0.25) * 5) + 16  # layer 0 from [5, 5]
    assert rerun == {"kind": "forward_rerun", "step": 2, "layers": [0], "capacity": [cap0]}
    # the step record keeps the capacity layer 0 began with (the rerun measured it after)
    assert last["capacity"][0] == cap0 and last["rerun"] == [0] and last["redo"] == []
    assert (last["heavy_max"], last["sequences_per_call"]) == ([99.0, 1.0, 3.0], 2)
    # the same steps without the trace: the same decisions and state
    off = FFNPlan(_mlps(3), PlanOptions(host_sync="micro_batch"))
    _trace_steps(off)
    assert off.capacity_trace is None and off.state_dict() == plan.state_dict()
    assert "capacity_trace" not in plan.state_dict()
    plan.capacity_trace = None  # stops recording
    _step(plan, _stats([1, 1, 1]))
    assert len(trace) == 5


def test_micro_batch_check_reuses_its_limits_until_they_change():
    """The limits the micro-batch check compares with are made once while the capacities and
    rows repeat (a new device tensor is a blocking copy, a host sync, on CUDA), and
    made again when either changes."""
    plan = FFNPlan(_mlps(2), PlanOptions(host_sync="micro_batch", capacity_rule="adaptive"))
    plan.begin_step()
    plan.end_step(_stats([5, 3]))
    plan.begin_step()
    heavy = torch.tensor([1.0, 1.0])
    assert plan.call_overflow(heavy, rows=256) == []
    lim = plan._vectors["lim"][1]
    assert plan.call_overflow(heavy, rows=256) == [] and plan._vectors["lim"][1] is lim
    caps = [float(lp.backup_rows) for lp in plan.layers]
    assert lim.tolist() == caps
    assert plan.call_overflow(heavy, rows=2) == [] and plan._vectors["lim"][1].tolist() == [1, 1]
    assert plan.call_overflow(torch.tensor([2.0, 1.0]), rows=2) == [0]
    with pytest.raises(ValueError, match=r"heavy_L must be \(2,\)"):
        plan.call_overflow(torch.tensor([9.0]), rows=256)  # would broadcast against 2 limits


def test_only_ell_layers_are_checked_and_call_sync_measures_per_call():
    plan = FFNPlan(_mlps(2, impl="torch"))
    _step(plan, _stats([5, 5]))
    assert [lp.backup_rows for lp in plan.layers] == [27, 27]  # recorded, unused off ELL
    assert _step(plan, _stats([100, 100])).accepted  # torch layers: no capacity to exceed
    call = FFNPlan(_mlps(2), PlanOptions(host_sync="call"))
    _step(call, _stats([5, 0]))
    assert [lp.backup_rows for lp in call.layers] == [-1, -1]
    with pytest.raises(ValueError, match="3 layers; the plan has 2"):
        _step(call, _stats([1, 2, 3]))
    with pytest.raises(ValueError, match="host_sync"):
        FFNPlan(_mlps(1), PlanOptions(host_sync="never"))


def test_auto_chooses_from_the_steps_l0_and_heavy_fraction():
    plan = FFNPlan(_mlps(4, impl="auto"))
    assert plan.paths == ["dense"] * 4  # a fresh ReLU FFN is ~50 % dense
    # 512 tokens; L0 = nnz / 512; threshold 10 % of H = 6.4 units; heavy fraction 50 %
    nnz = [6.0 * 512, 7.0 * 512, 1.0 * 512, 1.0 * 512]
    heavy = [0.0, 0.0, 0.5 * 512, 0.51 * 512]
    out = _step(plan, _stats([0, 0, 0, 0], nnz, heavy, tokens=512))
    assert out.accepted
    assert plan.paths == ["ell", "dense", "ell", "dense"]
    assert [trains_ell(m) for m in plan.mlps] == [True, False, True, False]
    # a non-gated layer trains on torch under auto whatever its statistics
    ng = FFNPlan(_mlps(1, impl="auto", gated=False))
    assert ng.paths == ["torch"]
    assert ng.choose_paths([0.0], [0.0]) == ["torch"]


def test_a_pluggable_chooser_sees_each_layers_measure():
    seen = []

    def chooser(m: LayerMeasure) -> str:
        seen.append((m.layer, m.l0, m.heavy_fraction, m.width, m.gated))
        return "ell" if m.layer % 2 else "dense"

    plan = FFNPlan(_mlps(3, impl="auto"), chooser=chooser)
    assert plan.choose_paths([1.0, 2.0, 3.0], [0.1, 0.2, 0.3]) == ["dense", "ell", "dense"]
    assert seen == [(0, 1.0, 0.1, H, True), (1, 2.0, 0.2, H, True), (2, 3.0, 0.3, H, True)]
    bad = FFNPlan(_mlps(1, impl="auto"), chooser=lambda m: "sparse")
    with pytest.raises(ValueError, match="path must be one of"):
        bad.choose_paths([1.0], [0.0])
    # the default chooser is FFNPolicy.train_path of the layer's policy, clamped
    m = LayerMeasure(0, 2.0 * H, -0.5, H, True, FFNPolicy(train_density_threshold=1.0))
    assert density_rule(m) == "ell"  # density clamped to 1, heavy fraction to 0


def test_pin_fixes_paths_and_unpin_lets_auto_choose_again():
    plan = FFNPlan(_mlps(2, impl="auto"))
    plan.pin("ell")
    assert plan.paths == ["ell", "ell"] and plan.pinned == [True, True]
    assert plan.choose_paths([H, H], [1.0, 1.0]) == ["ell", "ell"]  # dense by the rule; pinned
    plan.pin(None, [1])
    assert plan.choose_paths([H, H], [1.0, 1.0]) == ["ell", "dense"]
    ng = FFNPlan(_mlps(1, impl="auto", gated=False))
    ng.pin("dense")
    assert ng.paths == ["torch"]  # as under auto
    with pytest.raises(ValueError, match="non-gated"):
        ng.pin("ell")
    with pytest.raises(ValueError, match="path must be one of"):
        plan.pin("twell")
    with pytest.raises(ValueError, match="out of range"):
        plan.pin("dense", [2])
    with pytest.raises(ValueError, match="non-gated"):
        FFNPlan(_mlps(1, impl="twell", gated=False))


def test_profiling_context_fixes_paths_measures_and_restores():
    plan = FFNPlan(_mlps(2, impl="auto"))
    _step(plan, _stats([5, 5], [1.0, 1.0], [0.0, 0.0]))  # L0 ~0: both to ELL, capacity 27
    plan.set_collect_stats(False)
    before = [(lp.path, lp.backup_rows, lp.collect_stats) for lp in plan.layers]
    assert before == [("ell", 27, False)] * 2
    with pytest.raises(RuntimeError, match="inside"), plan.profiling("dense") as p:
        assert p is plan
        assert [(lp.path, lp.backup_rows, lp.collect_stats) for lp in plan.layers] == [
            ("dense", -1, True)] * 2
        assert plan.choose_paths([0.0, 0.0], [0.0, 0.0]) == ["dense", "dense"]  # fixed
        raise RuntimeError("inside")
    assert [(lp.path, lp.backup_rows, lp.collect_stats) for lp in plan.layers] == before
    assert plan.pinned == [False, False]
    with plan.profiling():  # without a path: the current ones
        assert plan.paths == ["ell", "ell"]


def test_state_round_trips_through_json_and_loads_strictly():
    mlps = _mlps(3, impl="auto")
    a = FFNPlan(mlps, PlanOptions(capacity_rule="adaptive"))
    for i in range(12):
        nnz = [(i % 5) * 512.0, 40.0 * 512, 2.0 * 512]
        _step(a, _stats([i % 7, 3 * i, 0], nnz, [0.0, 0.0, 0.0]))  # some steps are redos
        if i % 4 == 3:
            a.capacity.overflowed([1])
    state = json.loads(json.dumps(a.state_dict()))
    b = FFNPlan(_mlps(3, impl="auto"), PlanOptions(capacity_rule="adaptive"))
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    for i in range(6):  # the same decisions from here on
        s = _stats([i, 2 * i, i % 3], [i * 512.0, 3.0 * 512, 9.0 * 512], [0.0] * 3)
        assert _step(a, s) == _step(b, s)
        assert b.state_dict() == a.state_dict()
    for bad, match in (({k: v for k, v in state.items() if k != "paths"}, r"missing keys \['paths'\]"),
                       ({**state, "extra": 1}, r"unexpected keys \['extra'\]"),
                       ({**state, "version": 3}, "version 3"),
                       ({**state, "paths": ["ell"] * 2}, "paths has 2 layers; the model has 3"),
                       ({**state, "paths": ["twell"] * 3}, "path must be one of")):
        with pytest.raises(ValueError, match=match):
            FFNPlan(_mlps(3, impl="auto")).load_state_dict(bad)
    # saved paths apply to auto layers only (a resume may change the impl)
    c = FFNPlan(_mlps(3, impl="twell"))
    c.load_state_dict({**state, "paths": ["dense"] * 3})
    assert c.paths == ["ell"] * 3
    c.reset_capacities()
    assert [lp.backup_rows for lp in c.layers] == [-1] * 3 and c.capacity.hist == [[], [], []]


def test_the_module_reads_its_entry():
    x = torch.randn(2, 9, 16)
    ref_mlp = _mlps(1, impl="auto")[0]
    ws = (ref_mlp.gate_proj.weight, ref_mlp.up_proj.weight, ref_mlp.down_proj.weight)
    ref, _ = gated_ffn_torch(x.double().reshape(-1, 16), *[w.double() for w in ws])
    # no plan: the default path of the impl, statistics on
    for impl, path in (("torch", "torch"), ("twell", "ell"), ("auto", "dense")):
        m = _mlps(1, impl=impl)[0]
        assert layer_plan(m).path == path == default_path(impl, True)
        y = m(x.clone().requires_grad_())
        assert (y.double().reshape(-1, 16) - ref).abs().max() < 1e-5
        assert m.last_stats is not None
        assert (m.last_info is not None and m.last_info.path == "train") == (path == "ell")
    m = _mlps(1, impl="torch")[0]
    plan = FFNPlan([m])
    for path in ("ell", "dense", "torch"):
        plan.pin(path)
        y = m(x.clone().requires_grad_())
        assert (y.double().reshape(-1, 16) - ref).abs().max() < 1e-5, path
    plan.set_collect_stats(False)
    m(x)
    assert m.last_stats is None
    with torch.no_grad():  # inference follows the module's impl, whatever the path
        torch.testing.assert_close(m(x).double().reshape(-1, 16), ref, rtol=0, atol=1e-5)


def test_hot_units_reach_the_op_only_when_set(monkeypatch):
    import twell.ops.ffn_train as st

    calls = []
    real = st.sparse_ffn_train

    def recording(*args, **kw):
        calls.append(dict(kw))
        kw.pop("hot_units", None)
        return real(*args, **kw)

    monkeypatch.setattr(st, "sparse_ffn_train", recording)
    m = _mlps(1)[0]
    plan = FFNPlan([m])
    x = torch.randn(5, 16, requires_grad=True)
    m(x)
    assert "hot_units" not in calls[-1] and calls[-1]["backup_rows"] == -1
    hot = torch.tensor([3, 7])
    plan.layers[0].hot_units = hot
    m(x)
    assert calls[-1]["hot_units"] is hot


def test_step_stats_pack_once_and_reduce():
    s = StepStats(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([5.0, 6.0]),
                  rows_per_call=8, tokens=16)
    assert s.packed().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    ops = []
    r = s.reduced(lambda t, op: (ops.append(op), t * 2)[1])
    assert ops == ["max", "sum", "sum"] and r.packed().tolist() == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    h = s.unpacked(s.packed().tolist())
    assert (h.heavy_max_L, h.nnz_sum_L, h.heavy_sum_L) == ([1.0, 2.0], [3.0, 4.0], [5.0, 6.0])
    assert (h.rows_per_call, h.tokens) == (8, 16)
    with pytest.raises(ValueError, match="3 L values"):
        s.unpacked([1.0, 2.0])


class _Alternate:
    """A chooser that flips layer 0 between dense and ELL after every step (layer 1: the
    density rule): a stand-in for a measured-time chooser."""

    def __init__(self):
        self.flips = 0

    def __call__(self, m: LayerMeasure) -> str:
        if m.layer:
            return density_rule(m)
        self.flips += 1
        return "ell" if self.flips % 2 else "dense"


def test_a_real_run_switches_a_layer_between_ell_and_dense(tmp_path):
    """A tiny run whose layer 0 alternates between the ELL kernels and dense mode step by step
    (logged as ffn_paths) trains as the PyTorch path does, step for step (fp32)."""
    from train.trainer import Trainer

    tok = write_tokens(tmp_path / "t.bin", n_tokens=8_000)
    over = {"trainer.max_steps": 4, "sparsity.l1_coeff": 0.5, "data.val_fraction": 0.0}
    runs = {}
    for impl in ("auto", "torch"):
        t = Trainer(tiny_config(tok, **over, **{"ffn.impl": impl}), tmp_path / impl)
        if impl == "auto":
            t.plan.chooser = _Alternate()
        try:
            t.train()
        finally:
            t.close()
        runs[impl] = read_metrics(tmp_path / impl)
    got, ref = runs["auto"], runs["torch"]
    # the paths chosen after each step: layer 0 flips, layer 1 stays dense (~50 % active)
    assert [r["ffn_paths"] for r in got] == [["ell", "dense"], ["dense", "dense"],
                                             ["ell", "dense"], ["dense", "dense"]]
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a["step"], a["loss"], b["loss"])
        assert abs(a["l0_mean"] - b["l0_mean"]) < 1e-3 * max(1.0, b["l0_mean"])
        assert a["dead_frac"] == b["dead_frac"]


# ------------------------------------------------------------ measured auto (training)


def _clock(per_layer):
    """FakeClock from {layer: {path: (fwd ms, bwd ms)}}."""
    return FakeClock({(k, p, kind): v for k, paths in per_layer.items()
                      for p, (f, b) in paths.items() for kind, v in (("fwd", f), ("bwd", b))})


def _plan_step(plan, mlps, x, micro=3, checkpointed=False, l0=1.0):
    """One optimizer step of the layers on their own: ``micro`` forward + backward each; the
    statistics say L0 ``l0`` and no heavy rows."""
    from torch.utils.checkpoint import checkpoint

    plan.begin_step()
    for _ in range(micro):
        for m in mlps:
            xi = x.clone().requires_grad_()
            y = checkpoint(m, xi, use_reentrant=False) if checkpointed else m(xi)
            (y.square().sum() + (0 if checkpointed else m.last_stats.l1)).backward()
    n = x.shape[0]
    return StepStats([0.0] * len(mlps), [l0 * n * micro] * len(mlps), [0.0] * len(mlps),
                     rows_per_call=n, tokens=n * micro)


def test_plan_times_each_layer_forward_and_backward_and_trains_the_same():
    clock = _clock({0: {"dense": (2.0, 3.0), "ell": (1.0, 1.5)},
                    1: {"dense": (2.0, 3.0), "ell": (4.0, 6.0)}})
    mlps = _mlps(2, impl="auto")
    plan = FFNPlan(mlps, clock=clock)
    x = torch.randn(10, 16)
    plan.end_step(_plan_step(plan, mlps, x, l0=30.0))  # dense by the rule
    # per micro-step: forward + backward = 5 ms; the first call of the path dropped
    assert [plan.chooser.layers[k].samples["dense"] for k in (0, 1)] == [[5.0, 5.0]] * 2
    assert clock.keys[:4] == [(0, "dense", "fwd"), (0, "dense", "bwd"), (1, "dense", "fwd"),
                              (1, "dense", "bwd")]
    # full recomputation: the forward runs twice, both count; the backward's time starts after
    # the replay
    clock.keys.clear()
    plan.end_step(_plan_step(plan, mlps, x, micro=1, checkpointed=True, l0=30.0))
    assert plan.chooser.layers[0].samples["dense"] == [5.0, 5.0, 7.0]
    assert clock.keys[:4] == [(0, "dense", "fwd"), (0, "dense", "bwd"), (0, "dense", "fwd"),
                              (0, "dense", "bwd")]
    # the timed step's gradients are the untimed one's, bit for bit
    grads = []
    for timed in (True, False):
        ms = _mlps(2, impl="auto")
        p = FFNPlan(ms, clock=clock, timed=timed)
        _plan_step(p, ms, x, micro=2)
        assert (p.layers[0].timing is not None) == timed
        grads.append([q.grad.clone() for m in ms for q in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    # pinned, non-auto or profiling: untimed
    plan.pin("dense", [1])
    plan.begin_step()
    assert plan.layers[0].timing is not None and plan.layers[1].timing is None
    with plan.profiling():
        assert all(lp.timing is None for lp in plan.layers)
    assert plan.layers[0].timing is not None
    tw = FFNPlan(_mlps(1, impl="twell"), clock=clock)
    tw.begin_step()
    assert tw.layers[0].timing is None


def test_plan_explores_picks_the_faster_path_per_layer_and_averages_over_ranks():
    # layer 0: ell 2.5 ms < dense 5; layer 1: ell 10 ms > dense 5 (L0 1 < 6.4: the rule says ell)
    clock = _clock({0: {"dense": (2.0, 3.0), "ell": (1.0, 1.5)},
                    1: {"dense": (2.0, 3.0), "ell": (4.0, 6.0)}})
    mlps = _mlps(2, impl="auto")
    calls = []

    def two_ranks(v):  # the other rank timed the same, plus 1 ms on layer 1's second call
        calls.append(len(v))
        other = list(v)
        other[17] += 1.0 * (v[32 + 17] > 0)
        return [a + b for a, b in zip(v, other)]

    plan = FFNPlan(mlps, clock=clock, reduce_host=two_ranks)
    x = torch.randn(10, 16)
    seen = []
    for _ in range(4):
        plan.end_step(_plan_step(plan, mlps, x, micro=4))
        seen.append(plan.paths)
    # step 1: dense timed, the rule moves both to ell; step 2: ell timed (3 after the dropped
    # first): layer 0 stays, layer 1 goes back to dense
    assert seen == [["ell", "ell"], ["ell", "dense"], ["ell", "dense"], ["ell", "dense"]]
    assert calls == [2 * 2 * 16] * 4  # 2 timed layers x 16 slots, values and counts
    assert plan.chooser.layers[1].samples["ell"] == [10.5, 10.0, 10.0]  # (10 + 11) / 2 first
    assert plan.chosen_paths == ["ell", "dense"] and plan.steps == 4


# ------------------------------------------------------------ hot units chosen by the plan


def test_plan_picks_hot_units_from_the_steps_counts():
    """FFN width 256; threshold 1/64 x 640 tokens = 10: layer 0's units 11..39 (29) are above it
    -> k 32 (multiples of 16), the 32 most active: units 8..39; layer 1 (all at 5) none; a layer
    with max_hot_units 16 takes the 16 most active, 24..39; impl torch layers none; at width 128
    32 hot units would be more than 1/8 of the units: none; below 1 % density (hot_min_density)
    none."""
    w = 256
    mlps = _mlps(4, impl="twell", h=w)
    mlps[2].policy = FFNPolicy(max_hot_units=16)
    mlps[3].impl = "torch"
    plan = FFNPlan(mlps)
    counts = torch.arange(w).clamp(max=39)
    counts[40:] = 0  # units 40.. never active
    a_LH = torch.stack([counts, torch.full((w,), 5), counts, counts]).to(torch.int64)
    zeros = torch.zeros(4)
    nnz = torch.full((4,), 0.02 * w * 640)  # 2 % density: above hot_min_density (1 %)
    stats = StepStats(zeros, nnz, zeros, rows_per_call=320, tokens=640, active_LH=a_LH)
    stats = plan.count_hot_units(stats)
    assert stats.hot_over_L.tolist() == [29.0, 0.0, 29.0, 29.0]
    host = stats.unpacked(stats.packed().tolist())  # the step's one host read carries them
    assert host.hot_over_L == [29.0, 0.0, 29.0, 29.0] and host.active_LH is a_LH
    plan.begin_step()
    assert plan.end_step(host).accepted
    hot = [lp.hot_units for lp in plan.layers]
    assert torch.equal(hot[0], torch.arange(8, 40)) and hot[1] is None
    assert torch.equal(hot[2], torch.arange(24, 40))
    assert hot[3] is None  # impl torch (not on ell): no hot units, none counted for it
    narrow = FFNPlan(_mlps(1, impl="twell", h=128))
    s = narrow.count_hot_units(StepStats(zeros[:1], zeros[:1], zeros[:1], rows_per_call=320,
                                         tokens=640, active_LH=a_LH[:1, :128]))
    narrow.begin_step()
    narrow.end_step(s.unpacked(s.packed().tolist()))
    assert s.hot_over_L.tolist() == [29.0] and narrow.layers[0].hot_units is None
    # below hot_min_density (1 % of the units per token) a layer takes none, at it some
    for density, want in ((0.0099, None), (0.0101, torch.arange(8, 40))):
        one = FFNPlan(_mlps(1, impl="twell", h=w))
        s = one.count_hot_units(StepStats(zeros[:1], torch.tensor([density * w * 640]),
                                          zeros[:1], rows_per_call=320, tokens=640,
                                          active_LH=a_LH[:1]))
        one.begin_step()
        one.end_step(s.unpacked(s.packed().tolist()))
        got = one.layers[0].hot_units
        assert (got is None) if want is None else torch.equal(got, want), density
    # an auto layer on dense gets none; a layer with max_hot_units=0 keeps what a caller set
    auto = _mlps(2, impl="auto", h=w)
    auto[1].policy = FFNPolicy(max_hot_units=0)
    p = FFNPlan(auto)
    mine = torch.tensor([1, 2])
    p.layers[1].hot_units = mine
    s = p.count_hot_units(StepStats(zeros[:2], torch.full((2,), 40.0 * 640), zeros[:2],
                                    rows_per_call=320, tokens=640, active_LH=a_LH[:2]))
    p.begin_step()
    p.end_step(s.unpacked(s.packed().tolist()))
    assert p.paths == ["dense", "dense"] and p.layers[0].hot_units is None
    assert p.layers[1].hot_units is mine
    # no layer can take hot units (impl torch everywhere): nothing counted, 3 L values read
    t = FFNPlan(_mlps(2, impl="torch", h=w))
    s = StepStats(zeros[:2], zeros[:2], zeros[:2], rows_per_call=8, tokens=8, active_LH=a_LH[:2])
    assert t.count_hot_units(s) is s and s.packed().numel() == 6
    with pytest.raises(ValueError, match="4 L values"):
        plan.count_hot_units(stats).unpacked([0.0] * 12)


def test_hot_units_are_plan_state_and_reach_the_inference_op(monkeypatch):
    from twell.ops import ffn

    mlps = _mlps(2, impl="twell")
    plan = FFNPlan(mlps)
    plan.layers[0].hot_units = torch.tensor([3, 9, 12])
    state = json.loads(json.dumps(plan.state_dict()))
    assert state["hot_units"] == [[3, 9, 12], None]
    other = FFNPlan(_mlps(2, impl="twell"))
    other.load_state_dict(state)
    assert other.layers[0].hot_units.tolist() == [3, 9, 12] and other.layers[1].hot_units is None
    for bad in ([[3, 3], None], [[64], None]):
        with pytest.raises(ValueError, match="hot_units of layer 0"):
            FFNPlan(_mlps(2, impl="twell")).load_state_dict({**state, "hot_units": bad})
    v1 = {k: state[k] for k in ("impls", "paths", "backup_rows", "capacity")}
    with pytest.raises(ValueError, match="FFN plan state version 1; this twell reads 2"):
        FFNPlan(_mlps(2, impl="twell")).load_state_dict({"version": 1, **v1})  # no reader kept
    calls = []
    real = ffn.sparse_ffn

    def recording(*args, **kw):
        calls.append(kw.get("hot_units"))
        return real(*args, **kw)

    monkeypatch.setattr(ffn, "sparse_ffn", recording)
    x = torch.randn(7, 16)
    ws = (mlps[0].gate_proj.weight, mlps[0].up_proj.weight, mlps[0].down_proj.weight)
    with torch.no_grad():
        want = gated_ffn_torch(x.double(), *[w.double() for w in ws])[0]
        y0, _y1 = mlps[0](x), mlps[1](x)
        cold, _ = real(x, *ws, mode="twell")  # the same op without hot units
    assert calls[0] is plan.layers[0].hot_units and calls[1] is None
    # as close to the fp64 reference as the op without hot units is (its CPU rounding)
    assert (y0.double() - want).abs().max() <= 2 * (cold.double() - want).abs().max() + 1e-6


def _run(tmp_path, name, over, clock=None, stop_at=None):
    from train.trainer import Trainer

    tok = write_tokens(tmp_path / "t.bin", n_tokens=8_000)
    t = Trainer(tiny_config(tok, **over), tmp_path / name)
    if clock is not None:
        t.plan.clock = clock
    try:
        t.train(stop_at_step=stop_at)
    finally:
        t.close()
    return t


def test_hot_units_train_as_without_them(tmp_path):
    """A tiny twell run (FFN width 256, ELL capacity 128) with the plan's hot units (the units
    active on > 0.65 of the tokens: 16 of 256) and one without (max_hot_units=0): the same losses
    up to fp32 rounding."""
    base = {"trainer.max_steps": 4, "sparsity.l1_coeff": 0.5, "data.val_fraction": 0.0,
            "ffn.impl": "twell", "model.intermediate_size": 256}
    runs = {}
    for name, pol in (("hot", FFNPolicy(hot_unit_fraction=0.65, ell_capacity=128)),
                      ("cold", FFNPolicy(max_hot_units=0, ell_capacity=128))):
        _run(tmp_path, name, {**base, "ffn.policy": pol})
        runs[name] = read_metrics(tmp_path / name)
    hot = [r.get("ffn_hot_units_layers") for r in runs["hot"]]
    assert all(h is not None and all(0 < k <= 256 // 8 for k in h) for h in hot), hot
    assert all("ffn_hot_units_layers" not in r for r in runs["cold"])
    for a, b in zip(runs["hot"], runs["cold"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), a["step"]
        assert a["l0_layers"] == pytest.approx(b["l0_layers"], rel=1e-4, abs=1e-3)


def test_measured_auto_in_a_real_run_is_deterministic_and_resumes_the_same(tmp_path):
    """Injected clock: layer 0 is faster on ell (2.5 ms vs 5), layer 1 slower (10 ms). With an
    exploration every 2 steps both layers time both paths; layer 0 ends on ell, layer 1 on
    dense; a run stopped at step 3 and resumed makes the same choices and the same steps."""
    def clock():
        return _clock({0: {"dense": (2.0, 3.0), "ell": (1.0, 1.5)},
                       1: {"dense": (2.0, 3.0), "ell": (4.0, 6.0)}})

    over = {"trainer.max_steps": 6, "trainer.micro_batch": 2, "sparsity.l1_coeff": 0.5,
            "data.val_fraction": 0.0, "ffn.impl": "auto", "trainer.save_every": 3,
            # an ELL capacity of H: no heavy rows (no redos, which would drop the timings)
            "ffn.policy": FFNPolicy(ell_capacity=64, train_explore_every=2)}
    straight = _run(tmp_path, "straight", over, clock())
    assert straight.plan.chosen_paths == ["ell", "dense"]
    _run(tmp_path, "resumed", over, clock(), stop_at=3)
    resumed = _run(tmp_path, "resumed", over, clock())
    assert resumed.step == 6
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["ffn_paths"] for r in a] == [r["ffn_paths"] for r in b]
    assert {tuple(r["ffn_paths"]) for r in a} >= {("ell", "dense"), ("dense", "ell")}  # explored
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6), x["step"]
    # the medians are logged per layer and path (ms per micro-step)
    assert a[-1]["ffn_ms_ell_layers"] == [2.5, 10.0]
    assert a[-1]["ffn_ms_dense_layers"] == [5.0, 5.0]
    assert straight.plan.chooser.state_dict() == resumed.plan.chooser.state_dict()


def test_a_timer_times_the_first_calls_of_a_step_only():
    from twell.nn.timing import LayerTimer
    from twell.ops.ffn_dense_train import dense_ffn_train

    clock = _clock({0: {"dense": (2.0, 3.0)}})
    timer = LayerTimer(0, clock, calls_per_step=2)
    mlp = _mlps(1, impl="auto")[0]
    x = torch.randn(6, 16)
    ws = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)

    def call():
        xi = x.clone().requires_grad_()
        y, _ = timer.run("dense", xi, lambda v: dense_ffn_train(v, *ws))
        y.sum().backward()
        return xi.grad

    grads = [call() for _ in range(3)]
    assert timer.samples() == [5.0, 5.0] and len(clock.keys) == 4  # the third call untimed
    assert torch.equal(grads[0], grads[2])  # the same gradients timed or not
    timer.clear()  # a new step: timed again
    assert timer.samples() == [] and not timer.events
    call()
    assert timer.samples() == [5.0]
    assert LayerTimer(0).run("dense", x, lambda v: ("untimed", None)) == ("untimed", None)
