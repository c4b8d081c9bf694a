"""The measured training auto (``twell.ops.ffn_train_auto.AutoFFNTrain``) on the CPU.

A deterministic clock (:class:`FakeClock`: a set time per candidate) stands in for the CUDA
events and ``train_cases.FakeGraphs`` for the CUDA graphs, so the exploration, the choice and
the capacity guard run here. Most tests use fp64 inputs (the ops' PyTorch backend: fast);
one runs the Triton kernels in fp32 under ``TRITON_INTERPRET=1``. Every result is compared with
the fp64 autograd reference of ``train_cases``. Shape legend: N tokens, D model width, H FFN
width.
"""

import pytest
import torch

from tests.train_utils import FakeClock
from twell.ops.ffn_train_auto import CANDIDATES, AutoFFNTrain, CapacityOverflow
from twell.ops.hot_units import hot_units_from_counts
from twell.policy import FFNPolicy

from .train_cases import (
    FakeGraphs,
    assert_close,
    make_inputs,
    needs_triton,
    reference,
)

POLICY = FFNPolicy(ell_capacity=20)
L1 = 0.3  # not an fp32 value: an fp64 call must not round it (the graph's dl1 buffer)


def n_heavy(x, wg, cap=20):
    return int((((x @ wg.T) > 0).sum(1) > cap).sum())


def check_outputs(out, x, wg, wu, wd, dy, rel=1e-10):
    """y, dx, dWg, dWu, dWd and l1 of a call against fp64 autograd."""
    y_r, st_r, g_r = reference(x, wg, wu, wd, dy, L1)
    for name, a, b in zip(("y", "dx", "dWg", "dWu", "dWd", "l1"), out, [y_r, *g_r, st_r.l1]):
        assert_close(name, a, b, rel)


def inputs(**kw):
    x, wg, wu, wd, dy = make_inputs(64, 40, 300, threshold=2.0, seed=21, **kw)
    assert 0 < n_heavy(x, wg) < 64
    return x, wg, wu, wd, dy


def more_heavy(x, wg, cap):
    """x with its first 48 rows' gate pre-activations widened: more heavy rows than ``cap``,
    not every row."""
    more = x.clone()
    more[:48, 1:] *= 3
    assert cap < n_heavy(more, wg) < x.shape[0]
    return more


def build(ms, ws, trials=3, **kw):
    clock = FakeClock(ms)
    graphs = FakeGraphs()
    op = AutoFFNTrain(*ws, l1_coeff=L1, policy=POLICY, trials=trials, clock=clock,
                      graphs=graphs, **kw)
    return op, clock, graphs


@pytest.mark.parametrize("fastest", ["dense", "ell_nosync", "ell_hot", "ell_graph"])
def test_picks_the_fastest_by_the_clock_and_drops_each_first_call(fastest):
    """Every candidate is timed ``trials`` times after its dropped first call (the no-sync ones
    also after their measuring call); the smallest median wins; every call, exploring or not,
    returns exact results."""
    x, wg, wu, wd, dy = inputs(hot=4)
    hot = torch.arange(4)
    ms = {c: 5.0 for c in CANDIDATES} | {fastest: 1.0}
    op, clock, graphs = build(ms, (wg, wu, wd), hot_units=hot)
    assert op.candidates == [] and op.choice is None
    n = 0
    while op.choice is None:
        check_outputs(op(x, dy), x, wg, wu, wd, dy)
        n += 1
    assert op.candidates == list(CANDIDATES) and op.choice == fastest
    assert op.timings == {c: [ms[c]] * 3 for c in CANDIDATES}
    assert op.medians() == {c: ms[c] for c in CANDIDATES}
    # dense: 1 dropped + 3; ell_nosync / ell_hot: measuring + 1 dropped + 3; ell_graph: its
    # capture (capacity from ell_nosync's measuring call) + 3
    assert op.calls == {"dense": 4, "ell_nosync": 5, "ell_hot": 5, "ell_graph": 4} and n == 18
    assert sorted(clock.keys) == sorted(c for c in CANDIDATES for _ in range(3))
    assert graphs.captures == 1
    assert (op.inputs() is not None) == (fastest == "ell_graph")  # a graph not chosen: released
    timed = len(clock.keys)
    for _ in range(2):
        check_outputs(op(x, dy), x, wg, wu, wd, dy)
    assert len(clock.keys) == timed  # nothing timed after the choice
    assert op.calls[fastest] == (5 if fastest in ("ell_nosync", "ell_hot") else 4)  # not counted
    assert op.summary().startswith(f"{fastest} (median ms: dense {ms['dense']:.3f}, ell_nosync")


