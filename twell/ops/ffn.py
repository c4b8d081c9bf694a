"""The sparse FFN inference op: ``sparse_ffn`` (TwELL inference, dense fallback).

Shape legend: N tokens, D model width, H FFN width.

    gated:      y = (relu(x Wg^T) * (x Wu^T)) Wd^T
    non-gated:  y = relu(x Wu^T) Wd^T

Source: arXiv 2603.23198, TwELL inference (two kernels per FFN: gate GEMM +
pack, then the fused up + down projection at the non-zeros).

Paths, chosen per call:

* ``"twell"`` inference (no gradient needed): producer (cuBLAS gate + Triton
  pack) then the Triton consumer. Triton runs on CUDA tensors, or on CPU tensors when
  ``TRITON_INTERPRET=1`` was set before import; otherwise the pure-PyTorch
  reference of the same format (``twell.ops.reference``) runs, so CPU users
  get the same results.
* training is not done here: ``twell.ops.ffn_train.sparse_ffn_train`` is the training op
  (the hybrid ELL path; ``twell.nn.SparseGatedMLP`` calls it on its ``ell`` training path), and
  ``sparse_ffn`` refuses inputs that need a gradient.
* ``"ell"`` (``mode="auto"`` only, gated FFNs, ``policy.infer_ell``): the training op's hybrid
  ELL layout, forward alone (``twell.ops.ffn_train.ell_ffn_forward``: gate GEMM, compaction,
  SDDMM + SpMM of the light rows, dense backup of the heavy rows; arXiv 2603.23198): a
  row-count bucket's first call measures (one host synchronisation reads the heavy-row count,
  which sizes the dense backup), later calls use the no-sync mode with a capacity from the
  recorded counts, whose overflow rows a Triton kernel computes (exact on every input). It
  reads the state's cached ``Wd^T`` and takes no hot units (the hot set is TwELL's).
  ``FFNInfo.overflow_rows`` counts its heavy rows.
* ``mode="auto"``: dense cuBLAS for calls with fewer than ``policy.infer_min_rows`` token
  rows or fewer dense FLOPs than ``policy.infer_min_flops`` (:class:`twell.policy.FFNPolicy`).
  Otherwise, on CUDA, the fastest of TwELL, the ELL forward and dense as timed on the layer's
  first calls of each row-count bucket (``twell.ops.auto.MeasuredChoice``: CUDA events read
  without blocking, re-timed when the density moves; ``policy.infer_measure``); a sparse path
  only when it beats dense by ``policy.infer_twell_margin``. The fallback, on CPU and while
  the timed calls are in flight: dense when the layer's last measured density is above
  ``policy.infer_density_threshold``, else TwELL (the ELL forward is only ever chosen by
  measurement). The density comes from the previous call through a pinned host copy and a
  CUDA event (no host sync on the calling path); the first call goes TwELL.

Hot units (``hot_units``, a set S of hidden units; ``twell.ops.hot_units``): computed through
a dense slice, ``y += relu(g_S) (x Wu[S]^T) Wd[:, S]^T``, with g_S taken from the gate GEMM's
output and those columns zeroed before the pack, so TwELL holds the cold units only (its tiles
overflow less and the consumer gathers fewer rows). Statistics stay those of the whole FFN.

Long rows (``policy.infer_long_rows`` = k > 0): the gated consumer walks a row's non-zeros in one
program, so a row far longer than the rest (a trained model's densest tokens) can outlast the
call. The k rows with the most non-zeros, those above ``policy.infer_long_min_nnz``, have their
TwELL counts zeroed before the consumer (it writes 0 for them) and are computed by a dense backup,
``y_R = (relu(g_R) (x_R Wu^T)) Wd^T`` (two GEMMs of k rows), written over them; the counts are put
back for the statistics. No host sync (a fixed top-k); ``FFNInfo.long_rows`` counts them.

NaN/inf: a non-finite input row makes its gates NaN/inf, which count as active
(``not (g <= 0)``), so they propagate to y (such a row overflows its tiles and
takes the dense tile path). Inactive units are exact zeros: unlike dense
``0 * inf = NaN``, a non-finite up/down weight at an *inactive* unit does not
reach y (as in the paper's kernels).

Overflow: a (row, tile) with more active units than the TwELL capacity is
computed densely inside the consumer (never dropped or double-counted);
``FFNInfo.overflow_rows`` counts the rows that took that path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twell.format import check_width, words_per_tile
from twell.ops.auto import MeasuredChoice, candidates, row_bucket
from twell.ops.hot_units import check_hot_units
from twell.policy import FFNPolicy
from twell.stats import FFNStats, stats_from_counts


class FFNInfo:
    """What one ``sparse_ffn`` call did (device tensors: reading them syncs).

    The TwELL path hands the counts over as zero-argument callables and each is reduced on its
    first read (then kept): the call itself launches none of the diagnostics' reductions, which
    only a bench or a test reads (with them the TwELL forward ran 18 kernels a call, ~55 us of
    them small; without, 8 and ~11 us: H200 profiles, ``BENCHMARKS.md``, seventh session of
    2026-12-06).

    Attributes:
        path: "twell" (Triton kernels), "twell-torch" (PyTorch reference of
            the format), "ell" (the hybrid ELL forward, ``ell_ffn_forward``), "dense" (cuBLAS)
            or "train" (training kernels).
        density: scalar fp32 tensor, active units / (N * H) (None if unknown).
        overflow_rows: scalar int tensor, rows with at least one tile over
            capacity, computed densely for those tiles (None on dense paths); on the "ell"
            path the heavy rows (more active units than the ELL capacity), computed whole by
            its dense backup.
        overflow_tiles: scalar int tensor, (row, tile) pairs over capacity (both counted from
            the TwELL counts, long rows included, though those run in the dense backup).
        long_rows: scalar int tensor, rows computed by the dense backup of the longest rows
            (``policy.infer_long_rows``; None when off or on other paths).

    Each argument of the constructor after ``path`` is a tensor, None, or a zero-argument
    callable returning the tensor.
    """

    _FIELDS = ("density", "overflow_rows", "overflow_tiles", "long_rows")
    __slots__ = ("_values", "path")

    def __init__(self, path: str, density=None, overflow_rows=None, overflow_tiles=None,
                 long_rows=None) -> None:
        self.path = path
        self._values = dict(zip(self._FIELDS, (density, overflow_rows, overflow_tiles,
                                               long_rows)))

    def _get(self, name: str) -> torch.Tensor | None:
        v = self._values[name]
        if callable(v):
            v = self._values[name] = v()
        return v

    density = property(lambda self: self._get("density"))
    overflow_rows = property(lambda self: self._get("overflow_rows"))
    overflow_tiles = property(lambda self: self._get("overflow_tiles"))
    long_rows = property(lambda self: self._get("long_rows"))

    def __repr__(self) -> str:
        shown = ("<not read>" if callable(v) else repr(v) for v in self._values.values())
        return f"FFNInfo(path={self.path!r}, " + ", ".join(
            f"{k}={v}" for k, v in zip(self._FIELDS, shown)) + ")"


DENSE_RECHECK_EVERY = 16  # "auto" on the dense path re-measures the density every this many calls


class TwELLState:
    """Per-layer measured state of the sparse FFN (held by ``SparseGatedMLP``; never global). The
    thresholds that act on it are policy (:class:`twell.policy.FFNPolicy`, passed per call).

    Attributes:
        factor: TwELL compression factor (8, 4 or 2).
        density: the latest measured density whose copy has landed (Python float; read without
            blocking), or None.
        dense_calls: calls that "auto" sent to the dense path (the density is measured on every
            ``DENSE_RECHECK_EVERY``-th of them, and on every TwELL call).
        last_info: :class:`FFNInfo` of the last call.
        consumer_kwargs: overrides for the consumer (``twell_ffn_apply``:
            nb, rows, num_warps, k, prefetch).
        pack_kwargs: overrides for the packer (``pack_dense``: block_m, num_warps).
        auto: :class:`twell.ops.auto.MeasuredChoice`, the measured ``auto`` choice per row-count
            bucket (``timer``: its timer, None = CUDA events on CUDA, none elsewhere).
    """

    def __init__(self, factor: int = 8, timer=None) -> None:
        words_per_tile(factor)
        self.factor = factor
        self.auto = MeasuredChoice(timer)
        self.dense_calls = 0
        self.last_info: FFNInfo | None = None
        self.consumer_kwargs: dict = {}
        self.pack_kwargs: dict = {}
        self._wdt: torch.Tensor | None = None
        self._wdt_key: tuple | None = None
        self._density = HostScalar()
        # the "ell" path's latest heavy-row count per row-count bucket (_ell_backup_rows)
        self._ell_heavy: dict[int, HostScalar] = {}

    def down_t(self, w_down_DH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(H, D) contiguous copy of ``w_down_DH.T`` in ``dtype``, cached until the weight changes.

        The key is the storage pointer, shape, dtype and the tensor's version
        counter (bumped by every in-place update: optimizer steps,
        ``load_state_dict``, ``copy_``).
        """
        try:
            version = w_down_DH._version
        except RuntimeError:  # inference tensors have no version counter: key on storage only
            version = None
        key = (w_down_DH.data_ptr(), tuple(w_down_DH.shape), w_down_DH.dtype, w_down_DH.device,
               version, dtype)
        if self._wdt is None or self._wdt_key != key:
            with torch.no_grad():
                self._wdt = w_down_DH.detach().T.to(dtype).contiguous()
            self._wdt_key = key
        return self._wdt

    def clear_cache(self) -> None:
        """Drop the cached ``Wd^T``. Call it when the weight may have changed without its version
        counter showing it: FSDP2 all-gathers the unsharded weight into fresh storage whose
        version stays 0, and a reused allocation can repeat the pointer (train/parallel.py)."""
        self._wdt = self._wdt_key = None

    def record_density(self, dens: torch.Tensor, scale: float = 1.0) -> None:
        """Store this call's density, ``float(dens) * scale`` (scalar tensor; ``scale`` lets a
        caller hand over a count and leave the division to the host), for a later call's
        dispatch without a host sync (:attr:`density` reads it once it has landed)."""
        self._density.put(dens, scale)

    @property
    def density(self) -> float | None:
        """The latest density whose copy has landed (never blocks)."""
        return self._density.get()

    def _ell_backup_rows(self, n: int, dense_row_fraction: float) -> int:
        """The "ell" path's ``backup_rows`` for a call of N rows: -1 (measure: one host sync)
        until a heavy-row count of N's row-count bucket has landed on the host, then the
        no-sync capacity ``backup_capacity_for(latest landed count)`` (heavy rows beyond it go
        to the overflow kernel: exact, no sync). Also -1 while that count is above
        ``dense_row_fraction * N``: only the measuring mode has the all-dense fallback. The
        latest count, not the largest: one burst of heavy rows must not pin the bucket to the
        measuring mode's sync, or to a backup of that burst's size (the backup's GEMMs run at
        the capacity), for good; a call above the capacity is exact anyway and raises the
        next calls' capacity. Never blocks."""
        from twell.ops.ffn_train import backup_capacity_for

        rec = self._ell_heavy.get(row_bucket(n))
        heavy = None if rec is None else rec.get()
        if heavy is None or heavy > dense_row_fraction * n:
            return -1
        return backup_capacity_for(int(heavy))

    def _record_ell_heavy(self, n: int, heavy: torch.Tensor, landed: bool = False) -> None:
        """Keep the "ell" path's heavy-row count ((1,) int32, the op's) for N's bucket with no
        host sync (:class:`HostScalar`), read by :meth:`_ell_backup_rows`. ``landed``: a
        measuring call (it has synchronised once already): the count is read now (a second
        sync), so the next call runs the no-sync mode at this count's capacity
        (``MeasuredChoice``'s second ELL warm-up; after a re-timing, ``BucketTimes.restart``'s
        untimed ELL call). Measuring calls are a bucket's first, a re-timing's first ELL call
        when the old count is above ``dense_row_fraction``, and the all-dense regime (R above
        it), where ``auto`` picks dense anyway."""
        rec = self._ell_heavy.setdefault(row_bucket(n), HostScalar())
        rec.put(heavy.cpu() if landed else heavy)


