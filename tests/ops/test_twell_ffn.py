"""The TwELL consumer kernel (``twell.ops.twell_ffn.twell_ffn_apply``) alone, against fp64 dense
products on crafted rows (all-zero, fully dense, at capacity, an overflowed tile between listed
ones, a single non-zero in the last column), gated and non-gated, at several launch shapes; and
the operand checks of the consumer (and of the producer's ``block_m``).

On a machine without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is imported if the caller did not).
"""

import numpy as np
import pytest
import torch

from twell.format import pack

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and not triton.knobs.runtime.interpret:
    pytest.skip("no CUDA and triton was imported without TRITON_INTERPRET=1", allow_module_level=True)

from twell.ops.twell_ffn import twell_ffn_apply
from twell.ops.twell_pack import pack_dense

from .infer_cases import DEV, assert_close_verbose

CONSUMER_LAUNCHES = [
    {},                                      # default: nb 4, k 32
    {"nb": 1, "rows": 2},
    {"nb": 1, "k": 2},                       # many K-batches per row
    {"nb": 2, "k": 4, "prefetch": True},
    {"nb": 4, "k": 8, "prefetch": True, "rows": 3},
    {"heavy_first": True},                   # rows longest first
    {"nb": 2, "rows": 3, "heavy_first": True},
]


@pytest.mark.parametrize("launch", CONSUMER_LAUNCHES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "default")
def test_consumer_launches_match_fp64_on_crafted_rows(launch):
    """twell_ffn_apply alone, several launch shapes, gated and non-gated.

    Rows: all-zero; fully dense (every tile overflowed); exactly at capacity in tile 0 plus
    entries in the partial last tile; one overflowed tile between listed ones (list order
    must skip it); a single non-zero in the last column; random sparse rows.
    """
    gen = torch.Generator().manual_seed(21)
    m, d, h = 8, 24, 700  # 3 tiles, the last one 188 columns wide
    pre = torch.randn(m, h, generator=gen, dtype=torch.float64)
    pre = torch.where(torch.rand(m, h, generator=gen) < 0.03, pre.abs() + 0.1, -pre.abs())
    pre[0] = -1.0
    pre[1] = pre[1].abs() + 0.1
    pre[2] = -1.0
    pre[2, :31] = 0.5
    pre[2, 600:604] = 2.0
    pre[3] = -1.0
    pre[3, 3] = 1.0
    pre[3, 256:300] = 0.25       # tile 1 overflowed (44 > 31)
    pre[3, [520, 699]] = 4.0
    pre[4] = -1.0
    pre[4, h - 1] = 3.0
    pre = pre.to(torch.bfloat16).float()  # bf16-exact: the TwELL values are the dense values
    x = torch.randn(m, d, generator=gen)
    wu = torch.randn(h, d, generator=gen)
    wdt = torch.randn(h, d, generator=gen)
    pre, x, wu, wdt = (t.to(DEV) for t in (pre, x, wu, wdt))
    tw = pack(pre, 8)
    assert int(tw.overflow_tiles().sum()) == 3 + 1 and int(tw.counts[2, 0]) == 31
    g = torch.relu(pre).double()
    for gated in (True, False):
        h_ref = g * (x.double() @ wu.double().T) if gated else g
        y_ref = h_ref @ wdt.double()
        up = {"x_MD": x, "w_up_HD": wu} if gated else {}
        y, l1 = twell_ffn_apply(tw, pre, wdt, stats=True, **up, **launch)
        assert_close_verbose(y, y_ref, rtol=1e-5, atol=1e-4, what=f"y gated={gated} {launch}")
        torch.testing.assert_close(l1.double(), h_ref.abs().sum(1), rtol=1e-5, atol=1e-6)
        assert y[0].abs().max().item() == 0.0 and l1[0].item() == 0.0


