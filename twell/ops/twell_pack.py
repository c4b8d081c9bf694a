"""Producer of TwELL: ReLU + pack of a dense gate pre-activation (the inference path's second pass).

Shape legend: M rows (tokens), H FFN width, T = ceil(H/256) tiles, W = 256/factor words per
(row, tile). Layout: ``twell.format``.

arXiv 2603.23198 writes TwELL from the gate GEMM's epilogue; here the gate ``g = x @ Wg^T`` is a
cuBLAS GEMM (torch) and :func:`pack_dense` reads the dense rows once and writes TwELL (two
passes: a plain Triton packing epilogue measured +60 % over the
GEMM, a dense bf16 round trip of M x H at ~0.1 ms). The dense gate stays in memory and the
consumer reads it for overflowed tiles only. The fused Triton GEMM + pack epilogue lost to this
design (H200: 1.01x vs 1.65x at 0.3 %) and was deleted; BENCHMARKS.md, "Superseded
kernels".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twell.format import TILE, TwELL, check_width, n_tiles, value_dtype_for, words_per_tile


@triton.jit
def f32_to_bf16_bits(v):
    """fp32 -> bf16 bit pattern (int32 in [0, 65535]), round-to-nearest-even, NaN -> 0x7FC0.

    Integer ops, so the GPU and the interpreter (whose float cast truncates) agree.
    """
    b = v.to(tl.int32, bitcast=True)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(v != v, 0x7FC0, r)  # noqa: PLR0124 (NaN test)


@triton.jit
def _pack_words(g, active, cols, wbase, colcnt_ptr, H,
                W: tl.constexpr, VALUE_MODE: tl.constexpr, STATS: tl.constexpr):
    """Write the slot words of one (rows x 256-column tile) block whose count words are at
    ``wbase`` (written by the caller): slot = inclusive cumsum of ``active`` along the tile,
    entries past the capacity W - 1 not written; with STATS, per-column counts (relaxed
    atomics, only for columns active in the block)."""
    a32 = active.to(tl.int32)
    pos = tl.cumsum(a32, axis=1)
    if VALUE_MODE == 0:
        bits = g.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        bits = f32_to_bf16_bits(g.to(tl.float32))
    tl.store(wbase[:, None] + pos, (bits << 16) | cols[None, :], mask=active & (pos < W))
    if STATS:
        cnt = tl.sum(a32, axis=0)
        tl.atomic_add(colcnt_ptr + cols, cnt, mask=(cols < H) & (cnt > 0), sem="relaxed")


@triton.jit
def _pack_dense_kernel(
    g_ptr,        # (M, H) dense pre-activation, unit column stride
    tw_ptr,       # (M, T, W) int32 out
    colcnt_ptr,   # (H,) int32 out (STATS)
    rownnz_ptr,   # (M,) int32 out: the row's exact count
    rowovf_ptr,   # (M,) int32 out: the row's overflowed tiles (count >= W)
    M, H, n_tile,
    stride_gm,    # row stride of g
    W: tl.constexpr,            # words per (row, tile)
    VALUE_MODE: tl.constexpr,   # 0: g is bf16/fp16, keep its 16 bits; 1: fp32 -> bf16 RNE
    STATS: tl.constexpr,        # accumulate per-column active counts
    BLOCK_M: tl.constexpr,      # rows per program (default 1, on one warp)
):
    """ReLU + pack: TwELL[r, t] from g[r, 256t : 256t+256], one program per row block walking
    all T tiles with two in flight.

    active = not (g <= 0) (NaN active); word 0 of (r, t) = the exact active count (also past the
    capacity); slot k >= 1 = (bf16/fp16 bits of g) << 16 | column of the k-th active entry. A
    (row block, tile) with no active entry stores only its count word (at 0.3 % density about
    half of a row's tiles are empty). The scan of a 256-column tile stays inside one warp and
    nothing crosses warps per step (one row per one-warp program ran 2x faster than
    32-row blocks on 8 warps; BENCHMARKS.md).
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    offs = tl.arange(0, 256)
    gp = g_ptr + rows.to(tl.int64)[:, None] * stride_gm
    g1 = tl.load(gp + offs[None, :], mask=row_mask[:, None] & (offs < H)[None, :], other=0.0)
    c2 = offs + 256
    g2 = tl.load(gp + c2[None, :], mask=row_mask[:, None] & (c2 < H)[None, :], other=0.0)
    nnz = tl.zeros((BLOCK_M,), dtype=tl.int32)
    n_ovf = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for t in range(n_tile):
        cols = t * 256 + offs
        g = g1
        g1 = g2
        c2 = cols + 512
        g2 = tl.load(gp + c2[None, :], mask=row_mask[:, None] & (c2 < H)[None, :], other=0.0)
        active = ~(g.to(tl.float32) <= 0) & row_mask[:, None] & (cols < H)[None, :]
        per_row = tl.sum(active.to(tl.int32), axis=1)
        wbase = tw_ptr + (rows.to(tl.int64) * n_tile + t) * W
        tl.store(wbase, per_row, mask=row_mask)  # count words: exact, also past capacity
        nnz += per_row
        n_ovf += (per_row >= W).to(tl.int32)
        if tl.sum(per_row, axis=0) > 0:
            _pack_words(g, active, cols, wbase, colcnt_ptr, H, W, VALUE_MODE, STATS)
    # the per-row sums the FFN's statistics read (else a pass over the strided count words)
    tl.store(rownnz_ptr + rows, nnz, mask=row_mask)
    tl.store(rowovf_ptr + rows, n_ovf, mask=row_mask)


def _check_dense(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D; got shape {tuple(t.shape)}")
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be float16, bfloat16 or float32; got {t.dtype}")


def pack_dense(
    g_MH: torch.Tensor,
    factor: int = 8,
    *,
    stats: bool = False,
    block_m: int = 1,
    num_warps: int = 1,
) -> tuple[TwELL, torch.Tensor | None]:
    """Triton ReLU + pack of a dense pre-activation (``_pack_dense_kernel``).

    Args:
        g_MH: (M, H) fp16/bf16/fp32, unit column stride (any row stride).
        factor: TwELL compression factor (8, 4, 2).
        stats: also return per-column active counts.
        block_m: rows per program (power of 2); 1 by default (one row per one-warp program:
            0.139 ms at M 16384, H 5632, 0.3 % on the H200).
        num_warps: warps per program.

    Returns:
        ``(TwELL, active_counts (H,) int32 or None)``; values in
        ``value_dtype_for(g.dtype)`` (a bf16/fp16 gate keeps its bits exactly,
        fp32 is rounded to bf16, nearest-even); the TwELL carries each row's exact count and
        overflowed tiles (``row_nnz``, ``row_overflow``) from the same pass.

    Raises:
        ValueError: bad rank/dtype, H >= 65536, bad factor or block_m.
    """
    _check_dense("g_MH", g_MH)
    m, h = g_MH.shape
    check_width(h)
    w = words_per_tile(factor)
    if g_MH.stride(1) != 1:
        g_MH = g_MH.contiguous()
    t = n_tiles(h)
    vdt = value_dtype_for(g_MH.dtype)
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"pack_dense block_m must be a power of 2; got {block_m}")
    tw = torch.empty(m, t, w, dtype=torch.int32, device=g_MH.device)
    colcnt = torch.zeros(h if stats else 1, dtype=torch.int32, device=g_MH.device)
    rows = torch.empty(2, m, dtype=torch.int32, device=g_MH.device)  # row_nnz, row_overflow
    if m > 0:
        _pack_dense_kernel[(triton.cdiv(m, block_m),)](
            g_MH, tw, colcnt, rows[0], rows[1], m, h, t, g_MH.stride(0),
            W=w, VALUE_MODE=1 if g_MH.dtype == torch.float32 else 0, STATS=stats,
            BLOCK_M=block_m, num_warps=num_warps,
        )
    return TwELL(tw, h, factor, vdt, rows[0], rows[1]), (colcnt if stats else None)


__all__ = ["TILE", "f32_to_bf16_bits", "pack_dense"]
