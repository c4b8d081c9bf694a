"""The no-sync ELL training op in a CUDA graph (``twell.ops.ffn_train_graph``).

Without CUDA the graph backend is a stand-in (``train_cases.FakeGraphs``: the capture runs the
step once and keeps its outputs, a replay runs it again and copies into them, as a real replay
overwrites the static outputs), so the wrapper's structure runs here: warm-up, one capture, the
static inputs and outputs, the argument checks and the capacity guard, and the FFN builder's
results against the eager no-sync op (PyTorch backend, fp64). The real capture is checked
against ``ell_nosync`` by the CUDA-only test at the end (skipped here); the benchmark's
``ell_graph`` op on the stand-in: tests/studies/test_kernel_bench_real_layers.py. Shape
legend: N tokens, D model width, H FFN width.
"""

import pytest
import torch

from twell.ops.ffn_train import ell_ffn_forward, sparse_ffn_train
from twell.ops.ffn_train_graph import (
    FFN_OUTPUTS,
    CapacityOverflow,
    GraphedStep,
    graphed_ell_forward,
    graphed_ffn_train,
)
from twell.policy import FFNPolicy

from .train_cases import FakeGraphs, make_inputs

POLICY = FFNPolicy(ell_capacity=20)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


@pytest.fixture(autouse=True)
def _pytorch_backend(monkeypatch):
    """The ops' PyTorch backend on the CPU (read per call): the wrapper, not the kernels."""
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def n_heavy(x, wg, cap):
    return int((((x @ wg.T) > 0).sum(1) > cap).sum())


def test_graphed_step_structure_on_a_fake_op():
    """Warm-up then one capture; a call refills the named inputs and replays into the same
    static outputs; the guard is sticky until check() reads it."""
    x, w = torch.arange(4.0), torch.ones(4)
    fake = FakeGraphs()
    g = GraphedStep(lambda: ((2 * x + w, x.sum()), x.sum() > 100), {"x": x}, warmup=3,
                    overflow_msg="too many", graphs=fake)
    assert (fake.warm, fake.captures, fake.replays) == (3, 1, 0)
    y, s = g.outputs
    assert torch.equal(y, 2 * x + w) and s.item() == 6.0
    out = g(x=torch.full((4,), 5.0))
    assert out is g.outputs and out[0] is y and torch.equal(y, torch.full((4,), 11.0))
    assert torch.equal(x, torch.full((4,), 5.0)) and fake.replays == 1  # x is the buffer
    w.fill_(2.0)  # read in place: an in-place update reaches the next replay
    assert torch.equal(g()[0], torch.full((4,), 12.0)) and fake.replays == 2
    g.check()  # nothing overflowed
    g(x=torch.full((4,), 50.0))  # sum 200 > 100: the guard trips, no exception yet
    g(x=torch.zeros(4))
    with pytest.raises(CapacityOverflow, match="too many"):
        g.check()
    g.check()  # cleared by the read


def test_graphed_step_refuses_bad_arguments():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        GraphedStep(lambda: ((x,), None), {"x": x}, warmup=0, graphs=FakeGraphs())
    with pytest.raises(ValueError, match="no static inputs"):
        GraphedStep(lambda: ((x,), None), {}, graphs=FakeGraphs())
    with pytest.raises(RuntimeError, match="CUDA graphs need CUDA tensors; got cpu"):
        GraphedStep(lambda: ((x,), None), {"x": x})
    g = GraphedStep(lambda: ((x + 1,), None), {"x": x}, graphs=FakeGraphs())
    with pytest.raises(ValueError, match="unknown input 'y'; known: \\['x'\\]"):
        g(y=x)
    with pytest.raises(ValueError, match="input 'x' is \\(4,\\) torch.float32, captured as "
                                         "\\(3,\\) torch.float32: capture again"):
        g(x=torch.zeros(4))
    with pytest.raises(ValueError, match="torch.float64"):
        g(x=torch.zeros(3, dtype=torch.float64))


