"""Thin ``nn.Module`` wrappers around the TwELL ops, and the plan that owns their execution state."""

from twell.nn.convert import convert_mlps
from twell.nn.mlp import SparseGatedMLP
from twell.nn.plan import FFN_IMPLS, TRAIN_PATHS, FFNPlan, LayerPlan, PlanOptions, trains_ell
from twell.nn.step import StepOutcome, StepStats

__all__ = ["FFN_IMPLS", "TRAIN_PATHS", "FFNPlan", "LayerPlan", "PlanOptions", "SparseGatedMLP",
           "StepOutcome", "StepStats", "convert_mlps", "trains_ell"]
