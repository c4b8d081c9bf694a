"""The backend of the two training ops (``twell.ops.ffn_train.sparse_ffn_train``, the ELL op,
and ``twell.ops.ffn_dense_train.dense_ffn_train``, dense mode): the choice between the Triton
kernels (:func:`triton_backend`) and their PyTorch twin (``twell.ops.reference.sparse_train_torch``,
the same names), the argument checks and casts, the statistics of the ops' outputs, and the
backward of dense rows (dense mode, and the ELL op's dense backup).

The Triton kernels, one op per file: ``compact.py`` (ReLU + ELL compaction), ``sddmm.py`` (u
forward, dh backward), ``spmm.py`` (y forward, dx backward), ``dw.py`` (weight gradients),
``elementwise.py`` (the dense rows' fused passes), ``transpose.py`` (the transposing cast of Wd
and dWd), ``add_rows.py`` (the dense rows' scatter-add into y, dx and the hot units' weight
gradients), ``overflow_rows.py`` (the forward-only no-sync backup's overflow rows); launch
shapes in ``launch.py``.

Shape legend: N tokens (R for dense rows), D model width, H FFN width, K ELL width (slots per
row), KC ELL capacity (the widest K allowed), J entries of one column in CSC order.

Layout (arXiv 2603.23198, the hybrid training layout): row n of the ELL part
holds its non-zeros in slots ``k < nnz[n]``::

    col_NK[n, k]  int32   hidden unit (column) of the k-th non-zero of row n, ascending
    g_NK[n, k]    dtype   relu(gate)[n, col] (> 0)
    u_NK[n, k]    dtype   up[n, col] = x[n] . Wu[col]

Slots ``k >= nnz[n]`` are never read (their contents are undefined). Rows with more non-zeros
than the capacity go to the dense backup (handled with cuBLAS by the caller) and have
``nnz[n] = 0`` here, so every kernel skips them.

All kernels accumulate in fp32 and index with int64 (no wrap past 2^31 elements or 65,536 tokens).
The launchers check contiguity and dtypes; the math lives in the kernel docstrings.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

from twell.ops.reference import sparse_train_torch as torch_backend
from twell.stats import FFNStats, stats_from_counts

BACKENDS = ("auto", "triton", "torch")


@functools.cache
def triton_backend() -> SimpleNamespace:
    """The Triton backend: the kernel files' launchers under the names the ops call (those of
    ``twell.ops.reference.sparse_train_torch``): ``compact``, ``compact_heavy``, ``sddmm_fwd``,
    ``sddmm_bwd``, ``spmm``, ``dw``, ``transposed``, ``backup_fwd``, ``backup_bwd``,
    ``dense_fwd``, ``add_rows``, ``overflow_rows``. One object per process (a test may wrap its
    attributes).

    Raises:
        ImportError: triton is not installed (imported here, not at module load: triton is
        optional off Linux x86_64).
    """
    from twell.ops.add_rows import add_rows
    from twell.ops.compact import compact, compact_heavy
    from twell.ops.dw import dw
    from twell.ops.elementwise import backup_bwd, backup_fwd, dense_fwd
    from twell.ops.overflow_rows import overflow_rows
    from twell.ops.sddmm import sddmm_bwd, sddmm_fwd
    from twell.ops.spmm import spmm
    from twell.ops.transpose import transposed

    return SimpleNamespace(compact=compact, compact_heavy=compact_heavy, sddmm_fwd=sddmm_fwd,
                           sddmm_bwd=sddmm_bwd, spmm=spmm, dw=dw, transposed=transposed,
                           backup_fwd=backup_fwd, backup_bwd=backup_bwd, dense_fwd=dense_fwd,
                           add_rows=add_rows, overflow_rows=overflow_rows)


def pick_backend(x: torch.Tensor, name: str):
    """The backend of a training call: the Triton kernels (:func:`triton_backend`) for CUDA
    tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (read at call time), of a float dtype
    other than float64; else the PyTorch backend (``twell.ops.reference.sparse_train_torch``).
    ``name``: "auto", "triton" (raises when unusable) or "torch".

    Raises:
        ValueError: unknown name, or "triton" where it cannot run.
    """
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {name!r}")
    if name == "torch":
        return torch_backend
    usable = x.dtype != torch.float64 and (
        x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    )
    if name == "triton" and not usable:
        raise ValueError(
            "backend='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1) of a "
            f"float dtype other than float64; got {x.device.type} {x.dtype}. Use backend='auto'."
        )
    if usable:
        try:
            return triton_backend()
        except ImportError:  # triton missing: fall back unless explicitly asked for
            if name == "triton":
                raise
            return torch_backend
    return torch_backend


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def check_train_args(x_ND, w_gate_HD, w_up_HD, w_down_DH, backend: str, fn: str) -> None:
    """Raise ValueError naming ``fn`` and the argument for a bad shape, dtype, device or backend."""
    if w_gate_HD is None:
        raise ValueError(f"{fn} needs w_gate_HD (gated FFN); use impl='torch' for the non-gated "
                         "FFN")
    if x_ND.dim() != 2:
        raise ValueError(f"{fn}: x_ND must be 2-D (N, D); got shape {tuple(x_ND.shape)}")
    d = x_ND.shape[1]
    h = w_gate_HD.shape[0]
    if w_gate_HD.shape != (h, d) or w_up_HD.shape != (h, d) or w_down_DH.shape != (d, h):
        raise ValueError(
            f"{fn}: weights must be w_gate_HD (H, D), w_up_HD (H, D), w_down_DH (D, H) with D = "
            f"{d}; got {tuple(w_gate_HD.shape)}, {tuple(w_up_HD.shape)}, {tuple(w_down_DH.shape)}"
        )
    if not x_ND.is_floating_point():
        raise ValueError(f"{fn}: x_ND must be floating point; got {x_ND.dtype}")
    devs = {t.device for t in (x_ND, w_gate_HD, w_up_HD, w_down_DH)}
    if len(devs) != 1:
        raise ValueError(f"{fn}: x and the weights must be on one device; got "
                         f"{sorted(map(str, devs))}")
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}; got {backend!r}")


def cast_train_args(x_ND, w_gate_HD, w_up_HD, w_down_DH, *, cast_weights: bool = True):
    """x and the weights in the compute dtype (autocast's, else x's), contiguous; with
    ``cast_weights=False`` the three weights are returned in their own dtype (contiguous: under
    autocast the fp32 masters themselves), for an op that casts them itself."""
    dt = _autocast_dtype(x_ND.device.type)
    if dt is None:
        dt = x_ND.dtype
    x = x_ND.to(dt).contiguous()
    ws = (w_gate_HD, w_up_HD, w_down_DH)
    return (x, *(w.to(dt).contiguous() if cast_weights else w.contiguous() for w in ws))


def stats_of(out, kc: int) -> FFNStats:
    """FFNStats of a training op's outputs (l1, nnz_N, counts_H at 1-3), heavy rows above ``kc``."""
    return stats_from_counts(out[1], out[2], out[3], kc)


def dense_rows_bwd(be, dy, scale, x, wg, wu, wd, g, u, wd_transposed: bool = False):
    """Backward of the dense FFN rows: g (relu'd or raw pre-activation) and u of those rows,
    dy their upstream gradient. Returns dx, dWg, dWu and dWd (D, H), or its transpose (H, D)
    contiguous when ``wd_transposed``."""
    dg, du, h_ = be.backup_bwd(torch.matmul(dy, wd), g, u, scale)
    dx = torch.matmul(dg, wg)
    dx.addmm_(du, wu)
    dwd = torch.matmul(h_.t(), dy) if wd_transposed else torch.matmul(dy.t(), h_)
    return dx, torch.matmul(dg.t(), x), torch.matmul(du.t(), x), dwd
