"""Thin ``nn.Module`` wrappers around the TwELL ops."""

from twell.nn.mlp import FFN_IMPLS, SparseGatedMLP
from twell.nn.convert import convert_mlps

__all__ = ["FFN_IMPLS", "SparseGatedMLP", "convert_mlps"]
