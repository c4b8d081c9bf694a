"""Launch shapes of the sparse training kernels (``CONFIG``, ``kernel_config``) and the launchers' checks.

The kernels (``twell/ops/compact.py``, ``sddmm.py``, ``spmm.py``, ``dw.py``, ``elementwise.py``,
``transpose.py``, ``add_rows.py``, ``overflow_rows.py``) read their block sizes and warps from ``CONFIG`` at launch;
``kernel_config`` changes them for a ``with`` block (benchmarks, tests).
"""

from __future__ import annotations

import contextlib

import torch
import triton

# BLOCK_D is capped by the next power of two of D so small/odd D (tests) waste little.
# Launch shapes (``CONFIG``; change with ``kernel_config``): each entry's comment gives the one
# measurement behind its default (one H200, N 16384, D 2048, H 5632, i.i.d. 0.3 % unless said;
# BENCHMARKS.md, "Training FFN").

_DEFAULT_CONFIG = {
    # compaction rows per program and warps: 1 row on 1 warp 0.22 ms vs 2 rows on 2 warps 0.67
    "compact_block_n": 1,
    "compact_warps": 1,  # at most compact_block_n
    # compaction columns per step (two steps' loads in flight a warp): 256 at bf16 is 16 bytes a
    # thread. Swept 64-1024 on the H200 (BENCHMARKS.md, "Second session of 2026-12-07"): wider
    # steps are slower; 128 wins on i.i.d. rows, not on heavy-tailed ones, so 256 stays until
    # timed on recorded layers. Values below 16 run as 16 (the kernel's smallest step)
    "compact_block_h": 256,
    # SDDMM slots per step, model-width chunk, warps: k8 d256 w1 0.172 ms vs k8 w4 0.222
    "sddmm_block_k": 8,
    "sddmm_block_d": 256,
    "sddmm_warps": 1,
    # SpMM slots per step for y (one weight) and dx (two): y k4 w4 0.148 ms vs k8 w8 0.193, dx k2 w4
    # 0.276 vs 0.320; the D slice per program is the whole row at D <= 2048
    "spmm_block_k": 4,
    "spmm_block_k2": 2,
    "spmm_block_d": 2048,
    "spmm_warps": 4,
    # dW entries per step (BLOCK_J x BLOCK_D accumulators per program; the warps split the
    # entries): j8 d128 w2 0.93 ms vs j16 d128 w4 1.78 (N 49152, heavy-tailed 0.5 %; BENCHMARKS.md,
    # "dW v2")
    "dw_block_j": 8,
    # 0 = auto: the widest D slice (128..1024) whose x and dy columns over all N rows fit in
    # dw_l2_bytes, D slice outermost (dw_d_outer ignored), so one slice's gathers hit L2: in the
    # 1.5B model at N 49152, 81.9 ms of dW a step vs 95.7 at d1024 (the first dW kernel;
    # BENCHMARKS.md, "Call 2")
    "dw_block_d": 0,
    "dw_l2_bytes": 16 * 2**20,  # 16 MiB (d128 at N 32768) 59.6 tok/ms vs 32 MiB (d256) 57.4 (first dW)
    "dw_warps": 2,
    # dW grid order when dw_block_d is set, 1 = D slice outermost: 0.518 vs 0.578 ms i.i.d. but
    # 0.345 vs 0.288 with hot units (N 16384, d1024; the first dW kernel)
    "dw_d_outer": 0,
    # transposing cast (transpose.py, the training op's Wd^T and dWd): tile side and warps;
    # not yet timed (the usual 64 x 64 tile; BENCHMARKS.md, "Built after the calls: the training
    # op's copies", has the prediction)
    "transpose_block": 64,
    "transpose_warps": 4,
    # dense-mode elementwise pass (dense_fwd): rows per program, columns per step, warps
    "dense_block_n": 16,
    "dense_block_h": 256,
    "dense_warps": 4,
    # row scatter-add (add_rows.py, the dense-backup rows into y and dx): columns per program,
    # warps; not yet timed
    "add_rows_block_d": 1024,
    "add_rows_warps": 4,
    # no-sync backup's overflow rows (overflow_rows.py): rows per tile, output columns per
    # tile, hidden units and model-width chunk per step, warps; a rare path, not timed (it
    # only has to cost nothing when no row overflows: one launch whose programs exit)
    "overflow_block_m": 16,
    "overflow_block_d": 128,
    "overflow_block_h": 64,
    "overflow_block_k": 64,
    "overflow_warps": 4,
}
CONFIG = dict(_DEFAULT_CONFIG)
# sizes used directly as tl.arange extents (others are rounded up to a power of 2 by _pow2)
_POW2_KEYS = ("compact_block_h", "dense_block_n", "dense_block_h", "sddmm_block_k",
              "spmm_block_k", "spmm_block_k2", "dw_block_j", "dw_block_d", "transpose_block",
              "add_rows_block_d", "overflow_block_m", "overflow_block_d", "overflow_block_h",
              "overflow_block_k")  # dw_block_d: also 0 = auto


