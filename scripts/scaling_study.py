#!/usr/bin/env python
"""The scaling-of-sparsity study on ONE GPU machine: concurrent runs, one report (issue 7).

    # the default study on one H200 (~4-5 min wall; corpus cache and eval data already there)
    TWELL_CACHE=/path/to/cache python scripts/scaling_study.py --out "$OUT" \\
        data.cache_dir=/path/to/cache/corpus data.build_if_missing=false
    # CPU smoke test (what tests/test_report.py runs)
    python scripts/scaling_study.py --cpu --sizes tiny --l1 0,1e-3 --steps 2 ... data=tokens ...

What it does (paper, arXiv 2603.23198, "Results": at L1 = 2e-5 larger models keep fewer active
FFN units, 39 -> 29 -> 24 non-zeros per token from 0.5B to 2B):

1. Plans the runs: every size x every L1 coefficient (plain constant L1; 0 = the dense ReLU
   baseline), plus optional pairs at one size: ``sparsity=l1_reinit`` (dead-gate re-init) and
   ``sparsity=warmup`` (coefficient 0 for the first half, linear ramp to 3e-4 at the last step,
   the paper's schedule scaled to this run length), and the issue-6 pair: the same run with
   ``model.ffn_impl=twell`` next to the ``torch`` one (same seed and config).
2. Starts them as concurrent subprocesses (``python -m train ...``, each with its own
   ``hydra.run.dir`` under ``--study-dir``) sharing the GPU; all see the same tokens (same seed,
   ``--steps`` x ``--global-batch`` x ``--seq-len``), log every step, validate and save at the
   end, then run the seven evals on ``--eval-limit`` items per task (``eval=end``).
3. A wall-clock guard kills runs still going after ``--max-wall`` seconds (they are reported as
   incomplete, with the tail of their log).
4. Calls the report (:mod:`train.report`), measures L0 per token position on the final
   checkpoints of the runs at ``--position-l1``, and writes into ``--out`` (at most 4 files, flat):
   ``scaling.md`` (docs/scaling.md-ready; images linked as ``scaling/<name>.png``),
   ``runs.csv``, ``runs.json`` (every run's status, command, summary, per-step curves, eval
   result, log tail of failed runs, L0 by position) and ``plots.tar.gz`` (``scaling/*.png``;
   extract it in ``docs/``). Prints a short table last.

Default study and its cost (H200, bf16 autocast, no activation checkpointing):
  sizes small_l2/l4/l8/l12 (width 768, FFN 2048, 12 heads, seq 1024; non-embedding params
  14.2 / 28.3 / 56.6 / 84.9 M, plus the 37.7 M tied embedding that the LM head also multiplies)
  x L1 {0, 2e-5, 1e-4} = 12 runs, + small_l4 l1_reinit, warmup and twell = 15 runs, all at once.
  Each run: 150 steps x 16 seqs x 1024 = 2.46 M tokens (micro-batch 4, 4 accumulation steps).
  Training FLOPs per token, 6 x (non-emb + emb) + attention 12 L T D: 0.33 / 0.43 / 0.64 / 0.85
  GFLOP for l2 / l4 / l8 / l12; the 15 runs sum to 8.06 GFLOP per token position of a run, so the
  study is 2.46 M x 8.1 G = 20 PFLOP: 40 s at 500 TFLOP/s, 100 s at 200 TFLOP/s (small GEMMs
  time-sliced between 15 processes: expect 150-300 TFLOP/s). Plus ~30-40 s of process start
  (imports, data, CUDA context), ~20-40 s of evals (7 tasks x 300 items), ~20 s of report:
  about 3-4 minutes; the guard (--max-wall 240) kills what is still running at 4 min, so with
  the report the script ends within ~5 min. A ``model.ffn_impl=twell`` run that is much slower
  than torch at the dense start of training is the likeliest to hit the guard; it is then
  reported as incomplete and the rest of the study is unaffected.
  Memory: ~3-7 GB per process (fp32 weights + AdamW state 16 B/param, activations of 4 x 1024
  tokens, fp32 logits 4096 x 49152), ~75 GB for the 15 runs.

Arguments: see ``--help``. Extra ``key=value`` arguments are Hydra overrides passed to every run
(e.g. ``data.cache_dir=...``, ``optim.lr=2e-3``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass
class RunSpec:
    """One planned run: its name (= directory under the study dir) and Hydra overrides."""

    name: str
    overrides: list[str]
    role: str  # sweep | variant | ffn_pair | baseline
    status: str = "pending"
    rc: int | None = None
    seconds: float | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)
    t0: float = 0.0


def _l1_name(v: float) -> str:
    return "0" if v == 0 else f"{v:g}"


def plan(a) -> list[RunSpec]:
    """The study's runs (names unique, safe as directory names)."""
    runs: list[RunSpec] = []
    have = set()

    def add(name, over, role):
        if name not in have:
            have.add(name)
            runs.append(RunSpec(name, over, role))

    for size in a.sizes:
        for l1 in a.l1:
            add(f"{size}_l1_{_l1_name(l1)}",
                [f"model={size}", "sparsity=l1", f"sparsity.l1_coeff={l1!r}"], "sweep")
    vsize, vl1 = a.variant_size, a.variant_l1
    base = f"{vsize}_l1_{_l1_name(vl1)}"
    for v in a.variants:
        add(base, [f"model={vsize}", "sparsity=l1", f"sparsity.l1_coeff={vl1!r}"], "baseline")
        if v == "l1_reinit":
            add(f"{vsize}_l1_reinit_{_l1_name(vl1)}",
                [f"model={vsize}", "sparsity=l1_reinit", f"sparsity.l1_coeff={vl1!r}"], "variant")
        elif v == "warmup":
            add(f"{vsize}_warmup_{_l1_name(a.warmup_l1)}",
                [f"model={vsize}", "sparsity=warmup", f"sparsity.l1_coeff={a.warmup_l1!r}",
                 f"sparsity.warmup_start={a.steps // 2}", f"sparsity.warmup_end={a.steps}"],
                "variant")
    if a.ffn_pair:
        psize = a.ffn_pair
        add(f"{psize}_l1_{_l1_name(vl1)}",
            [f"model={psize}", "sparsity=l1", f"sparsity.l1_coeff={vl1!r}"], "baseline")
        add(f"{psize}_l1_{_l1_name(vl1)}_twell",
            [f"model={psize}", "sparsity=l1", f"sparsity.l1_coeff={vl1!r}",
             "model.ffn_impl=twell"], "ffn_pair")
    return runs


