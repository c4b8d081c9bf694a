"""Training ops of the ReLU-gated FFN: the public entry points of the ``ell`` and ``dense``
training paths (``twell.nn.plan.TRAIN_PATHS``).

    sparse_ffn_train   ell: hybrid ELL + dense backup, forward and backward
                       (``twell/ops/ffn_train.py``)
    dense_ffn_train    dense mode: cuBLAS + one fused elementwise pass each way
                       (``twell/ops/ffn_dense_train.py``)
    backup_capacity_for, train_path_for_density, default_ell_capacity

Math, saved tensors and host synchronisation: ``twell.ops.ffn_train``. The kernels: one op per
file (``compact.py``, ``sddmm.py``, ``spmm.py``, ``dw.py``, ``elementwise.py``; the Triton backend
``sparse_train_triton.py``), their PyTorch backend ``twell/ops/reference/sparse_train_torch.py``.
Source: arXiv 2603.23198, the hybrid ELL + dense-backup training layout.
"""

from __future__ import annotations

from twell.ops.ffn_dense_train import dense_ffn_train
from twell.ops.ffn_train import backup_capacity_for, sparse_ffn_train
from twell.policy import FFNPolicy
from twell.stats import DEFAULT_MAX_ROW_DENSITY, default_ell_capacity


def train_path_for_density(density: float, heavy_fraction: float = 0.0,
                           policy: FFNPolicy | None = None) -> str:
    """Path of ``impl="auto"`` in training for a layer of measured density (L0 / H) and
    heavy-row fraction: :meth:`twell.policy.FFNPolicy.train_path` of ``policy`` (default: the
    defaults). Returns ``"ell"`` (:func:`sparse_ffn_train`) or ``"dense"``
    (:func:`dense_ffn_train`).

    Raises:
        ValueError: density or heavy_fraction outside [0, 1] or NaN.
    """
    return (policy if policy is not None else FFNPolicy()).train_path(density, heavy_fraction)


__all__ = ["DEFAULT_MAX_ROW_DENSITY", "backup_capacity_for", "default_ell_capacity",
           "dense_ffn_train", "sparse_ffn_train", "train_path_for_density"]
