"""Measured choice among the FFN training op's variants for a caller that runs the op directly
in a loop: time each variant on the caller's own calls, then run the fastest.

Shape legend: N tokens, D model width, H FFN width, k hot units.

Source: the candidates compute the gated ReLU FFN and L1 term of arXiv 2603.23198 ("The L1
regularizer"; the hybrid ELL + dense-backup training of "Hybrid (training)"); the measured choice
among them is ours.

Why measured: which variant is fastest depends on the card, the layer's shape and activations
and on how busy the host is, and no density rule orders them. In the recorded-layer benchmark
(BENCHMARKS.md, "Outcome: the training ops on the 2B layers", H100) the ungraphed ELL ops are
host-bound: ``ell`` took 4.945 ms a call by wall against 2.238 ms of GPU work (55 % idle, 88
kernels a call; ~96 for the no-sync op), so the same no-sync op captured in one CUDA graph
(``twell.ops.ffn_train_graph``: one launch a call) ran 2.24x and 2.83x of dense on the two
sparse 2B layers against 1.30-1.43x for every ungraphed variant, while on the densest layer
(3.07 %) the hot-unit split won (1.08x against the graph's 1.01x). A rule-based ``auto`` missed
"within 2 % of the best variant" by ~40 % there. The trainer's per-layer plan has its own
measured chooser (``twell.nn.chooser.MeasuredPathChooser``); this is the op-level one.

Candidates (:data:`CANDIDATES`, in this order; each returns :data:`FFN_OUTPUTS`):

    dense       dense mode (``dense_ffn_train``: cuBLAS and one fused pass each way)
    ell_nosync  ``sparse_ffn_train`` without host sync, the dense backup at
                ``backup_capacity_for`` of the heavy rows of a measuring call
    ell_hot     the same with the caller's hot units (only when ``hot_units`` is given)
    ell_graph   ``ell_nosync`` captured in one CUDA graph (``graphed_ffn_train``); only on CUDA
                (or with an injected ``graphs`` backend); a capture that raises drops it, the
                reason kept in ``reasons``

Exploration (a clock is available: CUDA, or an injected ``clock``): the calls rotate over the
candidates (the one with the fewest calls first, ties in the order above). A candidate's calls
are timed only once it is in its steady form: after its first call (dropped: Triton compiles,
cuBLAS initialises), and for the no-sync ones after their measuring call (``backup_rows=-1``,
exact, one host sync, which sets the capacity). Once every candidate has ``trials`` timings the
one with the smallest median is ``choice`` (ties in the order above), and every later call runs
it (a graph not chosen is released with its memory pool). On CUDA the default clock (:class:`SyncedEventTimer`) waits for the stream before each timed
call, so a call is not timed behind the previous call's GPU work (which would hide a host-bound
op's launch gaps), and the exploration's last call waits for its events. Every call of the
exploration returns that call's exact results (its guard is read, below).

No clock (a CPU tensor without ``clock``, or ``policy.train_measure`` off): nothing is timed; the
first call is a measuring call (with the hot set when given) whose density (L0 / H) and
heavy-row fraction (of that call: the cold units' with a hot set) pick the path by :meth:`twell.policy.FFNPolicy.train_path`: ``dense``, else
``ell_hot`` when hot units are given and the density is at least ``policy.hot_min_density``,
else ``ell_nosync`` (the recorded-layer benchmark's former rule).

Capacity guard (the no-sync candidates: ``ell_nosync``, ``ell_hot``, ``ell_graph``). A call with
more heavy rows than the backup's capacity has wrong results in those rows. The rule:

- every exploration call reads its guard (one host sync; the exploration's timer syncs anyway);
- ``check_each_call=True`` (default): every later call reads it too, after the call is queued
  (one host sync a call: the GPU drains before the next call's first launch; with the graph the
  host has nothing else to queue, so it costs the next call's few launch microseconds);
- ``check_each_call=False``: later calls never sync; the caller must call :meth:`check` before
  using the results of the calls since the last check (e.g. once per optimizer step, the
  trainer's rule), which raises :class:`CapacityOverflow` when one of them overflowed; the
  caller then redoes those calls.

On an overflow read by a call, that call is redone eagerly in the measuring mode (exact) and its
results returned; an overflow read by :meth:`check` raises. Either way the candidate's next call
measures its heavy rows again (``ell_graph``: captured again at the new capacity). A measuring
call that finds every row heavy drops that candidate (the no-sync backup holds at most N - 1
rows); a dropped choice falls to the next fastest by the medians (``dense`` at worst).

Shapes and dtypes are fixed by the first call (its timings, capacities and graph are for that
shape, as the inference ``auto`` buckets its timings by row count): a later call with another
shape, dtype or device raises ValueError; build one :class:`AutoFFNTrain` per shape.

NaN / inf: each candidate propagates them as the eager ops do (a NaN or inf row is heavy and goes
through the dense backup; ``twell.ops.ffn_train``); a NaN row more than the capacity is an
overflow like any other heavy row.
"""

