"""The benchmark's capacity trace (``capacity_trace.csv``) and its replay.

Every timed row of a sparse path (``ell``, ``auto``, and ``default`` when its FFN is one of
them) records :attr:`twell.nn.plan.FFNPlan.capacity_trace` over its warm-up and timed steps:
per step and layer the heavy rows of the step's busiest FFN call (the host values of the step's
one sync), the no-sync dense-backup capacity the layer ran with and whether it overflowed (a
redone step or a forward rerun). :func:`trace_rows` flattens the records into the CSV's rows
(:data:`TRACE_COLUMNS`, one per step and layer); :func:`load_trace` reads one row's steps back
as the (S, L) trace :func:`studies.capacity_sim.replay` takes, and :func:`replay_trace` replays
them (which capacity rule overflows on these counts, and at what spare rows)::

    python scripts/replay_capacity_trace.py docs/model_bench/capacity_trace.csv

Why: the synthetic traces of :mod:`studies.capacity_sim` may be tamer than a real model's
(docs/capacity_sim.md); this gives the rules the real counts.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from studies.capacity_sim import SEQ_LEN, ReplayResult, replay

TRACE_COLUMNS = ["size", "budget_gb", "path", "rule", "step", "timed", "layer", "layer_path",
                 "rows_per_call", "sequences_per_call", "heavy_max", "capacity", "overflow",
                 "event"]
ROW_KEYS = ("size", "budget_gb", "path")  # one benchmark row's steps


def _steps(records: Sequence[dict], timed_from: int | None) -> list[tuple[dict, bool]]:
    """The plan's ``kind="step"`` records, one per optimizer step (a redone attempt stands
    for its step: it holds the capacities that overflowed; its retry measured every layer), each
    with whether it was timed (its index in ``records`` at least ``timed_from``)."""
    out, pending = [], None
    for i, r in enumerate(records):
        if r["kind"] != "step":
            continue
        timed = timed_from is not None and i >= timed_from
        if r["redo"]:
            pending = pending or (r, timed)
            continue
        out.append(pending or (r, timed))
        pending = None
    return out + ([pending] if pending else [])  # a redone attempt whose retry never ended


def _int_if_whole(v: float):
    return int(v) if float(v).is_integer() else float(v)


def trace_rows(records: Sequence[dict], timed_from: int | None, **const) -> list[dict]:
    """``capacity_trace.csv``'s rows of one benchmark row: one per optimizer step and layer.

    Args:
        records: :attr:`twell.nn.plan.FFNPlan.capacity_trace` of the row's steps.
        timed_from: index into ``records`` of the first timed step's first record (the records
            before it: warm-up steps); None = nothing timed.
        const: columns every row gets (``size``, ``budget_gb``, ``path``, ``rule``).

    Returns:
        Dicts of :data:`TRACE_COLUMNS`: ``step`` counts the row's steps from 0; ``capacity``
        None where the layer measured per call; ``overflow`` and ``event`` (``redo``: the step
        was redone for this layer; ``forward_rerun``: a micro-batch's forward ran again for it;
        else None).
    """
    rows = []
    for step, (r, timed) in enumerate(_steps(records, timed_from)):
        for k, (hv, cap) in enumerate(zip(r["heavy_max"], r["capacity"])):
            event = "redo" if k in r["redo"] else "forward_rerun" if k in r["rerun"] else None
            rows.append({**const, "step": step, "timed": timed, "layer": k,
                         "layer_path": r["paths"][k], "rows_per_call": r["rows_per_call"],
                         "sequences_per_call": r["sequences_per_call"],
                         "heavy_max": _int_if_whole(hv), "capacity": cap,
                         "overflow": event is not None, "event": event})
    return rows


@dataclass(frozen=True)
class TraceReplay:
    """One benchmark row's capacity trace as :func:`studies.capacity_sim.replay` takes it.

    Attributes:
        trace: (S, L) float array, each step's heavy-row maximum per layer (warm-up steps
            first).
        sequences: sequences per FFN call (``replay``'s ``sequences``).
        rule: the capacity rule the row ran (``ffn.backup_capacity``).
        warm: the row's warm-up steps (``replay``'s ``warm``: the statistics cover the timed
            steps).
        layers: the layer index of each column of ``trace``.
        overflows: the row's overflowed layer-steps in its timed steps (redos and forward
            reruns), to compare with the replay's.
    """

    trace: np.ndarray
    sequences: int
    rule: str
    warm: int
    layers: tuple[int, ...]
    overflows: int


def read_trace(csv_path: Path) -> list[dict]:
    """``capacity_trace.csv``'s rows with their cells typed (ints, floats, bools, None).

    Raises:
        ValueError: a header without :data:`TRACE_COLUMNS`, or a cell that is not of its
            column's type (the file, line and column named).
    """
    conv = {"budget_gb": float, "step": int, "layer": int, "rows_per_call": int,
            "sequences_per_call": int, "heavy_max": float, "capacity": int}
    out = []
    with Path(csv_path).open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{csv_path}: not a capacity_trace.csv: "
                             + ("an empty file" if reader.fieldnames is None
                                else f"no column {', '.join(missing)}"))
        for r in reader:
            row = {}
            for k, v in r.items():
                try:
                    row[k] = None if v in ("", None) else conv[k](v) if k in conv else v
                except ValueError:
                    raise ValueError(f"{csv_path} line {reader.line_num}: column {k} holds "
                                     f"{v!r}, not a {conv[k].__name__}") from None
            row["timed"], row["overflow"] = r["timed"] == "True", r["overflow"] == "True"
            out.append(row)
    return out


def row_keys(rows: Sequence[dict]) -> list[tuple]:
    """The (size, budget_gb, path) of each benchmark row in ``rows``, in order of appearance."""
    return list(dict.fromkeys(tuple(r[k] for k in ROW_KEYS) for r in rows))


def load_trace(csv_path: Path, *, size: str | None = None, budget_gb: float | None = None,
               path: str | None = None, ell_layers_only: bool = False) -> TraceReplay:
    """One benchmark row's steps of ``capacity_trace.csv`` as :class:`TraceReplay`:
    :func:`trace_from_rows` of the file's :func:`read_trace` (a caller replaying several rows
    reads the file once and calls that).

    Args:
        csv_path: the file.
        size, budget_gb, path, ell_layers_only: as :func:`trace_from_rows`.

    Raises:
        ValueError: as :func:`trace_from_rows` (the messages name ``csv_path``).
    """
    return trace_from_rows(read_trace(csv_path), size=size, budget_gb=budget_gb, path=path,
                           ell_layers_only=ell_layers_only, source=csv_path)


def trace_from_rows(csv_rows: Sequence[dict], *, size: str | None = None,
                    budget_gb: float | None = None, path: str | None = None,
                    ell_layers_only: bool = False, source: Path | str = "<rows>") -> TraceReplay:
    """One benchmark row's steps of ``capacity_trace.csv``'s rows as :class:`TraceReplay`.

    Args:
        csv_rows: the CSV's rows as :func:`read_trace` returns them.
        size, budget_gb, path: which row (None: any; what is left must be one row).
        ell_layers_only: keep only the layers that ran on ``ell`` in some step (``auto`` rows:
            the others had no capacity to overflow); else every layer, replayed as on ``ell``.
        source: where the rows came from, for the error messages (the CSV's path).

    Raises:
        ValueError: no row or several rows match (they are named); calls of a size ``replay``
            cannot model (rows per call not ``sequences x`` :data:`studies.capacity_sim.SEQ_LEN`,
            or changing within the row); a step missing (the steps count from the first without
            a gap) or missing some layer, a layer twice in a step; no layer to replay.
    """
    want = {"size": size, "budget_gb": None if budget_gb is None else float(budget_gb),
            "path": path}
    rows = [r for r in csv_rows if all(v is None or r[k] == v for k, v in want.items())]
    keys = row_keys(rows)
    if len(keys) != 1:
        raise ValueError(f"{source}: {len(keys)} benchmark rows match size={size} "
                         f"budget_gb={budget_gb} path={path}: {keys}; name one")
    calls = {(r["rows_per_call"], r["sequences_per_call"]) for r in rows}
    rows_per_call, seqs = next(iter(calls))
    if len(calls) != 1 or rows_per_call != seqs * SEQ_LEN:
        raise ValueError(f"{source} {keys[0]}: replay() models calls of sequences x {SEQ_LEN} "
                         f"rows; this row's calls (rows, sequences): {sorted(calls)}")
    layers = sorted({r["layer"] for r in rows
                     if not ell_layers_only or r["layer_path"] == "ell"})
    if not layers:
        raise ValueError(f"{source} {keys[0]}: no layer ran on ell (nothing to replay with "
                         "ell_layers_only)")
    steps = sorted({r["step"] for r in rows})
    gaps = sorted(set(range(steps[0], steps[-1] + 1)) - set(steps))
    if gaps:
        raise ValueError(f"{source} {keys[0]}: steps {gaps[:10]} are missing (the trace's "
                         f"steps run from {steps[0]} to {steps[-1]})")
    col = {k: j for j, k in enumerate(layers)}
    trace = np.full((len(steps), len(layers)), np.nan)
    for r in rows:
        if r["layer"] in col:
            at = (r["step"] - steps[0], col[r["layer"]])
            if not np.isnan(trace[at]):
                raise ValueError(f"{source} {keys[0]}: step {r['step']} holds layer "
                                 f"{r['layer']} twice")
            trace[at] = r["heavy_max"]
    if np.isnan(trace).any():
        raise ValueError(f"{source} {keys[0]}: some step misses some layer's heavy_max")
    warm = len({r["step"] for r in rows if not r["timed"]})
    over = sum(r["overflow"] and r["timed"] and r["layer"] in col for r in rows)
    return TraceReplay(trace, seqs, rows[0]["rule"], warm, tuple(layers), over)


def replay_trace(loaded: TraceReplay, rule: str | None = None, *, warm: int | None = None,
                 policy=None) -> ReplayResult:
    """:func:`studies.capacity_sim.replay` of a loaded trace, under ``rule`` (None: the one
    the row ran) over the steps after ``warm`` (None: its timed steps), every layer on ``ell``
    with ``policy`` (a :class:`twell.policy.FFNPolicy`; None: the defaults, which the
    benchmark's model may not use), from an empty history and resting margins (the row's
    ``reset_capacities`` kept the adaptive rule's margins). A replayed redo stands for either
    of the row's overflows (the replay checks once per step, as ``host_sync=step``)."""
    return replay(loaded.trace, rule or loaded.rule, loaded.warm if warm is None else warm,
                  policy=policy, sequences=loaded.sequences)


__all__ = ["ROW_KEYS", "TRACE_COLUMNS", "TraceReplay", "load_trace", "read_trace",
           "replay_trace", "row_keys", "trace_from_rows", "trace_rows"]