def common_overrides(a, study_dir: Path) -> list[str]:
    """Overrides shared by every run: same tokens (steps x global batch x seq_len, seed), log
    every step, validate/save/evaluate only at the end, no wandb, no progress bar."""
    over = [
        f"trainer={'cpu' if a.cpu else 'gpu'}", "optim=adamw",
        f"optim.warmup_steps={max(1, a.steps // 10)}",
        f"trainer.max_steps={a.steps}", f"trainer.global_batch={a.global_batch}",
        f"trainer.micro_batch={a.micro_batch}", f"model.seq_len={a.seq_len}",
        f"trainer.seed={a.seed}", "trainer.log_every=1", "trainer.val_every=0",
        f"trainer.val_sequences={a.val_sequences}", "trainer.save_every=0", "trainer.keep_last=1",
        "trainer.progress=false", "trainer.resume=never", "logging.wandb_mode=disabled",
    ]
    if a.cpu:
        over += ["trainer.cpu=true", "trainer.num_threads=1"]
    else:
        over += ["trainer.grad_checkpointing=false"]
    if a.eval_limit > 0:
        over += ["eval=end", f"eval.limit={a.eval_limit}", f"eval.batch_size={a.eval_batch}"]
    else:
        over += ["eval=disabled"]
    return over


def launch(spec: RunSpec, a, study_dir: Path, env: dict) -> None:
    run_dir = study_dir / spec.name
    cmd = [sys.executable, "-m", "train", *spec.overrides, *common_overrides(a, study_dir),
           *a.overrides, f"hydra.run.dir={run_dir}"]
    spec.overrides = cmd[3:]
    log = open(study_dir / f"{spec.name}.log", "w")  # noqa: SIM115  (closed by the child's exit)
    spec.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # own process group: the guard kills it
    log.close()
    spec.t0 = time.monotonic()
    spec.status = "running"


