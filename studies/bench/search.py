"""The search: per FFN path and memory budget, the fastest micro-batch x recompute that fits,
from the memory planner's probes (``train.memory``: a few forward+backward steps per candidate,
a linear peak-memory model per recompute mode, one confirmation probe).

Budgets are cards: ``Budget(139)`` the H200 itself (its 140.4 GiB), ``Budget(80)`` an
H100-class card, emulated on the H200 with ``torch.cuda.set_per_process_memory_fraction``
while its rows are timed (:func:`emulated`). A candidate fits a budget when its predicted step
peak (probe peak + the optimizer state still to be allocated) is within the planner's budget
of that card (``train.memory.default_budget_gb``: less 8 %, at least 2 GiB), the rule a
training run applies to itself.

Peak memory does not depend on the budget, so one :class:`SharedProbe` serves every budget of a
path: each candidate is probed once, on the whole device. Recompute modes are tried from the
least recomputation up; a heavier mode is tried only while the lighter ones' largest fitting
micro-batch holds fewer than ``saturation_tokens`` tokens (:data:`SATURATION_TOKENS`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from train.memory import (
    BELOW_FRACTION,
    Candidate,
    Measurement,
    MemoryPlanner,
    Plan,
    choose_within_noise,
    default_budget_gb,
)
from train.recompute import RECOMPUTE_MODES

# A heavier recompute mode is probed only while the lighter modes fit fewer tokens than this:
# on one H200 going from micro-batch 8 to 16 (16,384 -> 32,768 tokens) without recomputation
# gained 3.8 % (1.5B plain transformers 33.8 -> 35.1 tok/ms) where full recomputation cost
# 1.27-1.32x (BENCHMARKS.md, "Memory planner"): beyond it a larger micro-batch bought by
# recomputation cannot win.
SATURATION_TOKENS = 16384


@dataclass(frozen=True)
class Budget:
    """A memory budget: a card of ``card_gb`` GiB (one rank).

    Raises:
        ValueError: ``card_gb`` not a finite number > 0.
    """

    card_gb: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.card_gb) and self.card_gb > 0):
            raise ValueError(f"a budget must be a card's memory in GiB > 0; got {self.card_gb}")

    @property
    def planner_gb(self) -> float:
        """GiB a step's predicted peak may reach (:func:`train.memory.default_budget_gb`)."""
        return default_budget_gb(self.card_gb)

    def fraction(self, total_gb: float) -> float:
        """The per-process memory fraction that makes a ``total_gb`` device this card (1 when
        the card is at least the device)."""
        return 1.0 if self.card_gb >= total_gb * 0.999 else self.card_gb / total_gb

    @property
    def label(self) -> str:
        return f"{self.card_gb:g}"


def parse_budgets(text: str) -> list[Budget]:
    """``"139,80"`` -> [Budget(139), Budget(80)] (order kept, repeats dropped).

    Raises:
        ValueError: an empty list or an entry that is not a number > 0 (named).
    """
    out: list[Budget] = []
    for piece in [p.strip() for p in text.split(",") if p.strip()]:
        try:
            b = Budget(float(piece))
        except ValueError:
            raise ValueError(f"--budgets {text!r}: {piece!r} is not a card memory in GiB "
                             "(e.g. 139,80)") from None
        if b not in out:
            out.append(b)
    if not out:
        raise ValueError(f"--budgets {text!r}: give at least one card memory in GiB (e.g. 139,80)")
    return out


def check_budgets_fit(budgets: list[Budget], device_gb: float) -> None:
    """Refuse a budget above the GPU's memory: the run would time the whole GPU and label the
    rows with the larger card (an H100's rows once came out labelled 139 GB). A budget up to
    2 % above ``device_gb`` is that card (an 80 GB H100 reports 79.2 GiB).

    Raises:
        ValueError: one line naming ``--budgets``, the budget and the GPU's GiB.
    """
    over = [b.label for b in budgets if b.card_gb > 1.02 * device_gb]
    if over:
        raise ValueError(f"--budgets {','.join(over)}: this GPU has {device_gb:.1f} GiB; a budget "
                         "emulates a card no larger than the GPU (e.g. --budgets 80 on an 80 GB "
                         "card)")