@pytest.mark.parametrize("launch", [{}, {"nb": 1}, {"nb": 2, "prefetch": True, "rows": 2}],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "default")
def test_overflowed_tiles_compacted_match_fp64_with_nan_and_inf(launch):
    """The overflowed-tile path (its active columns compacted from one load of the tile) against
    fp64: a tile at exactly W = 32 actives (the first count that overflows), counts that are not
    multiples of NB, an overflowed partial last tile, hot columns zeroed in the pre-activation, a
    NaN gate (NaN reaches the whole row, as relu(NaN) = NaN in the reference) and a +inf gate
    (its up product's sign times inf) inside overflowed tiles, and a -inf gate (inactive); the
    rows taken longest first (``heavy_first``) give the same bits."""
    gen = torch.Generator().manual_seed(5)
    m, d, h = 7, 16, 600  # 3 tiles, the last one 88 columns wide
    pre = -torch.rand(m, h, generator=gen, dtype=torch.float64) - 0.1
    pre[0, :32] = torch.rand(32, generator=gen, dtype=torch.float64) + 0.05
    for r, (t0, n) in enumerate([(256, 45), (512, 88), (0, 256), (256, 33)], start=1):
        cols = t0 + torch.randperm(min(256, h - t0), generator=gen)[:n]
        pre[r, cols] = torch.rand(n, generator=gen, dtype=torch.float64) + 0.05
    pre[4, 0:40] = 0.5          # a second overflowed tile in row 4, listed tile 2 between
    pre[4, 520:523] = 1.5
    pre[5, 300:340] = 0.75      # row 5: overflowed tile 1 with a NaN in it
    pre[5, 310] = float("nan")
    pre[6, 0:50] = 0.25         # row 6: overflowed tile 0 with +inf and -inf in it
    pre[6, 7] = float("inf")
    pre[6, 9] = float("-inf")
    pre[:, 200] = 0.0           # a hot column: zeroed, never active
    pre = pre.to(torch.bfloat16).float()
    x = torch.randn(m, d, generator=gen)
    wu = torch.randn(h, d, generator=gen)
    wdt = torch.randn(h, d, generator=gen)
    pre, x, wu, wdt = (t.to(DEV) for t in (pre, x, wu, wdt))
    tw = pack(pre, 8)
    assert tw.overflow_tiles().sum(1).tolist() == [1, 1, 1, 1, 2, 1, 1]
    act = ~(pre <= 0)
    g = torch.where(act, pre, 0.0).double()  # relu with NaN kept
    for gated in (True, False):
        h_ref = torch.where(act, g * (x.double() @ wu.double().T), 0.0) if gated else g
        y_ref = h_ref @ wdt.double()
        up = {"x_MD": x, "w_up_HD": wu} if gated else {}
        y, l1 = twell_ffn_apply(tw, pre, wdt, stats=True, **up, **launch)
        assert_close_verbose(y, y_ref, rtol=1e-5, atol=1e-4, what=f"y gated={gated} {launch}")
        torch.testing.assert_close(l1.double(), h_ref.abs().sum(1), rtol=1e-5, atol=1e-6,
                                   equal_nan=True)
        assert torch.isnan(y[5]).all() and torch.isinf(y[6]).all()
        y2, l12 = twell_ffn_apply(tw, pre, wdt, stats=True, **up, **launch, heavy_first=True)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in ((y2, y), (l12, l1)))


def test_apply_rejects_bad_operands():
    tw = pack(torch.ones(3, 300))
    wdt = torch.zeros(300, 16)
    dense = torch.zeros(3, 300)
    with pytest.raises(ValueError, match="both"):
        twell_ffn_apply(tw, dense, wdt, x_MD=torch.zeros(3, 16))
    with pytest.raises(ValueError, match="unit column stride"):
        twell_ffn_apply(tw, dense, torch.zeros(16, 300).T)
    with pytest.raises(ValueError, match="whole row"):
        twell_ffn_apply(tw, dense, wdt, x_MD=torch.zeros(3, 16), w_up_HD=torch.zeros(300, 16),
                        block_d=8)
    with pytest.raises(ValueError, match="powers of 2"):
        twell_ffn_apply(tw, dense, wdt, nb=4, k=2)
    with pytest.raises(ValueError, match="block_m"):
        pack_dense(dense, block_m=3)


