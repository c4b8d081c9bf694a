"""The trainer's set-up steps that need no trainer: the run's warnings, the data checks, the
model (given, from ``model.init_from`` or built) with its recomputation, fused ops and
distillation teacher, the optimizer and the learning-rate schedule.

Shape legend: T sequence length.
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext

import torch

from train import checkpoint as ckpt_io
from train import determinism, parallel
from train.config import ConfigError, OptimConfig, TrainConfig, TrainerConfig
from train.lean_saves import LEAN_SAVES, enable_lean_saves, lean_saves_enabled
from train.liger import liger_enabled, use_liger
from train.loss import use_distillation
from train.metrics import flops_per_token
from train.model import build_model
from train.recompute import enable_grad_checkpointing
from train.residual_join import use_fused_joins


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



def duration(seconds: float) -> str:
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
# a GPU-sized global batch is warned about only when the run's steps at CPU_FLOPS are predicted to
# take longer than this (the tiny model's step of 512 x 256 tokens: ~29 s predicted, ~50 s run)
CPU_SLOW_RUN_S = 1800.0


def cpu_cost_warning(cfg: TrainConfig) -> str | None:
    """The warning for a GPU-sized run about to train on the CPU, or None: a global batch of 64
    or more sequences (when the CPU was not asked for with trainer.cpu) whose ``max_steps`` steps
    are predicted to take more than :data:`CPU_SLOW_RUN_S` (any such batch when the model's shape
    is not known yet: ``model.init_from``), a step predicted to take
    more than :data:`CPU_SLOW_STEP_S` (its model FLOPs, attention's ``seq_len^2`` included, at
    :data:`CPU_FLOPS`: a long ``model.seq_len``; a SIGTERM waits for the step in progress once a
    step has finished since the last checkpoint), evals over the seven tasks' full validation
    sets (eval.limit=null: ~58 k scoring requests per evaluation), or trainer.compile; the line
    names what applies and the overrides that shrink it (a run whose only slow part is
    trainer.compile: a line saying compiling takes minutes, not hours)."""
    t, e = cfg.trainer, cfg.eval
    parts, fix = [], []
    shaped = all(getattr(cfg.model, k) is not None for k in (  # null: from init_from, not yet read
        "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "seq_len"))
    step_s = (flops_per_token(cfg.model) * t.global_batch * cfg.model.seq_len / CPU_FLOPS
              if shaped else 0.0)
    run_s = t.max_steps * step_s
    if t.global_batch >= 64 and not t.cpu and (run_s > CPU_SLOW_RUN_S or not shaped):
        steps = f"{t.max_steps} step{'s' if t.max_steps != 1 else ''}"
        parts.append(f"{steps} of {t.global_batch} x {cfg.model.seq_len} tokens"
                     + (f", about {duration(run_s)} or more" if shaped else ""))
        fix.append("trainer.max_steps=20 trainer.global_batch=8 trainer.micro_batch=4")
    if step_s > CPU_SLOW_STEP_S:
        parts.append(f"about {duration(step_s)} or more per optimizer step ({t.global_batch} x "
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
    if t.compile and not parts:  # a small run: compiling is the only slow part, not hours
        return ("warning: trainer.compile=true on the CPU: compiling the model takes minutes "
                "before the first step and again for a new shape; to skip it: "
                "trainer.compile=false.")
    if t.compile:
        parts.append("torch.compile (minutes of compilation on a CPU)")
        fix.append("trainer.compile=false")
    if not parts:
        return None
    return ("warning: " + ("" if t.cpu else "no GPU found; ") + "this is a GPU-sized run ("
            + "; ".join(parts) + ") and can take hours on the CPU. To shrink it: " + " ".join(fix)
            + ".")


def make_accelerator(t) -> tuple:
    """Threads, precision and the ``accelerate.Accelerator`` of trainer config ``t`` (FSDP2
    settings when launched with configs/accelerate/fsdp2.yaml: the trainer shards the model
    itself, train/parallel.py, accelerate gives the process group and device). Returns
    ``(accelerator, precision, fsdp settings or None)``; precision ``"bf16"`` or ``"fp32"``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import AutocastKwargs

    if t.num_threads:
        torch.set_num_threads(t.num_threads)
    precision = t.precision
    if precision == "auto":
        precision = "bf16" if (torch.cuda.is_available() and not t.cpu) else "fp32"
    if AcceleratorState._shared_state:  # an earlier run in this process (Hydra -m, tests)
        AcceleratorState._reset_state()  # keeps the process group; lets precision differ
    # autocast_cache=false: no weight cast outlives its use (under checkpointing the cache
    # otherwise holds every layer's bf16 weights until the forward ends; it never hits)
    handlers = [] if t.autocast_cache else [AutocastKwargs(cache_enabled=False)]
    fsdp = parallel.fsdp_settings_from_env()
    with parallel.hidden_from_accelerate() if fsdp else nullcontext():
        acc = Accelerator(mixed_precision="bf16" if precision == "bf16" else "no", cpu=t.cpu,
                          kwargs_handlers=handlers)
    return acc, precision, fsdp


