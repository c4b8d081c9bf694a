"""No-sync dense-backup capacities of the sparse training path (``model.ffn_host_sync=step``).

Each layer on the ELL path runs with a fixed dense-backup capacity (rows for the tokens with more
active units than the ELL capacity, "heavy rows"), chosen before the step from earlier steps'
heavy-row counts; the step's one host sync checks them, and a step in which some layer had more
heavy rows than its capacity is redone measuring per call (:meth:`twell.nn.plan.FFNPlan.end_step`
decides, the trainer redoes it). A redo costs a whole step; a backup row costs 12 D H FLOPs per
micro-step (forward + backward, ~14 us for 64 rows at the 1.5B shape on an H200, ~0.4 ms a step
over 28 layers), so capacities should be generous.

``trainer.backup_capacity`` rules (per layer; ``R`` = the step's largest heavy-row count of any
micro-batch, measured in the step's one host sync):

* ``window`` (default): ``ceil(1.25 max(R of the last 16 steps)) + 16``, 0 when that max is 0
  (:func:`twell.ops.sparse_train.backup_capacity_for`).
* ``adaptive``: ``ceil(m max(R of the last 128 steps)) + 16`` rounded up to a multiple of 64
  (so backup GEMM shapes repeat), 0 when that max is 0. The margin ``m`` starts at 1.25; each
  redo this layer caused multiplies it by 1.5 (at most 4); every accepted step moves it back
  towards 1.25 by 1 % of the distance (half-life ~70 steps). The long window remembers the rare
  heavy batches (many short documents: each document start has fully active first tokens),
  and the margin learns a layer's burst size. Evaluated on synthetic traces by
  ``scripts/capacity_policy_sim.py``.

The histories and margins are part of the FFN plan's state (:class:`twell.nn.plan.FFNPlan`,
checkpointed with the trainer: an exact resume uses the same capacities). Source of the dense
backup: arXiv 2603.23198, "Hybrid (training)"; the rules and their margins are ours.
"""

from __future__ import annotations

import math

from twell.ops.sparse_train import backup_capacity_for

CAPACITY_RULES = ("window", "adaptive")
WINDOW_STEPS = {"window": 16, "adaptive": 128}  # steps of heavy-row maxima kept per layer
MARGIN_START = 1.25  # the adaptive rule's resting margin (the window rule's fixed one)
MARGIN_GROWTH = 1.5  # x margin after each redo the layer caused
MARGIN_MAX = 4.0
MARGIN_DECAY = 0.01  # per accepted step, fraction of (margin - MARGIN_START) given back
ROUND_ROWS = 64  # adaptive capacities are multiples of this


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

    def update(self, heavy_max_L: list[float]) -> list[int]:
        """Record an accepted step's per-layer heavy-row maxima; return the next step's
        capacities (rows, one int per layer)."""
        caps = []
        for i, r in enumerate(heavy_max_L):
            h = self.hist[i]
            h.append(float(r))
            del h[:-self.window]
            if self.rule == "adaptive":
                self.margin[i] = MARGIN_START + (self.margin[i] - MARGIN_START) * (1 - MARGIN_DECAY)
            caps.append(self.capacity(i))
        return caps

    def capacity(self, i: int) -> int:
        """Layer i's capacity from its current history and margin (0 with no heavy rows)."""
        top = max(self.hist[i], default=0.0)
        if top <= 0:
            return 0
        if self.rule == "window":
            return backup_capacity_for(top)  # ceil(1.25 top) + 16
        rows = math.ceil(self.margin[i] * top) + 16
        return ROUND_ROWS * math.ceil(rows / ROUND_ROWS)

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
