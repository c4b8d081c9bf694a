#!/usr/bin/env python
"""Does training through the TwELL kernels (``ffn.impl=twell``) follow the dense PyTorch
path (``torch``)? Three runs of the trainer CLI from the same seed on the same data, one verdict.

Requirement checked: "a small model trained 300 steps on the real corpus with ffn_impl=twell and
with ffn_impl=torch from the same seed: loss curves agree within bf16 noise (report the max
difference), final L0 within 5 %, dead-neuron counts equal within 1 %."

    # on one H200 (bf16 autocast; the corpus cache already built; ~3 runs one after another)
    python scripts/compare_ffn_paths.py --out "$OUT" \\
        model=small_l4 trainer=gpu trainer.global_batch=16 trainer.micro_batch=16 \\
        optim=adamw optim.warmup_steps=30 \\
        data.cache_dir=/path/to/cache/corpus data.build_if_missing=false eval=disabled
    # CPU smoke test (tiny model on a synthetic token file, 8 steps; what the tests run; its
    # runs go to a new temporary folder unless --runs-dir is given)
    python scripts/compare_ffn_paths.py --smoke --out /tmp/cmp

The runs (``python -m train`` through ``studies.jobs``, one after another, each in
``--runs-dir/<name>``; every extra ``key=value`` argument is a Hydra override passed to all
three, in the same position; ``studies.ffn_compare`` plans and judges them):

    A  ffn.impl=torch                              the reference
    B  ffn.impl=torch, trainer.micro_batch halved  the same math with twice the gradient
                                                         accumulation: another reduction order
                                                         and bf16 rounding -- the noise baseline
    C  ffn.impl=twell                              the sparse training kernels (ell)

The script sets ``trainer.max_steps`` (``--steps``), ``trainer.log_every=1`` (every step is
logged to ``metrics.jsonl``), ``trainer.resume=never`` and ``hydra.run.dir``; it defaults
``eval=disabled``, ``logging.wandb_mode=disabled``, ``trainer.progress=false`` and
``trainer.val_every=0`` (validation at the end only), which the extra overrides may change.
With ``trainer.global_batch == trainer.micro_batch``, A and C take one micro-step per optimizer
step and B two (gradient accumulation 2). Use an even micro-batch (it is halved for B).
Size of the GPU command above: 300 steps x 16 x 1024 = 4.9 M tokens per run (small_l4: 4
layers, width 768, FFN 2048, 28 M non-embedding parameters): 35-39 s per run on one H200
(compare_ffn.md in docs/bench/run10.tar.xz). Without the two batch overrides ``trainer=gpu``
means 512 sequences per step (157 M tokens per run) and accumulation 64 vs 128.

Criteria (each printed as a PASS/FAIL line; the numbers come from the runs' ``metrics.jsonl``):

* loss within bf16 noise: ``max_t |loss_A(t) - loss_C(t)| <= 2 x max_t |loss_A(t) - loss_B(t)|``
  over every logged step t (loss = CE + l1_coeff x L1, the logged training loss of the step).
  Also printed: the ratio of the two maxima and both maxima over the last 50 steps.
* final L0 within 5 %: ``|L0_C - L0_A| / L0_A <= 0.05``, L0 = the mean over the last 50 logged
  steps of ``l0_mean`` (mean over layers of the active FFN units per token). One step's L0 is a
  one-batch estimate: on one H200 (small_l4, L1 3e-4, 300 steps) two torch runs from the same
  seed (A and B) differed by up to 10.5 % at single steps of the last 100 but by 2.0 % in their
  last-50-step means. The last step's values are reported too (``l0_last``).
* dead neurons within 1 %: ``|dead_C - dead_A| <= 0.01 x num_layers x intermediate_size``,
  dead = units inactive on every token of the last closed window (the last step's
  ``dead_layers`` fractions x intermediate_size, summed over layers).

What it prints: one line per run as it finishes (wall-clock seconds), then a table (run,
ffn_impl, micro-batch, accumulation, steps, final loss, final L0, dead units, val loss,
tokens/s, wall s), the loss-difference lines and the three PASS/FAIL lines, and writes
``compare_ffn.json`` (everything, with the per-step curves) and ``compare_ffn.md`` to ``--out``.
Exit status: 0 all PASS, 1 a criterion FAILed, 2 a run failed or the configuration was refused.

``--smoke``: ``data=tokens`` on a generated learnable token stream (vocab 64), a 2-layer model
of width 32 (FFN 64), L1 0.05, 8 x 32 tokens per step, micro-batch 8 (B: 4), CPU, fp32, 8 steps
by default (~15 s on 2 cores). Its runs are started without ``TRITON_INTERPRET`` so the twell
run uses the PyTorch backend of the same sparse math (the Triton interpreter takes minutes; the kernels have their
own tests). In fp32 the loss criterion compares rounding noise with rounding noise, so a smoke
FAIL of that line says little; on the GPU it is the bf16 comparison the requirement asks for.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from studies.ffn_compare import (
    SMOKE_OVERRIDES,
    check_plan,
    compare_runs,
    curves,
    diff_lines,
    json_safe,
    load_run_data,
    markdown,
    split_steps,
    summary_rows,
    text_table,
    write_smoke_tokens,
)
from studies.jobs import ROOT, Job, run_jobs, train_command
from train.config import ConfigError


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps of every run (default 300; --smoke: 8; or the "
                        "trainer.max_steps override if one is given)")
    p.add_argument("--out", type=Path, required=True,
                   help="output folder: compare_ffn.json, compare_ffn.md")
    p.add_argument("--runs-dir", type=Path, default=None,
                   help="where the three run directories and logs go (must be empty or new; "
                        "default runs/compare_ffn/<date-time>; --smoke: a new temporary "
                        "folder)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model on a synthetic token file, CPU, fp32 (tests / CI)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (key=value)")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a.overrides, a.steps = split_steps(a.overrides, a.steps, smoke=a.smoke)
    except ValueError as e:
        p.error(str(e))
    return a


def default_runs_dir(smoke: bool) -> Path:
    """The runs' folder without ``--runs-dir``: ``runs/compare_ffn/<date-time>`` in the
    checkout, or for ``--smoke`` a new temporary folder (so a smoke leaves the checkout as it
    was; the folder is printed with the setup line and kept: the runs' logs and metrics)."""
    if smoke:
        return Path(tempfile.mkdtemp(prefix="compare_ffn_smoke_"))
    return ROOT / "runs" / "compare_ffn" / time.strftime("%Y-%m-%d_%H-%M-%S")


def _log_tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def main(argv=None) -> int:
    """Run the three FFN paths on the same tokens and compare them; 0 when every criterion
    passed, 1 when one failed, 2 for a bad configuration, a non-empty --runs-dir or no
    comparison (a run failed or its files do not read)."""
    a = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    runs_dir = a.runs_dir or default_runs_dir(a.smoke)
    if runs_dir.exists() and any(runs_dir.iterdir()):
        print(f"--runs-dir {runs_dir} is not empty; pick a new one", file=sys.stderr)
        return 2
    runs_dir.mkdir(parents=True, exist_ok=True)
    user, env = _user_overrides(a, runs_dir)
    try:  # refuse a bad configuration before the first run starts
        cfg, specs, accum = check_plan(user, a.steps)
    except ConfigError as e:
        print(f"ConfigError: {e}", file=sys.stderr)
        if a.runs_dir is None and a.smoke:  # the smoke's temporary folder: only its tokens
            shutil.rmtree(runs_dir, ignore_errors=True)
        return 2
    _print_setup(cfg, runs_dir, a.steps)
    jobs = _run_specs(specs, accum, runs_dir, env)
    a.out.mkdir(parents=True, exist_ok=True)
    meta = _meta(a, started, runs_dir, user, specs, accum, jobs)
    runs, result, error = _compare(specs, accum, jobs, runs_dir, meta)
    if error is not None:
        (a.out / "compare_ffn.json").write_text(json.dumps(json_safe(
            {"meta": meta, "error": error}), indent=1))
        print(f"no comparison: {error}", file=sys.stderr)
        return 2
    doc = {"meta": meta, "result": result, "table": summary_rows(runs), "curves": curves(runs)}
    (a.out / "compare_ffn.json").write_text(json.dumps(json_safe(doc), indent=1))
    (a.out / "compare_ffn.md").write_text(markdown(result, runs, meta))
    _print_result(result, runs, a.out)
    return 0 if result["passed"] else 1


def _user_overrides(a: argparse.Namespace, runs_dir: Path) -> tuple[list[str], dict]:
    """The overrides every run gets and the runs' environment (the smoke run: its token file
    written into ``runs_dir``, the PyTorch backend of the sparse math)."""
    user, env = list(a.overrides), {}
    if a.smoke:
        tokens = write_smoke_tokens(runs_dir / "smoke_tokens.bin")
        user = [*SMOKE_OVERRIDES, f"data.paths=[{tokens}]", *user]
        env["TRITON_INTERPRET"] = None  # twell: the PyTorch backend of the sparse math
    return user, env


def _print_setup(cfg, runs_dir: Path, steps: int) -> None:
    """One line: the runs, their steps, batch, model and precision."""
    print(f"runs dir {runs_dir}: 3 runs x {steps} steps, global batch "
          f"{cfg.trainer.global_batch} x {cfg.model.seq_len} tokens, model {cfg.model.name} "
          f"({cfg.model.num_layers} layers, FFN {cfg.model.intermediate_size}), precision "
          f"{cfg.trainer.precision}"
          + (" (bf16 on a GPU, fp32 on CPU)" if cfg.trainer.precision == "auto" else "")
          + f", seed {cfg.trainer.seed}", flush=True)


def _run_specs(specs, accum: dict, runs_dir: Path, env: dict) -> dict[str, Job]:
    """Train the runs one after another (each a subprocess); name -> its finished :class:`Job`."""
    jobs = {}
    for s in specs:
        print(f"{s.name}: ffn.impl={s.ffn_impl} trainer.micro_batch={s.micro_batch} "
              f"(accumulation {accum[s.name]}) ...", flush=True)
        job = Job(s.name, train_command(s.overrides, runs_dir / s.name),
                  run_dir=runs_dir / s.name, env=env)
        run_jobs([job])
        jobs[s.name] = job
        state = "done" if job.ok else f"FAILED (exit {job.rc}; log {job.log_path})"
        print(f"{s.name}: {state} in {job.wall_s:.1f} s wall-clock", flush=True)
    return jobs


def _meta(a: argparse.Namespace, started: str, runs_dir: Path, user: list[str], specs,
          accum: dict, jobs: dict) -> dict:
    """The comparison's provenance: arguments, overrides and each run's command and outcome."""
    return {"started": started, "argv": a.argv, "steps": a.steps, "runs_dir": str(runs_dir),
            "overrides": user, "smoke": a.smoke,
            "triton_interpret": None if a.smoke else os.environ.get("TRITON_INTERPRET"),
            "runs": [{"name": s.name, "ffn_impl": s.ffn_impl, "micro_batch": s.micro_batch,
                      "accum": accum[s.name], "rc": jobs[s.name].rc,
                      "wall_s": jobs[s.name].wall_s,
                      "command": ["python", "-m", "train", *s.overrides,
                                  f"hydra.run.dir={runs_dir / s.name}"]} for s in specs]}


def _compare(specs, accum: dict, jobs: dict, runs_dir: Path, meta: dict):
    """(runs, result, error): the runs' data and their comparison, or the error that stopped it
    (a failed run's log tail is added to ``meta`` and printed)."""
    failed = [s for s in specs if not jobs[s.name].ok]
    runs, result, error = [], None, None
    if not failed:
        try:
            runs = [load_run_data(s, runs_dir, accum[s.name], jobs[s.name].wall_s)
                    for s in specs]
            result = compare_runs(*runs)
        except (ValueError, OSError) as e:  # studies.report.ReportError is a ValueError
            error = str(e)
    else:
        error = "run(s) failed: " + ", ".join(s.name for s in failed)
        for s, rec in zip(specs, meta["runs"]):
            if not jobs[s.name].ok:
                rec["log_tail"] = _log_tail(jobs[s.name].log_path)
                print(f"--- {s.name} log tail ---\n{rec['log_tail'][-1500:]}", file=sys.stderr)
    return runs, result, error


def _print_result(result: dict, runs: list, out: Path) -> None:
    """The summary table, the differences, each criterion's line and where the outputs are."""
    print()
    print(text_table(summary_rows(runs)))
    print("(val loss: end-of-run validation on the same trainer.val_sequences held-out sequences "
          "for every run)")
    print()
    for line in diff_lines(result):
        print(line)
    for k in result["criteria"]:
        print(k["line"])
    print(f"outputs: {out / 'compare_ffn.json'}, {out / 'compare_ffn.md'}")


if __name__ == "__main__":
    sys.exit(main())
