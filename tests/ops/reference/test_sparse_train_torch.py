"""The PyTorch backend of the training ops (``twell.ops.reference.sparse_train_torch``), each
function alone in float64 against dense fp64 products (the entries of a hand-built ELL state
scattered into dense (N, H) matrices, ``tests/ops/ell_cases.py``) or a hand-computed case: the
same checks the Triton kernels' files make (``test_compact.py``, ``test_sddmm.py``,
``test_spmm.py``, ``test_dw.py``, ``test_elementwise.py``), at fp64 tolerance. The whole op on this
backend: ``test_ffn_train.py``. Shape legend: N tokens, D model width, H FFN width, K ELL width.
"""

import torch

from twell.ops import ffn_train
from twell.ops.reference import sparse_train_torch as ref

from ..ell_cases import dense_dw, ell_state, scatter

F64 = torch.float64


def _state(*args, **kw):
    return [t.cpu() for t in ell_state(*args, dtype=F64, **kw)]


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def test_compact_hand_computed():
    g = torch.tensor([[0.0, 2.0, -1.0, 3.0, float("nan")],
                      [-1.0, -2.0, -0.0, 0.0, -3.0],
                      [1.0, 1.0, 1.0, 1.0, 1.0]], dtype=F64)
    col, val, nnz, counts, nnz_eff, heavy = ref.compact_heavy(g, 3)
    assert nnz.tolist() == [3, 0, 5] and counts.tolist() == [1, 2, 1, 2, 2]  # NaN is active
    assert col[0].tolist() == [1, 3, 4] and val[0, :2].tolist() == [2.0, 3.0]
    assert torch.isnan(val[0, 2]) and col[2].tolist() == [0, 1, 2]  # the first kc of a heavy row
    assert nnz_eff.tolist() == [3, 0, 0] and heavy.tolist() == [1]


def test_sddmm_fwd_and_bwd_match_dense():
    x, dy, col, nnz, _, _, g, u = _state(27, 37, 60, 7, seed=11, hot=2, zero_rows=(3,))
    gen = torch.Generator().manual_seed(1)
    wu, wdt = torch.randn(60, 37, generator=gen, dtype=F64), torch.randn(60, 37, generator=gen,
                                                                        dtype=F64)
    valid = ref.valid_slots(nnz, col.shape[1])
    u_fwd, l1 = ref.sddmm_fwd(x, wu, col, g, nnz)
    u_ref = torch.gather(x @ wu.T, 1, col.long()) * valid
    assert _rel(u_fwd[valid], u_ref[valid]) < 1e-12 and l1[3] == 0
    torch.testing.assert_close(l1, (g * u_ref).abs().sum(1), rtol=1e-12, atol=1e-12)
    dg, du = ref.sddmm_bwd(dy, wdt, col, g, u, nnz, torch.tensor(0.25, dtype=F64))
    dh = torch.gather(dy @ wdt.T, 1, col.long()) + 0.25 * torch.sign(u)
    assert _rel(dg[valid], (dh * u)[valid]) < 1e-12 and _rel(du[valid], (dh * g)[valid]) < 1e-12


def test_spmm_one_and_two_weights_match_dense():
    _, _, col, nnz, a, b, _, _ = _state(31, 37, 45, 6, seed=13, hot=5, zero_rows=(0, 9))
    a, b = a.double(), b.double()
    gen = torch.Generator().manual_seed(3)
    w1, w2 = (torch.randn(45, 37, generator=gen, dtype=F64) for _ in range(2))
    out = torch.full((31, 37), 7.0, dtype=F64)
    ref.spmm(out, w1, None, col, a, b, nnz)
    assert _rel(out, scatter(col, nnz, a * b, 45) @ w1) < 1e-12
    ref.spmm(out, w1, w2, col, a, b, nnz)
    assert _rel(out, scatter(col, nnz, a, 45) @ w1 + scatter(col, nnz, b, 45) @ w2) < 1e-12
    assert torch.count_nonzero(out[[0, 9]]) == 0  # rows with no slot: written as zero


def test_dw_matches_dense_products_with_the_adds():
    st = _state(29, 37, 50, 6, seed=1, hot=3, zero_rows=(0, 5))
    st[4], st[5] = st[4].double(), st[5].double()  # dg, du
    x, dy, col, nnz, dg, du, g, u = st
    adds = [torch.randn(50, 37, generator=torch.Generator().manual_seed(i), dtype=F64)
            for i in range(3)]
    perm, colptr, order = ffn_train.csc_order(col, nnz, col.shape[1], 50)
    outs = [torch.full((50, 37), 7.0, dtype=F64) for _ in range(3)]
    ref.dw(*outs, adds, x, dy, perm, colptr, dg, du, g, u, order=order)
    for name, got, want in zip(("dWg", "dWu", "dWd^T"), outs, dense_dw(*st, 50, adds=adds)):
        assert _rel(got, want) < 1e-12, name


def test_dense_rows_fwd_and_bwd_hand_computed():
    g = torch.tensor([[2.0, -1.0, 0.0], [-3.0, 4.0, 1.0]], dtype=F64)
    u = torch.tensor([[3.0, 5.0, -2.0], [1.0, -2.0, 0.5]], dtype=F64)
    h, l1, l0, counts = ref.dense_fwd(g, u)
    assert h.tolist() == [[6.0, 0.0, 0.0], [0.0, -8.0, 0.5]]
    assert l1.tolist() == [6.0, 8.5] and l0.tolist() == [1, 2] and counts.tolist() == [1, 1, 1]
    dh = torch.ones(2, 3, dtype=F64)
    dg, du, h_b = ref.backup_bwd(dh, g, u, torch.tensor(0.5, dtype=F64))
    # dh + 0.5 sign(h): [[1.5, 1, 1], [1, 0.5, 1.5]]; dg = dh u where g > 0, du = dh relu(g)
    assert dg.tolist() == [[4.5, 0.0, 0.0], [0.0, -1.0, 0.75]]
    assert du.tolist() == [[3.0, 0.0, 0.0], [0.0, 2.0, 1.5]] and torch.equal(h_b, h)
    g_in = g.clone()
    h_f, l1_f = ref.backup_fwd(g_in, u)
    assert torch.equal(h_f, h) and l1_f.item() == 14.5 and g_in.min().item() == 0.0  # relu'd