def test_graphed_step_overflow_in_warmup_stops_before_the_capture():
    x = torch.ones(2)
    fake = FakeGraphs()
    with pytest.raises(CapacityOverflow, match="cap"):
        GraphedStep(lambda: ((x,), x.sum() > 1), {"x": x}, overflow_msg="cap", graphs=fake)
    assert fake.captures == 0


def _eager_nosync(x, wg, wu, wd, dy, l1_coeff, backup_rows):
    """The eager no-sync call the graph must equal: FFN_OUTPUTS' tensors."""
    ins = [t.detach().clone().requires_grad_() for t in (x, wg, wu, wd)]
    y, st = sparse_ffn_train(*ins, policy=POLICY, backup_rows=backup_rows)
    grads = torch.autograd.grad([y, st.l1], ins, [dy, torch.full_like(st.l1, l1_coeff)])
    return [y.detach(), *grads, st.l1.detach(), st.heavy_rows]


def test_graphed_ffn_train_equals_the_eager_nosync_op_with_a_fake_graph():
    """The builder's step is ell_nosync's call (outputs, the four gradients, the L1 term and
    the heavy rows, exactly), on the capture's x and on a new x and dy passed to a call."""
    x, wg, wu, wd, dy = make_inputs(33, 40, 300, threshold=1.5, seed=21)
    r = n_heavy(x, wg, 20)
    assert 0 < r < 33
    fake = FakeGraphs()
    g = graphed_ffn_train(x, wg, wu, wd, dy, backup_rows=r + 4, l1_coeff=0.5, policy=POLICY,
                          graphs=fake)
    assert (fake.warm, fake.captures) == (2, 1) and len(g.outputs) == len(FFN_OUTPUTS)
    for got, want in zip(g(), _eager_nosync(x, wg, wu, wd, dy, 0.5, r + 4)):
        assert torch.equal(got, want)
    x2, *_, dy2 = make_inputs(33, 40, 300, threshold=1.6, seed=5)
    assert 0 < n_heavy(x2, wg, 20) <= r + 4
    for got, want in zip(g(x=x2, dy=dy2), _eager_nosync(x2, wg, wu, wd, dy2, 0.5, r + 4)):
        assert torch.equal(got, want)
    assert g.outputs[FFN_OUTPUTS.index("heavy_rows")].item() == n_heavy(x2, wg, 20)
    g.check()
    # the L1 coefficient as a Python number: the eager op's result at that coefficient
    for got, want in zip(g(x=x2, dy=dy2, dl1=2.0), _eager_nosync(x2, wg, wu, wd, dy2, 2.0, r + 4)):
        assert torch.equal(got, want)
    with pytest.raises(TypeError, match="input 'dy' is a float; give a tensor of shape"):
        g(dy=1.0)


def test_graphed_ffn_train_capacity_guard():
    """A capacity below the heavy rows stops the build; one that holds the capture's inputs
    but not a later call's trips the guard, which check() raises."""
    x, wg, wu, wd, dy = make_inputs(33, 40, 300, threshold=1.5, seed=21)
    r = n_heavy(x, wg, 20)
    with pytest.raises(CapacityOverflow, match=f"dense backup's {r - 1} .*backup_rows=-1"):
        graphed_ffn_train(x, wg, wu, wd, dy, backup_rows=r - 1, policy=POLICY,
                          graphs=FakeGraphs())
    g = graphed_ffn_train(x, wg, wu, wd, dy, backup_rows=r, policy=POLICY, graphs=FakeGraphs())
    dense_x = x.clone()
    dense_x[:, 1:] *= 3  # wider gate pre-activations: more active units, more heavy rows
    assert n_heavy(dense_x, wg, 20) > r
    g(x=dense_x)
    with pytest.raises(CapacityOverflow):
        g.check()


