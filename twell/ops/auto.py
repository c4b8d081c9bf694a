"""Measured path choice of the inference ``auto`` mode: time TwELL, the hybrid ELL forward and
dense, take the fastest.

The candidates (:data:`PATHS`, a call may restrict them: :func:`candidates`):

* ``"twell"``: cuBLAS gate GEMM + Triton pack + the TwELL consumer (``twell.ops.ffn``).
* ``"ell"``: the training op's hybrid ELL layout, forward alone
  (``twell.ops.ffn_train.ell_ffn_forward``: gate GEMM, compaction, SDDMM + SpMM of the light
  rows, dense backup of the heavy rows; arXiv 2603.23198, hybrid ELL layout). Gated FFNs only,
  and only with ``policy.infer_ell``: its first call of a bucket synchronises the host (the
  heavy-row count sizes its dense backup), later ones run the op's exact no-sync mode with a
  capacity from the recorded counts (``twell.ops.ffn._ell``). Its no-sync forward beat TwELL
  on two of three recorded layers of a 2B model and on i.i.d. rows at 0.3-3 % (one H200,
  M 16384; BENCHMARKS.md, "Seventh session of 2026-12-06"), markedly on the densest layer
  (3 %: 1.11x of dense where TwELL ran 0.34x), and lost 1.76x to 1.79x at 0.24 %.
* ``"dense"``: cuBLAS.

Per layer (one :class:`MeasuredChoice` in each ``twell.ops.ffn.TwELLState``) and per row-count
bucket (token rows in ``[2^(b-1), 2^b)``), the layer's first real calls alternate between the
candidates: untimed warm-up calls (:data:`WARMUP_CALLS`: one each, two for ``"ell"``, whose
first call measures its heavy-row count and whose second is the first of its no-sync mode; their
times include Triton's compilation and that mode switch), then ``policy.infer_timed_calls``
timed calls each. Times are read without blocking (CUDA events polled on later calls), so
measuring adds no host synchronisation of its own; until every timed
call has landed, the density rule (:meth:`twell.policy.FFNPolicy.infer_dense`) picks TwELL or
dense (never ``ell``: it is only ever chosen by measurement). The bucket then keeps the sparse
candidate, TwELL, or ELL when its median is below TwELL's by more than
``policy.infer_twell_margin`` (ELL's host issues ~0.85-0.96 ms of launches a call on an H200,
about its GPU time: host time that its CUDA-event time does not show), if it is faster than
dense's median by more than that margin (so ``auto`` is never slower than dense beyond the
timing noise), else dense. The bucket is timed again when the layer's measured density moves
by more than ``policy.infer_remeasure_factor`` from the density at the choice, and decided
again when a call's candidates differ from those it was decided among (a policy change: the
times of the candidates still offered are kept, unless the density has moved as above since
the choice: then every candidate is timed again).

Every path is exact, so the calls that measure return correct results; the cost of measuring
is the slower paths' time on a few calls per layer and bucket.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from twell.policy import FFNPolicy

PATHS = ("twell", "ell", "dense")
SPARSE_PATHS = ("twell", "ell")  # TwELL first: ELL must beat it by the margin (host-bound risk)
# untimed calls a path gets before its timed ones: the ELL forward's first call measures (one host
# sync; the count lands at once) and its second is the first no-sync call, so no timed call holds
# that sync or a compilation (with one warm-up, `auto` timed it at 2.1 ms where the op ran ~1.0)
WARMUP_CALLS = {"twell": 1, "ell": 2, "dense": 1}


def candidates(gated: bool, policy: FFNPolicy) -> tuple[str, ...]:
    """The paths a call may time and choose: ``"ell"`` only for a gated FFN (the hybrid ELL op
    has no non-gated form) with ``policy.infer_ell`` on; ``"twell"`` and ``"dense"`` always."""
    return PATHS if gated and policy.infer_ell else ("twell", "dense")


class CudaEventTimer:
    """Times the GPU work queued between ``start`` and ``stop`` with CUDA events; ``poll``
    never blocks. The timer interface of :class:`MeasuredChoice` (a test injects another)."""

    def start(self, path: str):
        """Record a start event (``path`` names what is timed; unused here)."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, token):
        """Record the end event; returns the handle ``poll`` reads."""
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return token, end

    def poll(self, handle) -> float | None:
        """Milliseconds between the two events, or None while the GPU has not reached the end."""
        start, end = handle
        return start.elapsed_time(end) if end.query() else None


