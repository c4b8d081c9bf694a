"""Measured path choice of the inference ``auto`` mode: time TwELL and dense, take the faster.

Per layer (one :class:`MeasuredChoice` in each ``twell.ops.ffn.TwELLState``) and per row-count
bucket (token rows in ``[2^(b-1), 2^b)``), the layer's first real calls alternate between the
two paths: one untimed warm-up call each (its time includes Triton's compilation), then
``policy.infer_timed_calls`` timed calls each. Times are read without blocking (CUDA events
polled on later calls), so measuring adds no host synchronisation; until every timed call has
landed, the density rule (:meth:`twell.policy.FFNPolicy.infer_dense`) picks. The bucket then
keeps the path with the lower median, TwELL only when it is faster than dense by more than
``policy.infer_twell_margin`` (so it is never slower than dense beyond the timing noise), and
is timed again when the layer's measured density moves by more than
``policy.infer_remeasure_factor`` from the density at the choice.

Both paths are exact, so the calls that measure return correct results; the cost of measuring
is the slower path's time on a few calls per layer and bucket.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from twell.policy import FFNPolicy

PATHS = ("twell", "dense")


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
        warm: paths whose untimed warm-up call ran.
        pending: (path, timer handle) of timed calls not landed yet.
        choice: "twell" / "dense" once decided, else None.
        density: the layer's measured density when the choice was made (None: not known yet).
        seen_density: the latest density passed in (becomes ``density`` at the choice).
    """

    samples: dict = field(default_factory=lambda: {p: [] for p in PATHS})
    issued: dict = field(default_factory=lambda: {p: 0 for p in PATHS})
    warm: set = field(default_factory=set)
    pending: list = field(default_factory=list)
    choice: str | None = None
    density: float | None = None
    seen_density: float | None = None

    def medians(self) -> dict:
        """path -> median ms of the landed timed calls (paths with none left out)."""
        return {p: statistics.median(v) for p, v in self.samples.items() if v}

    def restart(self) -> None:
        """Forget the times and the choice (the warm-up calls stay done)."""
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


class MeasuredChoice:
    """Per-layer measured choice between TwELL and dense for inference ``auto`` (see the module
    docstring). One per ``TwELLState``; never global.

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

    def begin(self, x: torch.Tensor, n_rows: int, density: float | None,
              policy: FFNPolicy) -> tuple[str | None, object | None]:
        """The path of one call: ``(path, token)``. path None = measuring cannot decide this
        call (no timer, ``policy.infer_measure`` off, or timed calls still in flight): use the
        density rule. token not None = this call is timed: pass it to :meth:`end` after the
        path has been queued."""
        timer = self._timer_for(x)
        if timer is None or not policy.infer_measure:
            return None, None
        b = self.buckets.setdefault(row_bucket(n_rows), BucketTimes())
        if density is not None:
            b.seen_density = density
        self._land(b, timer, policy)
        if b.choice is not None:
            if b.density is None:
                b.density = density
            if not drifted(b.density, density, policy.infer_remeasure_factor):
                return b.choice, None
            b.restart()
        path = min(PATHS, key=lambda p: b.issued[p])  # alternate; a tie goes to TwELL first
        if path not in b.warm:
            b.warm.add(path)
            return path, None
        if b.issued[path] >= policy.infer_timed_calls:
            return None, None  # every timed call issued; waiting for them to land
        b.issued[path] += 1
        return path, (b, path, timer.start(path))

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
        if b.choice is None and all(len(b.samples[p]) >= need for p in PATHS):
            med = b.medians()
            fast = med["twell"] < (1.0 - policy.infer_twell_margin) * med["dense"]
            b.choice = "twell" if fast else "dense"
            b.density = b.seen_density

    def choices(self) -> dict:
        """bucket -> (choice or None, {path: median ms}): what was measured (for reports)."""
        return {k: (b.choice, b.medians()) for k, b in sorted(self.buckets.items())}


__all__ = ["BucketTimes", "CudaEventTimer", "MeasuredChoice", "drifted", "row_bucket"]
