"""Consumer of TwELL: fused sparse up projection + down projection (inference).

Shape legend: M rows (tokens), D model width, H FFN width, T = ceil(H/256)
tiles, W = 256/factor words per (row, tile), NB slots handled per step.

Math (arXiv 2603.23198, TwELL inference path, "fused up-projection at the
non-zeros and down-projection"), per row r, over the active set A_r:

    gated:      y_r = sum_{c in A_r} g_rc * (x_r . Wu_c) * WdT_c
    non-gated:  y_r = sum_{c in A_r} h_rc * WdT_c          (h = relu(x Wu^T) packed)

with Wu (H, D) row-major and WdT = Wd^T (H, D) contiguous, so every non-zero
gathers two contiguous D-rows (4 KiB each at D = 2048, bf16). Accumulation is
fp32 in registers over the full D of the row; nothing of size M x H is
written. An overflowed (row, tile) (count > W-1) is computed from the dense
pre-activation ``dense[r, 256t : 256t+256]`` instead of its slots: one load of
the tile, its active columns compacted in registers, NB per step (ceil(count /
NB) steps, as its entries would take in slots; not yet timed), so overflow
costs steps but never correctness.

Performance: the work is a gather of 2 * nnz weight rows per token; such gathers ran at 9-10 TB/s on
the H200 when Wu/WdT sit in L2 (BENCHMARKS.md, "TwELL inference FFN"). ``_twell_ffn_kernel`` treats
a row's non-zeros as one flat list (one vector load of the T counts, K slot words per vector load,
NB non-zeros per step from registers); NB > 1 issues NB independent row gathers per step, ROWS > 1
amortises program start. It replaced a first kernel that walked the tiles one by one (deleted;
BENCHMARKS.md, "Superseded kernels").

Long rows (``split_long``): a row is one program, so a first token with nearly every tile
overflowed (~900 active units at H 5632) is ~230 dependent NB-steps in one program that runs alone
at the launch's end: on an H100 (M 16384, D 2048, H 5632, i.i.d. 0.3 %) eight such rows cost
+0.33 ms on 1.154 ms (+28 %), and taking rows longest first (``heavy_first``) hid only 0.126 ms
while costing 6.7 % on i.i.d. rows (BENCHMARKS.md, "Session of 2026-12-05, seventh"). With
``split_long = L`` the L rows with the most non-zeros (one ``topk``, no host sync) hand their
overflowed tiles to L x S programs of their own launch, before the main one (program (j, p)
takes tiles t % S == p of long row j); the row's own program keeps its listed slots. Each writes an fp32
partial row to a scratch buffer, and ``_split_fixup_kernel`` sums the S + 1 partials in a fixed
order (deterministic, no atomics) into y and the L1.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch
import triton
import triton.language as tl

from twell.format import TwELL
from twell.ops.twell_pack import f32_to_bf16_bits


@triton.jit
def _accumulate(
    acc,          # (BLOCK_D,) fp32 running y row slice
    l1,           # fp32 scalar running sum |h|
    x,            # (BLOCK_D,) fp32 x row (GATED)
    cols,         # (NB,) int32 hidden indices
    v,            # (NB,) fp32 gate value (GATED) or h value (non-gated)
    valid,        # (NB,) bool
    offs_d, d_mask,
    wu_ptr, wdt_ptr, stride_wu, stride_wd,
    GATED: tl.constexpr,
):
    """acc += sum_k h_k * WdT[cols_k, d]; h_k = v_k * (x . Wu[cols_k]) (gated) or v_k. Both row
    gathers are issued before either is used (``_load_rows``).

    The L1 term is summed as |v_k| |u_k| (the same bits as |h_k|; 0 where not valid), not as
    |h_k|: on an H100 (Triton 3.6) the compiled ``tl.sum(tl.abs(h))`` of the overflowed-tile path
    summed h itself for some shapes (gated, D 40 on nb 4 / 4 warps, D 100 on 8 warps), so a row's
    L1 came out as its signed sum while y was right; ``tests/ops/test_ffn.py`` on CUDA showed it."""
    wu, wd = _load_rows(cols, valid, offs_d, d_mask, wu_ptr, wdt_ptr, stride_wu, stride_wd, GATED)
    if GATED:
        u = tl.where(valid, tl.sum(wu.to(tl.float32) * x[None, :], axis=1), 0.0)
    else:
        u = tl.where(valid, 1.0, 0.0)
    h = tl.where(valid, v * u, 0.0)
    acc += tl.sum(h[:, None] * wd.to(tl.float32), axis=0)
    l1 += tl.sum(tl.abs(v) * tl.abs(u), axis=0)
    return acc, l1


@triton.jit
def _overflow_tile(acc, l1, x, t, r64, dense_ptr, stride_dm, H, offs_nb, offs_d, d_mask,
                   wu_ptr, wdt_ptr, stride_wu, stride_wd, GATED: tl.constexpr, NB: tl.constexpr):
    """An overflowed (row, tile): its 256 pre-activations in one load, the active ones (NaN
    active) compacted in registers, NB per step in column order; returns the updated (acc, l1).

    Why: stepping NB columns at a time over all 256 took 256 / NB dependent steps per overflowed
    tile whatever its count, so a first token with every tile overflowed (~700-1700 active units
    at 1.5B) ran ~1400 steps in one program: a tail that held real layers' forward near dense
    (BENCHMARKS.md, "The overflowed tiles of the forward consumer"). Now ceil(count / NB)."""
    offs = tl.arange(0, 256)
    cols_t = t * 256 + offs
    in_h = cols_t < H
    g = tl.load(dense_ptr + r64 * stride_dm + cols_t, mask=in_h, other=0.0).to(tl.float32)
    act = ~(g <= 0) & in_h
    a32 = act.to(tl.int32)
    pos = tl.where(act, tl.cumsum(a32, axis=0) - 1, -1)  # rank among the tile's active columns
    n_act = tl.sum(a32, axis=0)
    for j in range(0, n_act, NB):
        want = j + offs_nb
        sel = pos[None, :] == want[:, None]  # (NB, 256): at most one column per step lane
        cols = tl.sum(tl.where(sel, cols_t[None, :], 0), axis=1)
        v = tl.sum(tl.where(sel, g[None, :], 0.0), axis=1)  # exact: one term (NaN, inf kept)
        acc, l1 = _accumulate(acc, l1, x, cols, v, want < n_act, offs_d, d_mask, wu_ptr,
                              wdt_ptr, stride_wu, stride_wd, GATED)
    return acc, l1


@triton.jit
def _store_row(acc, l1, y_ptr, l1_ptr, r, r64, stride_ym, offs_d, d_mask, pid_d,
               OUT_BF16: tl.constexpr, STATS: tl.constexpr):
    """Store one output row slice (bf16 by explicit round-to-nearest-even: the interpreter's
    float cast truncates) and, from the first D slice, the row's L1."""
    if OUT_BF16:
        yv = f32_to_bf16_bits(acc).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        yv = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r64 * stride_ym + offs_d, yv, mask=d_mask)
    if STATS:  # noqa: SIM102 (constexpr guard around a runtime branch)
        if pid_d == 0:
            tl.store(l1_ptr + r, l1)


