"""The SDDMM kernels (``twell.ops.sddmm``) alone, against dense fp64 products.

Forward: ``u[n, k] = x[n] . Wu[col[n, k]]`` at the valid slots and ``l1[n] = sum_k |g u|``;
backward: ``dh = dy . Wd^T[col] + s sign(u)``, ``dg = dh u``, ``du = dh g``. The reference reads
the slots out of dense (N, H) products (``x Wu^T``, ``dy Wd``); unused slots are not compared
(the kernels leave them undefined). Through the Triton interpreter on CPU.
"""

import pytest
import torch

from twell.ops.launch import kernel_config
from twell.ops.reference import sparse_train_torch as ref
from twell.ops.train_backend import pick_backend

from .ell_cases import DEV, TRITON, ell_state

pytestmark = pytest.mark.skipif(not TRITON, reason="Triton (or its interpreter) absent")
LAUNCHES = [{}, {"sddmm_block_k": 2, "sddmm_block_d": 16, "sddmm_warps": 2}]


def at_slots(dense_NH, col):
    return torch.gather(dense_NH, 1, col.long())


def rel(a, b, valid):
    a, b = a.double()[valid], b[valid]
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("launch", LAUNCHES, ids=["default", "small_blocks"])
def test_forward_matches_dense(launch):
    x, _, col, nnz, _, _, g, _ = ell_state(27, 37, 60, 7, seed=11, hot=2, zero_rows=(3,))
    wu = torch.randn(60, 37, generator=torch.Generator().manual_seed(1)).to(DEV)
    with kernel_config(**launch):
        u, l1 = pick_backend(x, "triton").sddmm_fwd(x, wu, col, g, nnz)
    valid = ref.valid_slots(nnz, col.shape[1])
    u_ref = at_slots(x.double() @ wu.double().t(), col) * valid
    assert rel(u, u_ref, valid) < 1e-5
    l1_ref = (g.double() * u_ref).abs().sum(1)
    assert torch.allclose(l1.double(), l1_ref, rtol=1e-5, atol=1e-6)
    assert l1[3] == 0  # a row with no slot


@pytest.mark.parametrize("launch", LAUNCHES, ids=["default", "small_blocks"])
def test_backward_matches_dense(launch):
    _, dy, col, nnz, _, _, g, u = ell_state(25, 33, 50, 6, seed=12, hot=0)
    wdt = torch.randn(50, 33, generator=torch.Generator().manual_seed(2)).to(DEV)
    scale = torch.tensor(0.25, device=DEV)
    with kernel_config(**launch):
        dg, du = pick_backend(dy, "triton").sddmm_bwd(dy, wdt, col, g, u, nnz, scale)
    valid = ref.valid_slots(nnz, col.shape[1])
    dh = at_slots(dy.double() @ wdt.double().t(), col) + 0.25 * torch.sign(u.double())
    assert rel(dg, dh * u.double(), valid) < 1e-5
    assert rel(du, dh * g.double(), valid) < 1e-5