def test_weights_are_read_in_place():
    """An in-place update of a weight (an optimizer step) reaches the next call of the chosen
    candidate, graph included."""
    x, wg, wu, wd, dy = inputs()
    op, _, _ = build({"dense": 3.0, "ell_nosync": 2.0, "ell_hot": 9.0, "ell_graph": 1.0},
                     (wg, wu, wd))
    assert op.explore(x, dy) == "ell_graph"
    wd.mul_(0.5)
    wu.add_(0.01)
    check_outputs(op(x, dy), x, wg, wu, wd, dy)
    op = AutoFFNTrain(wg, wu, wd, l1_coeff=L1, policy=POLICY)  # no clock: the rule's eager op
    with torch.no_grad():  # the gradients are outputs: computed all the same
        out = [t.clone() for t in op(x, dy)]
    check_outputs(out, x, wg, wu, wd, dy)


def test_graph_overflow_is_redone_exactly_and_captured_again():
    """check_each_call (default): a call with more heavy rows than the graph's capacity is
    redone in the measuring mode (exact) and the next call captures at the new capacity."""
    x, wg, wu, wd, dy = inputs()
    op, _, graphs = build({"dense": 3.0, "ell_nosync": 2.0, "ell_graph": 1.0}, (wg, wu, wd))
    assert op.explore(x, dy) == "ell_graph" and graphs.captures == 1
    more = more_heavy(x, wg, op._caps["ell_graph"])
    check_outputs(op(more, dy), more, wg, wu, wd, dy)
    assert graphs.captures == 1 and op.inputs() is None
    check_outputs(op(more, dy), more, wg, wu, wd, dy)  # captured again, the larger capacity
    assert graphs.captures == 2 and op._caps["ell_graph"] >= n_heavy(more, wg)
    check_outputs(op(*op.inputs()), more, wg, wu, wd, dy)  # its own buffers: no copy
    op.check()


def test_explore_after_a_capture_explores_its_own_inputs():
    """A graph captured by earlier calls holds their x and dy: explore(more, dy) explores on
    ``more`` (its capacities cover more's heavy rows), not on the buffers' stale inputs."""
    x, wg, wu, wd, dy = inputs()
    op, _, graphs = build({"dense": 3.0, "ell_nosync": 2.0, "ell_graph": 1.0}, (wg, wu, wd))
    for _ in range(3):  # dense, ell_nosync's measuring call, ell_graph's capture on x
        op(x, dy)
    assert graphs.captures == 1 and op.choice is None
    with pytest.raises(ValueError, match="its first call was"):  # not copied by broadcast
        op.explore(x[:1], dy[:1])
    more = more_heavy(x, wg, op._caps["ell_graph"])
    assert op.explore(more, dy) == "ell_graph"
    assert min(op._caps.values()) >= n_heavy(more, wg)
    assert torch.equal(op.inputs()[0], more)
    check_outputs(op(*op.inputs()), more, wg, wu, wd, dy)


def test_nosync_overflow_is_redone_exactly():
    x, wg, wu, wd, dy = inputs()
    op, _, _ = build({"dense": 3.0, "ell_nosync": 1.0, "ell_graph": 2.0}, (wg, wu, wd))
    assert op.explore(x, dy) == "ell_nosync"
    more = more_heavy(x, wg, op._caps["ell_nosync"])
    check_outputs(op(more, dy), more, wg, wu, wd, dy)
    check_outputs(op(more, dy), more, wg, wu, wd, dy)


