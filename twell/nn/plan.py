"""The execution plan of a model's FFNs: one owner for each layer's per-call choices.

Shape legend: L layers (FFN modules, in layer order), H FFN width.

Per layer (:class:`LayerPlan`) the plan holds the training path, the dense-backup capacity of the
sparse path, whether the forward collects statistics, and the hidden units a sparse op computes
through a dense slice. :class:`FFNPlan` attaches one to every :class:`twell.nn.SparseGatedMLP`
(``forward`` reads it; nobody else writes module flags) and runs the optimizer-step protocol that
updates them from the step's statistics.

Training paths (the words used in code, config, logs and benchmarks):

* ``torch``: autograd through PyTorch ops (``twell.ops.reference.gated_ffn_torch``), the reference.
* ``dense``: dense mode (``twell.ops.sparse_train.dense_ffn_train``): cuBLAS products and one fused
  elementwise pass each way, the same FFN and statistics. Gated FFNs only.
* ``ell``: the hybrid ELL + dense-backup kernels (``twell.ops.sparse_train.sparse_ffn_train``;
  arXiv 2603.23198, "Hybrid (training)"). Gated FFNs only.

``impl`` (``model.ffn_impl``, ``SparseGatedMLP(impl=...)``) maps to paths as follows:

* ``torch`` -> ``torch``; ``dense`` for gated layers with ``dense_ffn_fused``
  (``trainer.dense_ffn_fused``).
* ``twell`` (the TwELL / ELL kernels) -> ``ell``.
* ``auto`` is a policy, not a path: per layer and optimizer step the plan's chooser picks ``ell``
  or ``dense`` from the step's statistics (default :func:`density_rule`, the thresholds of
  :class:`twell.policy.FFNPolicy`); every layer starts on ``dense`` (a freshly initialised ReLU
  FFN has ~50 % of its units active).
* Non-gated layers train on ``torch`` under ``torch`` and ``auto``.

Inference (no gradient) does not read the path: ``impl=torch`` runs dense PyTorch, ``twell`` and
``auto`` run ``twell.ops.ffn.sparse_ffn`` (``auto`` per call, by density). A module with no plan
attached behaves as one with :func:`default_path` of its ``impl``, statistics on and the
dense backup measured per call.

The optimizer step, one host sync (what ``train.trainer.Trainer.train_step`` does)::

    plan.begin_step()                                    # freezes this step's capacities
    ... micro-steps (forward, loss, backward), clip ...
    stats = StepStats(heavy_max_L, nnz_sum_L, heavy_sum_L, rows_per_call=..., tokens=...)
    host = torch.cat([bad.reshape(1), stats.packed()]).tolist()   # the step's one host sync
    outcome = plan.end_step(stats.unpacked(host[1:]))
    if outcome.redo:  # discard the gradients and run the step again (it now measures per call)
        ...

A step redone this way cannot overflow again: after a redo every layer measures its dense backup
per call (exact on any input). So a step runs at most twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from twell.nn.capacity import BackupCapacity
from twell.policy import FFNPolicy

FFN_IMPLS = ("torch", "twell", "auto")  # SparseGatedMLP(impl=...), model.ffn_impl
TRAIN_PATHS = ("torch", "dense", "ell")
HOST_SYNCS = ("step", "call")  # model.ffn_host_sync: no-sync capacities checked per step | per call
STATE_VERSION = 1


def default_path(impl: str, gated: bool, dense_ffn_fused: bool = False) -> str:
    """The training path a layer of ``impl`` starts on (see the module docstring).

    Args:
        impl: ``torch``, ``twell`` or ``auto`` (:data:`FFN_IMPLS`).
        gated: the layer has ``gate_proj``.
        dense_ffn_fused: ``impl=torch`` gated layers train in dense mode.

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
    return "dense" if dense_ffn_fused else "torch"


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
        hot_units: (K,) int64 device tensor of hidden-unit indices the sparse op computes through
            a dense slice, or None (every unit through ELL). Passed to the op only when set.
    """

    path: str = "torch"
    backup_rows: int = -1
    collect_stats: bool = True
    hot_units: torch.Tensor | None = None


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
    """

    layer: int
    l0: float
    heavy_fraction: float
    width: int
    gated: bool
    policy: FFNPolicy


