"""No-sync dense-backup capacities of the sparse training path (``ffn.host_sync=step``).

Each layer on the ELL path runs with a fixed dense-backup capacity (rows for the tokens with more
active units than the ELL capacity, "heavy rows"), chosen before the step from earlier steps'
heavy-row counts; the step's one host sync checks them, and a step in which some layer had more
heavy rows than its capacity is redone measuring per call (:meth:`twell.nn.plan.FFNPlan.end_step`
decides, the trainer redoes it). A redo costs a whole step; a backup row costs 16 D H FLOPs per
micro-step (forward ``u_R = x_R Wu^T`` and ``h_R Wd^T``, backward ``dy_R Wd``, ``dx_R`` through
both weights and the three weight gradients: 4 + 12 D H; ~24 us for 64 rows at the 1.5B shape
at 300 TFLOP/s, ~0.7 ms a micro-step over 28 layers), so capacities should be generous.

Every capacity is at least the plan's floor (``FFNPolicy.backup_floor_fraction`` of a call's
rows plus one row per sequence: :meth:`BackupCapacity.capacity`'s ``floor``), so a layer whose
recent steps had no heavy row is not redone for the first one.

``ffn.backup_capacity`` rules (per layer; ``R`` = the step's largest heavy-row count of any
micro-batch, measured in the step's one host sync):

* ``window`` (default): ``ceil(1.25 c max(R of the last 16 steps)) + 16``, 0 when that max is 0
  (:func:`twell.ops.ffn_train.backup_capacity_for`).
* ``adaptive`` (``trainer=gpu``'s): ``ceil(m c max(R of the last 128 steps)) + 16`` rounded up to
  a multiple of 64 (so backup GEMM shapes repeat), 0 when that max is 0. The margin ``m`` starts at 1.25; each
  redo this layer caused multiplies it by 1.5 (at most 4); every accepted step moves it back
  towards 1.25 by 1 % of the distance (half-life ~70 steps). The long window remembers the rare
  heavy batches (many short documents: each document start has fully active first tokens),
  and the margin learns a layer's burst size. Evaluated on synthetic traces by
  :mod:`studies.capacity_sim` (``scripts/capacity_policy_sim.py``).

``c`` (:func:`cold_margin`) widens the margin while a layer's history is shorter than its window
(a fresh run, a resume without history, a layer just moved to the ELL path): 1.75 from one step
of the window rule's, 1 with the window full.

The histories count rows per FFN call: when the calls change size (the memory planner changes
the micro-batch) they are scaled (:meth:`BackupCapacity.rescale`) rather than forgotten; when a
layer moves to the ELL path its history keeps only its latest steps (:meth:`BackupCapacity.restart`:
counts from its dense-path steps, not from when it was denser).

The histories and margins are part of the FFN plan's state (:class:`twell.nn.plan.FFNPlan`,
checkpointed with the trainer: an exact resume uses the same capacities). Source of the dense
backup: arXiv 2603.23198, "Hybrid (training)"; the rules and their margins are ours.
"""

from __future__ import annotations

import math

from twell.ops.ffn_train import backup_capacity_for

CAPACITY_RULES = ("window", "adaptive")
WINDOW_STEPS = {"window": 16, "adaptive": 128}  # steps of heavy-row maxima kept per layer
MARGIN_START = 1.25  # the adaptive rule's resting margin (the window rule's fixed one)
MARGIN_GROWTH = 1.5  # x margin after each redo the layer caused
MARGIN_MAX = 4.0
MARGIN_DECAY = 0.01  # per accepted step, fraction of (margin - MARGIN_START) given back
ROUND_ROWS = 64  # adaptive capacities are multiples of this
RESTART_STEPS = 8  # steps of history a layer keeps when it moves to the ELL path


def cold_margin(n: int, window: int) -> float:
    """Extra margin factor of a capacity from ``n`` steps of history in a rule that keeps
    ``window``: ``1 + 1/sqrt(n) - 1/sqrt(window)`` (at least 1): 1 once the window is full, 1.75
    (window rule) or 1.91 (adaptive) from a single step. The largest of a few counts
    under-estimates the next ones' (on the synthetic traces 20 steps from a fresh start redid
    0.5-1.0 steps per 10 with the window rule, 0.3-0.7 adaptive; 0.1-0.4 and 0.01-0.16 with this
    factor: BENCHMARKS.md, "No redone steps")."""
    n = max(int(n), 1)
    return max(1.0, 1.0 + 1.0 / math.sqrt(n) - 1.0 / math.sqrt(max(int(window), 1)))


