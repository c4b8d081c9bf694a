"""Where the forward's GPU time goes: each inference impl's forward under ``torch.profiler``.

With ``--profile-forward``, after the forward stage (:func:`studies.bench.core.measure_forward`)
each inference impl it timed (dense PyTorch ``torch``, ``liger``, our sparse ``twell`` and
``auto``, and ``hf`` / ``compile`` when the paths have them) is built again and its forward
(eval, the decoder stack without the LM head, ``fwd_batch`` x seq_len held-out tokens) runs:
``fwd_warmup`` untimed forwards for ``auto`` (2 for the others), ``fwd_steps`` timed with CUDA
events outside the profiler (the forward's time), then two under ``torch.profiler``
(:func:`studies.bench.step_profile.profile_step`). Each kernel is put in an op family
(:func:`studies.bench.step_profile.kernel_family`: our Triton kernels are ``ffn_triton``, the
gate / up / down products ``gemm_ffn``) and the longest kernels are listed by name (the TwELL
consumer ``_twell_ffn_kernel``, the pack ``_pack_dense_kernel``, cuBLAS products, ...), with
their calls per forward (one per layer for a per-layer kernel) and mean time per call.

Outputs (``--out``): ``forward_profile_<size>.md`` (the family table, ms per forward, and each
impl's longest kernels) and ``forward_profile_<size>.csv`` (one row per impl and family, total
and kernel). The forward's tokens/ms in ``best_configs.csv`` stay those of the forward stage.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

import torch

from studies.bench.step_profile import (
    FAMILIES,
    StepProfile,
    family_table,
    kernel_table,
    log_failure,
    log_top_kernels,
    profile_dims,
    profile_step,
)

PROFILED_FORWARDS = 2  # forwards under the profiler (every time and count is per forward)
CSV_COLUMNS = ("size", "fwd_batch", "seq_len", "l0", "impl", "kind", "name", "family", "calls",
               "ms", "mean_us")


def profile_forward(run) -> dict[str, StepProfile]:
    """Profile one forward of each inference impl the forward stage timed (module docstring).

    Args:
        run: the size's :class:`studies.bench.core.SizeRun`, its forward measured (``run.fwd``:
            the impls profiled, in that order).

    Returns:
        impl -> its :class:`StepProfile` (ms per forward). An impl that fails (out of memory)
        is logged and left out; empty when the deadline leaves no time for it.

    Raises:
        ValueError: the run's device is not CUDA.
    """
    from studies.bench.core import build_forward, forward_ids, forward_impls, forward_warmup
    from studies.bench.steps import free_memory, log

    s, dev = run.s, run.device
    if dev.type != "cuda":
        raise ValueError(f"profile_forward needs a CUDA device; got {dev}")
    impls = [i for i in forward_impls(run) if i in run.fwd]
    ids = forward_ids(run)
    fwd_s = {i: ids.numel() / run.fwd[i] / 1e3 for i in impls}
    est = sum(run.est_build_s() + 2.0 + (forward_warmup(run, i) + s.fwd_steps
                                         + PROFILED_FORWARDS) * fwd_s[i] for i in impls)
    if not impls or not run.clock.fits(est, f"{run.size} forward profile"):
        return {}
    t0 = run.clock.elapsed()
    dims = profile_dims(run.bm.model_cfg)
    out: dict[str, StepProfile] = {}
    for impl in impls:
        decoder = None
        try:
            t1 = time.monotonic()
            decoder = build_forward(run, impl)
            with torch.no_grad():
                out[impl] = prof = profile_step(
                    lambda d=decoder: d(input_ids=ids), dev, dims, steps=PROFILED_FORWARDS,
                    warmup=forward_warmup(run, impl), timed=s.fwd_steps)
            log(f"{run.size} forward profile {impl}: forward {prof.step_ms:.1f} ms, kernels "
                f"{prof.kernel_ms:.1f} ms, idle {prof.idle_ms:.1f} ms, {prof.syncs:.0f} syncs "
                f"({time.monotonic() - t1:.1f} s)")
            log_top_kernels(prof)
        except Exception as e:  # noqa: BLE001  (one impl's failure keeps the others)
            log_failure(f"{run.size} forward profile {impl}", e)
            run.meta.setdefault("errors", []).append(f"forward profile {impl}: "
                                                     f"{type(e).__name__}: {e}")
        decoder = None
        free_memory(dev)
    run.clock.mark("forward profile", t0)
    return out


def forward_table(profiles: dict[str, StepProfile], tokens: int) -> str:
    """The family table of ``profiles`` in ms per forward of ``tokens`` tokens
    (:func:`studies.bench.step_profile.family_table`), with each impl's speed-up over dense
    PyTorch (``torch``'s forward time / the impl's) when ``torch`` was profiled."""
    table = family_table(profiles, tokens, per="forward")
    base = profiles.get("torch")
    if base is None:
        return table
    return table + "\n| speed-up over `torch` | " + " | ".join(
        f"{base.step_ms / p.step_ms:.3f}" for p in profiles.values()) + " |"


def write_forward_profile(out_dir, size: str, profiles: dict[str, StepProfile], *,
                          fwd_batch: int, seq_len: int, l0: float, layers: int) -> str:
    """Write ``forward_profile_<size>.md`` (the family table, ms per forward, then each impl's
    longest kernels) and ``.csv`` (:data:`CSV_COLUMNS`; ``kind`` is ``family``, ``total``:
    forward / kernels / idle / syncs, or ``kernel``) into ``out_dir`` (made if missing).

    Args:
        profiles: impl -> its profile, ms and calls per forward (:func:`profile_forward`).
        fwd_batch, seq_len: the forward's sequences and their length (tokens = the product).
        l0: the bench model's held-out L0; layers: its decoder layers (a per-layer kernel has
            that many calls per forward).

    Returns:
        The family table (markdown).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = forward_table(profiles, fwd_batch * seq_len)
    title = (f"# Forward profile: {size}, {fwd_batch} x {seq_len} tokens, eval, the decoder "
             f"stack without the LM head ({layers} layers), held-out L0 {l0:.1f}")
    how = ("Forward: CUDA events outside the profiler (median); kernels: the mean of "
           f"{PROFILED_FORWARDS} profiled forwards; calls per forward (a per-layer kernel: "
           f"{layers}).")
    lines = [title, "", how, "", table, ""]
    for name, p in profiles.items():
        lines += [f"## {name}: longest kernels (per forward)", "", kernel_table(p, per="forward"),
                  ""]
    stem = out_dir / f"forward_profile_{size}"
    stem.with_suffix(".md").write_text("\n".join(lines))
    with stem.with_suffix(".csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for row in csv_rows(profiles):
            w.writerow([size, fwd_batch, seq_len, f"{l0:.2f}", *row])
    return table


def csv_rows(profiles: dict, step: str = "forward") -> list[tuple]:
    """The ``impl, kind, name, family, calls, ms, mean_us`` part of each CSV row
    (:func:`write_forward_profile`), ms per ``step`` (a forward); calls and mean us on kernel
    rows only. The totals: ``step`` (its time), ``kernels`` (GPU busy), ``idle``, ``syncs`` and
    ``kernel_calls`` (kernels launched; the last two counts, not ms). ``impl`` is the key of
    ``profiles`` as it comes."""
    rows = []
    for impl, p in profiles.items():
        rows += [(impl, "family", fam, fam, "", f"{p.families.get(fam, 0.0):.4f}", "")
                 for fam in FAMILIES]
        rows += [(impl, "total", k, "", "", f"{v:.4f}", "") for k, v in (
            (step, p.step_ms), ("kernels", p.kernel_ms), ("idle", p.idle_ms),
            ("syncs", p.syncs), ("kernel_calls", p.kernels))]
        rows += [(impl, "kernel", name, fam, f"{calls:g}", f"{ms:.4f}",
                  f"{1e3 * ms / calls:.1f}" if calls > 0 else "")
                 for fam, name, ms, calls in p.top]
    return rows


__all__ = ["CSV_COLUMNS", "PROFILED_FORWARDS", "csv_rows", "forward_table", "profile_forward",
           "write_forward_profile"]
