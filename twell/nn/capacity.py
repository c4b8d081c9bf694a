"""No-sync dense-backup capacities of the sparse training path (``ffn.host_sync=step``).

Each layer on the ELL path runs with a fixed dense-backup capacity (rows for the tokens with more
active units than the ELL capacity, "heavy rows"), chosen before the step from earlier steps'
heavy-row counts; the step's one host sync checks them, and a step in which some layer had more
heavy rows than its capacity is redone measuring per call (:meth:`twell.nn.plan.FFNPlan.end_step`
decides, the trainer redoes it). A redo costs a whole step; a backup row costs 16 D H FLOPs per
micro-step (forward ``u_R = x_R Wu^T`` and ``h_R Wd^T``, backward ``dy_R Wd``, ``dx_R`` through
both weights and the three weight gradients: 4 + 12 D H; ~39 us for 64 rows at the 1.5B shape
at 300 TFLOP/s, ~1.1 ms a micro-step over 28 layers), so capacities should be generous.

Every capacity is at least the plan's floor (``FFNPolicy.backup_floor_fraction`` of a call's
rows plus one row per sequence: :meth:`BackupCapacity.capacity`'s ``floor``), so a layer whose
recent steps had no heavy row is not redone for the first one.

``ffn.backup_capacity`` rules (per layer; ``R`` = the step's largest heavy-row count of any
micro-batch, measured in the step's one host sync):

* ``window`` (default): ``ceil(1.25 c max(R of the last 16 steps)) + 16``, 0 when that max is 0
  (:func:`twell.ops.ffn_train.backup_capacity_for`).
* ``adaptive`` (``trainer=gpu``'s): ``ceil(M top) + 16`` rounded up to a multiple of 64 (so
  backup GEMM shapes repeat), 0 when ``top`` is 0, where

  - ``top = max(max(R of the last 128 steps), g max(R of the last 8 steps))``: the long window
    remembers the rare heavy batches (many short documents: each document start has fully
    active first tokens); ``g`` (:func:`drift_factor`) is how much the last 8 steps' median rose
    over the 8 before (1 when it did not, at most 2), so a rising count (L0 drifting up) gets
    its capacity one window ahead of the rise instead of after an overflow;
  - ``M = max(m c, s)``: the learned margin ``m`` (starts at 1.25; each redo or forward rerun
    this layer caused multiplies it by 1.5, at most 4; every accepted step moves it back
    towards 1.25 by 1 % of the distance, half-life ~70 steps) times ``c`` below, or the
    spread headroom ``s`` (:func:`spread_margin`): the layer's own step-to-step variation,
    ``exp((Z - E[max of n normals]) up)`` with ``up`` the upper spread of ``ln(1 + R)`` over
    its last 32 steps (from the deviations above their median only, scaled to equal the
    standard deviation on symmetric noise: a step far below the rest does not raise it) and
    ``Z`` = 3.5, so that a layer whose counts swing up gets the headroom its swings need, a
    steady one keeps ``m c``.

  While the layer's history is shorter than the window the capacity is also at least
  ``top + h floor`` (before the ``+ 16`` and the rounding), :func:`cold_headroom`: ``h`` = 2
  floors of rows above the largest count seen, for a micro-batch of many short documents
  (heavy in absolute rows, in every layer at once) that the first steps have not shown yet.

  Evaluated on synthetic traces by :mod:`studies.capacity_sim`
  (``scripts/capacity_policy_sim.py``; docs/capacity_sim.md).

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
from statistics import NormalDist, median

from twell.ops.ffn_train import backup_capacity_for

CAPACITY_RULES = ("window", "adaptive")
WINDOW_STEPS = {"window": 16, "adaptive": 128}  # steps of heavy-row maxima kept per layer
MARGIN_START = 1.25  # the adaptive rule's resting margin (the window rule's fixed one)
MARGIN_GROWTH = 1.5  # x margin after each redo the layer caused
MARGIN_MAX = 4.0
MARGIN_DECAY = 0.01  # per accepted step, fraction of (margin - MARGIN_START) given back
ROUND_ROWS = 64  # adaptive capacities are multiples of this
RESTART_STEPS = 8  # steps of history a layer keeps when it moves to the ELL path
# The adaptive rule's spread headroom (spread_margin): the capacity sits SPREAD_Z upper spreads
# of ln(1 + R) (the standard deviation of the counts above their median) above their median,
# less what the window's maximum already stands above it; 3.5 is an overflow in ~4000 steps of a
# layer whose counts are log-normal. The spread of the last SPREAD_STEPS steps: the recent one
# (16 to 128 gave the same redo rates on the synthetic traces). At most SPREAD_MAX: a layer
# swinging between 0 and a few rows has a huge log spread and a small capacity either way.
SPREAD_Z = 3.5
SPREAD_STEPS = 32
SPREAD_MAX = MARGIN_MAX
# The adaptive rule's drift look-ahead (drift_factor): the median of the last DRIFT_STEPS counts
# over the median of the DRIFT_STEPS before, at most DRIFT_MAX
DRIFT_STEPS = 8
DRIFT_MAX = 2.0
# The adaptive rule's cold headroom (cold_headroom): while a layer's history is shorter than the
# window its capacity is at least its largest count plus COLD_HEADROOM floors of rows
COLD_HEADROOM = 2.0
# E[max of n standard normals] (Blom's approximation), n = 0..the adaptive window: what the
# window's maximum already stands above the mean, in standard deviations
_NORMAL_MAX = [0.0] + [NormalDist().inv_cdf((n - 0.375) / (n + 0.25))
                       for n in range(1, WINDOW_STEPS["adaptive"] + 1)]


def cold_margin(n: int, window: int) -> float:
    """Extra margin factor of a capacity from ``n`` steps of history in a rule that keeps
    ``window``: ``1 + 1/sqrt(n) - 1/sqrt(window)`` (at least 1): 1 once the window is full, 1.75
    (window rule) or 1.91 (adaptive) from a single step. The largest of a few counts
    under-estimates the next ones' (on the synthetic traces 20 steps from a fresh start redid
    0.5-1.0 steps per 10 with the window rule, 0.3-0.7 adaptive; 0.1-0.4 and 0.01-0.16 with this
    factor: BENCHMARKS.md, "No redone steps")."""
    n = max(int(n), 1)
    return max(1.0, 1.0 + 1.0 / math.sqrt(n) - 1.0 / math.sqrt(max(int(window), 1)))


def cold_headroom(n: int, window: int, floor: int) -> float:
    """Rows the adaptive rule keeps above a layer's largest count (times its drift) while its
    history of ``n`` steps is shorter than ``window``: :data:`COLD_HEADROOM` x ``floor`` (the
    plan's floor, ``backup_floor_fraction`` of a call's rows plus one row per sequence; 2 x
    (128 + 16) = 288 rows at 16 x 2048 tokens), 0 with the window full or no floor.

    Why: the heavy tail of a light layer's counts is in absolute rows. Its heavy rows are
    mostly the dense first tokens of the documents in the call, so a micro-batch of many short
    documents adds rows to every such layer at once, however few it had before; a margin
    proportional to the layer's count gives it few rows. The 2B benchmark (38 layers, 16 x 2048
    tokens a call, each row from an empty history; ``docs/model_bench/runs_s22.tar.xz``,
    ``s22/bench_2b_80/capacity_trace.csv``):
    layer 6 counted 107, 137, 132, 57, 131, then 417 (their spread above their median ~0:
    the spread headroom saw no tail); the margin alone gave
    ``1.25 x 1.36 x 137 + 16`` -> 256 rows (320 a step earlier, the cold margin falling with
    ``n``) and the step's forward ran again for layers 4-9 (280 rows over layer 6's max; 123-245
    over the others'). With 2 floors: 448 rows. The layers of thousands of rows already have
    more from the margin (``0.25 top > 288`` from 1152 rows) and get nothing: the 2B replay's
    mean capacity +0.4 % (3469 -> 3484 rows; 0 forward reruns where there was 1), the 1.5B
    one's +0.1 %. Why 2 floors: 1 left layer 6 at 320; on the synthetic traces' 20-step fresh
    starts (docs/capacity_sim.md, "The cold headroom") 2 cut the redos by 5-84 % (0.075 ->
    0.012 per 10 on ``docs``, 0.239 -> 0.096 on ``heavytail`` at accumulation 1) for 1-4 % more
    capacity (8-10 % on ``steady``, where nothing overflows); 3 cut a few more for 1-8 %
    more capacity again. Why while the window fills (the cold margin's steps):
    the chance that the next count is the largest yet is ``1 / (n + 1)`` whatever the counts'
    law; once the layer's steps have held such a micro-batch its maximum covers the next. The
    steady state (window full) is unchanged.
    """
    if n >= window or floor <= 0:
        return 0.0
    return COLD_HEADROOM * floor


def spread_margin(hist: list[float], z: float = SPREAD_Z) -> float:
    """The adaptive rule's spread headroom (a factor on the window's maximum, >= 1) of a layer
    whose steps had the heavy-row counts ``hist`` (rows per FFN call, oldest first, at most the
    rule's window): ``exp((z - E[max of n normals]) up)``, ``n`` the whole history's length (the
    maximum the factor multiplies is over it), within ``[1, SPREAD_MAX]``; 1 with fewer than
    two counts. ``up`` is the upper spread of ``x = ln(1 + R)`` over the last
    :data:`SPREAD_STEPS` counts ``x_1..x_k`` about their median ``med``::

        up = sqrt(2 sum_i max(x_i - med, 0)^2 / (k - 1))

    Why: a fixed margin over the window's maximum suits a layer whose counts vary as little as
    the synthetic traces'; a layer whose counts swing more (batches heavy in several layers at
    once, a rising L0) overflows it. Its own spread says by how much: the capacity sits ``z``
    spreads above the counts' centre, less what their maximum already stands above it
    (``E[max]`` of ``n``: a short history, whose maximum is a weak bound, gets more).

    Only the counts above the median count: a capacity guards against high counts, and a count
    far below the rest (a batch with few heavy rows) would otherwise widen the spread and raise
    the capacity for :data:`SPREAD_STEPS` steps without guarding against anything. The scale
    is the standard deviation's on symmetric noise: for a normal ``x`` of standard deviation
    ``sigma`` the median is the mean and ``E[max(x - med, 0)^2] = sigma^2 / 2`` (half the
    squared deviations, the upper half), so ``up`` estimates ``sigma`` and ``z`` of them is the
    same margin as ``z`` standard deviations; a sample symmetric about its median (any two
    counts, say) gives exactly its sample standard deviation."""
    recent = [math.log1p(max(v, 0.0)) for v in hist[-SPREAD_STEPS:]]
    if len(recent) < 2:
        return 1.0
    med = median(recent)  # equal counts: exactly each, so no spread
    up = math.sqrt(2 * sum(max(x - med, 0.0) ** 2 for x in recent) / (len(recent) - 1))
    e_max = _NORMAL_MAX[min(len(hist), len(_NORMAL_MAX) - 1)]
    return min(max(math.exp(max(z - e_max, 0.0) * up), 1.0), SPREAD_MAX)


def drift_factor(hist: list[float], steps: int = DRIFT_STEPS) -> float:
    """How much a layer's heavy-row counts ``hist`` (oldest first) rose: the median of the last
    ``steps`` over the median of the ``steps`` before, within ``[1, DRIFT_MAX]``; 1 with fewer
    than ``2 steps`` counts or a zero median before. The adaptive rule multiplies the recent
    maximum by it, so a count that keeps rising (L0 drifting up: heavy rows grow faster than L0)
    finds its capacity already raised by as much as it rose over the last window. Medians, not
    means: one step far below (or above) the rest in either window is not a drift (a low step
    among the earlier ones would raise the factor for ``steps`` steps; a spike is what the
    window's maximum and the spread headroom already cover)."""
    if len(hist) < 2 * steps:
        return 1.0
    recent, before = median(hist[-steps:]), median(hist[-2 * steps:-steps])
    if before <= 0:
        return 1.0
    return min(max(recent / before, 1.0), DRIFT_MAX)


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
        the history's length; the adaptive rule also its spread, drift and
        :func:`cold_headroom`, see the module docstring), at least ``floor`` rows (0 with no
        heavy rows and no floor)."""
        h = self.hist[i]
        top = max(h, default=0.0)
        if top <= 0:
            return max(0, int(floor))
        cold = cold_margin(len(h), self.window)
        if self.rule == "window":
            rows = backup_capacity_for(cold * top)  # ceil(1.25 cold top) + 16
        else:
            top = max(top, max(h[-DRIFT_STEPS:]) * drift_factor(h))
            m = max(self.margin[i] * cold, spread_margin(h))
            need = max(m * top, top + cold_headroom(len(h), self.window, int(floor)))
            rows = ROUND_ROWS * math.ceil((math.ceil(need) + 16) / ROUND_ROWS)
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