def test_graphed_ffn_train_refuses_the_measuring_mode_and_bad_shapes():
    x, wg, wu, wd, dy = make_inputs(8, 16, 64)
    fake = FakeGraphs()
    with pytest.raises(ValueError, match="backup_rows must be a capacity >= 0"):
        graphed_ffn_train(x, wg, wu, wd, dy, backup_rows=-1, graphs=fake)
    with pytest.raises(ValueError, match="dy of x's shape \\(8, 16\\); got dy \\(8, 15\\)"):
        graphed_ffn_train(x, wg, wu, wd, dy[:, :15], backup_rows=0, graphs=fake)
    with pytest.raises(ValueError, match="N >= 1"):
        graphed_ffn_train(x[:0], wg, wu, wd, dy[:0], backup_rows=0, graphs=fake)
    with pytest.raises(ValueError, match="graphed_ffn_train: weights must be"):
        graphed_ffn_train(x, wg[:, :8], wu, wd, dy, backup_rows=0, graphs=fake)
    assert fake.warm == 0


def _fp64_forward(x, wg, wu, wd):
    return (torch.relu(x @ wg.T) * (x @ wu.T)) @ wd.T


def test_graphed_ell_forward_equals_the_eager_forward_with_a_fake_graph():
    """The forward builder's step is ell_ffn_forward's no-sync call (y bitwise, the heavy-row
    count), on the capture's x and on a new x; below the heavy rows the overflow path inside
    the step keeps y exact (against fp64 by hand), so there is no guard to trip."""
    x, wg, wu, wd, _ = make_inputs(33, 40, 300, threshold=1.5, seed=21)
    r = n_heavy(x, wg, 20)
    assert 0 < r < 33
    # inputs that require grad: the graph's forward keeps no autograd graph all the same
    ins = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    for cap in (r + 4, r - 2, 0):  # room to spare, overflow rows, every heavy row overflowing
        fake = FakeGraphs()
        g = graphed_ell_forward(*ins, backup_rows=cap, policy=POLICY, graphs=fake)
        assert (fake.warm, fake.captures, len(g.outputs)) == (2, 1, 2)
        x2 = make_inputs(33, 40, 300, threshold=1.6, seed=5)[0]
        for xi in (x, x2, x.T.contiguous().T):  # the last: column-major, copied into the buffer
            y, heavy = g(x=xi)
            assert not y.requires_grad and y.grad_fn is None
            with torch.no_grad():
                want_y, want_heavy = ell_ffn_forward(xi, wg, wu, wd, backup_rows=cap,
                                                     policy=POLICY)
            assert torch.equal(y, want_y) and heavy.item() == want_heavy.item() == n_heavy(
                xi, wg, 20)
            torch.testing.assert_close(y, _fp64_forward(xi, wg, wu, wd), rtol=1e-12, atol=1e-12)
        assert g.inputs["x"].is_contiguous()
        g.check()  # never set: the forward has no capacity guard


def test_graphed_ell_forward_refuses_the_measuring_mode_and_bad_shapes():
    x, wg, wu, wd, _ = make_inputs(8, 16, 64)
    fake = FakeGraphs()
    with pytest.raises(ValueError, match="graphed_ell_forward: backup_rows must be a capacity"):
        graphed_ell_forward(x, wg, wu, wd, backup_rows=-1, graphs=fake)
    with pytest.raises(ValueError, match="graphed_ell_forward: N >= 1"):
        graphed_ell_forward(x[:0], wg, wu, wd, backup_rows=0, graphs=fake)
    with pytest.raises(ValueError, match="graphed_ell_forward: weights must be"):
        graphed_ell_forward(x, wg[:, :8], wu, wd, backup_rows=0, graphs=fake)
    g = graphed_ell_forward(x, wg, wu, wd, backup_rows=0, graphs=fake)
    with pytest.raises(ValueError, match="input 'x' is \\(8, 15\\) torch.float64, captured as"):
        g(x=x[:, :15])


