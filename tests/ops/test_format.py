"""TwELL format (twell.format): hand-computed words, round trips, overflow, validator."""

import pytest
import torch

from twell.format import (
    TILE,
    TwELL,
    TwELLFormatError,
    pack,
    unpack,
    validate,
    value_dtype_for,
    words_per_tile,
)


def _u32(w: int) -> int:
    return w & 0xFFFFFFFF


def test_hand_computed_words():
    # one row, H = 300 (2 tiles: 256 + 44 columns)
    a = torch.zeros(1, 300)
    a[0, 3] = 1.0          # bf16 0x3F80
    a[0, 7] = -2.0         # inactive
    a[0, 255] = 2.0        # bf16 0x4000
    a[0, 256] = 0.5        # bf16 0x3F00, tile 1
    a[0, 299] = float("nan")  # active (relu(NaN) = NaN)
    tw = pack(a, factor=8)
    assert tw.data.shape == (1, 2, 32) and tw.data.dtype == torch.int32
    d = tw.data[0]
    assert d[0, 0].item() == 2 and d[1, 0].item() == 2
    assert _u32(d[0, 1].item()) == (0x3F80 << 16) | 3
    assert _u32(d[0, 2].item()) == (0x4000 << 16) | 255
    assert _u32(d[1, 1].item()) == (0x3F00 << 16) | 256
    nan_bits = _u32(d[1, 2].item()) >> 16  # any bf16 NaN pattern (CPU torch writes 0xFFFF)
    assert nan_bits & 0x7F80 == 0x7F80 and nan_bits & 0x7F and _u32(d[1, 2].item()) & 0xFFFF == 299
    assert int(d[0, 3:].abs().sum()) == 0  # reference zeros the unused slots


def test_active_semantics_inf_zero_negzero():
    a = torch.tensor([[float("inf"), float("-inf"), 0.0, -0.0, 1e-30, float("nan"), -1.0]])
    tw = pack(a)
    assert tw.counts.tolist() == [[3]]  # +inf, 1e-30 (bf16 keeps it), NaN
    out = unpack(tw)
    assert out[0, 0] == float("inf") and out[0, 4] > 0 and torch.isnan(out[0, 5])
    assert (out[0, [1, 2, 3, 6]] == 0).all()


