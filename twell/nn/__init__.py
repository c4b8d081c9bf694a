"""Thin ``nn.Module`` wrappers around the TwELL ops."""

from twell.nn.convert import convert_mlps
from twell.nn.mlp import FFN_IMPLS, SparseGatedMLP

__all__ = ["FFN_IMPLS", "SparseGatedMLP", "convert_mlps"]
