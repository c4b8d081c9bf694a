"""``python -m train.data ...`` = ``twell-data ...`` (see train/data/cli.py)."""

import sys

from train.data.cli import main

sys.exit(main())
