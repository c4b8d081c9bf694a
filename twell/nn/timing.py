"""Timing one FFN layer's training calls inside real training steps, with no extra host sync.

Shape legend: N tokens, D model width.

A :class:`LayerTimer` wraps a layer's training forward (``SparseGatedMLP`` calls
:meth:`LayerTimer.run` when its :class:`twell.nn.plan.LayerPlan` carries one) and marks the
backward with two identity autograd nodes: one on the FFN's output (its gradient arriving: the
FFN's backward starts) and one on its input (the input's gradient leaving: it ends). A clock
records a start and a stop around each; on CUDA (:class:`twell.ops.auto.CudaEventTimer`) these
are events queued on the stream, read only after the step's own host sync, so timing adds no
sync. One *sample* is one micro-step's FFN time of the layer: every forward since the previous
backward plus that backward (so under full recomputation, where the layer's forward runs again
inside the backward, both forwards count: what the path costs in that mode; the backward's time
then starts after the replay, which also replays the layer's attention).

The identity nodes pass the gradients through unchanged (bitwise), so a timed step trains as an
untimed one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from twell.ops.auto import CudaEventTimer

# micro-steps timed per layer and optimizer step (the first ones): enough for a median (the
# chooser needs 3), and at 32 micro-steps per step 8x fewer CUDA events to record and read
CALLS_PER_STEP = 4


class _BackwardStart(torch.autograd.Function):
    """Identity on the FFN's output; its backward (the output's gradient has arrived) starts the
    layer's backward timing."""

    @staticmethod
    def forward(ctx, y, timer, clock, path):
        ctx.timer, ctx.clock, ctx.path = timer, clock, path
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        ctx.timer.open_backward(ctx.clock, ctx.path)
        return dy, None, None, None


class _BackwardEnd(torch.autograd.Function):
    """Identity on the FFN's input; its backward (the input's gradient is complete) stops the
    layer's backward timing."""

    @staticmethod
    def forward(ctx, x, timer):
        ctx.timer = timer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        ctx.timer.close_backward()
        return dx, None


class LayerTimer:
    """Records one FFN layer's training calls within an optimizer step.

    Args:
        layer: the layer's index (passed to the clock's ``start`` in the key
            ``(layer, path, "fwd" | "bwd")``).
        clock: an object with ``start(key) -> token``, ``stop(token) -> handle`` and
            ``poll(handle) -> ms or None`` (the interface of
            :class:`twell.ops.auto.CudaEventTimer`; tests inject a deterministic one). None: a
            :class:`CudaEventTimer` for CUDA inputs, nothing timed on other devices.
        calls_per_step: micro-steps timed between two :meth:`clear` (the first ones; the rest
            run untimed).

    Attributes:
        events: ``("fwd" | "bwd", clock, handle)`` in the order recorded since :meth:`clear`.
    """

    def __init__(self, layer: int, clock=None, calls_per_step: int = CALLS_PER_STEP) -> None:
        self.layer, self.clock, self.calls_per_step = layer, clock, calls_per_step
        self.events: list[tuple[str, object, object]] = []
        self._closed = 0  # backwards recorded since clear()
        self._open: tuple | None = None  # (clock, token, path) of a running backward
        self._cuda: CudaEventTimer | None = None

    def _clock_for(self, x: torch.Tensor):
        if self.clock is not None:
            return self.clock
        if x.is_cuda:
            if self._cuda is None:
                self._cuda = CudaEventTimer()
            return self._cuda
        return None

    def run(self, path: str, x_ND: torch.Tensor, op: Callable[[torch.Tensor], tuple]) -> tuple:
        """``op(x_ND)`` (the layer's training call on ``path``, returning ``(y_ND, stats)``), timed:
        forward between a start and a stop (the stop also when ``op`` raises, e.g. a checkpoint's
        recomputation stopping early), backward between the identity nodes on y and x. Untimed
        (``op(x_ND)`` as it is) when there is no clock for the device."""
        clock = self._clock_for(x_ND)
        # enough micro-steps timed (a replay inside a timed backward still counts: _open)
        if clock is None or (self._open is None and self._closed >= self.calls_per_step):
            return op(x_ND)
        token = clock.start((self.layer, path, "fwd"))
        try:
            x_in = _BackwardEnd.apply(x_ND, self) if x_ND.requires_grad else x_ND
            y_ND, stats = op(x_in)
        finally:
            self.events.append(("fwd", clock, clock.stop(token)))
            if self._open is not None:  # a recomputation inside this layer's backward (full
                # checkpointing replays the whole decoder layer, attention first): the
                # backward's time starts after it, the replayed FFN forward counts as a forward
                self.open_backward(self._open[0], self._open[2])
        if y_ND.requires_grad and x_ND.requires_grad:
            y_ND = _BackwardStart.apply(y_ND, self, clock, path)
        return y_ND, stats

    def open_backward(self, clock, path: str) -> None:
        """The FFN's backward starts (called by the identity node on its output)."""
        self._open = (clock, clock.start((self.layer, path, "bwd")), path)

    def close_backward(self) -> None:
        """The FFN's backward ends (called by the identity node on its input)."""
        if self._open is not None:
            clock, token, _ = self._open
            self._open = None
            self._closed += 1
            self.events.append(("bwd", clock, clock.stop(token)))

    def samples(self) -> list[float]:
        """Milliseconds of each complete micro-step recorded since :meth:`clear`: the forwards
        since the previous backward plus that backward. Reads the clock's handles (on CUDA:
        after the step's host sync they have all landed; one that has not drops its sample);
        forwards with no backward after them are left out."""
        out: list[float] = []
        fwd, ok = 0.0, True
        for kind, clock, handle in self.events:
            ms = clock.poll(handle)
            ok = ok and ms is not None
            if kind == "fwd":
                fwd += float(ms or 0.0)
                continue
            if ok:
                out.append(fwd + float(ms))
            fwd, ok = 0.0, True
        return out

    def clear(self) -> None:
        """Forget what was recorded (a new optimizer step, or an attempt that is discarded)."""
        self.events.clear()
        self._open, self._closed = None, 0


__all__ = ["LayerTimer"]
