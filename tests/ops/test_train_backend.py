"""The training ops' backend (``twell.ops.train_backend``): which backend a call gets
(``pick_backend``), the casts to the compute dtype, the statistics of an op's outputs, and the
backward of dense rows (``dense_rows_bwd``) against fp64 PyTorch autograd of the dense gated FFN
with the L1 term, on the PyTorch backend in float64 and the Triton one in float32 (on CPU through
``TRITON_INTERPRET=1``, tests/conftest.py). The checks' error lines: ``test_ffn_train.py`` and
``test_ffn_dense_train.py`` (through the ops). Shape legend: N tokens, D model width, H FFN width.
"""

import pytest
import torch

from twell.ops import train_backend
from twell.ops.reference import sparse_train_torch
from twell.ops.train_backend import cast_train_args, dense_rows_bwd, pick_backend, stats_of

from .train_cases import DEV, needs_triton


def test_pick_backend_by_name_device_and_dtype(monkeypatch):
    x32, x64 = torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.float64)
    assert pick_backend(x32, "torch") is sparse_train_torch
    assert pick_backend(x64, "auto") is sparse_train_torch  # fp64 always runs in PyTorch
    with pytest.raises(ValueError, match="backend must be one of"):
        pick_backend(x32, "cuda")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        pick_backend(x64, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pick_backend(x32, "auto") is sparse_train_torch  # CPU without the interpreter
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        pick_backend(x32, "triton")
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pick_backend(x32, "auto") is train_backend.triton_backend()
    assert pick_backend(x32, "triton").dw.__module__ == "twell.ops.dw"


def test_cast_train_args_to_autocast_dtype_and_contiguous():
    x = torch.randn(4, 6).t()  # (6, 4), not contiguous
    ws = [torch.randn(5, 4), torch.randn(5, 4), torch.randn(4, 5)]
    out = cast_train_args(x, *ws)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in out)
    assert torch.equal(out[0], x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cast_train_args(x, *ws)
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in out)
    assert torch.equal(out[3], ws[2].bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cast_train_args(x, *ws, cast_weights=False)
    assert out[0].dtype == torch.bfloat16 and all(o is w for o, w in zip(out[1:], ws))


def test_stats_of_counts_heavy_rows_above_the_capacity():
    l1 = torch.tensor(2.5)
    nnz = torch.tensor([0, 3, 7, 2, 9], dtype=torch.int32)
    counts = torch.tensor([1, 0, 4], dtype=torch.int32)
    st = stats_of((None, l1, nnz, counts), kc=3)
    assert st.n_tokens == 5 and st.l1.item() == 2.5
    assert st.nnz_sum.item() == 21 and st.nnz_max.item() == 9
    assert st.heavy_rows.item() == 2  # 7 and 9 are above 3
    assert torch.equal(st.active_counts, counts)


def _fp64_dense_grads(x, wg, wu, wd, dy, scale):
    """fp64 autograd of loss = sum(y dy) + scale sum |h|: [dx, dWg, dWu, dWd]."""
    ins = [t.detach().double().requires_grad_() for t in (x, wg, wu, wd)]
    h = torch.relu(ins[0] @ ins[1].T) * (ins[0] @ ins[2].T)
    loss = ((h @ ins[3].T) * dy.double()).sum() + scale * h.abs().sum()
    return torch.autograd.grad(loss, ins)


@pytest.mark.parametrize("backend,dtype,rtol", [
    ("torch", torch.float64, 1e-12),
    pytest.param("triton", torch.float32, 1e-4, marks=needs_triton),
])
@pytest.mark.parametrize("wd_transposed", [False, True])
def test_dense_rows_bwd_matches_fp64_autograd(backend, dtype, rtol, wd_transposed):
    n, d, h, scale = 13, 16, 40, 0.3
    gen = torch.Generator().manual_seed(0)
    x, wg, wu, dy = (torch.randn(*s, generator=gen) for s in ((n, d), (h, d), (h, d), (n, d)))
    wd = torch.randn(d, h, generator=gen)
    refs = _fp64_dense_grads(x, wg, wu, wd, dy, scale)
    x, wg, wu, wd, dy = (t.to(DEV, dtype) for t in (x, wg, wu, wd, dy))
    be = pick_backend(x, backend)
    g, u = x @ wg.T, x @ wu.T  # dense mode saves the raw pre-activation
    s = torch.tensor(scale, device=DEV, dtype=dtype)  # the ops pass it as a tensor
    dx, dwg, dwu, dwd = dense_rows_bwd(be, dy, s, x, wg, wu, wd, g, u, wd_transposed)
    if wd_transposed:
        assert dwd.shape == (h, d) and dwd.is_contiguous()
        dwd = dwd.T
    for name, out, ref in zip(("dx", "dWg", "dWu", "dWd"), (dx, dwg, dwu, dwd), refs):
        torch.testing.assert_close(out.double().cpu(), ref, rtol=rtol, atol=rtol * ref.abs().max(),
                                   msg=lambda m, name=name: f"{name}: {m}")