@contextmanager
def emulated(budget: Budget, device) -> Iterator[None]:
    """Within the block, the CUDA ``device`` allocates at most ``budget.card_gb`` GiB (an
    out-of-memory error beyond, as on that card); the whole device again after. No-op off CUDA.
    Cached blocks are returned first, so the cap applies to what is allocated from now on."""
    dev = torch.device(device)
    if dev.type != "cuda":
        yield
        return
    from train.memory import cuda_index

    dev = cuda_index(dev)
    total = torch.cuda.get_device_properties(dev).total_memory / 2**30
    frac = budget.fraction(total)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(frac, dev)
    try:
        yield
    finally:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, dev)


class SharedProbe:
    """A probe (``Candidate -> Measurement``) that runs each candidate once and keeps every
    measurement (:attr:`measured`) for the planners of all budgets and for the output."""

    def __init__(self, probe: Callable[[Candidate], Measurement]) -> None:
        self.probe = probe
        self.measured: dict[Candidate, Measurement] = {}

    def __call__(self, c: Candidate) -> Measurement:
        if c not in self.measured:
            self.measured[c] = self.probe(c)
        return self.measured[c]


@dataclass
class Choice:
    """The search's answer for one FFN path and budget.

    Attributes:
        ffn: the FFN path (``hf``, ``torch``, ``dense``, ``ell``, ``auto``).
        budget: the :class:`Budget`.
        micro_batch, recompute: the configuration (None: nothing fits).
        step_peak_gb: predicted peak GiB of a training step (probe + optimizer state to come).
        probe_tok_per_ms: forward+backward tokens/ms of its probe.
        why: how it was chosen (or why nothing fits).
        per_mode: per recompute mode tried, its fastest fitting micro-batch (None: none fits).
    """

    ffn: str
    budget: Budget
    micro_batch: int | None
    recompute: str | None
    step_peak_gb: float | None
    probe_tok_per_ms: float | None
    why: str
    per_mode: dict[str, int | None] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.micro_batch is not None

    @property
    def key(self) -> tuple:
        """What makes two choices the same timing: path, micro-batch, recompute."""
        return (self.ffn, self.micro_batch, self.recompute)


def search(probe: SharedProbe, *, ffn: str, budgets: list[Budget], batch_per_rank: int,
           seq_len: int, pending_gb: float, modes: tuple[str, ...], min_probe_tokens: int = 0,
           saturation_tokens: int = SATURATION_TOKENS) -> dict[Budget, Choice]:
    """The fastest fitting configuration of one FFN path for each budget (module docstring).

    Per budget and recompute mode (least recomputation first) a :class:`MemoryPlanner` of that
    mode alone finds its largest fitting micro-batch and races it against the candidate at
    :data:`train.memory.BELOW_FRACTION` of it, as the default run's planner does; among those
    the planner's rule chooses (:func:`train.memory.choose_within_noise`: the largest
    micro-batch within the probes' noise of the fastest in probe tokens/ms). Heavier modes
    stop once a lighter one fits ``saturation_tokens`` tokens (0: every mode is tried).

    Raises:
        ValueError: an unknown recompute mode or an empty ``modes``.
    """
    bad = [m for m in modes if m not in RECOMPUTE_MODES]
    if bad or not modes:
        raise ValueError(f"modes must be a non-empty tuple of {RECOMPUTE_MODES}; got {modes!r}")
    order = tuple(m for m in RECOMPUTE_MODES if m in modes)
    out = {}
    for b in budgets:
        fitting, per_mode = [], {}
        for r in order:
            planner = MemoryPlanner(probe, batch_per_rank=batch_per_rank, seq_len=seq_len,
                                    budget_gb=b.planner_gb, pending_gb=pending_gb,
                                    recompute=(r,), min_probe_tokens=min_probe_tokens,
                                    below=BELOW_FRACTION)
            plan = planner.choose()
            per_mode[r] = plan.micro_batch if plan.fits else None
            if not plan.fits:
                continue
            fitting.append((plan, planner))
            if saturation_tokens and plan.micro_batch * seq_len >= saturation_tokens:
                break
        out[b] = _best(ffn, b, fitting, per_mode)
    return out


