"""Offline evaluation of the no-sync dense-backup capacities on synthetic heavy-row traces that
mimic a framework-trained 1.5B model (CPU, seconds; ``scripts/capacity_policy_sim.py`` prints
the tables, BENCHMARKS.md "No redone steps" holds them).

Shape legend: S steps, A micro-batches per step, L layers.

What is simulated (per layer l of 28, per micro-batch of B x 2048 tokens; B = 8 unless said),
from what the real model showed (L0 6-45 per token, the busiest layer 75-100, the first tokens
of each sequence fully active, 1-3 redone steps in 15 with the window rule)::

    heavy = k_l (B + D) + Poisson(lam_l(t) c)

* ``k_l`` in 1..4: fully active first tokens of each sequence and of each document start;
* ``D``: document starts inside the micro-batch (documents are joined with EOS and cut into
  2048-token blocks): Poisson(1.5 B) in ``steady``, negative binomial (mean 1.5 B, shape 1.5:
  many short documents now and then) in the other scenarios;
* ``lam_l(t)``: the other heavy tokens, log-uniform 5-400 per 8 sequences and layer (3 busy
  layers 1500-4000), drifting over ~500 steps to 0.2-1.0x of the start (L1 trains them away;
  3 layers drift up 1.5x instead);
* ``c``: a content factor shared by all layers, lognormal sigma 0.15 (``steady``: 0.05);
* ``bursty``: 4 layers see their ``lam`` x 2-4 in 0.5 % of the micro-batches;
* ``early``: ``bursty`` with the drift 8x faster (over ~60 steps) and the content factor's
  sigma 0.3;
* ``surge``: ``docs`` where from step 300 every layer's ``lam`` rises 4 % a step for 40
  steps (L0 drifting up: heavy rows grow faster than L0) and stays there, falling back to
  start again every 700 steps;
* ``dips``: ``docs`` where 1 % of the steps are far below the rest in every layer (micro-batches
  of a few long documents with few heavy tokens: no document start inside them and 0.1x the
  other heavy tokens); the other steps are ``docs``'s.
* ``heavytail``: ``docs`` with ``heavy = k_l D + Poisson(lam_l(t) c)`` and ``D`` Poisson of a
  log-normal mean (sigma 1, mean 1.5 B, shared by the layers): the dense first tokens are those
  of document starts only (a block cut inside a document starts none), and a micro-batch of
  many short documents now and then adds rows to every layer at once (99th / 99.9th percentile
  of ``D`` at B = 16: 151 / 324; the negative binomial's 93 / 133). Its light layers swing as
  the 2B benchmark's did in their first 13 steps (``docs/model_bench/runs_s22.tar.xz``,
  ``s22/bench_2b_80/capacity_trace.csv``, 38 layers, B = 16): a count over the largest of the
  5-12 steps before it is 2.33x at its 99th percentile (2B: 2.43x; ``docs``: 1.51x), above
  2x in 1.4 % of the layer-steps (2B: 2.3 %; ``docs``: 0.15 %); a layer's spread of
  ln(1 + R) over 13 steps 0.77 at the 90th percentile of the layers (2B: 1.15; ``docs``:
  0.41).

The step's count is the maximum over its micro-batches. :func:`replay` runs the trainer's
protocol through a real :class:`twell.nn.plan.FFNPlan` (``begin_step`` / ``end_step``; a redone
step is replayed measuring), optionally changing the micro-batch midway, and reports over the
steady state: redone steps per 100, mean capacity, spare rows (capacity beyond the heavy rows:
computed for nothing) and the expected cost at the 1.5B shape as a share of the step (redos x
the step, plus the spare rows' backup FLOPs, 16 D H per row and micro-step at
:data:`BACKUP_TFLOPS`, against a :data:`MICRO_MS` micro-step of 8 x 2048 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twell.nn import FFNPlan, PlanOptions, StepStats
from twell.nn.mlp import SparseGatedMLP
from twell.policy import FFNPolicy

SCENARIOS = ("steady", "docs", "bursty", "early", "surge", "dips", "heavytail")
NUM_LAYERS, SEQ_LEN, SEQUENCES = 28, 2048, 8
D, H = 2048, 5632  # the 1.5B shape
MICRO_MS = SEQUENCES * SEQ_LEN / 26.2  # plain transformers' 1.5B micro-step on one H200 (ms)
BACKUP_TFLOPS = 300.0  # the backup's R x D x H GEMMs (R ~ 100-1000 rows) on an H200
BACKUP_MS_PER_ROW = 16 * D * H / (BACKUP_TFLOPS * 1e12) * 1e3  # one row, forward + backward


def make_trace(scenario: str, steps: int, accum: int, seed: int,
               sequences: int = SEQUENCES) -> np.ndarray:
    """(S, L) float array: each step's largest heavy-row count of any of its ``accum``
    micro-batches of ``sequences`` x 2048 tokens (see the module docstring). The same seed
    gives the same layers (rates, first-token counts, drift) at any ``sequences``.

    Raises:
        ValueError: unknown scenario, or steps / accum / sequences < 1.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS}; got {scenario!r}")
    if min(steps, accum, sequences) < 1:
        raise ValueError(f"steps, accum and sequences must be >= 1; got {steps}, {accum}, "
                         f"{sequences}")
    L, scale = NUM_LAYERS, sequences / SEQUENCES
    rng = np.random.default_rng(seed)
    k = rng.integers(1, 5, L)
    lam0 = np.exp(rng.uniform(np.log(5), np.log(400), L))
    busy = rng.choice(L, 3, replace=False)
    lam0[busy] = rng.uniform(1500, 4000, 3)
    end = rng.uniform(0.2, 1.0, L)
    up = rng.choice(np.setdiff1d(np.arange(L), busy), 3, replace=False)
    end[up] = 1.5
    bursty = rng.choice(L, 4, replace=False)
    sigma = {"steady": 0.05, "early": 0.3}.get(scenario, 0.15)
    tau = 60.0 if scenario == "early" else 500.0
    t = np.arange(steps)[:, None, None]
    lam = scale * lam0 * (end + (1 - end) * np.exp(-t / tau))  # (S, 1, L)
    if scenario == "surge":
        lam = lam * np.exp(0.04 * np.clip((t - 300) % 700, 0, 40) * (t >= 300))
    shape = (steps, accum, 1)
    mean_docs = 12 * scale
    if scenario == "steady":
        docs = rng.poisson(mean_docs, shape)
    else:  # negative binomial, mean 12 per 8 sequences, shape 1.5
        docs = rng.negative_binomial(1.5, 1.5 / (1.5 + mean_docs), shape)
    if scenario == "heavytail":  # its own generator: the other draws stay docs's
        aside = np.random.default_rng((seed, 2))
        docs = aside.poisson(mean_docs * aside.lognormal(-0.5, 1.0, shape))
    c = rng.lognormal(0.0, sigma, shape)
    rate = lam * c
    if scenario in ("bursty", "early"):
        hit = rng.random(shape) < 0.005
        mult = np.ones((steps, accum, L))
        mult[:, :, bursty] = np.where(hit, rng.uniform(2, 4, shape), 1.0)
        rate = rate * mult
    starts = docs if scenario == "heavytail" else sequences + docs
    heavy = k * starts + rng.poisson(rate)  # (S, A, L)
    if scenario == "dips":  # its own generator: the other steps stay docs's
        aside = np.random.default_rng((seed, 1))
        dip = aside.random((steps, 1, 1)) < 0.01
        heavy = np.where(dip, k * sequences + aside.poisson(0.1 * rate), heavy)
    return np.minimum(heavy, sequences * SEQ_LEN).max(axis=1).astype(float)


