"""The training loop: accelerate, bf16 autocast over fp32 master weights, L1 sparsity.

    twell-train                                           # tiny model, offline corpus, CPU
    twell-train model=tiny trainer.max_steps=20 sparsity.l1_coeff=2e-5 hydra.run.dir=DIR
    accelerate launch -m train experiment=paper_0p5b      # the paper recipe on a GPU node

One optimizer step (``train_step``) reads top to bottom: L1 coefficient, micro-steps
(forward, CE + l1_coeff * L1, backward; no host sync), gradient clip, the one host sync per step
(non-finite check and the FFN plan's statistics), the FFN plan's verdict (accept, or redo the
step), optimizer and scheduler step, dead-neuron window and optional re-init.
Logging, validation, evaluation, checkpoints and a requested stop (SIGTERM / SIGINT:
``train.interrupt``) happen between steps in ``train``.

Shape legend: B micro-batch (sequences), T sequence length, L layers, H FFN width.
"""

from __future__ import annotations

import json
import math
import os
import resource
import secrets
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import AutocastKwargs, set_seed
from omegaconf import OmegaConf

from evals.scoring import (  # light (torch only); the harness loads lazily
    ContinuationTooLong,
    NonFiniteScores,
)
from train import checkpoint as ckpt_io
from train import determinism, interrupt, memory, parallel, rundir
from train.checkpointer import (  # noqa: F401  (config_diff: callers import it from here)
    Checkpointer,
    NonFiniteLossError,
    config_diff,
    config_to_dict,
)
from train.config import ConfigError, OptimConfig, TrainConfig
from train.interrupt import StopRequested, StopSignals, TrainingInterrupted
from train.liger import liger_enabled, use_liger
from train.loss import use_distillation
from train.metrics import device_peak_flops, flops_per_token, mfu
from train.model import build_model, ffn_modules
from train.recompute import enable_grad_checkpointing
from train.requeue import override_arg
from train.sparsity import (
    DeadNeuronTracker,
    collect_stats,
    l1_coeff_at,
    l1_penalty,
    reinit_dead_gates,
)
from twell.nn import FFNPlan, StepStats


class OutOfMemory(ConfigError):
    """A training step ran out of memory and nothing could step down (on the CPU, or with
    ``trainer.memory=off``); the finished steps are saved first. One line (exit code 2)."""


shell_quote = ckpt_io.shell_quote


