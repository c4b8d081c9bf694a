#!/usr/bin/env python
"""Whole-model benchmark on a model the framework made sparse: train it, profile its sparsity,
then measure every training and inference path on it, in one process on one GPU.

    # one H200, the default (1.5B shape, 200 steps at L1 3e-4; ~6-7 min, see docs/model_bench)
    python scripts/bench_model.py --out "$OUT" --acts-dir /tmp/acts \\
        --config data.cache_dir=/tmp/twc/corpus data.build_if_missing=false
    # the speed helper's trainer options side by side (each variant a row of the CSV)
    python scripts/bench_model.py --out "$OUT" --variants auto+fce=auto:trainer.fused_ce=true
    # a profile breakdown of the 1.5B step (auto and ell paths)
    python scripts/bench_model.py --out "$OUT" --profile --micro-list 8
    # CPU smoke run (tiny shape, fp32, synthetic tokens; what tests/test_bench_model.py runs)
    python scripts/bench_model.py --smoke --out /tmp/bm
    # rebuild the markdown table and the plots from the CSVs (CPU)
    python scripts/bench_model.py --report docs/model_bench

Stage 1 (per ``--sizes`` entry): ``train.trainer.Trainer`` built from ``configs/`` with
``model=<size> trainer=gpu optim=adamw optim.lr=1e-3 optim.warmup_steps=10
sparsity.l1_coeff=3e-4 model.ffn_impl=auto``, micro-batch = global batch = 8, sequence 2048, bf16
autocast over fp32 master weights, gradient checkpointing, trains ``--train-steps`` optimizer
steps (its own ``train_step`` and ``log_metrics``; a log line every ``--log-every`` steps; no
checkpoint is written: the model stays in memory). Then, on held-out blocks (the val split):
per-layer L0, largest active units of one token, dead units (never active on those tokens),
heavy rows (more active units than the ELL capacity) and the share of the active entries held by
the hottest 1 % of units (``sparsity_profile.csv``); ``--acts-dir``: the FFN inputs and weights of
the layers with the lowest, median and highest L0 (``twell.nn.record``'s safetensors format,
for ``bench_real_layers.py``, ``bench_ffn.py --acts`` / ``bench_ffn_train.py --acts``).

Stage 2, the same trained weights for every path:

* ``hf``: stock ``LlamaForCausalLM`` (ReLU, SDPA), gradient checkpointing, bf16 autocast over
  fp32 weights, fused AdamW, grad clip 1.0, CE on ``labels=ids``: what users run today.
* ``torch``, ``dense_mode``, ``ell``, ``auto``: the trainer's own ``train_step`` (L1 term,
  statistics, the no-sync dense-backup capacities and redone steps) with ``model.ffn_impl`` =
  ``torch``; ``auto`` with every layer pinned to dense mode (cuBLAS + fused elementwise passes);
  ``twell``; ``auto`` with the per-layer choices the trained statistics gave (updated after
  every step as in training). ``dense`` in the ratios is the faster of ``torch`` and
  ``dense_mode`` at the equal micro-batch (column ``dense_ref``).
* ``--variants NAME=BASE[:KEY=VALUE,...]``: a base path with extra trainer overrides (e.g. the
  speed helper's flags), one more row each; ``--override KEY=VALUE`` applies to all our paths.

Every path and micro-batch is a fresh model (trained weights loaded) and optimizer, so the
memory of one measurement never holds another's. The learning rate is 0 while timing (AdamW
still runs every kernel, ``w <- w`` exactly), so every path times the same weights and
sparsity. Timing: CUDA events around each optimizer step, ``--warmup`` steps first, the
median of ``--steps`` steps (also the wall-clock mean, which includes redone steps); the peak
memory is reset after the warm-up. ``static_gb`` = 16 bytes per parameter (fp32 weight,
gradient, AdamW's two moments); ``activation_peak_gb`` = peak - static. Energy from NVML's
cumulative counter over the timed steps (``energy_j_per_tok``; empty without NVML). Forward:
eval, no grad, bf16 weights, the decoder stack (no LM head, as the paper's dense baseline) on
``--fwd-batch`` x 2048 tokens. Largest micro-batch: ``--micro-list`` ascending up to
``--max-micro``, a few steps each, stopping at the first out-of-memory; ``max_micro_est``
extrapolates the activation peak to the device's memory.

Checks first (cheap): logits of ``hf`` and our model (fp32, eval) on one small batch; each
path's training-forward loss on one held-out batch against ``hf``'s bf16 loss, within
``max(4 x |hf bf16 - hf fp32|, 0.2 %)`` (``check_ok``).

Time box: ``--deadline`` seconds for the whole run (default 480); training stops at
``--train-budget`` seconds; each later measurement is skipped (and named) when its estimated time
does not fit. Order: micro-batch 8 of every path, the forward, the profile, the larger
micro-batches.

Output under ``--out`` (default $OUT, else docs/model_bench), at most 6 files plus 3 PNGs (the
device returns 8 files; ``--no-plots``, then ``--report`` on the CPU): ``bench_model.csv`` (one
row per size, path and micro-batch, rewritten after every measurement),
``sparsity_profile.csv``, ``bench_meta.json`` (checks, stage 1's log lines, auto's paths,
skipped stages), ``bench_model.md`` (the paper's Table 1 layout, then every row),
``profile.csv`` and ``profile_kernels.csv`` (``--profile``: ms per step by category; the top 25
kernels), ``bench_throughput.png``, ``bench_memory.png``, ``bench_l0.png``. The short table
printed last is the markdown's first table. ``--acts-dir`` files are ~130 MB per layer at 1.5B
(too large to come back from the device): use them in the same call.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from train.profile import sparsity_profile

PATHS = ("hf", "torch", "dense_mode", "ell", "auto")
IMPL = {"torch": "torch", "dense_mode": "auto", "ell": "twell", "auto": "auto"}  # model.ffn_impl
DENSE_PATHS = ("torch", "dense_mode")
GIB = 2**30
STATIC_BYTES_PER_PARAM = 16  # fp32 weight 4 + gradient 4 + AdamW exp_avg 4 + exp_avg_sq 4
CONTROLLED = ("model.ffn_impl", "trainer.micro_batch", "trainer.global_batch", "trainer.max_steps",
              "trainer.resume", "hydra.")

CSV_COLUMNS = [
    "size", "path", "base_path", "overrides", "micro_batch", "seq_len", "l0_mean", "l0_timed",
    "train_tok_per_ms", "train_tok_per_ms_wall", "step_ms_median", "step_ms_p10", "step_ms_p90",
    "timed_steps", "redos", "fwd_tok_per_ms", "fwd_ms_median", "fwd_batch", "peak_gb", "static_gb",
    "activation_peak_gb", "alloc_after_step_gb", "energy_j_per_tok", "mfu", "mfu_useful",
    "loss_check", "loss_diff_vs_hf", "check_ok", "oom", "dense_ref", "max_micro_batch",
    "max_micro_est", "train_speedup_vs_dense", "train_speedup_vs_hf", "fwd_speedup",
    "activation_mem_ratio", "max_micro_speedup_vs_dense", "n_params", "device", "device_mem_gb",
    "notes",
]
PROFILE_COLUMNS = ["size", "layer", "tokens", "l0", "l0_max", "dead_pct", "hot1_share",
                   "heavy_frac"]
BREAKDOWN_COLUMNS = ["size", "path", "category", "ms_per_step", "share"]
KERNEL_COLUMNS = ["size", "path", "kernel", "category", "ms_per_step", "calls_per_step"]


# ---------------------------------------------------------------- small helpers


class Clock:
    """Wall-clock budget of the run: ``fits(est)`` is False when ``est`` seconds would end past
    the deadline minus a reserve for writing the outputs."""

    def __init__(self, deadline_s: float, reserve_s: float = 10.0) -> None:
        self.t0 = time.monotonic()
        self.deadline_s = deadline_s
        self.reserve_s = reserve_s
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.deadline_s - self.elapsed()

    def fits(self, est_s: float, what: str) -> bool:
        if est_s <= self.left() - self.reserve_s:
            return True
        self.skipped.append(what)
        log(f"SKIP {what}: needs ~{est_s:.0f} s, {self.left():.0f} s left of --deadline")
        return False


def log(msg: str) -> None:
    print(f"[bench_model] {msg}", flush=True)


def _num(v):
    """CSV cell -> float/int/str/None (the inverse of writing)."""
    if v is None or v == "":
        return None
    try:
        f = float(v)
    except ValueError:
        return v
    return int(f) if f.is_integer() and "." not in str(v) and "e" not in str(v).lower() else f


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def free_memory() -> None:
    """Collect the last measurement's tensors and return cached blocks to the device (CUDA
    only: on the CPU smoke run memory is not measured, and a full collection costs ~0.5 s)."""
    import torch

    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def peak_gb(dev):
    import torch

    return torch.cuda.max_memory_allocated(dev) / GIB if dev.type == "cuda" else None


def reset_peak(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def allocated_gb(dev):
    import torch

    return torch.cuda.memory_allocated(dev) / GIB if dev.type == "cuda" else None


def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


class Energy:
    """NVML's cumulative energy counter of the device (mJ); ``read()`` is None without NVML."""

    def __init__(self, dev) -> None:
        self.handle = None
        if dev.type != "cuda":
            return
        try:
            import pynvml
            import torch

            pynvml.nvmlInit()
            try:
                p = torch.cuda.get_device_properties(dev)
                bus = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
                self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
            except Exception:  # noqa: BLE001  (older torch: no PCI ids; one visible GPU)
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(dev.index or 0)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            self._nvml = pynvml
        except Exception as e:  # noqa: BLE001  (energy is optional)
            log(f"NVML energy counter unavailable ({type(e).__name__}: {e}); energy omitted")
            self.handle = None

    def read(self):
        if self.handle is None:
            return None
        try:
            return float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except Exception:  # noqa: BLE001
            return None


