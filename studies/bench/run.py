"""A benchmark run over its sizes: :func:`run_bench` prepares each size
(``studies.bench.core.prepare``), runs its forward and per-budget stages
(``studies.bench.stages.bench_budgets``) and rewrites the outputs after every size
(``studies.bench.report.write_outputs``), so a run cut short keeps what it measured; its
:class:`BenchResult` names what failed."""

from __future__ import annotations

import dataclasses
import tempfile
import traceback
from pathlib import Path

import torch

from studies.bench.core import BenchSettings, prepare
from studies.bench.recipe import write_smoke_tokens
from studies.bench.report import write_outputs
from studies.bench.stages import bench_budgets, forward_stage
from studies.bench.step_profile import profile_paths, write_profile
from studies.bench.steps import Clock, free_memory, log


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """What :func:`run_bench` did.

    Attributes:
        table: Table 1 (markdown) of the rows measured.
        failed: one line for each failure: a size that failed or that the deadline left out
            whole, a forward or a budget's stage that failed (its rows then name it); empty
            when everything ran.
    """

    table: str
    failed: tuple[str, ...] = ()


def run_bench(s: BenchSettings) -> BenchResult:
    """Run every size of ``s``, writing the outputs into ``s.out`` after each; returns Table 1
    and what failed. One size's failure is logged (and named under ``errors`` in
    ``bench_meta.json``) and the next size runs. The trainer run folders go to ``s.work_dir``
    (kept); without one, to a temporary folder that is removed at the end, unless
    ``s.save_model`` (the checkpoint lives there: the folder is kept and logged)."""
    if s.work_dir is not None:
        s.work_dir.mkdir(parents=True, exist_ok=True)
        return _run_sizes(s, s.work_dir)
    if s.save_model:
        work = Path(tempfile.mkdtemp(prefix="bench_model_"))
        log(f"--save-model without --work-dir: the trainer run folders stay in {work}")
        return _run_sizes(s, work)
    with tempfile.TemporaryDirectory(prefix="bench_model_", ignore_cleanup_errors=True) as d:
        return _run_sizes(s, Path(d))


def _run_sizes(s: BenchSettings, work: Path) -> BenchResult:
    """:func:`run_bench` with its trainer run folders in ``work``."""
    clock = Clock(s.deadline_s, reserve_s=2.0 if s.smoke else 10.0)
    smoke_tokens = write_smoke_tokens(work / "smoke_tokens.bin") if s.smoke else None
    rows, probes, profile, trace = [], [], [], []
    meta = {"sizes": {}, "skipped": clock.skipped, "torch": torch.__version__,
            "settings": {k: str(v) for k, v in dataclasses.asdict(s).items()}}
    table, failed = "", []
    for size in s.sizes:
        if clock.left() < 60 and not s.smoke:
            clock.skipped.append(f"size {size}")
            failed.append(f"{size}: skipped (deadline)")
            continue
        run = None
        try:
            run = prepare(s, size, clock, work, smoke_tokens)
            profile += [{"size": size, **r} for r in run.checks["profile"]]
            if s.profile_micro and run.device.type != "cuda":
                log(f"{size}: --profile-micro skipped: torch.profiler's CUDA kernel times "
                    "need a GPU")
            elif s.profile_micro:
                for micro in s.profile_micro:
                    profs = profile_paths(run, micro, s.profile_paths)
                    print(write_profile(s.out, size, micro, profs, run.seq_len,
                                        run.checks["l0"]), flush=True)
            if not s.profile_only:
                bench_budgets(run)
            elif s.profile_forward:
                forward_stage(run)
        except Exception as e:  # noqa: BLE001  (keep the other sizes and the outputs)
            traceback.print_exc()
            log(f"size {size} FAILED: {type(e).__name__}: {e}")
            meta.setdefault("errors", []).append(f"{size}: {type(e).__name__}: {e}")
            failed.append(f"{size}: {type(e).__name__}: {_first_line(str(e))}")
        if run is not None:
            failed += [f"{size} {_first_line(err)}" for err in run.meta.get("errors", [])]
            rows += run.rows
            probes += run.probes
            trace += run.capacity_trace
            meta["sizes"][size] = {**run.meta, "stages": dict(clock.stages)}
            free_memory(run.device)
        meta["wall_s"] = round(clock.elapsed(), 1)
        table = write_outputs(s.out, rows, probes, profile, meta, equal_micro=s.equal_micro,
                              plot=s.plots, trace=trace)
    return BenchResult(table, tuple(failed))


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


__all__ = ["BenchResult", "run_bench"]