@dataclass(frozen=True)
class ReplayResult:
    """Steady-state statistics of one :func:`replay`."""

    redo_per_100: float
    """Redone steps per 100 steps."""
    mean_cap: float
    """Mean no-sync capacity (rows per layer and step)."""
    spare_rows: float
    """Capacity beyond the heavy rows, summed over the layers, per step (rows computed for
    nothing)."""
    measured_layer_steps: float
    """Layers per step that measured per call (no capacity: one host sync per call)."""
    cost_pct: float
    """Expected cost in % of the steps: redos plus the spare rows' backup time."""
    steps: int


def replay(trace: np.ndarray, rule: str = "window", warm: int = 200, *,
           policy: FFNPolicy | None = None, sequences: int = SEQUENCES,
           change: tuple[int, int] | None = None, rescale: bool = True) -> ReplayResult:
    """Replay the trainer's protocol on a trace (see the module docstring).

    Args:
        trace: (S, L) heavy-row maxima per step (:func:`make_trace`).
        rule: ``ffn.backup_capacity`` (``window`` or ``adaptive``).
        warm: steps before the steady state.
        policy: every layer's :class:`twell.policy.FFNPolicy` (its ``backup_floor_fraction`` and
            ``dense_row_fraction``); None = the defaults.
        sequences: sequences per micro-batch (rows per call = sequences x 2048).
        change: ``(step, sequences)``: from that step on the micro-batch has that many
            sequences (the trace must have been made for it from there); the plan is told
            before the step (``set_rows_per_call``, or with ``rescale=False``
            ``reset_capacities``, which forgets the histories).

    Returns:
        :class:`ReplayResult` over the steps from ``warm`` on.
    """
    policy = policy if policy is not None else FFNPolicy()
    mlps = [SparseGatedMLP(8, 64, impl="twell", policy=policy) for _ in range(trace.shape[1])]
    plan = FFNPlan(mlps, PlanOptions(capacity_rule=rule))
    redos, cap_sum, cap_n, spare, measured = 0, 0.0, 0, 0.0, 0
    seqs = sequences
    for s, heavy in enumerate(trace):
        if change is not None and s == change[0]:
            seqs = change[1]
            if rescale:
                plan.set_rows_per_call(seqs * SEQ_LEN, seqs)
            else:
                plan.reset_capacities()
        rows = seqs * SEQ_LEN
        hv = [float(v) for v in heavy]
        stats = StepStats(hv, [0.0] * len(hv), [0.0] * len(hv), rows_per_call=rows,
                          tokens=rows, sequences_per_call=seqs)
        caps = [min(lp.backup_rows, rows - 1) for lp in plan.layers]
        plan.begin_step()
        redo = not plan.end_step(stats).accepted
        if redo:  # the redone step measures per call: accepted
            plan.begin_step()
            plan.end_step(stats)
        if s >= warm:
            redos += redo
            used = [(c, v) for c, v in zip(caps, hv) if c >= 0]
            cap_sum += sum(c for c, _ in used)
            cap_n += len(used)
            spare += sum(max(c - v, 0.0) for c, v in used)
            measured += len(hv) - len(used)
    steps = max(len(trace) - warm, 1)
    redo_pct = 100 * redos / steps
    spare_pct = 100 * spare / steps * BACKUP_MS_PER_ROW / MICRO_MS
    return ReplayResult(redo_pct, cap_sum / max(cap_n, 1), spare / steps, measured / steps,
                        redo_pct + spare_pct, steps)


__all__ = ["BACKUP_MS_PER_ROW", "MICRO_MS", "SCENARIOS", "ReplayResult", "make_trace", "replay"]
