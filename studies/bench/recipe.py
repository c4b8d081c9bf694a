"""The whole-model benchmark's vocabulary and the Hydra overrides of every configuration it times.

Paths (the ``path`` column of ``best_configs.csv``):

* ``hf``: stock transformers ``LlamaForCausalLM`` (ReLU, SDPA, fp32 logits) with the same
  weights; recomputation ``none`` or ``full`` (transformers' own gradient checkpointing): what a
  transformers user runs.
* ``liger``: the same model with Liger-Kernel's RMSNorm, RoPE and fused linear cross-entropy
  (``train.liger.use_liger``, what ``apply_liger_kernel_to_llama(rope=True, rms_norm=True,
  swiglu=False, fused_linear_cross_entropy=True)`` does, on this instance only): the dense
  training a user would pick instead.
* ``compile``: the same model with each decoder layer ``torch.compile``-d (regional
  compilation, as torchtitan does: one graph serves every layer; embeddings and the fp32-logit
  loss stay eager).
* ``dense``: our best dense FFN, the faster of two training paths of the FFN plan
  (``twell.nn.plan``): ``torch`` (autograd through PyTorch ops) and ``dense`` (dense mode: cuBLAS
  products and one fused elementwise pass each way). The search covers both.
* ``ell``: every layer pinned to the ELL path (the hybrid ELL + dense-backup kernels).
* ``auto``: the plan's own per-layer choices, from the bench model's trained plan state.
* ``default``: what ``experiment=paper_1p5b`` / ``paper_2b`` picks by itself (``trainer=gpu``:
  ``trainer.memory=auto``, the experiment's ``ffn.impl``), as a user gets it.

``ffn`` (a column too) names the FFN training path a row ran: ``hf``, ``torch``, ``dense``,
``ell`` or ``auto``. Our four run in one trainer (``ffn.impl=auto``) whose plan is pinned
(``FFNPlan.pin``) or left to choose, so they share one model build per size.

Stage 1 (the bench model, when trained in-process) is the scaling study's 1.5B / 2B recipe
(``studies.scaling``): AdamW lr 1e-3, 10 warmup steps then cosine, micro-batch = global batch = 8
sequences of 2048, 200 steps, no recomputation, seed 42 (init and data order), at a fixed L1
coefficient per size (:data:`STAGE1_L1`) chosen to put the held-out L0 near the paper's
(:data:`PAPER_L0`: 29 at 1.5B, 24 at 2B): the sparse speed-up follows the bench model's L0 (2B
models of held-out L0 24.3 and 29.7: 1.30x and 1.22x; BENCHMARKS.md), and 200 steps do not settle
it. Steering the coefficient to hold a training L0 (``Recipe.target_l0``,
``sparsity.schedule=target_l0``) is an option, not the default: at 1.5B it drove the L0 below
the target while the learning rate was high, lowered the coefficient, and ended above it (held-out
49.4 against 36.8 at a fixed 3e-4; BENCHMARKS.md, "stage 1 steered to hold training L0 29").
``trainer.deterministic=true`` (bitwise the same model on a rerun; ~11 % slower steps at 1.5B,
``scripts/check_determinism.py``; without it one command made models of held-out L0 27-36). Its FFNs
train in dense mode (``ffn.impl=torch``, ``ffn.dense_fused=true``: cuBLAS and one
fused pass each way), not ``auto``: ``auto`` picks each layer's path from timings, so two runs
would differ in which kernels (and which bf16 roundings) made the model, and the sparse rows of
two fresh benchmarks differed by 10 % on models of held-out L0 37.0 and 34.7 (BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PATHS = ("hf", "liger", "compile", "dense", "ell", "auto", "default")
FFNS = ("hf", "liger", "compile", "torch", "dense", "ell", "auto")
# the FFN training paths a searched path runs (dense: the faster of the two)
PATH_FFNS = {"hf": ("hf",), "liger": ("liger",), "compile": ("compile",),
             "dense": ("dense", "torch"), "ell": ("ell",), "auto": ("auto",)}
PATH_OF_FFN = {"hf": "hf", "liger": "liger", "compile": "compile", "torch": "dense",
               "dense": "dense", "ell": "ell", "auto": "auto"}
# ffn.impl -> the ffn a trainer of that impl starts on (the default path's own)
FFN_OF_IMPL = {"torch": "torch", "twell": "ell", "auto": "auto"}
# the inference impl whose forward a path reports (dense: dense PyTorch; hf: stock transformers)
FORWARD_IMPL = {"hf": "hf", "liger": "liger", "compile": "compile", "torch": "torch",
                "dense": "torch", "ell": "twell", "auto": "auto"}
SPARSE_PATHS = ("ell", "auto")
# the stock transformers model with its own training loop (studies.bench.steps.HFStep), plain or
# with Liger-Kernel or regional torch.compile; "best dense" is the fastest of these and ours
BASELINE_PATHS = ("hf", "liger", "compile")
DENSE_PATHS = (*BASELINE_PATHS, "dense")
# the experiment whose own choices the default path times, per model size
EXPERIMENTS = {"1p5b": "paper_1p5b", "2b": "paper_2b"}
# hf recomputes with transformers' own checkpointing only; ours also recompute attention alone
HF_RECOMPUTE = ("none", "full")
OUR_RECOMPUTE = ("none", "attention", "full")
# keys the benchmark sets itself (a --config override of one of them is refused)
CONTROLLED = ("ffn.impl", "trainer.micro_batch", "trainer.global_batch",
              "trainer.max_steps", "trainer.memory", "trainer.grad_checkpointing",
              "trainer.checkpoint_ffn", "trainer.resume", "optim.lr", "hydra.")
# the paper's non-zeros per token of its trained models (its Results table, L1 2e-5): the L0
# stage 1 aims at (STAGE1_L1) and the one Recipe.target_l0 "paper" steers to
PAPER_L0 = {"1p5b": 29.0, "2b": 24.0}
# stage 1's L1 coefficient per size: L0 = c L1^-a through the two deterministic 200-step models
# whose held-out L0 brackets PAPER_L0, solved for it (1.5B: 36.8 at 3e-4, 24.3 at 3.36e-4; 2B:
# 28.1 at 3.3e-4, 18.5 at 3.7e-4; BENCHMARKS.md). The 200-step L0 is not smooth in L1 (1.5B:
# 22.4 at 3.8e-4; 2B: 29.7 at 3e-4): an aim lands within ~20 %, and the reports read the ratio
# at PAPER_L0 between measured models. A size not listed trains at DEFAULT_L1
STAGE1_L1 = {"1p5b": 3.2e-4, "2b": 3.45e-4}
DEFAULT_L1 = 3e-4
SMOKE_SIZE = "smoke"
SMOKE_VOCAB = 64
SMOKE_SEQ = 32


@dataclass(frozen=True)
class Recipe:
    """How stage 1 trains the bench model (the scaling study's recipe; module docstring).

    Attributes:
        l1: ``sparsity.l1_coeff``; None: :data:`STAGE1_L1` of the size (else
            :data:`DEFAULT_L1`).
        lr: ``optim.lr`` (AdamW peak).
        warmup_steps: ``optim.warmup_steps``, then cosine over ``steps``.
        micro_batch: sequences per step (= global batch).
        steps: ``trainer.max_steps``: the most optimizer steps stage 1 trains.
        log_every: steps between metric lines (the L0 history the settle rule reads).
        deterministic: ``trainer.deterministic``: a bitwise-reproducible stage 1, so that two
            fresh benchmarks time the same model (without it non-deterministic reductions
            grow, through the early L0 swings, into models of held-out L0 27-36 from one
            command; BENCHMARKS.md).
        target_l0: a training L0 stage 1 steers the coefficient to hold
            (``sparsity.schedule=target_l0``): ``"paper"`` = :data:`PAPER_L0` of the size (a
            size without one: the fixed ``l1``), a number, or None (the default: the fixed
            ``l1``).
        target_after: steps at ``l1`` before the coefficient is steered (None: 30 % of
            ``steps``: the L0 falls from the dense init's thousands in the first ~50, and the
            cosine learning rate, which gives the coefficient its grip, is 54 % of its peak at
            half the steps and 17 % at three quarters).
        target_gain: ``sparsity.target_gain``.
    """

    l1: float | None = None
    lr: float = 1e-3
    warmup_steps: int = 10
    micro_batch: int = 8
    steps: int = 200
    log_every: int = 10
    deterministic: bool = True
    target_l0: float | str | None = None
    target_after: int | None = None
    target_gain: float = 0.05

    def l1_for(self, size: str) -> float:
        """The stage-1 ``sparsity.l1_coeff`` of ``size``."""
        return self.l1 if self.l1 is not None else STAGE1_L1.get(size, DEFAULT_L1)

    def target_for(self, size: str) -> float | None:
        """The L0 stage 1 holds for ``size``; None: the fixed coefficient."""
        return PAPER_L0.get(size) if self.target_l0 == "paper" else self.target_l0


def smoke_model_overrides(tokens: Path) -> list[str]:
    """The ``--smoke`` shape and data: 2 layers of width 32, FFN 64, 32 tokens, a 64-id
    synthetic token file (``tokens``), fp32 on the CPU, one thread."""
    return ["model=tiny", f"model.name={SMOKE_SIZE}", f"model.vocab_size={SMOKE_VOCAB}",
            "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2",
            "model.num_layers=2", f"model.seq_len={SMOKE_SEQ}", "data=tokens",
            f"data.paths=[{tokens}]", f"data.vocab_size={SMOKE_VOCAB}", "data.val_fraction=0.1",
            "trainer=cpu", "trainer.cpu=true", "trainer.precision=fp32", "trainer.num_threads=1"]


QUIET = ["eval=disabled", "logging.wandb_mode=disabled", "trainer.progress=false",
         "trainer.val_every=0", "trainer.save_every=0", "trainer.resume=never"]
"""Overrides that change no step: no evals, no wandb, no bar, no validation or checkpoints."""


def stage1_overrides(size: str, recipe: Recipe, config: list[str] = (),
                     smoke_tokens: Path | None = None) -> list[str]:
    """Hydra overrides of the stage-1 training run (module docstring); ``config`` (the user's
    ``--config``: data location and the like) last. ``smoke_tokens``: the ``--smoke`` shape."""
    if smoke_tokens is not None:
        base = [*smoke_model_overrides(smoke_tokens), "optim=tiny"]
    else:
        base = [f"model={size}", "trainer=gpu", "optim=adamw"]
    return [*base, f"optim.lr={recipe.lr!r}", f"sparsity.l1_coeff={recipe.l1_for(size)!r}",
            f"optim.warmup_steps={recipe.warmup_steps}",
            f"trainer.micro_batch={recipe.micro_batch}",
            f"trainer.global_batch={recipe.micro_batch}", f"trainer.max_steps={recipe.steps}",
            "trainer.grad_checkpointing=false", "ffn.impl=torch",
            "ffn.dense_fused=true", *QUIET, f"trainer.log_every={recipe.log_every}",
            *(["trainer.deterministic=true"] if recipe.deterministic else []),
            *_target_overrides(recipe, size), *config]


def _target_overrides(recipe: Recipe, size: str) -> list[str]:
    target = recipe.target_for(size)
    if target is None:
        return []
    after = recipe.steps * 3 // 10 if recipe.target_after is None else recipe.target_after
    return ["sparsity.schedule=target_l0", f"sparsity.target_l0={target!r}",
            f"sparsity.target_after={after}",
            f"sparsity.target_gain={recipe.target_gain!r}"]


def ours_overrides(size: str, search_batch: int, config: list[str] = (),
                   smoke_tokens: Path | None = None) -> list[str]:
    """The trainer all our FFN paths run in: the stage-1 shape and trainer settings
    (``trainer=gpu``: Liger-Kernel's fused ops, adaptive dense-backup capacities), impl ``auto``
    (its plan is pinned per path), learning rate 0 (AdamW runs every kernel but leaves the
    trained weights, and so the sparsity, as they are), the memory planner off (the benchmark
    searches itself) and ``search_batch`` sequences a step (the candidates' micro-batches are
    its divisors)."""
    base = smoke_model_overrides(smoke_tokens) + ["optim=tiny"] if smoke_tokens is not None \
        else [f"model={size}", "trainer=gpu", "optim=adamw"]
    return [*base, "ffn.impl=auto", "optim.lr=0", "optim.warmup_steps=0",
            "trainer.memory=off", f"trainer.micro_batch={search_batch}",
            f"trainer.global_batch={search_batch}", "trainer.grad_checkpointing=false",
            "trainer.checkpoint_ffn=always", "trainer.max_steps=1000000", *QUIET,
            "trainer.log_every=1000000", *config]


def default_overrides(size: str, smoke_tokens: Path | None = None,
                      budget_gb: float | None = None) -> list[str]:
    """The default path's trainer: ``experiment=<EXPERIMENTS[size]>`` as it is, except what
    changes no step (:data:`QUIET`) and the learning rate, 0 as for every timed row (the timed
    steps then leave the weights and their sparsity as trained). Its data module is the
    benchmark's, so the experiment's data source is not read.

    ``--smoke`` (``smoke_tokens``): the smoke shape under the planner's defaults
    (``trainer.memory=auto``, micro-batch and recomputation its choice, ``ffn.impl=auto``
    as the paper experiments), with ``budget_gb`` as ``trainer.memory_budget_gb`` (no CUDA memory
    to read it from).

    Raises:
        ValueError: a size without an experiment (:data:`EXPERIMENTS`).
    """
    if smoke_tokens is not None:
        over = [*smoke_model_overrides(smoke_tokens), "optim=tiny", "trainer.memory=auto",
                "trainer.micro_batch=null", "trainer.grad_checkpointing=null",
                "trainer.checkpoint_ffn=null", "trainer.global_batch=8", "ffn.impl=auto"]
        if budget_gb is not None:
            over.append(f"trainer.memory_budget_gb={budget_gb!r}")
    elif size in EXPERIMENTS:
        over = [f"experiment={EXPERIMENTS[size]}"]
    else:
        raise ValueError(f"size {size!r} has no paper experiment for the default path (one of "
                         f"{', '.join(EXPERIMENTS)}); leave default out of --paths")
    return [*over, "optim.lr=0", *QUIET, "trainer.log_every=1000000"]


def write_smoke_tokens(path: Path, n_tokens: int = 30_000, vocab: int = SMOKE_VOCAB,
                       seed: int = 0) -> Path:
    """A uint16 token file of documents that mostly follow a fixed random successor table
    (id 0 = end of document): a tiny model learns it and turns sparse in a few steps."""
    from train.data.synthetic import write_successor_tokens

    return write_successor_tokens(path, n_tokens, vocab, seed)


def check_config(config: list[str], controlled: tuple[str, ...] = CONTROLLED,
                 instead: str = "--budgets / --search-batch / --paths / --train-steps") -> None:
    """Refuse a ``--config`` override of a key the caller sets itself (``controlled``: the
    benchmark's by default; ``instead``: the caller's options that set them).

    Raises:
        ValueError: one line naming the override and the option that controls it instead.
    """
    for o in config:
        key = o.split("=", 1)[0].lstrip("+~")
        if "=" not in o:
            raise ValueError(f"--config {o!r} is not KEY=VALUE")
        if key.startswith(controlled):
            raise ValueError(f"--config {o!r} sets a key this command controls "
                             f"({', '.join(controlled)}); use {instead} instead")


def check_overrides(sizes: list[str], recipe: Recipe, config: list[str], *,
                    search_batch: int = 8, smoke: bool = False,
                    model_from: Path | None = None) -> None:
    """Compose stage 1's and our trainer's configs of every size before any work, so that a bad
    ``--config`` value or an unknown size stops the command at once; with ``model_from`` (a
    checkpoint folder for the one size), its ``config.json`` is checked against the size's shape.

    Raises:
        ValueError: one line: a size without ``configs/model/<size>.yaml`` (naming the sizes
            there), the trainer's :class:`train.config.ConfigError` for an override, or a
            checkpoint of another shape (:func:`studies.bench.source.check_shape`) or with an
            unreadable ``config.json``.
        FileNotFoundError: ``model_from`` has no ``config.json``.
    """
    from studies.bench.source import check_shape
    from studies.sizes import check_sizes
    from train.config import compose
    from twell.hf import read_config_json

    tokens = Path("smoke_tokens.bin") if smoke else None  # composing reads no file
    for size in [SMOKE_SIZE] if smoke else sizes:
        if not smoke:
            check_sizes([size])
        cfg1 = compose(stage1_overrides(size, recipe, config, tokens))
        compose(ours_overrides(size, search_batch, config, tokens))
        if model_from is not None:
            check_shape(read_config_json(model_from), cfg1.model, model_from)



PROFILE_PATHS = ("hf", "liger", "compile", "dense", "ell", "auto", "default", "dense-noliger",
                 "ell-noliger", "auto-noliger")
"""What ``--profile-paths`` may name: the stock-transformers baselines
(:data:`studies.bench.recipe.BASELINE_PATHS`), our trainer's FFN paths (``dense`` is dense
mode), each of ours also as ``<path>-noliger`` (``trainer.liger=false``: our own fused loss and
lean norms, eager RoPE), and ``default`` (the ``default`` row's trainer: the experiment's
config, its planner and a fresh FFN plan; the step shape the profile's). Any of them may add ``@key=value:...``: launch shapes of the
training kernels for that profile (:func:`twell.ops.launch.kernel_config`, integer values),
e.g. ``ell@dw_block_d=1024:dw_d_outer=0``; ours may end in ``+hydra.key=value+...``: overrides
of our trainer's config, e.g. ``ell+ffn.policy.hot_min_density=0.001`` (hot units on
sparse layers too)."""


def split_profile_path(name: str) -> tuple[str, dict, list[str]]:
    """``"ell@dw_block_d=256:dw_d_outer=1+model.x=1"`` -> ``("ell", {"dw_block_d": 256,
    "dw_d_outer": 1}, ["model.x=1"])``.

    Raises:
        ValueError: an unknown path, a malformed ``key=value``, or config overrides on a
            stock-transformers baseline.
    """
    name, *overrides = name.split("+")
    for o in overrides:
        if "=" not in o or o.startswith("="):
            raise ValueError(f"profile path {name!r}: {o!r} is not a Hydra key=value override")
    path, _, spec = name.partition("@")
    if path not in PROFILE_PATHS:
        raise ValueError(f"profile path {name!r}: unknown {path!r}; use one of "
                         f"{', '.join(PROFILE_PATHS)}, optionally with @key=value:...")
    kw = {}
    for item in filter(None, spec.split(":")):
        key, eq, val = item.partition("=")
        try:
            kw[key] = int(val)
        except ValueError:
            raise ValueError(f"profile path {name!r}: {item!r} is not key=<integer>") from None
        if not eq:
            raise ValueError(f"profile path {name!r}: {item!r} is not key=<integer>")
    if overrides and path.partition("-")[0] in BASELINE_PATHS:
        raise ValueError(f"profile path {name!r}: config overrides apply to our trainer's paths "
                         "only")
    return path, kw, overrides

__all__ = [
    "BASELINE_PATHS",
    "CONTROLLED",
    "DENSE_PATHS",
    "EXPERIMENTS",
    "FFNS",
    "FFN_OF_IMPL",
    "FORWARD_IMPL",
    "HF_RECOMPUTE",
    "OUR_RECOMPUTE",
    "PATHS",
    "PATH_FFNS",
    "PATH_OF_FFN",
    "PROFILE_PATHS",
    "QUIET",
    "SMOKE_SEQ",
    "SMOKE_SIZE",
    "SMOKE_VOCAB",
    "SPARSE_PATHS",
    "Recipe",
    "check_config",
    "check_overrides",
    "default_overrides",
    "ours_overrides",
    "smoke_model_overrides",
    "split_profile_path",
    "stage1_overrides",
    "write_smoke_tokens",
]