from __future__ import annotations

import math
import numbers
import statistics

import torch

from twell.ops.auto import CudaEventTimer
from twell.ops.ffn_dense_train import dense_ffn_train
from twell.ops.ffn_train import _backup_capacity, backup_capacity_for, sparse_ffn_train
from twell.ops.ffn_train_graph import FFN_OUTPUTS, CapacityOverflow, graphed_ffn_train
from twell.ops.hot_units import check_hot_units
from twell.ops.train_backend import check_train_args
from twell.policy import FFNPolicy

CANDIDATES = ("dense", "ell_nosync", "ell_hot", "ell_graph")
NOSYNC = ("ell_nosync", "ell_hot", "ell_graph")  # candidates with a capacity guard
UNCHECKED_FOLD = 64  # heavy-row counts kept per candidate between checks before folding to a max


class SyncedEventTimer(CudaEventTimer):
    """:class:`twell.ops.auto.CudaEventTimer` that waits for the current stream before a timed
    call starts (the call's time is then its own, not hidden behind queued work) and can wait
    for a timed call's end (:meth:`wait`). The clock interface of :class:`AutoFFNTrain`; times
    in milliseconds (CUDA events). CUDA only (``torch.cuda`` raises without a device)."""

    def start(self, path: str):
        """Wait for the current stream, then record a start event."""
        torch.cuda.current_stream().synchronize()
        return super().start(path)

    def wait(self, handle) -> float | None:
        """Block until the timed call's end event, then its milliseconds."""
        handle[1].synchronize()
        return self.poll(handle)