@dataclass
class BucketTimes:
    """What one row-count bucket measured and chose.

    Attributes:
        samples: path -> landed timed calls (ms).
        issued: path -> timed calls started (landed or not).
        warm: path -> untimed warm-up calls run (:data:`WARMUP_CALLS` each).
        pending: (path, timer handle) of timed calls not landed yet.
        candidates: the paths of the latest call (:func:`candidates`), those the choice is
            made among.
        choice: "twell" / "ell" / "dense" once decided, else None.
        density: the layer's measured density when the choice was made (None: not known yet).
        seen_density: the latest density passed in (becomes ``density`` at the choice).
    """

    samples: dict = field(default_factory=lambda: {p: [] for p in PATHS})
    issued: dict = field(default_factory=lambda: {p: 0 for p in PATHS})
    warm: dict = field(default_factory=lambda: {p: 0 for p in PATHS})
    pending: list = field(default_factory=list)
    candidates: tuple = PATHS
    choice: str | None = None
    density: float | None = None
    seen_density: float | None = None

    def medians(self) -> dict:
        """path -> median ms of the landed timed calls (paths with none left out)."""
        return {p: statistics.median(v) for p, v in self.samples.items() if v}

    def restart(self) -> None:
        """Forget the times and the choice. The warm-up calls stay done, but for one ELL call:
        the ELL path's count (its backup's capacity) is of the old density, so its next call
        may measure (a host sync); that call is untimed and lands the new count."""
        self.warm["ell"] = min(self.warm["ell"], WARMUP_CALLS["ell"] - 1)
        self.samples = {p: [] for p in PATHS}
        self.issued = {p: 0 for p in PATHS}
        self.pending = []
        self.choice = self.density = None


def row_bucket(n_rows: int) -> int:
    """Bucket of a call with ``n_rows`` token rows: b with 2^(b-1) <= n_rows < 2^b (0 for 0)."""
    return max(int(n_rows), 0).bit_length()


def drifted(before: float | None, now: float | None, factor: float) -> bool:
    """True when two densities differ by more than ``factor`` (either way); False if unknown.
    Densities below 1e-6 count as 1e-6 (a layer at zero does not re-measure on every call)."""
    if before is None or now is None:
        return False
    lo, hi = sorted((max(before, 1e-6), max(now, 1e-6)))
    return hi > factor * lo


def choose(med: dict, paths: tuple, margin: float) -> str:
    """The decision of a bucket from its medians (path -> ms, every one of ``paths`` present):
    the sparse path (TwELL, or the ELL forward only when its median is below ``(1 - margin)`` x
    TwELL's: its host launches take about its GPU time, which its CUDA-event time does not
    count) when it is below ``(1 - margin)`` x dense's
    median, else ``"dense"``."""
    sparse = [p for p in SPARSE_PATHS if p in paths]
    best = sparse[0]
    if len(sparse) > 1 and med["ell"] < (1.0 - margin) * med["twell"]:
        best = "ell"
    return best if med[best] < (1.0 - margin) * med["dense"] else "dense"


