#!/usr/bin/env python
"""docs/relufy.md, its plots and docs/relufy/results.csv from the results of
scripts/relufy_study.py (runs on a CPU; the library is studies/relufy_report.py).

    python scripts/relufy_report.py OUT --doc docs/relufy.md   # OUT = the study's --out
    python scripts/relufy_report.py --pending --doc docs/relufy.md  # no results yet

Whatever rows OUT has scored are reported (a partial study gives a partial table; the targets
it cannot decide yet are "pending"). The hand-written findings block of an existing --doc is
kept.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from studies.jobs import ROOT
from studies.relufy_report import write_report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="?", type=Path, help="the study's --out folder")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "relufy.md")
    p.add_argument("--pending", action="store_true", help="write the version without results")
    a = p.parse_args(argv)
    if a.pending == (a.results is not None):
        p.error("give the study's --out folder, or --pending")
    try:
        write_report(None if a.pending else a.results, a.doc)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    print(f"wrote {a.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
