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
BENCHMARKS.md, "Superseded kernels"). A variant that spread the longest rows' overflowed tiles
over extra programs (``split_long``) was deleted after measuring: dominated by ``heavy_first``
on every input timed (BENCHMARKS.md, second session of 2026-12-06).
"""

from __future__ import annotations

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
def _twell_ffn_kernel(
    x_ptr,        # (M, D) input rows (GATED), unit column stride
    tw_ptr,       # (M, T, W) int32 TwELL of the gate (GATED) or of h (non-gated)
    dense_ptr,    # (M, H) dense pre-activation, read only for overflowed tiles
    wu_ptr,       # (H, D) up weight (GATED)
    wdt_ptr,      # (H, D) down weight transposed, unit column stride
    y_ptr,        # (M, D) out
    l1_ptr,       # (M,) fp32 out: sum_c |h_rc| (STATS)
    order_ptr,    # (M,) int32 row of each program slot (ORDERED)
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
):
    """y[r, d-slice] for ROWS rows (grid: (cdiv(M, ROWS), cdiv(D, BLOCK_D))): the row's
    non-zeros as one flat list, NB per step.

    One vector load of the row's T counts; their inclusive cumsum ``incl``
    maps flat index k to (tile = #{t : incl_t <= k}, slot = k - incl_{tile-1});
    K slot words are fetched in one vector load; steps of NB take NB words
    from registers (no memory access between the count load and the weight
    gathers but that one word load per K non-zeros). Overflowed tiles are
    left out of the list (count 0) and done afterwards from the dense gate.
    """
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    offs_nb = tl.arange(0, NB)
    offs_k = tl.arange(0, K)
    offs_t = tl.arange(0, T_PAD)
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

    Returns:
        ``(y_MD, l1_M or None)``.

    Raises:
        ValueError: inconsistent shapes/dtypes/devices, unsupported D split,
            bad nb / k, or (heavy_first) a ``tw.row_nnz`` that is not (M,).
    """
    if nb < 1 or nb & (nb - 1) or k < nb or k & (k - 1):
        raise ValueError(f"nb and k must be powers of 2 with k >= nb; got nb={nb}, k={k}")
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
    if heavy_first:
        nnz_rows = tw.nnz_per_row()  # the producer's row_nnz when set
        if nnz_rows.shape != (m,):  # else programs past row M, or rows never written
            raise ValueError(f"heavy_first orders the rows by tw.row_nnz, which must be ({m},) "
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
        args = (xa, tw.data, dense_MH, wa, w_down_t_HD, y, l1, order, m, h, d, t,
                xa.stride(0), dense_MH.stride(0), y.stride(0), wa.stride(0), w_down_t_HD.stride(0))
        meta = {"W": w, "GATED": gated, "FP16_VALUES": tw.value_dtype == torch.float16,
                "STATS": stats, "BLOCK_D": block_d, "NB": nb, "ROWS": rows,
                "OUT_BF16": out_dtype == torch.bfloat16, "num_warps": num_warps}
        _twell_ffn_kernel[grid](*args, **meta, T_PAD=max(2, triton.next_power_of_2(t)), K=k,
                                PREFETCH=prefetch, ORDERED=heavy_first)
    return y, (l1 if stats else None)


__all__ = ["twell_ffn_apply"]
