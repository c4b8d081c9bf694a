#!/usr/bin/env python
"""The whole-model benchmark: the fastest way to train a framework-made sparse model on a card,
per path (plain transformers, transformers + Liger-Kernel, torch.compile, our dense path, ELL,
auto, and what ``experiment=paper_*`` picks by itself), per memory budget. A thin driver over ``studies.bench`` (what each stage does: its module
docstrings; the commands for a bare GPU machine: docs/model_bench/README.md).

    # one H200: bench the 1.5B model the scaling study left in this call (~5.5 min)
    python scripts/bench_model.py --sizes 1p5b --model-from /tmp/runs/1p5b_l1_3e-4/checkpoints/step200 \\
        --out "$OUT" --config data.build_if_missing=false
    # train the bench model here instead (stage 1: 200 steps at a fixed L1 aimed at the paper's L0)
    python scripts/bench_model.py --sizes 2b --train-steps 300 --until-settled --out "$OUT"
    # CPU smoke run (tiny shape, fp32, synthetic tokens, fake memory; tests/e2e/test_bench_model.py;
    # without --out and $OUT its outputs go to a new temporary folder, printed at the start)
    python scripts/bench_model.py --smoke --out /tmp/bm
    # merge several calls' outputs (1.5B from one call, 2B from another) on the CPU
    python scripts/bench_model.py --report out_1p5b out_2b --out docs/model_bench

Exit status 0 when every size ran, 1 when a size (or a forward or a budget's stage of one)
failed or the deadline left a size out (the outputs keep what succeeded; the last line on stderr
names what failed), 2 for bad input.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from studies.bench import PATHS, BenchSettings, Recipe, SettleRule, parse_budgets, run_bench
from studies.bench.recipe import PAPER_L0, PROFILE_PATHS, SMOKE_SIZE, check_config, check_overrides
from studies.bench.report import merge_runs

# seconds for a run on the device machine (one call, outputs included): --deadline's default
# (--smoke: 600); the library itself sets no limit
DEADLINE_S = 330.0


def _at_least_one(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse names the option in its one-line error)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return n


SIZES_DEFAULT = "1p5b"
UNSET = object()  # --target-l0 not given (None is its "none")


def _target_l0(text: str) -> float | str | None:
    """``--target-l0``: ``paper``, ``none`` or a number > 0."""
    if text in ("paper", "none"):
        return None if text == "none" else text
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not paper, none or a number > 0")
    return v


def _stage1_args(p: argparse.ArgumentParser) -> None:
    """The options of stage 1, the bench model trained in the run (:class:`Recipe`)."""
    p.add_argument("--train-steps", type=_at_least_one, default=None,
                   help="stage-1 steps (the most)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="stage 1 bitwise reproducible (trainer.deterministic; ~11 %% slower)")
    p.add_argument("--until-settled", action="store_true",
                   help="stop stage 1 once L0 moves < --settle-tolerance over --settle-window")
    p.add_argument("--settle-window", type=_at_least_one, default=50, help="steps (default 50)")
    p.add_argument("--settle-tolerance", type=float, default=0.05, help="relative (0.05)")
    p.add_argument("--target-l0", type=_target_l0, default=UNSET,
                   help="steer the stage-1 L1 coefficient from 30 %% of its steps to hold this "
                        "training L0: paper (29 at 1p5b, 24 at 2b; no other size), a number > 0, "
                        "or none "
                        "(default: the fixed --l1)")
    p.add_argument("--train-budget", type=float, default=None,
                   help="stage-1 seconds (default 0.45 x --deadline)")
    p.add_argument("--l1", type=float, default=None,
                   help="stage-1 sparsity.l1_coeff (default per size: 3.2e-4 at 1p5b, "
                        "3.45e-4 at 2b, else 3e-4)")
    p.add_argument("--lr", type=float, default=None, help="stage-1 optim.lr")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n")[0].split()))
    p.add_argument("--sizes", default=None,
                   help=f"model shapes, comma-separated (configs/model; {SIZES_DEFAULT})")
    p.add_argument("--paths", default=",".join(PATHS), help=f"paths to time ({','.join(PATHS)})")
    p.add_argument("--budgets", default="80,139",
                   help="cards in GiB, in timing order (139 = the H200; 80 = emulated)")
    p.add_argument("--model-from", type=Path, default=None, metavar="CKPT",
                   help="bench this trainer checkpoint (step{N} folder) instead of training")
    _stage1_args(p)
    p.add_argument("--steps", type=_at_least_one, default=None, help="timed steps per row (50)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (3)")
    p.add_argument("--search-batch", type=_at_least_one, default=None,
                   help="the search tries micro-batches ceil(N / a), a = 1, 2, ... (512)")
    p.add_argument("--saturation-tokens", type=int, default=None,
                   help="heavier recomputation only below this many tokens (16384; 0: all)")
    p.add_argument("--equal-micro", type=_at_least_one, default=None,
                   help="micro-batch of the equal-micro-batch memory ratio (8)")
    p.add_argument("--acts-dir", type=Path, default=None,
                   help="record the lowest / median / highest-L0 layers' FFN inputs here")
    p.add_argument("--acts-tokens", type=_at_least_one, default=16384, help="tokens per recorded layer")
    p.add_argument("--deadline", type=float, default=None,
                   help=f"seconds for the run ({DEADLINE_S:.0f}; --smoke: 600)")
    p.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE",
                   help="Hydra overrides for stage 1 and our trainer (e.g. data.cache_dir=...)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder ($OUT, else docs/model_bench; --smoke: $OUT, else a new "
                        "temporary folder)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="trainer run folders, kept (default: a temporary folder, removed at "
                        "the end unless --save-model)")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="no PNGs")
    p.add_argument("--profile-micro", default="", metavar="M,...",
                   help="profile one step of each --profile-paths at these micro-batches "
                        "first (torch.profiler, op families; CUDA only)")
    p.add_argument("--profile-paths", default=",".join(PROFILE_PATHS),
                   help=f"paths to profile ({','.join(PROFILE_PATHS)})")
    p.add_argument("--profile-only", action="store_true",
                   help="profile, then stop (with --profile-forward: the forward and its "
                        "profile, then stop)")
    p.add_argument("--profile-forward", action="store_true",
                   help="after the forward stage, profile one forward of each inference impl "
                        "it timed (torch, liger, twell, auto...; torch.profiler, CUDA only): "
                        "forward_profile_<size>.md / .csv in --out, GPU time by op family and "
                        "the longest kernels by name (calls, total ms, mean us)")
    p.add_argument("--save-model", action="store_true",
                   help="keep the bench model trained here as a checkpoint under --work-dir "
                        "(<size>_stage1/checkpoints/step<N>) for a later --model-from")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (tests)")
    p.add_argument("--report", type=Path, nargs="+", default=None, metavar="DIR",
                   help="only merge these runs' outputs into --out (CPU)")
    a = p.parse_args(argv)
    a.out_is_temp = a.out is None and a.smoke and not os.environ.get("OUT")
    if a.out is None:
        a.out = default_out(a.smoke)
    return a


def default_out(smoke: bool) -> Path:
    """The output folder without ``--out``: ``$OUT`` where set, else ``docs/model_bench`` (the
    committed results), except for ``--smoke``, whose tiny numbers must not overwrite those:
    a new temporary folder (printed, and kept for the user to read)."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    if smoke:
        out = Path(tempfile.mkdtemp(prefix="bench_model_smoke_out_"))
        print(f"--smoke without --out: outputs go to {out}", flush=True)
        return out
    return Path("docs/model_bench")