def given_on_command_line(key: str) -> bool:
    """Did this run's command line set ``key`` (``twell-train optim.warmup_steps=5``, also with
    ``+``/``++``)? Outside a ``twell-train`` run (the Python API: ``Trainer(cfg)``, whose caller
    wrote every value) True."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return True
    return any(o.partition("=")[0].lstrip("+~").strip() == key
               for o in HydraConfig.get().overrides.task)


def warmup_line(cfg: TrainConfig) -> tuple[str, str] | None:
    """``("warning" | "note", line)`` when the lr warm-up is longer than the run, else None.

    The schedule is kept as configured (the lr rises to ``lr * max_steps / warmup_steps`` at
    the last step): clamping the warm-up to a short run would change the lr of every short run
    (smoke runs, benchmarks, probes) and make a run extended on resume change its warm-up half
    way. A warm-up the user set on the command line (``optim.warmup_steps=600
    trainer.max_steps=100``) is likely a mistake: a warning on stderr. One that comes from the
    configs (``optim=tiny``'s 10 steps under ``trainer.max_steps=5``, an experiment's 600 in a
    short test of it) is what a smoke run expects: a note in the run's log lines. With
    ``optim.lr=0`` there is no peak to fall short of (:func:`config_notes` says what lr 0 does)."""
    o, steps = cfg.optim, cfg.trainer.max_steps
    if o.warmup_steps <= steps or o.lr == 0:
        return None
    peak = o.lr * steps / o.warmup_steps
    if given_on_command_line("optim.warmup_steps"):
        return "warning", (f"warning: optim.warmup_steps={o.warmup_steps} > trainer.max_steps="
                           f"{steps}: the learning rate never reaches optim.lr (peak "
                           f"{peak:.2e}); lower optim.warmup_steps.")
    return "note", (f"note: the configured lr warm-up (optim.warmup_steps={o.warmup_steps}) is "
                    f"longer than this {steps}-step run: the lr rises to {peak:.2e} by its last "
                    f"step, short of optim.lr={o.lr:.2e}.")


def config_notes(cfg: TrainConfig) -> list[str]:
    """Informational lines about the configuration (printed with the run's other lines): a
    warm-up longer than the run (:func:`warmup_line`), and ``optim.lr=0``, allowed because the
    benchmarks time steps that must leave the trained weights as they are."""
    line = warmup_line(cfg)
    notes = [line[1]] if line is not None and line[0] == "note" else []
    if cfg.optim.lr == 0:
        notes.append("note: optim.lr=0: the optimizer steps leave the weights as they are (what "
                     "a timing run wants); set optim.lr to a positive value to train.")
    return notes


def config_warnings(cfg: TrainConfig, device: torch.device) -> list[str]:
    """One-line warnings of a configuration that runs but likely not as meant on ``device``."""
    t, out = cfg.trainer, []
    line = warmup_line(cfg)
    if line is not None and line[0] == "warning":
        out.append(line[1])
    sp = cfg.sparsity
    if sp.schedule == "target_l0" and sp.target_after >= t.max_steps:
        out.append(f"warning: sparsity.target_after={sp.target_after} >= trainer.max_steps="
                   f"{t.max_steps}: the L1 coefficient is never steered (it stays "
                   f"sparsity.l1_coeff={sp.l1_coeff:g}); lower sparsity.target_after.")
    # linear_warmup: 0 up to step warmup_start (0-based), so none of steps 0..max_steps-1 gets L1
    if sp.schedule == "linear_warmup" and sp.l1_coeff > 0 and sp.warmup_start >= t.max_steps - 1:
        out.append(f"warning: sparsity.warmup_start={sp.warmup_start} with trainer.max_steps="
                   f"{t.max_steps}: the L1 warm-up never starts (the coefficient is 0 through "
                   f"step {sp.warmup_start + 1}, so the whole run trains without L1); lower "
                   "sparsity.warmup_start and sparsity.warmup_end, raise trainer.max_steps, or "
                   "use sparsity.schedule=constant.")
    line = cpu_cost_warning(cfg) if device.type == "cpu" else None
    if line:  # e.g. trainer=gpu or experiment=relufy_smollm2 on a machine without a GPU
        out.append(line)
    if (device.type == "cpu" and cfg.ffn.impl == "twell"
            and os.environ.get("TRITON_INTERPRET") == "1"):  # read as twell.ops reads it
        # measured: 19 tok/s training (1150 without it) and ~200 s per validation FFN call
        # of 512 tokens at the tiny shape, 2 cores; the interpreter is for the kernel tests
        out.append("warning: TRITON_INTERPRET=1 runs ffn.impl=twell through the Triton "
                   "interpreter on the CPU: ~60x slower training and minutes per validation "
                   "FFN call; unset TRITON_INTERPRET (the PyTorch version of the same sparse "
                   "math runs) unless you are testing the kernels.")
    return out


def report_config(cfg: TrainConfig, device: torch.device, print_, warn) -> None:
    """What in the configuration runs but likely not as meant: :func:`config_warnings` through
    ``warn`` (stderr), :func:`config_notes` through ``print_`` (the run's lines and train.log).
    The trainer calls it on the main process only."""
    for line in config_warnings(cfg, device):
        warn(line)
    for line in config_notes(cfg):
        print_(line)


def check_data(cfg: TrainConfig, data) -> None:
    """The data module against the model's vocabulary and the evaluation.

    Raises:
        ConfigError: a vocabulary larger than ``model.vocab_size``, or evals on data without a
            tokenizer (one line naming the key and the fix).
    """
    if data.vocab_size > cfg.model.vocab_size:
        if getattr(data, "tokenizer", None) is None:  # tokens source: ids from files
            what = (f"data.vocab_size={cfg.data.vocab_size}" if cfg.data.vocab_size else
                    f"the token files data.paths={list(cfg.data.paths)} hold ids up to "
                    f"{data.vocab_size - 1}, so the vocabulary ({data.vocab_size})")
        else:
            what = (f"the tokenizer vocabulary ({data.vocab_size}, data.tokenizer="
                    f"{cfg.data.tokenizer!r})")
        raise ConfigError(f"{what} is larger than model.vocab_size={cfg.model.vocab_size}; "
                          f"set model.vocab_size>={data.vocab_size}.")
    e = cfg.eval
    if e.enabled and getattr(data, "tokenizer", None) is None:
        raise ConfigError(
            f"eval is on (eval.at_end={e.at_end}, eval.every_steps={e.every_steps}, "
            f"eval.at_start={e.at_start}) but "
            f"data.source={cfg.data.source!r} has no tokenizer to score the tasks with; "
            "set eval=disabled or use a data source with a tokenizer.")


def load_model(cfg: TrainConfig, model, init_src, resume_from, vocab_check, print_):
    """The model to train: ``model`` as given, ``model.init_from``'s (``init_src``: its
    inspected checkpoint; weights loaded unless resuming, when the run's checkpoint holds
    them), or built from ``cfg.model``. Returns ``(model, init_info)`` (the init_from record,
    None unless weights were loaded).

    Raises:
        ConfigError: both a ready model and ``model.init_from``.
    """
    if model is not None:
        if init_src is not None:
            raise ConfigError(f"model.init_from={cfg.model.init_from!r} and a ready model "
                              "were both given; pass one of them.")
        return model, None
    if init_src is None:
        return build_model(cfg.model, cfg.ffn), None
    from train import pretrained

    if resume_from is None:  # pretrained weights
        model, switched = pretrained.build_model(cfg.model, cfg.ffn, init_src)
        line, info = pretrained.describe(cfg.model, init_src, vocab_check=vocab_check,
                                         switched=switched, weights_loaded=True)
        print_(line)
        return model, info
    # resuming: the shape from the run's own checkpoint
    model, _ = pretrained.build_model(cfg.model, cfg.ffn, init_src, load_weights=False)
    print_(f"model.init_from={cfg.model.init_from}: not read (resuming the run's "
           f"checkpoint {resume_from}, which holds the model)")
    return model, None


def prepare_model(model, cfg: TrainConfig, *, device, precision: str, fsdp, print_) -> str | None:
    """Recomputation and the fused non-FFN ops on ``model``; returns who computes the loss
    without logits (``"liger"``, or None: transformers)."""
    t = cfg.trainer
    # non-reentrant: the L1 side output keeps its graph. The FSDP config's
    # fsdp_activation_checkpointing means the same and is applied through the same call once
    if t.grad_checkpointing or (fsdp and fsdp.activation_checkpointing):
        enable_grad_checkpointing(model, t.checkpoint_ffn or "always")
    # the fused non-FFN ops (RMSNorm, RoPE, the loss): Liger-Kernel's where it runs
    # (train/liger.py), transformers' own elsewhere (the CPU, compiled runs)
    if t.liger and device.type != "cuda":
        print_("trainer.liger=true: Liger-Kernel's kernels run on CUDA only; this "
               f"{device.type} run keeps transformers' norms, RoPE and loss")
    if t.fused_norm_cast and device.type != "cuda":
        print_("trainer.fused_norm_cast=true: it acts on Liger-Kernel's norms, which run on CUDA "
               f"only; this {device.type} run keeps transformers' norms")
    if fsdp and (t.recompute_norms or t.recast_attn_weights):
        # sharded parameters swap in and out around each layer: not tested
        raise ConfigError("trainer.recompute_norms / trainer.recast_attn_weights are not "
                          "supported under FSDP; set both null or false for FSDP runs.")
    liger = liger_enabled(t.liger, device_type=device.type, precision=precision,
                          compile=t.compile)
    # where the norms return bf16 (Liger's kernels run on CUDA only; norm_out_bf16's null is
    # on wherever they do): only there is a norm output saved that recompute_norms can drop
    norms_bf16 = liger and device.type == "cuda" and t.norm_out_bf16 is not False
    lean = {key: lean_saves_enabled(getattr(t, key), key=key, device_type=device.type,
                                    precision=precision, compile=t.compile, fsdp=bool(fsdp),
                                    norms_bf16=norms_bf16)
            for key in LEAN_SAVES}
    if any(lean.values()):  # layers without checkpointing only
        enable_lean_saves(model, **lean)
    if not liger:
        return None
    # the fused loss: not with distillation (ours + KL replaces it) nor FSDP (the LM
    # head weight is a sharded DTensor outside its module's forward: untested)
    liger_loss = not cfg.distill and not fsdp
    use_fused_ops(model, t, device_type=device.type, fused_linear_ce=liger_loss,
                  fsdp=bool(fsdp))
    # (on the CPU, where a forced trainer.liger=true falls back, transformers' loss)
    return "liger" if liger_loss and device.type == "cuda" else None


def use_fused_ops(model, t: TrainerConfig, *, device_type: str, fused_linear_ce: bool,
                  fsdp: bool = False) -> None:
    """Liger-Kernel's norms, RoPE and (``fused_linear_ce``) fused loss on ``model``, with the
    norms' bf16 output (``t.norm_out_bf16``) written by their own kernel (``t.fused_norm_cast``),
    and, where that kernel runs (``device_type`` cuda) and not under FSDP, each residual add
    joined to the norm after it (:mod:`train.residual_join`).

    What a run with Liger on installs: :func:`prepare_model` calls it once the caller has
    decided that (:func:`train.liger.liger_enabled`), and so does the whole-model benchmark's
    forward (``studies.bench.core.build_forward``), so that it times the model training runs.
    ``t`` is read for ``norm_out_bf16`` and ``fused_norm_cast`` only (null: on). The model is
    changed in place (a Llama-style causal LM: ``model.model.layers``, ``model.model.norm``);
    its state dict stays stock.

    Raises:
        ValueError: a decoder layer without the Llama modules, or no final norm, where the joins
            are installed (:func:`train.residual_join.use_fused_joins`).
    """
    fused_cast = t.norm_out_bf16 is not False and t.fused_norm_cast is not False
    use_liger(model, fused_linear_ce=fused_linear_ce,
              norm_out_autocast=t.norm_out_bf16 is not False, fused_norm_cast=fused_cast)
    if fused_cast and device_type == "cuda" and not fsdp:
        # not under FSDP, whose per-layer hooks would not see a pending pair: untested
        use_fused_joins(model)


def attach_teacher(model, cfg: TrainConfig, init_src, resume_from, *, device, precision: str,
                   is_main: bool, print_, warn):
    """Distillation (``sparsity.distill_from``): the frozen source model as stored (also when
    resuming: then checked to be the source the run recorded), its KL added to the loss
    (train/loss.py, in chunks); returns the teacher."""
    from train import pretrained

    s, t = cfg.sparsity, cfg.trainer
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    # the teacher is the source as stored, also when resuming (init_src is then the
    # run's own checkpoint, the student)
    src = init_src
    if resume_from is not None:  # the source must be the one the run recorded
        src = pretrained.inspect_checkpoint(cfg.model.init_from)
        if is_main:
            recorded = (ckpt_io.load_state(resume_from, "trainer").get("init") or {})
            pretrained.check_same_source(src, recorded.get("sha256"),
                                         ckpt_io.shell_quote(resume_from.parent.parent),
                                         warn=warn)
    teacher = pretrained.build_teacher(src, device, dtype)
    use_distillation(model, teacher, temperature=s.distill_temperature,
                     kl_weight=s.distill_weight * s.distill_temperature ** 2,
                     chunk_rows=t.ce_chunk_rows)
    print_(f"distillation: teacher {src.spec} as stored (hidden_act "
           f"{src.hidden_act}, frozen, {dtype}), loss = CE + l1_coeff x L1"
           f" + {s.distill_weight:g} x {s.distill_temperature:g}^2 x KL")
    return teacher


def build_optimizer(model, o: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters: weight decay on matrices and embeddings, none on the
    RMSNorm weights; fused on CUDA unless ``optim.fused`` says otherwise."""
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices and embeddings
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # RMSNorm weights
    fused = o.fused if o.fused is not None else device.type == "cuda"
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=fused)