PathChooser = Callable[[LayerMeasure], str]
"""``auto``'s choice for one layer: a :class:`LayerMeasure` -> ``"ell"`` or ``"dense"`` (or
``"torch"``). A measured-time chooser is a callable object holding its own timings."""


def density_rule(m: LayerMeasure) -> str:
    """The default chooser: :meth:`twell.policy.FFNPolicy.train_path` of the layer's policy at
    density ``l0 / H`` and its heavy-row fraction (both clamped to [0, 1]); ``torch`` for a
    non-gated layer."""
    if not m.gated:
        return "torch"
    return m.policy.train_path(min(m.l0 / m.width, 1.0), min(max(m.heavy_fraction, 0.0), 1.0))


def _host(v) -> list[float]:
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
    """

    heavy_max_L: torch.Tensor | list[float]
    nnz_sum_L: torch.Tensor | list[float]
    heavy_sum_L: torch.Tensor | list[float]
    rows_per_call: int
    tokens: int

    def reduced(self, reduce: Callable[[torch.Tensor, str], torch.Tensor]) -> StepStats:
        """Reduced over ranks with ``reduce(tensor, "max" | "sum")`` (e.g. accelerate's)."""
        return dataclasses.replace(self, heavy_max_L=reduce(self.heavy_max_L, "max"),
                                   nnz_sum_L=reduce(self.nnz_sum_L, "sum"),
                                   heavy_sum_L=reduce(self.heavy_sum_L, "sum"))

    def packed(self) -> torch.Tensor:
        """(3 L,) the device tensors in one, for the caller's single host read."""
        return torch.cat([self.heavy_max_L, self.nnz_sum_L, self.heavy_sum_L])

    def unpacked(self, values: Sequence[float]) -> StepStats:
        """The host copy from ``packed().tolist()`` (``values``, 3 L floats).

        Raises:
            ValueError: ``values`` is not a multiple of 3 long.
        """
        if len(values) % 3:
            raise ValueError(f"StepStats.unpacked needs 3 L values; got {len(values)}")
        n = len(values) // 3
        return dataclasses.replace(self, heavy_max_L=list(values[:n]),
                                   nnz_sum_L=list(values[n:2 * n]),
                                   heavy_sum_L=list(values[2 * n:]))


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


class FFNPlan:
    """The execution plan of a model's FFNs (see the module docstring).

    Args:
        mlps: the model's :class:`twell.nn.SparseGatedMLP` modules in layer order
            (``twell.hf.ffn_modules``); each gets its :class:`LayerPlan` attached (a module in two
            plans follows the last one).
        impl: ``torch``, ``twell`` or ``auto`` for every layer's training; None = each module's
            own ``impl``. Inference always follows the module's ``impl``.
        dense_ffn_fused: ``impl=torch`` gated layers train on ``dense``.
        host_sync: ``step`` (no-sync dense-backup capacities from past steps, checked once per
            step by :meth:`end_step`) or ``call`` (every ``ell`` call measures its backup).
        capacity_rule: the no-sync capacity rule (:data:`twell.nn.capacity.CAPACITY_RULES`).
        chooser: ``auto``'s per-layer choice (default :func:`density_rule`).

    Attributes:
        layers: the :class:`LayerPlan` of each layer (read them; change them through the
            methods).
        capacity: the :class:`twell.nn.capacity.BackupCapacity` behind the no-sync capacities.

    Raises:
        ValueError: unknown impl, host_sync or capacity rule; ``twell`` for a non-gated layer.
    """

    def __init__(self, mlps: Sequence, impl: str | None = None, *, dense_ffn_fused: bool = False,
                 host_sync: str = "step", capacity_rule: str = "window",
                 chooser: PathChooser | None = None) -> None:
        if host_sync not in HOST_SYNCS:
            raise ValueError(f"host_sync must be one of {HOST_SYNCS}; got {host_sync!r}")
        self.mlps = list(mlps)
        self.impls = [m.impl if impl is None else impl for m in self.mlps]
        self.layers = [LayerPlan(default_path(i, m.gated, dense_ffn_fused))
                       for i, m in zip(self.impls, self.mlps)]
        for k, (i, m) in enumerate(zip(self.impls, self.mlps)):
            if i == "twell" and not m.gated:
                raise ValueError(f"layer {k} is non-gated: impl twell trains only gated FFNs "
                                 "(the ELL kernels need gate_proj); use impl torch or auto")
        self.host_sync = host_sync
        self.capacity = BackupCapacity(len(self.mlps), capacity_rule)
        self.chooser = density_rule if chooser is None else chooser
        self._pinned = [False] * len(self.mlps)
        self._step_caps: list[int | None] = [None] * len(self.mlps)
        for m, lp in zip(self.mlps, self.layers):
            m.layer_plan = lp

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def paths(self) -> list[str]:
        """Each layer's training path (what ``metrics.jsonl`` logs as ``ffn_paths``)."""
        return [lp.path for lp in self.layers]

    def trains_ell(self, layer: int) -> bool:
        """Does layer ``layer`` train on the ``ell`` path this step (:func:`trains_ell`)."""
        return trains_ell(self.mlps[layer])

    # ------------------------------------------------------------ the step protocol

    def begin_step(self) -> None:
        """Start an optimizer step: statistics on (the L1 term needs them) and this step's
        no-sync capacities recorded, against which :meth:`end_step` checks the step."""
        for k, lp in enumerate(self.layers):
            lp.collect_stats = True
            self._step_caps[k] = lp.backup_rows if lp.path == "ell" and lp.backup_rows >= 0 \
                else None

    def end_step(self, stats: StepStats) -> StepOutcome:
        """Decide on the step from its statistics; set the next step's capacities and paths.

        A layer that ran with a no-sync capacity and had more heavy rows in some call than
        ``min(capacity, rows_per_call - 1)`` makes the step a redo: every layer then measures per
        call (so the redone step is exact) and the capacity rule learns of the overflow. Else
        the step is accepted: the capacity rule records the heavy-row maxima and gives each
        layer its next no-sync capacity, except with ``host_sync="call"`` and for layers with
        more than ``policy.dense_row_fraction`` of a call's rows heavy (the op then runs the whole
        call densely, which needs the measurement): those measure per call. Then ``auto``'s
        layers get their next paths (:meth:`choose_paths`).

        Args:
            stats: the step's :class:`StepStats` (host lists; tensors are read here, a sync).

        Raises:
            ValueError: statistics of another number of layers.
        """
        heavy_max = _host(stats.heavy_max_L)
        if len(heavy_max) != len(self.layers):
            raise ValueError(f"StepStats has {len(heavy_max)} layers; the plan has "
                             f"{len(self.layers)}")
        n_rows = max(stats.rows_per_call, 1)
        over = tuple(k for k, (cap, hv) in enumerate(zip(self._step_caps, heavy_max))
                     if cap is not None and hv > min(cap, n_rows - 1))
        if over:
            self.capacity.overflowed(list(over))
            for lp in self.layers:
                lp.backup_rows = -1
            return StepOutcome(redo=over)
        # capacities from past steps' counts (one step's count alone made a tiny GPU run redo 50
        # of 120 steps: a few heavy tokens come and go from batch to batch)
        for lp, mlp, hv, cap in zip(self.layers, self.mlps, heavy_max,
                                    self.capacity.update(heavy_max)):
            measure = self.host_sync != "step" or hv > mlp.policy.dense_row_fraction * n_rows
            lp.backup_rows = -1 if measure else cap
        tokens = max(stats.tokens, 1)
        self.choose_paths([v / tokens for v in _host(stats.nnz_sum_L)],
                          [v / tokens for v in _host(stats.heavy_sum_L)])
        return StepOutcome()

    def choose_paths(self, l0_L: Sequence[float], heavy_L: Sequence[float]) -> list[str]:
        """``auto``: each unpinned ``auto`` layer's path for the next step from its L0 (mean active
        units per token) and heavy-row fraction, by the plan's chooser; other layers keep theirs.

        Returns:
            :attr:`paths` after the choice.

        Raises:
            ValueError: the chooser returned an unknown path, or ``dense`` / ``ell`` for a
                non-gated layer; a density or fraction outside [0, 1] (the default chooser).
        """
        for k, (lp, mlp, l0, heavy) in enumerate(zip(self.layers, self.mlps, l0_L, heavy_L)):
            if self.impls[k] != "auto" or self._pinned[k]:
                continue
            path = self.chooser(LayerMeasure(k, l0, heavy, mlp.intermediate_size, mlp.gated,
                                             mlp.policy))
            lp.path = self._checked(k, path)
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
        longer changes them; ``path=None`` unpins them (``auto`` chooses again after the next
        step, they keep their path until then). A non-gated layer takes ``torch`` for
        ``dense`` (as under ``auto``).

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

    def reset_capacities(self) -> None:
        """Forget the no-sync capacities and their heavy-row history (they count rows per FFN
        call: after a change of micro-batch they are measured again); margins are kept."""
        for lp in self.layers:
            lp.backup_rows = -1
        self.capacity.hist = [[] for _ in self.layers]

    @contextmanager
    def profiling(self, path: str | None = None) -> Iterator[FFNPlan]:
        """A profiling pass (batches that are not training batches): statistics on, every
        dense backup measured per call (a no-sync capacity could be exceeded silently), every
        path fixed (``path`` on all layers, if given, as :meth:`pin`); everything restored on
        exit, also on an error. Yields the plan."""
        saved = [dataclasses.replace(lp) for lp in self.layers]
        pinned, step_caps = list(self._pinned), list(self._step_caps)
        try:
            for lp in self.layers:
                lp.collect_stats, lp.backup_rows = True, -1
            if path is not None:
                self.pin(path)
            self._pinned = [True] * len(self.layers)
            yield self
        finally:
            for lp, old in zip(self.layers, saved):  # in place: the modules hold these objects
                lp.path, lp.backup_rows = old.path, old.backup_rows
                lp.collect_stats, lp.hot_units = old.collect_stats, old.hot_units
            self._pinned, self._step_caps = pinned, step_caps

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """The plan's state as plain JSON-able data: version, per-layer impls, paths and no-sync
        capacities, and the capacity rule's state (histories, margins). Pins and hot units are
        not state (a caller sets them)."""
        return {"version": STATE_VERSION, "impls": list(self.impls), "paths": self.paths,
                "backup_rows": [int(lp.backup_rows) for lp in self.layers],
                "capacity": self.capacity.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict`'s data. The saved paths apply to layers that were ``auto``
        then and are ``auto`` now and unpinned (other layers' paths follow their impl, which a
        resume may change); the capacities apply to every layer.

        Raises:
            ValueError: a missing or unexpected key, another version or number of layers, or an
                unknown path (each named).
        """
        keys = {"version", "impls", "paths", "backup_rows", "capacity"}
        missing, unexpected = sorted(keys - set(d)), sorted(set(d) - keys)
        if missing or unexpected:
            raise ValueError(f"FFN plan state: missing keys {missing}, unexpected keys "
                             f"{unexpected}")
        if d["version"] != STATE_VERSION:
            raise ValueError(f"FFN plan state version {d['version']!r}; this twell reads "
                             f"{STATE_VERSION}")
        n = len(self.layers)
        for key in ("impls", "paths", "backup_rows"):
            if len(d[key]) != n:
                raise ValueError(f"FFN plan state: {key} has {len(d[key])} layers; the model "
                                 f"has {n}")
        for k, (lp, was, path) in enumerate(zip(self.layers, d["impls"], d["paths"])):
            if was == "auto" and self.impls[k] == "auto" and not self._pinned[k]:
                lp.path = self._checked(k, path)
        for lp, rows in zip(self.layers, d["backup_rows"]):
            lp.backup_rows = int(rows)
        self.capacity.load_state_dict(d["capacity"])


__all__ = ["FFN_IMPLS", "HOST_SYNCS", "TRAIN_PATHS", "FFNPlan", "LayerMeasure", "LayerPlan", "PathChooser",
           "StepOutcome", "StepStats", "default_path", "density_rule", "layer_plan",
           "trains_ell"]
