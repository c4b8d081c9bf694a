"""PyTorch references: the dense FFN and the TwELL FFN (``ffn.py``), and the PyTorch backend of the
sparse training ops (``sparse_train_torch.py``)."""

from twell.ops.reference.ffn import gated_ffn_torch, twell_ffn_torch

__all__ = ["gated_ffn_torch", "twell_ffn_torch"]