@pytest.mark.parametrize("fastest", ["ell_nosync", "ell_graph"])
def test_overflow_without_per_call_checks_raises_at_check(fastest):
    """check_each_call=False: no sync per call; check() raises CapacityOverflow after a call
    that overflowed; the next call measures again and is exact."""
    x, wg, wu, wd, dy = inputs()
    ms = {"dense": 3.0, "ell_nosync": 2.0, "ell_graph": 2.0} | {fastest: 1.0}
    op, _, _ = build(ms, (wg, wu, wd), check_each_call=False)
    assert op.explore(x, dy) == fastest
    check_outputs(op(x, dy), x, wg, wu, wd, dy)
    op.check()  # nothing overflowed
    more = more_heavy(x, wg, op._caps[fastest])
    op(more, dy)  # wrong rows: the guard trips, no exception yet
    with pytest.raises(CapacityOverflow, match=f"{fastest} since the last check.*redo"):
        op.check()
    op.check()  # cleared by the read
    for _ in range(2):
        check_outputs(op(more, dy), more, wg, wu, wd, dy)
    op.check()


def test_failed_capture_drops_the_graph_with_its_reason():
    class Broken(FakeGraphs):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    x, wg, wu, wd, dy = inputs()
    op = AutoFFNTrain(wg, wu, wd, l1_coeff=L1, policy=POLICY, trials=1, graphs=Broken(),
                      clock=FakeClock({"dense": 2.0, "ell_nosync": 3.0, "ell_graph": 1.0}))
    while op.choice is None:
        check_outputs(op(x, dy), x, wg, wu, wd, dy)
    assert op.choice == "dense" and "ell_graph" not in op.candidates
    assert op.reasons["ell_graph"].startswith("capture failed: RuntimeError: operation not")


def test_every_row_heavy_drops_the_nosync_candidates():
    x, wg, wu, wd, dy = make_inputs(16, 24, 64, threshold=-3.0, seed=2)  # every unit active
    op = AutoFFNTrain(wg, wu, wd, l1_coeff=L1, policy=FFNPolicy(ell_capacity=8), trials=1,
                      clock=FakeClock({"dense": 9.0, "ell_nosync": 1.0}), graph=False)
    assert op.explore(x, dy) == "dense"
    assert op.reasons["ell_nosync"] == "every row heavy (16 of 16): a no-sync backup holds at most N - 1"
    assert op.reasons["ell_graph"] == "graph=False"


def test_nan_and_inf_propagate_on_the_chosen_nosync_op():
    x, wg, wu, wd, dy = inputs()
    op, _, _ = build({"dense": 3.0, "ell_nosync": 1.0, "ell_graph": 2.0}, (wg, wu, wd))
    assert op.explore(x, dy) == "ell_nosync"
    bad = x.clone()
    bad[3, 5] = float("nan")
    bad[7, 2] = float("inf")
    y, dx, dwg, dwu, dwd, l1, _ = op(bad, dy)
    assert torch.isnan(y[3]).all() and not torch.isfinite(y[7]).all()
    assert torch.isnan(dx[3]).all() and torch.isnan(dwg).any() and torch.isnan(dwu).any()
    assert torch.isnan(dwd).any() and torch.isnan(l1)
    assert torch.isfinite(y[0]).all()


@needs_triton
def test_without_clock_the_density_rule_picks_on_the_triton_kernels():
    """CPU, no clock: the first call measures (hot set given) and policy.train_path picks;
    fp32 Triton kernels (interpreter) within fp32 tolerance of fp64 autograd."""
    x, wg, wu, wd, dy = make_inputs(24, 16, 64, threshold=1.2, seed=21, hot=2)
    x, wg, wu, wd, dy = (t.float() for t in (x, wg, wu, wd, dy))
    _, counts = ((x @ wg.T) > 0).sum(1), ((x @ wg.T) > 0).sum(0)
    hot = hot_units_from_counts(counts.int(), 24, 16)
    policy = FFNPolicy(ell_capacity=8, train_density_threshold=0.6)  # a dense small layer
    op = AutoFFNTrain(wg, wu, wd, hot_units=hot, l1_coeff=L1, policy=policy)
    for _ in range(2):
        check_outputs(op(x, dy), x, wg, wu, wd, dy, rel=2e-5)
    density = ((x @ wg.T) > 0).float().mean().item()
    assert policy.train_path(density, n_heavy(x, wg, 8) / 24) == "ell"
    assert density >= policy.hot_min_density
    assert op.choice == "ell_hot" and op.timings == {c: [] for c in op.candidates}
    assert op.reasons["ell_hot"].startswith("density rule (no clock): train_path(density")


