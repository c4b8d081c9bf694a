"""``trainer.dense_ffn_fused``: impl=torch FFNs train in dense mode (``dense_ffn_train``) with the
same outputs, statistics and gradients as the PyTorch autograd path, and the same losses."""

import pytest
import torch

from tests.train_utils import train_metrics_by_value
from twell.nn import FFNPlan, SparseGatedMLP
from twell.nn.mlp import gated_ffn_torch


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    """dense_ffn_train's PyTorch backend (its Triton pass is tested in test_kernels_train.py)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _run(path, x, gated=True):
    torch.manual_seed(0)
    m = SparseGatedMLP(24, 40, gated=gated, impl="torch")
    plan = FFNPlan([m], dense_ffn_fused=path == "dense")
    assert plan.paths == ["dense" if path == "dense" and gated else "torch"]
    xx = x.clone().requires_grad_()
    y = m(xx)
    st = m.last_stats
    ((y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum() + 0.7 * st.l1).backward()
    grads = [xx.grad] + [p.grad for p in m.parameters()]
    return y.detach(), st, grads


@pytest.mark.parametrize("gated", [True, False])
def test_dense_mode_matches_pytorch_autograd(gated):
    x = torch.randn(2, 37, 24)
    x[0, 3] = 0  # an all-zero row: no unit active
    ya, sa, ga = _run("torch", x, gated)
    yb, sb, gb = _run("dense", x, gated)  # non-gated: stays on the PyTorch path
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sb.l1, sa.l1, rtol=1e-6, atol=0)
    assert sb.nnz_sum == sa.nnz_sum and sb.nnz_max == sa.nnz_max
    assert torch.equal(sb.active_counts, sa.active_counts)
    assert sb.heavy_rows == sa.heavy_rows
    for a, b in zip(ga, gb):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # and the forward against a float64 computation
    torch.manual_seed(0)
    m = SparseGatedMLP(24, 40, gated=gated).double()
    ref, _ = gated_ffn_torch(x.double().reshape(-1, 24), m.gate_proj.weight if gated else None,
                             m.up_proj.weight, m.down_proj.weight)
    assert (yb.double().reshape(-1, 24) - ref).abs().max() < 1e-5


def test_inference_is_unchanged():
    m = SparseGatedMLP(24, 40, impl="torch")
    FFNPlan([m], dense_ffn_fused=True)
    x = torch.randn(5, 24)
    with torch.no_grad():
        ref, _ = gated_ffn_torch(x, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)
        torch.testing.assert_close(m(x), ref, rtol=0, atol=0)


def test_trainer_dense_ffn_fused_same_losses(tmp_path):
    def check(t, fused):
        assert set(t.plan.paths) == {"dense" if fused else "torch"}

    runs = train_metrics_by_value(tmp_path, "trainer.dense_ffn_fused", (False, True), check=check)
    for a, b in zip(runs[True], runs[False]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["l0_layers"] == pytest.approx(b["l0_layers"], rel=1e-6)
        assert a["dead_frac"] == b["dead_frac"]
