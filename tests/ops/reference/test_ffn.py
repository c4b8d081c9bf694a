"""The PyTorch references (``twell.ops.reference.ffn``): ``gated_ffn_torch`` on a hand-computed
case (gated and non-gated, with its statistics), and ``twell_ffn_torch`` (the TwELL format in
PyTorch: ELL slots, dense overflowed tiles, a dense hot set) against ``gated_ffn_torch`` in
float64 on bf16-exact gate values, so the format's value rounding is exact and any difference is
a bug. Their use as the kernels' oracle: ``tests/ops/test_ffn.py``, ``test_ffn_train.py``.
Shape legend: N tokens, D model width, H FFN width.
"""

import pytest
import torch

from twell.ops.reference import gated_ffn_torch, twell_ffn_torch

F64 = torch.float64


def test_gated_ffn_torch_hand_computed():
    x = torch.tensor([[1.0, 2.0]], dtype=F64)
    wg = torch.tensor([[1.0, 0.0], [0.0, -1.0], [1.0, 1.0]], dtype=F64)  # g = [1, -2, 3]
    wu = torch.tensor([[2.0, 0.0], [1.0, 1.0], [0.0, 1.0]], dtype=F64)  # u = [2, 3, 2]
    wd = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, -1.0]], dtype=F64)
    y, st = gated_ffn_torch(x, wg, wu, wd, ell_capacity=1)  # h = [2, 0, 6]
    assert y.tolist() == [[8.0, -6.0]]
    assert st.l1.item() == 8.0 and st.nnz_sum.item() == 2 and st.nnz_max.item() == 2
    assert st.active_counts.tolist() == [1, 0, 1] and st.heavy_rows.item() == 1
    y, st = gated_ffn_torch(x, None, wu, wd, with_stats=True)  # h = relu(u) = [2, 3, 2]
    assert y.tolist() == [[7.0, 1.0]] and st.l1.item() == 7.0
    assert gated_ffn_torch(x, wg, wu, wd, with_stats=False)[1] is None


def _exact_case(n, d, h, seed):
    """fp64 x and weights with small integer gate pre-activations (bf16-exact, many zeros)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (n, d), generator=gen).to(F64)
    wg = torch.randint(-1, 2, (h, d), generator=gen).to(F64)
    wu, wd = torch.randn(h, d, generator=gen, dtype=F64), torch.randn(d, h, generator=gen, dtype=F64)
    return x, wg, wu, wd


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("factor", [8, 2])
@pytest.mark.parametrize("hot", [None, [0, 7, 299]])
def test_twell_ffn_torch_matches_dense_fp64(gated, factor, hot):
    n, d, h = 9, 12, 300
    x, wg, wu, wd = _exact_case(n, d, h, seed=factor)
    x[4] = 0.0  # an all-zero row
    if not gated:  # the stored values are relu(x Wu^T): the integer weight keeps them exact
        wg, wu = None, wg
    hot_t = None if hot is None else torch.tensor(hot)
    out = twell_ffn_torch(x, wg, wu, wd, factor=factor, hot_units=hot_t)
    y_ref, st = gated_ffn_torch(x, wg, wu, wd)
    pre = x @ (wg if gated else wu).T
    act = pre > 0
    torch.testing.assert_close(out["y"], y_ref, rtol=1e-12, atol=1e-12)
    assert out["y"].dtype == F64 and out["y"][4].abs().max().item() == 0.0
    assert out["nnz_rows"].tolist() == act.sum(1).tolist()
    assert out["active_counts"].tolist() == act.sum(0).tolist() == st.active_counts.tolist()
    h_ref = (torch.relu(x @ wg.T) * (x @ wu.T)) if gated else torch.relu(pre)
    torch.testing.assert_close(out["l1_rows"], h_ref.abs().sum(1).float(), rtol=1e-6, atol=0)
    if factor == 8:  # ~40 % density: above the 32 slots of a 256-unit tile
        assert bool(out["overflow_rows"].any())
