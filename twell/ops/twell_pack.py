"""Producers of TwELL: ReLU + pack of a dense gate, and the fused gate GEMM + pack.

Shape legend: M rows (tokens), D model width, H FFN width, T = ceil(H/256)
tiles, W = 256/factor words per (row, tile). Layout: ``twell.format``.

Two designs (arXiv 2603.23198 writes TwELL from the gate GEMM's epilogue;
``shared/PAPER.md`` "Calibration" measured that a plain Triton epilogue costs
+60% over the GEMM while a dense bf16 round trip of M x H costs ~0.1 ms):

* two-pass (default): ``g = x @ Wg^T`` by cuBLAS (torch), then
  :func:`pack_dense` reads the bf16 rows once and writes TwELL. The dense
  gate stays in memory and the consumer reads it for overflowed tiles only.
  Two pack kernels: v1 (one program per 16-row block and tile; 0.27 ms for
  the 184 MB gate of M = 16384, H = 5632 on the H200, i.e. 0.67 TB/s) and
  v2 (default; persistent, prefetching, see ``_pack_dense_v2_kernel``).
* fused: :func:`gate_gemm_pack`, a Triton GEMM whose 128 x 256 (BLOCK_M x
  tile) accumulator is packed in the epilogue; the dense tile is written
  (to a lazily allocated ``spill`` buffer) only for overflowed (row, tile).

``scripts/bench_ffn.py`` times both; see BENCHMARKS.md for which is default
and why.
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
def _pack_tile_epilogue(
    v,            # (BLOCK_M, 256) fp32 pre-activation of one row block x one tile
    rows,         # (BLOCK_M,) int32 row indices
    cols,         # (256,) int32 global column indices of the tile
    row_mask,     # (BLOCK_M,) rows < M
    col_mask,     # (256,) cols < H
    tile,         # tile index t
    tw_ptr,       # TwELL int32 (M, T, W)
    colcnt_ptr,   # (H,) int32 active counts per column (STATS only)
    n_tile,       # T
    W: tl.constexpr,            # words per (row, tile)
    FP16_VALUES: tl.constexpr,  # value half is fp16 (else bf16)
    STATS: tl.constexpr,        # accumulate per-column active counts
):
    """Write the TwELL words of one (row block, tile); returns the (BLOCK_M,) counts.

    active = not (v <= 0) (NaN active); slot of an active entry = inclusive
    cumsum of the active mask along the tile (1-based word index); entries
    past the capacity W-1 are not written (the count stays exact).
    """
    active = ~(v <= 0) & row_mask[:, None] & col_mask[None, :]
    a32 = active.to(tl.int32)
    cnt = tl.sum(a32, axis=1)
    pos = tl.cumsum(a32, axis=1)
    if FP16_VALUES:
        bits = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        bits = f32_to_bf16_bits(v)  # RNE, same bits on GPU and in the interpreter
    word = (bits << 16) | cols[None, :]
    base = tw_ptr + (rows.to(tl.int64) * n_tile + tile) * W
    tl.store(base[:, None] + pos, word, mask=active & (pos < W))
    tl.store(base, cnt, mask=row_mask)
    if STATS:
        tl.atomic_add(colcnt_ptr + cols, tl.sum(a32, axis=0), mask=col_mask)
    return cnt


@triton.jit
def _pack_dense_kernel(
    g_ptr,        # (M, H) dense pre-activation, unit column stride
    tw_ptr,       # (M, T, W) int32 out
    colcnt_ptr,   # (H,) int32 out (STATS)
    M, H, n_tile,
    stride_gm,    # row stride of g
    W: tl.constexpr,
    FP16_VALUES: tl.constexpr,
    STATS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """ReLU + pack: TwELL[r, t] from g[r, 256t : 256t+256] for a BLOCK_M row block."""
    pid_m = tl.program_id(0)
    tile = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile * 256 + tl.arange(0, 256)
    row_mask = rows < M
    col_mask = cols < H
    g = tl.load(g_ptr + rows.to(tl.int64)[:, None] * stride_gm + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    _pack_tile_epilogue(g.to(tl.float32), rows, cols, row_mask, col_mask, tile, tw_ptr, colcnt_ptr,
                        n_tile, W, FP16_VALUES, STATS)


@triton.jit
def _pack_dense_v2_kernel(
    g_ptr,        # (M, H) dense pre-activation, unit column stride
    tw_ptr,       # (M, T, W) int32 out
    colcnt_ptr,   # (H,) int32 out (STATS)
    M, H, n_tile, n_prog_m,
    stride_gm,    # row stride of g
    W: tl.constexpr,
    VALUE_MODE: tl.constexpr,   # 0: g is bf16/fp16, keep its 16 bits; 1: fp32 -> bf16 RNE
    STATS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """ReLU + pack, persistent over row blocks: program (p, t) packs tile t of row blocks p, p + P, ...

    Versus v1 (one 16-row block per program): the next block's load is issued
    before the current block is packed (loads in flight while the cumsum and
    the scattered stores run), the 16-bit value is the input's own bits (no
    fp32 round trip for bf16/fp16 gates), and per-column active counts are
    summed in registers over all of the program's blocks, then added with one
    atomic per column per program (v1: one per column per 16-row block).
    """
    pid_m = tl.program_id(0)
    tile = tl.program_id(1)
    cols = tile * 256 + tl.arange(0, 256)
    col_mask = cols < H
    n_blk = tl.cdiv(M, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    colacc = tl.zeros((256,), dtype=tl.int32)
    rows = pid_m * BLOCK_M + offs_m
    g_next = tl.load(g_ptr + rows.to(tl.int64)[:, None] * stride_gm + cols[None, :],
                     mask=(rows < M)[:, None] & col_mask[None, :], other=0.0)
    for b in range(pid_m, n_blk, n_prog_m):
        g = g_next
        rows = b * BLOCK_M + offs_m
        rows_n = rows + n_prog_m * BLOCK_M  # prefetch the program's next block
        g_next = tl.load(g_ptr + rows_n.to(tl.int64)[:, None] * stride_gm + cols[None, :],
                         mask=(rows_n < M)[:, None] & col_mask[None, :], other=0.0)
        row_mask = rows < M
        active = ~(g.to(tl.float32) <= 0) & row_mask[:, None] & col_mask[None, :]
        a32 = active.to(tl.int32)
        base = tw_ptr + (rows.to(tl.int64) * n_tile + tile) * W
        tl.store(base, tl.sum(a32, axis=1), mask=row_mask)
        _pack_words(g, active, cols, base, colcnt_ptr, H, W, VALUE_MODE, False)
        if STATS:  # summed in registers over the program's blocks, one atomic per column at the end
            colacc += tl.sum(a32, axis=0)
    if STATS:
        tl.atomic_add(colcnt_ptr + cols, colacc, mask=col_mask)


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
def _pack_dense_v4_kernel(
    g_ptr,        # (M, H) dense pre-activation, unit column stride
    tw_ptr,       # (M, T, W) int32 out
    colcnt_ptr,   # (H,) int32 out (STATS)
    M, H, n_tile,
    stride_gm,    # row stride of g
    W: tl.constexpr,
    VALUE_MODE: tl.constexpr,   # 0: g is bf16/fp16, keep its 16 bits; 1: fp32 -> bf16 RNE
    STATS: tl.constexpr,
    BLOCK_M: tl.constexpr,      # rows per program (default 1, on one warp)
    SKIP_EMPTY: tl.constexpr = False,  # v5: no scan or word stores for an all-zero block
):
    """ReLU + pack, v4: one program per row block walking all T tiles, two tiles in flight.

    v5 (``SKIP_EMPTY``) stores only the count word of a (row block, tile) with no active
    entry and skips its scan and masked word stores (at 0.3 % density about half of the
    256-column tiles of a row are empty; ncu put the pack at the L1/LSU limit).

    The structure of the training compaction v3 (run E: one row per one-warp program was 2x
    faster than 32-row blocks on 8 warps): the scan of a 256-column tile stays inside one warp
    and nothing crosses warps per step (per-column counts, when asked for, are relaxed atomics
    only for columns active in the block).
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    offs = tl.arange(0, 256)
    gp = g_ptr + rows.to(tl.int64)[:, None] * stride_gm
    g1 = tl.load(gp + offs[None, :], mask=row_mask[:, None] & (offs < H)[None, :], other=0.0)
    c2 = offs + 256
    g2 = tl.load(gp + c2[None, :], mask=row_mask[:, None] & (c2 < H)[None, :], other=0.0)
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
        if SKIP_EMPTY:
            if tl.sum(per_row, axis=0) > 0:
                _pack_words(g, active, cols, wbase, colcnt_ptr, H, W, VALUE_MODE, STATS)
        else:
            _pack_words(g, active, cols, wbase, colcnt_ptr, H, W, VALUE_MODE, STATS)


