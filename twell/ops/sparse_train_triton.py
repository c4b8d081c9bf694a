"""The Triton backend of the sparse training ops: the kernel files' launchers under the names the
ops call (``twell.ops.reference.sparse_train_torch``, the PyTorch backend, has the same names).

One op per file: ``compact.py`` (ReLU + ELL compaction), ``sddmm.py`` (u forward, dh backward),
``spmm.py`` (y forward, dx backward), ``dw.py`` (weight gradients), ``elementwise.py`` (the dense
rows' fused passes); launch shapes in ``launch.py``.

Shape legend: N tokens, D model width, H FFN width, K ELL width (slots per row), KC ELL
capacity (the widest K allowed), J entries of one column in CSC order.

Layout (arXiv 2603.23198, the hybrid training layout): row n of the ELL part
holds its non-zeros in slots ``k < nnz[n]``::

    col_NK[n, k]  int32   hidden unit (column) of the k-th non-zero of row n, ascending
    g_NK[n, k]    dtype   relu(gate)[n, col] (> 0)
    u_NK[n, k]    dtype   up[n, col] = x[n] . Wu[col]

Slots ``k >= nnz[n]`` are never read (their contents are undefined). Rows with more non-zeros
than the capacity go to the dense backup (handled with cuBLAS by the caller) and have
``nnz[n] = 0`` here, so every kernel below skips them.

All kernels accumulate in fp32 and index with int64 (no wrap past 2^31 elements or 65,536 tokens).
The launchers check contiguity and dtypes; the math lives in the kernel docstrings.
"""

from twell.ops.compact import compact, compact_heavy  # noqa: F401
from twell.ops.dw import dw  # noqa: F401
from twell.ops.elementwise import backup_bwd, backup_fwd, dense_fwd  # noqa: F401
from twell.ops.launch import CONFIG, kernel_config  # noqa: F401
from twell.ops.sddmm import sddmm_bwd, sddmm_fwd  # noqa: F401
from twell.ops.spmm import spmm  # noqa: F401
