"""The memory planner (``trainer.memory=auto``): the micro-batch and how much of each decoder
layer to recompute, chosen from measurements of this model on this device so that the step fits
``trainer.memory_budget_gb`` and trains fastest.

Why: on one H200 every FFN path trained 1.27-1.32x faster without activation recomputation,
and it fits at 1.5B and 2B (BENCHMARKS.md, "Memory planner"); which micro-batch and which
recomputation fit depends on the model, the FFN path, the loss and the card, so it is measured.

Candidates: ``micro_batch`` in :func:`micro_batch_candidates` of ``P = global_batch / world size``
(the largest micro-batch of each accumulation count: a step of ``P`` sequences runs as
``ceil(P / micro_batch)`` micro-batches of balanced sizes, :func:`micro_batch_sizes`, so the
global batch stays what the user set and the micro-batch need not divide it) x ``recompute`` (:data:`train.recompute.RECOMPUTE_MODES`): ``none``;
``attention`` (every layer recomputes its attention half, its FFN runs once outside:
``checkpoint_ffn=never``); ``full`` (whole layers). ``attention_ell`` (``checkpoint_ffn=auto``:
only layers on the ELL path skip their FFN's recomputation) is taken only when the user sets
it: its memory grows as layers move to the ELL path during the run, so a probe at the start
would under-estimate the later peak; ``attention`` keeps every FFN's state from the start, and
an FFN's state only shrinks when it turns sparse.

Peak-memory model (GiB, one rank): ``peak(B, r) = a_r + b_r B + pending``. ``a_r`` holds the
weights, their gradients and whatever does not grow with the micro-batch (bf16 weight casts
saved for backward, the loss's chunk), ``b_r`` the activations of one sequence, ``pending`` the
AdamW moments not allocated yet (8 bytes per fp32 parameter before the first optimizer step:
with the 4 + 4 of weights and gradients, 16 bytes a parameter on one GPU). ``a_r`` and ``b_r``
come from two probes at the two smallest micro-batches of at least ``min_probe_tokens`` tokens
(the fused loss's chunk: below it the chunk grows with the batch and the line's slope would be
too steep), both divisors of ``P`` (points far enough apart for a steady slope); the largest
candidate the line fits within the budget is then probed itself (the confirmation), stepping to
the next smaller candidate while it does not fit (a probe that ran refits the line through it).

A probe (:class:`ProbeRunner`): forward and backward (CE + L1, as a training micro-step) of a
fixed batch of real token ids (held-out sequences, repeated to the micro-batch), one warm-up and
:data:`PROBE_TIMED_STEPS` timed with CUDA events, gradients accumulated over them as in an
accumulating step, no optimizer step; weights, optimizer state, data position and the FFNs'
per-step settings are left as they were (the gradients are set to None after). Peak:
``torch.cuda.max_memory_allocated``; an out-of-memory error in a probe marks it "does not fit".

Decision: per recompute mode its largest fitting micro-batch (confirmed by a probe) and the
largest candidate at most :data:`BELOW_FRACTION` of it (probed: the largest is not always the
fastest); among those the fastest in measured tokens/ms of forward+backward (the optimizer step
costs the same for every candidate of one global batch), except that among the candidates
within the probes' noise of the fastest (:data:`PROBE_NOISE`, or the probes' own spread) and
of its recomputation the largest micro-batch wins (:func:`choose_within_noise`; the plan's
``why`` says when it did). Values the user set (``trainer.micro_batch``,
``trainer.grad_checkpointing``, ``trainer.checkpoint_ffn``) restrict the candidates and are never
overridden: with both set the planner only probes them and warns when they do not fit.

During the run (:meth:`TrainerMemory.step_down`): an out-of-memory error inside a training step
makes the planner step down (the next smaller divisor of ``P``: a large step, so that one
error is rarely followed by another; at the smallest, or with the
micro-batch set by the user, the next heavier recomputation), and the step is redone from the
same batches (:class:`StepBatches`), so no data and no update is lost. One process only: under
several ranks the error propagates (the other ranks wait in a collective).

Once sparsity settles (:meth:`TrainerMemory.after_step`, called after every accepted step): the
first plan was made at step 0 with every FFN dense; when ``auto`` has moved most layers to the
ELL path and their paths have not changed for a while, the planner runs once more on the
current model (``attention_ell`` among the candidates now, when the recomputation is the
planner's) and the faster plan is adopted and logged; user-set values stay as they are.

On a machine without CUDA nothing is measured: the user's values, else the largest micro-batch
up to :data:`CPU_MICRO_BATCH` and no recomputation. Tests inject the probe
(:class:`MemoryPlanner` takes any function ``Candidate -> Measurement``).
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from train.recompute import RECOMPUTE_CHECKPOINT_FFN, RECOMPUTE_MODES
from train.step_shape import micro_batch_sizes

# the planner's own candidates (attention_ell only when the user sets checkpoint_ffn=auto)
PLANNED_RECOMPUTE = ("none", "attention", "full")
# Budget margin: 8 % of the device memory, at least 2 GiB. What max_memory_allocated does not see:
# the caching allocator's fragmentation (reserved above allocated, a few % over a long run), the
# CUDA context and the cuBLAS / NCCL / Triton memory outside PyTorch's allocator (~1 GiB), and the
# step-to-step variation of the sparse path's dense backup (heavy rows differ by batch). On a
# 140.4 GiB H200 the budget is 129.2 GiB, above the 127.6 GiB peak plain transformers ran at
# (1.5B, micro-batch 16, no recomputation, BENCHMARKS.md "Memory planner").
MARGIN_FRACTION = 0.08
MARGIN_MIN_GB = 2.0
PROBE_TIMED_STEPS = 2  # timed forward+backward per probe, after one warm-up
PROBE_DISTINCT_SEQUENCES = 64  # held-out sequences in the probe batch (repeated beyond)
CPU_MICRO_BATCH = 8  # no CUDA: largest micro-batch taken (trainer=cpu's)
# The one re-plan once sparsity settled (TrainerMemory.after_step): after this many accepted steps
# with unchanged FFN paths (auto's choices settle within a few steps once L0 stops falling fast),
# with at least this share of the gated layers on ell and their mean heavy-row fraction at most
# this (the recorded 1.5B layers: 0.2-28 %, mean ~2 %); adopted when faster by more than the gain
# (the probes' noise: two timed micro-steps each)
REPLAN_STABLE_STEPS = 50
REPLAN_ELL_SHARE = 0.5
REPLAN_HEAVY_FRACTION = 0.1
REPLAN_GAIN = 0.02
# Below the largest: with ``below`` on, each mode's largest fitting micro-batch L is raced against
# the largest candidate <= BELOW_FRACTION * L (one more probe a mode). The largest is not always
# the fastest: our dense path at 1.5B on an H200 ran 52.2 tok/ms at micro 24 and 50.6 at 29
# (BENCHMARKS.md, "the search over `ceil(512 / a)`"); 0.85 reaches 24 from 29 and 17 from 20.
BELOW_FRACTION = 0.85
# The probes' noise (relative, tokens/ms): candidates within it of the fastest are taken as
# equally fast, and the largest micro-batch among them wins (choose_within_noise). A probe is
# two timed micro-steps after one warm-up, and two probes' ranking has been wrong by more than
# their own spread: at 1.5B on 80 GB 17 probed 0.9 % faster than 20 and timed 3.8 % slower; at
# 2B 13 probed 2.1 % faster than 16 and timed 3.8 % slower (BENCHMARKS.md, the entries "The
# planner's race" and "The planner's tie-break"). The larger one runs fewer micro-steps a step,
# and what a micro-step costs beyond its forward+backward (drawing its batch, the overflow
# check's host sync) is not in a probe. Our dense path's 24 over 29 (+3.2 %) still wins.
PROBE_NOISE = 0.03
# ... widened to a probe's own spread (max - min of its timed micro-steps over their median)
# when that is larger, up to this: a probe that noisy cannot rank candidates, and a wider
# window would only pick the largest micro-batch regardless of speed
PROBE_NOISE_MAX = 0.10


@dataclass(frozen=True, order=True)
class Candidate:
    """One configuration of a training micro-step."""

    micro_batch: int
    """Sequences per forward/backward on one rank."""
    recompute: str
    """One of :data:`train.recompute.RECOMPUTE_MODES`."""


@dataclass(frozen=True)
class Measurement:
    """What a probe of one :class:`Candidate` measured."""

    peak_gb: float
    """Peak GiB allocated during the probe (inf: out of memory; nan: not measurable, CPU)."""
    ms: float
    """Milliseconds per forward+backward of one micro-batch (median; nan if out of memory)."""
    spread: float = 0.0
    """The timed micro-steps' spread relative to their median, ``(max - min) / median``
    (0: one timed micro-step, or not measured): the probe's own noise."""

    @property
    def oom(self) -> bool:
        return math.isinf(self.peak_gb)


