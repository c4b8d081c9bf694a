"""The row scatter-add (``twell.ops.add_rows.add_rows``, the Triton backend's ``add_rows``, and
the PyTorch backend's ``twell.ops.reference.sparse_train_torch.add_rows``) against an fp64
reference rounded once to dst's dtype, and against ``index_add_`` over the used slots, bit for
bit: unused slots (index N, the no-sync backup's fill value), NaN / inf rows, R = 0, R = N - 1,
strided rows, several column blocks. On CPU the kernel runs through ``TRITON_INTERPRET=1``
(tests/conftest.py). Shape legend: N destination rows, D row width, R slots.
"""

import pytest
import torch

from twell.ops.reference import sparse_train_torch
from twell.ops.train_backend import triton_backend

from .train_cases import DEV, needs_triton

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _backend(name):
    return sparse_train_torch if name == "torch" else triton_backend()


BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]


def _case(n, d, rows, unused, dtype, seed=0):
    """dst (N, D), idx (R,) int64 (``rows`` then ``unused`` slots of index N), src (R, D), on
    DEV in ``dtype``; every unused slot's src row is NaN (it must not reach dst)."""
    gen = torch.Generator().manual_seed(seed)
    dst = torch.randn(n, d, generator=gen).to(dtype)
    idx = torch.tensor(list(rows) + [n] * unused, dtype=torch.int64)
    src = torch.randn(idx.shape[0], d, generator=gen).to(dtype)
    src[len(rows):] = float("nan")
    return dst.to(DEV), idx.to(DEV), src.to(DEV)