def test_heavy_first_refuses_row_counts_of_another_length():
    """``heavy_first`` orders the programs by ``tw.nnz_per_row()``: the producer's ``row_nnz``
    when set. One of another length than the M rows of ``data`` (a TwELL rebuilt with
    ``dataclasses.replace(tw, data=...)`` keeps the old one) would send programs to rows past M
    (out-of-bounds writes of y) or leave rows of y unwritten: refused, naming the field."""
    gen = torch.Generator().manual_seed(2)
    pre = torch.randn(2, 300, generator=gen).to(DEV)
    wdt = torch.randn(300, 8, generator=gen).to(DEV)
    tw, _ = pack_dense(pre)
    for bad in (torch.tensor([5, 9, 0], dtype=torch.int32, device=DEV),  # argsort: 1, 0, 2
                torch.tensor([5], dtype=torch.int32, device=DEV)):
        tw.row_nnz = bad
        with pytest.raises(ValueError, match="row_nnz"):
            twell_ffn_apply(tw, pre, wdt, heavy_first=True)


@pytest.mark.parametrize("d,launch", [(40, {}), (40, {"nb": 8}), (100, {"nb": 4, "num_warps": 8})],
                         ids=["d40-default", "d40-nb8", "d100-nb4-w8"])
def test_overflowed_tile_l1_sums_absolute_values(d, launch):
    """The gated L1 of overflowed tiles is sum |h|, not sum h: rows whose h has both signs, in
    overflowed tiles only. On an H100 (Triton 3.6) these shapes returned the signed sum from the
    compacted overflow path (y right, L1 wrong) before ``_accumulate`` summed |v| |u|; the
    interpreter never showed it, so this runs there only as a guard."""
    gen = torch.Generator().manual_seed(0)
    m, h = 2, 520
    pre = -torch.rand(m, h, generator=gen)
    pre[0, :300] = torch.rand(300, generator=gen) + 0.1   # tile 0 full, tile 1 at 44 > 31
    pre[1, ::2] = torch.rand(260, generator=gen)           # tiles 0, 1 overflowed (128 each)
    pre = pre.to(torch.bfloat16).float()
    x = torch.randn(m, d, generator=gen)
    wu = torch.randn(h, d, generator=gen)
    wdt = torch.randn(h, d, generator=gen)
    act = ~(pre <= 0)
    h_ref = torch.where(act, pre.double() * (x.double() @ wu.double().T), 0.0)
    assert (h_ref < 0).any(1).all() and (h_ref > 0).any(1).all()
    pre, x, wu, wdt = (t.to(DEV) for t in (pre, x, wu, wdt))
    tw, _ = pack_dense(pre)
    assert tw.row_overflow.tolist() == [2, 2]
    y, l1 = twell_ffn_apply(tw, pre, wdt, x_MD=x, w_up_HD=wu, stats=True, **launch)
    torch.testing.assert_close(l1.double().cpu(), h_ref.abs().sum(1), rtol=1e-5, atol=1e-4)
    assert_close_verbose(y.double().cpu(), h_ref @ wdt.double().cpu(), rtol=1e-5, atol=1e-3, what=f"y {launch}")


