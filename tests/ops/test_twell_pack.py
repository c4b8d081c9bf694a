"""The TwELL producer kernel (``twell.ops.twell_pack.pack_dense``) alone, against the PyTorch
reference pack (``twell.format.pack``), bit for bit: counts, columns and values of every valid
slot, the per-column active counts, the per-row counts and overflowed tiles, on crafted tiles
(empty, full, at capacity, one above, NaN with either sign, -0.0) at several launch shapes.

On a machine without CUDA the Triton kernel runs in the interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is imported if the caller did not).
"""

import pytest
import torch

from twell.format import TILE, pack, validate, words_per_tile

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and not triton.knobs.runtime.interpret:
    pytest.skip("no CUDA and triton was imported without TRITON_INTERPRET=1", allow_module_level=True)

from twell.ops.twell_pack import pack_dense

from .infer_cases import DEV


@pytest.mark.parametrize(
    "factor,dtype,launch",
    [
        # one row on one warp (the default), and 2 / 4 rows per program (partial last block)
        (8, torch.bfloat16, {}),  # 16-bit input: bits kept
        (8, torch.float32, {"block_m": 4, "num_warps": 2}),
        (4, torch.float32, {"block_m": 2, "num_warps": 2}),
        (4, torch.float32, {}),
        (2, torch.float16, {"num_warps": 1}),
        (2, torch.float32, {"block_m": 4}),
        (8, torch.float16, {"block_m": 2}),
    ],
)
def test_pack_dense_matches_reference_pack(factor, dtype, launch):
    torch.manual_seed(factor)
    m, h = 37, 777
    cap = words_per_tile(factor) - 1
    a = torch.randn(m, h)
    a = torch.where(torch.rand(m, h) < 0.4 * cap / TILE, a.abs() + 0.01, -a.abs())
    # crafted tiles: empty row, full row, tiles with cap, cap+1, 100, 256 (partial) actives
    a[0] = -1.0
    a[1] = 1.0
    for r, k in zip(range(2, 7), (cap, cap + 1, 100, 256, 255)):
        a[r, :TILE] = -1.0
        a[r, :k] = torch.arange(1.0, k + 1)
    a[7, 3] = float("nan")
    a[8, :] = float("nan")
    a[9, 4] = -float("nan")  # a NaN with the sign bit: still active (not (a <= 0))
    a[10, 5] = -0.0
    a = a.to(dtype).to(DEV)
    tw, colcnt = pack_dense(a, factor, stats=True, **launch)
    ref = pack(a.cpu(), factor)
    assert tw.value_dtype == ref.value_dtype
    assert torch.equal(tw.counts.cpu(), ref.counts)
    valid, cols, vals, _ = ref.slots()
    _, gcols, gvals, _ = tw.slots()
    assert torch.equal(gcols.cpu()[valid], cols[valid])
    torch.testing.assert_close(gvals.cpu()[valid], vals[valid], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(colcnt.cpu(), (~(a.cpu() <= 0)).sum(0, dtype=torch.int32))
    info = validate(tw)
    assert info["overflow_rows"] == int((ref.counts > cap).any(1).sum()) >= 4
    # the per-row sums written in the same pass: each row's exact count and overflowed tiles
    act = ~(a.cpu() <= 0)
    assert tw.row_nnz.dtype == torch.int32 and tw.row_overflow.dtype == torch.int32
    assert torch.equal(tw.row_nnz.cpu(), act.sum(1, dtype=torch.int32))
    assert torch.equal(tw.row_overflow.cpu(), (ref.counts > cap).sum(1, dtype=torch.int32))
    assert torch.equal(tw.nnz_per_row(), tw.row_nnz) and int(tw.n_overflow_tiles()) == int(
        (ref.counts > cap).sum())
    assert torch.equal(tw.overflow_rows().cpu(), ref.overflow_rows())