class HostScalar:
    """A device scalar's latest value on the host without a host sync.

    :meth:`put` starts a non-blocking copy of a one-element tensor into a pinned host buffer
    and records an event; :meth:`get` returns the latest value whose copy has landed (None
    before the first), never blocking. One copy is in flight at a time: a :meth:`put` while
    the previous copy is still in flight does nothing, so back-to-back calls that keep the
    GPU a few calls behind the host still see a value land (re-recording each call would
    move the event forward for ever). A CPU tensor is read at once. Source: ours (the no-sync
    dispatch of ``sparse_ffn``'s ``auto``).
    """

    def __init__(self) -> None:
        self._value: float | None = None
        self._host: torch.Tensor | None = None
        self._event = None
        self._scale = 1.0

    def put(self, t: torch.Tensor, scale: float = 1.0) -> None:
        """Copy one-element ``t`` (any dtype, any shape of one element) times ``scale`` to the
        host, without a sync; NaN / inf kept.

        Raises:
            ValueError: ``t`` has not exactly one element.
        """
        if t.numel() != 1:
            raise ValueError(f"HostScalar.put: expected a one-element tensor; got shape "
                             f"{tuple(t.shape)}")
        if not t.is_cuda:
            self._value = float(t.reshape(-1)[0]) * scale
            self._event = None  # an older copy in flight must not replace it when it lands
            return
        if self._event is not None:
            if not self._event.query():
                return
            self.get()
        if self._host is None or self._host.dtype != t.dtype:
            self._host = torch.empty((1,), dtype=t.dtype, pin_memory=True)
        self._host.copy_(t.detach().reshape(1), non_blocking=True)
        self._scale = scale
        self._event = torch.cuda.Event()
        # on the stream the copy went to: t's device's, which need not be the current device
        self._event.record(torch.cuda.current_stream(t.device))

    def get(self) -> float | None:
        """The latest landed value, or None if none has landed yet (never blocks)."""
        if self._event is not None and self._event.query():
            self._value = float(self._host[0]) * self._scale
            self._event = None
        return self._value


