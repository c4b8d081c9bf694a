"""``python -m train`` (and ``accelerate launch -m train``): same as ``twell-train``."""

from train.main import cli

cli()