def _best(ffn: str, b: Budget, fitting: list, per_mode: dict) -> Choice:
    """``b``'s choice among ``fitting``: ``(plan, the MemoryPlanner that made it)`` of each
    recompute mode that fits, each with its probe's tokens/ms and spread as that planner holds
    them (:meth:`train.memory.MemoryPlanner.spread`)."""
    if not fitting:
        return Choice(ffn, b, None, None, None, None,
                      f"nothing fits {b.planner_gb:.1f} GiB (of a {b.label} GiB card)", per_mode)

    def option(plan: Plan, planner: MemoryPlanner):
        c = Candidate(plan.micro_batch, plan.recompute)
        return c, math.nan if plan.tok_per_ms is None else plan.tok_per_ms, planner.spread(c)

    i, note = choose_within_noise([option(*f) for f in fitting])
    plan = fitting[i][0]
    tried = ", ".join(f"{r} {m if m is not None else 'none fits'}" for r, m in per_mode.items())
    fits = f"{b.planner_gb:.1f} GiB (per mode: {tried})"
    return Choice(ffn, b, plan.micro_batch, plan.recompute, plan.peak_gb, plan.tok_per_ms,
                  f"{note}; fits {fits}" if note else f"fastest that fits {fits}", per_mode)


def faster(a: Choice | None, b: Choice | None) -> Choice | None:
    """The choice with more probe tokens/ms (``a`` on a tie; one that fits over one that does
    not)."""
    if a is None or not a.fits:
        return b if b is not None and b.fits else a
    if b is None or not b.fits:
        return a
    return b if (b.probe_tok_per_ms or 0.0) > (a.probe_tok_per_ms or 0.0) else a


@dataclass(frozen=True)
class FakeMemory:
    """A made-up peak-memory model for runs without CUDA (``--smoke``): the probe's time is
    measured, its peak is ``static_gb + factor[ffn] * per_sequence_gb[recompute] * micro_batch``
    GiB, so the search and its budgets run end to end on the CPU. The defaults make the two
    default budgets (139 and 80) choose differently and need recomputation for some paths."""

    static_gb: float = 30.0
    per_sequence_gb: tuple[tuple[str, float], ...] = (("none", 14.0), ("attention", 8.0),
                                                      ("full", 4.0), ("attention_ell", 8.0))
    factor: tuple[tuple[str, float], ...] = (("hf", 1.2), ("liger", 1.0), ("compile", 1.1),
                                             ("torch", 1.0), ("dense", 1.0),
                                             ("ell", 0.7), ("auto", 0.75))

    def peak_gb(self, ffn: str, c: Candidate) -> float:
        return self.static_gb + dict(self.factor)[ffn] * dict(self.per_sequence_gb)[
            c.recompute] * c.micro_batch

    def probe(self, ffn: str, timed: Callable[[Candidate], Measurement]
              ) -> Callable[[Candidate], Measurement]:
        """``timed``'s time (and spread) with this model's peak for ``ffn``."""
        def run(c: Candidate) -> Measurement:
            m = timed(c)
            return Measurement(self.peak_gb(ffn, c), m.ms, m.spread)
        return run


__all__ = [
    "SATURATION_TOKENS",
    "Budget",
    "Choice",
    "FakeMemory",
    "SharedProbe",
    "check_budgets_fit",
    "emulated",
    "faster",
    "parse_budgets",
    "search",
]
