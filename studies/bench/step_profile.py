"""Where a training step's GPU time goes: ``torch.profiler`` kernel times by op family.

A step of each path (plain transformers, transformers + Liger-Kernel, our dense, ``ell`` and
``auto`` trainers) runs under ``torch.profiler`` with input shapes recorded; every CUDA kernel is
put in one family by its name and, for matrix products, by the shapes of the op that launched
it (an FFN product has the FFN width H in a dimension, the LM head the vocabulary V, the
attention projections neither):

=================  ===========================================================================
family             kernels
=================  ===========================================================================
attention          flash / memory-efficient attention, forward and backward
gemm_attn          q, k, v, o projections (cuBLAS)
gemm_ffn           FFN products through cuBLAS (dense FFNs, the gate GEMM, dense backups)
gemm_lm_head       LM head and its gradients (also inside a fused loss)
ffn_triton         twell's Triton kernels (compaction, SDDMM, SpMM, dW, the fused passes, the
                   transposing cast of Wd^T and dWd)
norm               RMSNorm kernels (Liger's; eager norms land in elementwise / reduction)
rope               RoPE kernels (Liger's; eager RoPE lands in elementwise)
loss               cross-entropy / softmax kernels
optimizer          fused AdamW and the gradient-norm / clip passes (multi-tensor kernels)
cast               dtype conversions and copies
reduction          other reductions (eager norms, statistics, sums)
elementwise        other elementwise kernels (residual adds, eager norms and RoPE, ReLU, ...)
other              the rest (memset, sort, scan, index, ...)
=================  ===========================================================================

Besides the families: the step's time (CUDA events, outside the profiler), the kernels' sum
(the GPU's busy time; the rest is idle: launch gaps and host waits) and the host
synchronisations (``cudaStreamSynchronize`` / ``cudaEventSynchronize`` / ``cudaDeviceSynchronize``
calls) per step. Results: ``BENCHMARKS.md``, "Where the step's time goes".
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

FAMILIES = ("attention", "gemm_attn", "gemm_ffn", "gemm_lm_head", "ffn_triton", "norm", "rope",
            "loss", "optimizer", "cast", "reduction", "elementwise", "other")
_SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
_NAME_RULES = (  # (family, pattern on the kernel name), first match wins
    ("attention", r"flash|fmha|attention|attn|sdpa"),
    ("norm", r"rms_norm|layer_norm|rmsnorm"),
    ("rope", r"rope|rotary"),
    ("loss", r"cross_entropy|softmax|nll_loss|log_softmax"),
    ("ffn_triton", (r"^_?(compact|sddmm|spmm|dw_|pack|twell|backup|dense_fwd|dense_bwd|hot|"
                    r"relu_mul|ew_|gated|transpose_kernel)")),
    ("optimizer", r"multi_tensor|adam|foreach|fused_adam|clip"),
    ("cast", r"copy|cast|convert|to_dtype"),
    ("reduction", r"reduce|_sum|norm_kernel|mean|amax"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|triton_poi"),
)
_GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|cublas|wgmma|matmul|triton_tem",
                   re.IGNORECASE)


def kernel_family(kernel: str, op: str | None, shapes, dims: dict) -> str:
    """The family of one kernel (module docstring).

    Args:
        kernel: the CUDA kernel's name.
        op: the name of the PyTorch op that launched it (``aten::mm``...), or None.
        shapes: that op's recorded input shapes (lists of ints), or None.
        dims: ``{"ffn": H, "vocab": V}`` of the model.
    """
    name = kernel.lower()
    if _GEMM.search(name) and not re.search(r"flash|fmha|attention", name):
        flat = {d for s in (shapes or []) if isinstance(s, (list, tuple)) for d in s
                if isinstance(d, int)}
        if dims.get("vocab") in flat:
            return "gemm_lm_head"
        if dims.get("ffn") in flat:
            return "gemm_ffn"
        return "gemm_attn"
    for fam, pat in _NAME_RULES:
        if re.search(pat, name):
            return fam
    return "other"


@dataclass
class StepProfile:
    """One path's step, by family (milliseconds per step).

    Attributes:
        step_ms: median step time from CUDA events (outside the profiler).
        kernel_ms: the sum of the step's kernel times (GPU busy time).
        families: family -> ms per step.
        syncs: host synchronisations per step.
        top: the longest kernels, (family, name, ms per step, calls per step).
        kernels: kernels launched per step (all of them, not only :attr:`top`'s).
    """

    step_ms: float
    kernel_ms: float
    families: dict = field(default_factory=dict)
    syncs: float = 0.0
    top: list = field(default_factory=list)
    kernels: float = 0.0

    @property
    def idle_ms(self) -> float:
        """Step time the GPU ran no kernel (launch gaps, host waits); 0 if the kernels of
        several streams overlapped to more than the step."""
        return max(0.0, self.step_ms - self.kernel_ms)


def _busy_us(spans: list[tuple[float, float]]) -> float:
    """Length (us) of the union of the kernels' ``(start, end)`` intervals: streams may overlap,
    so a plain sum would count the same GPU time twice."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def profile_step(step: Callable[[], object], device, dims: dict, *, steps: int = 2,
                 warmup: int = 1, timed: int = 5) -> StepProfile:
    """Time ``timed`` calls of ``step`` with CUDA events, then profile ``steps`` more.

    Args:
        step: one step: a training step (it synchronises as the path does; nothing else is
            added) or a forward.
        device: a CUDA device; or the CPU, to run the code path without a GPU: the step is
            timed by the host clock and its "kernels" are its top-level PyTorch ops
            (:func:`profile_of_events`, ``kernels_on="cpu"``), not a GPU measure.
        dims: ``{"ffn": H, "vocab": V}`` (:func:`kernel_family`).

    Raises:
        ValueError: ``device`` is neither CUDA nor the CPU.
    """
    from torch.profiler import ProfilerActivity, profile

    from studies.bench.steps import time_steps

    dev = torch.device(device)
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"profile_step needs a CUDA device or the CPU; got {dev}")
    cuda = dev.type == "cuda"
    window = time_steps(step, warmup, timed, dev)
    step_ms = sorted(window.step_ms)[len(window.step_ms) // 2]
    if cuda:
        torch.cuda.synchronize(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        if cuda:  # the kernels land inside the profile; not the step's sync
            torch.cuda.synchronize(dev)
    # the harness's syncs inside the record: the one above and the profiler's own exit (it
    # synchronises the device before it stops recording: torch/autograd/profiler.py)
    return profile_of_events(prof.events(), dims, steps=steps, step_ms=step_ms,
                             own_syncs=2 * int(cuda), kernels_on=dev.type)


def profile_of_events(events, dims: dict, *, steps: int, step_ms: float,
                      top: int = 25, own_syncs: int = 0, kernels_on: str = "cuda") -> StepProfile:
    """The :class:`StepProfile` of ``steps`` profiled steps from their ``torch.profiler``
    events (``prof.events()``): kernel times summed by family and by kernel name, per step.

    Args:
        events: the profiler's events: CPU ops (``device_type`` CPU, with ``id``, ``name``,
            ``input_shapes`` and the ``kernels`` they launched), CUDA kernels (``device_type``
            CUDA, ``name``, ``time_range`` in us, ``linked_correlation_id`` = the id of the op
            that launched them) and runtime calls (the host synchronisations, by name).
        dims: ``{"ffn": H, "vocab": V}`` (:func:`kernel_family`).
        steps: how many steps the events hold (every time and count is divided by it).
        step_ms: the step's time from CUDA events, measured outside the profiler.
        top: how many kernels :attr:`StepProfile.top` keeps (the longest in total).
        own_syncs: host synchronisations among the events that the profiling harness made, not
            the steps (left out of :attr:`StepProfile.syncs`).
        kernels_on: ``"cuda"``: the kernels are the CUDA kernels; ``"cpu"`` (a CPU-only
            profile): they are the top-level CPU ops (no parent op: what the step's Python
            called), each its own launching op; the gaps between them are host overhead.

    Raises:
        ValueError: ``steps < 1``, or ``kernels_on`` is neither ``"cuda"`` nor ``"cpu"``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    if kernels_on not in ("cuda", "cpu"):
        raise ValueError(f"kernels_on: 'cuda' or 'cpu'; got {kernels_on!r}")
    cpu = torch.autograd.DeviceType.CPU
    # the PyTorch ops that launched kernels, by id (a kernel's linked correlation id); runtime
    # calls (cudaLaunchKernel...) carry CUPTI's own ids, which may collide with these: left out
    cpu_ops = {e.id: e for e in events if e.device_type == cpu and e.kernels}
    fams: dict[str, float] = defaultdict(float)
    kern: dict[tuple, list] = {}
    spans, syncs = [], 0
    for e in events:
        if e.name in _SYNCS:
            syncs += 1
        # kernels only: a user annotation (record_function, the optimizer's step range) has a
        # GPU range of its own that spans the kernels inside it
        if not _is_kernel(e, kernels_on):
            continue
        op = e if kernels_on == "cpu" else cpu_ops.get(getattr(e, "linked_correlation_id", 0))
        us = e.time_range.end - e.time_range.start
        spans.append((e.time_range.start, e.time_range.end))
        fam = kernel_family(e.name, op.name if op else None, op.input_shapes if op else None,
                            dims)
        fams[fam] += us / 1e3 / steps
        k = kern.setdefault((fam, e.name[:90]), [0.0, 0])
        k[0] += us / 1e3 / steps
        k[1] += 1 / steps
    longest = sorted(((f, n, ms, c) for (f, n), (ms, c) in kern.items()), key=lambda t: -t[2])
    return StepProfile(step_ms, _busy_us(spans) / 1e3 / steps,
                       {f: fams.get(f, 0.0) for f in FAMILIES}, max(syncs - own_syncs, 0) / steps,
                       longest[:top], len(spans) / steps)


def _is_kernel(e, kernels_on: str) -> bool:
    """Is profiler event ``e`` a kernel (:func:`profile_of_events`' ``kernels_on``)? Never a
    user annotation nor, on the CPU, a host synchronisation."""
    if getattr(e, "is_user_annotation", False):
        return False
    if kernels_on == "cuda":
        return e.device_type == torch.autograd.DeviceType.CUDA
    return (e.device_type == torch.autograd.DeviceType.CPU and e.name not in _SYNCS
            and getattr(e, "cpu_parent", None) is None)


def family_table(profiles: dict[str, StepProfile], tokens_per_step: int, *,
                 per: str | None = None) -> str:
    """A markdown table: one column per path, one row per family (those some path has), then
    kernels, idle, step, host syncs and tokens/ms.

    Args:
        profiles: path -> its profile (ms per step).
        tokens_per_step: the tokens one step runs (tokens/ms = this / step ms).
        per: None: ms per 2048-token sequence (per step / sequences); a name (``forward``): ms
            per step, the header ``ms per <per>`` and the step rows named after it.
    """
    seqs = 1 if per else tokens_per_step / 2048
    step = per or "step"
    names = list(profiles)
    head = f"ms per {per}" if per else "ms per 2048-token sequence"
    lines = [f"| {head} | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for fam in FAMILIES:
        vals = [profiles[n].families.get(fam, 0.0) / seqs for n in names]
        if any(v >= 0.005 for v in vals):
            lines.append(f"| {fam} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    for label, get in (("kernels (GPU busy)", lambda p: p.kernel_ms / seqs),
                       ("idle (gaps, host waits)", lambda p: p.idle_ms / seqs),
                       (f"**{step}**", lambda p: p.step_ms / seqs)):
        lines.append(f"| {label} | " + " | ".join(f"{get(profiles[n]):.2f}" for n in names)
                     + " |")
    lines.append(f"| host syncs per {step} | " + " | ".join(f"{profiles[n].syncs:.0f}"
                                                           for n in names) + " |")
    lines.append("| tokens/ms | " + " | ".join(f"{tokens_per_step / profiles[n].step_ms:.1f}"
                                               for n in names) + " |")
    return "\n".join(lines)


def kernel_table(p: StepProfile, *, per: str = "step", unit: str = "ms") -> str:
    """A markdown table of ``p``'s longest kernels (:attr:`StepProfile.top`, longest first):
    ``unit`` (``"ms"``, or ``"us"`` for short calls) per ``per`` (their total GPU time), share
    of the GPU's busy time (%), calls per ``per``, mean us per call, family and name.

    Raises:
        ValueError: ``unit`` is neither ``"ms"`` nor ``"us"``.
    """
    if unit not in ("ms", "us"):
        raise ValueError(f"unit: 'ms' or 'us'; got {unit!r}")
    scale, digits = (1.0, 2) if unit == "ms" else (1e3, 1)
    lines = [f"| {unit} per {per} | % of busy | calls | mean us | family | kernel |",
             "|---|---|---|---|---|---|"]
    for fam, name, ms, calls in p.top:
        share = 100 * ms / p.kernel_ms if p.kernel_ms > 0 else 0.0
        mean_us = 1e3 * ms / calls if calls > 0 else 0.0
        lines.append(f"| {scale * ms:.{digits}f} | {share:.1f} | {calls:.0f} | {mean_us:.1f} | "
                     f"{fam} | `{name}` |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the paths of a bench run

def profile_paths(run, micro: int, paths: tuple[str, ...], *, steps: int = 2, warmup: int = 3,
                  timed: int = 6) -> dict[str, StepProfile]:
    """Profile one training step of each path of ``paths`` on the bench model of ``run`` (a
    :class:`studies.bench.core.SizeRun`), ``micro`` sequences per step, no recomputation, one
    micro-batch per optimizer step (learning rate 0: every kernel runs, the weights stay);
    ``default`` is the ``default`` row's trainer (:func:`_profiled_trainer`).
    A path that fails (out of memory) is logged and left out."""
    from studies.bench.recipe import BASELINE_PATHS, split_profile_path
    from studies.bench.steps import HFStep, batches_from, build_hf, free_memory, log
    from train.memory import Plan
    from twell.ops.launch import kernel_config

    specs = {p: split_profile_path(p) for p in paths}
    cfg = run.bm.model_cfg
    dims = profile_dims(cfg)
    out: dict[str, StepProfile] = {}
    for p in paths:
        path, launch, extra = specs[p]
        base, _, flag = path.partition("-")
        step = tr = None
        try:
            batches = batches_from(run.pool_NT, micro, seed=micro)
            if base in BASELINE_PATHS:
                step = HFStep(build_hf(cfg, run.bm.weights, run.device, variant=base),
                              run.cfg1.optim, run.bf16)
                def fn(step=step, batches=batches):
                    step(batches)
            else:
                tr = _profiled_trainer(run, base, flag, extra)
                tr.memory.apply(Plan(micro, "none", 1, None, None, None, "profile"))
                tr.plan.reset_capacities()
                tr.model.train()
                interval = tr.new_interval()
                def fn(tr=tr, batches=batches, interval=interval):
                    tr.train_step(batches, interval)
            with kernel_config(**launch):
                out[p] = prof = profile_step(fn, run.device, dims, steps=steps, warmup=warmup,
                                             timed=timed)
            log(f"{run.size} profile {p} micro {micro}: {micro * run.seq_len / prof.step_ms:.1f} "
                f"tok/ms, step {prof.step_ms:.1f} ms, kernels {prof.kernel_ms:.1f} ms, "
                f"{prof.syncs:.0f} syncs, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GB")
            log_top_kernels(prof)
        except Exception as e:  # noqa: BLE001  (one path's failure keeps the others)
            log_failure(f"{run.size} profile {p}", e)
        finally:
            if tr is not None:
                tr.close()
                tr.acc.free_memory()
            step = tr = fn = None
            free_memory(run.device)
    return out


def _profiled_trainer(run, path: str, flag: str, extra: list[str]):
    """Our trainer for the profile of ``path``: the bench's (``build_our_trainer``) on the FFN
    path, ``auto`` from the paths the model's own sparsity picks (as its timed row); or
    ``default``: the experiment's trainer as the ``default`` row builds it (its planner, its
    fresh FFN plan) on the largest budget, its step shape then replaced by the profile's."""
    from studies.bench.stages import build_default_trainer, build_our_trainer, use_ffn
    from train.memory import ProbeRunner, choose_initial_paths

    if path == "default":
        return build_default_trainer(run, max(run.s.budgets, key=lambda b: b.card_gb), extra)
    tr = build_our_trainer(run, (["trainer.liger=false"] if flag == "noliger" else []) + extra)
    use_ffn(tr, path, run.bm.plan_state)
    if path == "auto":
        choose_initial_paths(tr, ProbeRunner(tr).ids_BT, force=True)
    return tr


def profile_dims(model_cfg) -> dict:
    """``{"ffn": H, "vocab": V}`` of a model config (:func:`kernel_family`'s ``dims``)."""
    return {"ffn": model_cfg.intermediate_size, "vocab": model_cfg.vocab_size}


def log_top_kernels(prof: StepProfile, n: int = 12) -> None:
    """Log the ``n`` longest kernels of ``prof`` (ms and calls per step, family, name)."""
    from studies.bench.steps import log

    for fam, name, ms, calls in prof.top[:n]:
        log(f"    {ms:8.2f} ms {calls:6.0f}x  {fam:12s} {name}")


def log_failure(what: str, e: BaseException) -> None:
    """Log a profiled path's failure in one line; the traceback too unless it ran out of
    memory (which says enough)."""
    from studies.bench.steps import is_oom, log

    log(f"{what} FAILED: {type(e).__name__}: {str(e)[:200]}")
    if not is_oom(e):
        import traceback

        traceback.print_exc()


def write_profile(out_dir, size: str, micro: int, profiles: dict[str, StepProfile],
                  seq_len: int, l0: float) -> str:
    """Write ``step_profile_<size>_m<micro>.md`` (the family table and each path's longest
    kernels) and ``.csv`` (one row per path and family) into ``out_dir``; returns the table."""
    import csv
    from pathlib import Path

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = micro * seq_len
    table = family_table(profiles, tokens)
    stem = out_dir / f"step_profile_{size}_m{micro}"
    lines = [(f"# Step profile: {size}, micro-batch {micro} x {seq_len}, no recomputation, "
              f"held-out L0 {l0:.1f}"), "", table, ""]
    for name, p in profiles.items():
        lines += [f"## {name}: longest kernels (per step)", "", kernel_table(p), ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    with stem.with_suffix(".csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["size", "micro_batch", "l0", "path", "family", "ms_per_step"])
        for name, p in profiles.items():
            for fam, ms in {**p.families, "kernels": p.kernel_ms, "idle": p.idle_ms,
                            "step": p.step_ms, "syncs": p.syncs}.items():
                w.writerow([size, micro, f"{l0:.2f}", name, fam, f"{ms:.4f}"])
    return table


__all__ = ["FAMILIES", "StepProfile", "family_table", "kernel_family", "kernel_table",
           "log_failure", "log_top_kernels", "profile_dims", "profile_of_events", "profile_paths",
           "profile_step", "write_profile"]
