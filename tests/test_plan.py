"""The FFN execution plan (twell.nn.plan): the step protocol's accept / redo decisions and next
capacities on hand-made statistics, auto's choices, pins, the profiling context, the JSON state,
the module reading its entry, and a real tiny run whose layer switches between ELL and dense."""

import json
import math

import pytest
import torch

from tests.train_utils import read_metrics, tiny_config, write_tokens
from twell.nn import FFNPlan, SparseGatedMLP, StepStats, trains_ell
from twell.nn.plan import LayerMeasure, default_path, density_rule, layer_plan
from twell.ops.reference import gated_ffn_torch
from twell.policy import FFNPolicy

H = 64  # FFN width of the hand-made layers (ELL capacity 16)


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    """The sparse training op's PyTorch backend (its Triton kernels: test_kernels_train.py)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _mlps(n, impl="twell", gated=True):
    torch.manual_seed(0)
    return [SparseGatedMLP(16, H, impl=impl, gated=gated) for _ in range(n)]


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
    # window rule: ceil(1.25 * 5) + 16 = 23; no heavy row: 0; 200 of 256 rows heavy (> half):
    # the op runs the call densely, which needs the measurement
    assert [lp.backup_rows for lp in plan.layers] == [23, 0, -1]
    # the next step holds its heavy rows: accepted, capacities from the 16-step window
    out = _step(plan, _stats([23, 0, 250]))
    assert out.accepted
    assert [lp.backup_rows for lp in plan.layers] == [math.ceil(1.25 * 23) + 16, 0, -1]


def test_redo_when_a_layer_exceeds_its_capacity_then_measured_step_is_accepted():
    plan = FFNPlan(_mlps(3), capacity_rule="adaptive")
    _step(plan, _stats([5, 0, 200]))
    caps = [lp.backup_rows for lp in plan.layers]
    assert caps == [64, 0, -1]  # adaptive: ceil(1.25 * 5) + 16 = 23 -> 64 (multiples of 64)
    margin = plan.capacity.margin[1]
    out = _step(plan, _stats([64, 1, 256]))  # layer 1 had a heavy row and capacity 0
    assert not out.accepted and out.redo == (1,)
    assert [lp.backup_rows for lp in plan.layers] == [-1, -1, -1]  # the redo measures per call
    assert plan.capacity.margin[1] == pytest.approx(margin * 1.5)  # the rule learnt of it
    assert plan.capacity.hist == [[5.0], [0.0], [200.0]]  # the redone attempt is not recorded
    out = _step(plan, _stats([64, 1, 256]))  # the redone step: every layer measured
    assert out.accepted and plan.capacity.hist[1] == [0.0, 1.0]


def test_capacity_is_checked_against_the_rows_of_a_call():
    """The op's backup holds at most rows_per_call - 1 rows (all rows: the all-dense fallback,
    which needs the measurement), so a capacity above that is checked against it."""
    plan = FFNPlan(_mlps(1))
    _step(plan, _stats([10], rows=256))
    assert plan.layers[0].backup_rows == 29
    assert _step(plan, _stats([9], rows=10)).accepted  # 9 <= min(29, 9)
    plan.layers[0].backup_rows = 29
    assert _step(plan, _stats([10], rows=10)).redo == (0,)  # 10 > min(29, 9)


def test_only_ell_layers_are_checked_and_call_sync_measures_per_call():
    plan = FFNPlan(_mlps(2, impl="torch"))
    _step(plan, _stats([5, 5]))
    assert [lp.backup_rows for lp in plan.layers] == [23, 23]  # recorded, unused off ELL
    assert _step(plan, _stats([100, 100])).accepted  # torch layers: no capacity to exceed
    call = FFNPlan(_mlps(2), host_sync="call")
    _step(call, _stats([5, 0]))
    assert [lp.backup_rows for lp in call.layers] == [-1, -1]
    with pytest.raises(ValueError, match="3 layers; the plan has 2"):
        _step(call, _stats([1, 2, 3]))
    with pytest.raises(ValueError, match="host_sync"):
        FFNPlan(_mlps(1), host_sync="never")


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
        FFNPlan(_mlps(1, gated=False), "twell")


def test_profiling_context_fixes_paths_measures_and_restores():
    plan = FFNPlan(_mlps(2, impl="auto"))
    _step(plan, _stats([5, 5], [1.0, 1.0], [0.0, 0.0]))  # L0 ~0: both to ELL, capacity 23
    plan.set_collect_stats(False)
    before = [(lp.path, lp.backup_rows, lp.collect_stats) for lp in plan.layers]
    assert before == [("ell", 23, False)] * 2
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
    a = FFNPlan(mlps, capacity_rule="adaptive")
    for i in range(12):
        nnz = [(i % 5) * 512.0, 40.0 * 512, 2.0 * 512]
        _step(a, _stats([i % 7, 3 * i, 0], nnz, [0.0, 0.0, 0.0]))  # some steps are redos
        if i % 4 == 3:
            a.capacity.overflowed([1])
    state = json.loads(json.dumps(a.state_dict()))
    b = FFNPlan(_mlps(3, impl="auto"), capacity_rule="adaptive")
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    for i in range(6):  # the same decisions from here on
        s = _stats([i, 2 * i, i % 3], [i * 512.0, 3.0 * 512, 9.0 * 512], [0.0] * 3)
        assert _step(a, s) == _step(b, s)
        assert b.state_dict() == a.state_dict()
    for bad, match in (({k: v for k, v in state.items() if k != "paths"}, r"missing keys \['paths'\]"),
                       ({**state, "extra": 1}, r"unexpected keys \['extra'\]"),
                       ({**state, "version": 2}, "version 2"),
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
    import twell.ops.sparse_train as st

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
        t = Trainer(tiny_config(tok, **over, **{"model.ffn_impl": impl}), tmp_path / impl)
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