@contextlib.contextmanager
def kernel_config(**overrides):
    """Temporarily set launch shapes (keys of ``CONFIG``), e.g. ``with kernel_config(
    spmm_block_k=8): ...``. Not thread-safe (a module-level setting, meant for benchmarks and
    tests).

    Raises:
        ValueError: an unknown key, a non-positive or non-power-of-2 size, dw_d_outer not 0 / 1.
    """
    for key, val in overrides.items():
        if key not in CONFIG:
            raise ValueError(f"kernel_config: unknown key {key!r}; known: {sorted(CONFIG)}")
        if key == "dw_d_outer":
            if val not in (0, 1):
                raise ValueError(f"kernel_config: dw_d_outer must be 0 or 1; got {val!r}")
            continue
        if key == "dw_block_d" and val == 0:  # auto
            continue
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"kernel_config: {key} must be a positive int; got {val!r}")
        if key in _POW2_KEYS and val & (val - 1):
            raise ValueError(f"kernel_config: {key} must be a power of 2 (a Triton block size); "
                             f"got {val!r}")
    saved = dict(CONFIG)
    CONFIG.update(overrides)
    try:
        yield CONFIG
    finally:
        CONFIG.clear()
        CONFIG.update(saved)


def dw_launch(n: int, d: int, row_bytes: int) -> tuple[int, bool]:
    """The dW kernel's (D slice, D-slice-outermost) for N rows of width D whose x and dy rows
    take ``row_bytes`` per element together (4 for two bf16 operands): ``CONFIG``'s
    ``dw_block_d`` / ``dw_d_outer`` when set, else (``dw_block_d=0``) the widest power-of-2
    slice in [128, 1024] (and at most D's power of 2) whose N x slice columns of x and dy fit in
    ``dw_l2_bytes`` and whose accumulators fit 96 registers a thread (``1024 dw_warps /
    dw_block_j`` columns: 256 at the defaults), outermost."""
    cap = pow2(d, 16, 1024)
    if CONFIG["dw_block_d"]:
        return pow2(d, 16, CONFIG["dw_block_d"]), bool(CONFIG["dw_d_outer"])
    fit = CONFIG["dw_l2_bytes"] // max(1, n * row_bytes)
    # three (BLOCK_J, BLOCK_D) fp32 accumulators over 32 * dw_warps threads: at most 96
    # registers a thread (3 J D <= 96 * 32 w), so a wide slice at small N does not spill
    regs = max(16, 1024 * CONFIG["dw_warps"] // CONFIG["dw_block_j"])
    block = 128
    while block * 2 <= min(fit, 1024, regs):
        block *= 2
    return min(block, cap), True


def pow2(n: int, lo: int, hi: int) -> int:
    """The power of 2 at or above ``n``, clamped to [lo, hi] (a Triton block size)."""
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def check_operand(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype | None = None) -> None:
    """Raise ValueError naming ``name`` unless ``t`` has ``shape`` (and ``dtype``) and is contiguous."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (call .contiguous())")
