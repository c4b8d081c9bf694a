"""Where each sparse FFN op's time goes: the ops of ``real_layers`` under ``torch.profiler``.

With ``scripts/bench_real_layers.py --profile``, after a case is timed every op runs
:data:`PROFILE_WARMUP` untimed calls, :data:`PROFILE_TIMED` calls timed with CUDA events (its
wall per call: events around each call, no sync in between, so a host-bound op's wall is its
host time), then :data:`PROFILE_CALLS` calls under ``torch.profiler``
(:func:`studies.bench.step_profile.profile_step`). Per op and call: the wall (median), the GPU's
busy time (the union of the kernels' intervals), idle % = (wall - busy) / wall, the kernels
launched, the host synchronisations, and the longest kernels by GPU time (family:
:func:`studies.bench.step_profile.kernel_family`, a product with H in its shapes being
``gemm_ffn``), and the kind's dense baseline (``real_layers.BASELINE``: dense fwd, torch train)
over the op by wall and by GPU busy time (``x dense``). An op whose wall is well above its
busy time is host-bound (launch overhead, host syncs), not limited by its kernels: its
``x dense (GPU busy)`` is what it would reach with the launches hidden (``ell_graph``).

On the CPU (``--smoke``) the same code runs with the profiler's CPU activities only: the
"kernels" are the top-level PyTorch ops, the wall the host clock; it checks the code path, not
a GPU.

Outputs (``--out``, rewritten after every case): ``kernel_profile.md`` (one section per case:
the op table, then each op's longest kernels) and ``kernel_profile.csv`` (:data:`CSV_COLUMNS`).
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

from studies.bench.forward_profile import csv_rows
from studies.bench.step_profile import StepProfile, kernel_table, profile_step
from studies.kernel_bench.real_layers import BASELINE

PROFILE_WARMUP = 3  # untimed calls first (the measured ``auto`` settles in the timing before)
PROFILE_TIMED = 10  # calls timed with CUDA events: the wall per call (median)
PROFILE_CALLS = 5  # calls under the profiler: every time and count is per call
TOP_KERNELS = 12  # kernels listed per op in the markdown (the CSV keeps 25)
CSV_COLUMNS = ("size", "layer", "op", "kind", "row", "name", "family", "calls", "ms", "mean_us")


def profile_ops(ops: dict, device, ffn_width: int) -> dict[tuple[str, str], StepProfile]:
    """Profile every op of ``ops`` (module docstring), printing one line per op.

    Args:
        ops: ``(op, kind) -> closure`` running one call (``real_layers.make_op``).
        device: the ops' device (CUDA; the CPU for the smoke run).
        ffn_width: the case's FFN width H (a product with H in its shapes is ``gemm_ffn``).

    Returns:
        ``(op, kind) -> StepProfile`` in ms, kernels and syncs per call; an op that raises is
        printed and left out.
    """
    out = {}
    for (op, kind), fn in ops.items():
        try:
            out[(op, kind)] = p = profile_step(fn, device, {"ffn": ffn_width},
                                               steps=PROFILE_CALLS, warmup=PROFILE_WARMUP,
                                               timed=PROFILE_TIMED)
        except Exception as e:  # noqa: BLE001  (one op's failure keeps the others)
            print(f"  profile {op} {kind}: failed ({type(e).__name__}: {str(e)[:160]})")
            continue
        print(f"  profile {kind:5s} {op:10s}: wall {p.step_ms:.3f} ms, GPU busy "
              f"{p.kernel_ms:.3f} ms, {p.kernels:.0f} kernels, {p.syncs:.0f} syncs per call",
              flush=True)
    return out


def idle_pct(p: StepProfile) -> float:
    """Share (%) of ``p``'s wall per call with no kernel running; 0 for a zero wall."""
    return 100 * p.idle_ms / p.step_ms if p.step_ms > 0 else 0.0


def ratio(num: float, den: float) -> str:
    """``num / den`` as ``1.85x``, or ``-`` where ``den`` is not positive (no kernel seen)."""
    return f"{num / den:.2f}x" if den > 0 else "-"


