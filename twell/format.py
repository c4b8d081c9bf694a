"""TwELL (tile-wise ELLPACK): the sparse activation format of the FFN kernels.

Shape legend: M rows (tokens), H columns (FFN hidden units), T = ceil(H / 256)
column tiles, W words per (row, tile).

Source: arXiv 2603.23198, the TwELL format (tiled ELL). This
module is the written specification, a pure-PyTorch reference ``pack`` /
``unpack``, and ``validate``; the Triton producers and consumers in
``twell.ops`` read and write exactly this layout.

Specification, version 1 (``FORMAT_VERSION``)
---------------------------------------------
* Columns are cut into tiles of ``TILE = 256``; tile ``t`` holds columns
  ``[256 t, min(256 (t + 1), H))``.
* A *compression factor* ``C`` in ``{8, 4, 2}`` gives ``W = 256 / C`` words per
  (row, tile): 32, 64 or 128. Capacity ``W - 1`` (31, 63, 127) slots.
* Storage: an ``int32`` tensor of shape ``(M, T, W)``, contiguous, read with
  uint32 bit semantics.
* Word 0 is the **exact** count of active columns of that row in that tile
  (0..256). It may exceed the capacity: such a (row, tile) is *overflowed*.
* Words ``1 .. min(count, W - 1)`` are ``(value_bits16 << 16) | column``,
  ``column`` the *global* hidden index (so ``H < 65536``), in ascending column
  order. ``value_bits16`` is the 16-bit float pattern of the value in the
  buffer's ``value_dtype``.
* Words past ``min(count, W - 1)`` are unspecified (the reference writes 0).
* A stored value is itself active: ``validate`` refuses negative values and -0 (bits
  0x8000). It accepts +0: an active value at most half the smallest subnormal of
  ``value_dtype`` (2^-134 as bf16, 2^-25 as fp16) rounds to +0, and ``pack`` and
  ``twell.ops.twell_pack.pack_dense`` (fp32 input) store it as such (its column still counts).
* "Active" means ``not (a <= 0)``: positive values **and NaN** are active, as
  ``relu(NaN) = NaN`` in PyTorch; ``+inf`` is active, ``-inf``, 0 and ``-0`` are not.
* Overflow is never silent: a consumer must not use the slots of an
  overflowed (row, tile) (they hold the first ``W - 1`` active columns, or
  are unspecified) and must compute that tile from the dense values
  instead (the FFN kernels read the dense gate pre-activation of just that
  tile), or raise. Counts stay exact, so statistics (L0, max non-zeros)
  are exact regardless of overflow.

Changes from the paper's layout (each tested in ``tests/ops/test_format.py``):
  1. ``value_dtype`` may be ``float16`` as well as ``bfloat16``: the kernels
     store the gate value in the model's own 16-bit type, so fp16 models do
     not lose 3 mantissa bits to a bf16 round trip (the paper is bf16-only).
     fp32 inputs are stored as bf16.
  2. Factors 4 and 2 (64 / 128 words) besides the paper's 8, and exact counts
     with a defined overflow rule (the public reference silently overwrites
     or double-counts an overflowed tile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMAT_VERSION = 1
TILE = 256
FACTORS = (8, 4, 2)
MAX_COLUMNS = 1 << 16  # column index is stored in 16 bits
VALUE_DTYPES = (torch.bfloat16, torch.float16)

__all__ = [
    "FACTORS", "FORMAT_VERSION", "MAX_COLUMNS", "TILE", "TwELL", "TwELLFormatError",
    "check_width", "n_tiles", "pack", "unpack", "validate", "value_dtype_for", "words_per_tile",
]


class TwELLFormatError(ValueError):
    """A TwELL buffer does not satisfy the specification (see module docstring)."""


def words_per_tile(factor: int) -> int:
    """Words per (row, tile) for compression factor ``factor`` (8 -> 32, 4 -> 64, 2 -> 128).

    Raises:
        ValueError: ``factor`` not in ``FACTORS``.
    """
    if factor not in FACTORS:
        raise ValueError(f"TwELL compression factor must be one of {FACTORS}; got {factor!r}")
    return TILE // factor


def n_tiles(h: int) -> int:
    """Number of 256-column tiles for width ``h``."""
    return (h + TILE - 1) // TILE


def check_width(h: int) -> None:
    """Raise ValueError unless ``0 < h < 65536`` (column indices are 16 bits)."""
    if not 0 < h < MAX_COLUMNS:
        raise ValueError(
            f"TwELL stores column indices in 16 bits: hidden width H must be in [1, {MAX_COLUMNS - 1}]"
            f"; got H={h}. Split the FFN into column groups of < {MAX_COLUMNS} units."
        )


def value_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The 16-bit value type TwELL uses for activations of ``dtype`` (fp16 -> fp16, else bf16)."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


@dataclass
class TwELL:
    """A TwELL buffer with its metadata.

    Attributes:
        data: (M, T, W) int32, contiguous (see the module docstring for words).
        n_cols: H, the dense width.
        factor: compression factor (8, 4 or 2); ``W = 256 // factor``.
        value_dtype: ``torch.bfloat16`` or ``torch.float16``, the type of the
            16-bit values in the high halves of the slot words.
        row_nnz: (M,) int32, each row's exact count (the sum of its count words), as the
            producer wrote it in its pass (``twell.ops.twell_pack.pack_dense``); None: summed
            from the count words when asked. Describes ``data`` as packed: a caller that
            changes the count words in place must not rely on it meanwhile.
        row_overflow: (M,) int32, each row's overflowed tiles (count > capacity), likewise.
    """

    data: torch.Tensor
    n_cols: int
    factor: int = 8
    value_dtype: torch.dtype = torch.bfloat16
    row_nnz: torch.Tensor | None = None
    row_overflow: torch.Tensor | None = None

    @property
    def n_rows(self) -> int:
        return self.data.shape[0]

    @property
    def capacity(self) -> int:
        """Slots per (row, tile): ``W - 1``."""
        return words_per_tile(self.factor) - 1

    @property
    def counts(self) -> torch.Tensor:
        """(M, T) int32 view of the exact per-tile counts (word 0)."""
        return self.data[:, :, 0]

    def overflow_tiles(self) -> torch.Tensor:
        """(M, T) bool: tiles whose count exceeds the capacity."""
        return self.counts > self.capacity

    def overflow_rows(self) -> torch.Tensor:
        """(M,) bool: rows with at least one overflowed tile."""
        if self.row_overflow is not None:
            return self.row_overflow > 0
        return self.overflow_tiles().any(dim=1)

    def n_overflow_tiles(self) -> torch.Tensor:
        """Scalar int64 tensor: the overflowed (row, tile) pairs."""
        if self.row_overflow is not None:
            return self.row_overflow.sum()
        return self.overflow_tiles().sum()

    def nnz_per_row(self) -> torch.Tensor:
        """(M,) int32: exact active columns per row (overflow included); the producer's
        ``row_nnz`` when it wrote one (no pass over the M x T count words, which are strided
        by W words)."""
        if self.row_nnz is not None:
            return self.row_nnz
        return self.counts.sum(dim=1, dtype=torch.int32)

    def slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode the usable (non-overflowed, within-count) slots.

        Returns:
            ``(valid_MTS bool, cols_MTS int64, vals_MTS value_dtype, words_MTS int64)``,
            each (M, T, W - 1); entries where ``valid`` is False are garbage.
        """
        cap = self.capacity
        words = self.data[:, :, 1:].to(torch.int64) & 0xFFFFFFFF
        cnt = self.counts.to(torch.int64)
        slot = torch.arange(cap, device=self.data.device)
        valid = (slot[None, None, :] < cnt[:, :, None]) & (cnt[:, :, None] <= cap)
        cols = words & 0xFFFF
        bits = (words >> 16).to(torch.int32)  # 0..65535
        vals = (bits - ((bits >> 15) << 16)).to(torch.int16).view(self.value_dtype)
        return valid, cols, vals, words