OOM = Measurement(math.inf, math.nan)


@dataclass
class Plan:
    """The planner's choice (what ``metrics.jsonl``'s ``memory`` record and summary.json hold)."""

    micro_batch: int
    recompute: str
    accum: int
    """Micro-steps per optimizer step on one rank: ``ceil(P / micro_batch)``, ``P`` = global_batch
    / world size (their sizes: :func:`micro_batch_sizes`)."""
    peak_gb: float | None
    """Predicted peak GiB of a step (probe peak + optimizer state to come); None unmeasured."""
    tok_per_ms: float | None
    """Measured tokens/ms of forward+backward on one rank; None unmeasured."""
    budget_gb: float | None
    why: str
    """Why this candidate: fastest that fits | set by the user | ..."""
    fits: bool = True
    candidates: list[dict] = field(default_factory=list)
    """Every probe: micro_batch, recompute, peak_gb (None = out of memory), tok_per_ms, spread
    (the probe's timed micro-steps, (max - min) / median)."""


def micro_batches(batch_per_rank: int) -> list[int]:
    """The divisors of ``batch_per_rank`` (= global_batch / world size), ascending."""
    if batch_per_rank < 1:
        raise ValueError(f"batch_per_rank must be >= 1; got {batch_per_rank}")
    return [m for m in range(1, batch_per_rank + 1) if batch_per_rank % m == 0]