def _triton_ok(t: torch.Tensor) -> bool:
    if t.is_cuda:
        return True
    try:
        from triton import knobs
        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # triton missing or too old: reference path
        return False


def _check(x_ND, w_gate_HD, w_up_HD, w_down_DH) -> None:
    if x_ND.dim() != 2:
        raise ValueError(f"x_ND must be 2-D (N, D); got {tuple(x_ND.shape)}")
    d = x_ND.shape[1]
    h = w_up_HD.shape[0]
    if w_up_HD.shape != (h, d) or (w_gate_HD is not None and w_gate_HD.shape != (h, d)):
        raise ValueError(
            f"w_up_HD/w_gate_HD must be (H, D={d}); got {tuple(w_up_HD.shape)}, "
            f"{None if w_gate_HD is None else tuple(w_gate_HD.shape)}"
        )
    if w_down_DH.shape != (d, h):
        raise ValueError(f"w_down_DH must be (D={d}, H={h}); got {tuple(w_down_DH.shape)}")
    check_width(h)
    ws = [w for w in (w_gate_HD, w_up_HD, w_down_DH) if w is not None]
    if x_ND.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x_ND dtype must be float16, bfloat16 or float32; got {x_ND.dtype}")
    if any(w.dtype != x_ND.dtype for w in ws):
        raise ValueError(
            f"x_ND ({x_ND.dtype}) and the weights ({[w.dtype for w in ws]}) must share a dtype "
            "(or run under torch.autocast)"
        )
    if any(w.device != x_ND.device for w in ws):
        raise ValueError(f"x_ND and the weights must be on one device; got {x_ND.device}, "
                         f"{[w.device for w in ws]}")