def _kill(spec: RunSpec) -> None:
    """SIGTERM the run's process group (the one we started), SIGKILL after 10 s."""
    try:
        os.killpg(spec.proc.pid, signal.SIGTERM)
        spec.proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(spec.proc.pid, signal.SIGKILL)
        spec.proc.wait()
    except ProcessLookupError:
        pass


def run_all(specs: list[RunSpec], a, study_dir: Path) -> float:
    """Run ``specs`` with at most ``a.parallel`` at once until done or ``a.max_wall`` seconds."""
    env = dict(os.environ)
    n = min(a.parallel, len(specs))
    env.update({
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n)),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    start = time.monotonic()
    pending = list(specs)
    running: list[RunSpec] = []
    while pending or running:
        while pending and len(running) < a.parallel:
            spec = pending.pop(0)
            launch(spec, a, study_dir, env)
            running.append(spec)
            print(f"[{time.monotonic() - start:6.1f}s] started {spec.name}", flush=True)
        for spec in list(running):
            rc = spec.proc.poll()
            if rc is not None:
                spec.rc, spec.seconds = rc, time.monotonic() - spec.t0
                spec.status = "done" if rc == 0 else f"failed (exit {rc})"
                running.remove(spec)
                print(f"[{time.monotonic() - start:6.1f}s] {spec.status}: {spec.name} "
                      f"({spec.seconds:.0f} s)", flush=True)
        if time.monotonic() - start > a.max_wall:
            for spec in running:
                _kill(spec)
                spec.rc, spec.seconds = spec.proc.returncode, time.monotonic() - spec.t0
                spec.status = f"killed by the {a.max_wall:.0f} s wall-clock guard"
                print(f"[{time.monotonic() - start:6.1f}s] killed {spec.name}", flush=True)
            for spec in pending:
                spec.status = f"not started before the {a.max_wall:.0f} s wall-clock guard"
            break
        time.sleep(0.5)
    return time.monotonic() - start


