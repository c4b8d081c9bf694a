"""twell: TwELL (tile-wise ELLPACK) sparse FFN kernels and modules.

The core package. It imports neither ``train`` nor ``evals``.
"""

from twell.stats import FFNStats

__all__ = ["FFNStats"]
__version__ = "0.1.0"
