"""The execution plan of a model's FFNs: one owner for each layer's per-call choices.

Shape legend: L layers (FFN modules, in layer order), H FFN width.

Per layer (:class:`LayerPlan`) the plan holds the training path, the dense-backup capacity of the
sparse path, whether the forward collects statistics, and the hidden units a sparse op computes
through a dense slice. :class:`FFNPlan` attaches one to every :class:`twell.nn.SparseGatedMLP`
(``forward`` reads it; nobody else writes module flags) and runs the optimizer-step protocol that
updates them from the step's statistics.

Training paths (the words used in code, config, logs and benchmarks):

* ``torch``: autograd through PyTorch ops (``twell.ops.reference.gated_ffn_torch``), the reference.
* ``dense``: dense mode (``twell.ops.ffn_dense_train.dense_ffn_train``): cuBLAS products and one fused
  elementwise pass each way, the same FFN and statistics. Gated FFNs only.
* ``ell``: the hybrid ELL + dense-backup kernels (``twell.ops.ffn_train.sparse_ffn_train``;
  arXiv 2603.23198, "Hybrid (training)"). Gated FFNs only.

``impl`` is each module's (``SparseGatedMLP(impl=...)``; the trainer's ``ffn.impl``), the one
copy: the plan reads it. It maps to paths as follows:

* ``torch`` -> ``torch``; ``dense`` for gated layers with ``PlanOptions.dense_fused``
  (``ffn.dense_fused``).
* ``twell`` (the TwELL / ELL kernels) -> ``ell``.
* ``auto`` is a policy, not a path: per layer and optimizer step the plan's chooser picks ``ell``
  or ``dense`` (default :class:`twell.nn.chooser.MeasuredPathChooser`: the faster of the two by the layer's own
  timings in real steps, :func:`twell.nn.chooser.density_rule` until both paths have timings and wherever
  nothing is timed, e.g. on the CPU); every layer starts on ``dense`` (a freshly initialised
  ReLU FFN has ~50 % of its units active).
* Non-gated layers train on ``torch`` under ``torch`` and ``auto``.

Inference (no gradient) does not read the path: ``impl=torch`` runs dense PyTorch, ``twell`` and
``auto`` run ``twell.ops.ffn.sparse_ffn`` (``auto`` per call, by density). A module with no plan
attached behaves as one with :func:`default_path` of its ``impl``, statistics on and the
dense backup measured per call.

The optimizer step, one host sync (what ``train.trainer.Trainer.train_step`` does)::

    plan.begin_step()                                    # freezes this step's capacities
    ... micro-steps (forward, loss, backward), clip ...
    stats = StepStats(heavy_max_L, nnz_sum_L, heavy_sum_L, rows_per_call=..., tokens=...,
                      sequences_per_call=..., active_LH=...)
    stats = plan.count_hot_units(stats)                  # device: units above the hot threshold
    host = torch.cat([bad.reshape(1), stats.packed()]).tolist()   # the step's one host sync
    outcome = plan.end_step(stats.unpacked(host[1:]))    # reads the step's timings too
    if outcome.redo:  # discard the gradients and run the step again (it now measures per call)
        ...

A step redone this way cannot overflow again: after a redo every layer measures its dense backup
per call (exact on any input). So a step runs at most twice; redos are meant to be rare faults
(capacity floors, histories scaled across micro-batch changes: :mod:`twell.nn.capacity`).

``host_sync="micro_batch"`` checks sooner and redoes less: after each micro-batch's forward (one
host sync per micro-batch), :meth:`FFNPlan.call_overflow` compares its heavy rows with the
capacities; a layer over its capacity then measures per call for the rest of the step
(:meth:`FFNPlan.overflowed_in_call`) and the caller runs that micro-batch's forward again before
its backward, so an overflow costs one forward of one micro-batch instead of the whole step
(at accumulation 1 a redone step doubles the step; on one H200, one redone step in 10 cost the
1.5B ``ell`` row 10 % of its wall-clock: BENCHMARKS.md, "Call 4 outcome").

After an accepted step the plan also sets each ``ell`` layer's hot units (``LayerPlan.hot_units``,
from the step's per-unit active counts: :meth:`FFNPlan.count_hot_units` counted the units above
``FFNPolicy.hot_unit_fraction`` on the device, their number arrives in the one host sync, the
set is a device top-k) and the timings of ``auto``'s layers (:class:`twell.nn.timing.LayerTimer`,
CUDA events read after the sync) reach the chooser.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from twell.nn.capacity import CAPACITY_RULES, BackupCapacity
from twell.nn.chooser import (
    MEASURED_PATHS,
    SAMPLES_KEPT,
    LayerMeasure,
    MeasuredPathChooser,
    PathChooser,
)
from twell.nn.step import StepOutcome, StepStats, host_list
from twell.nn.timing import LayerTimer
from twell.ops.hot_units import hot_unit_k, hot_units_from_counts

FFN_IMPLS = ("torch", "twell", "auto")  # SparseGatedMLP(impl=...), ffn.impl
TRAIN_PATHS = ("torch", "dense", "ell")
# ffn.host_sync: no-sync capacities checked once per step | after each micro-batch's
# forward | measured per call
HOST_SYNCS = ("step", "micro_batch", "call")
STATE_VERSION = 2
# The plan gives a layer hot units only while they are a minority of its units: k hot units cost
# k / H of the dense FFN (18 N D each, fwd + bwd), so past H / 8 the layer is dense mode's (at
# H 5632 the cap max_hot_units = 512 binds first: 9 % of the dense FFN's time)
HOT_SHARE_MAX = 1 / 8


def default_path(impl: str, gated: bool, dense_fused: bool = False) -> str:
    """The training path a layer of ``impl`` starts on (see the module docstring).

    Args:
        impl: ``torch``, ``twell`` or ``auto`` (:data:`FFN_IMPLS`).
        gated: the layer has ``gate_proj``.
        dense_fused: ``impl=torch`` gated layers train in dense mode.

    Returns:
        One of :data:`TRAIN_PATHS`. A non-gated ``twell`` layer gets ``ell``, whose op refuses
        it with a ValueError at the first training forward (the ELL kernels need ``gate_proj``).

    Raises:
        ValueError: unknown ``impl``.
    """
    if impl not in FFN_IMPLS:
        raise ValueError(f"ffn impl must be one of {FFN_IMPLS}; got {impl!r}")
    if impl == "twell":
        return "ell"
    if not gated:
        return "torch"
    if impl == "auto":
        return "dense"
    return "dense" if dense_fused else "torch"


@dataclass(frozen=True)
class PlanOptions:
    """How an :class:`FFNPlan` trains its layers: the plan-wide knobs of the trainer's ``ffn``
    config group (``train.config.FFNConfig.plan_options``). Each layer's ``impl`` and ``policy``
    are its module's own (:class:`twell.nn.SparseGatedMLP`), not options.

    Attributes:
        dense_fused: gated layers of ``impl=torch`` train on ``dense`` (dense mode) instead of
            ``torch`` (``ffn.dense_fused``).
        host_sync: ``step`` (no-sync dense-backup capacities from past steps, checked once per
            step by :meth:`FFNPlan.end_step`), ``micro_batch`` (the same capacities, also checked
            after each micro-batch's forward by the caller: :meth:`FFNPlan.call_overflow`) or
            ``call`` (every ``ell`` call measures its backup) (:data:`HOST_SYNCS`,
            ``ffn.host_sync``).
        capacity_rule: the no-sync capacity rule (:data:`twell.nn.capacity.CAPACITY_RULES`,
            ``ffn.backup_capacity``).

    Raises:
        ValueError: unknown host_sync or capacity_rule.
    """

    dense_fused: bool = False
    host_sync: str = "step"
    capacity_rule: str = "window"

    def __post_init__(self) -> None:
        if self.host_sync not in HOST_SYNCS:
            raise ValueError(f"host_sync must be one of {HOST_SYNCS}; got {self.host_sync!r}")
        if self.capacity_rule not in CAPACITY_RULES:
            raise ValueError(f"backup capacity rule must be one of {CAPACITY_RULES}; got "
                             f"{self.capacity_rule!r}")


@dataclass
class LayerPlan:
    """One FFN layer's per-call choices, fixed within an optimizer step (so a checkpointed
    forward and its recomputation agree) and changed only by :class:`FFNPlan`.

    Attributes:
        path: training path, one of :data:`TRAIN_PATHS`.
        backup_rows: dense-backup capacity of the ``ell`` path (``sparse_ffn_train``'s
            ``backup_rows``): -1 = measure per call (one host sync per call, exact on any
            input); >= 0 = that many rows, no host sync (the step's statistics are checked
            against it in :meth:`FFNPlan.end_step`).
        collect_stats: the forward stores :class:`twell.stats.FFNStats` in ``last_stats``
            (training needs them: the L1 term is computed from them).
        hot_units: (K,) int64 device tensor of hidden-unit indices the sparse ops compute through
            a dense slice, or None (every unit through ELL / TwELL). Passed to the training op
            (``ell``) and the inference op only when set.
        timing: the :class:`twell.nn.timing.LayerTimer` that times this step's training calls
            (``auto`` layers the measured chooser compares), or None (untimed).
    """

    path: str = "torch"
    backup_rows: int = -1
    collect_stats: bool = True
    hot_units: torch.Tensor | None = None
    timing: LayerTimer | None = None


def layer_plan(mlp) -> LayerPlan:
    """The :class:`LayerPlan` a :class:`twell.nn.SparseGatedMLP` runs with: its attached entry,
    or (no plan attached) the default of its ``impl`` (a new object; changing it changes
    nothing)."""
    lp = getattr(mlp, "layer_plan", None)
    return lp if lp is not None else LayerPlan(default_path(mlp.impl, mlp.gated))


def trains_ell(mlp) -> bool:
    """Does this FFN's training forward run the ``ell`` path this optimizer step? (Fixed within
    a step. Selective recomputation keeps such layers' FFN out of the checkpoint.)"""
    return layer_plan(mlp).path == "ell"