@triton.jit
def _gate_gemm_pack_kernel(
    x_ptr,        # (M, D) input rows, unit column stride
    w_ptr,        # (H, D) gate weight, unit column stride
    tw_ptr,       # (M, T, W) int32 out
    spill_ptr,    # (M, H) dense out, written only for overflowed (row, tile)
    colcnt_ptr,   # (H,) int32 out (STATS)
    M, H, D, n_tile,
    stride_xm, stride_wh, stride_sm,
    W: tl.constexpr,
    FP16_VALUES: tl.constexpr,
    STATS: tl.constexpr,
    IEEE: tl.constexpr,          # fp32 inputs: exact fp32 dot (tests), else tensor cores
    UPCAST: tl.constexpr,        # interpreter only: its tl.dot multiplies bf16 bit patterns
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """g = x @ Wg^T for a (BLOCK_M x 256) block, then ReLU + pack in the epilogue.

    Grouped program ordering as in the Triton matmul tutorial; fp32 accumulation.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_in_group = GROUP_M * n_tile
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % num_in_group) % group_size)
    tile = (pid % num_in_group) // group_size

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile * 256 + tl.arange(0, 256)
    row_mask = rows < M
    col_mask = cols < H
    rows_c = tl.where(row_mask, rows, 0).to(tl.int64)   # clamp: unmasked loads in the main loop
    cols_c = tl.where(col_mask, cols, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + rows_c[:, None] * stride_xm + offs_k[None, :]
    b_ptrs = w_ptr + cols_c[None, :] * stride_wh + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, 256), dtype=tl.float32)
    for k in range(tl.cdiv(D, BLOCK_K)):
        k_mask = offs_k < D - k * BLOCK_K
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    cnt = _pack_tile_epilogue(acc, rows, cols, row_mask, col_mask, tile, tw_ptr, colcnt_ptr, n_tile,
                              W, FP16_VALUES, STATS)
    ovf = (cnt > W - 1) & row_mask
    s_ptrs = spill_ptr + rows_c[:, None] * stride_sm + cols[None, :]
    tl.store(s_ptrs, acc.to(spill_ptr.dtype.element_ty), mask=ovf[:, None] & col_mask[None, :])


def _check_dense(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D; got shape {tuple(t.shape)}")
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be float16, bfloat16 or float32; got {t.dtype}")


def _n_sm(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 4 off the GPU (interpreter)."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _N_SM:
        _N_SM[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _N_SM[idx]


_N_SM: dict[int, int] = {}
PACK_VERSIONS = (1, 2, 4, 5)  # v3 (persistent, one row per warp) measured in runs E/F, removed


def pack_dense(
    g_MH: torch.Tensor,
    factor: int = 8,
    *,
    stats: bool = False,
    version: int = 5,
    block_m: int | None = None,
    num_warps: int | None = None,
    programs_per_sm: int = 8,
) -> tuple[TwELL, torch.Tensor | None]:
    """Triton ReLU + pack of a dense pre-activation (second pass of the two-pass design).

    Args:
        g_MH: (M, H) fp16/bf16/fp32, unit column stride (any row stride).
        factor: TwELL compression factor (8, 4, 2).
        stats: also return per-column active counts.
        version: 5 (default): v4 that skips the scan and word stores of
            all-zero blocks (run I on one H200, M 16384, H 5632: 0.195 / 0.209
            ms at 1 / 3 % vs v4's 0.218 / 0.220); 4: one program per row block
            walking all tiles with two in flight, one warp by default (run F:
            0.217 ms vs 0.259 for v2 and 0.255 for v1);
            2: persistent programs, one per (row-block
            stripe, tile), that prefetch their next row block and keep
            per-column counts in registers; 1: the first kernel (one program
            per 16-row block and tile), kept for the benchmark's old/new ratio.
            (A v3, v2 with one row per warp, was measured in runs E/F and
            removed: no faster than v4.)
        block_m: rows per block (power of 2); default 16 (v1, v2) or 1
            (v4, v5).
        num_warps: warps per program; default 1 for v4 and v5, else 4.
        programs_per_sm: v2 only: about this many programs per SM in total
            (grid = (P, T) with P = ceil(SMs * programs_per_sm / T) row stripes).

    Returns:
        ``(TwELL, active_counts (H,) int32 or None)``; values in
        ``value_dtype_for(g.dtype)`` (a bf16/fp16 gate keeps its bits exactly,
        fp32 is rounded to bf16, nearest-even).

    Raises:
        ValueError: bad rank/dtype, H >= 65536, bad factor or version.
    """
    _check_dense("g_MH", g_MH)
    if version not in PACK_VERSIONS:
        raise ValueError(f"pack_dense version must be one of {PACK_VERSIONS}; got {version!r}")
    m, h = g_MH.shape
    check_width(h)
    w = words_per_tile(factor)
    if g_MH.stride(1) != 1:
        g_MH = g_MH.contiguous()
    t = n_tiles(h)
    vdt = value_dtype_for(g_MH.dtype)
    if num_warps is None:
        num_warps = 1 if version in (4, 5) else 4
    if block_m is None:
        block_m = 1 if version in (4, 5) else 16
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"pack_dense block_m must be a power of 2; got {block_m}")
    tw = torch.empty(m, t, w, dtype=torch.int32, device=g_MH.device)
    colcnt = torch.zeros(h if stats else 1, dtype=torch.int32, device=g_MH.device)
    if m > 0 and version == 1:
        grid = (triton.cdiv(m, block_m), t)
        _pack_dense_kernel[grid](
            g_MH, tw, colcnt, m, h, t, g_MH.stride(0),
            W=w, FP16_VALUES=vdt == torch.float16, STATS=stats, BLOCK_M=block_m,
            num_warps=num_warps,
        )
    elif m > 0 and version in (4, 5):
        _pack_dense_v4_kernel[(triton.cdiv(m, block_m),)](
            g_MH, tw, colcnt, m, h, t, g_MH.stride(0),
            W=w, VALUE_MODE=1 if g_MH.dtype == torch.float32 else 0, STATS=stats,
            BLOCK_M=block_m, SKIP_EMPTY=version == 5, num_warps=num_warps,
        )
    elif m > 0:
        n_blk = triton.cdiv(m, block_m)
        n_prog_m = max(1, min(n_blk, triton.cdiv(_n_sm(g_MH.device) * programs_per_sm, t)))
        _pack_dense_v2_kernel[(n_prog_m, t)](
            g_MH, tw, colcnt, m, h, t, n_prog_m, g_MH.stride(0),
            W=w, VALUE_MODE=1 if g_MH.dtype == torch.float32 else 0, STATS=stats,
            BLOCK_M=block_m, num_warps=num_warps,
        )
    return TwELL(tw, h, factor, vdt), (colcnt if stats else None)


def gate_gemm_pack(
    x_MD: torch.Tensor,
    w_HD: torch.Tensor,
    factor: int = 8,
    *,
    stats: bool = False,
    block_m: int = 64,
    block_k: int = 64,
    group_m: int = 8,
    num_warps: int = 8,
    num_stages: int = 3,
) -> tuple[TwELL, torch.Tensor, torch.Tensor | None]:
    """Fused gate GEMM + ReLU + pack (one Triton kernel, paper's inference producer).

    Args:
        x_MD: (M, D) activations; w_HD: (H, D) gate (or, non-gated, up)
            weight; same dtype (fp16/bf16/fp32), unit column stride.
        factor: TwELL compression factor.
        stats: also return per-column active counts.

    Returns:
        ``(TwELL, spill_MH, active_counts or None)``: ``spill_MH`` (M, H) in
        x's dtype holds the dense pre-activation of overflowed (row, tile)
        pairs only (the rest is uninitialised memory, never read).

    Raises:
        ValueError: shape/dtype mismatch, H >= 65536.
    """
    _check_dense("x_MD", x_MD)
    _check_dense("w_HD", w_HD)
    if x_MD.dtype != w_HD.dtype or x_MD.shape[1] != w_HD.shape[1]:
        raise ValueError(
            f"x_MD {tuple(x_MD.shape)} {x_MD.dtype} and w_HD {tuple(w_HD.shape)} {w_HD.dtype} must "
            "share dtype and D"
        )
    m, d = x_MD.shape
    h = w_HD.shape[0]
    check_width(h)
    w = words_per_tile(factor)
    x_MD = x_MD if x_MD.stride(1) == 1 else x_MD.contiguous()
    w_HD = w_HD if w_HD.stride(1) == 1 else w_HD.contiguous()
    t = n_tiles(h)
    vdt = value_dtype_for(x_MD.dtype)
    tw = torch.empty(m, t, w, dtype=torch.int32, device=x_MD.device)
    spill = torch.empty(m, h, dtype=x_MD.dtype, device=x_MD.device)
    colcnt = torch.zeros(h if stats else 1, dtype=torch.int32, device=x_MD.device)
    if m > 0:
        grid = (triton.cdiv(m, block_m) * t,)
        _gate_gemm_pack_kernel[grid](
            x_MD, w_HD, tw, spill, colcnt, m, h, d, t,
            x_MD.stride(0), w_HD.stride(0), spill.stride(0),
            W=w, FP16_VALUES=vdt == torch.float16, STATS=stats, IEEE=x_MD.dtype == torch.float32,
            UPCAST=(not x_MD.is_cuda) and x_MD.dtype == torch.bfloat16,
            BLOCK_M=block_m, BLOCK_K=block_k, GROUP_M=group_m,
            num_warps=num_warps, num_stages=num_stages,
        )
    return TwELL(tw, h, factor, vdt), spill, (colcnt if stats else None)


__all__ = ["PACK_VERSIONS", "TILE", "gate_gemm_pack", "pack_dense"]