def _dense(x_ND, w_gate_HD, w_up_HD, w_down_DH, with_stats, measure=True):
    if w_gate_HD is not None and _triton_ok(x_ND) and x_ND.dtype != torch.float64:
        return _dense_fused(x_ND, w_gate_HD, w_up_HD, w_down_DH, with_stats, measure)
    from twell.stats import stats_from_activations

    pre = F.linear(x_ND, w_gate_HD if w_gate_HD is not None else w_up_HD)
    g = F.relu(pre)
    h = g * F.linear(x_ND, w_up_HD) if w_gate_HD is not None else g
    y = F.linear(h, w_down_DH)
    if with_stats:
        stats = stats_from_activations(h, ~(g <= 0))
        dens = stats.nnz_sum / max(pre.numel(), 1)
    elif measure:  # 1/16 of the rows is enough to steer "auto"
        stats = None
        dens = (~(pre[::16] <= 0)).float().mean() if pre.numel() else pre.new_zeros((), dtype=torch.float32)
    else:
        return y, None, None
    return y, stats, dens.float()


def _dense_fused(x_ND, w_gate_HD, w_up_HD, w_down_DH, with_stats, measure):
    """Gated dense path with one fused Triton pass for ``h = relu(g) * u`` (and, when asked, the
    statistics: per-row sum |h| and L0, per-unit counts) instead of PyTorch's ReLU and multiply
    passes and its separate statistics reductions. Same outputs as the PyTorch dense path."""
    from twell.ops.elementwise import dense_fwd

    n, h = x_ND.shape[0], w_up_HD.shape[0]
    g = F.linear(x_ND, w_gate_HD)
    u = F.linear(x_ND, w_up_HD)
    hh, l1_N, nnz_N, counts = dense_fwd(g, u, stats=with_stats or measure)
    del g, u
    y = F.linear(hh, w_down_DH)
    if not (with_stats or measure):
        return y, None, None
    nnz_sum = nnz_N.sum().float()
    dens = nnz_sum / max(n * h, 1)
    stats = (stats_from_counts(l1_N.mean() if n else l1_N.sum(), nnz_N, counts)
             if with_stats else None)
    return y, stats, dens