def _split_case(vdt):
    """M 37 rows (not a multiple of rows=3), D 32, H 600 (tiles of 256, 256, 88), values exact
    in ``vdt``: row 0 a dense first token (~25 %: tiles 0 and 1 overflowed, tile 2 listed),
    row 17 an overflowed tile 1 holding a NaN, row 30 80 listed non-zeros and no overflowed
    tile (among the top 4), row 36 (alone in its program) one tile at 33 actives holding +inf;
    the other rows ~3 % i.i.d. (~18 non-zeros, no overflow)."""
    gen = torch.Generator().manual_seed(7)
    m, d, h = 37, 32, 600
    pre = -torch.rand(m, h, generator=gen, dtype=torch.float64) - 0.1
    pre = torch.where(torch.rand(m, h, generator=gen) < 0.03, -pre, pre)
    pre[0] = torch.where(torch.rand(h, generator=gen) < 0.25, pre[0].abs(), -pre[0].abs())
    pre[17, 256:296] = 0.5
    pre[17, 270] = float("nan")
    pre[30] = -1.0
    pre[30, :30] = 0.25
    pre[30, 256:286] = 0.75
    pre[30, 512:532] = 1.25
    pre[36] = -1.0
    pre[36, 100:133] = 0.125
    pre[36, 101] = float("inf")
    pre[36, 300:305] = 2.0
    pre = pre.to(vdt).float()
    x = torch.randn(m, d, generator=gen)
    wu = torch.randn(h, d, generator=gen)
    wdt = torch.randn(h, d, generator=gen)
    pre, x, wu, wdt = (t.to(DEV) for t in (pre, x, wu, wdt))
    tw = pack(pre, 8, value_dtype=vdt)
    assert tw.overflow_tiles().sum(1)[[0, 17, 30, 36]].tolist() == [2, 1, 0, 1]
    assert torch.topk(tw.nnz_per_row(), 4).indices.sort().values.tolist() == [0, 17, 30, 36]
    return tw, pre, x, wu, wdt


def _same_bits(a, b):
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _assert_unchanged(a, b):
    """The interpreter runs one arithmetic whatever the launch: the same bits. A GPU compiles
    each launch variant (SPLIT, a D split) on its own, and contraction into FMAs may differ in
    the last fp32 bit (the H200 run of 2026-12-06): within fp32 rounding there."""
    if a.is_cuda:
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6, equal_nan=True)
    else:
        assert _same_bits(a, b)