# ---------------------------------------------------------------- configs


def stage1_overrides(a, size: str, smoke_tokens: Path | None) -> list[str]:
    """Hydra overrides of the stage-1 training run (and the base of every measured path)."""
    if a.smoke:
        over = ["model=tiny", "model.name=smoke", "model.vocab_size=64", "model.hidden_size=32",
                "model.intermediate_size=64", "model.num_heads=2", "model.num_layers=2",
                "model.seq_len=32", "data=tokens", f"data.paths=[{smoke_tokens}]",
                "data.vocab_size=64", "data.val_fraction=0.1", "trainer=cpu", "trainer.cpu=true",
                "trainer.precision=fp32", "trainer.num_threads=1",
                "trainer.grad_checkpointing=true", "optim=tiny", "sparsity.l1_coeff=0.05"]
    else:
        over = [f"model={size}", "trainer=gpu", "optim=adamw", f"optim.lr={a.lr}",
                f"sparsity.l1_coeff={a.l1}"]
    return over + [
        f"optim.warmup_steps={a.warmup_steps}", f"trainer.micro_batch={a.micro}",
        f"trainer.global_batch={a.micro}", f"trainer.max_steps={a.train_steps}",
        "model.ffn_impl=auto", "eval=disabled", "logging.wandb_mode=disabled",
        "trainer.progress=false", "trainer.val_every=0", "trainer.save_every=0",
        "trainer.resume=never", f"trainer.log_every={a.log_every}", *a.config]


def path_overrides(base: list[str], impl: str, a, extra: list[str], user: bool = True) -> list[str]:
    """A measured path's overrides: stage 1's, its ffn_impl, a long flat schedule (replaced by a
    zero learning rate anyway), then ``--override`` (``user``) and the variant's own."""
    return [*base, f"model.ffn_impl={impl}", "trainer.max_steps=100000", "optim.warmup_steps=0",
            *(a.override if user else []), *extra]


def parse_variants(specs: list[str]) -> list[tuple[str, str, list[str]]]:
    """``NAME=BASE[:KEY=VALUE,KEY=VALUE]`` -> (name, base path, overrides).

    Raises:
        SystemExit: a malformed spec or an unknown base path (one line naming it).
    """
    out = []
    for spec in specs:
        name, sep, rest = spec.partition("=")
        base, _, over = rest.partition(":")
        if not sep or not name or base not in IMPL:
            sys.exit(f"--variants {spec!r}: use NAME=BASE[:KEY=VALUE,...] with BASE one of "
                     f"{', '.join(IMPL)}")
        items: list[str] = []
        for piece in [p for p in over.split(",") if p] if over else []:
            if "=" in piece or not items:
                items.append(piece)
            else:  # a comma inside a value (a list): glue it back
                items[-1] += "," + piece
        bad = [o for o in items if "=" not in o or _key(o).startswith(CONTROLLED)]
        if bad:
            sys.exit(f"--variants {spec!r}: override {bad[0]!r} is not KEY=VALUE or sets a key the "
                     f"script controls ({', '.join(CONTROLLED)})")
        out.append((name, base, items))
    return out


def compose(overrides: list[str]):
    from compare_ffn_paths import compose_config

    return compose_config(overrides)


# ---------------------------------------------------------------- models and trainers