def _empty_stats(x_ND, h):
    z = torch.zeros((), dtype=torch.float32, device=x_ND.device)
    return FFNStats(l1=z, nnz_sum=z.clone(), nnz_max=z.clone(),
                    active_counts=torch.zeros(h, dtype=torch.int32, device=x_ND.device), n_tokens=0)


def sparse_ffn(
    x_ND: torch.Tensor,
    w_gate_HD: torch.Tensor | None,
    w_up_HD: torch.Tensor,
    w_down_DH: torch.Tensor,
    *,
    with_stats: bool = True,
    mode: str = "twell",
    state: TwELLState | None = None,
    policy: FFNPolicy | None = None,
    hot_units: torch.Tensor | None = None,
) -> tuple[torch.Tensor, FFNStats | None]:
    """ReLU(-gated) FFN inference through TwELL, with sparsity statistics.

    Args:
        x_ND: (N, D) fp16/bf16/fp32 (any strides). Under ``torch.autocast``
            x and the weights are cast to the autocast dtype.
        w_gate_HD: (H, D) gate weight, or None for the non-gated FFN.
        w_up_HD: (H, D) up weight.
        w_down_DH: (D, H) down weight (``down_proj.weight``).
        with_stats: also return :class:`FFNStats` (l1 = mean over rows of
            sum |h|; nnz and per-column active counts from the TwELL counts).
            Inference stats carry no gradient. NaN gates count as active here.
        mode: "twell" (always TwELL) or "auto" (the fastest of TwELL, the hybrid ELL
            forward and dense as timed on CUDA, else dense above the density threshold; see
            the module docstring).
        state: per-layer :class:`TwELLState` (cached ``Wd^T``, density for
            "auto", ``last_info``); a throwaway one when None.
        policy: :class:`twell.policy.FFNPolicy` (``auto``'s thresholds and measurement); the
            defaults when None.
        hot_units: (k,) int64 tensor on x's device, unique hidden units computed through a
            dense slice (TwELL holds the rest; see the module docstring); None or empty = none
            (``twell.ops.hot_units.hot_units_from_counts`` picks them). The TwELL path's: the
            "ell" path ignores them.

    Returns:
        ``(y_ND, stats or None)``; y in x's (or autocast) dtype on every path. The call's
        :class:`FFNInfo` is ``state.last_info``. The "ell" path's stats are the TwELL
        path's (``heavy_rows`` None on both; its heavy rows are ``FFNInfo.overflow_rows``) on
        finite inputs. With non-finite values the two differ: an inf / NaN in Wu or Wd at an
        inactive unit reaches the "ell" path's heavy rows (0 x inf in its dense backup, as in
        dense PyTorch) but not TwELL's y, and an inf in x makes its l1 NaN where TwELL's is inf.

    Raises:
        ValueError: bad shapes, dtypes, devices, mode, or H >= 65536.
        ValueError: a gradient is needed (gradients enabled and an input that requires one):
            the training op is ``twell.ops.ffn_train.sparse_ffn_train``.
    """
    if mode not in ("twell", "auto"):
        raise ValueError(f"sparse_ffn mode must be 'twell' or 'auto'; got {mode!r}")
    ws = [w for w in (w_gate_HD, w_up_HD, w_down_DH) if w is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in [x_ND, *ws]):
        raise ValueError("sparse_ffn is the inference op and computes no gradients; run it under "
                         "torch.no_grad() (or on tensors that need none), or train with "
                         "twell.ops.ffn_train.sparse_ffn_train")

    state = state if state is not None else TwELLState()
    policy = policy if policy is not None else FFNPolicy()
    if torch.is_autocast_enabled(x_ND.device.type):
        dt = torch.get_autocast_dtype(x_ND.device.type)
        x_ND = x_ND.to(dt)
        w_gate_HD = None if w_gate_HD is None else w_gate_HD.to(dt)
        w_up_HD = w_up_HD.to(dt)
        w_down_DH_c = w_down_DH.to(dt)
    else:
        w_down_DH_c = w_down_DH
    _check(x_ND, w_gate_HD, w_up_HD, w_down_DH_c)
    h = w_up_HD.shape[0]
    if x_ND.shape[0] == 0:
        state.last_info = FFNInfo("twell")
        y = x_ND.new_empty(0, w_down_DH.shape[0])
        return y, (_empty_stats(x_ND, h) if with_stats else None)

    hot = check_hot_units(hot_units, h, x_ND.device, "sparse_ffn")
    with torch.autocast(x_ND.device.type, enabled=False):
        path, token = "twell", None
        if mode == "auto":
            n = x_ND.shape[0]
            flops = (6 if w_gate_HD is not None else 4) * x_ND.numel() * h  # dense FFN
            density = state.density
            small = n < policy.infer_min_rows or flops < policy.infer_min_flops
            paths = candidates(w_gate_HD is not None, policy)
            path, token = ((None, None) if small
                           else state.auto.begin(x_ND, n, density, policy, paths))
            if path is None:  # the size and density rules (CPU; measurement not decided)
                path = "dense" if policy.infer_dense(density, n, flops) else "twell"
        try:
            if path == "dense":
                out = _auto_dense(x_ND, w_gate_HD, w_up_HD, w_down_DH_c, with_stats, state)
            elif path == "ell":
                out = _ell(x_ND, w_gate_HD, w_up_HD, w_down_DH, w_down_DH_c, with_stats, state,
                           policy)
            else:
                out = _twell(x_ND, w_gate_HD, w_up_HD, w_down_DH, w_down_DH_c.dtype,
                             with_stats, state, hot, policy)
        except BaseException:  # e.g. out of memory: the timed call is issued again later
            state.auto.cancel(token)
            raise
        state.auto.end(token, policy)
        return out


