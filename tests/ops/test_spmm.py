"""The SpMM kernel (``twell.ops.spmm``) alone, against dense fp64 products.

``out[n] = sum_k a b W1[col[n, k]]`` (one weight: the forward's ``y = h Wd^T``) and
``out[n] = sum_k a W1[col] + b W2[col]`` (two: the backward's ``dx``). The reference scatters the
slot values into dense (N, H) matrices and multiplies; every output row is written, rows with
no slot get zero. Through the Triton interpreter on CPU.
"""

import pytest
import torch

from twell.ops.launch import kernel_config
from twell.ops.train_backend import pick_backend

from .ell_cases import DEV, TRITON, ell_state, scatter

pytestmark = pytest.mark.skipif(not TRITON, reason="Triton (or its interpreter) absent")


@pytest.mark.parametrize("launch", [{}, {"spmm_block_k": 2, "spmm_block_k2": 1,
                                         "spmm_block_d": 16, "spmm_warps": 2}],
                         ids=["default", "small_blocks"])
@pytest.mark.parametrize("two", [False, True], ids=["one_weight", "two_weights"])
def test_matches_dense(launch, two):
    _, _, col, nnz, a, b, _, _ = ell_state(31, 37, 45, 6, seed=13, hot=5, zero_rows=(0, 9))
    gen = torch.Generator().manual_seed(3)
    w1 = torch.randn(45, 37, generator=gen).to(DEV)
    w2 = torch.randn(45, 37, generator=gen).to(DEV) if two else None
    out = torch.full((31, 37), 7.0, device=DEV)
    with kernel_config(**launch):
        pick_backend(out, "triton").spmm(out, w1, w2, col, a, b, nnz)
    if two:
        want = scatter(col, nnz, a, 45) @ w1.double() + scatter(col, nnz, b, 45) @ w2.double()
    else:
        want = scatter(col, nnz, a.double() * b.double(), 45) @ w1.double()
    assert float((out.double() - want).norm() / want.norm()) < 1e-5
    assert torch.count_nonzero(out[[0, 9]]) == 0  # rows with no slot: written as zero
