"""What the FFN plan decides an optimizer step from (:class:`StepStats`: per-layer heavy rows,
L0 sums and active-unit counts, device tensors during the step, host lists after its one sync)
and its verdict (:class:`StepOutcome`); the protocol itself: :mod:`twell.nn.plan`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def host_list(v) -> list[float]:
    """A (L,) device tensor or a host sequence as a list of floats (a device tensor: a host
    sync)."""
    return v.tolist() if isinstance(v, torch.Tensor) else [float(x) for x in v]


@dataclass
class StepStats:
    """The per-layer statistics of one optimizer step that :meth:`FFNPlan.end_step` decides
    from: device tensors while the step runs, host lists after the step's one sync.

    Attributes:
        heavy_max_L: (L,) most heavy rows (tokens above the ELL capacity) of any single FFN call
            of the step (max over micro-batches and ranks).
        nnz_sum_L: (L,) active units summed over the step's tokens (sum over ranks).
        heavy_sum_L: (L,) heavy rows summed over the step's tokens (sum over ranks).
        rows_per_call: token rows of one FFN call (one micro-batch of one rank).
        tokens: FFN tokens of the step over all ranks.
        sequences_per_call: sequences of one FFN call (each one's first token is a heavy row:
            part of the capacity floor); 0 = unknown.
        active_LH: (L, H) int device tensor, tokens in which each unit was active over the step
            (sum over ranks once reduced), or None; stays on the device (the hot units' top-k,
            the dead-neuron tracker).
        hot_over_L: (L,) units above each layer's hot threshold
            (``policy.hot_unit_fraction * tokens``), set by :meth:`FFNPlan.count_hot_units`
            (device, then host after the sync), or None.
    """

    heavy_max_L: torch.Tensor | list[float]
    nnz_sum_L: torch.Tensor | list[float]
    heavy_sum_L: torch.Tensor | list[float]
    rows_per_call: int
    tokens: int
    sequences_per_call: int = 0
    active_LH: torch.Tensor | None = None
    hot_over_L: torch.Tensor | list[float] | None = None

    def reduced(self, reduce: Callable[[torch.Tensor, str], torch.Tensor]) -> StepStats:
        """Reduced over ranks with ``reduce(tensor, "max" | "sum")`` (e.g. accelerate's);
        ``active_LH`` summed too. Reduce before :meth:`FFNPlan.count_hot_units`."""
        active = None if self.active_LH is None else reduce(self.active_LH, "sum")
        return dataclasses.replace(self, heavy_max_L=reduce(self.heavy_max_L, "max"),
                                   nnz_sum_L=reduce(self.nnz_sum_L, "sum"),
                                   heavy_sum_L=reduce(self.heavy_sum_L, "sum"), active_LH=active)

    def packed(self) -> torch.Tensor:
        """(3 L,) the device tensors in one (4 L with ``hot_over_L``), for the caller's single
        host read."""
        parts = [self.heavy_max_L, self.nnz_sum_L, self.heavy_sum_L]
        if self.hot_over_L is not None:
            parts.append(self.hot_over_L.to(self.heavy_max_L.dtype))
        return torch.cat(parts)

    def unpacked(self, values: Sequence[float]) -> StepStats:
        """The host copy from ``packed().tolist()`` (``values``, 3 L floats, 4 L with
        ``hot_over_L``); ``active_LH`` stays the device tensor.

        Raises:
            ValueError: ``values`` is not 3 L (4 L) long.
        """
        n = len(self.heavy_max_L)
        parts = 3 if self.hot_over_L is None else 4
        if len(values) != parts * n:
            raise ValueError(f"StepStats.unpacked needs {parts} L values (L = {n}); got "
                             f"{len(values)}")
        v = list(values)
        return dataclasses.replace(self, heavy_max_L=v[:n], nnz_sum_L=v[n:2 * n],
                                   heavy_sum_L=v[2 * n:3 * n],
                                   hot_over_L=None if parts == 3 else v[3 * n:])


@dataclass(frozen=True)
class StepOutcome:
    """:meth:`FFNPlan.end_step`'s verdict on the step.

    Attributes:
        redo: layers (indices) whose heavy rows exceeded their no-sync dense-backup capacity;
            their results are wrong: discard the step's gradients and run it again. Empty: the
            step is accepted.
    """

    redo: tuple[int, ...] = ()

    @property
    def accepted(self) -> bool:
        return not self.redo


__all__ = ["StepOutcome", "StepStats", "host_list"]
