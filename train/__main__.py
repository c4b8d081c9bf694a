"""``python -m train`` (and ``accelerate launch -m train``): same as ``twell-train``."""

from train.packages import use_checkout_packages

use_checkout_packages()  # a same-named folder in the current folder shadows no package

from train.main import cli  # after the packages are this checkout's

cli()
