"""Dense mode of the training op (``twell.ops.ffn_dense_train.dense_ffn_train``: cuBLAS products,
one fused elementwise pass each way) against fp64 dense autograd (``twell.ops.reference``): the
PyTorch backend in float64, the op's schema, torch.compile and checkpointing, its input checks;
and a NaN gate reaching y on both backends as on the PyTorch path.

Its Triton pass at several launch shapes: ``test_elementwise.py``. On CPU the Triton kernels run
through ``TRITON_INTERPRET=1`` (tests/conftest.py). Shape legend: N tokens, D model width, H FFN
width.
"""

import pytest
import torch

from twell.ops import ffn_dense_train
from twell.ops.reference import gated_ffn_torch

from .train_cases import DEV, check_case, check_compiled_and_checkpointed, make_inputs, needs_triton


@pytest.mark.parametrize("n,d,h,l1_coeff", [(1, 16, 64, 0.5), (33, 40, 300, 0.5), (33, 40, 300, 0.0),
                                            (64, 24, 257, 2.0)])
def test_dense_mode_torch_backend_fp64(n, d, h, l1_coeff):
    x, wg, wu, wd, dy = make_inputs(n, d, h, threshold=0.3, seed=n + h, zero_rows=(0,))
    check_case(x, wg, wu, wd, dy, l1_coeff=l1_coeff, dtype=torch.float64, rel=1e-10,
               fn=ffn_dense_train.dense_ffn_train, backend="torch")


def test_dense_mode_opcheck_compile_and_checkpoint():
    x, wg, wu, wd, dy = make_inputs(7, 16, 64, seed=14)
    args = tuple(t.float() for t in (x, wg, wu, wd)) + ("torch",)
    torch.library.opcheck(ffn_dense_train._ffn_dense_train_fwd, args)

    def f(x, wg, wu, wd, dy):
        y, st = ffn_dense_train.dense_ffn_train(x, wg, wu, wd, backend="torch")
        return (y * dy).sum() + 0.5 * st.l1

    check_compiled_and_checkpointed(f, x, wg, wu, wd, dy)


def test_dense_mode_bad_inputs_name_the_argument():
    x, wg, wu, wd, _ = make_inputs(3, 16, 64)
    with pytest.raises(ValueError, match="dense_ffn_train.*w_down_DH"):
        ffn_dense_train.dense_ffn_train(x, wg, wu, wd.t())
    with pytest.raises(ValueError, match="dense_ffn_train needs w_gate_HD"):
        ffn_dense_train.dense_ffn_train(x, None, wu, wd)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_dense_mode_propagates_a_nan_gate_like_pytorch(backend):
    """A NaN confined to one gate weight row makes that unit's gate NaN in every token:
    relu(NaN) * u = NaN reaches y as on the PyTorch path (a GPU max(g, 0) would return 0 and
    hide it)."""
    x, wg, wu, wd, _ = make_inputs(9, 16, 64, threshold=0.5, seed=51)
    wg = wg.clone()
    wg[3, 5] = float("nan")
    y_ref, _ = gated_ffn_torch(x.float(), wg.float(), wu.float(), wd.float(), with_stats=False)
    y, _ = ffn_dense_train.dense_ffn_train(*(t.float().to(DEV) for t in (x, wg, wu, wd)),
                                        backend=backend)
    assert torch.isnan(y_ref).all()
    assert torch.equal(torch.isnan(y.cpu()), torch.isnan(y_ref))