class FFNPlan:
    """The execution plan of a model's FFNs (see the module docstring).

    Args:
        mlps: the model's :class:`twell.nn.SparseGatedMLP` modules in layer order
            (``twell.hf.ffn_modules``); each gets its :class:`LayerPlan` attached (a module in two
            plans follows the last one). Each layer's ``impl`` is its module's (read, not
            copied: set ``impl`` on the modules before building the plan).
        options: the plan-wide :class:`PlanOptions` (dense mode for ``torch``, host sync,
            capacity rule); None = the defaults.
        chooser: ``auto``'s per-layer choice (default: a new :class:`MeasuredPathChooser`).
        timed: time ``auto``'s layers for a chooser that measures (False under torch.compile:
            the timing hooks are eager Python).
        clock: the clock of the timings (``start`` / ``stop`` / ``poll``, as
            :class:`twell.ops.auto.CudaEventTimer`); None = CUDA events on CUDA, nothing timed
            elsewhere. Tests inject a deterministic one.
        reduce_host: several ranks: a function summing a list of floats over the ranks (host
            side), so that every rank's chooser sees the same timings and makes the same
            choices; None = one process.

    Attributes:
        options: the :class:`PlanOptions`.
        layers: the :class:`LayerPlan` of each layer (read them; change them through the
            methods).
        capacity: the :class:`twell.nn.capacity.BackupCapacity` behind the no-sync capacities.
        steps: accepted optimizer steps seen by :meth:`end_step`.
        rows_per_call: token rows of one FFN call (the last step's, or
            :meth:`set_rows_per_call`'s); None before either.
        sequences_per_call: sequences of one FFN call (the capacity floor's first tokens).
        last_l0: per layer, the last accepted step's L0; last_heavy: its heavy-row fractions.
        capacity_trace: None (the default: nothing recorded) or a list that the step protocol
            appends to, from host values it already holds (no host sync; not plan state; set
            it before a step's :meth:`begin_step`, None to stop). :meth:`end_step` appends one
            record per attempt: ``kind`` ``"step"``, ``step`` (:attr:`steps` before it: a
            redone attempt and its retry share it), ``rows_per_call``, ``sequences_per_call``,
            per layer ``paths`` (the step's), ``heavy_max`` (the host floats it decides from)
            and ``capacity`` (the no-sync capacity the step began with, None = measured per
            call), ``redo`` (the layers that made the attempt a redo, empty when accepted) and
            ``rerun`` (the layers whose forward ran again in it, ascending).
            :meth:`overflowed_in_call` appends ``kind`` ``"forward_rerun"``, ``step``,
            ``layers`` and ``capacity`` (each one's capacity that it exceeded).

    Raises:
        ValueError: a module's ``impl`` is ``twell`` and it is non-gated.
    """

    def __init__(self, mlps: Sequence, options: PlanOptions | None = None, *,
                 chooser: PathChooser | None = None, timed: bool = True, clock=None,
                 reduce_host: Callable[[list[float]], list[float]] | None = None) -> None:
        self.options = PlanOptions() if options is None else options
        self.mlps = list(mlps)
        self.layers = [LayerPlan(default_path(m.impl, m.gated, self.options.dense_fused))
                       for m in self.mlps]
        for k, m in enumerate(self.mlps):
            if m.impl == "twell" and not m.gated:
                raise ValueError(f"layer {k} is non-gated: impl twell trains only gated FFNs "
                                 "(the ELL kernels need gate_proj); use impl torch or auto")
        self.capacity = BackupCapacity(len(self.mlps), self.options.capacity_rule)
        self.chooser = MeasuredPathChooser() if chooser is None else chooser
        self.timed, self.reduce_host = timed, reduce_host
        self.timers = [LayerTimer(k, clock) for k in range(len(self.mlps))]
        self.steps = 0
        self.rows_per_call: int | None = None
        self.sequences_per_call = 0
        self.last_l0: list[float] = []
        self.last_heavy: list[float] = []
        self._pinned = [False] * len(self.mlps)
        self._step_caps: list[int | None] = [None] * len(self.mlps)
        self._after_redo = False
        self._call_redo = False  # some micro-batch of this step ran its forward again
        self._vectors: dict[str, tuple] = {}  # _device_vector's cache
        self.capacity_trace: list[dict] | None = None
        # the capacities the step began with: overflowed_in_call clears _step_caps' entries
        self._began_caps: list[int | None] = [None] * len(self.mlps)
        self._reruns: list[int] = []  # layers whose forward ran again this attempt
        for m, lp in zip(self.mlps, self.layers):
            m.layer_plan = lp

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def impls(self) -> list[str]:
        """Each layer's ``impl``: its module's (``SparseGatedMLP.impl``, the one copy)."""
        return [m.impl for m in self.mlps]

    @property
    def host_sync(self) -> str:
        """``options.host_sync``: when the no-sync capacities are checked."""
        return self.options.host_sync

    @property
    def paths(self) -> list[str]:
        """Each layer's training path (what ``metrics.jsonl`` logs as ``ffn_paths``)."""
        return [lp.path for lp in self.layers]

    @property
    def chosen_paths(self) -> list[str]:
        """Each layer's path as chosen, explorations left out (an exploring ``auto`` layer's
        choice is the path it goes back to): what a caller waits on to see the paths settle."""
        choice = getattr(self.chooser, "choice", None)
        out = []
        for k, lp in enumerate(self.layers):
            c = choice(k) if choice is not None and self._chooses(k) else None
            out.append(c if c is not None else lp.path)
        return out

    @property
    def clock(self):
        """The clock of the timings (the ``clock`` argument; None = CUDA events on CUDA). Set it
        to time with another one (tests: a deterministic clock), from the next step."""
        return self.timers[0].clock if self.timers else None

    @clock.setter
    def clock(self, clock) -> None:
        for t in self.timers:
            t.clock = clock

    def trains_ell(self, layer: int) -> bool:
        """Does layer ``layer`` train on the ``ell`` path this step (:func:`trains_ell`)."""
        return trains_ell(self.mlps[layer])

    @property
    def auto_layers(self) -> list[int]:
        """The layers whose path ``auto``'s chooser sets (unpinned ``auto`` layers)."""
        return [k for k in range(len(self.layers)) if self._chooses(k)]

    def _chooses(self, k: int) -> bool:
        """Does ``auto``'s chooser set layer k's path (an unpinned ``auto`` layer)?"""
        return self.mlps[k].impl == "auto" and not self._pinned[k]

    def _timed(self, k: int) -> bool:
        """Are layer k's training calls timed this step (an ``auto`` layer the measuring chooser
        compares, on one of the compared paths)?"""
        mlp = self.mlps[k]
        return (self.timed and self._chooses(k) and mlp.gated and mlp.policy.train_measure
                and getattr(self.chooser, "measures", False)
                and self.layers[k].path in MEASURED_PATHS)

    # ------------------------------------------------------------ the step protocol

    def begin_step(self) -> None:
        """Start an optimizer step: statistics on (the L1 term needs them), this step's no-sync
        capacities recorded (against which :meth:`end_step` checks the step) and the timers of
        the timed layers cleared and attached."""
        for k, lp in enumerate(self.layers):
            lp.collect_stats = True
            self._step_caps[k] = lp.backup_rows if lp.path == "ell" and lp.backup_rows >= 0 \
                else None
            self.timers[k].clear()
            lp.timing = self.timers[k] if self._timed(k) else None
        self._call_redo = False
        if self.capacity_trace is not None:
            self._began_caps, self._reruns = list(self._step_caps), []

    def call_overflow(self, heavy_L: torch.Tensor, rows: int) -> list[int]:
        """The layers whose heavy rows in the micro-batch just run forward exceed this step's
        no-sync capacity (``min(capacity, rows - 1)``, as :meth:`end_step` checks): a host sync,
        none when no layer runs on a no-sync capacity (then ``[]`` at once).

        Args:
            heavy_L: (L,) float32 device tensor, the micro-batch's heavy rows per layer
                (``SparsityStats.heavy_L`` of the forward).
            rows: token rows of the micro-batch's FFN calls.

        Returns:
            the overflowed layers' indices, ascending (a list of ints).
        """
        if all(c is None for c in self._step_caps):
            return []
        if tuple(heavy_L.shape) != (len(self.layers),):
            raise ValueError(f"call_overflow: heavy_L must be ({len(self.layers)},), one count "
                             f"a layer; got {tuple(heavy_L.shape)}")
        lim = self._device_vector("lim", [math.inf if c is None else float(min(c, rows - 1))
                                          for c in self._step_caps], heavy_L)
        return [k for k, o in enumerate((heavy_L > lim).tolist()) if o]  # the one host sync

    def overflowed_in_call(self, layers: Sequence[int]) -> None:
        """``layers`` exceeded their no-sync capacity in the current micro-batch (found by
        :meth:`call_overflow` before its backward): they measure per call for the rest of this
        step (exact), :meth:`end_step` no longer checks them and drops this step's timings (per
        call measurement distorts them), and the capacity rule learns of the overflow as of a
        redone step. The caller runs the micro-batch's forward again, after dropping the
        overflowed forward's graph."""
        layers = list(layers)
        if self.capacity_trace is not None:
            self._trace_rerun(layers)
        for k in layers:
            self.layers[k].backup_rows = -1
            self._step_caps[k] = None
        self.capacity.overflowed(layers)
        self._call_redo = True

    def _trace_rerun(self, layers: list[int]) -> None:
        """:attr:`capacity_trace`'s record of a forward rerun of ``layers``."""
        self._reruns += [k for k in layers if k not in self._reruns]
        self.capacity_trace.append({"kind": "forward_rerun", "step": self.steps,
                                    "layers": list(layers),
                                    "capacity": [self._step_caps[k] for k in layers]})

    def count_hot_units(self, stats: StepStats) -> StepStats:
        """``stats`` with ``hot_over_L`` (device, (L,)): per layer the units active on more than
        ``policy.hot_unit_fraction * stats.tokens`` tokens of the step, counted from
        ``stats.active_LH`` (reduced over ranks first: :meth:`StepStats.reduced`) so that the
        step's one host read carries them to :meth:`end_step`, which sizes the next step's hot
        sets with them (no other sync). ``stats`` unchanged without ``active_LH`` or when no
        layer can take hot units (non-gated, ``max_hot_units=0``, ``impl=torch`` and not on
        ``ell``)."""
        if stats.active_LH is None or not any(self._may_split(k) for k in range(len(self))):
            return stats
        a_LH = stats.active_LH
        thr_L = self._device_vector("hot", [m.policy.hot_unit_fraction * stats.tokens
                                            for m in self.mlps], a_LH, torch.float64)
        over_L = (a_LH.to(torch.float64) > thr_L[:, None]).sum(1).to(torch.float32)
        return dataclasses.replace(stats, hot_over_L=over_L)

    def _device_vector(self, name: str, values: list[float], like: torch.Tensor,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
        """``values`` as a device tensor on ``like``'s device (``like``'s dtype unless given),
        made again only when the values change (a step's capacities and token count repeat
        step to step) and then copied from pinned memory without waiting: a plain
        ``torch.tensor(..., device=cuda)`` is a blocking copy, a host sync every call."""
        dtype = like.dtype if dtype is None else dtype
        key = (tuple(values), like.device, dtype)
        hit = self._vectors.get(name)
        if hit is None or hit[0] != key:
            host = torch.tensor(values, dtype=dtype)
            if like.is_cuda:
                host = host.pin_memory()  # kept with the copy: not reused while in flight
            hit = self._vectors[name] = (key, host.to(like.device, non_blocking=True), host)
        return hit[1]

    def _may_split(self, k: int) -> bool:
        """Can layer k run the ``ell`` path with hot units (next step)?"""
        m = self.mlps[k]
        return m.gated and m.policy.max_hot_units > 0 and (
            self.mlps[k].impl != "torch" or self.layers[k].path == "ell")

    def end_step(self, stats: StepStats) -> StepOutcome:
        """Decide on the step from its statistics; set the next step's capacities, paths and
        hot units.

        A layer that ran with a no-sync capacity and had more heavy rows in some call than
        ``min(capacity, rows_per_call - 1)`` makes the step a redo: every layer then measures per
        call (so the redone step is exact) and the capacity rule learns of the overflow. Else
        the step is accepted: the capacity rule records the heavy-row maxima and gives each
        layer its next no-sync capacity (at least the floor: ``policy.backup_floor_fraction`` of
        a call's rows plus its sequences; a layer that moves to ``ell`` keeps only its latest
        counts, :meth:`twell.nn.capacity.BackupCapacity.restart`), except with
        ``host_sync="call"`` and for layers with more than ``policy.dense_row_fraction`` of a
        call's rows heavy (the op then runs the whole call densely, which needs the
        measurement): those measure per call. Then ``auto``'s layers get their next paths
        (:meth:`choose_paths`, with the step's timings; the timings of a redone or redoing
        attempt are dropped: it measured per call) and the ``ell`` layers their hot units
        (:meth:`count_hot_units`).

        Args:
            stats: the step's :class:`StepStats` (host lists; tensors are read here, a sync).

        Raises:
            ValueError: statistics of another number of layers.
        """
        heavy_max = host_list(stats.heavy_max_L)
        if len(heavy_max) != len(self.layers):
            raise ValueError(f"StepStats has {len(heavy_max)} layers; the plan has "
                             f"{len(self.layers)}")
        n_rows = max(stats.rows_per_call, 1)
        over = tuple(k for k, (cap, hv) in enumerate(zip(self._step_caps, heavy_max))
                     if cap is not None and hv > min(cap, n_rows - 1))
        if self.capacity_trace is not None:
            self._trace_step(stats, heavy_max, over)
        samples = self._take_samples(discard=bool(over) or self._after_redo or self._call_redo)
        self._after_redo = bool(over)
        if over:
            self.capacity.overflowed(list(over))
            for lp in self.layers:
                lp.backup_rows = -1
            return StepOutcome(redo=over)
        self.steps += 1
        self.rows_per_call, self.sequences_per_call = stats.rows_per_call, stats.sequences_per_call
        floors = [self._floor(k) for k in range(len(self))]
        # capacities from past steps' counts (one step's count alone made a tiny GPU run redo 50
        # of 120 steps: a few heavy tokens come and go from batch to batch)
        caps = self.capacity.update(heavy_max, floors)
        tokens = max(stats.tokens, 1)
        before = self.paths
        self.last_l0 = [v / tokens for v in host_list(stats.nnz_sum_L)]
        self.last_heavy = [v / tokens for v in host_list(stats.heavy_sum_L)]
        self.choose_paths(self.last_l0, self.last_heavy, samples)
        for k, (lp, mlp, hv) in enumerate(zip(self.layers, self.mlps, heavy_max)):
            if lp.path == "ell" and before[k] != "ell":  # from its dense-path counts
                self.capacity.restart(k)
                caps[k] = self.capacity.capacity(k, floors[k])
            measure = self.host_sync == "call" or hv > mlp.policy.dense_row_fraction * n_rows
            lp.backup_rows = -1 if measure else caps[k]
        self._set_hot_units(stats)
        return StepOutcome()

    def _trace_step(self, stats: StepStats, heavy_max: list[float], over: tuple) -> None:
        """:attr:`capacity_trace`'s record of one :meth:`end_step` attempt."""
        self.capacity_trace.append({
            "kind": "step", "step": self.steps, "rows_per_call": int(stats.rows_per_call),
            "sequences_per_call": int(stats.sequences_per_call), "paths": self.paths,
            "heavy_max": list(heavy_max), "capacity": list(self._began_caps),
            "redo": list(over), "rerun": sorted(self._reruns)})

    def _floor(self, k: int) -> int:
        """Layer k's capacity floor at the current rows per call (0 while unknown)."""
        rows = self.rows_per_call or 0
        f = self.mlps[k].policy.backup_floor_fraction
        return math.ceil(f * rows) + self.sequences_per_call if rows > 0 else 0

    def _take_samples(self, discard: bool) -> dict[int, list[float]]:
        """Layer -> the step's timed calls (ms per micro-step) of the layers timed this step,
        averaged over ranks with ``reduce_host`` (every rank calls it in the same steps); the
        timers are cleared. ``discard``: read nothing (a redo measured per call)."""
        timed = [k for k, lp in enumerate(self.layers) if lp.timing is not None]
        out = {k: ([] if discard else self.layers[k].timing.samples()[:SAMPLES_KEPT])
               for k in timed}
        for k in timed:
            self.layers[k].timing.clear()
        if discard or not timed or self.reduce_host is None:
            return out
        vals = [v for k in timed for v in out[k] + [0.0] * (SAMPLES_KEPT - len(out[k]))]
        cnts = [float(i < len(out[k])) for k in timed for i in range(SAMPLES_KEPT)]
        tot = self.reduce_host(vals + cnts)
        n = len(vals)
        for j, k in enumerate(timed):
            row = range(j * SAMPLES_KEPT, (j + 1) * SAMPLES_KEPT)
            out[k] = [tot[i] / tot[n + i] for i in row if tot[n + i] > 0]
        return out

    def _set_hot_units(self, stats: StepStats) -> None:
        """Each ``ell`` layer's hot set for the next step: the ``k`` most active units
        (``twell.ops.hot_units``: k from the counted ``hot_over_L``, the top-k on the device);
        None on the other paths, below ``policy.hot_min_density`` and where k would exceed
        :data:`HOT_SHARE_MAX` of the units.
        Layers with ``policy.max_hot_units = 0`` keep what a caller set."""
        over, counts = stats.hot_over_L, stats.active_LH
        if over is None or counts is None:
            return
        over, nnz = host_list(over), host_list(stats.nnz_sum_L)
        for k, (lp, mlp) in enumerate(zip(self.layers, self.mlps)):
            if not self._may_split(k):
                continue
            h = mlp.intermediate_size
            n_hot = hot_unit_k(int(over[k]), h, mlp.policy)
            dense_enough = nnz[k] >= mlp.policy.hot_min_density * h * stats.tokens
            use = lp.path == "ell" and dense_enough and 0 < n_hot <= HOT_SHARE_MAX * h
            lp.hot_units = hot_units_from_counts(counts[k], stats.tokens, k=n_hot) if use else None

    def choose_paths(self, l0_L: Sequence[float], heavy_L: Sequence[float],
                     samples: dict[int, list[float]] | None = None) -> list[str]:
        """``auto``: each unpinned ``auto`` layer's path for the next step from its L0 (mean active
        units per token), heavy-row fraction and the step's timed calls (``samples``: layer ->
        ms per micro-step), by the plan's chooser; other layers keep theirs.

        Returns:
            :attr:`paths` after the choice.

        Raises:
            ValueError: the chooser returned an unknown path, or ``dense`` / ``ell`` for a
                non-gated layer; a density or fraction outside [0, 1] (the default chooser).
        """
        samples = samples or {}
        for k, (lp, mlp, l0, heavy) in enumerate(zip(self.layers, self.mlps, l0_L, heavy_L)):
            if not self._chooses(k):
                continue
            m = LayerMeasure(k, l0, heavy, mlp.intermediate_size, mlp.gated, mlp.policy,
                             path=lp.path, samples_ms=tuple(samples.get(k, ())), step=self.steps,
                             num_layers=len(self.layers))
            lp.path = self._checked(k, self.chooser(m))
        return self.paths

    def _checked(self, k: int, path: str) -> str:
        if path not in TRAIN_PATHS:
            raise ValueError(f"FFN path must be one of {TRAIN_PATHS}; got {path!r} (layer {k})")
        if path != "torch" and not self.mlps[k].gated:
            raise ValueError(f"layer {k} is non-gated: the {path} path needs gate_proj; use torch")
        return path

    # ------------------------------------------------------------ overrides

    def pin(self, path: str | None, layers: Sequence[int] | None = None) -> None:
        """Force ``path`` on ``layers`` (default: every layer; benchmarks), so that ``auto`` no
        longer changes them (nor times them); ``path=None`` unpins them (``auto`` chooses again
        after the next step, they keep their path until then). A non-gated layer takes
        ``torch`` for ``dense`` (as under ``auto``).

        Raises:
            ValueError: unknown path; ``ell`` on a non-gated layer; a layer index out of range.
        """
        ks = range(len(self.layers)) if layers is None else list(layers)
        for k in ks:
            if not 0 <= k < len(self.layers):
                raise ValueError(f"layer {k} is out of range (the plan has {len(self.layers)})")
            if path is not None:
                p = "torch" if path == "dense" and not self.mlps[k].gated else path
                self.layers[k].path = self._checked(k, p)
            self._pinned[k] = path is not None

    @property
    def pinned(self) -> list[bool]:
        """Per layer: is its path pinned (:meth:`pin`)."""
        return list(self._pinned)

    def set_collect_stats(self, on: bool) -> None:
        """Statistics on or off for every layer (off for inference: no counting pass). A
        training step turns them on again (:meth:`begin_step`)."""
        for lp in self.layers:
            lp.collect_stats = bool(on)

    def set_rows_per_call(self, rows: int, sequences: int | None = None) -> None:
        """The FFN calls will have ``rows`` token rows (and ``sequences`` sequences; None = in
        the same proportion as before) from the next step: a new micro-batch. The heavy-row
        histories (:meth:`twell.nn.capacity.BackupCapacity.rescale`) and the chooser's timings
        are scaled to it and the no-sync capacities recomputed, so the next step needs neither
        a per-call measurement nor a redo. A no-op at the same rows; only records them before
        the first step.

        Raises:
            ValueError: rows < 1 or sequences < 0.
        """
        if rows < 1 or (sequences is not None and sequences < 0):
            raise ValueError(f"set_rows_per_call: rows must be >= 1 and sequences >= 0; got "
                             f"{rows}, {sequences}")
        old = self.rows_per_call
        if sequences is None:
            sequences = round(self.sequences_per_call * rows / old) if old else 0
        self.rows_per_call, self.sequences_per_call = int(rows), int(sequences)
        if old is None or old == rows:
            return
        self.capacity.rescale(rows / old)
        rescale = getattr(self.chooser, "rescale", None)
        if rescale is not None:
            rescale(rows / old)
        for k, lp in enumerate(self.layers):
            if lp.backup_rows >= 0:
                lp.backup_rows = self.capacity.capacity(k, self._floor(k))

    def forget_timings(self) -> None:
        """The steps changed shape in a way that changes both paths' times (another
        recomputation): the chooser's timings are dropped (its choices stay until explorations
        bring new ones)."""
        reset = getattr(self.chooser, "reset_samples", None)
        if reset is not None:
            reset()

    def reset_capacities(self) -> None:
        """Forget the no-sync capacities and their heavy-row history (measured again from the
        next step); margins are kept. After a change of micro-batch prefer
        :meth:`set_rows_per_call`, which keeps the history."""
        for lp in self.layers:
            lp.backup_rows = -1
        self.capacity.hist = [[] for _ in self.layers]

    @contextmanager
    def profiling(self, path: str | None = None) -> Iterator[FFNPlan]:
        """A profiling pass (batches that are not training batches): statistics on, every
        dense backup measured per call (a no-sync capacity could be exceeded silently), every
        path fixed (``path`` on all layers, if given, as :meth:`pin`), nothing timed for the
        chooser; everything restored on exit, also on an error. Yields the plan."""
        saved = [dataclasses.replace(lp) for lp in self.layers]
        pinned, step_caps = list(self._pinned), list(self._step_caps)
        try:
            for lp in self.layers:
                lp.collect_stats, lp.backup_rows, lp.timing = True, -1, None
            if path is not None:
                self.pin(path)
            self._pinned = [True] * len(self.layers)
            yield self
        finally:
            for lp, old in zip(self.layers, saved):  # in place: the modules hold these objects
                lp.path, lp.backup_rows = old.path, old.backup_rows
                lp.collect_stats, lp.hot_units, lp.timing = (old.collect_stats, old.hot_units,
                                                             old.timing)
            self._pinned, self._step_caps = pinned, step_caps

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """The plan's state as plain JSON-able data: version, per-layer impls, paths, no-sync
        capacities and hot units (unit indices or None), the capacity rule's state (histories,
        margins), the steps seen, the rows and sequences per call and the chooser's state (its
        timings; None for a chooser without one). Pins are not state (a caller sets them)."""
        state = getattr(self.chooser, "state_dict", None)
        return {"version": STATE_VERSION, "impls": list(self.impls), "paths": self.paths,
                "backup_rows": [int(lp.backup_rows) for lp in self.layers],
                "capacity": self.capacity.state_dict(), "steps": self.steps,
                "rows_per_call": self.rows_per_call, "sequences_per_call": self.sequences_per_call,
                "hot_units": [None if lp.hot_units is None else lp.hot_units.tolist()
                              for lp in self.layers],
                "chooser": None if state is None else state()}

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict`'s data. The saved paths apply to layers that were ``auto`` then and are ``auto`` now
        and unpinned (other layers' paths follow their impl, which a resume may change); the
        capacities and hot units apply to every layer.

        Raises:
            ValueError: a missing or unexpected key, another version or number of layers, an
                unknown path or a hot unit out of range (each named).
        """
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"FFN plan state version {d.get('version')!r}; this twell reads "
                             f"{STATE_VERSION}")
        keys = {"version", "impls", "paths", "backup_rows", "capacity", "steps", "rows_per_call",
                "sequences_per_call", "hot_units", "chooser"}
        missing, unexpected = sorted(keys - set(d)), sorted(set(d) - keys)
        if missing or unexpected:
            raise ValueError(f"FFN plan state: missing keys {missing}, unexpected keys "
                             f"{unexpected}")
        n = len(self.layers)
        for key in ("impls", "paths", "backup_rows", "hot_units"):
            if key in d and len(d[key]) != n:
                raise ValueError(f"FFN plan state: {key} has {len(d[key])} layers; the model "
                                 f"has {n}")
        for k, (lp, was, path) in enumerate(zip(self.layers, d["impls"], d["paths"])):
            if was == "auto" and self.mlps[k].impl == "auto" and not self._pinned[k]:
                lp.path = self._checked(k, path)
        for lp, rows in zip(self.layers, d["backup_rows"]):
            lp.backup_rows = int(rows)
        self.capacity.load_state_dict(d["capacity"])
        self.steps = int(d["steps"])
        self.rows_per_call = None if d["rows_per_call"] is None else int(d["rows_per_call"])
        self.sequences_per_call = int(d["sequences_per_call"])
        for k, (lp, mlp, ids) in enumerate(zip(self.layers, self.mlps, d["hot_units"])):
            lp.hot_units = None if ids is None else self._hot_tensor(k, mlp, ids)
        load = getattr(self.chooser, "load_state_dict", None)
        if d["chooser"] is not None and load is not None:
            load(d["chooser"])

    @staticmethod
    def _hot_tensor(k: int, mlp, ids) -> torch.Tensor:
        h = mlp.intermediate_size
        if any(not 0 <= int(i) < h for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"FFN plan state: hot_units of layer {k} must be distinct unit "
                             f"indices in [0, {h})")
        return torch.tensor([int(i) for i in ids], dtype=torch.int64,
                            device=mlp.up_proj.weight.device)


__all__ = ["FFN_IMPLS", "HOST_SYNCS", "TRAIN_PATHS", "FFNPlan", "LayerPlan", "PlanOptions",
           "default_path", "layer_plan", "trains_ell"]
