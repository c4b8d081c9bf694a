"""What the benchmark times: model builds with given weights, the plain-transformers training
step (probed by ``train.memory.ProbeRunner``), CUDA-event timing windows, and the run's
wall-clock budget.

Shape legend: B micro-batch (sequences), T sequence length.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from train.memory import free_memory
from train.recompute import set_recompute

GIB = 2**30
STATIC_BYTES_PER_PARAM = 16  # fp32 weight 4 + gradient 4 + AdamW exp_avg 4 + exp_avg_sq 4


def log(msg: str) -> None:
    print(f"[bench_model] {msg}", flush=True)


# ---------------------------------------------------------------- models


def load_weights(model, weights: dict) -> None:
    """Copy ``weights`` (a state dict) into ``model``; the tied ``lm_head.weight`` may be absent.

    Raises:
        ValueError: any other missing or unexpected key (the first three named).
    """
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"the weights do not match the model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")


def build_ours(model_cfg, weights: dict, device, dtype=None, *, ffn=None,
               impl: str | None = None):
    """Our ``LlamaForCausalLM`` (``SparseGatedMLP`` FFNs of ``ffn.impl`` and ``ffn.policy``,
    ``ffn`` a :class:`train.config.FFNConfig`, None = its defaults; ``impl`` replaces
    ``ffn.impl``), initialised on ``device`` (not on the CPU: minutes at 1.5B) and loaded with
    ``weights``."""
    import dataclasses

    from train.config import FFNConfig
    from train.model import build_model

    ffn = FFNConfig() if ffn is None else ffn
    if impl is not None:
        ffn = dataclasses.replace(ffn, impl=impl)
    with torch.device(device):
        model = build_model(model_cfg, ffn)
    if dtype is not None:
        model.to(dtype)
    load_weights(model, weights)
    return model


def build_hf(model_cfg, weights: dict, device, dtype=None, variant: str = "hf"):
    """Stock ``LlamaForCausalLM`` (ReLU, SDPA) of ``model_cfg`` with ``weights``.

    ``variant`` (:data:`studies.bench.recipe.BASELINE_PATHS`): ``hf`` as built; ``liger``: with
    Liger-Kernel's RMSNorm, RoPE and fused linear cross-entropy (:func:`train.liger.use_liger`);
    ``compile``: every decoder layer ``torch.compile``-d (:func:`compile_layers`).

    Raises:
        ValueError: an unknown ``variant``.
    """
    from transformers import LlamaForCausalLM

    from train.model import llama_config

    if variant not in ("hf", "liger", "compile"):
        raise ValueError(f"build_hf: variant {variant!r} is unknown; use hf, liger or compile")
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(model_cfg))
    if dtype is not None:
        model.to(dtype)
    load_weights(model, weights)
    if variant == "liger":
        from train.liger import use_liger

        use_liger(model)
    elif variant == "compile":
        compile_layers(model)
    return model


def compile_layers(model) -> int:
    """``torch.compile`` each decoder layer of a transformers causal LM in place (regional
    compilation: the layers share one compiled graph, their parameters are its inputs, so one
    compilation serves all; torchtitan compiles per block the same way). Returns the number of
    layers."""
    layers = model.model.layers
    # on the CPU (the --smoke run) the same graphs without code generation: no C++ toolchain
    backend = "inductor" if next(model.parameters()).is_cuda else "aot_eager"
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)


def cpu_weights(model, pin: bool) -> dict:
    """fp32 CPU copy of a model's state dict (every measured model is loaded from it); ``pin``:
    page-locked (copies to the GPU ~2x faster)."""
    out = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return {k: v.pin_memory() for k, v in out.items()} if pin else out


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


# ---------------------------------------------------------------- plain transformers


@torch.no_grad()
def eval_loss(model, ids_BT: torch.Tensor, bf16: bool) -> float:
    """Eval-mode loss of ``model`` on ``ids_BT`` (labels = inputs), bf16 autocast if ``bf16``;
    the model's train / eval mode is restored."""
    dev = next(model.parameters()).device
    was = model.training
    model.eval()
    try:
        ids = ids_BT.to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            return model(input_ids=ids, labels=ids).loss.item()
    finally:
        model.train(was)