@pytest.mark.parametrize("vdt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_split_long_matches_fp64_and_the_unsplit_rows(gated, vdt):
    """``split_long``: the 4 longest rows' overflowed tiles over extra programs, partials summed
    by the fix-up kernel. y and the L1 against fp64; NaN and inf in a split tile reach the row;
    every row whose sum is not reassociated (the rows not split, and row 30: split but without
    an overflowed tile) has the unsplit launch's bits (within fp32 rounding on a GPU), the others are within fp32 rounding of
    it; with and without stats, 2 and 4 parts (4 > T: a part with no tile), rows 3, with
    heavy_first (gated) or a D split (non-gated)."""
    tw, pre, x, wu, wdt = _split_case(vdt)
    act = ~(pre <= 0)
    g = torch.where(act, pre, 0.0).double()
    up = {"x_MD": x, "w_up_HD": wu} if gated else {}
    h_ref = torch.where(act, g * (x.double() @ wu.double().T), 0.0) if gated else g
    y_ref = h_ref @ wdt.double()
    y0, l0 = twell_ffn_apply(tw, pre, wdt, stats=True, rows=3, **up)
    y1, l1 = twell_ffn_apply(tw, pre, wdt, stats=True, rows=3, split_long=4, split_parts=2, **up)
    more = {"heavy_first": True} if gated else {"block_d": 16}
    y2, none = twell_ffn_apply(tw, pre, wdt, split_long=4, split_parts=4, **more, **up)
    assert none is None
    plain = torch.ones(37, dtype=torch.bool, device=pre.device)
    plain[[0, 17, 36]] = False  # the split rows with overflowed tiles
    for y in (y1, y2):
        assert_close_verbose(y, y_ref, rtol=1e-5, atol=1e-4, what=f"y gated={gated} {vdt}")
        assert torch.isnan(y[17]).all() and torch.isinf(y[36]).all()
        _assert_unchanged(y[plain], y0[plain])
        torch.testing.assert_close(y[[0, 36]], y0[[0, 36]], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(l1.double(), h_ref.abs().sum(1), rtol=1e-5, atol=1e-6,
                               equal_nan=True)
    _assert_unchanged(l1[plain], l0[plain])
    assert torch.isnan(l1[17]) and torch.isinf(l1[36])


def test_split_long_more_slots_than_rows_bf16_out():
    """M 3 < L 8: every row is a long row (min(L, M) slots, M x S extra programs); a bf16 y
    through the fix-up kernel's rounding, gated and non-gated, against the unsplit launch (the
    same bf16 value or one ulp apart: the fp32 sums differ in their last bits) and fp64."""
    gen = torch.Generator().manual_seed(3)
    m, d, h = 3, 16, 520
    pre = -torch.rand(m, h, generator=gen) - 0.1
    pre[0, :300] = torch.rand(300, generator=gen) + 0.1   # tiles 0 and 1 overflowed
    pre[1, ::2] = torch.rand(260, generator=gen)           # tiles 0 and 1 overflowed
    pre[2, 5:9] = 1.0                                      # no overflowed tile
    pre = pre.to(torch.bfloat16).float()
    x = torch.randn(m, d, generator=gen)
    wu = torch.randn(h, d, generator=gen)
    wdt = torch.randn(h, d, generator=gen)
    pre, x, wu, wdt = (t.to(DEV) for t in (pre, x, wu, wdt))
    tw, _ = pack_dense(pre)
    act = ~(pre <= 0)
    for gated in (True, False):
        up = {"x_MD": x, "w_up_HD": wu} if gated else {}
        h_ref = torch.where(act, pre.double() * (x.double() @ wu.double().T), 0.0) if gated \
            else torch.relu(pre.double())
        kw = {"stats": True, "out_dtype": torch.bfloat16, **up}
        y0, l0 = twell_ffn_apply(tw, pre, wdt, **kw)
        y1, l1 = twell_ffn_apply(tw, pre, wdt, split_long=8, split_parts=3, **kw)
        assert y1.dtype == torch.bfloat16
        assert_close_verbose(y1, h_ref @ wdt.double(), rtol=1e-2, atol=1e-2, what=f"gated={gated}")
        torch.testing.assert_close(l1.double(), h_ref.abs().sum(1), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(y1, y0, rtol=2 ** -7, atol=1e-3)
        assert _same_bits(y1[2], y0[2]) and _same_bits(l1[2], l0[2])


def test_split_long_zero_is_the_unsplit_launch_and_refusals():
    """split_long=0 (the default) is the unsplit launch whatever split_parts; bad values and a
    ``row_nnz`` of another length are refused naming the argument."""
    gen = torch.Generator().manual_seed(4)
    pre = torch.randn(5, 300, generator=gen).to(DEV)
    wdt = torch.randn(300, 8, generator=gen).to(DEV)
    tw, _ = pack_dense(pre)
    y0, l0 = twell_ffn_apply(tw, pre, wdt, stats=True)
    y1, l1 = twell_ffn_apply(tw, pre, wdt, stats=True, split_long=0, split_parts=3)
    assert _same_bits(y0, y1) and _same_bits(l0, l1)
    # a NumPy integer is an integer (it was refused as "got np.int64(0)")
    y2, l2 = twell_ffn_apply(tw, pre, wdt, stats=True, split_long=np.int64(0),
                             split_parts=np.int32(3))
    assert _same_bits(y0, y2) and _same_bits(l0, l2)
    for bad in ({"split_long": -1}, {"split_long": True}, {"split_parts": 0},
                {"split_long": np.bool_(True)},
                {"split_long": 2, "split_parts": 1.5}):
        with pytest.raises(ValueError, match=next(iter(k for k in bad if k != "split_long"),
                                                  "split_long")):
            twell_ffn_apply(tw, pre, wdt, **bad)
    tw.row_nnz = torch.tensor([5, 9], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="split_long picks the rows by tw.row_nnz"):
        twell_ffn_apply(tw, pre, wdt, split_long=2)
