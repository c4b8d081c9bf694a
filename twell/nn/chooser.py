"""``auto``'s per-layer choice of a training path (``ell`` or ``dense``), made after every
accepted optimizer step by the plan (:meth:`twell.nn.plan.FFNPlan.choose_paths`): what a chooser
is told about a layer (:class:`LayerMeasure`), the density rule (:func:`density_rule`), and the
default chooser, which times both paths on the layer's own activations
(:class:`MeasuredPathChooser`). The paper picks the path by a density threshold (arXiv
2603.23198, "Hybrid (training)"); the measured choice is ours.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from twell.policy import FFNPolicy

MEASURED_PATHS = ("ell", "dense")  # what the measured chooser compares
SAMPLES_KEPT = 16  # timed calls kept per layer and path (the newest)
EXPLORE_MAX_STEPS = 8  # an exploration that gathered too few timings ends after this many steps


@dataclass(frozen=True)
class LayerMeasure:
    """What a path chooser knows about one layer after an optimizer step (host values).

    Attributes:
        layer: index in the plan (layer order).
        l0: mean active units per token over the step's tokens.
        heavy_fraction: tokens with more active units than the ELL capacity / tokens.
        width: H, the layer's FFN width.
        gated: the layer has ``gate_proj`` (the ``dense`` and ``ell`` paths need it).
        policy: the layer's :class:`twell.policy.FFNPolicy`.
        path: the training path the step ran on ("" unknown).
        samples_ms: the step's timed calls of the layer on ``path`` (ms per micro-step:
            forward(s) + backward, :class:`twell.nn.timing.LayerTimer`); empty when untimed.
        step: accepted optimizer steps so far, this one included (the exploration schedule).
        num_layers: L, layers in the plan (spreads the explorations over the layers).
    """

    layer: int
    l0: float
    heavy_fraction: float
    width: int
    gated: bool
    policy: FFNPolicy
    path: str = ""
    samples_ms: tuple[float, ...] = ()
    step: int = 0
    num_layers: int = 1


PathChooser = Callable[[LayerMeasure], str]
"""``auto``'s choice for one layer: a :class:`LayerMeasure` -> ``"ell"`` or ``"dense"`` (or
``"torch"``). A chooser may also have ``measures = True`` (the plan then times the layer's calls
and passes them in ``samples_ms``), ``choice(layer)`` (its choice without explorations),
``rescale(ratio)`` (the calls changed size) and ``state_dict`` / ``load_state_dict`` (plain JSON):
:class:`MeasuredPathChooser` has all four."""


def density_rule(m: LayerMeasure) -> str:
    """The default chooser: :meth:`twell.policy.FFNPolicy.train_path` of the layer's policy at
    density ``l0 / H`` and its heavy-row fraction (both clamped to [0, 1]); ``torch`` for a
    non-gated layer."""
    if not m.gated:
        return "torch"
    return m.policy.train_path(min(m.l0 / m.width, 1.0), min(max(m.heavy_fraction, 0.0), 1.0))


@dataclass
class LayerTimes:
    """What :class:`MeasuredPathChooser` knows of one layer (plain data: its state).

    Attributes:
        samples: path (``ell`` / ``dense``) -> timed calls, ms per micro-step at the current rows
            per call, newest last, at most :data:`SAMPLES_KEPT`. ``ell``'s list starts afresh
            each time the layer comes back to ``ell`` (its time depends on the activations;
            dense mode's does not).
        l0_at: path -> the layer's L0 in the latest step timed on it.
        warm: paths whose first timed call (Triton compilation, allocator growth) was dropped.
        choice: the path chosen by the last decision (comparison or density rule); None before.
        measured: ``choice`` came from comparing timings (kept while timings are missing, e.g.
            after :meth:`MeasuredPathChooser.reset_samples`).
        exploring: the path being explored (run for fresh timings), or None.
        fresh: timed calls gathered by the current exploration.
        explore_steps: steps the current exploration has run.
        last_path: the path of the latest timed step.
    """

    samples: dict = field(default_factory=lambda: {p: [] for p in MEASURED_PATHS})
    l0_at: dict = field(default_factory=dict)
    warm: list = field(default_factory=list)
    choice: str | None = None
    measured: bool = False
    exploring: str | None = None
    fresh: int = 0
    explore_steps: int = 0
    last_path: str | None = None

    def medians(self, need: int = 1) -> dict:
        """path -> median ms of its timed calls, for paths with at least ``need`` of them."""
        return {p: statistics.median(v) for p, v in self.samples.items() if len(v) >= max(need, 1)}


def _other(path: str) -> str:
    return "dense" if path == "ell" else "ell"


class MeasuredPathChooser:
    """``auto``'s default chooser: per layer, the faster of ``ell`` and ``dense`` by that layer's
    own timings on its current activations (the plan's default; see :data:`PathChooser`).

    The plan times each ``auto`` layer's FFN forward(s) and backward in every training step
    (:class:`twell.nn.timing.LayerTimer`: CUDA events read after the step's one host sync) and
    passes the step's timed calls in :attr:`LayerMeasure.samples_ms`. Per layer:

    * the first timed call of each path is dropped (compilation, allocation);
    * with at least ``policy.train_timed_calls`` timings of both paths the medians decide, with
      hysteresis: the layer changes path only when the other one is faster by more than
      ``policy.train_switch_margin``;
    * before that (and for a layer that was never timed: the CPU, ``train_measure`` off) the
      density rule (:func:`density_rule`) decides; a layer that was decided by timings keeps
      its choice while timings are missing;
    * explorations: the path the layer is not on runs until it has ``train_timed_calls`` fresh
      timings, every ``policy.train_explore_every`` steps (phases spread over the layers, so
      only about ``L / train_explore_every`` layers explore in one step), and as soon as a
      layer on ``dense`` has an L0 more than ``policy.train_remeasure_factor`` below the L0 of
      its latest ``ell`` timing; never towards ``ell`` while more than
      ``policy.dense_row_fraction`` of the tokens are heavy rows (the op would run the call
      densely) and never for a layer that was not timed.

    Deterministic given the timings: with an injected clock the same steps give the same
    choices, and :meth:`state_dict` (plain JSON, in the plan's state) continues them exactly
    after a resume.

    Attributes:
        layers: layer index -> :class:`LayerTimes`.
    """

    measures = True

    def __init__(self) -> None:
        self.layers: dict[int, LayerTimes] = {}

    def __call__(self, m: LayerMeasure) -> str:
        if not m.gated:
            return "torch"
        rule = density_rule(m)
        if not m.policy.train_measure:
            return rule
        st = self.layers.setdefault(m.layer, LayerTimes())
        self._record(st, m)
        need = m.policy.train_timed_calls
        if st.exploring is not None:
            st.explore_steps += 1
            if st.fresh < need and st.explore_steps < EXPLORE_MAX_STEPS:
                return st.exploring
            st.exploring = None
        st.choice = self._compare(st, m, rule)
        target = self._explore_target(st, m)
        if target is not None:
            st.exploring, st.fresh, st.explore_steps = target, 0, 0
            return target
        return st.choice

    @staticmethod
    def _record(st: LayerTimes, m: LayerMeasure) -> None:
        """Add the step's timed calls of ``m.path`` (the first one ever of a path dropped)."""
        p, xs = m.path, [float(v) for v in m.samples_ms]
        if p not in MEASURED_PATHS or not xs:
            return
        if p == "ell" and st.last_path != "ell":  # back on ell: its old times are stale
            st.samples["ell"] = []
        st.last_path = p
        if p not in st.warm:
            st.warm.append(p)
            xs = xs[1:]
        if not xs:
            return
        st.samples[p] = (st.samples[p] + xs)[-SAMPLES_KEPT:]
        st.l0_at[p] = float(m.l0)
        if st.exploring == p:
            st.fresh += len(xs)

    @staticmethod
    def _compare(st: LayerTimes, m: LayerMeasure, rule: str) -> str:
        """The faster path by the medians, with hysteresis; the density rule (or the last
        measured choice) while one path lacks timings."""
        med = st.medians(m.policy.train_timed_calls)
        if len(med) < len(MEASURED_PATHS):
            return st.choice if st.measured and st.choice is not None else rule
        cur = st.choice if st.choice in MEASURED_PATHS else (
            m.path if m.path in MEASURED_PATHS else rule)
        other = _other(cur)
        st.measured = True
        return other if med[other] < (1.0 - m.policy.train_switch_margin) * med[cur] else cur

    @staticmethod
    def _explore_target(st: LayerTimes, m: LayerMeasure) -> str | None:
        """The path to explore next step, or None (see the class docstring)."""
        pol = m.policy
        other = _other(st.choice)
        if not st.warm:  # never timed (no clock for this device): nothing to compare
            return None
        if other == "ell" and m.heavy_fraction > pol.dense_row_fraction:
            return None
        if other == "ell" and "ell" in st.l0_at and \
                m.l0 * pol.train_remeasure_factor < st.l0_at["ell"]:
            return other
        every = pol.train_explore_every
        phase = (m.layer * every) // max(m.num_layers, 1)
        return other if (m.step + phase) % every == 0 else None

    def choice(self, layer: int) -> str | None:
        """The layer's chosen path without explorations (None: not decided by this chooser)."""
        st = self.layers.get(layer)
        return None if st is None else st.choice

    def medians(self, layer: int) -> dict:
        """path -> median ms per micro-step of the layer's timed calls (for logs)."""
        st = self.layers.get(layer)
        return {} if st is None else st.medians()

    def rescale(self, ratio: float) -> None:
        """The FFN calls now have ``ratio`` times as many rows: every timing x ratio (both paths
        take time in proportion to the rows; the current path's are replaced within a step)."""
        for st in self.layers.values():
            st.samples = {p: [v * ratio for v in xs] for p, xs in st.samples.items()}

    def reset_samples(self) -> None:
        """Forget every timing (a step of another shape: e.g. another recomputation); choices
        made from timings are kept until new ones arrive, explorations refill them."""
        for st in self.layers.values():
            st.samples = {p: [] for p in MEASURED_PATHS}
            st.exploring, st.last_path = None, None

    def state_dict(self) -> dict:
        """Plain JSON-able state: ``{"layers": {str(layer): LayerTimes fields}}``."""
        return {"layers": {str(k): dataclasses.asdict(st) for k, st in sorted(self.layers.items())}}

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict`'s data.

        Raises:
            ValueError: missing or unexpected keys (each named), an unknown path.
        """
        names = {f.name for f in dataclasses.fields(LayerTimes)}
        layers = {}
        for k, v in d.get("layers", {}).items():
            missing, unexpected = sorted(names - set(v)), sorted(set(v) - names)
            if missing or unexpected:
                raise ValueError(f"measured chooser state, layer {k}: missing keys {missing}, "
                                 f"unexpected keys {unexpected}")
            st = LayerTimes(**v)
            st.samples = {p: [float(x) for x in st.samples.get(p, [])] for p in MEASURED_PATHS}
            for p in (st.choice, st.exploring, st.last_path, *st.warm, *st.l0_at):
                if p is not None and p not in MEASURED_PATHS:
                    raise ValueError(f"measured chooser state, layer {k}: unknown path {p!r}")
            layers[int(k)] = st
        self.layers = layers


__all__ = ["MEASURED_PATHS", "LayerMeasure", "LayerTimes", "MeasuredPathChooser", "PathChooser",
           "density_rule"]