@triton.jit
def _decode(wrd, FP16_VALUES: tl.constexpr):
    """Slot words -> (column int32, value fp32)."""
    cols = wrd & 0xFFFF
    if FP16_VALUES:
        v = ((wrd >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        v = (wrd & -65536).to(tl.float32, bitcast=True)  # bf16 -> fp32 exactly
    return cols, v


@triton.jit
def _take(wrds, idx, offs_k, n_here, FP16_VALUES: tl.constexpr):
    """Words ``idx`` (NB,) of a batch of K slot words (a one-hot select: exact for int32) ->
    (column int32, value fp32, valid = idx < n_here)."""
    sel = offs_k[None, :] == idx[:, None]
    cols, v = _decode(tl.sum(tl.where(sel, wrds[None, :], 0), axis=1), FP16_VALUES)
    return cols, v, idx < n_here


@triton.jit
def _load_rows(cols, valid, offs_d, d_mask, wu_ptr, wdt_ptr, stride_wu, stride_wd, GATED: tl.constexpr):
    """Issue the gathers of Wu[cols] (GATED) and WdT[cols]: (NB, BLOCK_D) each, both before any use."""
    c64 = cols.to(tl.int64)
    m2 = valid[:, None] & d_mask[None, :]
    wd = tl.load(wdt_ptr + c64[:, None] * stride_wd + offs_d[None, :], mask=m2, other=0.0)
    if GATED:
        wu = tl.load(wu_ptr + c64[:, None] * stride_wu + offs_d[None, :], mask=m2, other=0.0)
    else:
        wu = wd  # unused
    return wu, wd


@triton.jit
def _store_part(acc, l1, scr_ptr, scr_l1_ptr, q, D, offs_d, d_mask, pid_d, STATS: tl.constexpr):
    """Store one fp32 partial row slice at scratch row ``q`` = j (S + 1) + part (and, from the
    first D slice, its partial L1): summed by ``_split_fixup_kernel``."""
    tl.store(scr_ptr + q.to(tl.int64) * D + offs_d, acc, mask=d_mask)
    if STATS:  # noqa: SIM102 (constexpr guard around a runtime branch)
        if pid_d == 0:
            tl.store(scr_l1_ptr + q, l1)


@triton.jit
def _split_part_kernel(
    long_ptr, tw_ptr, x_ptr, dense_ptr, wu_ptr, wdt_ptr, scr_ptr, scr_l1_ptr, H, D, n_tile,
    stride_xm, stride_dm, stride_wu, stride_wd, W: tl.constexpr, GATED: tl.constexpr,
    STATS: tl.constexpr, NB: tl.constexpr, S_PARTS: tl.constexpr, BLOCK_D: tl.constexpr,
    T_PAD: tl.constexpr,
):
    """Program (j S + p, d-slice) of ``split_long``: the overflowed tiles t of long row
    ``long[j]`` with t % S == p, into scratch row j (S + 1) + 1 + p (written even when it has
    no such tile, so the scratch needs no zero fill). Its own launch, before the main one: in
    the main kernel (the first version) it cost the row loop 10-17 % on every input, most
    likely by raising the whole kernel's registers (H200, BENCHMARKS.md "Session of
    2026-12-06")."""
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    offs_nb = tl.arange(0, NB)
    offs_t = tl.arange(0, T_PAD)
    j = pid // S_PARTS
    p = pid - j * S_PARTS
    r = tl.load(long_ptr + j)
    r64 = r.to(tl.int64)
    cnt = tl.load(tw_ptr + r64 * n_tile * W + offs_t * W, mask=offs_t < n_tile, other=0)
    ovf32 = (cnt >= W).to(tl.int32)
    # -0.0 (bits 0x80000000), the identity of fp32 addition: a part with no tile adds nothing,
    # so a long row without overflowed tiles keeps the unsplit path's bits, -0 included
    acc = tl.full((BLOCK_D,), -2147483648, tl.int32).to(tl.float32, bitcast=True)
    l1 = tl.sum(tl.zeros((BLOCK_D,), dtype=tl.float32), axis=0)  # fp32 scalar 0
    if GATED:
        x = tl.load(x_ptr + r64 * stride_xm + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    else:
        x = acc  # unused
    for t in range(p, n_tile, S_PARTS):
        if tl.sum(tl.where(offs_t == t, ovf32, 0), axis=0) > 0:
            acc, l1 = _overflow_tile(acc, l1, x, t, r64, dense_ptr, stride_dm, H, offs_nb, offs_d,
                                     d_mask, wu_ptr, wdt_ptr, stride_wu, stride_wd, GATED, NB)
    _store_part(acc, l1, scr_ptr, scr_l1_ptr, j * (S_PARTS + 1) + 1 + p, D, offs_d, d_mask,
                pid_d, STATS)


@triton.jit
def _split_fixup_kernel(
    long_ptr,     # (L,) int32 long rows
    scr_ptr,      # (L, S + 1, D) fp32 partial rows: part 0 the listed slots, 1 + p extra p's
    scr_l1_ptr,   # (L, S + 1) fp32 partial L1 (STATS)
    y_ptr, l1_ptr, D, stride_ym,
    S_PARTS: tl.constexpr, BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr, STATS: tl.constexpr,
):
    """y[long[j], d-slice] (and l1[long[j]]) = the S + 1 partials of long row j summed in fp32 in
    part order (grid: (L, cdiv(D, BLOCK_D))): a fixed order, so the same bits every call."""
    j = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    r = tl.load(long_ptr + j)
    q0 = j * (S_PARTS + 1)
    acc = tl.load(scr_ptr + q0.to(tl.int64) * D + offs_d, mask=d_mask, other=0.0)
    if STATS:
        l1 = tl.load(scr_l1_ptr + q0)
    else:
        l1 = tl.sum(acc, axis=0)  # unused
    for s in tl.static_range(1, S_PARTS + 1):
        acc += tl.load(scr_ptr + (q0 + s).to(tl.int64) * D + offs_d, mask=d_mask, other=0.0)
        if STATS:
            l1 += tl.load(scr_l1_ptr + q0 + s)
    _store_row(acc, l1, y_ptr, l1_ptr, r, r.to(tl.int64), stride_ym, offs_d, d_mask, pid_d,
               OUT_BF16, STATS)


@triton.jit
def _twell_ffn_kernel(
    x_ptr,        # (M, D) input rows (GATED), unit column stride
    tw_ptr,       # (M, T, W) int32 TwELL of the gate (GATED) or of h (non-gated)
    dense_ptr,    # (M, H) dense pre-activation, read only for overflowed tiles
    wu_ptr,       # (H, D) up weight (GATED)
    wdt_ptr,      # (H, D) down weight transposed, unit column stride
    y_ptr,        # (M, D) out
    l1_ptr,       # (M,) fp32 out: sum_c |h_rc| (STATS)
    order_ptr,    # (M,) int32 row of each program slot (ORDERED)
    long_ptr,     # (L,) int32 rows whose overflowed tiles are split (SPLIT)
    scr_ptr,      # (L, S + 1, D) fp32 scratch of the long rows' partial y rows (SPLIT)
    scr_l1_ptr,   # (L, S + 1) fp32 scratch of their partial L1 (SPLIT and STATS)
    n_long,       # L (SPLIT)
    M, H, D, n_tile,
    stride_xm, stride_dm, stride_ym, stride_wu, stride_wd,
    W: tl.constexpr,            # words per (row, tile)
    GATED: tl.constexpr,
    FP16_VALUES: tl.constexpr,  # value half of a word is fp16 (else bf16)
    STATS: tl.constexpr,
    BLOCK_D: tl.constexpr,      # D slice per program (>= D when GATED)
    NB: tl.constexpr,           # non-zeros per step
    ROWS: tl.constexpr,         # rows per program
    OUT_BF16: tl.constexpr,     # y is bf16
    T_PAD: tl.constexpr,        # next power of 2 >= T
    K: tl.constexpr,            # slot words fetched per batch (power of 2, >= NB)
    PREFETCH: tl.constexpr,     # issue the next step's row gathers before this step's math
    ORDERED: tl.constexpr,      # rows in the order of order_ptr (else 0 .. M-1)
    SPLIT: tl.constexpr,        # split_long: long rows write partials (their tiles: _split_part_kernel)
    S_PARTS: tl.constexpr,      # S, extra programs per long row (SPLIT)
    L_PAD: tl.constexpr,        # next power of 2 >= L (SPLIT)
):
    """y[r, d-slice] for ROWS rows (grid: (cdiv(M, ROWS), cdiv(D, BLOCK_D))): the row's
    non-zeros as one flat list, NB per step.

    One vector load of the row's T counts; their inclusive cumsum ``incl``
    maps flat index k to (tile = #{t : incl_t <= k}, slot = k - incl_{tile-1});
    K slot words are fetched in one vector load; steps of NB take NB words
    from registers (no memory access between the count load and the weight
    gathers but that one word load per K non-zeros). Overflowed tiles are
    left out of the list (count 0) and done afterwards from the dense gate.

    SPLIT: a long row's own program skips its overflowed tiles (``_split_part_kernel``, launched
    before, computes them) and writes its partial to the scratch, not to y.
    """
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    offs_nb = tl.arange(0, NB)
    offs_k = tl.arange(0, K)
    offs_t = tl.arange(0, T_PAD)
    if SPLIT:
        offs_l = tl.arange(0, L_PAD)
        # L is small (tens): one vector of the long rows, compared with each row below
        long_rows = tl.load(long_ptr + offs_l, mask=offs_l < n_long, other=-1)
    for i in tl.static_range(ROWS):
        slot = pid * ROWS + i
        if slot < M:
            if ORDERED:
                r = tl.load(order_ptr + slot)
            else:
                r = slot
            r64 = r.to(tl.int64)
            row_tw = tw_ptr + r64 * n_tile * W
            cnt = tl.load(row_tw + offs_t * W, mask=offs_t < n_tile, other=0)
            ovf = cnt >= W
            eff = tl.where(ovf, 0, cnt)
            incl = tl.cumsum(eff, axis=0)
            total = tl.sum(eff, axis=0)
            n_ovf = tl.sum(ovf.to(tl.int32), axis=0)
            if SPLIT:
                hit = long_rows == r  # topk's rows are distinct: at most one hit
                is_long = tl.sum(hit.to(tl.int32), axis=0) > 0
                n_ovf = tl.where(is_long, 0, n_ovf)  # a long row's tiles are the extras'
            acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
            l1 = tl.sum(acc, axis=0)  # fp32 scalar 0
            if GATED:
                x = tl.load(x_ptr + r64 * stride_xm + offs_d, mask=d_mask, other=0.0).to(tl.float32)
            else:
                x = acc
            for s0 in range(0, total, K):
                kk = s0 + offs_k
                le = incl[None, :] <= kk[:, None]                      # (K, T_PAD)
                tile_k = tl.sum(le.to(tl.int32), axis=1)
                before = tl.sum(tl.where(le, eff[None, :], 0), axis=1)
                wrds = tl.load(row_tw + tile_k * W + 1 + (kk - before), mask=kk < total, other=0)
                n_here = tl.minimum(total - s0, K)
                # step j takes words j .. j+NB-1 of the batch
                cols, v, valid = _take(wrds, offs_nb, offs_k, n_here, FP16_VALUES)
                if PREFETCH:
                    wu, wd = _load_rows(cols, valid, offs_d, d_mask, wu_ptr, wdt_ptr, stride_wu,
                                        stride_wd, GATED)
                for j in range(0, n_here, NB):
                    if PREFETCH:
                        cur_wu = wu
                        cur_wd = wd
                    else:
                        cur_wu, cur_wd = _load_rows(cols, valid, offs_d, d_mask, wu_ptr, wdt_ptr,
                                                    stride_wu, stride_wd, GATED)
                    cur_v = v
                    cur_valid = valid
                    cols, v, valid = _take(wrds, j + NB + offs_nb, offs_k, n_here, FP16_VALUES)
                    if PREFETCH:
                        wu, wd = _load_rows(cols, valid, offs_d, d_mask, wu_ptr, wdt_ptr, stride_wu,
                                            stride_wd, GATED)
                    if GATED:
                        u = tl.sum(cur_wu.to(tl.float32) * x[None, :], axis=1)
                        hv = tl.where(cur_valid, cur_v * u, 0.0)
                    else:
                        hv = tl.where(cur_valid, cur_v, 0.0)
                    acc += tl.sum(hv[:, None] * cur_wd.to(tl.float32), axis=0)
                    l1 += tl.sum(tl.abs(hv), axis=0)
            if n_ovf > 0:  # overflowed tiles: dense pre-activation, active columns only
                ovf32 = ovf.to(tl.int32)
                for t in range(n_tile):
                    # the flag from the counts already in registers: no dependent load per tile
                    if tl.sum(tl.where(offs_t == t, ovf32, 0), axis=0) > 0:
                        acc, l1 = _overflow_tile(acc, l1, x, t, r64, dense_ptr, stride_dm, H,
                                                 offs_nb, offs_d, d_mask, wu_ptr, wdt_ptr,
                                                 stride_wu, stride_wd, GATED, NB)
            if SPLIT:
                if is_long:
                    jl = tl.sum(tl.where(hit, offs_l, 0), axis=0)
                    _store_part(acc, l1, scr_ptr, scr_l1_ptr, jl * (S_PARTS + 1), D, offs_d,
                                d_mask, pid_d, STATS)
                else:
                    _store_row(acc, l1, y_ptr, l1_ptr, r, r64, stride_ym, offs_d, d_mask, pid_d,
                               OUT_BF16, STATS)
            else:
                _store_row(acc, l1, y_ptr, l1_ptr, r, r64, stride_ym, offs_d, d_mask, pid_d,
                           OUT_BF16, STATS)


def twell_ffn_apply(
    tw: TwELL,
    dense_MH: torch.Tensor,
    w_down_t_HD: torch.Tensor,
    *,
    x_MD: torch.Tensor | None = None,
    w_up_HD: torch.Tensor | None = None,
    stats: bool = False,
    out_dtype: torch.dtype | None = None,
    nb: int = 4,
    rows: int = 1,
    block_d: int | None = None,
    num_warps: int | None = None,
    k: int = 32,
    prefetch: bool = False,
    heavy_first: bool = False,
    split_long: int = 0,
    split_parts: int = 8,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the TwELL consumer: y = (h from TwELL) @ Wd^T, h gated by the up projection.

    Args:
        tw: TwELL of the gate pre-activation (gated) or of ``x Wu^T``
            (non-gated), (M, T, W).
        dense_MH: (M, H) dense pre-activation, unit column stride; read only
            at overflowed tiles (may be otherwise uninitialised).
        w_down_t_HD: (H, D) = ``down_proj.weight.T.contiguous()``.
        x_MD: (M, D) input, required for the gated FFN (None: non-gated).
        w_up_HD: (H, D) up weight, required with ``x_MD``.
        stats: also return the per-row L1 ``sum_c |h_rc|`` (M,) fp32.
        out_dtype: y dtype (default x's / the weights' dtype).
        nb, rows, block_d, num_warps: launch shape (see module notes);
            ``block_d`` < D splits D across programs (non-gated only).
            Defaults: nb=4 on 4 warps (H200, M 16384, 0.3 %: 0.349 ms vs 0.499 at nb=2);
            otherwise warps = block_d * nb / 1024.
        k, prefetch: words per batch (power of 2 >= nb) and whether the next step's weight
            rows are gathered before this step's math (double-buffered registers).
        heavy_first: programs take the rows in descending order of their non-zeros (one
            ``argsort`` of the M row counts: ~10-20 us estimated, not yet timed) instead of
            0 .. M-1: a row's program walks its whole list, so a first token with hundreds of
            active units that starts late in the launch runs alone after the rest have
            finished; longest first, it overlaps them (the longest-processing-time-first
            order). Each row's arithmetic, hence y and the L1, is the same bits either way.
        split_long: L, the number of long-row slots (0: off, the unsplit launch). The
            min(L, M) rows with the most non-zeros (``torch.topk`` of ``tw.nnz_per_row()``: no
            host sync) have their overflowed tiles computed by min(L, M) x ``split_parts``
            programs of a launch before the main one instead of by the row's own program, which
            keeps the row's listed slots: a first token with nearly every tile overflowed was
            one program of ~230 dependent steps running alone at the launch's end (+0.33 ms,
            +28 % on an H100 with eight such rows in M 16384; module notes). The partial rows
            go to an fp32 scratch, (min(L, M), S + 1, D) and (min(L, M), S + 1) for the L1
            (``torch.empty``: every part is written), and a second small kernel sums them in a
            fixed order into y and the L1: deterministic, and equal to the unsplit result up to
            the fp32 reassociation of the overflowed tiles' sum (a row without overflowed tiles,
            or one not among the L, keeps its bits; NaN and inf propagate as there). Combines
            with ``heavy_first``, ``rows`` and a D split (each D slice has its own scratch
            columns). Not yet timed on a GPU.
        split_parts: S >= 1, extra programs per long row; program p takes the row's overflowed
            tiles t with t % S == p.

    Returns:
        ``(y_MD, l1_M or None)``.

    Raises:
        ValueError: inconsistent shapes/dtypes/devices, unsupported D split,
            bad nb / k, split_long < 0 or split_parts < 1 (or not integers), or (heavy_first,
            split_long) a ``tw.row_nnz`` that is not (M,).
    """
    if nb < 1 or nb & (nb - 1) or k < nb or k & (k - 1):
        raise ValueError(f"nb and k must be powers of 2 with k >= nb; got nb={nb}, k={k}")
    for name, v, lo in (("split_long", split_long, 0), ("split_parts", split_parts, 1)):
        # numbers.Integral: a NumPy integer is one too (bool is refused: a flag passed by slip)
        if not isinstance(v, numbers.Integral) or isinstance(v, (bool, np.bool_)) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}; got {v!r}")
    split_long, split_parts = int(split_long), int(split_parts)
    m, t, w = tw.data.shape
    h = tw.n_cols
    gated = x_MD is not None
    if gated != (w_up_HD is not None):
        raise ValueError("x_MD and w_up_HD must both be given (gated FFN) or both be None")
    if w_down_t_HD.dim() != 2 or w_down_t_HD.shape[0] != h:
        raise ValueError(f"w_down_t_HD must be (H={h}, D); got {tuple(w_down_t_HD.shape)}")
    d = w_down_t_HD.shape[1]
    if w_down_t_HD.stride(1) != 1:
        raise ValueError("w_down_t_HD must have unit column stride: pass down_proj.weight.T.contiguous()")
    if dense_MH.shape != (m, h) or dense_MH.stride(1) != 1:
        raise ValueError(f"dense_MH must be ({m}, {h}) with unit column stride; got {tuple(dense_MH.shape)}")
    if gated:
        if x_MD.shape != (m, d) or w_up_HD.shape != (h, d):
            raise ValueError(
                f"x_MD must be ({m}, {d}) and w_up_HD ({h}, {d}); got {tuple(x_MD.shape)}, "
                f"{tuple(w_up_HD.shape)}"
            )
        x_MD = x_MD if x_MD.stride(1) == 1 else x_MD.contiguous()
        w_up_HD = w_up_HD if w_up_HD.stride(1) == 1 else w_up_HD.contiguous()
    devs = {tw.data.device, dense_MH.device, w_down_t_HD.device}
    if gated:
        devs |= {x_MD.device, w_up_HD.device}
    n_long = min(split_long, m)
    if heavy_first or n_long > 0:
        nnz_rows = tw.nnz_per_row()  # the producer's row_nnz when set
        if nnz_rows.shape != (m,):  # else programs past row M, or rows never written
            who = " and ".join(n for n, on in (("heavy_first", heavy_first),
                                                ("split_long", n_long > 0)) if on)
            raise ValueError(f"{who} picks the rows by tw.row_nnz, which must be ({m},) "
                             f"like tw.data's rows; got {tuple(nnz_rows.shape)}: set "
                             "tw.row_nnz = None when data changes rows")
        devs.add(nnz_rows.device)
    if len(devs) != 1:
        raise ValueError(f"all operands must be on one device; got {devs}")
    full_d = triton.next_power_of_2(d)
    if block_d is None:
        block_d = full_d
    if gated and block_d < d:
        raise ValueError(f"the gated consumer needs the whole row: block_d={block_d} < D={d}")
    if block_d > 16384:
        raise ValueError(f"D={d} too large for the register-resident row (max 16384)")
    if num_warps is None:
        num_warps = 4 if nb == 4 else max(1, min(16, block_d * nb // 1024))
    out_dtype = out_dtype or (x_MD.dtype if gated else w_down_t_HD.dtype)
    y = torch.empty(m, d, dtype=out_dtype, device=w_down_t_HD.device)
    l1 = torch.empty(m if stats else 1, dtype=torch.float32, device=y.device)
    if m > 0:
        grid = (triton.cdiv(m, rows), triton.cdiv(d, block_d))
        xa = x_MD if gated else y  # placeholders keep the signature fixed
        wa = w_up_HD if gated else w_down_t_HD
        order = (torch.argsort(nnz_rows, descending=True).to(torch.int32)
                 if heavy_first else l1)
        if n_long > 0:
            long_rows = torch.topk(nnz_rows, n_long).indices.to(torch.int32)  # longest first
            scr = torch.empty(n_long, split_parts + 1, d, dtype=torch.float32, device=y.device)
            scr_l1 = (torch.empty(n_long, split_parts + 1, dtype=torch.float32, device=y.device)
                      if stats else scr)
        else:
            long_rows, scr, scr_l1 = l1, l1, l1
        args = (xa, tw.data, dense_MH, wa, w_down_t_HD, y, l1, order, long_rows, scr, scr_l1,
                n_long, m, h, d, t, xa.stride(0), dense_MH.stride(0), y.stride(0), wa.stride(0),
                w_down_t_HD.stride(0))
        meta = {"W": w, "GATED": gated, "FP16_VALUES": tw.value_dtype == torch.float16,
                "STATS": stats, "BLOCK_D": block_d, "NB": nb, "ROWS": rows,
                "OUT_BF16": out_dtype == torch.bfloat16, "num_warps": num_warps}
        t_pad = max(2, triton.next_power_of_2(t))
        if n_long > 0:
            # the long rows' overflowed tiles first, L x S short programs, so they never run
            # alone at the main launch's end
            _split_part_kernel[(n_long * split_parts, triton.cdiv(d, block_d))](
                long_rows, tw.data, xa, dense_MH, wa, w_down_t_HD, scr, scr_l1, h, d, t,
                xa.stride(0), dense_MH.stride(0), wa.stride(0), w_down_t_HD.stride(0), W=w,
                GATED=gated, STATS=stats, NB=nb, S_PARTS=split_parts, BLOCK_D=block_d,
                T_PAD=t_pad, num_warps=num_warps)
        _twell_ffn_kernel[grid](*args, **meta, T_PAD=t_pad, K=k,
                                PREFETCH=prefetch, ORDERED=heavy_first, SPLIT=n_long > 0,
                                # fixed when off: one compiled variant whatever split_parts
                                S_PARTS=split_parts if n_long > 0 else 1,
                                L_PAD=max(2, triton.next_power_of_2(n_long)))
        if n_long > 0:
            fix_d = min(full_d, 1024)
            _split_fixup_kernel[(n_long, triton.cdiv(d, fix_d))](
                long_rows, scr, scr_l1, y, l1, d, y.stride(0), S_PARTS=split_parts,
                BLOCK_D=fix_d, OUT_BF16=out_dtype == torch.bfloat16, STATS=stats,
                num_warps=max(1, min(8, fix_d // 256)))
    return y, (l1 if stats else None)


__all__ = ["twell_ffn_apply"]