class AutoFFNTrain:
    """The FFN training op (forward and backward of the gated ReLU FFN with its L1 term) that
    times its variants on its first calls and then runs the fastest (module docstring: the
    candidates, the exploration, the capacity guard).

    A call ``op(x, dy)`` returns :data:`FFN_OUTPUTS`: y (N, D) in the compute dtype, the gradients
    of ``sum(y * dy) + l1_coeff * l1`` with respect to x (N, D; in the compute dtype), Wg, Wu
    (H, D) and Wd (D, H) (in the weights' dtypes), the L1 term l1 (mean over tokens of
    sum_j |h_nj|; fp32 scalar, fp64 for fp64 inputs) and heavy_rows (tokens with more active
    units than the ELL capacity, as the candidate that ran counts them: ``ell_hot`` counts the
    cold units only; fp32 scalar). Nothing accumulates into ``.grad``. The outputs
    may be the graph's static tensors, overwritten by the next call: clone what must outlive it.

    Args:
        w_gate_HD, w_up_HD, w_down_DH: (H, D), (H, D), (D, H) weights, read in place on every
            call (an optimizer's in-place step reaches the next call; a new tensor does not).
        hot_units: (k,) int64 unit indices on the weights' device (``ell_hot``'s hot set, e.g.
            ``twell.ops.hot_units.hot_units_from_counts``); None or empty: no ``ell_hot``.
        l1_coeff: dL/dl1, the L1 term's coefficient in the loss.
        policy: ELL capacity, ``train_path``'s thresholds, ``hot_min_density``; ``trials``
            defaults to its ``train_timed_calls``; ``train_measure=False`` = the density rule.
        trials: timed calls per candidate before the choice (>= 1).
        clock: ``start(name) -> token``, ``stop(token) -> handle``, ``poll(handle) -> ms or
            None`` (never blocking) and optionally ``wait(handle) -> ms`` (blocking); default
            :class:`SyncedEventTimer` for CUDA inputs, none (the density rule) otherwise.
        check_each_call: read the capacity guard on every call (module docstring); False: the
            caller calls :meth:`check`.
        graph: include ``ell_graph`` where it can run.
        graphs, warmup: ``graphed_ffn_train``'s (a test passes a stand-in for CUDA graphs).

    Attributes:
        choice: the candidate every call now runs, or None while exploring.
        timings: candidate -> timed calls (ms) landed so far.
        reasons: candidate -> why it is not (or no longer) a candidate; with the density rule,
            the chosen candidate -> the rule's inputs.
        calls: candidate -> calls run as it (measuring and warm-up calls included).

    Raises:
        ValueError: bad weights, hot units, ``trials``, ``l1_coeff`` (not a finite number) or
            ``warmup`` (here); bad inputs, or inputs of another shape, dtype or device than the
            first call's (at a call).
        TypeError: a weight not a tensor or ``policy`` not an FFNPolicy (here); x or dy not a
            tensor (at a call).
        RuntimeError: a call under ``torch.inference_mode`` (the op's outputs are gradients).
    """

    def __init__(self, w_gate_HD: torch.Tensor, w_up_HD: torch.Tensor, w_down_DH: torch.Tensor,
                 *, hot_units: torch.Tensor | None = None, l1_coeff: float = 0.0,
                 policy: FFNPolicy | None = None, trials: int | None = None, clock=None,
                 check_each_call: bool = True, graph: bool = True, graphs=None,
                 warmup: int = 2) -> None:
        self.policy = policy if policy is not None else FFNPolicy()
        if not isinstance(self.policy, FFNPolicy):
            raise TypeError(f"AutoFFNTrain: policy must be an FFNPolicy; got "
                            f"{type(self.policy).__name__}")
        trials = self.policy.train_timed_calls if trials is None else trials
        if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
            raise ValueError(f"AutoFFNTrain: trials must be an integer >= 1; got {trials!r}")
        if w_gate_HD is None:
            raise ValueError("AutoFFNTrain: needs w_gate_HD (the gated FFN)")
        for name, w in (("w_gate_HD", w_gate_HD), ("w_up_HD", w_up_HD), ("w_down_DH", w_down_DH)):
            if not isinstance(w, torch.Tensor):
                raise TypeError(f"AutoFFNTrain: {name} must be a tensor; got {type(w).__name__}")
            if not w.is_floating_point():
                raise ValueError(f"AutoFFNTrain: {name} must be floating point; got {w.dtype}")
        if (not isinstance(l1_coeff, numbers.Real) or isinstance(l1_coeff, bool)
                or not math.isfinite(l1_coeff)):
            raise ValueError(f"AutoFFNTrain: l1_coeff must be a finite number; got {l1_coeff!r}")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise ValueError(f"AutoFFNTrain: warmup must be an integer >= 1 (the graph's eager "
                             f"calls before its capture); got {warmup!r}")
        probe = w_gate_HD.new_empty((0, w_gate_HD.shape[-1]))  # the weights' checks, no x yet
        check_train_args(probe, w_gate_HD, w_up_HD, w_down_DH, "auto", "AutoFFNTrain")
        hot = check_hot_units(hot_units, w_gate_HD.shape[0], w_gate_HD.device, "AutoFFNTrain")
        self.hot_units = hot if hot is not None and hot.numel() > 0 else None
        self.trials = trials
        self.l1_coeff = float(l1_coeff)
        self.check_each_call = bool(check_each_call)
        self._want_graph, self._graphs, self._warmup = bool(graph), graphs, warmup
        self._clock_arg = clock
        # the weights' own storage (detach shares it): in-place updates reach every call
        self._ws = [w.detach().requires_grad_() for w in (w_gate_HD, w_up_HD, w_down_DH)]
        self.choice: str | None = None
        self.timings: dict[str, list[float]] = {}
        self.reasons: dict[str, str] = {}
        self.calls: dict[str, int] = {}
        self.candidates: list[str] = []
        self._clock = None
        self._sig = None  # (x shape, x dtype, x device, dy shape, dy dtype) of the first call
        self._caps: dict[str, int] = {}  # no-sync candidate -> backup capacity (rows)
        self._remeasure: set[str] = set()
        self._warm: set[str] = set()  # candidates that ran once in their steady form
        self._issued: dict[str, int] = {}
        self._pending: list = []  # (candidate, clock handle) of timed calls not landed
        self._graph = None
        self._unchecked: dict[str, tuple[int, list]] = {}
        self._dl1: dict[torch.dtype, torch.Tensor] = {}
        self._medians_at_choice: dict[str, float] = {}
        self._last_stats = None  # FFNStats of the last eager call (the density rule reads it)

    # -- public ---------------------------------------------------------------------------------

    def __call__(self, x_ND: torch.Tensor, dy_ND: torch.Tensor) -> tuple:
        """One forward + backward (class docstring: the outputs). Exploration calls and, with
        ``check_each_call``, every call sync once to read the capacity guard.

        Raises:
            ValueError: x not (N, D) floating on the weights' device, N = 0, dy not x's shape,
                device and dtype, or a shape / dtype / device other than the first call's.
            TypeError: x or dy not a tensor.
            RuntimeError: under ``torch.inference_mode``.
        """
        if torch.is_inference_mode_enabled():
            raise RuntimeError("AutoFFNTrain: called under torch.inference_mode, where no "
                               "gradient can be computed (its outputs are gradients); use "
                               "torch.no_grad or neither")
        self._check_inputs(x_ND, dy_ND)
        with torch.enable_grad():  # the gradients are the op's outputs, under no_grad too
            if self.choice is not None:
                return self._steady(self.choice, x_ND, dy_ND, read=self.check_each_call)
            if self._clock is None:
                return self._rule_call(x_ND, dy_ND)
            return self._explore_call(x_ND, dy_ND)

    def explore(self, x_ND: torch.Tensor, dy_ND: torch.Tensor, max_calls: int = 1000) -> str:
        """Call the op on ``(x, dy)`` until it has a choice; returns it (the results of those
        calls are dropped). While ``ell_graph`` is captured each call passes the graph's own
        input buffers (:meth:`inputs`), filled with this x and dy once per set of buffers (a
        graph captured by earlier calls holds their inputs), so the calls copy nothing, as the
        steady calls of a caller that fills those buffers do not.

        Raises:
            RuntimeError: no choice after ``max_calls`` calls (a clock whose times never land).
        """
        filled = None  # the graph's x buffer once it holds x_ND
        for _ in range(max_calls):
            if self.choice is not None:
                return self.choice
            ins = self.inputs()
            if ins is not None and ins[0] is not filled:
                self._check_inputs(x_ND, dy_ND)  # another shape: its error, not copy_'s
                with torch.no_grad():  # the buffers may be leaves that require grad
                    ins[0].copy_(x_ND)
                    ins[1].copy_(dy_ND)
                filled = ins[0]
            self(*(ins or (x_ND, dy_ND)))
        if self.choice is None:
            raise RuntimeError(f"AutoFFNTrain: no choice after {max_calls} calls (timings "
                               f"landed: { {k: len(v) for k, v in self.timings.items()} })")
        return self.choice

    def check(self) -> None:
        """Read the capacity guards of the no-sync calls since the last check (one host sync per
        candidate that ran; nothing to read after calls that read their own guard).

        Raises:
            CapacityOverflow: a call since the last check had more heavy rows than its
                candidate's backup: its results were wrong (redo it; the candidate's next call
                measures its capacity again).
        """
        over = []
        for name, (cap, hs) in list(self._unchecked.items()):
            if hs and int(torch.stack(hs).max()) > cap:
                over.append(name)
                self._forget_capacity(name)
        self._unchecked.clear()
        if self._graph is not None:
            try:
                self._graph.check()
            except CapacityOverflow:
                over.append("ell_graph")
                self._forget_capacity("ell_graph")
        if over:
            raise CapacityOverflow(
                f"AutoFFNTrain: a call of {', '.join(over)} since the last check had more heavy "
                "rows than its dense backup holds: its results were wrong; redo those calls "
                "(the next call measures the capacity again)")

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The graph's static (x, dy) buffers while ``ell_graph`` is captured, else None. A call
        given exactly these (filled in place) copies nothing into the graph; a new capture (after
        an overflow) makes new ones, so ask again."""
        if self._graph is None:
            return None
        return self._graph.inputs["x"], self._graph.inputs["dy"]

    def medians(self) -> dict[str, float]:
        """candidate -> median ms of its landed timings (candidates without timings left out)."""
        return {k: statistics.median(v) for k, v in self.timings.items() if v}

    def summary(self) -> str:
        """One line: the choice, each candidate's median ms, and the reasons (for reports)."""
        med = ", ".join(f"{k} {v:.3f}" for k, v in self.medians().items())
        why = "; ".join(f"{k}: {v}" for k, v in self.reasons.items())
        return (f"{self.choice or 'exploring'}"
                + (f" (median ms: {med})" if med else "") + (f"; {why}" if why else ""))

    # -- setup and checks -------------------------------------------------------------------------

    def _check_inputs(self, x, dy) -> None:
        if not isinstance(x, torch.Tensor) or not isinstance(dy, torch.Tensor):
            raise TypeError(f"AutoFFNTrain: x and dy must be tensors; got "
                             f"{type(x).__name__}, {type(dy).__name__}")
        sig = (x.shape, x.dtype, x.device, dy.shape, dy.dtype)
        if sig == self._sig:
            return
        if self._sig is not None:
            n0, t0, d0 = self._sig[:3]
            raise ValueError(f"AutoFFNTrain: x is {tuple(x.shape)} {x.dtype} on {x.device} "
                             f"(dy {tuple(dy.shape)} {dy.dtype}); its first call was "
                             f"{tuple(n0)} {t0} on {d0} (dy {tuple(self._sig[3])} {self._sig[4]}): its timings, "
                             "capacities and graph are for that shape; use one AutoFFNTrain "
                             "per shape")
        check_train_args(x, *self._ws, "auto", "AutoFFNTrain")
        if x.shape[0] == 0:
            raise ValueError("AutoFFNTrain: x has no rows (N = 0)")
        if dy.shape != x.shape or dy.device != x.device or dy.dtype != x.dtype:
            raise ValueError(f"AutoFFNTrain: dy must have x's shape, dtype and device "
                             f"{tuple(x.shape)} {x.dtype} {x.device}; got {tuple(dy.shape)} "
                             f"{dy.dtype} {dy.device}")
        self._sig = sig
        self._setup(x)

    def _setup(self, x) -> None:
        names = ["dense", "ell_nosync"]
        if self.hot_units is not None:
            names.append("ell_hot")
        else:
            self.reasons["ell_hot"] = "no hot units given"
        if not self._want_graph:
            self.reasons["ell_graph"] = "graph=False"
        elif not x.is_cuda and self._graphs is None:
            self.reasons["ell_graph"] = f"CUDA graphs need CUDA tensors; x is on {x.device}"
        else:
            names.append("ell_graph")
        self.candidates = names
        self.calls = {k: 0 for k in names}
        self.timings = {k: [] for k in names}
        self._issued = {k: 0 for k in names}
        if not self.policy.train_measure:
            self._clock = None
        elif self._clock_arg is not None:
            self._clock = self._clock_arg
        elif x.is_cuda:
            self._clock = SyncedEventTimer()

    # -- the candidates ---------------------------------------------------------------------------

    def _dl1_for(self, l1: torch.Tensor) -> torch.Tensor:
        t = self._dl1.get(l1.dtype)
        if t is None:
            t = self._dl1[l1.dtype] = torch.full((), self.l1_coeff, dtype=l1.dtype,
                                                 device=l1.device)
        return t

    def _eager(self, fn, x, dy, **kw) -> tuple:
        ins = [x.detach().requires_grad_(), *self._ws]
        y, st = fn(*ins, **kw)
        grads = torch.autograd.grad([y, st.l1], ins, [dy.to(y.dtype), self._dl1_for(st.l1)])
        self._last_stats = st
        return (y.detach(), *grads, st.l1.detach(), st.heavy_rows)

    def _nosync(self, name, x, dy, backup_rows: int) -> tuple:
        hot = self.hot_units if name == "ell_hot" else None
        return self._eager(sparse_ffn_train, x, dy, policy=self.policy, backup_rows=backup_rows,
                           hot_units=hot)

    def _measure(self, name, x, dy) -> tuple:
        """A measuring call (exact, one host sync) that sets ``name``'s capacity (``ell_graph``
        measures ``ell_nosync``'s op, which it captures); drops ``name`` when every row is
        heavy."""
        out = self._nosync(name, x, dy, -1)
        heavy, n = int(out[6]), x.shape[0]
        self._remeasure.discard(name)
        if heavy >= n:
            self._drop(name, f"every row heavy ({heavy} of {n}): a no-sync backup holds at "
                             "most N - 1")
            return out
        self._caps[name] = backup_capacity_for(heavy)
        if name == "ell_nosync" and "ell_graph" not in self._caps:  # the same op: no 2nd call
            self._caps["ell_graph"] = self._caps[name]
        return out

    def _forget_capacity(self, name: str) -> None:
        """``name``'s next call measures its capacity again (``ell_graph``: then captures)."""
        self._remeasure.add(name)
        if name == "ell_graph":
            self._graph = None

    def _drop(self, name: str, why: str) -> None:
        self.reasons[name] = why
        if name in self.candidates:
            self.candidates.remove(name)
        if name == "ell_graph":
            self._graph = None
        if self.choice == name:  # the next fastest by the medians; dense is always there
            med = self._medians_at_choice
            self.choice = min(self.candidates, key=lambda c: (med.get(c, float("inf")),
                                                              CANDIDATES.index(c)))

    def _ready(self, name: str) -> bool:
        """Will ``name``'s next call run its steady form (not a measuring call or a capture)?"""
        if name in ("ell_nosync", "ell_hot"):
            return name in self._caps and name not in self._remeasure
        return name == "dense" or self._graph is not None

    def _run(self, name, x, dy) -> tuple[tuple, bool]:
        """One call as ``name``: (outputs, steady). steady False = a measuring call or a
        capture: exact, not timed, no guard left to read."""
        if name == "dense":
            return self._eager(dense_ffn_train, x, dy, with_stats=True,
                               ell_capacity=self.policy.ell_capacity), True
        if name != "ell_graph":
            if not self._ready(name):
                return self._measure(name, x, dy), False
            return self._nosync(name, x, dy, self._caps[name]), True
        if self._graph is not None:
            return self._graph(x=x, dy=dy), True
        if "ell_graph" in self._remeasure or "ell_graph" not in self._caps:
            return self._measure("ell_graph", x, dy), False
        try:
            self._graph = graphed_ffn_train(
                x, *self._ws, dy, backup_rows=self._caps["ell_graph"],
                l1_coeff=self.l1_coeff, policy=self.policy, warmup=self._warmup,
                graphs=self._graphs)
        except CapacityOverflow:  # these inputs have more heavy rows: measure again
            return self._measure("ell_graph", x, dy), False
        except Exception as e:  # noqa: BLE001 (a capture that fails drops the candidate)
            self._drop("ell_graph", f"capture failed: {type(e).__name__}: {str(e)[:160]}")
            return self._measure("ell_nosync", x, dy), False
        # exact, not steady: the build's warm-up calls passed the guard on these inputs
        return self._graph(x=x, dy=dy), False

    def _overflowed(self, name, out, n) -> bool:
        """Read ``name``'s guard for the call that returned ``out`` (one host sync)."""
        if name == "ell_graph":
            try:
                self._graph.check()
            except CapacityOverflow:
                return True
            return False
        return int(out[6]) > _backup_capacity(self._caps[name], n)

    def _guarded(self, name, out, x, dy, read: bool) -> tuple:
        """``out`` of a steady call, its capacity guard read (``read``; on an overflow the call
        is redone in the measuring mode) or left for :meth:`check`."""
        if name not in NOSYNC:
            return out
        if read:
            if not self._overflowed(name, out, x.shape[0]):
                return out
            self._forget_capacity(name)
            return self._measure(name, x, dy)
        if name != "ell_graph":  # the graph's own flag is sticky on the device
            _, hs = self._unchecked.setdefault(
                name, (_backup_capacity(self._caps[name], x.shape[0]), []))
            hs.append(out[6])
            if len(hs) > UNCHECKED_FOLD:  # bounded memory when the caller checks rarely
                hs[:] = [torch.stack(hs).max()]
        return out

    def _steady(self, name, x, dy, read: bool) -> tuple:
        out, steady = self._run(name, x, dy)
        return self._guarded(name, out, x, dy, read) if steady else out

    # -- how a call is picked -----------------------------------------------------------------------

    def _rule_call(self, x, dy) -> tuple:
        probe = "ell_hot" if self.hot_units is not None else "ell_nosync"
        self.calls[probe] += 1
        out = self._measure(probe, x, dy)
        n, h = x.shape[0], self._ws[0].shape[0]
        density = min(max(float(self._last_stats.nnz_sum) / (n * h), 0.0), 1.0)
        heavy = min(int(out[6]) / n, 1.0)
        path = self.policy.train_path(density, heavy)
        if path == "dense":
            choice = "dense"
        elif self.hot_units is not None and density >= self.policy.hot_min_density:
            choice = "ell_hot"
        else:
            choice = "ell_nosync"
        if choice not in self.candidates:  # every row heavy for the no-sync op
            choice = "dense"
        self.choice = choice
        self.reasons[choice] = (f"density rule (no clock): train_path(density {density:.4g}, "
                                f"heavy fraction {heavy:.4g}) = {path}")
        return out

    def _explore_call(self, x, dy) -> tuple:
        need = [c for c in self.candidates if self._issued[c] < self.trials]
        if not need:  # every timed call issued and some not landed (a lazy clock): time again
            for c in self.candidates:
                self._issued[c] = len(self.timings[c])
            need = [c for c in self.candidates if self._issued[c] < self.trials]
        name = min(need, key=lambda c: (self.calls[c], CANDIDATES.index(c)))
        self.calls[name] += 1
        timed = name in self._warm and self._ready(name)
        token = self._clock.start(name) if timed else None
        out, steady = self._run(name, x, dy)
        if token is not None:
            self._pending.append((name, self._clock.stop(token)))
            self._issued[name] += 1
        if steady:
            self._warm.add(name)
            out = self._guarded(name, out, x, dy, read=True)
        elif name == "ell_graph" and self._graph is not None:
            self._warm.add(name)  # captured: the build's warm-up calls compiled everything
        self._land(wait=all(self._issued[c] >= self.trials for c in self.candidates))
        return out

    def _land(self, wait: bool) -> None:
        still = []
        read = getattr(self._clock, "wait", None) if wait else None
        for name, handle in self._pending:
            ms = read(handle) if read is not None else self._clock.poll(handle)
            if ms is None:
                still.append((name, handle))
            elif name in self.timings:
                self.timings[name].append(float(ms))
        self._pending = still
        if all(len(self.timings[c]) >= self.trials for c in self.candidates):
            med = self._medians_at_choice = self.medians()
            self.choice = min(self.candidates, key=lambda c: (med[c], CANDIDATES.index(c)))
            if self.choice != "ell_graph":
                self._graph = None  # its private memory pool holds a call's intermediates


__all__ = ["CANDIDATES", "FFN_OUTPUTS", "AutoFFNTrain", "CapacityOverflow", "SyncedEventTimer"]