@cuda
def test_cuda_graph_forward_equals_the_eager_forward_on_a_small_layer():
    """The real capture of the forward (Triton kernels, bf16) against the eager no-sync
    forward on a layer with heavy rows, at a capacity that holds them and at one that leaves
    rows to the overflow kernel: y within bf16 noise (cuBLAS may pick another algorithm in the
    graph), the heavy-row count exactly, on the capture's x and on new inputs."""
    from studies.kernel_bench.common import rel_err

    x, wg, wu, wd, _ = [t.cuda().bfloat16() for t in make_inputs(512, 128, 1024, threshold=2.0,
                                                                 seed=3)]
    policy = FFNPolicy(ell_capacity=32)
    r = int(ell_ffn_forward(x, wg, wu, wd, policy=policy)[1].item())  # measured
    assert 2 < r < 512
    more, fewer = x.clone(), x.clone()
    more[:, 1:] *= 1.1  # wider pre-activations against the fixed threshold: more heavy rows
    fewer[:, 1:] *= 0.8
    for cap in (r + 8, r // 2):  # no overflow at the capture, then some; overflow throughout
        g = graphed_ell_forward(x, wg, wu, wd, backup_rows=cap, policy=policy)
        seen = set()
        for xi in (x, x.flip(0), more, fewer):
            y, heavy = (t.clone() for t in g(x=xi))
            want_y, want_heavy = ell_ffn_forward(xi, wg, wu, wd, backup_rows=cap, policy=policy)
            assert rel_err(y, want_y) < 5e-3 and heavy.item() == want_heavy.item()
            ref = _fp64_forward(*(t.double() for t in (xi, wg, wu, wd)))
            assert rel_err(y, ref) < 2e-2
            seen.add(heavy.item())
        assert len(seen) == 3  # the count moves between replays (not frozen at the capture)
    with pytest.raises(ValueError, match="PyTorch backend, which reads counts on the host"):
        graphed_ell_forward(*(t.double() for t in (x, wg, wu, wd)), backup_rows=r)


@cuda
def test_cuda_graph_equals_ell_nosync_on_a_small_layer():
    """The real capture (Triton kernels, bf16) against the eager no-sync op on a layer with
    heavy rows: every output within bf16 noise of it (the same kernels; cuBLAS may pick
    another algorithm inside the graph), the heavy rows exactly; then on new inputs; and the
    guard trips on inputs with more heavy rows than the capacity."""
    from studies.kernel_bench.common import rel_err

    ts = [t.cuda().bfloat16() for t in make_inputs(512, 128, 1024, threshold=2.0, seed=3)]
    x, wg, wu, wd, dy = ts
    policy = FFNPolicy(ell_capacity=32)
    r = int(sparse_ffn_train(x, wg, wu, wd, policy=policy)[1].heavy_rows.item())  # measured
    assert 0 < r < 512
    g = graphed_ffn_train(x, wg, wu, wd, dy, backup_rows=r + 8, l1_coeff=0.4, policy=policy)
    for xi, dyi in ((x, dy), (x.flip(0), dy.flip(0))):
        got = [t.clone() for t in g(x=xi, dy=dyi)]
        ins = [t.detach().clone().requires_grad_() for t in (xi, wg, wu, wd)]
        y, st = sparse_ffn_train(*ins, policy=policy, backup_rows=r + 8)
        want = [y.detach(), *torch.autograd.grad([y, st.l1], ins,
                                                 [dyi, torch.full_like(st.l1, 0.4)])]
        for name, a, b in zip(FFN_OUTPUTS, got, want + [st.l1, st.heavy_rows]):
            assert rel_err(a, b) < 5e-3, name
        assert got[-1].item() == st.heavy_rows.item() == r
    g.check()
    more = x.clone()
    more[:, 1:] *= 3  # more active units: more heavy rows than the capacity
    g(x=more)
    with pytest.raises(CapacityOverflow):
        g.check()