def _micro_batches(text: str) -> tuple[int, ...]:
    """``--profile-micro``'s comma-separated micro-batches.

    Raises:
        ValueError: an item that is not an integer >= 1 (one line naming it).
    """
    out = []
    for x in filter(None, text.split(",")):
        if not x.strip().isdigit() or int(x) < 1:
            raise ValueError(f"--profile-micro: {x!r} is not a micro-batch (an integer >= 1)")
        out.append(int(x))
    return tuple(out)


def settings(a: argparse.Namespace) -> BenchSettings:
    """The :class:`studies.bench.BenchSettings` of the command line (``--smoke``: its own
    defaults, the options given on top).

    Raises:
        ValueError: an option the run would ignore: ``--sizes`` with ``--smoke`` (one tiny shape
            of its own), or a stage-1 option with ``--model-from`` (nothing is trained).
    """
    check_config(a.config)
    given = {k: v for k, v in {
        "steps": a.steps, "warmup": a.warmup, "candidate_batch": a.search_batch,
        "saturation_tokens": a.saturation_tokens, "equal_micro": a.equal_micro,
        "deadline_s": a.deadline}.items() if v is not None}
    common = {"paths": tuple(x for x in a.paths.split(",") if x),
              "budgets": parse_budgets(a.budgets), "model_from": a.model_from,
              "train_budget_s": a.train_budget, "config": list(a.config),
              "work_dir": a.work_dir, "plots": a.plots, "acts_dir": a.acts_dir,
              "acts_tokens": a.acts_tokens,
              "profile_micro": _micro_batches(a.profile_micro),
              "profile_paths": tuple(x for x in a.profile_paths.split(",") if x),
              "profile_only": a.profile_only, "profile_forward": a.profile_forward,
              "save_model": a.save_model,
              "settle": SettleRule(a.until_settled, a.settle_window, a.settle_tolerance),
              **given}
    given = {"l1": a.l1, "lr": a.lr, "steps": a.train_steps, "deterministic": a.deterministic,
             "target_l0": a.target_l0}  # the recipe options given (the rest: the recipe's own)
    recipe = {k: v for k, v in given.items() if v is not (UNSET if k == "target_l0" else None)}
    if a.model_from is not None:  # nothing is trained: a stage-1 option would be ignored
        flags = {"l1": "--l1", "lr": "--lr", "steps": "--train-steps", "target_l0": "--target-l0",
                 "deterministic": "--deterministic" if a.deterministic else "--no-deterministic"}
        named = [flags[k] for k in recipe] + [f for f, on in (
            ("--until-settled", a.until_settled), ("--train-budget", a.train_budget is not None),
            ("--save-model", a.save_model)) if on]
        if named:
            raise ValueError(f"{named[0]} with --model-from: the checkpoint is benched as it is "
                             f"and stage 1 trains nothing; drop {named[0]}")
    no_paper = [s for s in ([SMOKE_SIZE] if a.smoke else (a.sizes or SIZES_DEFAULT).split(","))
                if s and s not in PAPER_L0]
    if a.target_l0 == "paper" and no_paper:
        raise ValueError(f"--target-l0 paper: the paper gives no L0 for size {no_paper[0]} (it "
                         f"does for {', '.join(PAPER_L0)}); give a number or leave --target-l0 "
                         "out")
    if a.smoke:  # the smoke's own recipe, with the options given on top
        if a.sizes is not None:
            raise ValueError(f"--sizes {a.sizes}: --smoke runs its tiny shape only; leave "
                             "--sizes out (or --smoke out for a paper size)")
        return BenchSettings.for_smoke(a.out, recipe=recipe, **common)
    sizes = (SIZES_DEFAULT if a.sizes is None else a.sizes).split(",")
    return BenchSettings(sizes=[x for x in sizes if x], recipe=Recipe(**recipe), out=a.out,
                         **{"deadline_s": DEADLINE_S, **common})


