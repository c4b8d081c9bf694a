"""The report of the two-GPU acceptance run (``scripts/multi_gpu_check.sh``): DDP and FSDP2
against one GPU, read from the runs' ``metrics.jsonl`` files.

    python -m studies.multi_gpu OUT_DIR        # prints the report (the script tees report.txt)

``OUT_DIR`` holds the run directories ``one_torch``, ``two_torch``, ``one_auto``, ``two_auto``
and ``resume_two_on_one`` (each with ``metrics.jsonl``) and the speed runs' logs
``speed_one.metrics.jsonl``, ``speed_ddp.metrics.jsonl``, ``speed_fsdp.metrics.jsonl``. Lines:

* per ``ffn.impl`` (torch, auto): the largest |loss difference| and |grad-norm difference|
  of 2 GPUs against 1 over their common steps;
* the bf16 noise scale: the same for 1 GPU torch against 1 GPU auto;
* the sparsity of the 1-GPU auto run's last step (L0, the layers' training paths);
* the 2-GPU checkpoint resumed on 1 GPU: its losses against the 2-GPU run's own steps (and
  against the 1-GPU run);
* tokens/s of the speed runs (median of the logged rates after the first log, which holds the
  warm-up), their peak memory, and the 2-GPU / 1-GPU ratio against the target 1.85x.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

IMPLS = ("torch", "auto")
CURVE_RUNS = ("one_torch", "two_torch", "one_auto", "two_auto", "resume_two_on_one")
SPEED_RUNS = ("speed_one", "speed_ddp", "speed_fsdp")
SPEEDUP_TARGET = 1.85  # 2 GPUs / 1 GPU tokens/s at the 1.5B shape


def train_rows(path: str | Path) -> dict[int, dict]:
    """``{step: row}`` of the ``"kind": "train"`` lines of a metrics.jsonl file."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows if r.get("kind") == "train"}


def max_diff(a: dict[int, dict], b: dict[int, dict], key: str = "loss") -> tuple[float, int]:
    """(max |a[s][key] - b[s][key]| over the steps both logged, number of those steps).

    Raises:
        ValueError: the runs share no logged step.
    """
    steps = sorted(set(a) & set(b))
    if not steps:
        raise ValueError("the two runs share no logged step")
    return max(abs(a[s][key] - b[s][key]) for s in steps), len(steps)


def speed(rows: dict[int, dict]) -> tuple[float, int]:
    """(median tokens/s of the logged rows after the first, number of rows used)."""
    rates = [rows[s]["tokens_per_s"] for s in sorted(rows)][1:]  # the first log holds warmup
    return statistics.median(rates), len(rates)


def report_lines(out: str | Path) -> list[str]:
    """The report of the run folder ``out`` (see the module docstring).

    Raises:
        OSError: a run's metrics.jsonl is missing. ValueError: two compared runs share no step.
    """
    out = Path(out)
    runs = {n: train_rows(out / n / "metrics.jsonl") for n in CURVE_RUNS}
    lines = []
    for impl in IMPLS:
        d, n = max_diff(runs[f"one_{impl}"], runs[f"two_{impl}"])
        g, _ = max_diff(runs[f"one_{impl}"], runs[f"two_{impl}"], "grad_norm")
        lines.append(f"ffn_impl={impl}: 2 GPUs vs 1 GPU over {n} steps: max |loss diff| {d:.4g}, "
                     f"max |grad norm diff| {g:.4g}")
    d, n = max_diff(runs["one_torch"], runs["one_auto"])
    lines.append(f"bf16 noise scale: 1 GPU torch vs auto over {n} steps: max |loss diff| {d:.4g}")
    last = runs["one_auto"][max(runs["one_auto"])]
    lines.append(f"sparsity at step {last['step']} (1 GPU, auto): L0 {last['l0_mean']:.1f} of the "
                 f"FFN width, paths {last.get('ffn_paths')}")
    d, n = max_diff(runs["resume_two_on_one"], runs["two_auto"])
    straight = max_diff(runs["resume_two_on_one"], runs["one_auto"])[0]
    lines.append(f"2-GPU checkpoint resumed on 1 GPU: {n} steps, max |loss diff| vs the 2-GPU "
                 f"run {d:.4g} (vs 1 GPU straight: {straight:.4g})")
    rates = {}
    for name in SPEED_RUNS:
        rows = train_rows(out / f"{name}.metrics.jsonl")
        rates[name], n = speed(rows)
        lines.append(f"{name}: {rates[name]:.0f} tokens/s (median of {n} logs), peak "
                     f"{max(r['peak_mem_gb'] for r in rows.values()):.1f} GB")
    for name in SPEED_RUNS[1:]:
        lines.append(f"1.5B tokens/s ratio {name[6:]} 2 GPUs / 1 GPU: "
                     f"{rates[name] / rates['speed_one']:.2f}x (target >= {SPEEDUP_TARGET}x)")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m studies.multi_gpu OUT_DIR", file=sys.stderr)
        return 2
    try:
        print("\n".join(report_lines(argv[0])))
    except (OSError, ValueError) as e:
        print(f"multi-GPU report of {argv[0]}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