def _want(dst, idx, src, truncate=False):
    """fp64 sums at the used slots, rounded once to dst's dtype (PyTorch casts fp64 to 16 bits
    through fp32: exact here, each sum of two 16-bit values fits fp32). ``truncate``: fp32 ->
    bf16 by dropping the low 16 bits, what Triton's interpreter does for the cast the GPU
    rounds to nearest even (as in test_transpose.py)."""
    out = dst.double().cpu()
    used = idx.cpu() < dst.shape[0]
    out[idx.cpu()[used]] += src.double().cpu()[used]
    if dst.dtype not in (torch.bfloat16, torch.float16):
        return out.to(dst.dtype)
    if truncate and dst.dtype == torch.bfloat16:
        return (out.float().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    return out.float().to(dst.dtype)


def _check(be, dst, idx, src):
    interpreted = be is not sparse_train_torch and not dst.is_cuda
    want = _want(dst, idx, src, truncate=interpreted)
    used = idx < dst.shape[0]
    by_index_add = dst.clone().index_add_(0, idx[used], src[used])
    got = be.add_rows(dst, idx, src)
    assert got is dst
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)
    if not (interpreted and dst.dtype == torch.bfloat16):
        torch.testing.assert_close(got, by_index_add, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_used_slots_added_unused_skipped_bit_for_bit(backend, dtype):
    """37 rows of width 45 (odd: a partial column block), 9 used slots in no order, 5 unused;
    row N - 1 is not used, so nothing may reach it (its -0.0 stays -0.0)."""
    n, d = 37, 45
    dst, idx, src = _case(n, d, [3, 0, 35, 17, 8, 22, 5, 30, 11], 5, dtype, seed=1)
    dst[n - 1] = -0.0
    _check(_backend(backend), dst, idx, src)
    assert torch.signbit(dst[n - 1]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nan_and_inf_rows_reach_dst(backend, dtype):
    """A used slot's NaN and +inf reach their rows (and inf + -inf gives NaN, as index_add_)."""
    dst, idx, src = _case(10, 20, [2, 7, 4], 3, dtype, seed=2)
    src[0, 3] = float("nan")
    src[1, :] = float("inf")
    dst[4, 5] = float("-inf")
    src[2, 5] = float("inf")
    _check(_backend(backend), dst, idx, src)
    assert dst[2, 3].isnan() and dst[7].isposinf().all() and dst[4, 5].isnan()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_slots_and_every_row_but_one(backend):
    """R = 0 leaves dst as it was; R = N - 1 used slots (a permutation of all rows but one)."""
    be = _backend(backend)
    dst, idx, src = _case(12, 30, [], 0, torch.float32)
    before = dst.clone()
    be.add_rows(dst, idx, src)
    assert torch.equal(dst, before)
    rows = torch.randperm(16, generator=torch.Generator().manual_seed(3))[:15].tolist()
    _check(be, *_case(16, 30, rows, 0, torch.bfloat16, seed=4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows_and_several_column_blocks(backend):
    """src and dst column slices of wider tensors (row strides 70 and 50), int32 indices, and
    (Triton) 16-column programs: 3 blocks of a 40-wide row, the last partial."""
    from twell.ops.launch import kernel_config

    gen = torch.Generator().manual_seed(5)
    wide_dst = torch.randn(9, 50, generator=gen).to(DEV, torch.bfloat16)
    wide_src = torch.randn(6, 70, generator=gen).to(DEV, torch.bfloat16)
    before = wide_dst.clone()
    dst, src = wide_dst[:, 5:45], wide_src[:, 20:60]
    idx = torch.tensor([8, 1, 9, 4, 9, 0], dtype=torch.int32, device=DEV)  # 9 = N: unused
    with kernel_config(add_rows_block_d=16):
        _check(_backend(backend), dst, idx, src)
    assert torch.equal(wide_dst[:, :5], before[:, :5])  # outside the slice: untouched
    assert torch.equal(wide_dst[:, 45:], before[:, 45:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_name_the_problem(backend):
    be = _backend(backend)
    dst = torch.zeros(4, 8, device=DEV)
    idx = torch.tensor([0, 2], device=DEV)
    src = torch.ones(2, 8, device=DEV)
    with pytest.raises(ValueError, match="must have dst's float dtype"):
        be.add_rows(dst, idx, src.double())
    with pytest.raises(ValueError, match="must match idx"):
        be.add_rows(dst, idx[:1], src)
    with pytest.raises(ValueError, match="int32 or int64"):
        be.add_rows(dst, idx.float(), src)
    with pytest.raises(ValueError, match="src's columns must be contiguous"):
        be.add_rows(dst, idx, torch.ones(8, 2, device=DEV).t())
    with pytest.raises(ValueError, match=r"dst must be a float tensor .*got torch\.int64"):
        be.add_rows(dst.long(), idx, src.long())
    assert not dst.any()  # nothing written before a refusal


@pytest.mark.parametrize("backend", BACKENDS)
def test_dst_sharing_memory_with_src_or_idx_is_refused(backend):
    """A dst whose bytes src or idx also occupy (the kernel would read rows it writes) is
    refused before anything is written; adjacent row blocks of one tensor are not."""
    be = _backend(backend)
    buf = torch.arange(48, dtype=torch.float32, device=DEV).reshape(6, 8)
    before = buf.clone()
    idx = torch.tensor([0, 2], device=DEV)
    with pytest.raises(ValueError, match=r"dst shares memory with src .*src\.clone\(\)"):
        be.add_rows(buf[:4], idx, buf[3:5])  # row 3 is dst's and src's
    with pytest.raises(ValueError, match="dst shares memory with src"):
        be.add_rows(buf[:, :4], idx, buf[2:4, 2:6])  # columns 2, 3 of rows 2, 3
    dst = torch.zeros(4, 8, device=DEV)
    with pytest.raises(ValueError, match=r"dst shares memory with idx .*idx\.clone\(\)"):
        be.add_rows(dst, dst.view(torch.int32)[0, :2], torch.ones(2, 8, device=DEV))
    assert torch.equal(buf, before) and not dst.any()
    _check(be, buf[:4], idx, buf[4:6])  # next to each other, not overlapping: added
    be.add_rows(dst, idx[:0], dst[:0])  # R = 0: an empty view of dst reads nothing


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_strided_indices(backend, idx_dtype):
    """idx a strided view (every other entry of a longer tensor, whose other entries would name
    other rows): each slot reads its own entry."""
    gen = torch.Generator().manual_seed(6)
    dst = torch.randn(11, 24, generator=gen).to(DEV)
    src = torch.randn(5, 24, generator=gen).to(DEV)
    wide = torch.tensor([7, 0, 2, 1, 11, 3, 9, 4, 5, 6], dtype=idx_dtype, device=DEV)
    idx = wide[::2]  # 7, 2, 11 (= N: unused), 9, 5
    assert not idx.is_contiguous()
    _check(_backend(backend), dst, idx, src)