def _log_tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def write_outputs(specs, rep, report_error, a, study_dir: Path, out: Path, wall: float,
                  plot_dir: Path) -> None:
    from train.report import TASKS, markdown_table

    out.mkdir(parents=True, exist_ok=True)
    tokens = a.steps * a.global_batch * a.seq_len
    head = [
        "# Scaling of activation sparsity with model size", "",
        ("Generated by `scripts/scaling_study.py` (issue 7). Paper (arXiv 2603.23198, Results): at "
        "L1 = 2e-5 the number of active FFN units per token falls with model size, 39 -> 29 -> 24 "
        "from 0.5B to 2B."), "",
        f"Study: sizes {', '.join(a.sizes)}; L1 {', '.join(_l1_name(v) for v in a.l1)}; "
        f"{a.steps} steps x {a.global_batch} sequences x {a.seq_len} tokens = {tokens:,} tokens "
        f"per run (micro-batch {a.micro_batch}, seed {a.seed}); evals: "
        + (f"{a.eval_limit} items per task" if a.eval_limit else "off")
        + f"; {len(specs)} runs, {min(a.parallel, len(specs))} at a time, {wall:.0f} s wall for "
        f"training (guard {a.max_wall:.0f} s).", "",
        "Command: `python scripts/scaling_study.py " + " ".join(a.argv) + "`", "",
    ]
    bad = [s for s in specs if s.status != "done"]
    if bad:
        head += ["**Runs that did not finish:**", ""]
        head += [f"- `{s.name}`: {s.status} (log tail in runs.json)" for s in bad] + [""]
    body = rep.markdown(image_prefix="scaling/") if rep is not None else \
        f"**Report failed:** {report_error}\n"
    (out / "scaling.md").write_text("\n".join(head) + "\n" + body)
    if rep is not None:
        from train.report import csv_text

        (out / "runs.csv").write_text(csv_text(rep.rows))
    runs_by_name = {r.name: r for r in (rep.runs if rep is not None else [])}
    records = []
    for s in specs:
        rec = {"name": s.name, "role": s.role, "status": s.status, "rc": s.rc,
               "seconds": s.seconds, "overrides": s.overrides}
        r = runs_by_name.get(s.name)
        if r is not None:
            rec["summary"] = {k: v for k, v in r.summary.items() if k != "paths"}
            rec["curve"] = {k: [x.get(k) for x in r.train]
                            for k in ("step", "loss", "ce", "l1", "l0_mean", "nnz_max",
                                      "dead_frac", "lr", "grad_norm", "tokens_per_s")}
            rec["val"] = r.val
            rec["eval"] = r.evals
            if s.name in rep.position:
                l0_LT, n = rep.position[s.name]
                rec["l0_by_position"] = {"n_seqs": n, "l0_LT": [[round(float(x), 3) for x in row]
                                                               for row in l0_LT]}
        else:
            rec["log_tail"] = _log_tail(study_dir / f"{s.name}.log")
        records.append(rec)
    meta = {"args": {k: v for k, v in vars(a).items() if k != "argv"}, "wall_s": wall,
            "tokens_per_run": tokens, "tasks": list(TASKS), "report_error": report_error,
            "variant_pairs": rep.variant_rows if rep else [], "ffn_pairs": rep.ffn_rows if rep else []}
    (out / "runs.json").write_text(json.dumps({"study": meta, "runs": records}, default=str))
    pngs = sorted(plot_dir.glob("*.png"))
    if pngs:
        with tarfile.open(out / "plots.tar.gz", "w:gz") as tar:
            for p in pngs:
                tar.add(p, arcname=f"scaling/{p.name}")
    # the short table, last
    rows = rep.rows if rep is not None else []
    by = {r["run"]: r for r in rows}
    table = [{"run": s.name, "status": "ok" if s.status == "done" else s.status.split(" (")[0][:24],
              **{k: by.get(s.name, {}).get(k) for k in ("l1_coeff", "l0_mean", "dead_pct",
                                                        "val_loss", "acc_mean", "tokens_per_s")}}
             for s in specs]
    print()
    print(markdown_table(table, ["run", "status", "l1_coeff", "l0_mean", "dead_pct", "val_loss",
                                 "acc_mean", "tokens_per_s"]))
    for r in (rep.ffn_rows if rep else []):
        print(f"FFN pair {r['runs']}: max |loss diff| {r['max_abs_loss_diff']}, L0 rel. diff "
              f"{r['l0_rel_diff']}, dead units diff {r['dead_diff']}")
    print(f"outputs: {', '.join(sorted(p.name for p in out.iterdir()))} in {out}")


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _names(s: str) -> list[str]:
    return [] if s.strip().lower() in ("", "none") else [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=_names, default=_names("small_l2,small_l4,small_l8,small_l12"),
                   help="model configs (configs/model/*.yaml), comma-separated")
    p.add_argument("--l1", type=_floats, default=_floats("0,2e-5,1e-4"),
                   help="L1 coefficients, comma-separated (0 = dense ReLU baseline)")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps of every run")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=42, help="seed of every run (init and data order)")
    p.add_argument("--val-sequences", type=int, default=64,
                   help="held-out sequences of the validation at the end")
    p.add_argument("--eval-limit", type=int, default=300,
                   help="items per task of the end-of-training evals (0 = no evals)")
    p.add_argument("--eval-batch", type=int, default=32, help="sequences per eval forward")
    p.add_argument("--variants", type=_names, default=_names("l1_reinit,warmup"),
                   help="sparsity variants at --variant-size: l1_reinit, warmup, or none")
    p.add_argument("--variant-size", default="small_l4", help="model of the variant runs")
    p.add_argument("--variant-l1", type=float, default=2e-5,
                   help="L1 of the l1_reinit run, its baseline and the FFN pair")
    p.add_argument("--warmup-l1", type=float, default=3e-4,
                   help="final L1 of the warmup run (paper: 3e-4; 0 for the first half, then a "
                        "linear ramp to the last step)")
    p.add_argument("--ffn-pair", default="small_l4",
                   help="model of the issue-6 pair (model.ffn_impl=twell vs torch); none = off")
    p.add_argument("--parallel", type=int, default=16, help="runs at once")
    p.add_argument("--max-wall", type=float, default=240.0,
                   help="seconds after the first start when unfinished runs are killed")
    p.add_argument("--position-batches", type=int, default=2,
                   help="validation micro-batches for L0 by token position (0 = off)")
    p.add_argument("--position-l1", type=float, default=2e-5,
                   help="measure L0 by position for the runs at this L1")
    p.add_argument("--study-dir", type=Path, default=None,
                   help="where the run directories go (default: runs/scaling/<date-time>)")
    p.add_argument("--out", type=Path, required=True,
                   help="output folder: scaling.md, runs.csv, runs.json, plots.tar.gz")
    p.add_argument("--cpu", action="store_true", help="CPU runs (smoke tests): trainer=cpu, fp32")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (key=value)")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    a.ffn_pair = None if a.ffn_pair.lower() == "none" else a.ffn_pair
    bad = [v for v in a.variants if v not in ("l1_reinit", "warmup")]
    if bad:
        p.error(f"--variants: unknown {bad}; use l1_reinit, warmup or none")
    if a.global_batch % a.micro_batch:
        p.error(f"--global-batch {a.global_batch} is not a multiple of --micro-batch "
                f"{a.micro_batch}")
    if not a.sizes or not a.l1:
        p.error("--sizes and --l1 need at least one value each")
    if any(v < 0 for v in a.l1):
        p.error(f"--l1 values must be >= 0; got {a.l1}")
    for o in a.overrides:
        if "=" not in o:
            p.error(f"extra argument {o!r} is not a Hydra override key=value")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    study_dir = a.study_dir or ROOT / "runs" / "scaling" / time.strftime("%Y-%m-%d_%H-%M-%S")
    if study_dir.exists() and any(study_dir.iterdir()):
        print(f"--study-dir {study_dir} is not empty; pick a new one (runs would resume or "
              "clash)", file=sys.stderr)
        return 2
    study_dir.mkdir(parents=True, exist_ok=True)
    specs = plan(a)
    print(f"study dir {study_dir}: {len(specs)} runs, {a.steps} steps x {a.global_batch} x "
          f"{a.seq_len} tokens each, at most {a.parallel} at a time, guard {a.max_wall:.0f} s",
          flush=True)
    wall = run_all(specs, a, study_dir)

    from train.report import MismatchError, ReportError, build_report

    plot_dir = Path(tempfile.mkdtemp(prefix="twell_scaling_plots_"))
    rep, err = None, None
    kw = {"skip_incomplete": True, "position_batches": a.position_batches,
              "position_l1": a.position_l1, "device": "cpu" if a.cpu else None, "plot_dir": plot_dir}
    finished = [str(study_dir / s.name) for s in specs if (study_dir / s.name).is_dir()]
    try:
        if not finished:
            raise ReportError("no run directory was created; see the log tails in runs.json")
        try:
            rep = build_report(finished, **kw)
        except MismatchError as e:  # still write what we have, flagged
            err = f"{e} (reported anyway)"
            rep = build_report(finished, allow_mismatch=True, **kw)
    except ReportError as e:
        err = str(e)
        print(f"report failed: {e}", file=sys.stderr)
    write_outputs(specs, rep, err, a, study_dir, a.out, wall, plot_dir)
    shutil.rmtree(plot_dir, ignore_errors=True)
    return 0 if rep is not None and all(s.status == "done" for s in specs) else 1


if __name__ == "__main__":
    sys.exit(main())
