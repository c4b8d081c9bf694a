"""The TwELL consumer kernel (``twell.ops.twell_ffn.twell_ffn_apply``) alone, against fp64 dense
products on crafted rows (all-zero, fully dense, at capacity, an overflowed tile between listed
ones, a single non-zero in the last column), gated and non-gated, at several launch shapes; and
the operand checks of the consumer (and of the producer's ``block_m``).

On a machine without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is imported if the caller did not).
"""

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
