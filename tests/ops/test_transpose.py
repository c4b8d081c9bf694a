"""The transposing cast (``twell.ops.transpose.transposed``) against PyTorch's copy of the
transposed view, bit for bit: odd shapes (partial tiles on both sides), a row-strided source,
the casts the training op makes (fp32 -> bf16 for Wd^T under autocast, bf16 -> fp32 for dWd),
NaN and inf. On CPU through the Triton interpreter (tests/conftest.py)."""

import pytest
import torch

from twell.ops.launch import kernel_config
from twell.ops.reference import sparse_train_torch

from .ell_cases import DEV, TRITON

pytestmark = pytest.mark.skipif(not TRITON, reason="Triton (or its interpreter) absent")


def _src(r, c, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(r, c, generator=gen) * 3
    t[0, 0], t[-1, -1], t[r // 2, c // 2] = float("nan"), float("inf"), float("-inf")
    return t.to(dtype).to(DEV)


def _same_bits(got, want, also=None):
    """got == want element for element (NaN where want has NaN), or == ``also`` where given."""
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    same = (got == want) | (got.isnan() & want.isnan())
    if also is not None:
        same |= got == also
    assert bool(same.all()), f"{int((~same).sum())} of {want.numel()} elements differ"


def _truncated_bf16(src_f32):
    """fp32 -> bf16 by dropping the low 16 bits: what Triton's interpreter does for a cast the
    GPU rounds to nearest even (the kernel runs on the CPU through the interpreter in CI)."""
    return (src_f32.contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("src_dtype,dtype", [
    (torch.float32, torch.bfloat16),  # Wd (fp32 master) -> Wd^T rows in the compute dtype
    (torch.bfloat16, torch.float32),  # dWd^T (compute dtype) -> dWd in the master's dtype
    (torch.bfloat16, torch.bfloat16),  # the bf16 benchmark's three copies
], ids=["f32_bf16", "bf16_f32", "bf16_bf16"])
@pytest.mark.parametrize("shape", [(5, 123), (37, 70), (1, 9)], ids=["5x123", "37x70", "1x9"])
def test_matches_the_torch_copy_bit_for_bit(src_dtype, dtype, shape):
    from twell.ops.transpose import transposed

    src = _src(*shape, src_dtype)
    with kernel_config(transpose_block=16):  # several tiles, partial on both sides
        got = transposed(src, dtype)
    trunc = None
    if not src.is_cuda and (src_dtype, dtype) == (torch.float32, torch.bfloat16):
        trunc = _truncated_bf16(src.t())
    _same_bits(got, sparse_train_torch.transposed(src, dtype), trunc)
    _same_bits(got, src.t().to(dtype).contiguous(), trunc)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_fp64_source_to_16_bits_rounds_through_fp32_as_torch(dtype):
    """fp64 weights under a 16-bit compute dtype: PyTorch's cast rounds to fp32 first, then to
    the 16-bit type, and so does the kernel. The first two values sit just above a 16-bit
    rounding midpoint (by 2^-40): one direct rounding goes up, PyTorch's two go to the even
    neighbour below."""
    from twell.ops.transpose import transposed

    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # at 1.0
    ties = torch.tensor([1 + ulp / 2 + 2.0**-40, -(1 + ulp / 2 + 2.0**-40)], dtype=torch.float64)
    src = _src(9, 70, torch.float64, seed=2)
    src[3, :2] = ties
    src = src.to(DEV)
    want = src.t().to(dtype)
    assert want[0, 3].item() == 1.0 and want[1, 3].item() == -1.0  # PyTorch's two roundings
    trunc = None
    if not src.is_cuda and dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16
        trunc = _truncated_bf16(src.t().float())
    with kernel_config(transpose_block=16):
        _same_bits(transposed(src, dtype), want, trunc)


def test_row_strided_source_and_empty():
    """A column slice of a wider tensor (row stride > C) is read in place; empty stays empty."""
    from twell.ops.transpose import transposed

    wide = _src(20, 50, torch.float32, seed=1)
    src = wide[:, 7:40]
    _same_bits(transposed(src, torch.float32), src.t().contiguous())
    assert transposed(wide[:0], torch.bfloat16).shape == (50, 0)


def test_refuses_strided_columns():
    from twell.ops.transpose import transposed

    with pytest.raises(ValueError, match=r"stride\(1\) == 1"):
        transposed(_src(8, 6, torch.float32).t(), torch.float32)
    with pytest.raises(ValueError, match="2-D"):
        transposed(torch.zeros(3, device=DEV), torch.float32)


def test_refuses_non_float_dtypes():
    """The output dtype and the source must be floating point (``transposed(x, torch.int32)``
    was accepted and cast): one-line ValueErrors naming the argument."""
    from twell.ops.transpose import transposed

    src = _src(8, 6, torch.float32)
    for dtype in (torch.int32, torch.bool, "bfloat16"):
        with pytest.raises(ValueError, match=r"^dtype: .*float torch.dtype; got"):
            transposed(src, dtype)
    with pytest.raises(ValueError, match=r"^src_RC: expected a float tensor, got torch.int64"):
        transposed(torch.zeros(8, 6, dtype=torch.int64, device=DEV), torch.float32)