@pytest.mark.parametrize("factor", [8, 4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip(factor, dtype):
    torch.manual_seed(factor)
    m, h = 37, 777  # odd: partial last tile
    cap = words_per_tile(factor) - 1
    a = torch.randn(m, h).to(dtype)
    keep = torch.rand(m, h) < 0.5 * cap / TILE  # overflow odds < 1e-4
    a = torch.where(keep, a.abs() + 0.01, -a.abs())
    tw = pack(a, factor)
    assert tw.value_dtype == value_dtype_for(dtype)
    info = validate(tw)
    assert info["overflow_tiles"] == 0 and info["nnz"] == int(keep.sum())
    expect = torch.where(keep, a.to(tw.value_dtype), torch.zeros((), dtype=tw.value_dtype))
    assert torch.equal(unpack(tw), expect)
    assert torch.equal(tw.nnz_per_row(), keep.sum(1).int())


@pytest.mark.parametrize("factor", [8, 4, 2])
def test_overflow_counts_exact_and_never_silent(factor):
    cap = words_per_tile(factor) - 1
    m, h = 6, 512
    a = -torch.ones(m, h)
    n_act = [0, cap, cap + 1, 100, 256, 17]
    for r, k in enumerate(n_act):
        a[r, 256 : 256 + k] = torch.arange(1, k + 1, dtype=torch.float32)
    tw = pack(a, factor)
    assert tw.counts[:, 1].tolist() == n_act  # exact, beyond capacity too
    expect_ovf = [k > cap for k in n_act]
    assert tw.overflow_rows().tolist() == expect_ovf
    info = validate(tw)
    assert info["overflow_rows"] == sum(expect_ovf)
    if any(expect_ovf):
        with pytest.raises(TwELLFormatError, match="exceed the capacity"):
            unpack(tw)
    full = unpack(tw, dense_MH=a)
    torch.testing.assert_close(full.float(), a.clamp_min(0), rtol=0, atol=0)


def test_validator_catches_corruption():
    torch.manual_seed(0)
    a = torch.randn(4, 300).clamp_min(2.0) - 2.0  # ~2% active: no overflow
    a[:, :8] = 1.0
    good = pack(a)
    validate(good)

    def corrupt(fn):
        d = good.data.clone()
        fn(d)
        return TwELL(d, good.n_cols, good.factor, good.value_dtype)

    with pytest.raises(TwELLFormatError, match="outside"):
        validate(corrupt(lambda d: d[1, 1, 0].fill_(45)))  # last tile holds 44 columns
    with pytest.raises(TwELLFormatError, match="outside"):
        validate(corrupt(lambda d: d[2, 0, 0].fill_(-1)))
    with pytest.raises(TwELLFormatError, match="outside its tile"):
        validate(corrupt(lambda d: d[0, 0, 1].fill_((0x3F80 << 16) | 260)))
    with pytest.raises(TwELLFormatError, match="ascending"):
        validate(corrupt(lambda d: d[0, 0, 2].copy_(d[0, 0, 1])))
    with pytest.raises(TwELLFormatError, match="negative or -0"):
        validate(corrupt(lambda d: d[0, 0, 1].fill_(((0xBF80 << 16) | 0) - (1 << 32))))
    with pytest.raises(TwELLFormatError, match="int32"):
        validate(TwELL(good.data.long(), good.n_cols))
    with pytest.raises(TwELLFormatError, match=r"\(M, 2, 32\)"):
        validate(TwELL(good.data[:, :, :16].contiguous(), good.n_cols))


@pytest.mark.parametrize("value_dtype", [torch.bfloat16, torch.float16])
def test_validator_refuses_stored_negative_zero_keeps_nan_and_plus_zero(value_dtype):
    """A stored value must not be negative: -0 (bits 0x8000, which ``v < 0`` misses) is
    refused; a stored NaN (0x7E00 / 0xFFC0) and +0 (an active value rounded below the smallest
    subnormal) are accepted."""
    a = torch.zeros(2, 300)
    a[0, [3, 9]] = 1.0
    good = pack(a, value_dtype=value_dtype)
    validate(good)

    def with_bits(bits):
        d = good.data.clone()
        d[0, 0, 1] = ((bits << 16) | 3) - ((bits >> 15) << 32)  # slot 1 keeps column 3
        return TwELL(d, good.n_cols, good.factor, value_dtype)

    with pytest.raises(TwELLFormatError, match=r"negative or -0 .*slot 1\): column 3"):
        validate(with_bits(0x8000))
    nan = 0x7E00 if value_dtype == torch.float16 else 0xFFC0
    assert validate(with_bits(nan))["nnz"] == 2
    assert validate(with_bits(0x0000))["nnz"] == 2


@pytest.mark.parametrize("value_dtype", [torch.bfloat16, torch.float16])
def test_tiny_active_value_packs_as_plus_zero_and_validates(value_dtype):
    """An fp32 value above 0 but below half the smallest subnormal of the value dtype (2^-134
    bf16, 2^-25 fp16) is active: ``pack`` stores it as +0 with its column counted, and
    ``validate`` accepts the buffer."""
    tiny = 2.0 ** -140 if value_dtype == torch.bfloat16 else 2.0 ** -30
    a = torch.zeros(1, 256)
    a[0, [5, 7]] = torch.tensor([tiny, 1.0])
    tw = pack(a, value_dtype=value_dtype)
    _, cols, vals, _ = tw.slots()
    assert cols[0, 0, :2].tolist() == [5, 7]
    assert vals[0, 0, 0].item() == 0.0 and not torch.signbit(vals[0, 0, 0].float())
    assert validate(tw)["nnz"] == 2


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="65535"):
        pack(torch.ones(1, 65536))
    with pytest.raises(ValueError, match="factor"):
        pack(torch.ones(1, 8), factor=16)
    with pytest.raises(ValueError, match="2-D"):
        pack(torch.ones(8))


def test_empty_rows():
    tw = pack(torch.empty(0, 300))
    assert tw.data.shape == (0, 2, 32)
    assert validate(tw)["nnz"] == 0
    assert unpack(tw).shape == (0, 300)


def test_validator_checks_the_row_sums():
    """``row_nnz`` / ``row_overflow`` (the producer's per-row sums, which ``nnz_per_row``,
    ``overflow_rows`` and ``n_overflow_tiles`` return when set) must describe the count words:
    a TwELL whose counts changed after packing, or rebuilt on other rows, is refused."""
    a = torch.zeros(3, 300)
    a[0, :40] = 1.0   # tile 0 overflowed
    a[1, 260:263] = 2.0
    good = pack(a)
    cnt = good.counts.sum(1, dtype=torch.int32)
    ovf = good.overflow_tiles().sum(1, dtype=torch.int32)
    assert validate(TwELL(good.data, 300, row_nnz=cnt, row_overflow=ovf))["nnz"] == 43
    for kw, what in (({"row_nnz": cnt + 1}, "row_nnz"),
                     ({"row_nnz": cnt[:2]}, "row_nnz"),
                     ({"row_nnz": cnt.long()}, "row_nnz"),
                     ({"row_overflow": ovf * 0}, "row_overflow"),
                     ({"row_overflow": ovf[None]}, "row_overflow")):
        with pytest.raises(TwELLFormatError, match=what):
            validate(TwELL(good.data, 300, **kw))