def build_scheduler(optimizer, o: OptimConfig, max_steps: int, steps_done: int = 0):
    """``LambdaLR`` of :func:`lr_factor`: after ``k`` optimizer steps the groups' lr is
    ``initial_lr * lr_factor(k + 1)``, the value step ``k + 1`` runs at. ``steps_done > 0``
    builds it at that point of the schedule (a resume with changed optim values; the groups
    must hold ``initial_lr``)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: lr_factor(k + 1, o, max_steps), last_epoch=steps_done - 1)


def attach_data(cfg: TrainConfig, acc, datamodule, init_src):
    """The data module (``datamodule``, or built for this rank by
    ``train.data.build_datamodule``, the main process first, so that a first run builds or
    fetches the corpus once) checked against the model's vocabulary and the evaluation
    (:func:`check_data`), and, built here or handed in, the eval tasks' longest choice against
    the model's positions before any step (``train.evaluation.check_eval_fits``); returns
    ``(data, model.init_from's vocabulary check or None)``.

    Raises:
        ConfigError: data that does not fit the model or the evaluation, or eval tasks that
            do not fit the model (one line).
    """
    t = cfg.trainer
    if datamodule is None:
        from train.data import build_datamodule

        with acc.main_process_first():  # the first rank fetches, the others find it cached
            datamodule = build_datamodule(
                cfg.data, seq_len=cfg.model.seq_len, micro_batch=t.micro_batch or 1,
                seed=t.seed, rank=acc.process_index, world_size=acc.num_processes)
    if cfg.eval.enabled and getattr(datamodule, "tokenizer", None) is not None:
        from train.evaluation import check_eval_fits

        with acc.main_process_first():  # the eval rows: the first rank loads (fetches) them
            check_eval_fits(cfg, datamodule.tokenizer, cfg.model.seq_len if init_src is None
                            else int(init_src.config.max_position_embeddings))
    vocab_check = None
    if init_src is not None:
        from train import pretrained

        vocab_check = pretrained.check_vocab(init_src, datamodule.vocab_size,
                                             getattr(datamodule, "tokenizer", None))
    check_data(cfg, datamodule)
    return datamodule, vocab_check


def build_plan(cfg: TrainConfig, mlps: list, *, world_size: int, fsdp, print_, reduce_host):
    """The :class:`twell.nn.FFNPlan` of the model's FFN modules ``mlps``: ``ffn.impl`` set on
    each (also on a model handed in ready: the plan reads it), ``auto``'s untimed policy under
    ``trainer.deterministic``, and the host-sync granularity this run can use."""
    from twell.nn import FFNPlan

    t = cfg.trainer
    for m in mlps:
        m.impl = cfg.ffn.impl
    if t.deterministic:  # auto's paths by the density rule, not timings (train/determinism)
        for m in mlps:
            m.policy = determinism.untimed_policy(m.policy)
    # per layer: training path, no-sync dense-backup capacity (from past heavy-row maxima by
    # ffn.backup_capacity), statistics. No-sync capacities change from step to step; as
    # integer arguments they would make torch.compile recompile the model for each new value
    # (and fall back to eager after its recompile limit), so a compiled model measures per call
    # auto's measured choice times each layer's calls with eager hooks: not under compile
    # (nor trainer.deterministic, where timings must not decide);
    # several ranks average the timings (host side) so that they choose alike
    host_sync = "call" if t.compile else cfg.ffn.host_sync
    if host_sync == "micro_batch" and (world_size > 1 or fsdp):
        # a forward run again without its backward would leave DDP's reducer (and FSDP's
        # unshard) expecting one: such runs check once per step
        print_("ffn.host_sync=micro_batch: several processes or FSDP check the "
               "dense-backup capacities once per step (step)")
        host_sync = "step"
    # the modules carry ffn.impl and ffn.policy (build_model); the plan takes the rest
    return FFNPlan(mlps, cfg.ffn.plan_options(host_sync),
                   timed=not (t.compile or t.deterministic), reduce_host=reduce_host)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (``model.model.layers``).

    Raises:
        ConfigError: ``model`` has no such layers (``trainer.compile_scope=layers`` needs them).
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ConfigError(f"trainer.compile_scope=layers needs decoder layers at "
                          f"model.model.layers; {type(model).__name__} has none: set "
                          "trainer.compile_scope=model.")
    return list(layers)


def compile_model(model, scope: str, teacher=None) -> None:
    """``torch.compile`` ``model`` in place (its parameter names and state dict stay stock).

    ``scope`` (``trainer.compile_scope``): ``model`` compiles the whole forward; ``layers``
    compiles each decoder layer and the loss on the logits (``model.loss_function``) apart,
    leaving embeddings, final norm and LM head eager. The layers run the same code on
    same-shaped inputs, and dynamo lifts each layer's parameters to graph inputs (it inlines
    nn modules), so all of them share the same compiled graphs (one for a dense FFN; a few
    between the sparse op's graph breaks): the compile time does not grow with depth. A
    Python number that differed between layers and were read in their forward would be
    guarded on: one recompilation per layer, and eager layers past dynamo's recompile limit
    (tests/train/test_compile_scope.py counts the graphs). The loss is compiled because eager it keeps several fp32 tokens x vocab tensors
    (upcast, log-softmax, its gradient) that inductor fuses away; the final norm is one
    N x D elementwise pass, not worth a graph. A distillation ``teacher`` (a frozen causal
    LM run inside the student's forward, which the ``model`` scope compiles with it) gets
    its layers compiled too (one no-grad graph).

    Raises:
        ConfigError: ``layers`` on a model without decoder layers (:func:`decoder_layers`).
    """
    if scope == "model":
        model.compile()
        return
    for m in (model, teacher) if teacher is not None else (model,):
        for layer in decoder_layers(m):
            layer.compile()
    model.loss_function = torch.compile(model.loss_function)


def wrap_model(model, cfg: TrainConfig, acc, *, fsdp, precision: str, device, print_,
               teacher=None):
    """Compile (``trainer.compile``, :func:`compile_model`; a distillation ``teacher`` too
    where the scope leaves it out of the model's graph), shard (FSDP2) and ``acc.prepare``
    the model with its optimizer; returns ``(model, prepared optimizer, torch optimizer)``.

    Raises:
        ConfigError: ``trainer.compile=true`` with FSDP; ``compile_scope=layers`` on a model
            without decoder layers.
    """
    t = cfg.trainer
    if t.compile and fsdp:
        raise ConfigError("trainer.compile=true with FSDP (configs/accelerate/fsdp2.yaml) is "
                          "not supported; set trainer.compile=false or launch with ddp.yaml.")
    if t.compile:
        if cfg.ffn.host_sync != "call" and cfg.ffn.impl != "torch":
            print_("trainer.compile=true: the ell training path measures its dense "
                   f"backup per call (ffn.host_sync={cfg.ffn.host_sync} "
                   "applies to eager runs)")
        compile_model(model, t.compile_scope, teacher)
    if fsdp:  # shard first: the optimizer then holds the fp32 master shards
        parallel.apply_fsdp2(model, fsdp, device=device, world_size=acc.num_processes,
                             param_dtype=torch.bfloat16 if precision == "bf16" else None)
        optimizer = build_optimizer(model, cfg.optim, device)
        return model, acc.prepare(optimizer), optimizer
    optimizer = build_optimizer(model, cfg.optim, device)
    model, prepared = acc.prepare(model, optimizer)
    return model, prepared, optimizer


def attach_model(cfg: TrainConfig, model, init_src, resume_from, vocab_check, *, device,
                 precision: str, fsdp, is_main: bool, print_, warn):
    """The model (given, from ``model.init_from``, or built: :func:`load_model`) with its
    recomputation, Liger-Kernel's fused ops (:func:`prepare_model`) and its distillation
    teacher (:func:`attach_teacher`); returns ``(model, init record or None, fused_loss,
    teacher or None)``, ``fused_loss`` being who computes the loss without logits
    (``"liger"``, ``"ours"`` or None)."""
    model, init_info = load_model(cfg, model, init_src, resume_from, vocab_check, print_)
    fused_loss = prepare_model(model, cfg, device=device, precision=precision, fsdp=fsdp,
                               print_=print_)
    teacher = None
    if cfg.distill:
        teacher = attach_teacher(model, cfg, init_src, resume_from, device=device,
                                 precision=precision, is_main=is_main, print_=print_, warn=warn)
        fused_loss = "ours"  # CE + KL in chunks (train/loss.py)
    return model, init_info, fused_loss, teacher


def apply_optim_config(scheduler, o: OptimConfig, max_steps: int, step: int):
    """Resume with ``trainer.resume_allow_changes=true``: put ``o``'s values into the loaded
    optimizer's param groups (lr, weight decay of the matrices' group, betas, eps) and return
    the lr schedule rebuilt at the checkpoint's ``step``, so step N+1 runs at the new
    schedule's value for step N+1 (a no-op when nothing changed)."""
    optimizer = scheduler.optimizer  # the torch optimizer under accelerate's wrapper
    for group, wd in zip(optimizer.param_groups, (o.weight_decay, 0.0)):
        group.update(initial_lr=o.lr, weight_decay=wd, betas=tuple(o.betas), eps=o.eps)
    return build_scheduler(optimizer, o, max_steps, step)