def main(argv=None) -> int:
    # before the first CUDA allocation: fewer fragments between the emulated card's limit and
    # the peak (the 80 GB card's search choice for dense and auto ran out of memory while timing
    # at a predicted 73.3 GB; BENCHMARKS.md, "Next")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    a = parse_args(argv)
    try:
        if a.report is not None:
            print(merge_runs(a.report, a.out, plot=a.plots,
                             **({"equal_micro": a.equal_micro} if a.equal_micro else {})))
            return 0
        s = settings(a)
        check_overrides(s.sizes, s.recipe, s.config, search_batch=s.search_batch, smoke=s.smoke,
                        model_from=s.model_from)
        if not s.smoke and not torch.cuda.is_available():  # the model in fp32 on the CPU: OOM
            raise ValueError(f"--sizes {','.join(s.sizes)} needs a CUDA GPU and there is none "
                             "here; pass --smoke for the tiny CPU run (--report merges outputs "
                             "on the CPU)")
        if not s.smoke:
            from studies.bench.search import check_budgets_fit

            check_budgets_fit(s.budgets, torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30)
    except (ValueError, FileNotFoundError) as e:  # one line, exit code 2 (bad input)
        print(f"bench_model: {e}", file=sys.stderr)
        if a.out_is_temp:  # the smoke's output folder, still empty
            shutil.rmtree(a.out, ignore_errors=True)
        return 2
    res = run_bench(s)
    print(res.table)
    print(f"outputs: {s.out}")
    if res.failed:  # the rows that ran are written; the exit status says not all are there
        print(f"bench_model: {len(res.failed)} FAILED (the outputs keep what succeeded): "
              f"{'; '.join(res.failed)}"[:2000], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