class BackupCapacity:
    """Per-layer no-sync dense-backup capacities from past heavy-row counts.

    Args:
        num_layers: L.
        rule: ``window`` or ``adaptive`` (see the module docstring).

    Raises:
        ValueError: unknown rule or num_layers < 0.
    """

    def __init__(self, num_layers: int, rule: str = "window") -> None:
        if rule not in CAPACITY_RULES:
            raise ValueError(f"backup capacity rule must be one of {CAPACITY_RULES}; got {rule!r}")
        if num_layers < 0:
            raise ValueError(f"num_layers must be >= 0; got {num_layers}")
        self.rule = rule
        self.window = WINDOW_STEPS[rule]
        self.hist: list[list[float]] = [[] for _ in range(num_layers)]
        self.margin: list[float] = [MARGIN_START] * num_layers

    def overflowed(self, layers: list[int]) -> None:
        """A step was redone because these layers had more heavy rows than their capacity."""
        if self.rule == "adaptive":
            for i in layers:
                self.margin[i] = min(self.margin[i] * MARGIN_GROWTH, MARGIN_MAX)

    def update(self, heavy_max_L: list[float], floor: int | list[int] = 0) -> list[int]:
        """Record an accepted step's per-layer heavy-row maxima; return the next step's
        capacities (rows, one int per layer; ``floor``: see :meth:`capacity`, one for every layer
        or one per layer)."""
        floors = floor if isinstance(floor, list) else [floor] * len(heavy_max_L)
        caps = []
        for i, r in enumerate(heavy_max_L):
            h = self.hist[i]
            h.append(float(r))
            del h[:-self.window]
            if self.rule == "adaptive":
                self.margin[i] = MARGIN_START + (self.margin[i] - MARGIN_START) * (1 - MARGIN_DECAY)
            caps.append(self.capacity(i, floors[i]))
        return caps

    def capacity(self, i: int, floor: int = 0) -> int:
        """Layer i's capacity from its current history and margin (times :func:`cold_margin` of
        the history's length), at least ``floor`` rows (0 with no heavy rows and no floor)."""
        h = self.hist[i]
        top = max(h, default=0.0)
        if top <= 0:
            return max(0, int(floor))
        cold = cold_margin(len(h), self.window)
        if self.rule == "window":
            rows = backup_capacity_for(cold * top)  # ceil(1.25 cold top) + 16
        else:
            rows = ROUND_ROWS * math.ceil((math.ceil(self.margin[i] * cold * top) + 16)
                                          / ROUND_ROWS)
        return max(rows, int(floor))

    def rescale(self, ratio: float) -> None:
        """The calls now have ``ratio`` times as many rows (a new micro-batch): every recorded
        count x ``ratio`` when they grow (a call's heavy rows, their mean and their spread, grow at
        most in proportion), x ``sqrt(ratio)`` when they shrink (a count's spread shrinks only as
        its square root: a smaller call can hold more than its share of a burst).

        Raises:
            ValueError: ratio not a finite number > 0.
        """
        if not (math.isfinite(ratio) and ratio > 0):
            raise ValueError(f"BackupCapacity.rescale: ratio must be a finite number > 0; got "
                             f"{ratio}")
        f = ratio if ratio >= 1 else math.sqrt(ratio)
        self.hist = [[v * f for v in h] for h in self.hist]

    def restart(self, i: int, keep: int = RESTART_STEPS) -> None:
        """Layer i moves to the ELL path: keep only its ``keep`` latest counts (steps measured on
        the path it leaves; older ones may date from when it was denser)."""
        self.hist[i] = self.hist[i][-keep:] if keep > 0 else []

    def state_dict(self) -> dict:
        return {"rule": self.rule, "hist": [list(h) for h in self.hist],
                "margin": list(self.margin)}

    def load_state_dict(self, d: dict) -> None:
        """Restore from :meth:`state_dict` (a checkpoint of another rule keeps the histories
        and starts the margins afresh)."""
        for i, h in enumerate(d.get("hist", [])[: len(self.hist)]):
            self.hist[i] = [float(v) for v in h][-self.window:]
        if d.get("rule") == self.rule:
            for i, m in enumerate(d.get("margin", [])[: len(self.margin)]):
                self.margin[i] = float(m)