def micro_batch_candidates(batch_per_rank: int) -> list[int]:
    """The planner's micro-batches, ascending: for each accumulation count ``a`` the largest
    micro-batch of a step of ``batch_per_rank`` sequences split into ``a`` balanced ones,
    ``ceil(batch_per_rank / a)``. Holds every divisor; 512 gives 1-27, 29, 31, 32, 35, ..., 512.

    Why not only the divisors: at global batch 512 the fastest micro-batch that fits may be 12
    or 24 (2B on 80 GB / 141 GB, BENCHMARKS.md "Uneven micro-batches"), where the divisors
    allowed 8 and 16 (0.91x and 0.96x of the step's speed)."""
    if batch_per_rank < 1:
        raise ValueError(f"batch_per_rank must be >= 1; got {batch_per_rank}")
    return sorted({-(-batch_per_rank // a) for a in range(1, batch_per_rank + 1)})


def recompute_choices(grad_checkpointing: bool | None, checkpoint_ffn: str | None, *,
                      compile: bool = False) -> tuple[str, ...]:
    """The recompute modes the planner may choose from, least recomputation first, given the
    user's ``trainer.grad_checkpointing`` and ``trainer.checkpoint_ffn`` (null = the planner's
    choice). ``compile``: the selective modes' saved-tensor hooks are eager-only, so under
    ``trainer.compile`` only ``none`` and ``full``.

    Raises:
        ValueError: an unknown checkpoint_ffn.
    """
    by_ffn = {v: k for k, v in RECOMPUTE_CHECKPOINT_FFN.items() if v is not None}
    if checkpoint_ffn is not None and checkpoint_ffn not in by_ffn:
        raise ValueError(f"checkpoint_ffn must be one of {sorted(by_ffn)} or None; got "
                         f"{checkpoint_ffn!r}")
    if grad_checkpointing is False:
        return ("none",)
    if checkpoint_ffn is not None:
        ckpt = (by_ffn[checkpoint_ffn],)
    else:
        ckpt = ("full",) if compile else ("attention", "full")
    return ckpt if grad_checkpointing else ("none", *ckpt)


def default_budget_gb(total_gb: float) -> float:
    """The default budget of a device with ``total_gb`` GiB usable: less :data:`MARGIN_FRACTION`
    of it, at least :data:`MARGIN_MIN_GB` (see their comment)."""
    return total_gb - max(MARGIN_MIN_GB, MARGIN_FRACTION * total_gb)


def device_budget_gb(device: torch.device) -> float | None:
    """:func:`default_budget_gb` of a CUDA device's memory times its per-process fraction
    (``torch.cuda.set_per_process_memory_fraction``: an 80 GB card emulated on a larger one);
    None for other devices."""
    if device.type != "cuda":
        return None
    index = cuda_index(device)
    total = torch.cuda.get_device_properties(index).total_memory / 2**30
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        total *= fraction(index)
    return default_budget_gb(total)


def cuda_index(device: torch.device | str) -> int:
    """The index of a CUDA device, the current one for a bare ``cuda`` (the per-process memory
    fraction functions refuse a device without an index)."""
    dev = torch.device(device)
    return torch.cuda.current_device() if dev.index is None else dev.index


def pending_optimizer_gb(optimizer) -> float:
    """GiB the optimizer will allocate at its first step: AdamW's two moments (the parameter's
    dtype and local size) for each parameter that has no state yet (0 after a resume)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    n = 0
    for group in opt.param_groups:
        for p in group["params"]:
            if p.requires_grad and not opt.state.get(p):
                local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2: the shard
                n += 2 * local.numel() * local.element_size()
    return n / 2**30


class MemoryPlanner:
    """Chooses a :class:`Plan` from probes (the decision logic; see the module docstring).

    Args:
        probe: ``Candidate -> Measurement`` (on the device: :class:`ProbeRunner`; tests: fakes).
        batch_per_rank: global_batch / world size (sequences per optimizer step on one rank).
        seq_len: tokens per sequence (for tokens/ms).
        budget_gb: GiB the predicted step peak must stay within.
        pending_gb: GiB allocated after the probes (the optimizer state to come).
        micro_batch: the user's micro-batch, or None (the planner's choice).
        recompute: the allowed recompute modes (:func:`recompute_choices`).
        min_probe_tokens: the smallest micro-batch of the two slope probes holds at least this
            many tokens (the fused loss's chunk rows; 0 = the smallest divisor).
        below: with ``0 < below < 1``, each mode's largest fitting micro-batch ``L`` is raced
            against the largest candidate ``<= below * L`` (probed; :data:`BELOW_FRACTION`),
            which wins only when its probe is faster by more than the probes' noise
            (:func:`choose_within_noise`); 0 = off (only the largest of each mode).

    Raises:
        ValueError: a user micro-batch outside 1..batch_per_rank, an unknown or empty
            recompute, a budget that is not > 0, ``below`` outside [0, 1).
    """

    def __init__(self, probe: Callable[[Candidate], Measurement], *, batch_per_rank: int,
                 seq_len: int, budget_gb: float, pending_gb: float = 0.0,
                 micro_batch: int | None = None,
                 recompute: tuple[str, ...] = PLANNED_RECOMPUTE,
                 min_probe_tokens: int = 0, below: float = 0.0) -> None:
        if not 0.0 <= below < 1.0:
            raise ValueError(f"below must be in [0, 1) (0: off); got {below}")
        self.below = below
        self.micros = micro_batch_candidates(batch_per_rank)
        self.divisors = micro_batches(batch_per_rank)  # the slope probes' and step-down's
        if micro_batch is not None and not 1 <= micro_batch <= batch_per_rank:
            raise ValueError(f"micro_batch={micro_batch} is not within 1..{batch_per_rank}, the "
                             "sequences per rank and step")
        bad = [r for r in recompute if r not in RECOMPUTE_MODES]
        if bad or not recompute:
            raise ValueError(f"recompute must be a non-empty tuple of {RECOMPUTE_MODES}; got "
                             f"{recompute!r}")
        if not (budget_gb > 0 and math.isfinite(budget_gb)):
            raise ValueError(f"budget_gb must be a finite number > 0; got {budget_gb}")
        self.probe, self.batch_per_rank, self.seq_len = probe, batch_per_rank, seq_len
        self.budget_gb, self.pending_gb = float(budget_gb), float(pending_gb)
        self.user_micro = micro_batch
        self.modes = tuple(r for r in RECOMPUTE_MODES if r in recompute)  # least first
        self.min_probe_tokens = min_probe_tokens
        self.measured: dict[Candidate, Measurement] = {}
        self.lines: dict[str, tuple[float, float]] = {}  # recompute -> (a_r, b_r) of the model
        self.plan: Plan | None = None

    # -- measurements ---------------------------------------------------------------------------
    def measure(self, c: Candidate) -> Measurement:
        """The probe of ``c`` (each candidate is probed once)."""
        if c not in self.measured:
            self.measured[c] = self.probe(c)
        return self.measured[c]

    def step_peak_gb(self, c: Candidate) -> float | None:
        """Predicted peak GiB of a training step of ``c``: measured if probed, else from its
        mode's line; None when neither is known. inf = ran out of memory."""
        m = self.measured.get(c)
        if m is not None:
            return m.peak_gb + self.pending_gb
        if c.recompute in self.lines:
            a, b = self.lines[c.recompute]
            return a + b * c.micro_batch + self.pending_gb
        return None

    def fits(self, c: Candidate) -> bool:
        p = self.step_peak_gb(c)
        return p is not None and not math.isnan(p) and p <= self.budget_gb

    def tok_per_ms(self, c: Candidate) -> float:
        m = self.measured.get(c)
        if m is None or m.oom or not m.ms > 0:
            return math.nan
        return c.micro_batch * self.seq_len / m.ms

    def spread(self, c: Candidate) -> float:
        """The probe of ``c``'s relative spread (:attr:`Measurement.spread`; 0 if unprobed)."""
        m = self.measured.get(c)
        return 0.0 if m is None or m.oom else m.spread

    # -- the decision ---------------------------------------------------------------------------
    def _largest_fitting(self, r: str) -> Candidate | None:
        """Mode ``r``'s largest micro-batch that fits, confirmed by a probe; None if none does."""
        ds = self.divisors
        first = next((i for i, m in enumerate(ds) if m * self.seq_len >= self.min_probe_tokens),
                     len(ds) - 1)
        points = [Candidate(m, r) for m in ds[first:first + 2]]
        for c in points:
            self.measure(c)
        ok = [c for c in points if self.fits(c)]
        if not ok:  # the smallest probe point is already too big: walk down, probing
            for m in reversed([m for m in self.micros if m < ds[first]]):
                c = Candidate(m, r)
                self.measure(c)
                if self.fits(c):
                    return c
            return None
        if len(ok) < 2:  # one point fits, the other ran above the budget: the line between them
            big = self.measured[points[-1]]
            if len(points) < 2 or ok[0] != points[0]:  # nothing between them to try
                return ok[0]
            m1, m2 = points[0].micro_batch, points[1].micro_batch
            between = [m for m in self.micros if m1 < m < m2]
            if big.oom:  # no line to trust: bisect between them
                return self._confirm(r, between, ok[0], hi=m2, bisect=True)
            self._fit_line(r, (m1, self.measured[ok[0]].peak_gb), (m2, big.peak_gb))
            return self._confirm(r, between, ok[0], hi=m2)
        (m1, p1), (m2, p2) = [(c.micro_batch, self.measured[c].peak_gb) for c in ok]
        self._fit_line(r, (m1, p1), (m2, p2))
        return self._confirm(r, [m for m in self.micros if m > m2], ok[-1])

    def _below(self, c: Candidate) -> Candidate | None:
        """The largest candidate of ``c``'s mode at most ``below`` x its micro-batch (and of at
        least ``min_probe_tokens`` tokens), probed; None when off or there is none."""
        if not self.below:
            return None
        lim = self.below * c.micro_batch
        ms = [m for m in self.micros
              if m <= lim and m * self.seq_len >= self.min_probe_tokens]
        if not ms:
            return None
        b = Candidate(max(ms), c.recompute)
        self.measure(b)
        return b

    def _fit_line(self, r: str, lo: tuple[int, float], hi: tuple[int, float]) -> None:
        (m1, p1), (m2, p2) = lo, hi
        b = max((p2 - p1) / (m2 - m1), 0.0)
        self.lines[r] = (p1 - b * m1, b)

    def _confirm(self, r: str, above: list[int], fallback: Candidate, hi: float = math.inf,
                 bisect: bool = False) -> Candidate:
        """The largest of ``above`` (micro-batches, ascending) that fits, confirmed by a probe;
        ``fallback`` (measured, fits) when none does. Tried first: the largest that mode ``r``'s
        line fits; if it fits and nothing above it was found not to, done. A probe above the
        budget refits the line through it and the largest that fits so far (a secant step); once
        a candidate above the budget is known (``hi``), or a probe ran out of memory (the line
        is no longer trusted), what lies between the largest that fits and the smallest that
        does not is bisected, so a peak that grows faster than linearly loses no fitting
        micro-batch."""
        lo = fallback.micro_batch  # fits (measured); hi does not
        while True:
            between = [m for m in above if lo < m < hi]
            if not bisect:
                between = [m for m in between if self.fits(Candidate(m, r))]  # the line's
            if not between:
                return Candidate(lo, r)
            m = between[len(between) // 2] if bisect else between[-1]
            c = Candidate(m, r)
            self.measure(c)
            if self.fits(c):
                if not bisect and math.isinf(hi):
                    return c
                lo, bisect = m, True
                continue
            hi, got = m, self.measured[c]
            if got.oom:
                bisect = True
            elif not bisect:
                self._fit_line(r, (lo, self.measured[Candidate(lo, r)].peak_gb), (m, got.peak_gb))

    def _choose(self) -> tuple[Candidate, str, bool]:
        """(candidate, why, fits) before any step-down."""
        if self.user_micro is not None:
            options = [Candidate(self.user_micro, r) for r in self.modes]
            for c in options:
                self.measure(c)
            why = ("micro_batch set by the user" if len(self.modes) > 1
                   else "micro_batch and recompute set by the user")
        else:
            options = [c for c in map(self._largest_fitting, self.modes) if c is not None]
            options += [c for c in map(self._below, options) if c is not None]
            why = "fastest that fits"
        fitting = [c for c in options if self.fits(c)]
        if fitting:
            i, note = choose_within_noise([(c, self.tok_per_ms(c), self.spread(c))
                                           for c in fitting])
            why = note or why  # a user-set micro-batch leaves one size per mode: no note
            return fitting[i], why, True
        ran = [c for c, m in self.measured.items() if not m.oom]
        if ran:
            best = min(ran, key=lambda c: self.measured[c].peak_gb)
            return best, f"{why}; nothing fits the budget: the smallest peak", False
        if self.user_micro is not None or len(self.modes) == 1:  # the user's values stay
            c = Candidate(self.user_micro or self.micros[0], self.modes[-1])
            return c, f"{why}; out of memory in every probe", False
        tried = ", ".join(f"{c.micro_batch} x {c.recompute}" for c in sorted(self.measured))
        raise MemoryError(
            f"trainer.memory=auto: every probe ran out of memory ({tried}); the model does not "
            "train on this device: use more devices (FSDP) or a smaller model.")

    def choose(self) -> Plan:
        """Probe and decide; returns (and keeps in ``self.plan``) the :class:`Plan`."""
        c, why, fits = self._choose()
        self.plan = self._plan(c, why, fits)
        return self.plan

    def step_down(self) -> Plan | None:
        """After an out-of-memory error at ``self.plan``: the next smaller micro-batch (not a
        user-set one), else the next heavier recompute mode allowed (at the largest micro-batch
        its line fits, else the same); None when there is nothing lower. No probe is run."""
        cur = Candidate(self.plan.micro_batch, self.plan.recompute)
        smaller = [m for m in self.divisors if m < cur.micro_batch]
        if self.user_micro is None and smaller:
            new = Candidate(smaller[-1], cur.recompute)
        else:
            heavier = [r for r in self.modes
                       if RECOMPUTE_MODES.index(r) > RECOMPUTE_MODES.index(cur.recompute)]
            if not heavier:
                return None
            r = heavier[0]
            fit = [m for m in self.micros if m <= cur.micro_batch and self.fits(Candidate(m, r))]
            new = Candidate(fit[-1] if fit and self.user_micro is None else cur.micro_batch, r)
        self.plan = self._plan(new, f"stepped down from micro_batch {cur.micro_batch}, recompute "
                                    f"{cur.recompute} (out of memory in a step)", True)
        return self.plan

    def _plan(self, c: Candidate, why: str, fits: bool) -> Plan:
        peak = self.step_peak_gb(c)
        tok = self.tok_per_ms(c)
        return Plan(c.micro_batch, c.recompute, -(-self.batch_per_rank // c.micro_batch),
                    None if peak is None or not math.isfinite(peak) else peak,
                    None if math.isnan(tok) else tok, self.budget_gb, why, fits,
                    candidates=[{"micro_batch": k.micro_batch, "recompute": k.recompute,
                                 "peak_gb": None if v.oom else _round(v.peak_gb + self.pending_gb),
                                 "tok_per_ms": _round(self.tok_per_ms(k)),
                                 "spread": round(self.spread(k), 4)}
                                for k, v in sorted(self.measured.items())])


def _num(x: float) -> float:
    return -math.inf if math.isnan(x) else x


def choose_within_noise(options: list[tuple[Candidate, float, float]]) -> tuple[int, str]:
    """The planner's choice among candidates that fit: the largest micro-batch among those of
    the fastest's recomputation whose probed speed is within the probes' noise of it.

    Rule (deterministic: it depends only on the numbers given): ``f`` is the fastest option
    (most tokens/ms; a tie: less recomputation, then the larger micro-batch); its recompute
    mode is the plan's. An option ``c`` of that mode is within noise when
    ``tok(c) * (1 + tol) >= tok(f)``, ``tol`` the larger of :data:`PROBE_NOISE` and the two
    probes' own spreads (:attr:`Measurement.spread`), at most :data:`PROBE_NOISE_MAX`; the
    largest micro-batch among those wins. Why: two probes within their noise do not tell which
    is faster, and at one recomputation the larger micro-batch runs fewer micro-steps a step,
    whose costs beyond forward+backward a probe does not time (:data:`PROBE_NOISE`'s comment
    has the timed cases), so a smaller one (``below``'s) wins only when faster by more than the
    noise. Across recomputations the
    fastest decides: no timed case says which way a tie between modes goes.

    Args:
        options: ``(candidate, tokens/ms of forward+backward, the probe's relative spread)``;
            nan tokens/ms (not measured) counts as slowest.

    Returns:
        ``(index, note)``: the chosen option's index, and ``""`` when it is the fastest, else
        what the plan's ``why`` says: ``"largest micro-batch within 3% of the fastest that fits
        (13 x none: 53.5 tok/ms; the probes' noise)"``.

    Raises:
        ValueError: no options.
    """
    if not options:
        raise ValueError("choose_within_noise: no options")

    def mode(c: Candidate) -> int:
        return RECOMPUTE_MODES.index(c.recompute)

    f = max(range(len(options)), key=lambda i: (
        _num(options[i][1]), -mode(options[i][0]), options[i][0].micro_batch))
    fc, ftok, fspread = options[f]
    if not ftok > 0:  # nothing measured: the fastest's order (less recomputation) decides
        return f, ""

    def tol(i: int) -> float:
        return min(max(PROBE_NOISE, options[i][2], fspread), PROBE_NOISE_MAX)

    near = [i for i, (c, tok, _) in enumerate(options)
            if c.recompute == fc.recompute and _num(tok) * (1 + tol(i)) >= ftok]
    i = max(near, key=lambda i: (options[i][0].micro_batch, _num(options[i][1])))
    if i == f:
        return f, ""
    return i, (f"largest micro-batch within {tol(i):.0%} of the fastest that fits "
               f"({fc.micro_batch} x {fc.recompute}: {ftok:.1f} tok/ms; the probes' noise)")


def _round(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 2)


def describe(plan: Plan, seq_len: int) -> str:
    """The planner's one log line: the choice, why, then every probe (step peak GiB, tokens/ms
    of forward+backward, +- half its timed micro-steps' spread in %; ``*`` the chosen one,
    ``oom`` ran out of memory)."""
    head = (f"memory: micro_batch {plan.micro_batch} x {seq_len}, recompute {plan.recompute}, "
            f"accumulation {plan.accum}")
    if plan.peak_gb is not None:
        head += f", step peak {plan.peak_gb:.1f} GB"
    if plan.budget_gb is not None:
        head += f" of {plan.budget_gb:.1f} GB budget"
    head += f" ({plan.why})"
    by_mode: dict[str, list[str]] = {r: [] for r in RECOMPUTE_MODES}  # least recomputation first
    for c in plan.candidates:
        chosen = (c["micro_batch"], c["recompute"]) == (plan.micro_batch, plan.recompute)
        mark = "*" if chosen else ""
        val = ("oom" if c["peak_gb"] is None else
               f"{c['peak_gb']:.1f} GB" + (f" {c['tok_per_ms']:.1f} tok/ms"
                                           if c["tok_per_ms"] is not None else ""))
        if c.get("spread") and c["peak_gb"] is not None:  # the probe's own noise
            val += f" +-{50 * c['spread']:.1f} %"
        by_mode.setdefault(c["recompute"], []).append(f"{c['micro_batch']}{mark}: {val}")
    if plan.candidates:
        head += " | probes " + "; ".join(f"{r} " + ", ".join(v) for r, v in by_mode.items() if v)
    if not plan.fits:
        head += " | warning: above trainer.memory_budget_gb"
    return head


# ---------------------------------------------------------------------------- on the trainer


def probe_batch(data, n: int, vocab_size: int, seed: int) -> torch.Tensor:
    """Probe token ids, int64 ``(n, T)``: up to :data:`PROBE_DISTINCT_SEQUENCES` held-out
    sequences of ``data`` (``val_batches``) repeated to ``n`` rows; uniform random ids (seeded)
    when there is no validation split. Reads no training batch (the data position stays)."""
    rows, have = [], 0
    for ids_BT in data.val_batches():
        rows.append(ids_BT)
        have += ids_BT.shape[0]
        if have >= min(n, PROBE_DISTINCT_SEQUENCES):
            break
    if rows:
        ids_BT = torch.cat(rows)[:PROBE_DISTINCT_SEQUENCES]
    else:
        gen = torch.Generator().manual_seed(seed)
        ids_BT = torch.randint(0, vocab_size, (1, data.seq_len), generator=gen)
    reps = -(-n // ids_BT.shape[0])
    return ids_BT.repeat(reps, 1)[:n]


class ProbeRunner:
    """The device probe of a training-step driver (see the module docstring): a
    :class:`train.trainer.Trainer`, or any object with its probe calls (``device``,
    ``world_size``, ``set_recompute(mode)``, ``forward_backward(ids_BT)``, ``zero_grad()``,
    ``reduce(t, op)`` and optionally an FFN ``plan``; the benchmark's plain-transformers step).

    ``runner(candidate)`` switches the model to the candidate's recomputation (the planner sets
    the chosen one afterwards), runs one warm-up and ``timed_steps`` timed forward+backward
    micro-steps of ``candidate.micro_batch`` probe sequences (accumulating gradients, no
    optimizer step, no gradient all-reduce), sets the gradients to None and returns the
    :class:`Measurement`, reduced over ranks (the largest peak and time). The FFNs measure their
    dense backup per call during probes (``backup_rows = -1``; restored after).

    Args:
        trainer: the driver.
        ids_BT: the probe's token ids, int64 (N, T) with N >= the largest candidate; default
            :func:`probe_batch` of the trainer's data (one step's sequences of one rank).
        timed_steps: timed micro-steps per probe.
    """

    def __init__(self, trainer, ids_BT: torch.Tensor | None = None,
                 timed_steps: int = PROBE_TIMED_STEPS) -> None:
        self.tr, self.timed_steps = trainer, timed_steps
        if ids_BT is None:
            ids_BT = probe_batch(trainer.data, trainer.shape.batch_per_rank,
                                 trainer.cfg.model.vocab_size, trainer.cfg.trainer.seed)
        self.ids_BT = ids_BT

    def _micro_step(self, ids_BT: torch.Tensor) -> float:
        """One forward+backward (``Trainer.forward_backward``); its milliseconds (CUDA events
        on the GPU)."""
        tr = self.tr
        cuda = tr.device.type == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        tr.forward_backward(ids_BT)
        if not cuda:
            return (time.perf_counter() - t0) * 1e3
        end.record()
        end.synchronize()  # host sync: the probe's time
        return start.elapsed_time(end)

    def __call__(self, c: Candidate) -> Measurement:
        tr = self.tr
        cuda = tr.device.type == "cuda"
        tr.set_recompute(c.recompute)
        plan = getattr(tr, "plan", None)  # every backup measured per call; restored after
        profiling = plan.profiling() if plan is not None else contextlib.nullcontext()
        profiling.__enter__()
        ids_BT = self.ids_BT[:c.micro_batch].to(tr.device)
        if cuda:
            torch.cuda.synchronize(tr.device)
            torch.cuda.reset_peak_memory_stats(tr.device)
        times, oom = [], False
        try:
            for i in range(1 + self.timed_steps):
                ms = self._micro_step(ids_BT)
                if i:
                    times.append(ms)
        except torch.cuda.OutOfMemoryError:
            oom = True
        finally:
            tr.zero_grad()
            profiling.__exit__(None, None, None)
        if oom:  # the failed forward's graph, held by the FFNs' statistics
            release_failed_step(tr.device, mlps=getattr(tr, "mlps", ()))
        free_memory(tr.device)
        flag = torch.tensor([float(oom)], device=tr.device)
        peak = torch.cuda.max_memory_allocated(tr.device) / 2**30 if cuda else math.nan
        med = statistics.median(times) if times else math.nan
        spread = (max(times) - min(times)) / med if len(times) > 1 and med > 0 else 0.0
        vals = torch.tensor([peak, med, spread], dtype=torch.float64, device=tr.device)
        flag, vals = tr.reduce(flag, "max"), tr.reduce(vals, "max")
        if flag.item():  # host sync
            if tr.world_size > 1:
                raise MemoryError(
                    f"trainer.memory=auto: a probe of micro_batch {c.micro_batch}, recompute "
                    f"{c.recompute} ran out of memory on some rank; with several ranks the "
                    "planner cannot recover: set trainer.micro_batch and "
                    "trainer.grad_checkpointing.")
            return OOM
        peak_gb, ms, spread = vals.tolist()
        return Measurement(peak_gb, ms, spread)


INITIAL_PATH_SEQUENCES = 4  # probe sequences of the measuring forward (8192 tokens at T 2048)


def choose_initial_paths(trainer, ids_BT: torch.Tensor, *, force: bool = False) -> str | None:
    """``auto``'s first paths from the model's own sparsity, before the first plan is made.

    A fresh ``auto`` plan runs every FFN on ``dense`` until its first step has been measured, so
    a plan made at step 0 probes the dense step's memory and speed. That is right for a fresh
    ReLU model (~50 % of its units active) and wrong for one that is already sparse (weights
    from a checkpoint: ``model.init_from``, a bench model, a ReLUfied model): on one H200 the 2B
    default run at 80 GB planned micro-batch 4 from its dense probes where the sparse step fits
    8 and runs 1.6x faster (BENCHMARKS.md, "2B profile: outcome"). So, when the plan has seen no
    step: one training forward (no backward) of the first ``INITIAL_PATH_SEQUENCES`` sequences
    of ``ids_BT`` (B, T) with every dense backup measured, each layer's L0 and heavy-row fraction
    from it (averaged over ranks, so that every rank chooses alike), and the plan's chooser sets
    the paths (:meth:`twell.nn.plan.FFNPlan.choose_paths`; with no timings yet, the density
    rule). A resumed plan (its steps or the trainer's > 0) keeps its paths unless ``force``
    (the whole-model bench, whose bench model's plan state comes from a stage that trained
    dense).

    Args:
        trainer: the :class:`train.trainer.Trainer` (its model, FFN plan and accelerator).
        ids_BT: int64 token ids ``(B, T)`` (a :class:`ProbeRunner`'s batch); the first
            :data:`INITIAL_PATH_SEQUENCES` rows are used.
        force: choose on a plan that has seen steps (the bench).

    Returns:
        a log line naming how many layers start on ``ell``, or None when nothing was chosen
        (a resumed plan without ``force``, no layer that ``auto`` chooses).

    Raises:
        torch.cuda.OutOfMemoryError: the forward did not fit (whole layers checkpointed: it
            holds one layer's activations and each layer's input); the paths stay as they
            were, the recomputation is left at full (the caller sets its own).
    """
    tr, plan = trainer, trainer.plan
    resumed = plan.steps > 0 or tr.step > 0  # (a plan state of version 1 has no steps)
    if (resumed and not force) or not plan.auto_layers:
        return None
    ids = ids_BT[:INITIAL_PATH_SEQUENCES].to(tr.device)
    # whole layers checkpointed: the forward keeps only each layer's input, not a dense step's
    # activations (a setup that fits the smallest plan must not run out of memory here); every
    # caller sets the recomputation afterwards (the planner's choice, a probe's, a bench row's)
    tr.set_recompute("full")
    with plan.profiling():  # training forward, every backup measured
        vals = tr.ffn_densities(ids)
    l0_L, heavy_L = vals.tolist()  # host sync (setup: once)
    paths = plan.choose_paths(l0_L, heavy_L)  # after profiling(), which restores the paths
    ell = sum(p == "ell" for p in paths)
    return (f"ffn: {ell} of {len(paths)} layers start on ell (L0 {sum(l0_L) / len(l0_L):.1f} "
            f"over {ids.numel()} probe tokens)")


def free_memory(device) -> None:
    """Collect the last measurement's tensors and return cached blocks to the device (CUDA
    only: on the CPU memory is not measured and a full collection costs ~0.5 s). After an
    out-of-memory error the traceback's frames form reference cycles that hold the failed
    step's tensors until a collection; without it every later probe ran out of memory too
    (BENCHMARKS.md, "Call 3 outcome")."""
    if torch.device(device).type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def release_failed_step(device, *, optimizer=None, mlps: Iterable = ()) -> None:
    """Release what an attempt that ran out of memory still holds, before the next one (a
    probe, a bench row): the gradients (set to None), each FFN's last statistics (``mlps``:
    they hold the failed forward's graph, and through it the saved activations of every layer
    that ran, until the next forward replaces them layer by layer), the exception's frames (a
    collection: they form reference cycles) and, on CUDA, the allocator's cached blocks, and
    the peak statistics are reset (a training run keeps its interval's peak first:
    ``MetricsLogger.hold_peak``). Call it after the ``except`` block, not inside: there the
    exception and its traceback, and so every frame of the failed step, are still alive."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    for mlp in mlps:
        mlp.last_stats = None
    gc.collect()  # also on the CPU (free_memory skips it there): an error path, not a hot one
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def device_probe(trainer) -> Callable[[Candidate], Measurement] | None:
    """The probe the planner uses for ``trainer``: a :class:`ProbeRunner` on CUDA, None on other
    devices (nothing to measure peak memory with)."""
    return ProbeRunner(trainer) if trainer.device.type == "cuda" else None


class StepBatches:
    """Training batches (an iterator of ``(B, T)`` tensors) that keeps those of the current
    optimizer step until the next one begins, so that a step is redone from the same blocks at
    another micro-batch (:meth:`rewind`).

    Args:
        batches: the data module's ``train_batches()``.
        per_step: sequences one rank takes per optimizer step (global_batch / world size).
        step: returns the trainer's optimizer step count (recorded when a step's first batch is
            drawn, so that a step already applied is never redone).
    """

    def __init__(self, batches: Iterable[torch.Tensor], per_step: int,
                 step: Callable[[], int]) -> None:
        self.it, self.per_step, self.step = iter(batches), per_step, step
        self.drawn: list[torch.Tensor] = []
        self.n = 0  # sequences drawn for the current step
        self.replay: deque[torch.Tensor] = deque()
        self.step_at: int | None = None  # the trainer's step when the current step's draw began
        self.fresh = False

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        if self.n >= self.per_step:  # the previous step is complete: a new one begins
            self.drawn, self.n = [], 0
        if not self.drawn:
            self.step_at = self.step()
        if self.fresh and torch.cuda.is_available():
            torch.cuda.empty_cache()  # the failed attempt's blocks back to the device first
        self.fresh = False
        ids_BT = self.replay.popleft() if self.replay else next(self.it)
        self.drawn.append(ids_BT)
        self.n += ids_BT.shape[0]
        return ids_BT

    def rewind(self, micro_batch: int) -> bool:
        """Replay the current step's sequences as batches of ``micro_batch`` next; False (and
        nothing changes) unless the step was drawn whole and nothing is waiting for replay."""
        if self.n != self.per_step or self.replay or micro_batch > self.per_step:
            return False
        sizes = micro_batch_sizes(self.per_step, micro_batch)
        self.replay = deque(torch.cat(self.drawn).split(sizes))
        self.drawn, self.n, self.fresh = [], 0, True
        return True


class TrainerMemory:
    """What ``trainer.memory`` does for one trainer: its plan, the log line and record, and the
    out-of-memory step-down (:func:`plan_memory` builds it).

    Attributes:
        planner: the :class:`MemoryPlanner` (None: ``trainer.memory=off`` or nothing measured).
        plan: the current :class:`Plan` (None under ``trainer.memory=off``).
        line: the last log line (None under off).
        record: the plan as a dict for ``metrics.jsonl`` (``kind: memory``) and summary.json.
    """

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.planner: MemoryPlanner | None = None
        self.plan: Plan | None = None
        self.line: str | None = None
        self.record: dict | None = None
        self.probe: Callable[[Candidate], Measurement] | None = None
        self.replan_after_steps = REPLAN_STABLE_STEPS
        """Accepted steps with unchanged FFN paths before the one re-plan (:meth:`after_step`)."""
        self.paths_line: str | None = None  # auto's first paths (choose_initial_paths)
        self._batches: StepBatches | None = None
        self._replanned = False
        self._paths: list[str] | None = None
        self._stable = 0

    def report(self, print_: Callable[[str], None], write: Callable[[dict, str], None]) -> None:
        """Print auto's first FFN paths and the plan's line, and ``write`` its record
        (``kind: memory``); nothing under ``trainer.memory=off``."""
        if self.paths_line:
            print_(self.paths_line)
        if self.line:
            print_(self.line)
            write(self.record, "memory")

    def apply(self, plan: Plan) -> None:
        """Make the trainer train at ``plan`` (``Trainer.set_step_shape``: its accumulation,
        the data's micro-batch, the recomputation, the FFN plan's rows per call) and log it."""
        tr = self.trainer
        tr.set_step_shape(plan.micro_batch, plan.accum, plan.recompute)
        self.plan = plan
        self.line = describe(plan, tr.cfg.model.seq_len)
        self.record = {"step": tr.step, **asdict(plan)}

    def after_step(self) -> str | None:
        """Call after each accepted optimizer step: re-plans once, when the FFN paths have
        settled, and returns the log line of the re-plan (None otherwise).

        The first plan is made at step 0, where every FFN is dense (a fresh ReLU FFN has ~50 %
        of its units active); the ELL path's activations are smaller (ELL state at the capacity
        width instead of N x H tensors), so once ``auto`` has moved most layers there the step
        may fit a larger micro-batch or less recomputation. Re-plans when, for
        :attr:`replan_after_steps` accepted steps, the FFN plan's chosen paths
        (``FFNPlan.chosen_paths``, explorations left out) have not changed, at least
        :data:`REPLAN_ELL_SHARE` of the gated layers are on ``ell`` and their mean heavy-row
        fraction is at most :data:`REPLAN_HEAVY_FRACTION` (their dense backups, which grow with
        the heavy rows, have shrunk): :meth:`replan`. Never under ``trainer.memory=off`` or
        without a probe (no CUDA)."""
        tr = self.trainer
        if self._replanned or self.planner is None or self.probe is None:
            return None
        paths = tr.plan.chosen_paths
        if paths != self._paths:
            self._paths, self._stable = paths, 0
            return None
        self._stable += 1
        ell = [k for k, (p, m) in enumerate(zip(paths, tr.mlps)) if m.gated and p == "ell"]
        gated = sum(m.gated for m in tr.mlps)
        if self._stable < self.replan_after_steps or not gated or len(ell) < REPLAN_ELL_SHARE * gated:
            return None
        heavy = tr.plan.last_heavy
        if heavy and sum(heavy[k] for k in ell) / len(ell) > REPLAN_HEAVY_FRACTION:
            return None
        self._replanned = True
        return self.replan(f"{len(ell)} of {gated} FFN layers on ell")

    def replan(self, reason: str = "") -> str:
        """Plan again on the current model (a new :class:`MemoryPlanner` over the same probe,
        budget and user values; ``attention_ell`` joins the candidates when the planner chooses
        the recomputation) and adopt the fastest plan that fits if it is more than
        :data:`REPLAN_GAIN` faster than the current configuration measured now (the current one
        is probed too); else keep the current one. Returns the log line; ``record`` holds the
        plan kept or adopted. A probe that runs out of memory on some rank of several ends the
        re-plan (the current plan is kept)."""
        tr, old, first = self.trainer, self.plan, self.planner
        modes = first.modes
        if "attention" in modes and "attention_ell" not in modes:
            modes = tuple(r for r in RECOMPUTE_MODES if r in (*modes, "attention_ell"))
        planner = MemoryPlanner(
            self.probe, batch_per_rank=first.batch_per_rank, seq_len=first.seq_len,
            budget_gb=first.budget_gb, pending_gb=pending_optimizer_gb(tr.optimizer),
            micro_batch=first.user_micro, recompute=modes, min_probe_tokens=first.min_probe_tokens,
            below=first.below)
        where = f"step {tr.step}" + (f", {reason}" if reason else "")
        tr.metrics.hold_peak()  # the probes reset the device's peak counter, then so do we
        try:
            new = planner.choose()
            cur = Candidate(old.micro_batch, old.recompute)
            planner.measure(cur)
        except MemoryError as e:  # several ranks: a probe ran out of memory somewhere
            self.apply(old)
            return f"memory: re-plan at {where} abandoned ({e}); kept the current plan"
        now = planner.tok_per_ms(cur)
        better = (Candidate(new.micro_batch, new.recompute) != cur and new.fits and (
            not now > 0 or _num(new.tok_per_ms or math.nan) > (1 + REPLAN_GAIN) * now))
        if better:
            new.why = f"re-planned at {where}: {new.why}, {_round(now)} tok/ms before"
            chosen = new
        else:
            chosen = planner._plan(cur, f"re-planned at {where}: kept (fastest within "
                                        f"{REPLAN_GAIN:.0%})", planner.fits(cur))
        self.planner, planner.plan = planner, chosen
        self.apply(chosen)
        if tr.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(tr.device)  # the run's peaks, not the probes'
        return self.line

    def batches(self, batches: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
        """The training batches the loop should draw from: a :class:`StepBatches` over them
        under ``trainer.memory=auto`` (redo after out of memory), else ``batches`` as they are."""
        if self.plan is None:
            return batches
        tr = self.trainer
        self._batches = StepBatches(batches, tr.shape.batch_per_rank, lambda: tr.step)
        return self._batches

    def step_down(self) -> str | None:
        """Call inside ``except torch.cuda.OutOfMemoryError`` around ``trainer.train_step``:
        picks a lower plan, applies it, rewinds the step's batches and sets the gradients to
        None; returns the log line, or None when the error must propagate (``memory=off``, no
        plan lower, several ranks, the step's update already applied: the error came from the
        optimizer step or after it). Before the redo, after the ``except`` block, the caller
        releases what the failed attempt holds (:func:`release_failed_step`)."""
        tr = self.trainer
        if self.planner is None or tr.world_size > 1 or self._batches is None:
            return None
        # the update began (torch.optim in the traceback, or the trainer's mark: the L1
        # controller's update after it is not in torch.optim): a redo would apply it twice
        if (self._batches.step_at != tr.step or tr.update_began
                or _raised_in_optimizer(sys.exc_info()[2])):
            return None
        old = self.plan
        new = self.planner.step_down()
        if new is None or not self._batches.rewind(new.micro_batch):
            self.planner.plan = old
            return None
        tr.zero_grad()
        self.apply(new)
        return (f"step {tr.step + 1}: out of memory at micro_batch {old.micro_batch}, recompute "
                f"{old.recompute}; now micro_batch {new.micro_batch}, recompute {new.recompute}, "
                f"accumulation {new.accum}; redoing the step from the same batches")


def error_text(e: BaseException) -> str:
    """An error's message on one line, at most 160 characters (its type's name when empty):
    what an out-of-memory line keeps of the error, so that the error itself, and with its
    traceback every frame of the failed step, can go."""
    return " ".join(str(e).split())[:160] or type(e).__name__


def out_of_memory_line(why: str, *, device, step: int, saved: int, last_ckpt: str,
                       micro_batch: int, seq_len: int, planned: bool, advice: str) -> str:
    """The one line of an out-of-memory error (``why``: :func:`error_text`) in step
    ``step + 1`` that nothing stepped down from: where, why, which finished steps are in
    checkpoint ``last_ckpt`` (``saved``: its step, 0 for none) or lost, and what to lower
    (``planned``: ``trainer.memory=auto`` had a planner), then ``advice`` (how to resume)."""
    where = "the CPU" if device.type == "cpu" else str(device)
    steps = f"steps 1-{saved} are" if saved > 1 else "step 1 is"
    kept = (f"{steps} in checkpoint {last_ckpt}" if saved
            else "no step had finished" if not step else "no checkpoint was written")
    if saved < step:  # several ranks: no save in the middle of their collectives
        kept += f"; steps {saved + 1}-{step} are lost"
    step_down = ("trainer.memory=auto's step-down works on CUDA only" if device.type == "cpu"
                 else "trainer.memory=off takes them as set; auto steps down by itself"
                 if not planned else "trainer.memory=auto found nothing lower to step down to")
    return (f"out of memory on {where} in step {step + 1} ({why}); {kept}. Lower "
            f"trainer.micro_batch (now {micro_batch}) or model.seq_len ({seq_len}) "
            f"({step_down}), then {advice}")


def _raised_in_optimizer(tb) -> bool:
    """Did the exception pass through ``torch.optim`` (an optimizer step, maybe half applied)?"""
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        if "/torch/optim/" in name:
            return True
        tb = tb.tb_next
    return False


def plan_memory(trainer, probe: Callable[[Candidate], Measurement] | None = None
                ) -> TrainerMemory:
    """Plan ``trainer``'s micro-batch and recomputation (``trainer.memory=auto``) and apply it.

    Called once at the end of the trainer's setup (after a resume, so probes see the trained
    weights and the optimizer state). ``probe`` defaults to :func:`device_probe`; without one
    (no CUDA) nothing is measured (module docstring). Returns the :class:`TrainerMemory`; under
    ``trainer.memory=off`` it holds no plan and changes nothing.

    Raises:
        MemoryError: every probe ran out of memory.
    """
    tm = TrainerMemory(trainer)
    t = trainer.cfg.trainer
    if t.memory == "off":
        return tm
    per_rank = trainer.shape.batch_per_rank
    modes = recompute_choices(True if trainer.fsdp_recompute else t.grad_checkpointing,
                              t.checkpoint_ffn,
                              compile=t.compile)
    probe = probe if probe is not None else device_probe(trainer)
    if probe is None:
        micro = t.micro_batch or max(m for m in micro_batch_candidates(per_rank)
                                     if m <= CPU_MICRO_BATCH)
        tm.apply(Plan(micro, modes[0], -(-per_rank // micro), None, None, None,
                      "no CUDA device to measure on"))
        return tm
    budget = t.memory_budget_gb or device_budget_gb(trainer.device)
    if budget is None:
        raise ValueError("plan_memory: no budget; set trainer.memory_budget_gb (no CUDA device)")
    fused = trainer.fused_loss is not None  # a chunked loss: probes of >= one chunk of rows
    ids = getattr(probe, "ids_BT", None)  # a ProbeRunner's batch; else (tests) the same draw
    if ids is None and trainer.plan.steps == 0 and trainer.plan.auto_layers:
        ids = probe_batch(trainer.data, INITIAL_PATH_SEQUENCES, trainer.cfg.model.vocab_size,
                          t.seed)
    line = None if ids is None else choose_initial_paths(trainer, ids)  # already sparse: plan
    tm.paths_line = line  # printed before the plan's line (report)
    tm.probe = probe
    tm.planner = MemoryPlanner(
        probe, batch_per_rank=per_rank, seq_len=trainer.cfg.model.seq_len, budget_gb=budget,
        pending_gb=pending_optimizer_gb(trainer.optimizer), micro_batch=t.micro_batch,
        recompute=modes, min_probe_tokens=t.ce_chunk_rows if fused else 0,
        below=BELOW_FRACTION)
    tm.apply(tm.planner.choose())
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(trainer.device)  # the run's peaks, not the probes'
    return tm