def pack(a_MH: torch.Tensor, factor: int = 8, value_dtype: torch.dtype | None = None) -> TwELL:
    """Pure-PyTorch reference packer: dense (M, H) -> TwELL.

    Active entries are ``not (a <= 0)``; their values (rounded to
    ``value_dtype``) and global column indices go to the slots in ascending
    column order; counts are exact; overflowed tiles keep their first
    ``capacity`` entries (which consumers must ignore, see the spec).

    Args:
        a_MH: (M, H) float tensor (typically the ReLU input: the gate
            pre-activation). Any device.
        factor: compression factor, 8 (paper), 4 or 2.
        value_dtype: bf16 / fp16; default ``value_dtype_for(a_MH.dtype)``.

    Returns:
        :class:`TwELL` on ``a_MH``'s device.

    Raises:
        ValueError: not 2-D, not floating, H out of range, bad factor/dtype.
    """
    if a_MH.dim() != 2 or not a_MH.is_floating_point():
        raise ValueError(f"pack expects a 2-D float tensor (M, H); got {tuple(a_MH.shape)} {a_MH.dtype}")
    m, h = a_MH.shape
    check_width(h)
    w = words_per_tile(factor)
    vdt = value_dtype or value_dtype_for(a_MH.dtype)
    if vdt not in VALUE_DTYPES:
        raise ValueError(f"value_dtype must be one of {VALUE_DTYPES}; got {vdt}")
    t = n_tiles(h)
    pad = t * TILE - h
    a = torch.nn.functional.pad(a_MH, (0, pad), value=0.0).view(m, t, TILE)
    active = ~(a <= 0)
    cnt = active.sum(-1, dtype=torch.int32)
    pos = active.to(torch.int32).cumsum(-1) - 1  # slot of each active entry
    col = torch.arange(t * TILE, device=a.device, dtype=torch.int64).view(1, t, TILE)
    bits = a.to(vdt).view(torch.int16).to(torch.int64) & 0xFFFF
    word = ((bits << 16) | col) & 0xFFFFFFFF
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
    keep = active & (pos < w - 1)
    data = torch.zeros(m, t, w, dtype=torch.int32, device=a.device)
    data[:, :, 0] = cnt
    # scatter kept words to slot 1 + pos; dropped entries go to a dummy slot index w (then cut)
    idx = torch.where(keep, pos + 1, torch.full_like(pos, w)).to(torch.int64)
    tmp = torch.zeros(m, t, w + 1, dtype=torch.int32, device=a.device)
    tmp.scatter_(2, idx, torch.where(keep, word, torch.zeros_like(word)))
    data[:, :, 1:] = tmp[:, :, 1:w]
    return TwELL(data, h, factor, vdt)