def _auto_dense(x_ND, w_gate_HD, w_up_HD, w_down_DH, with_stats, state):
    """``auto``'s dense path; the density is re-measured every DENSE_RECHECK_EVERY-th call
    (measuring it every call cost 1-4 % of the dense FFN on the H200)."""
    measure = state.density is None or state.dense_calls % DENSE_RECHECK_EVERY == 0
    state.dense_calls += 1
    y, stats, d = _dense(x_ND, w_gate_HD, w_up_HD, w_down_DH, with_stats, measure)
    if d is not None:
        state.record_density(d)
    state.last_info = FFNInfo("dense", density=d)
    return y, stats


def _ell(x_ND, w_gate_HD, w_up_HD, w_down_DH, w_down_DH_c, with_stats, state, policy):
    """``auto``'s ``"ell"`` path: the hybrid ELL forward (``twell.ops.ffn_train.ell_ffn_forward``)
    with the policy's ELL capacity and all-dense fraction, reading the state's cached ``Wd^T``.
    A row-count bucket's first call (``MeasuredChoice``'s first untimed warm-up) runs the
    measuring mode (one host sync reads the heavy-row count R, and a second lands it at once);
    once a count has landed on the host (read without blocking:
    ``TwELLState._ell_backup_rows``), later calls run the no-sync mode
    with ``backup_capacity_for(latest R landed)`` rows, exact on every input (heavy rows past
    the capacity go to the overflow kernel). Calls record their R without blocking (one copy in
    flight a bucket: ``TwELLState._record_ell_heavy``), so the capacity follows the layer's
    recent counts. Exact in both modes. No hot
    units: the hot set a caller passes is TwELL's (it takes those units out of TwELL's tiles),
    and this path ignores it (y is the same FFN either way on finite weights; see
    ``sparse_ffn``'s Returns for non-finite ones). The density is recorded for the next
    call as on the TwELL path; ``FFNInfo.overflow_rows`` is the heavy-row count (tokens above the
    ELL capacity, computed by the dense backup and, past its capacity, the overflow kernel).
    ``w_down_DH_c``: Wd in the compute dtype (the
    autocast cast), for the op's checks."""
    from twell.ops.ffn_train import ell_ffn_forward

    n, h = x_ND.shape[0], w_up_HD.shape[0]
    wdt = state.down_t(w_down_DH, w_down_DH_c.dtype)
    # with_stats always: the op computes l1, the row and unit counts anyway and the density
    # needs the row counts' sum; nnz_max and the heavy count's cast are two small reductions
    backup_rows = state._ell_backup_rows(n, policy.dense_row_fraction)
    y, heavy, stats = ell_ffn_forward(x_ND, w_gate_HD, w_up_HD, w_down_DH_c, policy=policy,
                                      backup_rows=backup_rows, w_down_t_HD=wdt, with_stats=True)
    state._record_ell_heavy(n, heavy, landed=backup_rows < 0)
    nnz_sum = stats.nnz_sum  # one reduction; the density's division is the host's
    state.record_density(nnz_sum, scale=1.0 / float(n * h))
    state.last_info = FFNInfo("ell", density=lambda: nnz_sum / float(n * h),
                              overflow_rows=lambda: heavy.reshape(()))
    if not with_stats:
        return y, None
    stats.heavy_rows = None  # as on the TwELL path (its count is FFNInfo.overflow_rows)
    return y, stats


