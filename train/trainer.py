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

import dataclasses
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import set_seed
from omegaconf import OmegaConf

from train import checkpoint as ckpt_io
from train import determinism, loop, memory, parallel, rundir
from train.checkpointer import (  # noqa: F401  (config_diff: callers import it from here)
    Checkpointer,
    NonFiniteLossError,
    config_diff,
    config_to_dict,
)
from train.config import TrainConfig
from train.evaluation import run_evals, run_validation
from train.loop import OutOfMemory, is_cpu_out_of_memory  # noqa: F401  (imported from here)
from train.metrics import device_peak_flops
from train.metrics_log import (
    Interval,
    MetricsLogger,
    RunLog,
    Segment,
    StepSums,
    format_record,
    run_summary,
    summary_line,  # noqa: F401  (callers import it from here)
)
from train.model import ffn_modules
from train.recompute import set_recompute
from train.setup import (
    apply_optim_config,
    attach_data,
    attach_model,
    build_plan,
    build_scheduler,
    make_accelerator,
    report_config,
    wrap_model,
)
from train.sparsity import (
    DeadNeuronTracker,
    L1Schedule,
    reinit_dead_gates,
)
from train.step import (
    accepted_step,
    draw_step,
    micro_steps,
    probe_densities,
    probe_forward_backward,
)
from train.step_shape import StepShape
from train.stop import RunStops


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
        l1: the :class:`train.sparsity.L1Schedule` (each step's L1 coefficient).
        shape: the :class:`train.step_shape.StepShape` the steps run at (micro-batch,
            accumulation, recomputation); set it with :meth:`set_step_shape` only.
        checkpointer: the :class:`train.checkpointer.Checkpointer` that finds, saves and restores
            this run's checkpoints; ``save_checkpoint``, ``resume``, ``resume_advice``,
            ``last_ckpt`` and ``saved_step`` go through it.
        metrics: the :class:`train.metrics_log.MetricsLogger` (metrics.jsonl, wandb);
            ``runlog`` the printed lines and train.log.
        stops: the :class:`train.stop.RunStops` of SIGTERM / SIGINT while :meth:`train` runs
            (the ranks' agreement, the stop's checkpoint and line).

    Drivers of the loop (the memory planner, benchmarks) use the public calls:
    :meth:`new_interval`, :meth:`run_step` / :meth:`train_step`, :meth:`log_metrics`,
    :meth:`set_step_shape`, :meth:`set_recompute`, :meth:`forward_backward`,
    :meth:`ffn_densities`, :meth:`zero_grad`, :meth:`reduce`.

    Raises:
        ConfigError: bad configuration, a resume the run dir does not allow (docs/training.md,
            Resuming), a run dir locked by another process (one line naming the key and the
            fix), or a ``model`` together with ``model.init_from``.
    """

    def __init__(self, cfg: TrainConfig, run_dir: str | Path, *, datamodule=None,
                 model=None) -> None:
        # the run dir is locked from the first check to close(); a construction that fails
        # unlocks it and removes the directory if it made it and left nothing else there
        self._lock: rundir.RunDirLock | None = None
        self.runlog = RunLog(Path(run_dir) / "train.log")  # printed lines and train.log
        self._determinism: determinism.Saved | None = None  # trainer.deterministic; close()
        made_dir = not Path(run_dir).exists()
        had_lock_file = (Path(run_dir) / rundir.LOCK_FILE).exists()
        try:
            self._setup(cfg, run_dir, datamodule=datamodule, model=model)
        except BaseException:
            determinism.restore(self._determinism)
            self._determinism = None
            rundir.undo_failed_setup(Path(run_dir), self._lock, made_dir=made_dir,
                                     had_lock_file=had_lock_file)
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
        if self.is_main:  # a configuration that runs but likely not as meant: warnings, notes
            report_config(cfg, self.device, print_=self._print, warn=self._warn)
        self.checkpointer.check_resume_config(resume_from, self.config_dict)
        if self.is_main:  # locked and new or this run's: a failure may now write into it
            rundir.claim(self.run_dir)

        set_seed(cfg.trainer.seed)
        vocab_check = self._setup_data(cfg, datamodule)
        # the model with its recomputation, Liger's fused ops and its distillation teacher;
        # fused_loss: who computes the loss without logits ("liger" | "ours" | None)
        model, self.init_info, self.fused_loss, self.teacher = attach_model(
            cfg, model, self.init_src, resume_from, vocab_check, device=self.device,
            precision=self.precision, fsdp=self.fsdp, is_main=self.is_main, print_=self._print,
            warn=self._warn)
        self._setup_parallel(cfg, model)
        self._setup_counters()
        if resume_from is not None:
            self.resume(resume_from)
        elif self.is_main:
            rundir.start_fresh(self.run_dir, OmegaConf.to_yaml(self.config_dict))
            if self.init_info is not None:
                self._write({"step": 0, **self.init_info}, "init")
        self.memory = memory.plan_memory(self)  # trainer.memory=auto: micro-batch, recomputation
        self.memory.report(self._print, self._write)
        if cfg.trainer.memory == "off" and cfg.trainer.memory_budget_gb is not None:
            self._warn(f"warning: trainer.memory_budget_gb={cfg.trainer.memory_budget_gb:g} does "
                       "nothing with trainer.memory=off (the micro-batch and recomputation as "
                       "set); set trainer.memory=auto to plan within it, or drop it")
        self.runlog.start()  # the lines printed so far, then each one
        self.acc.wait_for_everyone()
        self.metrics.start_wandb(cfg.logging, self.run_dir, self.config_dict, self._print)

    def _setup_accelerator(self, cfg: TrainConfig) -> None:
        """Threads, precision, the Accelerator (FSDP2 settings, gradient accumulation), the
        host-side process group, and rank 0's run-directory lock."""
        self.acc, self.precision, self.fsdp = make_accelerator(cfg.trainer)
        self._accum = cfg.check_world(self.acc.num_processes)  # the first StepShape's
        # ranks agree on stops and failed saves through host-side all-reduces (no GPU sync)
        self._host_group = parallel.host_group(self.acc.num_processes)
        self.is_main = self.runlog.is_main = self.acc.is_main_process
        self.device = self.acc.device
        if self.is_main:  # DDP: rank 0 holds the lock for the job (torchrun ends the others)
            self._lock = rundir.RunDirLock(self.run_dir)

    def _setup_data(self, cfg: TrainConfig, datamodule):
        """The data module (built unless given) and its checks against the model's vocabulary
        and the evaluation; returns ``model.init_from``'s vocabulary check (None without it)."""
        if datamodule is None:
            self._print(f"run dir {self.run_dir}: loading data.source={cfg.data.source} (a "
                        "first run builds or fetches it) ...")
        self.data, vocab_check = attach_data(cfg, self.acc, datamodule, self.init_src)
        self.shape = StepShape(cfg.trainer.global_batch // self.acc.num_processes,
                               self.data.micro_batch, self._accum, cfg.model.seq_len)
        return vocab_check

    def _setup_parallel(self, cfg: TrainConfig, model) -> None:
        """The FFN plan, compile, FSDP2 / DDP wrapping, optimizer, scheduler and the dead-neuron
        tracker."""
        t, precision = cfg.trainer, self.precision
        self.mlps = ffn_modules(model)
        self.plan = build_plan(cfg, self.mlps, world_size=self.acc.num_processes, fsdp=self.fsdp,
                               print_=self._print,
                               reduce_host=self._host_sum if self.acc.num_processes > 1 else None)
        self.n_params = sum(p.numel() for p in model.parameters())
        self._print(f"model: {self.n_params / 1e6:.2f}M parameters, {cfg.model.num_layers} layers, "
                    f"FFN {cfg.ffn.impl}; {precision} on {self.device} x "
                    f"{self.acc.num_processes}")
        # MFU denominators (train/metrics.py): None on CPU / fp32 / unknown GPU -> MFU not logged
        self.metrics = MetricsLogger(self.metrics_path, self.acc, cfg.model,
                                     device_peak_flops(self.device, precision, t.peak_tflops),
                                     self.is_main)
        self.model, self.optimizer, optimizer = wrap_model(
            model, cfg, self.acc, fsdp=self.fsdp, precision=precision, device=self.device,
            print_=self._print, teacher=self.teacher)
        self.scheduler = build_scheduler(optimizer, cfg.optim, t.max_steps)  # stepped by hand
        self.tracker = DeadNeuronTracker(
            cfg.model.num_layers, cfg.model.intermediate_size,
            cfg.sparsity.dead_window_tokens or self.tokens_per_step, device=self.device)
        self.l1 = L1Schedule(cfg.sparsity)  # the L1 coefficient of each step

    def _setup_counters(self) -> None:
        """The training state a fresh run starts from (a resume overwrites it)."""
        self.step = 0  # optimizer steps done
        self.tokens_seen = 0  # global training tokens consumed
        self.train_time = 0.0  # seconds spent in train steps (all runs of this job)
        self.last: dict = {}  # latest logged metrics (for summary.json)
        self.last_val: dict = {}
        self.last_eval: dict = {}
        self.prev_segment: Segment | None = None  # the checkpoint's last training segment
        self.segment = Segment(self.step + 1)  # this process's
        self.stops = RunStops(self, self._any_rank)  # SIGTERM / SIGINT while train() runs
        self.update_began = False  # whether the running step's optimizer update began

    # ---------------------------------------------------------------- setup helpers

    @property
    def accum(self) -> int:
        """Micro-batches per optimizer step (``shape.accum``)."""
        return self.shape.accum

    def set_step_shape(self, micro_batch: int, accum: int, recompute: str) -> StepShape:
        """Train the next steps in ``accum`` micro-batches of at most ``micro_batch`` sequences,
        recomputing ``recompute`` of each layer (:data:`train.recompute.RECOMPUTE_MODES`): the
        one setter of :attr:`shape` (the memory planner's). The data module draws at the new
        micro-batch, the model recomputes as asked, and the FFN plan's dense-backup capacities
        and timings (rows per FFN call) are scaled to it (``FFNPlan.set_rows_per_call``), its
        timings dropped when the recomputation changes (it changes every FFN's time). Returns
        the new shape."""
        old = self.shape
        self.shape = dataclasses.replace(old, micro_batch=micro_batch, accum=accum,
                                         recompute=recompute)
        self.data.micro_batch = micro_batch
        self.set_recompute(recompute)
        self.plan.set_rows_per_call(self.shape.rows_per_call, micro_batch)
        if old.recompute is not None and old.recompute != recompute:
            self.plan.forget_timings()
        return self.shape

    def set_recompute(self, recompute: str) -> None:
        """Make the model recompute ``recompute`` of each layer (``train.recompute``) without
        changing :attr:`shape` (a memory probe's candidate; :meth:`set_step_shape` sets both)."""
        set_recompute(self.acc.unwrap_model(self.model), recompute)

    @property
    def world_size(self) -> int:
        """Processes training together (1: no DDP / FSDP)."""
        return self.acc.num_processes

    @property
    def fsdp_recompute(self) -> bool:
        """Whether the FSDP config asks for activation checkpointing (whole layers)."""
        return bool(self.fsdp and self.fsdp.activation_checkpointing)

    def reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """``t`` reduced over ranks (sum / mean / max; every rank calls it), else ``t``."""
        return self.acc.reduce(t, op) if self.acc.num_processes > 1 else t

    def zero_grad(self) -> None:
        """Drop the accumulated gradients (set to None)."""
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, ids_BT: torch.Tensor) -> None:
        """One forward and backward of the token ids ``ids_BT`` ((B, T) int64 on the device) at
        this step's loss, ``CE + l1_coeff * L1``, accumulating gradients with no all-reduce over
        ranks and no optimizer step (the memory planner's probe; :meth:`zero_grad` after)."""
        probe_forward_backward(self.model, self.acc, self.mlps, ids_BT, self.l1.at(self.step))

    def ffn_densities(self, ids_BT: torch.Tensor) -> torch.Tensor:
        """(2, L) float64 device tensor: each FFN's mean active units per token (L0) and heavy-row
        fraction over one training forward of ``ids_BT`` ((B, T) int64 on the device; no
        backward), averaged over ranks (every rank calls it)."""
        return self.reduce(probe_densities(self.model, self.mlps, ids_BT), "mean")

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.trainer.global_batch * self.cfg.model.seq_len

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def state_dict(self) -> dict:
        """Trainer state for checkpoints, plain data and tensors only (``ckpt_io.save_state``):
        step, tokens seen, timing, the dead-neuron tracker, the L1 coefficient, the FFN plan
        (auto's paths and the dense-backup capacities: they pick the backup GEMMs' shapes, so an
        exact resume needs them), the init_from record, the last segment (closing tokens/s)."""
        seg = self._last_segment()
        return {"step": self.step, "tokens_seen": self.tokens_seen, "train_time": self.train_time,
                "sparsity": self.tracker.state_dict(), "l1": self.l1.state_dict(),
                "ffn_plan": self.plan.state_dict(), "init": self.init_info,
                "segment": None if seg is None else seg.as_dict()}

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: no ``ffn_plan`` (the checkpointer's one line names the folder).
        """
        self.step = int(d["step"])
        self.tokens_seen = int(d["tokens_seen"])
        self.train_time = float(d["train_time"])
        self.tracker.load_state_dict(d["sparsity"])
        self.l1.load_state_dict(d.get("l1"))
        if "ffn_plan" not in d:  # the checkpointer reports it in one line naming the folder
            raise ValueError("the trainer state has no ffn_plan (the FFN plan's paths and "
                             "capacities): it predates the plan and cannot be resumed")
        self.plan.load_state_dict(d["ffn_plan"])
        if d.get("init") is not None:
            self.init_info = d["init"]
        self.prev_segment = Segment(**d["segment"]) if d.get("segment") else None
        self.segment = Segment(self.step + 1)

    def _last_segment(self) -> Segment | None:
        """This process's segment if it trained a step, else the checkpoint's last one."""
        return self.segment if self.segment.steps else self.prev_segment

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step{N}/`` atomically (all ranks call this); returns the folder
        (:meth:`train.checkpointer.Checkpointer.save`: format, errors raised)."""
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

    def _host_sum(self, values: list[float]) -> list[float]:
        """``values`` summed over ranks (host side: the FFN plan averages its timings)."""
        return parallel.host_sum(values, self._host_group)

    def _any_rank(self, flag: int) -> int:
        """The largest ``flag`` over ranks (host side); ``flag`` itself on one process."""
        return parallel.host_max(flag, self._host_group)

    def resume(self, path: Path) -> None:
        """Restore everything from a checkpoint folder on any number of ranks
        (:meth:`train.checkpointer.Checkpointer.resume`: what continues exactly, errors raised),
        then, with ``trainer.resume_allow_changes``, this config's optim values."""
        latest = self.checkpointer.resume(self, path)
        # after the restore, which draws no random numbers and reads no lr: the schedule is the
        # trainer's (train.setup.build_scheduler), so the trainer rebuilds it
        if self.cfg.trainer.resume_allow_changes:
            self.scheduler = apply_optim_config(self.scheduler, self.cfg.optim,
                                                self.cfg.trainer.max_steps, self.step)
        self.last = latest.get("train", self.last)
        self.last_val = latest.get("val", self.last_val)
        self.last_eval = latest.get("eval", self.last_eval)

    def resume_advice(self) -> str:
        """How to continue this run after it stopped: the exact ``hydra.run.dir`` and
        ``trainer.resume`` that resume from its newest checkpoint
        (:meth:`train.checkpointer.Checkpointer.resume_advice`)."""
        return self.checkpointer.resume_advice()

    # ---------------------------------------------------------------- the loop

    def new_interval(self) -> Interval:
        """An empty log :class:`train.metrics_log.Interval` for :meth:`run_step` /
        :meth:`train_step` and :meth:`log_metrics` (a driver of the loop: benchmarks)."""
        return Interval.zeros(self.cfg.model.num_layers, self.device)

    def _micro_steps(self, ids: list, coeff: float) -> StepSums:
        """Forward + backward of the step's micro-batches (:func:`train.step.micro_steps`)."""
        def on_redo(micro: int, over: list[int]) -> None:
            self._print(f"step {self.step + 1}, micro-batch {micro + 1}: layers {over} had more "
                        "heavy rows than their dense-backup capacity; running its forward "
                        "again, those layers measuring per call")

        return micro_steps(self.model, self.acc, self.mlps, self.plan, ids, coeff,
                           width=self.cfg.model.intermediate_size, on_redo=on_redo)

    def run_step(self, batches, interval: Interval) -> float:
        """:meth:`train_step` timed: its seconds go to ``interval`` (tokens/s), the run's
        training time and this process's segment; returns them."""
        t0 = time.perf_counter()
        self.train_step(batches, interval)
        dt = time.perf_counter() - t0
        interval.time += dt
        self.train_time += dt
        self.segment.add(dt, self.tokens_per_step)
        return dt

    def train_step(self, batches, interval: Interval) -> None:
        """One optimizer step over ``accum`` micro-batches; accumulates metrics in ``interval``.

        Host synchronisation: once, after the backward of the last micro-batch (the non-finite
        check and the FFN plan's statistics: :func:`train.step.sync_step`). The plan then
        accepts the step, or asks for a redo when some layer on the ELL path had more heavy
        rows than its no-sync dense-backup capacity: the attempt's gradients are discarded
        before the optimizer sees them and the step runs again measuring per call (exact, so
        it is accepted). The plan also sets the next step's capacities and ``auto``'s paths.
        With ``ffn.host_sync=micro_batch`` the capacities are also checked after each
        micro-batch's forward (one more host sync each, ``FFNPlan.call_overflow``): an
        overflowed micro-batch runs its forward again before its backward, so the step is not
        redone.

        Raises:
            NonFiniteLossError: the loss or gradient norm is NaN / inf (the step not applied).
        """
        cfg = self.cfg
        self.update_began = False
        coeff = self.l1.at(self.step)
        lr = self.scheduler.get_last_lr()[0]
        ids = draw_step(batches, self.shape, self.data)  # kept until the step is accepted
        m, grad_norm, stats = self._accepted_step(ids, coeff, interval)
        self.update_began = True  # from here an error may leave the weights half updated
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.l1.update(self.step, stats.nnz_sum_L, stats.tokens)  # the next step's coefficient
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        interval.add_step(m, len(ids), self.tokens_per_step, grad_norm, lr, coeff)
        # dead neurons: counts summed over ranks so every rank holds the same window state
        dead_LH = self.tracker.update(stats.active_LH, self.tokens_per_step)
        if dead_LH is not None and cfg.sparsity.reinit_dead:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(cfg.trainer.seed * 1_000_003 + self.step)  # same on all ranks / resume
            reinit_dead_gates(self.mlps, dead_LH, lam=cfg.sparsity.reinit_lambda,
                              std=cfg.sparsity.reinit_std, generator=gen)

    def _accepted_step(self, ids: list, coeff: float, interval: Interval):
        """The step's micro-steps, clipped, until the FFN plan accepts them (a redone step
        measures per call: it cannot overflow again); ``(sums, grad norm, stats)``."""
        def redo(layers: list[int]) -> None:
            self.optimizer.zero_grad(set_to_none=True)  # discard the attempt
            interval.backup_redos += 1
            self._print(f"step {self.step + 1}: layers {layers} had more heavy rows than their "
                        "dense-backup capacity; redoing the step with per-call measurement")

        finite, m, grad_norm, stats = accepted_step(
            self._micro_steps, self.plan, self.acc, self.model, ids, coeff,
            grad_clip=self.cfg.optim.grad_clip, seq_len=self.cfg.model.seq_len, on_redo=redo)
        if not finite:
            raise NonFiniteLossError(
                f"non-finite loss or gradient at step {self.step + 1} (loss "
                f"{m.loss.item() / self.accum:.4g}, grad norm {grad_norm.item():.4g}); the "
                f"step was not applied; last good checkpoint: {self.last_ckpt or 'none'}",
                step=self.step + 1, reason="non-finite loss or gradient",
                last_ckpt=self.last_ckpt)
        return m, grad_norm, stats

    def log_metrics(self, interval: Interval) -> dict:
        """Reduce the interval's metrics over ranks (host sync) and write them everywhere;
        returns the train record as a dict (:class:`train.metrics_log.TrainRecord`)."""
        dead = self.tracker.dead_fraction_L
        m = self.metrics.train_record(interval, step=self.step, tokens_seen=self.tokens_seen,
                                      dead_L=dead, plan=self.plan,
                                      auto=self.cfg.ffn.impl == "auto").as_dict()
        self.last = m
        self._write(m)
        return m

    def _write(self, m: dict, prefix: str = "train") -> None:
        self.metrics.write(m, prefix, step=self.step)

    def validate(self) -> dict:
        """Token-weighted mean CE and L0 (mean over layers) on the first
        ``trainer.val_sequences`` held-out sequences (rounded down to a multiple of the world
        size; each rank takes its equal share), so the result depends neither on the
        micro-batch nor on how the sequences fall into batches. Fewer if the split is smaller
        (:func:`train.evaluation.run_validation`); none after a stop signal."""
        m = run_validation(self)
        if m is None:  # stopped by a signal
            return {"step": self.step, "val_loss": None, "val_l0": None, "val_sequences": 0}
        self.last_val = m
        self._write(m, "val")
        return m

    def evaluate(self) -> dict:
        """Downstream zero-shot evals (``evals.evaluate``) on the main process (on every rank of
        an FSDP model, whose forward gathers weights from all of them; the main one logs):
        :func:`train.evaluation.run_evals`; ``{}`` elsewhere and after a stop signal."""
        result = run_evals(self)
        if result:
            self.last_eval = result
            self._write(result, "eval")
        self.acc.wait_for_everyone()
        return result or {}

    def train(self, stop_at_step: int | None = None) -> dict:
        """Run until ``trainer.max_steps`` (or ``stop_at_step``, for interrupt tests) and return
        the summary (:func:`train.loop.run`; summary.json at the end of a full run), holding the
        run dir's lock (taken again if an earlier ``train`` call
        released it; released when it returns or raises) and handling SIGTERM / SIGINT
        (:meth:`train.stop.RunStops.watching`: the first one stops after the current optimizer
        step with a checkpoint, raising :class:`train.interrupt.TrainingInterrupted`)."""
        if self.is_main and (self._lock is None or not self._lock.held):
            self._lock = rundir.RunDirLock(self.run_dir)
        try:
            with self.stops.watching():
                return loop.run(self, stop_at_step)
        finally:
            self._unlock()

    @property
    def show_bars(self) -> bool:
        """Progress bars (tqdm) only on the main process, with ``trainer.progress=true`` and
        stderr (where tqdm draws) a terminal; elsewhere each log line carries the ETA."""
        return bool(self.is_main and self.cfg.trainer.progress and sys.stderr.isatty())

    def interrupted(self, e: KeyboardInterrupt) -> int:
        """The exit code of a run that an interrupt ended (``twell-train`` calls this for the
        KeyboardInterrupt that left :meth:`train`): :meth:`train.stop.RunStops.interrupted`."""
        return self.stops.interrupted(e)

    def _print(self, line: str, bar=None) -> None:
        self.runlog.print(line, bar)

    def _warn(self, line: str) -> None:
        self.runlog.warn(line)

    def report(self, lines: list[str]) -> None:
        """Print the run's closing lines (paths, summary line) and log them to train.log."""
        self.runlog.report(lines)

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()

    _format = staticmethod(format_record)

    def summary(self) -> dict:
        """Final numbers of the run (what summary.json holds). ``tokens_per_s`` is the last
        training segment's (``segment_steps``: its first and last step), ``tokens_per_s_all``
        the mean over every segment of a resumed run."""
        return run_summary(
            step=self.step, tokens_seen=self.tokens_seen, params=self.n_params,
            train_time=self.train_time, last=self.last, last_val=self.last_val,
            last_eval=self.last_eval, segment=self._last_segment(), precision=self.precision,
            world_size=self.acc.num_processes, init=self.init_info, memory=self.memory.record,
            run_dir=self.run_dir, last_ckpt=self.last_ckpt)

    def close(self) -> None:
        """Finish wandb and release the run dir's lock (the trainer writes nothing after)."""
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        determinism.restore(self._determinism)  # the process's torch settings before this run
        self._determinism = None
        self._unlock()

