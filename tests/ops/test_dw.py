"""The weight-gradient kernel (``twell.ops.dw``) alone, against dense fp64 products.

The ELL entries (token n, slot k, unit col[n, k]) of a hand-built state are scattered into dense
(N, H) matrices, so the reference is three plain matmuls, independent of the CSC order and of
the PyTorch backend:  dWg = Dg^T x,  dWu = Du^T x,  dWd^T = (G * U)^T dy  (+ the dense-backup
adds). The CSC order is the training forward's own (``ffn_train.csc_order``). On CPU the kernel
runs through the Triton interpreter (tests/conftest.py).
"""

import pytest
import torch

from twell.ops import ffn_train
from twell.ops.launch import kernel_config
from twell.ops.train_backend import pick_backend

from .ell_cases import DEV, TRITON, dense_dw, ell_state

pytestmark = pytest.mark.skipif(not TRITON, reason="Triton (or its interpreter) absent")


def run_dw(x, dy, col, nnz, dg, du, g, u, h, adds=None, out_dtype=torch.float32):
    perm, colptr, order = ffn_train.csc_order(col, nnz, col.shape[1], h)
    outs = [torch.full((h, x.shape[1]), 7.0, dtype=out_dtype, device=x.device) for _ in range(3)]
    pick_backend(x, "triton").dw(*outs, adds, x, dy, perm, colptr, dg, du, g, u, order=order)
    return outs


def assert_close(got, want, rel=1e-5):
    for name, a, b in zip(("dWg", "dWu", "dWd^T"), got, want):
        err = (a.double() - b).norm() / b.norm().clamp_min(1e-30)
        assert err < rel, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("launch", [
    {},  # the defaults (auto D slice, D slice outermost)
    {"dw_block_j": 1, "dw_block_d": 16, "dw_warps": 1},  # one entry a step, D in 3 slices
    {"dw_block_j": 16, "dw_block_d": 16, "dw_warps": 4},  # more entries a step than most columns
    {"dw_block_j": 4, "dw_block_d": 32, "dw_warps": 2, "dw_d_outer": 0},  # columns outermost
], ids=["default", "j1d16", "j16d16", "columns_outer"])
def test_matches_dense_products(launch):
    """Odd D (37: partial slices), a unit active in every non-empty row (a long column), rows
    with no entry, unused slots full of garbage; outputs fully overwritten (filled with 7)."""
    st = ell_state(29, 37, 50, 6, seed=1, hot=3, zero_rows=(0, 5))
    with kernel_config(**launch):
        got = run_dw(*st, 50)
    assert_close(got, dense_dw(*st, 50))


def test_dense_backup_adds_and_bf16_operands():
    """bf16 x, dy, g, u and bf16 outputs (fp32 accumulation), with the dense-backup parts added."""
    st = ell_state(24, 40, 30, 5, seed=2, hot=0, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    adds = [torch.randn(30, 40, generator=gen).to(DEV) for _ in range(3)]
    got = run_dw(*st, 30, adds=adds, out_dtype=torch.bfloat16)
    assert_close(got, dense_dw(*st, 30, adds=adds), rel=1e-2)  # bf16 outputs: ~4e-3


def test_no_entry_at_all_gives_the_adds():
    st = ell_state(8, 16, 12, 4, seed=4, zero_rows=range(8))
    adds = [torch.full((12, 16), float(i + 1), device=DEV) for i in range(3)]
    got = run_dw(*st, 12, adds=adds)
    for a, b in zip(got, adds):
        assert torch.equal(a, b)
    assert all(torch.count_nonzero(o) == 0 for o in run_dw(*st, 12))


def test_a_nan_reaches_exactly_the_units_of_its_row():
    """NaN in one token's dy: dWd^T is NaN in the rows of the units that token activates and
    nowhere else; dWg / dWu (from x) stay finite. inf in x: the units of its row get inf / NaN."""
    x, dy, col, nnz, dg, du, g, u = ell_state(16, 24, 40, 5, seed=5, hot=None)
    r = int(torch.nonzero(nnz > 0)[0])
    dy[r, 7] = float("nan")
    got = run_dw(x, dy, col, nnz, dg, du, g, u, 40)
    units = set(col[r, : int(nnz[r])].tolist())
    bad = set(torch.nonzero(torch.isnan(got[2]).any(1)).flatten().tolist())
    assert bad == units
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
    dy[r, 7] = 0.0
    x[r, 2] = float("inf")
    got = run_dw(x, dy, col, nnz, dg, du, g, u, 40)
    bad = set(torch.nonzero(~torch.isfinite(got[0]).all(1)).flatten().tolist())
    assert bad == units and torch.isfinite(got[2]).all()