def _twell(x_ND, w_gate_HD, w_up_HD, w_down_DH, wdt_dtype, with_stats, state, hot=None,
           policy=None):
    gated = w_gate_HD is not None
    long_mask = None
    n, h = x_ND.shape[0], w_up_HD.shape[0]
    if not _triton_ok(x_ND):
        from twell.ops.reference import twell_ffn_torch

        wd = w_down_DH.to(wdt_dtype)
        r = twell_ffn_torch(x_ND, w_gate_HD, w_up_HD, wd, factor=state.factor, hot_units=hot)
        tw, l1_rows, colcnt, path = r["tw"], r["l1_rows"], r["active_counts"], "twell-torch"
        y, nnz_row = r["y"], r["nnz_rows"]
    else:
        from twell.ops.twell_ffn import twell_ffn_apply
        from twell.ops.twell_pack import pack_dense

        x_ND = x_ND if x_ND.stride(1) == 1 else x_ND.contiguous()
        dense = F.linear(x_ND, w_gate_HD if gated else w_up_HD)  # cuBLAS on GPU
        g_S = None
        if hot is not None:  # the hot units' pre-activation; TwELL and its overflow see zeros
            g_S = dense.index_select(1, hot)
            dense.index_fill_(1, hot, 0)
        tw, colcnt = pack_dense(dense, state.factor, stats=with_stats, **state.pack_kwargs)
        wdt = state.down_t(w_down_DH, wdt_dtype)
        nnz_row = tw.nnz_per_row()  # the packer's (before _hide_long_rows changes the counts)
        k_long = 0 if policy is None else min(policy.infer_long_rows, n)
        if k_long > 0:
            top, is_long, saved = _hide_long_rows(tw, nnz_row, k_long, policy.infer_long_min_nnz)
            packed_rows = tw.row_nnz, tw.row_overflow
            tw.row_nnz, tw.row_overflow = None, None  # the consumer sees the hidden counts
        launch = {"heavy_first": policy is not None and policy.infer_heavy_first,
                  **state.consumer_kwargs}
        y, l1_rows = twell_ffn_apply(
            tw, dense, wdt, x_MD=x_ND if gated else None, w_up_HD=w_up_HD if gated else None,
            stats=with_stats, out_dtype=x_ND.dtype, **launch,
        )
        if k_long > 0:
            tw.counts.index_copy_(0, top, saved)  # the true counts again, for the statistics
            tw.row_nnz, tw.row_overflow = packed_rows
            _long_backup(y, l1_rows, x_ND, dense, w_up_HD if gated else None, wdt, top, is_long)
            long_mask = is_long  # (k,) bool: FFNInfo.long_rows counts it when read
        if g_S is not None:
            nnz_row = _hot_slice(y, l1_rows, colcnt, nnz_row, x_ND, w_up_HD if gated else None,
                                 wdt, hot, g_S)
        path = "twell"
    nnz_sum = nnz_row.sum(dtype=torch.float32)  # one reduction; the density's division is the host's
    state.record_density(nnz_sum, scale=1.0 / float(n * h))
    ovf = tw.row_overflow  # (N,) int32: the closures keep it, not the TwELL buffer
    state.last_info = FFNInfo(
        path, density=lambda: nnz_sum / float(n * h),
        overflow_rows=((lambda: (ovf > 0).sum()) if ovf is not None
                       else tw.overflow_rows().sum()),
        overflow_tiles=(lambda: ovf.sum()) if ovf is not None else tw.n_overflow_tiles(),
        long_rows=None if long_mask is None else long_mask.sum)
    stats = None
    if with_stats:
        stats = FFNStats(l1=l1_rows.mean(), nnz_sum=nnz_sum, nnz_max=nnz_row.max().float(),
                         active_counts=colcnt, n_tokens=n)
    return y, stats