class HFStep:
    """One training step of plain transformers (the ``hf`` path): bf16 autocast forward with
    ``labels=ids`` (transformers' loss over fp32 logits), backward, gradient clip, fused AdamW
    at learning rate 0 (every kernel runs, the weights stay), ``zero_grad(set_to_none=True)``.

    Args:
        model: a stock ``LlamaForCausalLM`` on its device.
        optim_cfg: the run's :class:`train.config.OptimConfig` (betas, eps, weight decay, clip).
        bf16: autocast to bf16 (CUDA runs).
    """

    def __init__(self, model, optim_cfg, bf16: bool) -> None:
        self.model = model.train()
        self.device = next(model.parameters()).device
        o = optim_cfg
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=0.0, betas=tuple(o.betas), eps=o.eps, fused=self.device.type == "cuda")
        self.clip = o.grad_clip if o.grad_clip > 0 else math.inf
        self.bf16 = bf16

    world_size = 1  # the memory planner's probe (train.memory.ProbeRunner) drives it too

    def set_recompute(self, recompute: str) -> None:
        """``none`` or ``full`` (transformers' own checkpointing; :data:`HF_RECOMPUTE`)."""
        set_recompute(self.model, recompute)

    def forward_backward(self, ids_BT: torch.Tensor) -> None:
        """The probe's micro-step (:meth:`micro_step`)."""
        self.micro_step(ids_BT)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @staticmethod
    def reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        return t  # one process

    def micro_step(self, ids_BT: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one (B, T) batch; returns the loss (detached)."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.model(input_ids=ids_BT, labels=ids_BT).loss
        loss.backward()
        return loss.detach()

    def __call__(self, batches: Iterator[torch.Tensor]) -> None:
        self.micro_step(next(batches).to(self.device, non_blocking=True))
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

# ---------------------------------------------------------------- timing


def time_call(fn: Callable[[], object], device) -> float:
    """Milliseconds of one ``fn()`` (CUDA events and a sync on the GPU, the host clock else)."""
    if torch.device(device).type != "cuda":
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()  # host sync: this call's time
    return start.elapsed_time(end)


@dataclass
class Window:
    """One timed window of training steps (or forwards).

    Attributes:
        step_ms: per step, ms (CUDA events around each call on the GPU; host clock on the CPU).
        wall_ms: the whole window on the host clock, synchronised at both ends (redone steps
            and host stalls between the events included).
        peak_gb: peak GiB allocated during the window (None off CUDA).
    """

    step_ms: list[float]
    wall_ms: float
    peak_gb: float | None

    def stats(self, tokens_per_step: int) -> dict:
        """``train_tok_per_ms`` (median step), ``train_tok_per_ms_wall`` (tokens over the wall
        time), ``step_ms_median`` / ``_p10`` / ``_p90``, ``timed_steps``."""
        n, med = len(self.step_ms), statistics.median(self.step_ms)
        return {"train_tok_per_ms": tokens_per_step / med,
                "train_tok_per_ms_wall": tokens_per_step * n / self.wall_ms,
                "step_ms_median": med, "step_ms_p10": quantile(self.step_ms, 0.1),
                "step_ms_p90": quantile(self.step_ms, 0.9), "timed_steps": n}


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def time_steps(step: Callable[[], object], warmup: int, steps: int, device) -> Window:
    """Run ``step()`` ``warmup`` times, reset the peak memory, then time ``steps`` calls: CUDA
    events around each (no sync in between, the step's own syncs apart) and the host clock
    around the window.

    Raises:
        ValueError: ``steps < 1``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    if cuda:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]
        for s, e in ev:
            s.record()
            step()
            e.record()
        torch.cuda.synchronize(dev)
        step_ms = [s.elapsed_time(e) for s, e in ev]
    else:
        step_ms = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            step_ms.append(1e3 * (time.perf_counter() - t))
    wall_ms = 1e3 * (time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) / GIB if cuda else None
    return Window(step_ms, wall_ms, peak)


def batches_from(pool_NT: torch.Tensor, micro_batch: int, seed: int = 0) -> Iterator[torch.Tensor]:
    """Endless (micro_batch, T) batches drawn from the (N, T) ``pool_NT`` (a fresh permutation
    each pass; rows repeat when micro_batch > N)."""
    g = torch.Generator().manual_seed(seed)
    n = pool_NT.shape[0]
    while True:
        idx = torch.randperm(n, generator=g).repeat(math.ceil(micro_batch / n) + 1)
        for s in range(0, n, micro_batch):
            if s + micro_batch > idx.numel():
                break
            yield pool_NT[idx[s:s + micro_batch]]


class Clock:
    """The run's wall-clock budget (``--deadline``): :meth:`fits` is False (and names the
    stage in :attr:`skipped`) when ``est_s`` seconds would end past the deadline less a reserve
    for writing the outputs."""

    def __init__(self, deadline_s: float, reserve_s: float = 10.0) -> None:
        self.t0 = time.monotonic()
        self.deadline_s, self.reserve_s = deadline_s, reserve_s
        self.skipped: list[str] = []
        self.stages: dict[str, float] = {}

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

    def mark(self, stage: str, since: float) -> None:
        """Record that ``stage`` took from ``since`` (``elapsed()`` then) to now."""
        self.stages[stage] = round(self.stages.get(stage, 0.0) + self.elapsed() - since, 1)


__all__ = ["GIB", "STATIC_BYTES_PER_PARAM", "Clock", "HFStep", "Window",
           "batches_from", "build_hf", "build_ours", "compile_layers", "cpu_weights", "eval_loss", "free_memory",
           "is_oom",
           "load_weights", "log", "quantile", "time_call", "time_steps"]