def is_cpu_out_of_memory(e: BaseException) -> bool:
    """Whether an error is the host running out of memory: Python's MemoryError, or PyTorch's
    CPU allocator failing (a RuntimeError "DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
        and "CPUAllocator" in str(e))


def _legacy_plan_state(d: dict, current: dict) -> dict:
    """The FFN plan state (``FFNPlan.state_dict``) of a trainer state written before the plan
    existed: its ``ffn_train_paths`` (auto's choices, the only impl that read them; ``twell`` is
    now ``ell``), ``ffn_backup_rows`` and ``ffn_backup_capacity`` (or the older
    ``ffn_heavy_hist``); what it lacks keeps ``current``."""
    out = dict(current)
    if "ffn_train_paths" in d:
        out["paths"] = ["ell" if p == "twell" else p for p in d["ffn_train_paths"]]
        out["impls"] = ["auto"] * len(out["paths"])
    if "ffn_backup_rows" in d:
        out["backup_rows"] = [int(r) for r in d["ffn_backup_rows"]]
    if "ffn_backup_capacity" in d:
        out["capacity"] = d["ffn_backup_capacity"]
    elif "ffn_heavy_hist" in d:
        out["capacity"] = {"rule": "window", "hist": d["ffn_heavy_hist"]}
    return out


def lr_factor(step: int, o: OptimConfig, max_steps: int) -> float:
    """Multiplier of ``optim.lr`` for optimizer step ``step`` (1-based).

    Linear warmup ``step / warmup_steps`` for ``step <= warmup_steps`` (peak at step
    ``warmup_steps``), then ``constant`` 1 or ``cosine`` from that peak towards ``min_lr_ratio``:
    ``r + (1 - r) * (1 + cos(pi * (step - warmup) / (max_steps - warmup + 1))) / 2``.
    Both ends are one step outside the run (factor 0 at step 0, ``min_lr_ratio`` at step
    ``max_steps + 1``), so no step runs at lr 0: step 1 at ``lr / warmup_steps``, the last step
    just above ``min_lr_ratio * lr`` (paper recipe: 600 warmup steps, then cosine).
    """
    w = o.warmup_steps
    if step <= w:
        return step / w
    if o.schedule == "constant":
        return 1.0
    progress = min((step - w) / (max_steps - w + 1), 1.0)
    r = o.min_lr_ratio
    return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * progress))


def summary_line(s: dict) -> str:
    """The one-line end of a run (printed last by ``twell-train``): step, train CE, validation
    loss, L0, dead % (n/a before a dead-unit window completed), eval mean (%, primary metric
    over the tasks) and tokens/s of the last training segment (labelled with its steps when the
    run was resumed)."""
    def f(v, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    ev = (s.get("eval") or {}).get("eval_mean")
    dead = s.get("dead_pct")
    seg = s.get("segment_steps")
    where = f" (steps {seg[0]}-{seg[1]})" if seg and seg[0] > 1 else ""  # a resumed segment
    return (f"done: step {s['step']} | train CE {f(s.get('final_train_ce'), '.4f')} | val loss "
            f"{f(s.get('val_loss'), '.4f')} | L0 {f(s.get('l0_mean'), '.1f')} | dead "
            f"{'n/a' if dead is None else format(dead, '.1f') + '%'} | eval mean "
            f"{'n/a' if ev is None else format(100 * ev, '.1f')} | "
            f"{f(s.get('tokens_per_s'), '.0f')} tok/s{where}")


def _duration(seconds: float) -> str:
    """``"1h02m"``, ``"3m05s"`` or ``"42s"``."""
    s = round(max(seconds, 0.0))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# FLOP/s of a training step on a CPU, generous (the tiny model at model.seq_len=32768 ran ~1e11 on
# one thread of a 2-core machine): a step predicted longer than CPU_SLOW_STEP_S at this rate is
# warned about
CPU_FLOPS = 2e11
CPU_SLOW_STEP_S = 60.0


def cpu_cost_warning(cfg: TrainConfig) -> str | None:
    """The warning for a GPU-sized run about to train on the CPU, or None: a global batch of 64
    or more sequences (when the CPU was not asked for with trainer.cpu), a step predicted to take
    more than :data:`CPU_SLOW_STEP_S` (its model FLOPs, attention's ``seq_len^2`` included, at
    :data:`CPU_FLOPS`: a long ``model.seq_len``; a SIGTERM waits for the step in progress once a
    step has finished since the last checkpoint), evals over the seven tasks' full validation
    sets (eval.limit=null: ~58 k scoring requests per evaluation), or trainer.compile; the line
    names what applies and the overrides that shrink it."""
    t, e = cfg.trainer, cfg.eval
    parts, fix = [], []
    shaped = all(getattr(cfg.model, k) is not None for k in (  # null: from init_from, not yet read
        "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "seq_len"))
    step_s = (flops_per_token(cfg.model) * t.global_batch * cfg.model.seq_len / CPU_FLOPS
              if shaped else 0.0)
    if t.global_batch >= 64 and not t.cpu:
        parts.append(f"{t.max_steps} steps of {t.global_batch} x {cfg.model.seq_len} tokens")
        fix.append("trainer.max_steps=20 trainer.global_batch=8 trainer.micro_batch=4")
    if step_s > CPU_SLOW_STEP_S:
        parts.append(f"about {_duration(step_s)} or more per optimizer step ({t.global_batch} x "
                     f"model.seq_len={cfg.model.seq_len} tokens; attention grows with seq_len "
                     "squared; a stop signal with finished steps unsaved waits for the step in "
                     "progress)")
        fix.append(f"a shorter model.seq_len (e.g. {min(cfg.model.seq_len, 1024) // 2 or 1}) "
                   "or a smaller trainer.global_batch")
    if e.enabled and e.limit is None:
        parts.append("evals on the full validation sets (eval.limit=null; ~58 k scoring requests "
                     f"with all seven tasks) {'before and after' if e.at_start else 'after'} "
                     "training")
        fix.append("eval.limit=50 (or eval=disabled)")
    if t.compile:
        parts.append("torch.compile (minutes of compilation on a CPU)")
        fix.append("trainer.compile=false")
    if not parts:
        return None
    return ("warning: " + ("" if t.cpu else "no GPU found; ") + "this is a GPU-sized run ("
            + "; ".join(parts) + ") and can take hours on the CPU. To shrink it: " + " ".join(fix)
            + ".")


def _peak_memory_gb(device: torch.device) -> float:
    """Peak memory in GiB since the last :func:`_reset_peak_memory` (CUDA: bytes allocated by
    tensors, ``torch.cuda.max_memory_allocated``). CPU: the process's peak resident set size
    (Linux's ``VmHWM``, which :func:`_reset_peak_memory` resets); where ``/proc`` cannot tell,
    the peak since the process started (``ru_maxrss``)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20  # KiB -> GiB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB -> GiB (RSS)


def _reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory interval: CUDA's peak counter; on CPU (Linux) the resident set's
    high-water mark, set to the current size (``/proc/self/clear_refs``: 5), so a sweep's later
    job in the same process does not report an earlier job's peak as its own."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # no /proc (or not writable): the process's peak since its start
        pass


class Trainer:
    """A stateful trainer: ``Trainer(cfg, run_dir).train()``.

    Args:
        cfg: the resolved :class:`train.config.TrainConfig`.
        run_dir: the run directory (Hydra's run dir): config.yaml, metrics.jsonl, summary.json,
            train.log (the printed lines), checkpoints/step{N}/, .lock (held by the main process
            from construction through ``train``; ``close`` releases it).
        datamodule: a ready data module (tests); default ``build_datamodule(cfg.data, ...)``.
        model: a ready ``LlamaForCausalLM`` of ``cfg.model`` with ``SparseGatedMLP`` FFNs (e.g.
            built on the GPU and loaded with trained weights by a benchmark); default built from
            ``cfg.model`` after seeding (``train.model.build_model``). The trainer then applies
            checkpointing, compilation and its FFN plan to it as to its own.

    Attributes:
        plan: the :class:`twell.nn.plan.FFNPlan` of the model's FFNs (training paths, dense-backup
            capacities, statistics); ask it, do not set module flags.
        checkpointer: the :class:`train.checkpointer.Checkpointer` that finds, saves and restores
            this run's checkpoints; ``save_checkpoint``, ``resume``, ``resume_advice``,
            ``last_ckpt`` and ``saved_step`` go through it.

    Raises:
        ConfigError: bad configuration, a resume the run dir does not allow (docs/training.md,
            Resuming),
            a run dir locked by another process (one line naming the key and the fix), or a
            ``model`` together with ``model.init_from``.
    """

    def __init__(self, cfg: TrainConfig, run_dir: str | Path, *, datamodule=None,
                 model=None) -> None:
        # the run dir is locked from the first check to close(); a construction that fails
        # unlocks it and removes the directory if it made it and left nothing else there
        self._lock: rundir.RunDirLock | None = None
        self._log_lines: list[str] = []  # train.log lines waiting for the run dir to be set up
        self._log_ready = False
        self._determinism: determinism.Saved | None = None  # trainer.deterministic; close()
        made_dir = not Path(run_dir).exists()
        had_lock_file = (Path(run_dir) / rundir.LOCK_FILE).exists()
        try:
            self._setup(cfg, run_dir, datamodule=datamodule, model=model)
        except BaseException:
            determinism.restore(self._determinism)
            self._determinism = None
            d = Path(run_dir)
            if not (made_dir or had_lock_file or rundir.claimed(d)) and self._lock is not None:
                # refused in another run's folder: leave it as found (removed while held)
                (d / rundir.LOCK_FILE).unlink(missing_ok=True)
            self._unlock()
            if made_dir and d.is_dir() and {p.name for p in d.iterdir()} <= {rundir.LOCK_FILE}:
                (d / rundir.LOCK_FILE).unlink(missing_ok=True)
                d.rmdir()
            raise

    def _setup(self, cfg: TrainConfig, run_dir: str | Path, *, datamodule=None,
               model=None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        ckpt_io.check_run_dir(self.run_dir)  # no link or FIFO where the run writes: before the lock
        if cfg.trainer.deterministic:  # before the process group (NCCL reads it) and GPU work
            self._determinism = determinism.enable(
                cuda=torch.cuda.is_available() and not cfg.trainer.cpu)
        self._setup_accelerator(cfg)
        # which checkpoint the run continues, saving, restoring: train/checkpointer.py
        self.checkpointer = Checkpointer(cfg, self.run_dir, self.acc, any_rank=self._any_rank,
                                         print_=self._print, warn=self._warn)
        resume_from = self.checkpointer.find_resume()
        self.init_src = None  # model.init_from: the checkpoint's config; the shape comes from it
        if cfg.model.init_from:
            self.init_src = self.checkpointer.inspect_init_from(resume_from)
        self.config_dict = config_to_dict(cfg)
        self._setup_warnings(cfg)
        self.checkpointer.check_resume_config(resume_from, self.config_dict)
        if self.is_main:  # locked and new or this run's: a failure may now write into it
            rundir.claim(self.run_dir)

        set_seed(cfg.trainer.seed)
        vocab_check = self._setup_data(cfg, datamodule)
        model = self._setup_model(cfg, model, resume_from, vocab_check)
        self._setup_parallel(cfg, model)
        self._setup_counters()
        if resume_from is not None:
            self.resume(resume_from)
        elif self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt_io.write_atomic(self.run_dir / "config.yaml", OmegaConf.to_yaml(self.config_dict))
            ckpt_io.write_atomic(self.metrics_path, "")
            if self.init_info is not None:
                self._write({"step": 0, **self.init_info}, "init")
        self.memory = memory.plan_memory(self)  # trainer.memory=auto: micro-batch, recomputation
        if self.memory.line:
            self._print(self.memory.line)
            self._write(self.memory.record, "memory")
        self._log_ready = True
        self._log()  # the lines printed so far
        self.acc.wait_for_everyone()
        self.wandb = self._init_wandb()

    def _setup_accelerator(self, cfg: TrainConfig) -> None:
        """Threads, precision, the Accelerator (FSDP2 settings, gradient accumulation), the
        host-side process group, and rank 0's run-directory lock."""
        t = cfg.trainer
        if t.num_threads:
            torch.set_num_threads(t.num_threads)
        precision = t.precision
        if precision == "auto":
            precision = "bf16" if (torch.cuda.is_available() and not t.cpu) else "fp32"
        self.precision = precision
        from accelerate.state import AcceleratorState

        if AcceleratorState._shared_state:  # an earlier run in this process (Hydra -m, tests)
            AcceleratorState._reset_state()  # keeps the process group; lets precision differ
        # autocast_cache=false: no weight cast outlives its use (under checkpointing the cache
        # otherwise holds every layer's bf16 weights until the forward ends; it never hits)
        handlers = [] if t.autocast_cache else [AutocastKwargs(cache_enabled=False)]
        # FSDP2 when launched with configs/accelerate/fsdp2.yaml; the trainer shards the model
        # itself (train/parallel.py), accelerate gives the process group and device
        self.fsdp = parallel.fsdp_settings_from_env()
        with parallel.hidden_from_accelerate() if self.fsdp else nullcontext():
            self.acc = Accelerator(mixed_precision="bf16" if precision == "bf16" else "no",
                                   cpu=t.cpu, kwargs_handlers=handlers)
        self.accum = cfg.check_world(self.acc.num_processes)
        # ranks agree on stops and failed saves through host-side all-reduces (no GPU sync):
        # False = one process, None = the default group (gloo already), else a gloo group
        self._host_group = False
        if self.acc.num_processes > 1:
            dist = torch.distributed
            self._host_group = None if dist.get_backend() == "gloo" else dist.new_group(
                backend="gloo")
        self.is_main = self.acc.is_main_process
        self.device = self.acc.device
        if self.is_main:  # DDP: rank 0 holds the lock for the job (torchrun ends the others)
            self._lock = rundir.RunDirLock(self.run_dir)

    def _setup_warnings(self, cfg: TrainConfig) -> None:
        """One-line warnings of a configuration that runs but likely not as meant."""
        t = cfg.trainer
        if cfg.optim.warmup_steps > t.max_steps and self.is_main:
            self._warn(f"warning: optim.warmup_steps={cfg.optim.warmup_steps} > trainer.max_steps="
                       f"{t.max_steps}: the learning rate never reaches optim.lr (peak "
                       f"{cfg.optim.lr * t.max_steps / max(cfg.optim.warmup_steps, 1):.2e}); "
                       "lower optim.warmup_steps.")
        line = cpu_cost_warning(cfg) if self.device.type == "cpu" and self.is_main else None
        if line:  # e.g. trainer=gpu or experiment=relufy_smollm2 on a machine without a GPU
            self._warn(line)
        if (self.device.type == "cpu" and cfg.ffn.impl == "twell" and self.is_main
                and os.environ.get("TRITON_INTERPRET") == "1"):  # read as twell.ops reads it
            # measured: 19 tok/s training (1150 without it) and ~200 s per validation FFN call
            # of 512 tokens at the tiny shape, 2 cores; the interpreter is for the kernel tests
            self._warn("warning: TRITON_INTERPRET=1 runs ffn.impl=twell through the Triton "
                       "interpreter on the CPU: ~60x slower training and minutes per validation "
                       "FFN call; unset TRITON_INTERPRET (the PyTorch version of the same sparse "
                       "math runs) unless you are testing the kernels.")

    def _setup_data(self, cfg: TrainConfig, datamodule):
        """The data module (built unless given) and its checks against the model's vocabulary
        and the evaluation; returns ``model.init_from``'s vocabulary check (None without it)."""
        t = cfg.trainer
        vocab_check = None
        if datamodule is None:
            from train.data import build_datamodule

            self._print(f"run dir {self.run_dir}: loading data.source={cfg.data.source} (a "
                        "first run builds or fetches it) ...")
            with self.acc.main_process_first():
                datamodule = build_datamodule(
                    cfg.data, seq_len=cfg.model.seq_len, micro_batch=t.micro_batch or 1,
                    seed=t.seed, rank=self.acc.process_index, world_size=self.acc.num_processes)
        self.data = datamodule
        if self.init_src is not None:
            from train import pretrained

            vocab_check = pretrained.check_vocab(self.init_src, self.data.vocab_size,
                                                 getattr(self.data, "tokenizer", None))
        if self.data.vocab_size > cfg.model.vocab_size:
            if getattr(self.data, "tokenizer", None) is None:  # tokens source: ids from files
                what = (f"data.vocab_size={cfg.data.vocab_size}" if cfg.data.vocab_size else
                        f"the token files data.paths={list(cfg.data.paths)} hold ids up to "
                        f"{self.data.vocab_size - 1}, so the vocabulary ({self.data.vocab_size})")
            else:
                what = (f"the tokenizer vocabulary ({self.data.vocab_size}, data.tokenizer="
                        f"{cfg.data.tokenizer!r})")
            raise ConfigError(f"{what} is larger than model.vocab_size={cfg.model.vocab_size}; "
                              f"set model.vocab_size>={self.data.vocab_size}.")

        e = cfg.eval
        if e.enabled and getattr(self.data, "tokenizer", None) is None:
            raise ConfigError(
                f"eval is on (eval.at_end={e.at_end}, eval.every_steps={e.every_steps}, "
                f"eval.at_start={e.at_start}) but "
                f"data.source={cfg.data.source!r} has no tokenizer to score the tasks with; "
                "set eval=disabled or use a data source with a tokenizer.")
        return vocab_check

    def _setup_model(self, cfg: TrainConfig, model, resume_from, vocab_check):
        """The model (given, from ``model.init_from``, or built), with its recomputation,
        Liger-Kernel's fused ops and its distillation teacher; returns it."""
        t, precision = cfg.trainer, self.precision
        if self.init_src is not None:
            from train import pretrained
        self.init_info = None
        if model is not None:
            if self.init_src is not None:
                raise ConfigError(f"model.init_from={cfg.model.init_from!r} and a ready model "
                                  "were both given; pass one of them.")
        elif self.init_src is not None and resume_from is None:  # pretrained weights
            model, switched = pretrained.build_model(cfg.model, cfg.ffn, self.init_src)
            line, self.init_info = pretrained.describe(
                cfg.model, self.init_src, vocab_check=vocab_check, switched=switched,
                weights_loaded=True)
            self._print(line)
        elif self.init_src is not None:  # resuming: the shape from the run's own checkpoint
            model, _ = pretrained.build_model(cfg.model, cfg.ffn, self.init_src,
                                              load_weights=False)
            self._print(f"model.init_from={cfg.model.init_from}: not read (resuming the run's "
                        f"checkpoint {resume_from}, which holds the model)")
        else:
            model = build_model(cfg.model, cfg.ffn)
        # non-reentrant: the L1 side output keeps its graph. The FSDP config's
        # fsdp_activation_checkpointing means the same and is applied through the same call once
        if t.grad_checkpointing or (self.fsdp and self.fsdp.activation_checkpointing):
            enable_grad_checkpointing(model, t.checkpoint_ffn or "always")
        # the fused non-FFN ops (RMSNorm, RoPE, the loss): Liger-Kernel's where it runs
        # (train/liger.py), transformers' own elsewhere (the CPU, compiled runs)
        self.fused_loss = None  # "liger" | "ours" | None: who computes the loss without logits
        if t.liger and self.device.type != "cuda":
            self._print("trainer.liger=true: Liger-Kernel's kernels run on CUDA only; this "
                        f"{self.device.type} run keeps transformers' norms, RoPE and loss")
        if liger_enabled(t.liger, device_type=self.device.type, precision=precision,
                         compile=t.compile):
            # the fused loss: not with distillation (ours + KL replaces it) nor FSDP (the LM
            # head weight is a sharded DTensor outside its module's forward: untested)
            liger_loss = not cfg.distill and not self.fsdp
            use_liger(model, fused_linear_ce=liger_loss,
                      norm_out_autocast=t.norm_out_bf16 is not False)
            # (on the CPU, where a forced trainer.liger=true falls back, transformers' loss)
            self.fused_loss = "liger" if liger_loss and self.device.type == "cuda" else None
        self.teacher = None  # sparsity.distill_from: the frozen source model, the KL's target
        if cfg.distill:
            from train import pretrained

            s, dtype = cfg.sparsity, torch.bfloat16 if precision == "bf16" else torch.float32
            # the teacher is the source as stored, also when resuming (init_src is then the
            # run's own checkpoint, the student)
            src = self.init_src
            if resume_from is not None:  # the source must be the one the run recorded
                src = pretrained.inspect_checkpoint(cfg.model.init_from)
                if self.is_main:
                    recorded = (ckpt_io.load_state(resume_from, "trainer").get("init") or {})
                    pretrained.check_same_source(src, recorded.get("sha256"),
                                                 shell_quote(resume_from.parent.parent),
                                                 warn=self._warn)
            self.teacher = pretrained.build_teacher(src, self.device, dtype)
            use_distillation(model, self.teacher, temperature=s.distill_temperature,
                             kl_weight=s.distill_weight * s.distill_temperature ** 2,
                             chunk_rows=t.ce_chunk_rows)
            self.fused_loss = "ours"  # CE + KL in chunks (train/loss.py)
            self._print(f"distillation: teacher {src.spec} as stored (hidden_act "
                        f"{src.hidden_act}, frozen, {dtype}), loss = CE + l1_coeff x L1"
                        f" + {s.distill_weight:g} x {s.distill_temperature:g}^2 x KL")
        return model

    def _setup_parallel(self, cfg: TrainConfig, model) -> None:
        """The FFN plan, compile, FSDP2 / DDP wrapping, optimizer, scheduler and the dead-neuron
        tracker."""
        t, precision = cfg.trainer, self.precision
        self.mlps = ffn_modules(model)
        for m in self.mlps:  # ffn.impl, also on a model handed in ready (the plan reads it)
            m.impl = cfg.ffn.impl
        if t.deterministic:  # auto's paths by the density rule, not timings (train/determinism)
            for m in self.mlps:
                m.policy = determinism.untimed_policy(m.policy)
        # per layer: training path, no-sync dense-backup capacity (from past heavy-row maxima by
        # ffn.backup_capacity), statistics. No-sync capacities change from step to step; as
        # integer arguments they would make torch.compile recompile the model for each new value
        # (and fall back to eager after its recompile limit), so a compiled model measures per call
        # auto's measured choice times each layer's calls with eager hooks: not under compile
        # (nor trainer.deterministic, where timings must not decide);
        # several ranks average the timings (host side) so that they choose alike
        host_sync = "call" if t.compile else cfg.ffn.host_sync
        if host_sync == "micro_batch" and (self.acc.num_processes > 1 or self.fsdp):
            # a forward run again without its backward would leave DDP's reducer (and FSDP's
            # unshard) expecting one: such runs check once per step
            self._print("ffn.host_sync=micro_batch: several processes or FSDP check the "
                        "dense-backup capacities once per step (step)")
            host_sync = "step"
        # the modules carry ffn.impl and ffn.policy (build_model); the plan takes the rest
        self.plan = FFNPlan(self.mlps, cfg.ffn.plan_options(host_sync),
                            timed=not (t.compile or t.deterministic),
                            reduce_host=self._host_sum if self.acc.num_processes > 1 else None)
        self.n_params = sum(p.numel() for p in model.parameters())
        self._print(f"model: {self.n_params / 1e6:.2f}M parameters, {cfg.model.num_layers} layers, "
                    f"FFN {cfg.ffn.impl}; {precision} on {self.device} x "
                    f"{self.acc.num_processes}")
        # MFU denominators (train/metrics.py): None on CPU / fp32 / unknown GPU -> MFU not logged
        self.peak_flops = device_peak_flops(self.device, precision, t.peak_tflops)
        self.peak_mem_run = 0.0  # GiB, largest interval peak of this process (peak_mem_gb_run)
        if t.compile and self.fsdp:
            raise ConfigError("trainer.compile=true with FSDP (configs/accelerate/fsdp2.yaml) is "
                              "not supported; set trainer.compile=false or launch with ddp.yaml.")
        if t.compile:
            if cfg.ffn.host_sync != "call" and cfg.ffn.impl != "torch":
                self._print("trainer.compile=true: the ell training path measures its dense "
                            f"backup per call (ffn.host_sync={cfg.ffn.host_sync} "
                            "applies to eager runs)")
            model.compile()
        if self.fsdp:  # shard first: the optimizer then holds the fp32 master shards
            parallel.apply_fsdp2(model, self.fsdp, device=self.device,
                                 world_size=self.acc.num_processes,
                                 param_dtype=torch.bfloat16 if precision == "bf16" else None)
            optimizer = self._build_optimizer(model)
            self.model, self.optimizer = model, self.acc.prepare(optimizer)
        else:
            optimizer = self._build_optimizer(model)
            self.model, self.optimizer = self.acc.prepare(model, optimizer)
        self.scheduler = self._build_scheduler(optimizer)  # stepped by hand, once per step
        self.tracker = DeadNeuronTracker(
            cfg.model.num_layers, cfg.model.intermediate_size,
            cfg.sparsity.dead_window_tokens or self.tokens_per_step, device=self.device)

    def _setup_counters(self) -> None:
        """The training state a fresh run starts from (a resume overwrites it)."""
        self.step = 0  # optimizer steps done
        self.tokens_seen = 0  # global training tokens consumed
        self.train_time = 0.0  # seconds spent in train steps (all runs of this job)
        self.last: dict = {}  # latest logged metrics (for summary.json)
        self.last_val: dict = {}
        self.last_eval: dict = {}
        self.prev_segment: dict | None = None  # the checkpoint's last training segment
        self.segment = self._new_segment()
        self.signals: StopSignals | None = None  # while train() runs
        self.wandb = None

    # ---------------------------------------------------------------- setup helpers

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.trainer.global_batch * self.cfg.model.seq_len

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def _build_optimizer(self, model) -> torch.optim.Optimizer:
        o = self.cfg.optim
        decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices and embeddings
        no_decay = [p for p in model.parameters() if p.dim() < 2]  # RMSNorm weights
        fused = o.fused if o.fused is not None else self.device.type == "cuda"
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=fused)

    def _build_scheduler(self, optimizer, steps_done: int = 0):
        """``LambdaLR`` of :func:`lr_factor`: after ``k`` optimizer steps the groups' lr is
        ``initial_lr * lr_factor(k + 1)``, the value step ``k + 1`` runs at. ``steps_done > 0``
        builds it at that point of the schedule (a resume with changed optim values; the groups
        must hold ``initial_lr``)."""
        o, max_steps = self.cfg.optim, self.cfg.trainer.max_steps
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda k: lr_factor(k + 1, o, max_steps), last_epoch=steps_done - 1)

    def _init_wandb(self):
        lg = self.cfg.logging
        if lg.wandb_mode == "disabled" or not self.is_main:
            return None
        try:
            import wandb
        except ImportError:
            self._print("wandb is not installed; logging to metrics.jsonl only")
            return None
        ckpt_io.check_run_folder(self.run_dir / "wandb")  # wandb writes its run through links
        id_file = self.run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        ckpt_io.write_atomic(id_file, run_id)
        # offline: no banner and no history table at finish (the run's summary line comes last)
        settings = wandb.Settings(silent=True) if lg.wandb_mode == "offline" else None
        try:
            return wandb.init(project=lg.wandb_project, name=lg.run_name or self.run_dir.name,
                              dir=str(self.run_dir), mode=lg.wandb_mode, config=self.config_dict,
                              id=run_id, resume="allow", settings=settings)
        except Exception as e:  # noqa: BLE001  (logging must not kill a training run)
            self._print(f"wandb.init failed ({e}); logging to metrics.jsonl only")
            return None

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """Trainer state for checkpoints, plain data and tensors only (``ckpt_io.save_state``):
        step, tokens seen, timing, the sparsity tracker, the FFN plan (auto's paths and the
        dense-backup capacities: they pick the backup GEMMs' shapes, so an exact resume needs
        them), the init_from record and the last training segment (for the closing line's
        tokens/s)."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, "train_time": self.train_time,
                "sparsity": self.tracker.state_dict(), "ffn_plan": self.plan.state_dict(),
                "init": self.init_info, "segment": self._last_segment()}

    def load_state_dict(self, d: dict) -> None:
        self.step = int(d["step"])
        self.tokens_seen = int(d["tokens_seen"])
        self.train_time = float(d["train_time"])
        self.tracker.load_state_dict(d["sparsity"])
        self.plan.load_state_dict(d["ffn_plan"] if "ffn_plan" in d else _legacy_plan_state(
            d, self.plan.state_dict()))
        if d.get("init") is not None:
            self.init_info = d["init"]
        self.prev_segment = d.get("segment")
        self.segment = self._new_segment()

    def _new_segment(self) -> dict:
        """What this process trains (the closing line's tokens/s): first step, steps, tokens,
        seconds in train steps."""
        return {"first_step": self.step + 1, "steps": 0, "tokens": 0, "time": 0.0}

    def _last_segment(self) -> dict | None:
        """This process's segment if it trained a step, else the checkpoint's last one."""
        return dict(self.segment) if self.segment["steps"] else self.prev_segment

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step{N}/`` atomically (all ranks call this); returns the folder.

        Model and optimizer state are full tensors in the unsharded formats (an FSDP model's are
        gathered on rank 0), so the checkpoint resumes on any number of ranks, sharded or not
        (:meth:`train.checkpointer.Checkpointer.save`).

        Raises:
            NonFiniteLossError: the weights hold NaN or inf (nothing is saved).
            train.checkpoint.CheckpointError: a stage failed on some rank (a full disk: one
                line; the temp folder is removed on every rank).
        """
        return self.checkpointer.save(self)

    @property
    def last_ckpt(self) -> Path | None:
        """The newest checkpoint this run wrote or resumed from (None: none yet)."""
        return self.checkpointer.last_ckpt

    @property
    def saved_step(self) -> int | None:
        """The step ``last_ckpt`` holds (a stop does not save it twice)."""
        return self.checkpointer.saved_step

    @property
    def lineage(self) -> dict:
        """The line of training the next checkpoint records (``ckpt_io.new_lineage``)."""
        return self.checkpointer.lineage

    @property
    def rerun_arg(self) -> str | None:
        """The override that re-runs this job in its folder (twell-train sets a ``-m`` sweep's
        ``hydra.sweep.dir``); None: ``hydra.run.dir`` of the run dir (:meth:`resume_advice`)."""
        return self.checkpointer.rerun_arg

    @rerun_arg.setter
    def rerun_arg(self, value: str | None) -> None:
        self.checkpointer.rerun_arg = value

    def _host_sum(self, values: list[float]) -> list[float]:
        """``values`` summed over ranks (a host-side all-reduce on the gloo group: no GPU
        sync); the FFN plan averages its timings with it."""
        v = torch.tensor(values, dtype=torch.float64)
        torch.distributed.all_reduce(v, group=self._host_group)
        return v.tolist()

    def _any_rank(self, flag: int) -> int:
        """The largest ``flag`` over ranks (a host-side all-reduce on the gloo group: no GPU
        sync); ``flag`` itself on one process."""
        if self._host_group is False:
            return int(flag)
        v = torch.tensor([int(flag)], dtype=torch.int64)
        torch.distributed.all_reduce(v, op=torch.distributed.ReduceOp.MAX, group=self._host_group)
        return int(v.item())

    def resume(self, path: Path) -> None:
        """Restore everything from a checkpoint folder: weights, optimizer, scheduler, trainer and
        sparsity state, the data position and RNG states, on any number of ranks. Nothing in it
        can run code (``ckpt_io.load_state``: safetensors and JSON).

        The global batch must be the one of the checkpoint (the data position and the schedules
        count its steps); the world size, micro-batch and accumulation may change, and 1 process,
        DDP and FSDP load each other's checkpoints. What continues exactly: the blocks of every
        step (a global data position), the lr / L1 schedules, the optimizer state, the dead-unit
        windows, auto's paths. The per-rank RNG states are restored only on the same world size
        (elsewhere every rank is re-seeded from trainer.seed, the step and its rank): after
        initialisation training draws no random numbers from them (no dropout; dead-unit
        re-init has its own generator seeded by the step). The no-sync dense-backup capacities
        count rows per FFN call, so a different micro-batch measures them again. A checkpoint of
        this run dir continues its lineage; one of another run dir starts a branch of it.

        Raises:
            ConfigError: another global batch, or a data position of other data.
            train.checkpoint.CheckpointError: a state file is missing, damaged or holds a pickle
                that is not plain data (one line naming the file).
        """
        latest = self.checkpointer.resume(self, path)
        # after the restore, which draws no random numbers and reads no lr: the schedule is the
        # trainer's (_build_scheduler), so the trainer rebuilds it
        if self.cfg.trainer.resume_allow_changes:
            self._apply_optim_config()
        self.last = latest.get("train", self.last)
        self.last_val = latest.get("val", self.last_val)
        self.last_eval = latest.get("eval", self.last_eval)

    def resume_advice(self) -> str:
        """How to continue this run after it stopped: the exact ``hydra.run.dir`` and
        ``trainer.resume`` that resume from its newest checkpoint
        (:meth:`train.checkpointer.Checkpointer.resume_advice`)."""
        return self.checkpointer.resume_advice()

    def _apply_optim_config(self) -> None:
        """Resume with ``trainer.resume_allow_changes=true``: put this config's optim values
        into the loaded optimizer's param groups (lr, weight decay of the matrices' group,
        betas, eps) and rebuild the lr schedule at the checkpoint's step, so step N+1 runs at
        the new schedule's value for step N+1 (a no-op when nothing changed)."""
        o = self.cfg.optim
        optimizer = self.scheduler.optimizer  # the torch optimizer under accelerate's wrapper
        for group, wd in zip(optimizer.param_groups, (o.weight_decay, 0.0)):
            group.update(initial_lr=o.lr, weight_decay=wd, betas=tuple(o.betas), eps=o.eps)
        self.scheduler = self._build_scheduler(optimizer, steps_done=self.step)

    # ---------------------------------------------------------------- the loop

    def _new_interval(self) -> dict:
        L, dev = self.cfg.model.num_layers, self.device
        return {"loss": torch.zeros((), device=dev), "ce": torch.zeros((), device=dev),
                "l1": torch.zeros((), device=dev), "micro": 0, "steps": 0, "tokens": 0,
                "nnz_sum_L": torch.zeros(L, device=dev), "nnz_max_L": torch.zeros(L, device=dev),
                "heavy_L": torch.zeros(L, device=dev),
                "ffn_tokens": 0, "time": 0.0}

    new_interval = _new_interval  # public: a driver of train_step / log_metrics (benchmarks)

    def _micro_steps(self, ids: list, coeff: float) -> dict:
        """Forward + backward of the step's micro-batches; returns the step's metric sums."""
        cfg, acc, model = self.cfg, self.acc, self.model
        L, dev = cfg.model.num_layers, self.device
        m = {"loss": torch.zeros((), device=dev), "ce": torch.zeros((), device=dev),
             "l1": torch.zeros((), device=dev), "nnz_sum_L": torch.zeros(L, device=dev),
             "heavy_L": torch.zeros(L, device=dev), "heavy_max_L": torch.zeros(L, device=dev),
             "nnz_max_L": torch.zeros(L, device=dev), "ffn_tokens": 0, "micro_tokens": 0,
             "active_LH": torch.zeros(L, cfg.model.intermediate_size, dtype=torch.int64,
                                      device=dev)}
        check = self.plan.host_sync == "micro_batch"  # one process (_setup_parallel)
        n_micro, n_seq = len(ids), sum(x.shape[0] for x in ids)
        for micro, ids_cpu in enumerate(ids):
            ids_BT = ids_cpu.to(dev, non_blocking=True)  # (B, T) token ids
            # a micro-batch's mean loss counts by its share of the step's sequences: 1.0 when
            # they are all the same size (bitwise as before), else B * n_micro / n_seq
            share = ids_BT.shape[0] * n_micro / n_seq
            sync = micro == n_micro - 1  # DDP all-reduces gradients on the last micro-step
            with nullcontext() if sync else acc.no_sync(model):
                out = model(input_ids=ids_BT, labels=ids_BT)
                ce = out.loss  # mean over B*(T-1) targets; distillation: CE + w T^2 KL
                l1, sp = l1_penalty(collect_stats(self.mlps))
                over = self.plan.call_overflow(sp.heavy_L, ids_BT.numel()) if check else []
                if over:  # some layer exceeded its no-sync capacity: this forward again, exact
                    del out, ce, l1, sp  # the overflowed forward's graph goes before the new one
                    for mlp in self.mlps:
                        mlp.last_stats = None
                    self.plan.overflowed_in_call(over)
                    m["forward_redos"] = m.get("forward_redos", 0) + 1
                    self._print(f"step {self.step + 1}, micro-batch {micro + 1}: layers {over} "
                                "had more heavy rows than their dense-backup capacity; running "
                                "its forward again, those layers measuring per call")
                    out = model(input_ids=ids_BT, labels=ids_BT)
                    ce = out.loss
                    l1, sp = l1_penalty(collect_stats(self.mlps))
                loss = ce + coeff * l1
                acc.backward(loss * share / n_micro)
            kl = getattr(out, "distill_kl", None)  # sparsity.distill_*: log CE and KL apart
            if kl is not None:
                ce = out.distill_ce
                m["distill_kl"] = m.get("distill_kl", 0.0) + kl * share
            m["loss"] += loss.detach() * share
            m["ce"] += ce.detach() * share
            m["l1"] += l1.detach() * share
            m["nnz_sum_L"] += sp.nnz_sum_L
            m["heavy_L"] += sp.heavy_L
            m["heavy_max_L"] = torch.maximum(m["heavy_max_L"], sp.heavy_L)
            m["nnz_max_L"] = torch.maximum(m["nnz_max_L"], sp.nnz_max_L)
            m["ffn_tokens"] += sp.n_tokens
            m["active_LH"] += sp.active_LH
            m["micro_tokens"] = max(m["micro_tokens"], sp.n_tokens)  # the largest call's rows
        return m

    def _draw_step(self, batches) -> list[torch.Tensor]:
        """The step's ``accum`` micro-batches from ``batches``: when the micro-batch does not
        divide the sequences a rank takes per step, their sizes are balanced
        (``train.memory.micro_batch_sizes``: 512 at micro-batch 24 is 6 x 24 + 16 x 23), drawn
        with the data module's ``micro_batch`` set to each size (its ``train_batches`` reads it
        at every batch). An iterator that ignores it (a benchmark's) gives its own sizes: the
        step weighs each micro-batch by the sequences it holds (``_micro_steps``)."""
        full = self.data.micro_batch
        per_rank = self.cfg.trainer.global_batch // self.acc.num_processes
        sizes = memory.micro_batch_sizes(per_rank, full) if full <= per_rank else []
        if len(sizes) != self.accum or sizes[-1] == full:  # equal sizes, or a driver's own accum
            return [next(batches) for _ in range(self.accum)]
        try:
            ids = []
            for size in sizes:
                self.data.micro_batch = size
                ids.append(next(batches))
            return ids
        finally:
            self.data.micro_batch = full

    def train_step(self, batches, interval: dict) -> None:
        """One optimizer step over ``accum`` micro-batches; accumulates metrics in ``interval``.

        Host synchronisation: once, after the backward of the last micro-batch (the non-finite
        check and the FFN plan's statistics). The plan (``self.plan``, ``FFNPlan.end_step``)
        then accepts the step, or asks for a redo when some layer on the ELL path had more heavy
        rows than its no-sync dense-backup capacity: the attempt's gradients are discarded
        before the optimizer sees them and the step runs again measuring per call (exact, so
        it is accepted). The plan also sets the next step's capacities and ``auto``'s paths.
        With ``ffn.host_sync=micro_batch`` the capacities are also checked after each
        micro-batch's forward (one more host sync each, ``FFNPlan.call_overflow``): an
        overflowed micro-batch runs its forward again before its backward, so the step is not
        redone.
        """
        cfg, acc, model = self.cfg, self.acc, self.model
        self._update_began = False
        coeff = l1_coeff_at(self.step, cfg.sparsity)
        lr = self.scheduler.get_last_lr()[0]
        ids = self._draw_step(batches)  # kept until the step is accepted
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        for _attempt in range(2):  # a redone step measures per call: it cannot overflow again
            self.plan.begin_step()
            m = self._micro_steps(ids, coeff)
            grad_norm = parallel.plain(acc.clip_grad_norm_(model.parameters(), max_norm))
            bad = (~torch.isfinite(m["loss"]) | ~torch.isfinite(grad_norm)).float()
            stats = StepStats(m["heavy_max_L"], m["nnz_sum_L"], m["heavy_L"],
                              rows_per_call=m["micro_tokens"],
                              tokens=m["ffn_tokens"] * acc.num_processes,
                              sequences_per_call=m["micro_tokens"] // cfg.model.seq_len,
                              active_LH=m["active_LH"])
            if acc.num_processes > 1:  # active_LH summed too: the hot units, dead neurons
                bad = acc.reduce(bad, "sum")
                stats = stats.reduced(lambda t, op: acc.reduce(t.contiguous(), op))
            stats = self.plan.count_hot_units(stats)  # device: units above the hot threshold
            host = torch.cat([bad.reshape(1), stats.packed()]).tolist()  # the step's one host sync
            if host[0]:
                raise NonFiniteLossError(
                    f"non-finite loss or gradient at step {self.step + 1} (loss "
                    f"{m['loss'].item() / self.accum:.4g}, grad norm {grad_norm.item():.4g}); the "
                    f"step was not applied; last good checkpoint: {self.last_ckpt or 'none'}")
            outcome = self.plan.end_step(stats.unpacked(host[1:]))
            if outcome.accepted:
                break
            self.optimizer.zero_grad(set_to_none=True)  # discard the attempt
            interval["backup_redos"] = interval.get("backup_redos", 0) + 1
            self._print(f"step {self.step + 1}: layers {list(outcome.redo)} had more heavy rows "
                        "than their dense-backup capacity; redoing the step with per-call "
                        "measurement")
        self._update_began = True  # from here an error may leave the weights half updated
        if m.get("forward_redos"):
            interval["forward_redos"] = interval.get("forward_redos", 0) + m["forward_redos"]
        for k in ("loss", "ce", "l1"):  # the step's mean: each step counts alike in the interval,
            interval[k] += m[k] / len(ids)  # whatever its accumulation (a step-down, a re-plan)
        for k in ("nnz_sum_L", "heavy_L"):
            interval[k] += m[k]
        if "distill_kl" in m:
            interval["distill_kl"] = interval.get("distill_kl", 0.0) + m["distill_kl"] / len(ids)
        interval["nnz_max_L"] = torch.maximum(interval["nnz_max_L"], m["nnz_max_L"])
        interval["ffn_tokens"] += m["ffn_tokens"]
        interval["micro"] += len(ids)
        active_LH = stats.active_LH  # summed over ranks (StepStats.reduced)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        interval["steps"] += 1
        interval["tokens"] += self.tokens_per_step
        interval["grad_norm"] = grad_norm.detach()
        interval["lr"], interval["l1_coeff"] = lr, coeff

        # dead neurons: counts summed over ranks so every rank holds the same window state
        dead_LH = self.tracker.update(active_LH, self.tokens_per_step)
        if dead_LH is not None and cfg.sparsity.reinit_dead:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(cfg.trainer.seed * 1_000_003 + self.step)  # same on all ranks / resume
            reinit_dead_gates(self.mlps, dead_LH, lam=cfg.sparsity.reinit_lambda,
                              std=cfg.sparsity.reinit_std, generator=gen)

    def log_metrics(self, interval: dict) -> dict:
        """Reduce the interval's metrics over ranks (host sync) and write them everywhere."""
        acc, L = self.acc, self.cfg.model.num_layers
        sums = torch.cat([torch.stack([interval["loss"], interval["ce"], interval["l1"]]),
                          interval["nnz_sum_L"], interval["heavy_L"]])
        nnz_max_L = interval["nnz_max_L"]
        if acc.num_processes > 1:
            sums = acc.reduce(sums, "sum") / torch.tensor([acc.num_processes] * 3 + [1] * 2 * L,
                                                          device=sums.device)
            nnz_max_L = acc.reduce(nnz_max_L.contiguous(), "max")
        sums = sums.tolist()  # host sync
        n = interval["steps"]  # loss, ce, l1, distill_kl: sums of step means
        ffn_tokens = interval["ffn_tokens"] * acc.num_processes
        l0_L = [v / ffn_tokens for v in sums[3:3 + L]]
        heavy_L = [v / ffn_tokens for v in sums[3 + L:]]
        dead = self.tracker.dead_fraction_L
        tok_s = interval["tokens"] / max(interval["time"], 1e-9)  # global tokens/s
        tok_s_dev = tok_s / acc.num_processes
        peak_mem = _peak_memory_gb(self.device)  # this interval's peak (CUDA); then a new one
        _reset_peak_memory(self.device)
        self.peak_mem_run = max(self.peak_mem_run, peak_mem)
        m = {
            "step": self.step,
            "tokens": self.tokens_seen,
            "loss": sums[0] / n,
            "ce": sums[1] / n,
            "l1": sums[2] / n,
            "l1_coeff": interval["l1_coeff"],
            "l0_mean": sum(l0_L) / L,
            "l0_min": min(l0_L),
            "l0_max": max(l0_L),
            "nnz_max": max(nnz_max_L.tolist()),
            "l0_layers": l0_L,
            "dead_frac": None if dead is None else dead.mean().item(),
            "dead_layers": None if dead is None else dead.tolist(),
            "lr": interval["lr"],
            "grad_norm": interval["grad_norm"].item(),
            "tokens_per_s": tok_s,
            # dense model FLOPs, and useful FLOPs at this interval's L0 (train/metrics.py)
            "mfu": mfu(flops_per_token(self.cfg.model), tok_s_dev, self.peak_flops),
            "mfu_useful": mfu(flops_per_token(self.cfg.model, l0_L), tok_s_dev, self.peak_flops),
            "peak_mem_gb": peak_mem,
            "peak_mem_gb_run": self.peak_mem_run,
        }
        if interval.get("backup_redos"):
            m["ffn_backup_redos"] = interval["backup_redos"]  # steps redone (capacity exceeded)
        if interval.get("forward_redos"):  # micro-batch forwards run again (ffn.host_sync)
            m["ffn_forward_redos"] = interval["forward_redos"]
        if "distill_kl" in interval:  # KL(teacher || student) at the temperature, per target
            kl = interval["distill_kl"]
            if acc.num_processes > 1:
                kl = acc.reduce(kl, "sum") / acc.num_processes
            m["distill_kl"] = kl.item() / n
        if self.cfg.ffn.impl == "auto":  # the paths chosen for the next step
            m["ffn_paths"] = self.plan.paths
            m["heavy_frac_layers"] = heavy_L
            m.update(self._ffn_timing_metrics())
        hot = [0 if lp.hot_units is None else int(lp.hot_units.numel()) for lp in self.plan.layers]
        if any(hot):  # hot units of the ell layers for the next step
            m["ffn_hot_units_layers"] = hot
        self.last = m
        self._write(m)
        return m

    def _ffn_timing_metrics(self) -> dict:
        """auto's measured choice: per layer the median ms per micro-step of each path's timed
        FFN calls (``ffn_ms_ell_layers``, ``ffn_ms_dense_layers``; None where not timed), when
        any layer has timings."""
        medians = getattr(self.plan.chooser, "medians", None)
        if medians is None:
            return {}
        meds = [medians(k) for k in range(len(self.plan))]
        if not any(meds):
            return {}
        return {f"ffn_ms_{p}_layers": [None if p not in md else round(md[p], 4) for md in meds]
                for p in ("ell", "dense")}

    def _write(self, m: dict, prefix: str = "train") -> None:
        if not self.is_main:
            return
        with ckpt_io.open_run_file(self.metrics_path) as f:
            f.write(json.dumps({"kind": prefix, **m}) + "\n")
        if self.wandb is not None:
            flat = {}
            for k, v in m.items():
                if isinstance(v, list):
                    flat.update({f"{prefix}/{k}/{i}": x for i, x in enumerate(v)})
                elif v is not None and k != "step":
                    flat[f"{prefix}/{k}"] = v
            self.wandb.log(flat, step=self.step)

    @torch.no_grad()
    def validate(self) -> dict:
        """Token-weighted mean CE and L0 (mean over layers) on the first
        ``trainer.val_sequences`` held-out sequences (rounded down to a multiple of the world
        size; each rank takes its equal share), so the result depends neither on the
        micro-batch nor on how the sequences fall into batches. Fewer if the split is smaller."""
        self._clear_sharded_ffn_caches()
        self.model.eval()
        dev = self.device
        share = self.cfg.trainer.val_sequences // self.acc.num_processes  # equal: same batches
        sums = torch.zeros(2, dtype=torch.float64, device=dev)  # CE over targets, L0 over tokens
        counts = [0, 0, 0]  # targets, FFN tokens, sequences (host ints)
        left = share
        try:  # every rank runs the same forwards: they agree on a stop at each one
            with self._stoppable(collective=True):
                for ids_BT in self.data.val_batches(-(-share // self.data.micro_batch)):
                    ids_BT = ids_BT[:left].to(dev)  # (B, T); the last batch may be cut
                    left -= ids_BT.shape[0]
                    ce = self.model(input_ids=ids_BT, labels=ids_BT).loss  # mean over B*(T-1)
                    _, sp = l1_penalty(collect_stats(self.mlps))
                    n_targets = ids_BT.shape[0] * (ids_BT.shape[1] - 1)
                    sums += torch.stack([ce.double() * n_targets,
                                         sp.l0_L.mean().double() * sp.n_tokens])
                    counts = [counts[0] + n_targets, counts[1] + sp.n_tokens,
                              counts[2] + ids_BT.shape[0]]
                    if left <= 0:
                        break
        except StopRequested:
            self.model.train()
            self._print(f"step {self.step}: validation stopped by {self._stop_name()} (no "
                        "validation loss for this step)")
            return {"step": self.step, "val_loss": None, "val_l0": None, "val_sequences": 0}
        tot = torch.cat([sums, torch.tensor(counts, dtype=torch.float64, device=dev)])
        if self.acc.num_processes > 1:
            tot = self.acc.reduce(tot, "sum")
        ce_sum, l0_sum, n_targets, n_tokens, n_seqs = tot.tolist()  # host sync
        self.model.train()
        m = {"step": self.step, "val_loss": ce_sum / n_targets if n_targets else None,
             "val_l0": l0_sum / n_tokens if n_tokens else None, "val_sequences": int(n_seqs)}
        self.last_val = m
        self._write(m, "val")
        return m

    def _clear_sharded_ffn_caches(self) -> None:
        """FSDP: the inference path's cached ``Wd^T`` is keyed on the weight's storage and
        version, which FSDP2's re-gathered weights do not keep; drop it before each eval pass
        (the weights are fixed within one)."""
        if parallel.is_sharded(self.model):
            for mlp in self.mlps:
                if mlp.twell_state is not None:
                    mlp.twell_state.clear_cache()

    def evaluate(self) -> dict:
        """Downstream zero-shot evals (``evals.evaluate``) on the main process (on every rank of
        an FSDP model, whose forward gathers weights from all of them; the main one logs)."""
        result = {}
        self._clear_sharded_ffn_caches()
        if self.is_main or parallel.is_sharded(self.model):
            from evals import evaluate

            e = self.cfg.eval
            tasks = "all" if list(e.tasks) == ["all"] else tuple(e.tasks)
            model = self.acc.unwrap_model(self.model)
            model.eval()
            self._print(f"step {self.step}: evaluating {tasks} (limit {e.limit})")
            try:  # a sharded model's ranks run the same forwards; else only this one runs
                with self._stoppable(collective=parallel.is_sharded(self.model)):
                    out = evaluate(model, self.data.tokenizer, tasks=tasks, limit=e.limit,
                                   batch_size=e.batch_size, device=self.device,
                                   progress=self.show_bars)
            except StopRequested:  # SIGTERM / SIGINT: the stop comes after it (_train)
                model.train()
                self._print(f"step {self.step}: evaluation stopped by {self._stop_name()} (no "
                            "eval result for this step)")
                self.acc.wait_for_everyone()
                return {}
            except NonFiniteScores as err:  # NaN / inf logits: no score, one line
                raise NonFiniteLossError(f"eval at step {self.step}: {err}") from None
            except ContinuationTooLong as err:  # a short model.seq_len: one line, no traceback
                raise ConfigError(
                    f"eval at step {self.step}: {err.args[0].split(';')[0]}: model.seq_len="
                    f"{self.cfg.model.seq_len} is too short for it; set model.seq_len>="
                    f"{err.n_tokens}, eval.tasks without it, or eval=disabled (the same command "
                    f"with eval=disabled {override_arg('hydra.run.dir', self.run_dir)} resumes "
                    "from the newest checkpoint and writes summary.json)") from None
            model.train()
            result = {"step": self.step, "eval_mean": out["mean"],
                      **{f"eval_{k}": v["primary"] for k, v in out["tasks"].items()}}
            self.last_eval = result
            self._write(result, "eval")
            self._print(f"step {self.step}: eval mean {100 * out['mean']:.1f} | " + " ".join(
                f"{k} {100 * v['primary']:.1f}" for k, v in out["tasks"].items()))
        self.acc.wait_for_everyone()
        return result

    @contextmanager
    def _stoppable(self, collective: bool):
        """Inside, each forward of the model first checks for a stop signal (SIGTERM / SIGINT
        while :meth:`train` runs) and raises :class:`StopRequested` once one came, so a long
        evaluation or validation ends within one forward instead of running on until a launcher
        or scheduler kills the process with no checkpoint. ``collective``: every rank runs the
        same forwards, and they agree at each one (a host-side all-reduce) so all stop at the
        same forward; else only this process's signal counts (the other ranks wait)."""
        if self.signals is None:
            yield
            return

        def check(_module, _args):
            flag = self.signals.signum if self.signals is not None else 0
            if self._any_rank(flag) if collective else flag:
                raise StopRequested

        # prepended: the check runs before FSDP's own pre-forward (its all-gather) starts
        handle = self.acc.unwrap_model(self.model).register_forward_pre_hook(check, prepend=True)
        try:
            yield
        finally:
            handle.remove()

    def _stop_name(self) -> str:
        signum = self.signals.signum if self.signals is not None else 0
        return interrupt.signal_name(signum) if signum else "a stop signal on another rank"

    def train(self, stop_at_step: int | None = None) -> dict:
        """:meth:`_train` holding the run dir's lock (taken again if an earlier ``train`` call
        released it; released when it returns or raises) and handling SIGTERM / SIGINT
        (:class:`train.interrupt.StopSignals`: the first one stops after the current optimizer
        step with a checkpoint, raising :class:`train.interrupt.TrainingInterrupted`)."""
        if self.is_main and (self._lock is None or not self._lock.held):
            self._lock = rundir.RunDirLock(self.run_dir)
        try:
            at_once = self._nothing_unsaved if self.acc.num_processes == 1 else None
            with StopSignals(grace_s=interrupt.launcher_grace_s(), notify=self.is_main,
                             at_once=at_once) as sig:
                self.signals = sig
                return self._train(stop_at_step)
        finally:
            self.signals = None
            self._unlock()

    def _nothing_unsaved(self) -> bool:
        """Whether every finished step is in a checkpoint (or none has finished): a signal then
        stops at once, not after a step in progress that may take minutes (one process)."""
        return self.step == (self.saved_step if self.saved_step is not None else 0)

    @property
    def show_bars(self) -> bool:
        """Progress bars (tqdm) only on the main process, with ``trainer.progress=true`` and
        stderr (where tqdm draws) a terminal; elsewhere each log line carries the ETA."""
        return bool(self.is_main and self.cfg.trainer.progress and sys.stderr.isatty())

    def _train(self, stop_at_step: int | None = None) -> dict:
        """Run until ``trainer.max_steps`` (or ``stop_at_step``, for interrupt tests); returns
        the summary (also written to run_dir/summary.json at the end of a full run)."""
        cfg, t = self.cfg, self.cfg.trainer
        end = min(t.max_steps, stop_at_step or t.max_steps)
        batches = self.memory.batches(iter(self.data.train_batches()))  # kept for a redo
        _reset_peak_memory(self.device)  # this run's peaks, not an earlier one's in this process
        self.model.train()
        from tqdm.auto import tqdm

        bar = tqdm(total=t.max_steps, initial=self.step, unit="step", dynamic_ncols=True,
                   disable=not self.show_bars)
        if self.step < end:
            self._print(f"training steps {self.step + 1}-{end} of {t.max_steps} "
                        f"({t.global_batch} x {cfg.model.seq_len} tokens per step)", bar)
        interval = self._new_interval()
        if cfg.eval.at_start and self.step == 0:  # e.g. a relufied checkpoint before training
            self.evaluate()
            self._stop_if_signalled(bar)
        while self.step < end:
            t0 = time.perf_counter()
            # where the data was before this step: an out-of-memory in it saves the steps before
            data_state = self.data.state_dict() if self.acc.num_processes == 1 else None
            try:
                self.train_step(batches, interval)
            except torch.cuda.OutOfMemoryError as e:  # memory=auto steps down (train/memory.py)
                line = self.memory.step_down()
                if line is None:
                    self._out_of_memory(e, data_state, bar)
                    raise  # the update may be half applied: nothing to save
                self._print(line, bar)
                self._write(self.memory.record, "memory")
                continue  # the same step again, from the same batches
            except (RuntimeError, MemoryError) as e:
                if is_cpu_out_of_memory(e):
                    self._out_of_memory(e, data_state, bar)
                raise
            dt = time.perf_counter() - t0
            line = self.memory.after_step()  # re-plans once when the FFN paths have settled
            if line is not None:
                self._print(line, bar)
                self._write(self.memory.record, "memory")
            interval["time"] += dt
            self.train_time += dt
            self.segment.update(steps=self.segment["steps"] + 1, time=self.segment["time"] + dt,
                                tokens=self.segment["tokens"] + self.tokens_per_step)
            bar.update(1)
            last = self.step == end
            if self.step % t.log_every == 0 or last:
                m = self.log_metrics(interval)
                interval = self._new_interval()
                bar.set_postfix(loss=f"{m['loss']:.3f}", l0=f"{m['l0_mean']:.1f}")
                self._print(self._format(m) + ("" if self.show_bars else self._eta()), bar)
            if (t.val_every and self.step % t.val_every == 0) or self.step == t.max_steps:
                v = self.validate()
                if v["val_sequences"]:
                    self._print(f"step {self.step}: val_loss {v['val_loss']:.4f} "
                                f"val_l0 {v['val_l0']:.1f}", bar)
            if cfg.eval.every_steps and self.step % cfg.eval.every_steps == 0:
                self.evaluate()
            if (t.save_every and self.step % t.save_every == 0) or last:
                self.save_checkpoint()
            self._stop_if_signalled(bar)  # every rank stops after the same step
        bar.close()
        done = self.last_eval is not None and self.last_eval.get("step") == self.step
        if self.step >= t.max_steps and cfg.eval.at_end and not done and not (
                cfg.eval.every_steps and self.step % cfg.eval.every_steps == 0):
            self.evaluate()
            self._stop_if_signalled()  # during the last eval: no summary.json, resume redoes it
        summary = self.summary()
        if self.is_main and self.step >= t.max_steps:
            ckpt_io.write_json(self.run_dir / "summary.json", summary, indent=2)
        return summary

    def _out_of_memory(self, e: BaseException, data_state: dict | None, bar) -> None:
        """An out-of-memory error inside step ``self.step + 1`` that nothing stepped down from
        (on the CPU, where ``trainer.memory=auto`` measures nothing, or with ``memory=off``):
        the step's partial gradients are dropped, the steps finished since the last checkpoint
        are saved with the data position from before the failed step (one process), and one
        line says what to lower. Returns (the caller re-raises ``e``) when the optimizer step
        had begun: the weights may be half updated, so nothing is saved.

        Raises:
            OutOfMemory: the error came before the update (a ConfigError: exit code 2).
        """
        if self._update_began:
            return
        bar.close()
        self.optimizer.zero_grad(set_to_none=True)
        where = "the CPU" if self.device.type == "cpu" else str(self.device)
        why = " ".join(str(e).split())[:160] or type(e).__name__
        if data_state is not None and self.step != (self.saved_step or 0):
            self.data.load_state_dict(data_state)  # the failed step's batches come again
            self.save_checkpoint()
        done = self.saved_step or 0
        steps = f"steps 1-{done} are" if done > 1 else "step 1 is"
        kept = (f"{steps} in checkpoint {shell_quote(self.last_ckpt)}" if done
                else "no step had finished" if not self.step else "no checkpoint was written")
        if done < self.step:  # several ranks: no save in the middle of their collectives
            kept += f"; steps {done + 1}-{self.step} are lost"
        step_down = ("trainer.memory=auto's step-down works on CUDA only"
                     if self.device.type == "cpu" else
                     "trainer.memory=off takes them as set; auto steps down by itself"
                     if self.memory.planner is None else
                     "trainer.memory=auto found nothing lower to step down to")
        line = (f"out of memory on {where} in step {self.step + 1} ({why}); {kept}. Lower "
                f"trainer.micro_batch (now {self.data.micro_batch}) or model.seq_len "
                f"({self.cfg.model.seq_len}) ({step_down}), then {self.resume_advice()}")
        raise OutOfMemory(line) from None

    def _eta(self) -> str:
        """`` | step 20/40, eta 1m05s`` from this process's mean step time (log lines without a
        progress bar)."""
        seg, left = self.segment, self.cfg.trainer.max_steps - self.step
        per = seg["time"] / max(seg["steps"], 1)
        return f" | step {self.step}/{self.cfg.trainer.max_steps}, eta {_duration(per * left)}"

    def _stop_if_signalled(self, bar=None) -> None:
        """Stop (:meth:`_stop_on_signal`) if any rank got SIGTERM / SIGINT; all ranks agree."""
        signum = self._any_rank(self.signals.signum if self.signals else 0)
        if signum:
            if bar is not None:
                bar.close()
            self._stop_on_signal(signum)

    def _stop_on_signal(self, signum: int) -> None:
        """After the step that a SIGTERM / SIGINT interrupted: checkpoint it (unless just saved,
        or no step was trained), print and log one line, raise
        :class:`train.interrupt.TrainingInterrupted`."""
        if self.saved_step != self.step and self.step > 0:
            self.save_checkpoint()
        name = interrupt.signal_name(signum)
        saved = (f"checkpoint written to {shell_quote(self.last_ckpt)}; " if self.last_ckpt
                 else "")
        line = (f"received {name} at step {self.step}: {saved}{self.resume_advice()} (exit code "
                f"{interrupt.exit_code(signum)})")
        self._print(line)
        raise TrainingInterrupted(signum, line, reported=True)

    def interrupted(self, e: KeyboardInterrupt) -> int:
        """The exit code of a run that an interrupt ended (``twell-train`` calls this for the
        KeyboardInterrupt that left :meth:`train`): 130 for SIGINT, 143 for SIGTERM. Prints and
        logs the interrupt's line (where to resume) unless :meth:`_stop_on_signal` did."""
        signum = e.signum if isinstance(e, TrainingInterrupted) else signal.SIGINT
        if not (isinstance(e, TrainingInterrupted) and e.reported):
            name = interrupt.signal_name(signum)
            how = ("interrupted" if not isinstance(e, TrainingInterrupted)
                   else f"received {name}: stopped at once (no step finished since the last "
                        "checkpoint, so none is lost)" if e.first
                   else f"received a second {name}: stopped at once")
            last = shell_quote(self.last_ckpt) if self.last_ckpt else "none"
            line = (f"{how} at step {self.step}; newest complete checkpoint: "
                    f"{last}; {self.resume_advice()}")
            print(line, file=sys.stderr)
            self._log(line)
        return interrupt.exit_code(signum)

    def _print(self, line: str, bar=None) -> None:
        """Print on the main process (through the progress bar if any) and log to train.log."""
        if self.is_main:
            (bar.write if bar is not None else print)(line)
            self._log(line)

    def _warn(self, line: str) -> None:
        print(line, file=sys.stderr)
        self._log(line)

    def _log(self, *lines: str) -> None:
        """Append lines (timestamped) to run_dir/train.log on the main process; lines from
        before the run dir is set up wait until it is."""
        if not getattr(self, "is_main", True):
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self._log_lines += [f"[{stamp}] {ln}\n" for ln in lines]
        if self._log_ready and self._log_lines:
            with ckpt_io.open_run_file(self.run_dir / "train.log") as f:
                f.writelines(self._log_lines)
            self._log_lines.clear()

    def report(self, lines: list[str]) -> None:
        """Print the run's closing lines (paths, summary line) and log them to train.log."""
        if self.is_main:
            print("\n".join(lines))
            self._log(*lines)

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()

    @staticmethod
    def _format(m: dict) -> str:
        dead = "n/a" if m["dead_frac"] is None else f"{100 * m['dead_frac']:.1f}%"
        util = "" if m.get("mfu") is None else (
            f" mfu {100 * m['mfu']:.1f}% (useful {100 * m['mfu_useful']:.1f}%)")
        kl = f" kl {m['distill_kl']:.4f}" if m.get("distill_kl") is not None else ""
        return (f"step {m['step']}: loss {m['loss']:.4f} ce {m['ce']:.4f}{kl} l1 {m['l1']:.3g} "
                f"l0 {m['l0_mean']:.1f} [{m['l0_min']:.1f}-{m['l0_max']:.1f}] max {m['nnz_max']:.0f}"
                f" dead {dead} lr {m['lr']:.3g} gnorm {m['grad_norm']:.3g} "
                f"{m['tokens_per_s']:.0f} tok/s{util} mem {m['peak_mem_gb']:.2f} GB "
                f"(run {m['peak_mem_gb_run']:.2f})")

    def summary(self) -> dict:
        """Final numbers of the run (what summary.json holds). ``tokens_per_s`` is the last
        training segment's (``segment_steps``: its first and last step), ``tokens_per_s_all``
        the mean over every segment of a resumed run."""
        m, seg = self.last, self._last_segment()
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "params": self.n_params,
            "final_train_loss": m.get("loss"),
            "final_train_ce": m.get("ce"),
            "val_loss": self.last_val.get("val_loss"),
            "val_l0": self.last_val.get("val_l0"),
            "l0_mean": m.get("l0_mean"),
            "l0_layers": m.get("l0_layers"),
            "nnz_max": m.get("nnz_max"),
            "dead_pct": None if m.get("dead_frac") is None else 100 * m["dead_frac"],
            # the last training segment (this process's steps, or the checkpoint's last ones):
            # the speed of the steps as they ran, not diluted by restarts
            "tokens_per_s": seg["tokens"] / seg["time"] if seg and seg["time"] else None,
            "segment_steps": [seg["first_step"], seg["first_step"] + seg["steps"] - 1]
            if seg else None,
            "tokens_per_s_all": self.tokens_seen / self.train_time if self.train_time else None,
            "train_time_s": self.train_time,
            "precision": self.precision,
            "world_size": self.acc.num_processes,
            "eval": self.last_eval or None,
            "init": self.init_info,
            "memory": self.memory.record,
            "paths": {"run_dir": str(self.run_dir), "config": str(self.run_dir / "config.yaml"),
                      "metrics": str(self.metrics_path),
                      "checkpoint": str(self.last_ckpt) if self.last_ckpt else None},
        }

    def close(self) -> None:
        """Finish wandb and release the run dir's lock (the trainer writes nothing after)."""
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        determinism.restore(self._determinism)  # the process's torch settings before this run
        self._determinism = None
        self._unlock()