def _hide_long_rows(tw, nnz_row, k, min_nnz):
    """The ``k`` rows with the most non-zeros, ``top`` (k,) int64; ``is_long`` (k,) bool: those
    with more than ``min_nnz``, whose TwELL counts are zeroed in place so that the consumer
    writes y = 0 and L1 = 0 for them (a fixed k: no host sync); ``saved`` (k, T) int32, their
    counts, which the caller puts back after the consumer."""
    top = torch.topk(nnz_row, k, sorted=False).indices
    is_long = nnz_row.index_select(0, top) > min_nnz
    saved = tw.counts.index_select(0, top)
    tw.counts.index_copy_(0, top, torch.where(is_long[:, None], 0, saved))
    return top, is_long, saved


def _long_backup(y, l1_rows, x_ND, dense, w_up_HD, wdt, top, is_long):
    """The long rows' dense backup, written in place into the rows ``top[is_long]`` of y (and of
    ``l1_rows`` when given): h = relu(g) (x Wu^T) (gated; relu(g) non-gated) from the
    pre-activation ``dense`` (N, H) (hot units' columns zeroed: their slice is added after), with
    exact zeros at inactive units and relu(NaN) = NaN, then y_R = h Wd^T. Rows of ``top`` that
    are not long keep the consumer's outputs. Like the training op's heavy rows, a non-finite
    down weight at an inactive unit reaches these rows (0 x inf in the GEMM)."""
    g = dense.index_select(0, top)
    act = ~(g <= 0)  # NaN active
    h = g.float().clamp(min=0)
    if w_up_HD is not None:
        u = torch.matmul(x_ND.index_select(0, top), w_up_HD.t()).float()
        h = torch.where(act, h * u, 0.0)
    y_R = torch.matmul(h.to(wdt.dtype), wdt).to(y.dtype)
    long2 = is_long[:, None]
    y.index_copy_(0, top, torch.where(long2, y_R, y.index_select(0, top)))
    if l1_rows is not None:
        l1_rows.index_copy_(0, top, torch.where(is_long, h.abs().sum(1),
                                                l1_rows.index_select(0, top)))


def _hot_slice(y, l1_rows, colcnt, nnz_row, x_ND, w_up_HD, wdt, hot, g_S):
    """The hot units' dense slice of the inference path, added in place: y += h_S Wd[:, S]^T
    with h_S = relu(g_S) (x Wu[S]^T) (gated; relu(g_S) non-gated), relu(NaN) = NaN; the per-row
    L1 and the per-unit counts (when given) gain the hot units'. Returns the per-row active
    counts with the hot units'."""
    act = ~(g_S <= 0)  # NaN active
    h_S = g_S.clamp(min=0)
    if w_up_HD is not None:
        h_S = h_S * torch.matmul(x_ND, w_up_HD.index_select(0, hot).t())
    y.addmm_(h_S.to(y.dtype), wdt.index_select(0, hot).to(y.dtype))
    if l1_rows is not None:
        l1_rows += h_S.float().abs().sum(1)
    if colcnt is not None:
        colcnt.index_add_(0, hot, act.sum(0, dtype=torch.int32))
    return nnz_row + act.sum(1, dtype=torch.int32)


__all__ = ["DENSE_RECHECK_EVERY", "FFNInfo", "TwELLState", "sparse_ffn"]
