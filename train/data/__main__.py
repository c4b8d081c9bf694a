"""``python -m train.data ...`` = ``twell-data ...`` (see train/data/cli.py)."""

import sys

from train.packages import use_checkout_packages

use_checkout_packages()  # a same-named folder in the current folder shadows no package

from train.data.cli import main  # after the packages are this checkout's

sys.exit(main())