def case_section(title: str, profiles: dict, baseline: dict | None = None) -> str:
    """One case's markdown: ``## title``, the op table (wall and GPU busy ms per call, idle %,
    kernels and host syncs per call, and the kind's dense baseline over the op by wall and by
    GPU busy time), then each op's :data:`TOP_KERNELS` longest kernels (us per call).

    Args:
        profiles: ``(op, kind) -> StepProfile`` (:func:`profile_ops`).
        baseline: kind -> the op the ``x dense`` columns divide (default :data:`BASELINE`:
            ``dense`` fwd, ``torch`` train); ``-`` where the case has no profile of it.
    """
    baseline = BASELINE if baseline is None else baseline
    head = ("| op | kind | wall ms/call | GPU busy ms/call | idle % | kernels/call | "
            "host syncs/call | x dense (wall) | x dense (GPU busy) |")
    lines = [f"## {title}", "", head, "|---|---|---|---|---|---|---|---|---|"]
    for (op, kind), p in profiles.items():
        b = profiles.get((baseline.get(kind), kind))
        lines.append(f"| {op} | {kind} | {p.step_ms:.3f} | {p.kernel_ms:.3f} | "
                     f"{idle_pct(p):.0f} | {p.kernels:.1f} | {p.syncs:.1f} | "
                     f"{ratio(b.step_ms, p.step_ms) if b else '-'} | "
                     f"{ratio(b.kernel_ms, p.kernel_ms) if b else '-'} |")
    for (op, kind), p in profiles.items():
        top = dataclasses.replace(p, top=p.top[:TOP_KERNELS])
        lines += ["", f"### {op} {kind}: longest kernels", "",
                  kernel_table(top, per="call", unit="us")]
    return "\n".join(lines)


def write_kernel_profile(out_dir, cases: list[tuple[dict, dict]], header: str) -> list[Path]:
    """Write ``kernel_profile.md`` and ``kernel_profile.csv`` into ``out_dir`` (made if
    missing; both rewritten whole).

    Args:
        cases: one ``(labels, profiles)`` per case: labels ``size``, ``layer`` and ``title``
            (the section's heading), profiles ``(op, kind) -> StepProfile``.
        header: the lines under the markdown's title (device, method).

    Returns:
        The two paths, markdown first. CSV rows: :func:`studies.bench.forward_profile.csv_rows`
        with ``row`` family / total / kernel; the totals ``call`` (wall), ``kernels`` (GPU
        busy), ``idle`` in ms, ``syncs`` and ``kernel_calls`` counts, all per call.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    how = (f"Per call: wall = median of {PROFILE_TIMED} calls timed with CUDA events (no sync "
           f"between calls; the host clock on the CPU), after {PROFILE_WARMUP} untimed; "
           f"kernels = the mean of "
           f"{PROFILE_CALLS} calls under torch.profiler; GPU busy = the union of the kernels' "
           "intervals; idle = wall - busy (launch gaps, host work, host syncs); x dense = the "
           "kind's dense baseline (dense fwd, torch train) over the op, by wall and by GPU "
           "busy time (a host-bound op gains by the second what it loses by the first).")
    lines = ["# Kernel profile of the sparse FFN ops", "", header, "", how, ""]
    for labels, profiles in cases:
        lines += [case_section(labels["title"], profiles), ""]
    md, csv_path = out_dir / "kernel_profile.md", out_dir / "kernel_profile.csv"
    md.write_text("\n".join(lines))
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for labels, profiles in cases:
            for (op, kind), *rest in csv_rows(profiles, step="call"):
                w.writerow([labels["size"], labels["layer"], op, kind, *rest])
    return [md, csv_path]


__all__ = ["CSV_COLUMNS", "PROFILE_CALLS", "PROFILE_TIMED", "PROFILE_WARMUP",
           "TOP_KERNELS", "case_section", "idle_pct", "profile_ops", "ratio",
           "write_kernel_profile"]
