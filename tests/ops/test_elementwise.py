"""The fused elementwise kernels (``twell.ops.elementwise``: ``dense_fwd`` forward, ``backup_bwd``
backward) through dense mode's Triton backend (``dense_ffn_train(backend="triton")``, whose only
Triton passes they are; the products are cuBLAS / torch.matmul), against fp64 dense autograd,
at two launch shapes (``dense_block_n``, ``dense_block_h``).

The same kernels on the inference op's dense path: ``test_ffn.py``
(``test_dense_path_fused_pass_matches_pytorch``); dense mode's PyTorch backend and its
integration: ``test_ffn_dense_train.py``. On CPU through ``TRITON_INTERPRET=1``
(tests/conftest.py).
"""

import pytest
import torch

from twell.ops import ffn_dense_train

from .train_cases import DEV, check_case, make_inputs, needs_triton


@needs_triton
@pytest.mark.parametrize("block", [(16, 256), (4, 64)])
@pytest.mark.parametrize("n,d,h", [(33, 40, 300), (7, 16, 64)])
def test_dense_mode_triton_fp32(block, n, d, h):
    """Odd N and H: partial row blocks and column steps; hot units and an all-zero token; with
    4-row programs the per-block column counts of 9 programs are summed."""
    from twell.ops.launch import kernel_config

    x, wg, wu, wd, dy = make_inputs(n, d, h, threshold=0.5, seed=5 * n + h, hot=2,
                                    zero_rows=(1,))
    with kernel_config(dense_block_n=block[0], dense_block_h=block[1]):
        check_case(x, wg, wu, wd, dy, l1_coeff=0.5, dtype=torch.float32, rel=2e-5,
                   fn=ffn_dense_train.dense_ffn_train, backend="triton")


@needs_triton
def test_dense_fwd_refuses_mixed_dtypes():
    """g and u of one dtype (an fp32 g with a bf16 u was accepted): a one-line ValueError
    naming u_NH and both dtypes."""
    from twell.ops.elementwise import dense_fwd

    g = torch.randn(5, 40, device=DEV)
    with pytest.raises(ValueError, match=r"^u_NH: expected dtype torch.float32, got torch.bfloat16"):
        dense_fwd(g, g.bfloat16())
    with pytest.raises(ValueError, match=r"^g_NH: expected a 2-D"):
        dense_fwd(g[0], g[0])
    h, *_ = dense_fwd(g, g)
    torch.testing.assert_close(h, g.clamp(min=0) * g)