def unpack(tw: TwELL, dense_MH: torch.Tensor | None = None) -> torch.Tensor:
    """Reference decoder: TwELL -> dense (M, H) in ``tw.value_dtype``.

    Inactive entries are 0. Overflowed tiles cannot be decoded from the
    slots; they are copied from ``dense_MH`` (the dense source, where
    active entries keep their value and the rest become 0), else this raises.

    Args:
        tw: the TwELL buffer (M rows, H = ``tw.n_cols``).
        dense_MH: None, or the (M, H) float dense source on ``tw``'s device.

    Raises:
        TwELLFormatError: overflowed tiles and no ``dense_MH``; ``dense_MH`` not an (M, H)
            tensor (checked first).
    """
    m, t, _ = tw.data.shape
    h = tw.n_cols
    if dense_MH is not None and (not isinstance(dense_MH, torch.Tensor)
                                 or tuple(dense_MH.shape) != (m, h)):
        got = tuple(dense_MH.shape) if isinstance(dense_MH, torch.Tensor) else type(dense_MH).__name__
        raise TwELLFormatError(f"unpack: dense_MH must be ({m}, {h}), the TwELL's rows and n_cols; "
                               f"got {got}")
    valid, cols, vals, _ = tw.slots()
    out = torch.zeros(m, t * TILE + 1, dtype=tw.value_dtype, device=tw.data.device)
    rows = torch.arange(m, device=tw.data.device).view(m, 1, 1).expand_as(cols)
    c = torch.where(valid, cols, torch.full_like(cols, t * TILE))  # dump column
    out[rows.reshape(-1), c.reshape(-1)] = vals.reshape(-1)
    out = out[:, :h]
    ovf = tw.overflow_tiles()
    if bool(ovf.any()):
        if dense_MH is None:
            raise TwELLFormatError(
                f"{int(ovf.sum())} (row, tile) pairs exceed the capacity {tw.capacity}; "
                "pass dense_MH (the dense source) to decode them, or pack with a smaller factor"
            )
        col_ovf = ovf.repeat_interleave(TILE, dim=1)[:, :h]
        d = dense_MH.to(tw.value_dtype)
        d = torch.where(~(d <= 0), d, torch.zeros_like(d))
        out = torch.where(col_ovf, d, out)
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate(tw: TwELL) -> dict:
    """Check a TwELL buffer against the specification.

    Checks: dtype int32, shape (M, ceil(H/256), 256/factor), contiguous;
    counts within [0, tile width]; every usable slot's column inside its
    tile, strictly ascending, value not negative or -0 (+0: a rounded tiny value); ``row_nnz`` and
    ``row_overflow``, when set, (M,) int32 equal to the count words' per-row sums.

    Returns:
        ``{"rows": M, "nnz": total count, "overflow_tiles": n, "overflow_rows": n}``.

    Raises:
        TwELLFormatError: one line naming the offending field (``data`` not an int32 tensor,
            ``n_cols`` not an int in [1, 65535], ``factor`` not an int in ``FACTORS``, bad
            ``value_dtype``, ``row_nnz`` / ``row_overflow``) or the first offending
            (row, tile, slot).
    """
    d = tw.data
    if not isinstance(d, torch.Tensor):
        raise TwELLFormatError(f"TwELL data must be an int32 torch.Tensor (M, T, W); got a "
                               f"{type(d).__name__}")
    if d.dtype != torch.int32:
        raise TwELLFormatError(f"TwELL data must be int32; got {d.dtype}")
    if not _is_int(tw.n_cols) or not 0 < tw.n_cols < MAX_COLUMNS:
        raise TwELLFormatError(f"TwELL n_cols must be an int in [1, {MAX_COLUMNS - 1}]; got "
                               f"{tw.n_cols!r} ({type(tw.n_cols).__name__})")
    if not _is_int(tw.factor) or tw.factor not in FACTORS:
        raise TwELLFormatError(f"TwELL factor must be an int in {FACTORS}; got {tw.factor!r} "
                               f"({type(tw.factor).__name__})")
    w = words_per_tile(tw.factor)
    t = n_tiles(tw.n_cols)
    if d.dim() != 3 or d.shape[1] != t or d.shape[2] != w:
        raise TwELLFormatError(
            f"TwELL data must be (M, {t}, {w}) for H={tw.n_cols}, factor={tw.factor}; got {tuple(d.shape)}"
        )
    if not d.is_contiguous():
        raise TwELLFormatError("TwELL data must be contiguous")
    if tw.value_dtype not in VALUE_DTYPES:
        raise TwELLFormatError(f"value_dtype must be one of {VALUE_DTYPES}; got {tw.value_dtype}")
    cnt = tw.counts
    width = torch.full((t,), TILE, dtype=torch.int32, device=d.device)
    width[-1] = tw.n_cols - (t - 1) * TILE
    bad = (cnt < 0) | (cnt > width[None, :])
    if bool(bad.any()):
        r, tt = (int(v) for v in bad.nonzero()[0])
        raise TwELLFormatError(
            f"count {int(cnt[r, tt])} at (row {r}, tile {tt}) is outside [0, {int(width[tt])}]"
        )
    valid, cols, vals, _ = tw.slots()
    lo = torch.arange(t, device=d.device).view(1, t, 1) * TILE
    out_of_tile = valid & ((cols < lo) | (cols >= (lo + width.view(1, t, 1))))
    prev = torch.cat([torch.full_like(cols[:, :, :1], -1), cols[:, :, :-1]], dim=2)
    not_ascending = valid & (cols <= prev)
    # negative or -0 (bits 0x8000): never stored; +0 is a tiny active value rounded (above)
    v32 = vals.float()
    inactive = valid & ((v32 < 0) | ((v32 == 0) & torch.signbit(v32)))
    for name, m in (("column outside its tile", out_of_tile),
                    ("columns not strictly ascending", not_ascending),
                    ("stored value is negative or -0 (bits 0x8000): an inactive unit must not be stored",
                     inactive)):
        if bool(m.any()):
            r, tt, s = (int(v) for v in m.nonzero()[0])
            raise TwELLFormatError(
                f"{name} at (row {r}, tile {tt}, slot {s + 1}): column {int(cols[r, tt, s])}, "
                f"value {float(vals[r, tt, s])}"
            )
    ovf = tw.overflow_tiles()
    for name, rows, want in (("row_nnz", tw.row_nnz, cnt.sum(1, dtype=torch.int32)),
                             ("row_overflow", tw.row_overflow, ovf.sum(1, dtype=torch.int32))):
        if rows is None:
            continue
        if not isinstance(rows, torch.Tensor):
            raise TwELLFormatError(f"{name} must be None or a ({d.shape[0]},) int32 tensor; got "
                                   f"a {type(rows).__name__}")
        if rows.dtype != torch.int32 or rows.shape != want.shape:
            raise TwELLFormatError(f"{name} must be ({d.shape[0]},) int32 like the rows of data; "
                                   f"got {tuple(rows.shape)} {rows.dtype}")
        wrong = rows.to(want.device) != want
        if bool(wrong.any()):
            r = int(wrong.nonzero()[0, 0])
            raise TwELLFormatError(f"{name}[{r}] = {int(rows[r])} but the count words give "
                                   f"{int(want[r])} (counts changed after packing?)")
    return {
        "rows": d.shape[0],
        "nnz": int(cnt.sum()),
        "overflow_tiles": int(ovf.sum()),
        "overflow_rows": int(ovf.any(1).sum()),
    }