@pytest.mark.parametrize(("policy", "hot", "want"), [
    (FFNPolicy(ell_capacity=20), False, "ell_nosync"),
    (FFNPolicy(ell_capacity=20, train_density_threshold=0.0), False, "dense"),
    (FFNPolicy(ell_capacity=20, hot_min_density=1.0), True, "ell_nosync"),
    (FFNPolicy(ell_capacity=20, train_measure=False), True, "ell_hot"),  # a clock, not used
])
def test_rule_choices(policy, hot, want):
    x, wg, wu, wd, dy = inputs(hot=4)
    clock = FakeClock({})
    op = AutoFFNTrain(wg, wu, wd, hot_units=torch.arange(4) if hot else None, l1_coeff=L1,
                      policy=policy, clock=clock if not policy.train_measure else None)
    check_outputs(op(x, dy), x, wg, wu, wd, dy)
    assert op.choice == want and clock.keys == []
    check_outputs(op(x, dy), x, wg, wu, wd, dy)


def test_bad_inputs_raise_one_line_errors():
    x, wg, wu, wd, dy = inputs()
    op = AutoFFNTrain(wg, wu, wd, policy=POLICY)
    cases = [((x[None], dy), "x_ND must be 2-D"), ((x[:, :8], dy[:, :8]), "weights must be"),
             ((x, dy[:5]), "dy must have x's shape"), ((x, dy.float()), "dy must have"),
             ((x[:0], dy[:0]), "no rows")]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg) as e:
            op(*args)
        assert "\n" not in str(e.value)
    op(x, dy)
    with pytest.raises(ValueError, match=r"x is \(32, 40\) torch.float64 .* first call was "
                                         r"\(64, 40\) .*one AutoFFNTrain per shape") as e:
        op(x[:32], dy[:32])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="dense backup|torch.float32"):
        op(x.float(), dy.float())
    with pytest.raises(TypeError, match="must be tensors"):
        op(x, 1.0)
    with pytest.raises(ValueError, match="trials must be an integer >= 1; got 0"):
        AutoFFNTrain(wg, wu, wd, trials=0)
    with pytest.raises(ValueError, match="weights must be"):
        AutoFFNTrain(wg, wu[:, :3], wd)


def test_bad_arguments_name_the_field():
    """Constructor arguments are checked up front (one line naming the field), not swallowed
    later (a warmup of 0 used to surface as a dropped graph, "capture failed")."""
    x, wg, wu, wd, dy = inputs()
    cases = [({"w_up_HD": None}, TypeError, "w_up_HD must be a tensor; got NoneType"),
             ({"w_gate_HD": "w"}, TypeError, "w_gate_HD must be a tensor; got str"),
             ({"w_down_DH": wd.int()}, ValueError, "w_down_DH must be floating point"),
             ({"l1_coeff": None}, ValueError, "l1_coeff must be a finite number"),
             ({"l1_coeff": float("nan")}, ValueError, "l1_coeff must be a finite number"),
             ({"warmup": 0}, ValueError, "warmup must be an integer >= 1"),
             ({"policy": "fast"}, TypeError, "policy must be an FFNPolicy; got str"),
             ({"trials": -2}, ValueError, "trials must be an integer >= 1; got -2")]
    for kw, exc, msg in cases:
        ws = {"w_gate_HD": wg, "w_up_HD": wu, "w_down_DH": wd}
        ws.update({k: kw.pop(k) for k in list(kw) if k in ws})
        with pytest.raises(exc, match=msg) as e:
            AutoFFNTrain(ws["w_gate_HD"], ws["w_up_HD"], ws["w_down_DH"], **kw)
        assert "\n" not in str(e.value)
    op = AutoFFNTrain(wg, wu, wd, policy=POLICY, l1_coeff=L1)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        op(x, dy)
    check_outputs(op(x, dy), x, wg, wu, wd, dy)
