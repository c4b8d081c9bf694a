"""``ffn.dense_fused``: impl=torch gated FFNs train in dense mode (``dense_ffn_train``) with
the same outputs, statistics and gradients as the PyTorch autograd path, and the same losses;
non-gated FFNs (dense mode needs gate_proj) stay on the PyTorch path."""

import pytest
import torch

from tests.train_utils import train_metrics_by_value
from twell.nn import FFNPlan, PlanOptions, SparseGatedMLP
from twell.nn.mlp import gated_ffn_torch


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    """dense_ffn_train's PyTorch backend (its Triton pass is tested in tests/ops/test_elementwise.py)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def dense_calls(monkeypatch):
    """A list that grows by one per ``dense_ffn_train`` call (SparseGatedMLP imports it from
    ``twell.ops.ffn_dense_train`` at each dense-mode forward)."""
    import twell.ops.ffn_dense_train as st
    from twell.ops.ffn_dense_train import dense_ffn_train

    calls = []
    monkeypatch.setattr(st, "dense_ffn_train",
                        lambda *a, **kw: calls.append(1) or dense_ffn_train(*a, **kw))
    return calls


def _run(path, x, gated=True):
    torch.manual_seed(0)
    m = SparseGatedMLP(24, 40, gated=gated, impl="torch")
    plan = FFNPlan([m], PlanOptions(dense_fused=path == "dense"))
    assert plan.paths == ["dense" if path == "dense" and gated else "torch"]
    xx = x.clone().requires_grad_()
    y = m(xx)
    st = m.last_stats
    ((y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum() + 0.7 * st.l1).backward()
    grads = [xx.grad] + [p.grad for p in m.parameters()]
    return y.detach(), st, grads


def _assert_same(a, b):
    (ya, sa, ga), (yb, sb, gb) = a, b
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sb.l1, sa.l1, rtol=1e-6, atol=0)
    assert sb.nnz_sum == sa.nnz_sum and sb.nnz_max == sa.nnz_max
    assert torch.equal(sb.active_counts, sa.active_counts)
    assert sb.heavy_rows == sa.heavy_rows
    for u, v in zip(ga, gb, strict=True):
        torch.testing.assert_close(v, u, rtol=1e-5, atol=1e-6)


def _inputs():
    x = torch.randn(2, 37, 24)
    x[0, 3] = 0  # an all-zero row: no unit active
    return x


def test_dense_mode_matches_pytorch_autograd(dense_calls):
    x = _inputs()
    ref = _run("torch", x)
    assert dense_calls == []
    got = _run("dense", x)
    assert dense_calls == [1]  # the forward ran dense mode (its backward is the op's own)
    _assert_same(ref, got)
    # and the forward against a float64 computation
    torch.manual_seed(0)
    m = SparseGatedMLP(24, 40).double()
    want, _ = gated_ffn_torch(x.double().reshape(-1, 24), m.gate_proj.weight, m.up_proj.weight,
                              m.down_proj.weight)
    assert (got[0].double().reshape(-1, 24) - want).abs().max() < 1e-5


def test_non_gated_layers_stay_on_the_pytorch_path(dense_calls):
    """dense_ffn_fused on a non-gated FFN: the plan keeps it on ``torch`` (dense mode computes
    relu(gate) * up), no dense_ffn_train call, the PyTorch path's results; dense_ffn_train
    itself refuses the non-gated FFN."""
    from twell.ops.ffn_dense_train import dense_ffn_train

    x = _inputs()
    ref = _run("torch", x, gated=False)
    got = _run("dense", x, gated=False)
    assert dense_calls == []
    _assert_same(ref, got)
    torch.manual_seed(0)
    m = SparseGatedMLP(24, 40, gated=False).double()
    want, _ = gated_ffn_torch(x.double().reshape(-1, 24), None, m.up_proj.weight,
                              m.down_proj.weight)
    assert (got[0].double().reshape(-1, 24) - want).abs().max() < 1e-5
    with pytest.raises(ValueError, match="needs w_gate_HD"):
        dense_ffn_train(x.reshape(-1, 24), None, m.up_proj.weight.float(),
                        m.down_proj.weight.float())


def test_inference_is_unchanged(dense_calls):
    m = SparseGatedMLP(24, 40, impl="torch")
    FFNPlan([m], PlanOptions(dense_fused=True))
    x = torch.randn(5, 24)
    with torch.no_grad():
        ref, _ = gated_ffn_torch(x, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)
        torch.testing.assert_close(m(x), ref, rtol=0, atol=0)
    assert dense_calls == []


def test_trainer_dense_ffn_fused_same_losses(tmp_path, dense_calls):
    seen = {}

    def check(t, fused):
        assert set(t.plan.paths) == {"dense" if fused else "torch"}
        seen[fused] = len(dense_calls)

    runs = train_metrics_by_value(tmp_path, "ffn.dense_fused", (False, True), check=check)
    # 3 steps x 2 micro-batches x 2 layers in dense mode (validation runs no_grad: inference)
    assert seen == {False: 0, True: 0} and len(dense_calls) == 3 * 2 * 2
    for a, b in zip(runs[True], runs[False]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["l0_layers"] == pytest.approx(b["l0_layers"], rel=1e-6)
        assert a["dead_frac"] == b["dead_frac"]