class MeasuredChoice:
    """Per-layer measured choice among TwELL, the hybrid ELL forward and dense for inference
    ``auto`` (see the module docstring). One per ``TwELLState``; never global.

    Args:
        timer: an object with ``start(path) -> token``, ``stop(token) -> handle`` and
            ``poll(handle) -> ms or None`` (never blocking). None: :class:`CudaEventTimer` for
            CUDA tensors, and no measurement on other devices (the density rule decides).
    """

    def __init__(self, timer=None) -> None:
        self.timer = timer
        self.buckets: dict[int, BucketTimes] = {}
        self._cuda_timer: CudaEventTimer | None = None

    def _timer_for(self, x: torch.Tensor):
        if self.timer is not None:
            return self.timer
        if x.is_cuda:
            if self._cuda_timer is None:
                self._cuda_timer = CudaEventTimer()
            return self._cuda_timer
        return None

    def begin(self, x: torch.Tensor, n_rows: int, density: float | None, policy: FFNPolicy,
              paths: tuple[str, ...] = PATHS) -> tuple[str | None, object | None]:
        """The path of one call: ``(path, token)``. path None = measuring cannot decide this
        call (no timer, ``policy.infer_measure`` off, or timed calls still in flight): use the
        density rule. token not None = this call is timed: pass it to :meth:`end` after the
        path has been queued. ``paths``: this call's candidates (:func:`candidates`; a subset
        of :data:`PATHS` holding ``"twell"`` and ``"dense"``).

        Raises:
            ValueError: ``paths`` is not such a subset.
        """
        if not ({"twell", "dense"} <= set(paths) <= set(PATHS)):
            raise ValueError(f"MeasuredChoice.begin: paths must be a subset of {PATHS} holding "
                             f"'twell' and 'dense'; got {paths!r}")
        timer = self._timer_for(x)
        if timer is None or not policy.infer_measure:
            return None, None
        b = self.buckets.setdefault(row_bucket(n_rows), BucketTimes())
        if density is not None:
            b.seen_density = density
        paths = tuple(p for p in PATHS if p in paths)  # PATHS' order: the alternation's
        if paths != b.candidates:  # another candidate set: decide again among these
            b.candidates = paths
            if b.choice is not None and drifted(b.density, density,
                                                policy.infer_remeasure_factor):
                b.restart()  # the kept times are of another density: time them all again
            b.choice = None
        self._land(b, timer, policy)
        if b.choice is not None:
            if b.density is None:
                b.density = density
            if not drifted(b.density, density, policy.infer_remeasure_factor):
                return b.choice, None
            b.restart()
        path = min(paths, key=lambda p: b.issued[p])  # alternate; a tie goes to PATHS' order
        if b.warm[path] < WARMUP_CALLS[path]:
            b.warm[path] += 1
            return path, None
        if b.issued[path] >= policy.infer_timed_calls:
            return None, None  # every timed call issued; waiting for them to land
        b.issued[path] += 1
        return path, (b, path, timer.start(path))

    def cancel(self, token) -> None:
        """Forget the timed call opened by :meth:`begin` whose path raised before :meth:`end`
        (no-op for a None token): it is issued again, so the bucket can still decide."""
        if token is None:
            return
        b, path, _ = token
        b.issued[path] = max(b.issued[path] - 1, 0)

    def end(self, token, policy: FFNPolicy) -> None:
        """Close the timed call opened by :meth:`begin` (no-op for a None token)."""
        if token is None:
            return
        b, path, t = token
        timer = self.timer if self.timer is not None else self._cuda_timer
        b.pending.append((path, timer.stop(t)))
        self._land(b, timer, policy)

    def _land(self, b: BucketTimes, timer, policy: FFNPolicy) -> None:
        still = []
        for path, handle in b.pending:
            ms = timer.poll(handle)
            if ms is None:
                still.append((path, handle))
            else:
                b.samples[path].append(float(ms))
        b.pending = still
        need = policy.infer_timed_calls
        if b.choice is None and all(len(b.samples[p]) >= need for p in b.candidates):
            b.choice = choose(b.medians(), b.candidates, policy.infer_twell_margin)
            b.density = b.seen_density

    def choices(self) -> dict:
        """bucket -> (choice or None, {path: median ms}): what was measured among the bucket's
        current candidates (for reports; times kept for a path no longer offered are left out,
        since the choice was not made among them)."""
        return {k: (b.choice, {p: m for p, m in b.medians().items() if p in b.candidates})
                for k, b in sorted(self.buckets.items())}


__all__ = ["PATHS", "SPARSE_PATHS", "WARMUP_CALLS", "BucketTimes", "CudaEventTimer",
           "MeasuredChoice", "candidates", "choose", "drifted", "row_bucket"]