def cpu_weights(model) -> dict:
    """fp32 CPU copy of a model's state dict (what every measured model is loaded from)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def load_weights(model, weights: dict) -> None:
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"weights do not match the model: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")


def build_ours(model_cfg, weights: dict, dev, dtype=None):
    """Our model (SparseGatedMLP FFNs), initialised on ``dev`` and loaded with ``weights``."""
    import torch

    from train.model import build_model

    with torch.device(dev):
        model = build_model(model_cfg)
    if dtype is not None:
        model.to(dtype)
    load_weights(model, weights)
    return model


def build_hf(model_cfg, weights: dict, dev, dtype=None):
    """Stock ``LlamaForCausalLM`` (ReLU, SDPA) with the same weights."""
    import torch
    from transformers import LlamaForCausalLM

    from train.model import llama_config

    with torch.device(dev):
        model = LlamaForCausalLM(llama_config(model_cfg))
    if dtype is not None:
        model.to(dtype)
    load_weights(model, weights)
    return model


def build_trainer(cfg, run_dir: Path, dm, weights: dict | None, sparse_state: dict | None, dev,
                  *, pin_dense: bool = False):
    """``train.trainer.Trainer`` for ``cfg`` whose model is initialised on ``dev`` (not on the
    CPU: minutes at 1.5B) and loaded with ``weights``; ``sparse_state`` restores the trained
    per-layer paths, dense-backup capacities and heavy-row history; ``pin_dense`` keeps every
    layer in dense mode (``auto`` would move sparse layers to the ELL path after a step)."""
    import torch

    import train.trainer as trainer_mod

    orig = trainer_mod.build_model

    def build_on_device(model_cfg):
        with torch.device(dev):
            model = orig(model_cfg)
        if weights is not None:
            load_weights(model, weights)
        return model

    trainer_mod.build_model = build_on_device
    try:
        tr = trainer_mod.Trainer(cfg, run_dir, datamodule=dm)
    finally:
        trainer_mod.build_model = orig
    if sparse_state is not None:
        for mlp, p, rows, hist in zip(tr.mlps, sparse_state["paths"], sparse_state["backup_rows"],
                                      sparse_state["heavy_hist"]):
            mlp.train_path, mlp.backup_rows = p, rows
        tr.heavy_hist = [list(h) for h in sparse_state["heavy_hist"]]
    if pin_dense:
        for mlp in tr.mlps:
            mlp.train_path = "dense"
        tr._update_auto_paths = lambda *_a, **_k: None  # instance patch: dense mode stays
    return tr


def close_trainer(tr) -> None:
    tr.close()
    tr.acc.free_memory()


def set_micro(tr, micro: int) -> None:
    """Make ``tr.train_step`` take one micro-batch of ``micro`` sequences per optimizer step."""
    tr.cfg.trainer.micro_batch = tr.cfg.trainer.global_batch = micro
    tr.accum = 1


def zero_lr(tr) -> None:
    """lr 0 from now on: timed steps run every kernel but leave the weights as trained."""
    import torch

    for g in tr.optimizer.param_groups:
        g["lr"] = 0.0
    tr.scheduler = torch.optim.lr_scheduler.LambdaLR(tr.optimizer, lambda _s: 0.0)


class HFStep:
    """One training step of plain transformers: autocast forward with ``labels=ids``, backward,
    clip 1.0, fused AdamW (lr 0, see module docstring), ``zero_grad(set_to_none=True)``."""

    def __init__(self, model, cfg, dev) -> None:
        import torch

        from train.model import enable_grad_checkpointing

        self.model, self.dev = model, dev
        if cfg.trainer.grad_checkpointing:
            enable_grad_checkpointing(model)
        model.train()
        o = cfg.optim
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=0.0, betas=tuple(o.betas), eps=o.eps, fused=dev.type == "cuda")
        self.clip = o.grad_clip if o.grad_clip > 0 else math.inf
        self.bf16 = dev.type == "cuda" and cfg.trainer.precision in ("auto", "bf16")

    def __call__(self, ids_cpu) -> None:
        import torch

        ids = ids_cpu.to(self.dev, non_blocking=True)
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- data


def train_pool(dm, n_blocks: int):
    """(n_blocks, T) int64 real training blocks (the stream after stage 1's position)."""
    import torch

    it = dm.train_batches()
    blocks = []
    while sum(b.shape[0] for b in blocks) < n_blocks:
        blocks.append(next(it))
    return torch.cat(blocks)[:n_blocks]


def val_blocks(dm, n_blocks: int):
    """(<= n_blocks, T) held-out blocks in stream order (None if there is no val split)."""
    import torch

    got = []
    for b in dm.val_batches():
        got.append(b)
        if sum(x.shape[0] for x in got) >= n_blocks:
            break
    return torch.cat(got)[:n_blocks] if got else None


def batches_from(pool, micro: int, seed: int = 0):
    """Endless (micro, T) batches drawn from ``pool`` (a fresh permutation each pass)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(pool.shape[0], generator=g)
        reps = math.ceil(micro / pool.shape[0])
        idx = perm.repeat(reps)
        for s in range(0, pool.shape[0], micro):
            chunk = idx[s:s + micro]
            if chunk.numel() < micro:
                break
            yield pool[chunk]


# ---------------------------------------------------------------- timing


def time_steps(step, n_warm: int, n_steps: int, dev, energy: Energy) -> dict:
    """Run ``step()`` ``n_warm`` times, reset the peak memory, then time ``n_steps`` calls.

    Returns step_ms (list, CUDA events on GPU, host clock on CPU), wall_ms (whole window),
    peak_gb (after the warm-up), energy_mj (None without NVML), alloc_after_gb.
    """
    import torch

    for _ in range(n_warm):
        step()
    sync(dev)
    reset_peak(dev)
    e0 = energy.read()
    t0 = time.perf_counter()
    if dev.type == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n_steps)]
        for s, e in ev:
            s.record()
            step()
            e.record()
        sync(dev)
        step_ms = [s.elapsed_time(e) for s, e in ev]
    else:
        step_ms = []
        for _ in range(n_steps):
            t = time.perf_counter()
            step()
            step_ms.append(1e3 * (time.perf_counter() - t))
    wall_ms = 1e3 * (time.perf_counter() - t0)
    e1 = energy.read()
    return {"step_ms": step_ms, "wall_ms": wall_ms, "peak_gb": peak_gb(dev),
            "energy_mj": None if e0 is None or e1 is None else e1 - e0,
            "alloc_after_gb": allocated_gb(dev)}


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[i]


def timing_row(t: dict, micro: int, seq: int, n_params: int) -> dict:
    """CSV fields of one timed window."""
    tokens = micro * seq
    med = statistics.median(t["step_ms"])
    n = len(t["step_ms"])
    static = STATIC_BYTES_PER_PARAM * n_params / GIB
    row = {"micro_batch": micro, "seq_len": seq, "timed_steps": n, "step_ms_median": med,
           "step_ms_p10": _quantile(t["step_ms"], 0.1), "step_ms_p90": _quantile(t["step_ms"], 0.9),
           "train_tok_per_ms": tokens / med, "train_tok_per_ms_wall": tokens * n / t["wall_ms"],
           "peak_gb": t["peak_gb"], "static_gb": static,
           "activation_peak_gb": None if t["peak_gb"] is None else t["peak_gb"] - static,
           "alloc_after_step_gb": t["alloc_after_gb"], "n_params": n_params,
           "energy_j_per_tok": (None if t["energy_mj"] is None
                                else t["energy_mj"] / 1e3 / (tokens * n))}
    return row


def mfu_fields(model_cfg, tok_per_ms: float, peak_flops, l0_L) -> dict:
    from train.metrics import flops_per_token, mfu

    tok_s = tok_per_ms * 1e3
    return {"mfu": mfu(flops_per_token(model_cfg), tok_s, peak_flops),
            "mfu_useful": (None if l0_L is None
                           else mfu(flops_per_token(model_cfg, l0_L), tok_s, peak_flops))}


# ---------------------------------------------------------------- stage 1


def train_sparse(tr, steps: int, log_every: int, budget_s: float) -> dict:
    """Train with the trainer's own ``train_step`` / ``log_metrics``; stops at ``steps`` or after
    ``budget_s`` seconds. Returns {steps, seconds, last metrics}."""
    tr.model.train()
    for m in tr.mlps:
        m.collect_stats = True
    batches = iter(tr.data.train_batches())
    interval = tr._new_interval()
    t0 = time.monotonic()
    last = {}
    while tr.step < steps:
        t = time.perf_counter()
        tr.train_step(batches, interval)
        interval["time"] += time.perf_counter() - t
        over = time.monotonic() - t0 > budget_s
        if tr.step % log_every == 0 or tr.step == steps or over:
            last = tr.log_metrics(interval)
            interval = tr._new_interval()
            paths = [mlp.train_path for mlp in tr.mlps]
            log(tr._format(last) + f" | ell layers {paths.count('twell')}/{len(paths)}")
        if over:
            log(f"stage 1 stopped at step {tr.step} of {steps}: --train-budget {budget_s:.0f} s")
            break
    return {"steps": tr.step, "seconds": time.monotonic() - t0, "last": last}


def pick_layers(profile: list[dict]) -> list[int]:
    """Layers with the lowest, median and highest L0 (distinct, in that order)."""
    order = sorted(profile, key=lambda r: r["l0"])
    picks = [order[0]["layer"], order[len(order) // 2]["layer"], order[-1]["layer"]]
    return list(dict.fromkeys(picks))


# ---------------------------------------------------------------- outputs (pure)


def add_ratios(rows: list[dict], equal_micro: int | None = None) -> list[dict]:
    """Fill ``dense_ref``, ``max_micro_batch``, ``max_micro_est`` and the ratio columns from the
    measured columns (in place; also what ``--report`` runs on the CSV).

    Per size: the forward numbers (one measurement per path) are copied to every row of the
    path; ``dense_ref`` = the faster (``train_tok_per_ms``) of ``torch`` and ``dense_mode`` at
    ``equal_micro`` (default: the smallest micro-batch measured). At each row's micro-batch:
    ``train_speedup_vs_dense`` = tok/ms over dense_ref's, ``train_speedup_vs_hf`` = tok/ms over
    hf's (= hf step time / this step time), ``activation_mem_ratio`` = activation peak over
    dense_ref's; ``fwd_speedup`` = forward tok/ms over dense_ref's. ``max_micro_batch`` = the
    largest micro-batch a path completed; on that row ``max_micro_speedup_vs_dense`` = its tok/ms
    over dense_ref's at dense_ref's largest. ``max_micro_est``: the activation peak per sequence
    (slope between the path's two largest measured micro-batches) extrapolated to 97 % of the
    device memory.
    """
    def ok(r):
        return r.get("train_tok_per_ms") not in (None, "")

    for r in rows:
        for c in ("dense_ref", "max_micro_batch", "max_micro_est", "train_speedup_vs_dense",
                  "train_speedup_vs_hf", "fwd_speedup", "activation_mem_ratio",
                  "max_micro_speedup_vs_dense"):
            r[c] = None
    for size in dict.fromkeys(r["size"] for r in rows):
        rs = [r for r in rows if r["size"] == size]
        by = {}
        for r in rs:
            if ok(r):
                by[(r["path"], int(r["micro_batch"]))] = r
        micros = sorted({m for (_p, m) in by})
        em = equal_micro if equal_micro in micros else (micros[0] if micros else None)
        cands = [by[(p, em)] for p in DENSE_PATHS if (p, em) in by]
        dref = max(cands, key=lambda r: r["train_tok_per_ms"])["path"] if cands else None
        fwd_of, fwd_row = {}, {}
        for r in rs:
            if r.get("fwd_tok_per_ms") not in (None, ""):
                fwd_of[r["path"]], fwd_row[r["path"]] = r["fwd_tok_per_ms"], r
        for r in rs:  # one forward per path: on every row of the path
            src = fwd_row.get(r["path"])
            if src is not None and r.get("fwd_tok_per_ms") in (None, ""):
                for c in ("fwd_tok_per_ms", "fwd_ms_median", "fwd_batch"):
                    r[c] = src.get(c)
        max_micro = {}
        for (p, m) in by:
            max_micro[p] = max(max_micro.get(p, 0), m)
        for r in rs:
            r["dense_ref"] = dref
            p = r["path"]
            r["max_micro_batch"] = max_micro.get(p)
            if dref is not None and p in fwd_of and dref in fwd_of:
                r["fwd_speedup"] = fwd_of[p] / fwd_of[dref]
            if not ok(r):
                continue
            m = int(r["micro_batch"])
            d, h = by.get((dref, m)), by.get(("hf", m))
            if d is not None:
                r["train_speedup_vs_dense"] = r["train_tok_per_ms"] / d["train_tok_per_ms"]
                if r.get("activation_peak_gb") not in (None, "") and d.get(
                        "activation_peak_gb") not in (None, ""):
                    r["activation_mem_ratio"] = r["activation_peak_gb"] / d["activation_peak_gb"]
            if h is not None:
                r["train_speedup_vs_hf"] = r["train_tok_per_ms"] / h["train_tok_per_ms"]
            if dref in max_micro and m == max_micro[p]:
                dm = by[(dref, max_micro[dref])]
                r["max_micro_speedup_vs_dense"] = r["train_tok_per_ms"] / dm["train_tok_per_ms"]
        for p in max_micro:
            pts = sorted((m, by[(q, m)]) for (q, m) in by if q == p)
            pts = [(m, r) for m, r in pts if r.get("activation_peak_gb") not in (None, "")]
            if len(pts) < 2:
                continue
            (m1, r1), (m2, r2) = pts[-2], pts[-1]
            slope = (r2["activation_peak_gb"] - r1["activation_peak_gb"]) / (m2 - m1)
            mem = r2.get("device_mem_gb")
            if slope > 0 and mem not in (None, ""):
                est = int(m2 + (0.97 * mem - r2["peak_gb"]) / slope)
                for r in rs:
                    if r["path"] == p:
                        r["max_micro_est"] = max(est, m2)
    return rows


def write_csv(rows: list[dict], path: Path, columns: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else
                            (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]))
                        for k in columns})
    tmp.replace(path)


def read_csv(path: Path) -> list[dict]:
    with path.open() as f:
        return [{k: _num(v) for k, v in r.items()} for r in csv.DictReader(f)]


def _f(v, fmt=".1f", none="n/a"):
    return none if v in (None, "") else format(v, fmt)


def _ratio(a, b):
    return None if a in (None, "") or b in (None, "") or not b else a / b


def _pct(r):
    return "" if r is None else f" ({100 * (r - 1):+.1f}%)"


def summary_table(rows: list[dict], prof: list[dict]) -> str:
    """The paper's Table 1 layout (dense -> sparse, sparse = auto) from the CSV rows."""
    lines = [("| size | non-zeros/token (val) | forward tok/ms dense -> auto | "
              "train step tok/ms dense -> auto (micro) | vs plain transformers | "
              "peak train memory GB dense -> auto | activation GB dense -> auto | "
              "largest micro-batch dense -> auto |"),
             "|---|---|---|---|---|---|---|---|"]
    for size in dict.fromkeys(r["size"] for r in rows):
        rs = [r for r in rows if r["size"] == size and r.get("train_tok_per_ms") not in (None, "")]
        if not rs:
            continue
        dref = rs[0].get("dense_ref")
        micros = sorted({int(r["micro_batch"]) for r in rs})
        m = micros[0]

        def get(path, micro=m, rows_=rs):
            return next((r for r in rows_ if r["path"] == path and int(r["micro_batch"]) == micro),
                        None)
        d, s, h = get(dref), get("auto"), get("hf")
        l0 = [p["l0"] for p in prof if p["size"] == size]
        l0s = f"{sum(l0) / len(l0):.1f} [{min(l0):.1f}-{max(l0):.1f}]" if l0 else "n/a"
        fwd_d = d.get("fwd_tok_per_ms") if d else None
        fwd_s = s.get("fwd_tok_per_ms") if s else None
        tr_d = d["train_tok_per_ms"] if d else None
        tr_s = s["train_tok_per_ms"] if s else None
        tr_h = h["train_tok_per_ms"] if h else None
        pk_d, pk_s = (d or {}).get("peak_gb"), (s or {}).get("peak_gb")
        ac_d, ac_s = (d or {}).get("activation_peak_gb"), (s or {}).get("activation_peak_gb")
        mm_d, mm_s = (d or {}).get("max_micro_batch"), (s or {}).get("max_micro_batch")
        lines.append(
            f"| {size} | {l0s} | {_f(fwd_d)} -> {_f(fwd_s)}{_pct(_ratio(fwd_s, fwd_d))} | "
            f"{_f(tr_d)} -> {_f(tr_s)}{_pct(_ratio(tr_s, tr_d))} ({m}) | "
            f"hf {_f(tr_h)}: {_f(_ratio(tr_s, tr_h), '.2f')}x | "
            f"{_f(pk_d)} -> {_f(pk_s)}{_pct(_ratio(pk_s, pk_d))} | "
            f"{_f(ac_d, '.2f')} -> {_f(ac_s, '.2f')}{_pct(_ratio(ac_s, ac_d))} | "
            f"{_f(mm_d, 'd')} -> {_f(mm_s, 'd')} |")
    return "\n".join(lines)


def rows_table(rows: list[dict]) -> str:
    cols = [("size", "s"), ("path", "s"), ("micro_batch", "d"), ("train_tok_per_ms", ".1f"),
            ("train_tok_per_ms_wall", ".1f"), ("redos", "d"), ("fwd_tok_per_ms", ".1f"),
            ("peak_gb", ".2f"), ("activation_peak_gb", ".2f"), ("energy_j_per_tok", ".3g"),
            ("mfu", ".3f"), ("mfu_useful", ".3f"), ("train_speedup_vs_dense", ".3f"),
            ("train_speedup_vs_hf", ".3f"), ("fwd_speedup", ".3f"), ("activation_mem_ratio", ".3f"),
            ("max_micro_batch", "d"), ("max_micro_est", "d"), ("loss_diff_vs_hf", ".2g"),
            ("check_ok", "s"), ("notes", "s")]
    out = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c, fmt in cols:
            v = r.get(c)
            if v in (None, ""):
                cells.append("")
            elif fmt == "s":
                cells.append(str(v))
            else:
                cells.append(format(int(v) if fmt == "d" else v, fmt))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def write_report(out: Path, rows: list[dict], prof: list[dict], breakdown: list[dict],
                 meta: dict | None = None, plot: bool = True) -> str:
    """Markdown (``bench_model.md``) and PNG plots from the rows; returns the summary table."""
    add_ratios(rows)
    table = summary_table(rows, prof)
    md = ["# Whole-model benchmark (scripts/bench_model.py)", ""]
    if meta:  # the scalars and short entries; everything is in bench_meta.json
        md += [f"- {k}: {v}" for k, v in meta.items()
               if not isinstance(v, (list, dict)) or len(str(v)) < 300] + [""]
    md += ["Dense = our faster dense path at the equal micro-batch (`dense_ref`); sparse = `auto`.",
           "Every number is a row of `bench_model.csv`.", "", table, "", "## All rows", "",
           rows_table(rows), ""]
    if prof:
        md += ["## Sparsity profile (held-out tokens)", "",
               "| size | layer | L0 | max nnz | dead % | hot 1 % share | heavy rows |",
               "|---|---|---|---|---|---|---|"]
        md += [f"| {p['size']} | {p['layer']} | {p['l0']:.1f} | {p['l0_max']:.0f} | "
               f"{p['dead_pct']:.1f} | {100 * p['hot1_share']:.1f} % | "
               f"{100 * p['heavy_frac']:.2f} % |" for p in prof]
        md.append("")
    if breakdown:
        md += ["## Profile breakdown of one training step", "",
               "| size | path | category | ms / step | share |", "|---|---|---|---|---|"]
        md += [f"| {b['size']} | {b['path']} | {b['category']} | {b['ms_per_step']:.2f} | "
               f"{100 * b['share']:.1f} % |" for b in breakdown]
        md.append("")
    (out / "bench_model.md").write_text("\n".join(md))
    if not plot:
        return table
    try:
        plots(out, rows, prof)
    except ImportError as e:
        log(f"plots skipped ({e}); render them elsewhere with --report")
    return table


def plots(out: Path, rows: list[dict], prof: list[dict]) -> None:
    """bench_throughput.png (train and forward tok/ms per path), bench_memory.png (static +
    activation peak per path), bench_l0.png (per-layer L0 and max non-zeros per token)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["size"] for r in rows))
    eq = {}
    for size in sizes:
        ms = sorted({int(r["micro_batch"]) for r in rows if r["size"] == size
                     and r.get("train_tok_per_ms") not in (None, "")})
        eq[size] = ms[0] if ms else None

    def sel(size):
        return [r for r in rows if r["size"] == size and r.get("micro_batch") not in (None, "")
                and int(r["micro_batch"]) == eq[size]
                and r.get("train_tok_per_ms") not in (None, "")]

    if any(sel(s) for s in sizes):
        fig, axes = plt.subplots(len(sizes), 2, figsize=(11, 3.2 * len(sizes)), squeeze=False)
        for ax, size in zip(axes, sizes):
            rs = sel(size)
            names = [r["path"] for r in rs]
            ax[0].bar(names, [r["train_tok_per_ms"] for r in rs], color="tab:blue")
            ax[0].set_title(f"{size}: training step, micro {eq[size]}")
            ax[0].set_ylabel("tokens / ms")
            fw = [(r["path"], r["fwd_tok_per_ms"]) for r in rs
                  if r.get("fwd_tok_per_ms") not in (None, "")]
            if fw:
                ax[1].bar([n for n, _ in fw], [v for _, v in fw], color="tab:green")
            ax[1].set_title(f"{size}: forward (decoder stack, --fwd-batch)")
            for a in ax:
                a.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        fig.savefig(out / "bench_throughput.png", dpi=110)
        plt.close(fig)
        memrows = [(s, sel(s)) for s in sizes if any(r.get("peak_gb") not in (None, "")
                                                     for r in sel(s))]
        if memrows:
            fig, axes = plt.subplots(1, len(memrows), figsize=(5.5 * len(memrows), 3.5),
                                     squeeze=False)
            for ax, (size, rs) in zip(axes[0], memrows):
                rs = [r for r in rs if r.get("peak_gb") not in (None, "")]
                names = [r["path"] for r in rs]
                st = [r["static_gb"] for r in rs]
                ac = [r["activation_peak_gb"] for r in rs]
                ax.bar(names, st, label="static (weights, grads, AdamW)", color="tab:gray")
                ax.bar(names, ac, bottom=st, label="activation peak", color="tab:orange")
                ax.set_ylabel("GiB")
                ax.set_title(f"{size}: peak training memory, micro {eq[size]}")
                ax.tick_params(axis="x", rotation=30)
                ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(out / "bench_memory.png", dpi=110)
            plt.close(fig)
    if prof:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for size in dict.fromkeys(p["size"] for p in prof):
            ps = [p for p in prof if p["size"] == size]
            ax.plot([p["layer"] for p in ps], [p["l0"] for p in ps], marker="o", label=f"{size} L0")
            ax.plot([p["layer"] for p in ps], [p["l0_max"] for p in ps], ls=":",
                    label=f"{size} max per token")
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("active FFN units per token")
        ax.legend(fontsize=8)
        ax.set_title("Per-layer L0 on held-out tokens")
        fig.tight_layout()
        fig.savefig(out / "bench_l0.png", dpi=110)
        plt.close(fig)


def report_mode(src: Path, out: Path) -> str:
    """``--report``: rebuild the markdown and plots from the CSVs in ``src`` (CPU)."""
    csv_path = src / "bench_model.csv"
    if not csv_path.is_file():
        sys.exit(f"--report {src}: no bench_model.csv there (run the benchmark first)")
    rows = read_csv(csv_path)
    prof_p = src / "sparsity_profile.csv"
    prof = read_csv(prof_p) if prof_p.is_file() else []
    br = read_csv(src / "profile.csv") if (src / "profile.csv").is_file() else []
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "bench_model.csv", CSV_COLUMNS)
    meta_p = src / "bench_meta.json"
    meta = json.loads(meta_p.read_text()) if meta_p.is_file() else None
    return write_report(out, rows, prof, br, meta, plot=True)


# ---------------------------------------------------------------- profile


# Profile categories: ffn_gemm = cuBLAS products inside the FFN (the gate GEMM on the ELL path;
# gate, up and down in dense mode / torch; forward, recomputation and backward); ffn_sparse_and_
# elementwise = the FFN's other kernels (TwELL / sparse-training Triton kernels, fused or PyTorch
# elementwise passes); attention_* = inside self_attn (SDPA kernels, q/k/v/o products, RoPE and
# the rest); lm_head_loss = the LM head product and the cross-entropy; optimizer = AdamW, zero_grad
# and the gradient clip; casts = dtype conversions (aten::_to_copy: autocast's weight casts);
# elementwise_norm_other = norms, residual adds, embedding, gradient accumulation; unattributed =
# device time no op claimed; idle_host = step time with the device idle (host work, syncs).
CATEGORIES = ("ffn_gemm", "ffn_sparse_and_elementwise", "attention_sdpa", "attention_proj_gemm",
              "attention_other", "lm_head_loss", "optimizer", "casts", "elementwise_norm_other",
              "unattributed", "idle_host")
_GEMM = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "s16816", "mma_",
         "aten::mm", "aten::addmm", "aten::bmm")  # device kernel names; CPU op names
_SDPA = ("flash", "fmha", "attention", "sdpa", "efficient")
_LOSS = ("cross_entropy", "log_softmax", "nll_loss", "logsumexp", "fused_linear_cross")


def install_scopes(model):
    """Name the regions of a step for the profiler (``bench::attn``, ``bench::ffn``,
    ``bench::decoder``, ``bench::causal_lm``) by wrapping module forwards (instance attributes:
    also re-entered by gradient checkpointing's recomputation). Returns an undo function."""
    from torch.profiler import record_function

    undo = []

    def wrap(mod, name):
        fwd = mod.forward
        had = "forward" in mod.__dict__

        def scoped(*args, **kw):
            with record_function(f"bench::{name}"):
                return fwd(*args, **kw)

        mod.forward = scoped
        undo.append((mod, fwd, had))

    wrap(model, "causal_lm")
    wrap(model.model, "decoder")
    for layer in model.model.layers:
        wrap(layer.self_attn, "attn")
        wrap(layer.mlp, "ffn")

    def restore():
        for mod, fwd, had in reversed(undo):
            if had:
                mod.forward = fwd
            else:
                del mod.forward
    return restore


def categorise(kernel: str, chain: list[str], scopes: set[str]) -> str:
    """Category of one device kernel (or CPU leaf op) from its name, the names of its launching
    op and that op's ancestors (``chain``, innermost first) and the ``bench::`` scopes of the
    forward code it belongs to (``scopes``; for a backward op, its forward op's)."""
    k = kernel.lower()
    names = [c.lower() for c in chain]
    if any(n.startswith("optimizer.") for n in names) or "clip" in scopes:
        return "optimizer"
    if any(n in ("aten::_to_copy", "aten::to") for n in names):
        return "casts"
    if "ffn" in scopes or any(n.startswith("twell::") for n in names):
        return "ffn_gemm" if any(g in k for g in _GEMM) else "ffn_sparse_and_elementwise"
    if "attn" in scopes:
        if any(s in k for s in _SDPA) or any("attention" in n for n in names):
            return "attention_sdpa"
        return "attention_proj_gemm" if any(g in k for g in _GEMM) else "attention_other"
    if ("causal_lm" in scopes and "decoder" not in scopes) or any(
            any(s in n for s in _LOSS) for n in names + [k]):
        return "lm_head_loss"
    return "elementwise_norm_other"


def summarise_profile(events, n_steps: int, wall_ms: float, on_gpu: bool) -> tuple[dict, list]:
    """Milliseconds per step by category (:data:`CATEGORIES`) from ``prof.events()``.

    GPU: each device kernel is charged to the op that launched it; CPU (smoke): each leaf op's
    self time. ``idle_host`` = step wall time - busy time (the union of the kernels' intervals on
    GPU, the summed leaf time on CPU). Backward ops take their forward op's scopes (autograd's
    sequence number links them). Returns ({category: ms per step}, top kernels)."""
    from torch.autograd import DeviceType

    scope_cache: dict[int, tuple] = {}

    def walk(e):
        """(names innermost first, bench scopes, the backward node met first or None)."""
        key = id(e)
        if key in scope_cache:
            return scope_cache[key]
        names, scopes, bwd = [], set(), None
        cur = e
        direct = True
        while cur is not None:
            n = cur.name
            names.append(n)
            if n.startswith("bench::") and direct:
                scopes.add(n[len("bench::"):])
            elif n.startswith("autograd::engine::evaluate_function") and not scopes and direct:
                bwd = cur
                direct = False
            cur = cur.cpu_parent
        scope_cache[key] = (names, scopes, bwd)
        return scope_cache[key]

    fwd_scopes: dict[tuple, set] = {}
    cpu_events = [e for e in events if e.device_type == DeviceType.CPU]
    for e in cpu_events:
        if e.sequence_nr >= 0 and not e.name.startswith("autograd::"):
            _n, sc, bwd = walk(e)
            if bwd is None and sc:
                fwd_scopes.setdefault((e.sequence_nr, e.thread), sc)

    totals = dict.fromkeys(CATEGORIES, 0.0)
    per_kernel: dict[tuple, list] = {}

    def charge(name, e, us):
        names, sc, bwd = walk(e)
        if bwd is not None:
            sc = set(fwd_scopes.get((bwd.sequence_nr, bwd.fwd_thread), set()))
        cat = categorise(name, names, sc)
        totals[cat] += us / 1e3
        k = per_kernel.setdefault((name[:90], cat), [0.0, 0])
        k[0] += us / 1e3
        k[1] += 1

    busy_ms = 0.0
    if on_gpu:
        for e in cpu_events:
            for kern in e.kernels:
                charge(kern.name, e, kern.duration)
        iv = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.device_type == DeviceType.CUDA)
        end = -math.inf
        for s, t in iv:
            if t <= end:
                continue
            busy_ms += (t - max(s, end)) / 1e3
            end = t
    else:
        for e in cpu_events:  # every op's own time once (a scope's own time is host overhead)
            if not e.name.startswith(("bench::", "autograd::engine", "Optimizer.")):
                charge(e.name, e, e.self_cpu_time_total)
        busy_ms = sum(v for k, v in totals.items() if k != "idle_host")
    if on_gpu:  # kernels no op claimed (e.g. a launch outside any profiled op)
        totals["unattributed"] = max(0.0, busy_ms - sum(totals.values()))
    per_step = {k: v / n_steps for k, v in totals.items()}
    per_step["idle_host"] = max(0.0, wall_ms / n_steps - busy_ms / n_steps)
    top = sorted(((v[0] / n_steps, v[1] / n_steps, n, c) for (n, c), v in per_kernel.items()),
                 reverse=True)[:25]
    return per_step, top


def profile_trainer(tr, batches, n_warm: int, n_steps: int, dev,
                    ref_step_ms: float | None = None) -> tuple[dict, list, float, float]:
    """Profile ``n_steps`` training steps of a trainer (after ``n_warm``); returns the
    category breakdown, the top kernels, the step time the shares refer to (``ref_step_ms``, the
    unprofiled median, when given: the profiler's own host overhead would inflate idle/host) and
    the profiled wall ms per step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    interval = tr._new_interval()
    for _ in range(n_warm):
        tr.train_step(batches, interval)
    model = tr.acc.unwrap_model(tr.model)
    restore = install_scopes(model)
    clip = tr.acc.clip_grad_norm_

    def scoped_clip(*a, **k):
        with record_function("bench::clip"):
            return clip(*a, **k)

    tr.acc.clip_grad_norm_ = scoped_clip
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    try:
        sync(dev)
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(n_steps):
                tr.train_step(batches, interval)
            sync(dev)
            wall_ms = 1e3 * (time.perf_counter() - t0)
    finally:
        restore()
        del tr.acc.clip_grad_norm_
    step_ms = ref_step_ms if ref_step_ms else wall_ms / n_steps
    per_step, top = summarise_profile(prof.events(), n_steps, step_ms * n_steps,
                                      dev.type == "cuda")
    del prof
    free_memory()
    return per_step, top, step_ms, wall_ms / n_steps


# ---------------------------------------------------------------- the run


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--sizes", default="1p5b", help="model shapes, comma-separated (configs/model)")
    p.add_argument("--train-steps", type=int, default=None, help="stage-1 steps (default 200)")
    p.add_argument("--train-budget", type=float, default=None,
                   help="stage-1 seconds per size before it stops (default 0.45 x --deadline)")
    p.add_argument("--l1", type=float, default=3e-4, help="sparsity.l1_coeff of stage 1")
    p.add_argument("--lr", type=float, default=1e-3, help="optim.lr of stage 1")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="optim.warmup_steps of stage 1 (10)")
    p.add_argument("--micro", type=int, default=None,
                   help="stage-1 micro-batch and the equal micro-batch of stage 2 (default 8)")
    p.add_argument("--log-every", type=int, default=25, help="stage-1 log interval (steps)")
    p.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE",
                   help="Hydra overrides for every trainer (stage 1 and all our paths)")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                   help="Hydra overrides for our measured paths only (not stage 1, not hf)")
    p.add_argument("--variants", nargs="*", default=[], metavar="NAME=BASE[:K=V,...]",
                   help="extra rows: a base path (torch|dense_mode|ell|auto) with overrides")
    p.add_argument("--paths", default=",".join(PATHS), help="paths to measure")
    p.add_argument("--steps", type=int, default=None, help="timed steps per measurement (10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (3)")
    p.add_argument("--steps-large", type=int, default=None,
                   help="timed steps at micro-batches above --micro (3; warm-up 1)")
    p.add_argument("--micro-list", default=None, help="micro-batches tried, ascending (8,16,32)")
    p.add_argument("--max-micro", type=int, default=32, help="largest micro-batch tried")
    p.add_argument("--fwd-batch", type=int, default=None, help="forward batch (16 sequences)")
    p.add_argument("--fwd-steps", type=int, default=None, help="timed forwards (8)")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler breakdown of a few auto and ell steps")
    p.add_argument("--profile-paths", default="auto,ell", help="paths to profile")
    p.add_argument("--profile-tokens", type=int, default=None,
                   help="held-out tokens of the sparsity profile (65536)")
    p.add_argument("--acts-dir", type=Path, default=None,
                   help="save recorded FFN inputs (low / median / high L0 layers) here")
    p.add_argument("--acts-tokens", type=int, default=16384, help="tokens per recorded layer")
    p.add_argument("--deadline", type=float, default=480.0, help="seconds for the whole run")
    p.add_argument("--out", type=Path, default=None, help="output dir ($OUT or docs/model_bench)")
    p.add_argument("--work-dir", type=Path, default=None, help="trainer run dirs (a temp dir)")
    p.add_argument("--no-plots", dest="plots", action="store_false",
                   help="no PNGs (render them later with --report; the device returns 8 files)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (tests)")
    p.add_argument("--report", type=Path, default=None, metavar="DIR",
                   help="only rebuild the markdown and plots from DIR's CSVs")
    a = p.parse_args(argv)
    smoke = a.smoke
    defaults = {  # (--smoke, GPU)
        "train_steps": (6, 200), "warmup_steps": (2, 10), "micro": (4, 8), "steps": (2, 10),
        "warmup": (1, 3), "steps_large": (1, 3), "micro_list": ("4,8", "8,16,32"),
        "fwd_batch": (4, 16), "fwd_steps": (2, 8), "profile_tokens": (256, 65536)}
    for k, (s, g) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, s if smoke else g)
    if smoke:
        a.sizes = "smoke"
        a.max_micro = min(a.max_micro, 8)
    if a.train_budget is None:
        a.train_budget = 0.45 * a.deadline
    a.micro_list = sorted({int(x) for x in str(a.micro_list).split(",") if x} | {a.micro})
    a.paths = [x for x in a.paths.split(",") if x]
    bad = [x for x in a.paths if x not in PATHS]
    if bad:
        sys.exit(f"--paths: unknown {bad}; use some of {', '.join(PATHS)}")
    ctl = [o for o in a.override + a.config if _key(o).startswith(CONTROLLED)]
    if ctl:
        sys.exit(f"override {ctl[0]!r} sets a key the script controls ({', '.join(CONTROLLED)}); "
                 "use --paths / --micro / --micro-list / --train-steps instead")
    a.variant_specs = parse_variants(a.variants)
    if a.out is None and a.report is not None:
        a.out = a.report
    if a.out is None:
        a.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "docs" / "model_bench"
    return a


class Bench:
    """The state of one run: rows written after every measurement."""

    def __init__(self, a) -> None:
        self.a = a
        self.rows: list[dict] = []
        self.prof: list[dict] = []
        self.breakdown: list[dict] = []
        self.kernels: list[dict] = []
        self.meta: dict = {}
        a.out.mkdir(parents=True, exist_ok=True)

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        self.flush()
        return row

    def flush(self) -> None:
        add_ratios(self.rows, self.a.micro)
        write_csv(self.rows, self.a.out / "bench_model.csv", CSV_COLUMNS)
        if self.prof:
            write_csv(self.prof, self.a.out / "sparsity_profile.csv", PROFILE_COLUMNS)
        if self.breakdown:
            write_csv(self.breakdown, self.a.out / "profile.csv", BREAKDOWN_COLUMNS)
            write_csv(self.kernels, self.a.out / "profile_kernels.csv", KERNEL_COLUMNS)
        (self.a.out / "bench_meta.json").write_text(json.dumps(self.meta, indent=1, default=str))


def run_size(bench: Bench, size: str, clock: Clock, energy: Energy, work: Path,
             smoke_tokens: Path | None) -> None:
    import torch

    from train.metrics import device_peak_flops

    a = bench.a
    base = stage1_overrides(a, size, smoke_tokens)
    cfg1 = compose(base)
    # ---- stage 1: make the sparse model
    t0 = time.monotonic()
    tr = build_trainer(cfg1, work / f"{size}_train", None, None, None,
                       torch.device("cuda") if (torch.cuda.is_available() and not a.smoke)
                       else torch.device("cpu"))
    dev = tr.device
    bf16 = tr.precision == "bf16"
    n_params = tr.n_params
    peak_flops = device_peak_flops(dev, tr.precision, cfg1.trainer.peak_tflops)
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    dev_mem = (torch.cuda.get_device_properties(dev).total_memory / GIB
               if dev.type == "cuda" else None)
    bench.meta.update({"device": dev_name, "torch": torch.__version__, "argv": sys.argv[1:],
                       f"{size}_stage1_overrides": base})
    log(f"{size}: stage 1: {n_params / 1e6:.0f} M parameters on {dev_name}, built in "
        f"{time.monotonic() - t0:.1f} s; training {a.train_steps} steps "
        f"(budget {a.train_budget:.0f} s)")
    res = train_sparse(tr, a.train_steps, a.log_every, min(a.train_budget, clock.left() - 60))
    step_s8 = (a.micro * cfg1.model.seq_len) / max(res["last"].get("tokens_per_s") or 1.0, 1e-9)
    log_rows = []
    if (tr.run_dir / "metrics.jsonl").is_file():  # stage 1's log lines (kept in bench_meta.json)
        log_rows = [json.loads(x) for x in (tr.run_dir / "metrics.jsonl").read_text().splitlines()
                    if x.strip()]
    bench.meta[f"{size}_stage1"] = {"steps": res["steps"], "seconds": round(res["seconds"], 1),
                                    "metrics": log_rows}
    dm = tr.data
    model1 = tr.acc.unwrap_model(tr.model)
    seq = cfg1.model.seq_len
    vb = val_blocks(dm, max(1, a.profile_tokens // seq))
    if vb is None:
        log("no held-out split: the sparsity profile uses training blocks")
        vb = train_pool(dm, max(1, a.profile_tokens // seq))
    prof = sparsity_profile(model1, tr.mlps, vb, a.micro, dev, bf16)
    for r in prof:
        r["size"] = size
    bench.prof += prof
    l0_L = [r["l0"] for r in prof]
    l0_mean = sum(l0_L) / len(l0_L)
    log(f"{size}: held-out L0 {l0_mean:.1f} per token (layers {min(l0_L):.1f}-{max(l0_L):.1f}), "
        f"max {max(r['l0_max'] for r in prof):.0f}, dead "
        f"{sum(r['dead_pct'] for r in prof) / len(prof):.1f} %, hot-1 % share "
        f"{100 * sum(r['hot1_share'] for r in prof) / len(prof):.1f} %")
    if a.acts_dir is not None:
        from twell.nn.record import ffn_input_stats, ffn_weights, record_ffn_inputs, save_ffn_layer

        n_blocks = max(1, a.acts_tokens // seq)
        blocks = vb[:n_blocks] if vb.shape[0] >= n_blocks else train_pool(dm, n_blocks)
        impls = [m.impl for m in tr.mlps]
        for m in tr.mlps:
            m.impl = "torch"
        model1.eval()
        for layer, x in record_ffn_inputs(model1, blocks, pick_layers(prof), batch=a.micro).items():
            wg, wu, wd = ffn_weights(model1, layer)
            meta = {"size": size, "layer": layer, "source": f"bench_model {size}",
                    **ffn_input_stats(x.to(dev), wg if wg is not None else wu)}
            out = save_ffn_layer(a.acts_dir / f"acts_{size}_l{layer}.safetensors", x, wg, wu, wd,
                                 meta)
            (a.acts_dir / f"acts_{size}_l{layer}.json").write_text(json.dumps(meta, indent=1))
            log(f"recorded layer {layer} -> {out}: L0 {meta['l0_mean']:.1f}, hot-1 % share "
                f"{100 * meta['top1pct_unit_share']:.1f} %")
        for m, impl in zip(tr.mlps, impls):
            m.impl = impl
    sparse_state = {"paths": [m.train_path for m in tr.mlps],
                    "backup_rows": [m.backup_rows for m in tr.mlps],
                    "heavy_hist": [list(h) for h in tr.heavy_hist]}
    bench.meta[f"{size}_auto_paths"] = sparse_state["paths"]
    weights = cpu_weights(model1)
    if dev.type == "cuda":  # pinned: every measured model loads them (~2x faster copies)
        weights = {k: v.pin_memory() for k, v in weights.items()}
    pool = train_pool(dm, max(4 * a.micro, max(a.micro_list), a.fwd_batch))
    check_ids = vb[: min(2, vb.shape[0])]
    del model1
    close_trainer(tr)
    del tr
    free_memory()
    bench.flush()
    log(f"{size}: stage 1 done at {clock.elapsed():.0f} s; {allocated_gb(dev) or 0:.2f} GB "
        "left allocated")

    # ---- checks: logits parity (fp32) and the reference losses
    checks = {}
    with torch.no_grad():
        hf = build_hf(cfg1.model, weights, dev).eval()
        ours = build_ours(cfg1.model, weights, dev).eval()
        for m in ours.modules():
            if hasattr(m, "collect_stats"):
                m.collect_stats, m.impl = False, "torch"
        small = check_ids[:, : min(seq, 256)].to(dev)
        lh = hf(input_ids=small).logits.float()
        lo = ours(input_ids=small).logits.float()
        checks["logits_rel_err"] = ((lo - lh).norm() / lh.norm()).item()
        del ours, lh, lo
        ids = check_ids.to(dev)
        checks["hf_loss_fp32"] = hf(input_ids=ids, labels=ids).loss.item()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            checks["hf_loss_bf16"] = hf(input_ids=ids, labels=ids).loss.item()
        del hf
    free_memory()
    noise = abs(checks["hf_loss_bf16"] - checks["hf_loss_fp32"])
    tol = max(4 * noise, 2e-3 * abs(checks["hf_loss_fp32"]))
    checks["loss_tol"] = tol
    checks["logits_ok"] = checks["logits_rel_err"] < 1e-4
    bench.meta[f"{size}_checks"] = checks
    log(f"{size}: logits hf vs ours (fp32) rel err {checks['logits_rel_err']:.2e} "
        f"({'PASS' if checks['logits_ok'] else 'FAIL'}); hf loss fp32 {checks['hf_loss_fp32']:.4f}"
        f" bf16 {checks['hf_loss_bf16']:.4f} -> path tolerance {tol:.4f}")

    specs = [(p, p, []) for p in a.paths] + list(a.variant_specs)
    common = {"size": size, "seq_len": seq, "l0_mean": l0_mean, "device": dev_name,
              "device_mem_gb": dev_mem, "n_params": n_params}
    run_id = [0]

    def new_trainer(name, base_path, extra):
        run_id[0] += 1
        cfg = compose(path_overrides(base, IMPL[base_path], a, extra))
        tr = build_trainer(cfg, work / f"{size}_{run_id[0]}_{name}", dm, weights,
                           sparse_state if base_path == "auto" else None, dev,
                           pin_dense=base_path == "dense_mode")
        zero_lr(tr)
        tr.model.train()
        for m in tr.mlps:
            m.collect_stats = True
        return tr

    def est(name, micro, n):
        per = timings.get(name, step_s8) * micro / a.micro
        return build_s[0] + (n + 1) * per * 1.3

    timings: dict[str, float] = {}
    build_s = [5.0 if dev.type == "cuda" else 1.0]

    def finish(row, t, micro, n_steps) -> dict:
        row.update(timing_row(t, micro, seq, n_params))
        row.update(mfu_fields(cfg1.model, row["train_tok_per_ms"], peak_flops, l0_L))
        if micro == a.micro:
            timings[row["path"]] = row["step_ms_median"] / 1e3
        bench.add(row)
        log(f"{size} {row['path']:>12} micro {micro:>3}: {row['train_tok_per_ms']:.1f} tok/ms "
            f"(median of {n_steps}; wall {row['train_tok_per_ms_wall']:.1f}), peak "
            f"{_f(row['peak_gb'], '.2f')} GB, activation {_f(row['activation_peak_gb'], '.2f')} GB,"
            f" redos {row.get('redos', 0)}" + (
                f", loss diff vs hf {row['loss_diff_vs_hf']:+.4f}"
                if row.get("loss_diff_vs_hf") is not None else ""))
        return row

    def run_micros(name, base_path, extra, micros, n_warm, n_steps, check, at) -> list[dict]:
        """Build the path once (plain transformers, or a fresh trainer with the trained weights
        and, for auto, the trained per-layer state), check its loss (``check``), then time each
        micro-batch of ``micros`` in turn; an out-of-memory ends the list (recorded as a row).
        The model lives in this frame only; ``at["micro"]`` is the micro-batch being run."""
        done: list[dict] = []

        def new_row(micro):
            return {**common, "path": name, "base_path": base_path, "micro_batch": micro,
                    "overrides": " ".join([*a.override, *extra]) if name != "hf" else ""}

        t_build = time.monotonic()
        if name == "hf":
            cfg = compose(path_overrides(base, "torch", a, [], user=False))
            stepper = HFStep(build_hf(cfg.model, weights, dev), cfg, dev)
            tr = None
        else:
            tr = new_trainer(name, base_path, extra)
        try:
            build_s[0] = max(build_s[0], time.monotonic() - t_build)
            first = {}
            if check and tr is None:
                first = {"loss_check": checks["hf_loss_bf16"], "loss_diff_vs_hf": 0.0,
                         "check_ok": checks["logits_ok"]}
            elif check:
                ids = check_ids.to(dev)
                caps = [m.backup_rows for m in tr.mlps]
                for m in tr.mlps:  # measured per call: the check batch is not a training batch
                    m.backup_rows = -1
                loss = tr.model(input_ids=ids, labels=ids).loss.item()
                for m, c in zip(tr.mlps, caps):
                    m.last_stats, m.backup_rows = None, c  # drop the check forward's graph
                diff = loss - checks["hf_loss_bf16"]
                first = {"loss_check": loss, "loss_diff_vs_hf": diff,
                         "check_ok": bool(abs(diff) <= tol and checks["logits_ok"])}
            for micro in micros:
                if done and not clock.fits(est(name, micro, n_warm + n_steps) - build_s[0],
                                           f"{size} {name} micro {micro}"):
                    break
                at["micro"] = micro
                row = {**new_row(micro), **(first if micro == micros[0] else {})}
                batches = batches_from(pool, micro, seed=micro)
                oom = False
                try:
                    if tr is None:
                        t = time_steps(lambda b=batches: stepper(next(b)), n_warm, n_steps, dev,
                                       energy)
                    else:
                        set_micro(tr, micro)
                        warm_iv, iv = tr._new_interval(), tr._new_interval()
                        for _ in range(n_warm):
                            tr.train_step(batches, warm_iv)
                        t = time_steps(lambda b=batches, v=iv: tr.train_step(b, v), 0, n_steps,
                                       dev, energy)
                        row["redos"] = iv.get("backup_redos", 0)
                        toks = max(iv["ffn_tokens"], 1)
                        row["l0_timed"] = iv["nnz_sum_L"].sum().item() / toks / len(tr.mlps)
                        if base_path == "auto":
                            paths = [m.train_path for m in tr.mlps]
                            row["notes"] = f"ell layers {paths.count('twell')}/{len(paths)}"
                except Exception as e:
                    if not is_oom(e):
                        raise
                    oom = True
                if oom:  # outside the except clause: its traceback no longer holds tensors
                    (stepper.opt if tr is None else tr.optimizer).zero_grad(set_to_none=True)
                    free_memory()
                    log(f"{size} {name} micro {micro}: out of memory")
                    done.append(bench.add({**row, "oom": True, "notes": "out of memory"}))
                    break
                done.append(finish(row, t, micro, n_steps))
                free_memory()
        finally:
            if tr is not None:
                close_trainer(tr)
        return done

    def measure(name, base_path, extra, micros, n_warm, n_steps, check: bool) -> list[dict]:
        """Rows of one path over ``micros`` (skipped when the first does not fit the deadline;
        a failure other than out-of-memory becomes a row with its message in ``notes``)."""
        if not clock.fits(est(name, micros[0], n_warm + n_steps),
                          f"{size} {name} micro {micros[0]}"):
            return []
        free_memory()
        failed, at = None, {"micro": micros[0]}
        try:
            return run_micros(name, base_path, extra, micros, n_warm, n_steps, check, at)
        except Exception as e:  # noqa: BLE001  (one failed measurement must not end the run)
            failed = f"{'out of memory' if is_oom(e) else 'failed'}: {type(e).__name__}: " \
                     f"{str(e)[:160]}"
        free_memory()
        log(f"{size} {name} micro {at['micro']}: {failed}")
        bench.add({**common, "path": name, "base_path": base_path, "micro_batch": at["micro"],
                   "notes": failed, "oom": failed.startswith("out of memory") or None})
        return []

    # round A: equal micro-batch, every path and variant (with the checks)
    for name, bp, extra in specs:
        measure(name, bp, extra, [a.micro], a.warmup, a.steps, check=True)

    # round B: forward (bf16 weights, eval, no grad, decoder stack)
    fwd_ids = pool[: a.fwd_batch]
    if fwd_ids.shape[0] < a.fwd_batch:
        fwd_ids = pool.repeat(math.ceil(a.fwd_batch / pool.shape[0]), 1)[: a.fwd_batch]
    # two model builds, then per path (fwd_steps + 2) forwards of ~1/3 of a training step each
    n_fwd = len(set(a.paths) | {bp for _n, bp, _e in a.variant_specs})
    fwd_est = 2 * build_s[0] + n_fwd * (a.fwd_steps + 2) * step_s8 * a.fwd_batch / a.micro / 3
    if clock.fits(fwd_est, f"{size} forward"):
        try:
            fwd = measure_forward(a, cfg1.model, weights, fwd_ids, dev, bf16)
        except Exception as e:  # noqa: BLE001  (keep the training rows and go on)
            log(f"{size} forward FAILED: {type(e).__name__}: {e}")
            fwd = {}
        free_memory()
        for name, bp, _extra in specs:
            v = fwd.get(name, fwd.get(bp))
            if v is None:
                continue
            hit = [r for r in bench.rows if r["size"] == size and r["path"] == name]
            for r in hit or [bench.add({**common, "path": name, "base_path": bp})]:
                r["fwd_tok_per_ms"], r["fwd_ms_median"] = v
                r["fwd_batch"] = a.fwd_batch
            log(f"{size} {name:>12} forward {a.fwd_batch} x {seq}: {v[0]:.1f} tok/ms")
        bench.flush()

    def profile_path(name, ref_s):
        tr = new_trainer(name, name, [])
        try:
            set_micro(tr, a.micro)
            return profile_trainer(tr, batches_from(pool, a.micro), 2, 3, dev,
                                   None if ref_s is None or dev.type != "cuda" else 1e3 * ref_s)
        finally:
            close_trainer(tr)

    # round C (optional): profile breakdown
    if a.profile:
        for name in [p for p in a.profile_paths.split(",") if p in IMPL]:
            if not clock.fits(est(name, a.micro, 8) + 30, f"{size} profile {name}"):
                continue
            ref = timings.get(name)
            try:
                per_step, top, step_ms, prof_ms = profile_path(name, ref)
            except Exception as e:  # noqa: BLE001  (the profile is optional)
                log(f"{size} profile {name} FAILED: {type(e).__name__}: {e}")
                continue
            bench.meta[f"{size}_profile_{name}"] = {"step_ms": step_ms, "profiled_step_ms": prof_ms}
            bench.breakdown += [{"size": size, "path": name, "category": c, "ms_per_step": v,
                                 "share": v / step_ms} for c, v in per_step.items()]
            bench.kernels += [{"size": size, "path": name, "kernel": n, "category": c,
                               "ms_per_step": ms, "calls_per_step": k} for ms, k, n, c in top]
            bench.flush()
            log(f"{size} profile {name}: {step_ms:.1f} ms/step ({prof_ms:.1f} under the profiler): "
                + ", ".join(
                f"{c} {v:.1f}" for c, v in sorted(per_step.items(), key=lambda kv: -kv[1]) if v))

    # round D: larger micro-batches, ascending, stop at the first out-of-memory
    larger = [m for m in a.micro_list if a.micro < m <= a.max_micro]
    for name, bp, extra in specs:
        if larger and any(r["path"] == name and r["size"] == size and r.get("train_tok_per_ms")
                          for r in bench.rows):
            measure(name, bp, extra, larger, 1, a.steps_large, check=False)


def measure_forward(a, model_cfg, weights: dict, ids, dev, bf16: bool) -> dict:
    """Forward tok/ms and median ms per path: {path: (tok_per_ms, ms)}."""
    import torch

    from twell.ops.ffn import TwELLState

    dtype = torch.bfloat16 if bf16 else None
    out = {}
    ids = ids.to(dev)
    n_tok = ids.numel()

    def timed(fn):
        t = time_steps(fn, 2, a.fwd_steps, dev, Energy(torch.device("cpu")))
        ms = statistics.median(t["step_ms"])
        return n_tok / ms, ms

    def timed_model(decoder):  # the model is freed when this returns
        return timed(lambda: decoder(input_ids=ids))

    with torch.no_grad():
        if "hf" in a.paths:
            out["hf"] = timed_model(build_hf(model_cfg, weights, dev, dtype).eval().model)
            free_memory()
        ours = build_ours(model_cfg, weights, dev, dtype).eval()
        mlps = [m for m in ours.modules() if hasattr(m, "twell_state")]
        for m in mlps:
            m.collect_stats = False
        decoder = ours.model
        for name in [p for p in a.paths if p != "hf"] + [bp for _n, bp, _e in a.variant_specs]:
            if name in out:
                continue
            for m in mlps:
                m.impl = IMPL[name]
                m.twell_state = TwELLState()
                if name == "dense_mode":  # auto's dense path on every call
                    m.twell_state.min_rows = 1 << 62
            try:
                out[name] = timed(lambda: decoder(input_ids=ids))
            except Exception as e:  # noqa: BLE001
                log(f"forward {name} FAILED: {type(e).__name__}: {e}")
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.report is not None:
        print(report_mode(a.report, a.out))
        return 0
    clock = Clock(a.deadline, reserve_s=2.0 if a.smoke else 10.0)
    import torch

    bench = Bench(a)
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="bench_model_"))
    smoke_tokens = None
    if a.smoke:
        from compare_ffn_paths import write_smoke_tokens

        smoke_tokens = write_smoke_tokens(work / "smoke_tokens.bin", n_tokens=30_000)
    dev = torch.device("cuda") if torch.cuda.is_available() and not a.smoke else \
        torch.device("cpu")
    energy = Energy(dev)
    for size in a.sizes.split(","):
        if clock.left() < 60 and not a.smoke:
            clock.skipped.append(f"size {size}")
            log(f"SKIP size {size}: {clock.left():.0f} s left")
            continue
        try:
            run_size(bench, size, clock, energy, work, smoke_tokens)
        except Exception as e:  # noqa: BLE001  (keep the other sizes and the outputs)
            import traceback

            traceback.print_exc()
            log(f"size {size} FAILED: {type(e).__name__}: {e}")
            bench.meta[f"{size}_error"] = f"{type(e).__name__}: {e}"
        free_memory()
    bench.meta["skipped"] = clock.skipped
    bench.meta["wall_s"] = round(clock.elapsed(), 1)
    bench.flush()
    table = write_report(a.out, bench.rows, bench.prof, bench.breakdown, bench.meta,
                         plot=a.plots)
    write_csv(bench.rows, a.out / "bench_model.csv", CSV_COLUMNS)
    if clock.skipped:
        print("skipped: " + "; ".join(clock.skipped))
    print(f"outputs: {a.out} ({clock.elapsed():.0f} s)")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
