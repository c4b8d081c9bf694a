#!/usr/bin/env python
"""The scaling-of-sparsity study at the paper's sizes, one GPU call at a time (train.scaling).

    # one H200 call: train 1.5B at L1 3e-4, profile it, write $OUT/1p5b_l1_3e-4.json; the
    # checkpoint stays in /tmp/runs/1p5b_l1_3e-4/checkpoints/step200/ (printed)
    python scripts/scaling_study.py --sizes 1p5b --l1 3e-4 --out $OUT --runs-dir /tmp/runs \\
        --max-wall 540 data.cache_dir=/tmp/twc/corpus data.build_if_missing=false
    # the whole default study, call after call (rows with a result in --out or --skip-results
    # are skipped; the plan and its estimated GPU seconds are printed first)
    python scripts/scaling_study.py --reinit --out $OUT --runs-dir /tmp/runs --max-wall 540 \\
        --skip-results docs/scaling/results data.cache_dir=... data.build_if_missing=false
    python scripts/scaling_study.py --reinit --dry-run          # only the plan and the estimate
    # CPU smoke run (tiny shapes, 4 steps; what tests/train/test_scaling.py runs)
    python scripts/scaling_study.py --cpu --smoke --sizes 0p5b,1b --l1 0.5 --out /tmp/s/out \\
        --runs-dir /tmp/s/runs data=tokens data.paths=[tok.bin] data.vocab_size=64 ...
    # merge the result folders of several calls, write docs/scaling/ and rewrite the doc
    python scripts/scaling_study.py --report DIR1 DIR2 ... --doc docs/scaling.md

Rows: every size x every L1 strength (``sparsity=l1``); ``--reinit`` adds the
``sparsity=l1_reinit`` twin of each ``--reinit-sizes`` row. Each row trains from scratch on the
same tokens (``--tokens``; default 200 steps x 8 x 2048 = 3,276,800, the recipe of
``scripts/bench_model.py``'s bench model), is profiled on held-out blocks and leaves
``<out>/<row>.json``. The default order puts the most informative rows first
(:func:`train.scaling.plan_rows`). Extra ``key=value`` arguments are Hydra overrides for every
row. Exit code 0 when every row is done or skipped, 1 otherwise.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from train.scaling import KEEP, PAPER_SIZES, StudySettings, plan_rows, plan_text, result_names


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=_names, default=list(PAPER_SIZES),
                   help="model configs (configs/model), comma-separated")
    p.add_argument("--l1", type=_floats, default=[3e-4, 1e-4],
                   help="L1 coefficients (sparsity.l1_coeff), comma-separated")
    p.add_argument("--reinit", action="store_true",
                   help="add the sparsity=l1_reinit twin of each --reinit-sizes row")
    p.add_argument("--reinit-sizes", type=_names, default=["1p5b"],
                   help="sizes of the re-init rows (those of them among --sizes)")
    p.add_argument("--tokens", type=int, default=None,
                   help="training tokens per row (default 3,276,800; smoke 256)")
    p.add_argument("--dead-window-tokens", type=int, default=None,
                   help="sparsity.dead_window_tokens (default 1,048,576: the paper's window)")
    p.add_argument("--profile-tokens", type=int, default=None,
                   help="held-out tokens profiled per row (default 262,144)")
    p.add_argument("--ffn-impl", default=None, help="model.ffn_impl (default auto; smoke torch)")
    p.add_argument("--seed", type=int, default=None, help="seed of every row (default 42)")
    p.add_argument("--keep", choices=KEEP, default="full",
                   help="what stays of a finished row's checkpoint (weights: no optimizer state)")
    p.add_argument("--out", type=Path, default=None, help="result files (<row>.json)")
    p.add_argument("--runs-dir", type=Path, default=Path("runs/scaling"),
                   help="run directories (<row>/, with checkpoints/step{N}/)")
    p.add_argument("--skip-results", type=Path, nargs="*", default=[],
                   help="folders of earlier result files: their rows are skipped")
    p.add_argument("--max-wall", type=float, default=540.0,
                   help="seconds for this invocation; a row that would not fit is not started")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the estimate only")
    p.add_argument("--cpu", action="store_true", help="train and profile on the CPU")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and steps (tests)")
    p.add_argument("--report", type=Path, nargs="+", default=None, metavar="DIR",
                   help="merge these result folders and rewrite --doc (no training)")
    p.add_argument("--doc", type=Path, default=Path("docs/scaling.md"),
                   help="the page --report rewrites (plots, runs.csv, results/ beside it)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every row (key=value)")
    a = p.parse_args(argv)
    if a.report is None and a.out is None and not a.dry_run:
        p.error("--out is required (the folder of result files)")
    if a.smoke and not a.cpu:
        p.error("--smoke runs on the CPU; add --cpu")
    return a


def free_gb(path: Path) -> float | None:
    """Free disk space at ``path`` (its nearest existing parent), GB."""
    for p in (path, *path.resolve().parents):
        if p.exists():
            return shutil.disk_usage(p).free / 1e9
    return None


def settings(a) -> StudySettings:
    given = {"tokens": a.tokens, "dead_window_tokens": a.dead_window_tokens,
             "profile_tokens": a.profile_tokens, "ffn_impl": a.ffn_impl, "seed": a.seed}
    kw = {k: v for k, v in given.items() if v is not None}
    kw.update(keep=a.keep, cpu=a.cpu, overrides=list(a.overrides))
    return StudySettings.for_smoke(**kw) if a.smoke else StudySettings(**kw)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.report is not None:
        from train.scaling_report import write_report

        res = write_report(a.report, a.doc, command="python scripts/scaling_study.py --report "
                           + " ".join(str(d) for d in a.report) + f" --doc {a.doc}")
        for t in res["targets"]:
            print(f"{t['target']}: {t['measured']} -> {t['verdict']}")
        print(f"wrote {res['doc']}, {res['csv']}, results in {res['results']}")
        return 0
    try:
        s = settings(a)
        rows = plan_rows(a.sizes, a.l1, [x for x in a.reinit_sizes if x in a.sizes]
                         if a.reinit else [])
    except ValueError as e:
        print(f"scaling_study: {e}", file=sys.stderr)
        return 2
    skip = result_names([d for d in (a.out, *a.skip_results) if d is not None])
    print(plan_text(rows, s, skip, free_gb=free_gb(a.runs_dir)), flush=True)
    if a.dry_run:
        return 0
    from train.scaling import run_study

    t0 = time.monotonic()
    outcomes = run_study(rows, s, out=a.out, runs_dir=a.runs_dir, max_wall=a.max_wall,
                         skip_results=a.skip_results,
                         log=lambda m: print(f"[{time.monotonic() - t0:6.1f}s] {m}", flush=True))
    print()
    for o in outcomes:
        print(f"{o.row.name:24s} {o.status:14s} {o.checkpoint or ''}")
    return 0 if all(o.status in ("done", "skipped") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
