"""Path policy of the sparse FFN: the ``auto`` thresholds and the training layout's capacities.

Every :class:`twell.nn.SparseGatedMLP` holds one :class:`FFNPolicy` (``policy=``, per layer); the
trainer builds it from ``ffn.policy`` (``train/config.py``), so it is in the run's resolved
``config.yaml`` and can be set per run from YAML or the command line
(``ffn.policy.infer_min_rows=4096``). Nothing is read from the environment at import:
:meth:`FFNPolicy.from_env` reads the ``TWELL_*`` overrides when a caller asks for them (the
benchmark scripts do).

Each default carries the one measurement behind it (one H200, M 16384, D 2048, H 5632, bf16
unless said); the run-by-run history is in ``BENCHMARKS.md``, "Policy defaults".
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

# FFNPolicy field -> the environment variable FFNPolicy.from_env reads for it
ENV_OVERRIDES = {
    "infer_density_threshold": "TWELL_AUTO_DENSITY",
    "infer_min_rows": "TWELL_AUTO_MIN_ROWS",
    "infer_min_flops": "TWELL_AUTO_MIN_FLOPS",
    "train_density_threshold": "TWELL_TRAIN_AUTO_DENSITY",
    "train_heavy_fraction": "TWELL_TRAIN_AUTO_HEAVY",
}


class PolicyValueError(ValueError):
    """A bad :class:`FFNPolicy` field. Its message names the field as ``FFNPolicy.<field>``;
    :meth:`named` gives the same line under another key (the trainer's ``ffn.policy.<field>``).
    """

    def __init__(self, field: str, rule: str, value: object, fix: str) -> None:
        self.field, self.rule, self.value, self.fix = field, rule, value, fix
        super().__init__(self.named("FFNPolicy."))

    def named(self, prefix: str) -> str:
        """The one-line message with the field named ``prefix + field``, and its fix."""
        key = prefix + self.field
        return f"{key} {self.rule}; got {self.value!r}. Set {key}={self.fix}."


@dataclass
class FFNPolicy:
    """Which path an FFN call takes, and the sparse training layout's capacities.

    Raises (on construction):
        PolicyValueError: (a ValueError) a fraction outside [0, 1], a negative or non-finite
            threshold, or a negative count; one line naming the field and its fix.
    """

    infer_density_threshold: float = 0.006
    """Inference ``auto``: dense cuBLAS when the layer's last measured density (active units /
    (N H)) is above this. TwELL won at 0.3 % (1.30x) and lost at 1 % (0.85x) (H200)."""
    infer_min_rows: int = 8192
    """Inference ``auto``: dense for calls with fewer token rows (M 2048 lost at every density,
    0.65x at 0.3 %, launch-bound; H200)."""
    infer_min_flops: float = 3e11
    """Inference ``auto``: dense when the dense FFN has fewer FLOPs (6 M D H gated, 4 M D H
    non-gated; 3e11 ~ 0.45 ms of cuBLAS): a small_l4 layer (D 768, H 2048) at 0.25 % ran 0.60x on
    TwELL, launch-bound (H200)."""
    infer_long_rows: int = 0
    """Inference TwELL: up to this many of a call's rows with the most non-zeros (those above
    ``infer_long_min_nnz``) run through a dense backup (two GEMMs of those rows) instead of the
    consumer, no host sync (a fixed top-k). The gated consumer walks a row in one program, NB
    non-zeros a step, so one row of ~2000 non-zeros (the densest tokens of a trained 1.5B
    model's middle layers) is ~500 dependent gathers that can outlast the rest of the call;
    128 rows cost 2 x 128 x 2 D H FLOPs (~6 GFLOP, ~10 us at the 1.5B shape). 0 = none (the
    default until timed on the H200: BENCHMARKS.md, "Next")."""
    infer_long_min_nnz: int = 256
    """Inference TwELL: a row joins the dense backup of ``infer_long_rows`` only with more
    non-zeros than this (shorter rows stay on the consumer even among the top-k)."""
    infer_heavy_first: bool = False
    """Inference TwELL: the consumer takes a call's rows in descending order of their non-zeros
    (``twell_ffn_apply``'s ``heavy_first``: one ``argsort`` of the row counts) so that the
    densest tokens start first instead of running alone at the end; the same bits. Off until
    timed on real layers (BENCHMARKS.md, "The overflowed tiles of the forward consumer")."""
    train_density_threshold: float = 0.10
    """Training ``auto``: the ELL kernels up to this density (L0 / H), else dense mode; 10 % is
    the densest case measured (i.i.d. 10 %: dense mode 0.99x vs the ELL op's fallback 0.90x,
    H200)."""
    train_heavy_fraction: float = 0.5
    """Training ``auto``: the ELL kernels only while at most this fraction of the tokens are heavy
    rows (above the ELL capacity); heavy-tailed 3 % with 32 % heavy ran 1.11x on the ELL path
    vs 1.00x in dense mode (H200)."""
    dense_row_fraction: float = 0.5
    """Sparse training op: when more than this fraction of a call's rows are heavy, the whole
    call runs through the dense backup (the trainer then measures the backup per call)."""
    ell_capacity: int = 0
    """Sparse training op: ELL slots per token row (KC); rows with more active units go to the
    dense backup. 0 = ``twell.stats.default_ell_capacity(H)`` (128 at H 5632, the paper's
    width)."""
    hot_unit_fraction: float = 1 / 64
    """Hot/cold split (``hot_units`` of the sparse ops, picked by
    ``twell.ops.hot_units.hot_unit_count``): a unit active on more than this fraction of the
    tokens goes through a dense slice. Cost model (H200, ~700 TFLOP/s, ~9 TB/s row gathers from
    L2): a dense slice costs ~18 N D FLOPs per unit over forward and backward (0.86 us at N 16384,
    D 2048), an ELL entry ~7 gathers of a 2 D-byte row (~3 ns); they break even near 1/61 of
    the tokens, whatever N and D. Inference alone (2 gathers against 4 N D FLOPs) breaks even
    near 1/78."""
    max_hot_units: int = 512
    """Hot/cold split: at most this many hot units per layer (k is rounded up to a multiple of
    16 first). 512 dense slices cost ~0.44 ms per fwd + bwd at N 16384, D 2048 (the cost model
    above), ~9 % of the dense FFN's 5.06 ms; a layer with more hot units than this is dense
    mode's (``train_path``)."""
    hot_min_density: float = 0.01
    """Hot/cold split: a layer whose density (active units per token / H) is below this takes
    no hot units. Measured on six recorded layers of the 1.5B and 2B bench models (one H200,
    training op against dense): at 0.19-0.32 % the split made the no-sync ELL op slower (1.22-1.77x
    -> 0.98-1.58x), at 3.1-4.6 % it made it 2x faster (0.57-0.60x -> 0.96-1.17x)."""
    backup_floor_fraction: float = 1 / 256
    """No-sync dense backup of the sparse training path: every capacity is at least this
    fraction of a call's rows plus one row per sequence (each sequence's first token is fully
    active in a trained model), so that a layer whose last steps had few heavy rows does not
    redo a step for the next one. Cost: a backup row costs 16 D H FLOPs per micro-step (forward
    u_R and y_R, backward five products and dh_R); at the 1.5B shape (D 2048, H 5632) 1/256 of
    a 16 x 2048-row call is 128 rows x 28 layers = 6.6e11 FLOPs, 0.19 % of the micro-step's
    3.5e14 training FLOPs (~0.3 % of its time at the backup GEMMs' lower throughput):
    BENCHMARKS.md, "No redone steps"."""
    train_measure: bool = True
    """Training ``auto``: choose each layer's path (``ell`` or ``dense``) by the measured time of
    its own FFN forward and backward in real training steps (CUDA events, read after the step's
    one host sync: ``twell.nn.chooser.MeasuredPathChooser``), the density rule above deciding
    until both paths have timings; False (and CPU runs, where nothing is timed) = the density
    rule alone."""
    train_timed_calls: int = 3
    """Training ``auto``, measured: FFN calls (micro-steps) of a path needed before its median
    time is compared; an exploration of the other path runs until it has this many fresh
    timings (the first 4 micro-steps of a step are timed: one step at 3 or more micro-steps per
    step, two for the very first exploration, whose first call is dropped, below 4)."""
    train_switch_margin: float = 0.02
    """Training ``auto``, measured: a layer changes path only when the other path's median is
    below ``(1 - margin)`` x its current path's (hysteresis: timing noise does not flip it), so
    a layer stays within ~2 % of the faster path (the issue's floor for ``auto`` is 0.98x)."""
    train_explore_every: int = 200
    """Training ``auto``, measured: steps between two explorations of a layer (the path it is
    not on, for the steps ``train_timed_calls`` needs), phases spread over the layers (one
    layer at a time up to 200 layers). Cost bound: one layer's FFN is ~2 % of a 1.5B step
    (18 D H of the 10.6 GFLOP a token); its slower path takes at worst ~1.7x as long (the
    densest recorded layer on ``ell`` ran 0.60x of dense), so one step of exploration costs
    <= 1.4 % of a step and 28 layers explored once per 200 steps <= 0.2 % of the run (0.4 % if
    each exploration needs two steps)."""
    train_remeasure_factor: float = 1.5
    """Training ``auto``, measured: a layer on ``dense`` explores ``ell`` again (outside its
    schedule) when its L0 has fallen by more than this factor since ``ell`` was last timed
    (the ELL op's time falls with L0; dense mode's does not depend on the activations)."""
    infer_measure: bool = True
    """Inference ``auto`` on CUDA: time the candidate paths (TwELL, the hybrid ELL forward when
    ``infer_ell``, dense) on the layer's first calls of each row-count bucket (CUDA events, read
    without blocking) and take the fastest (``twell.ops.auto``); False (and CPU tensors) = the
    density rule above, which picks TwELL or dense."""
    infer_ell: bool = True
    """Inference ``auto``, measured: also time the training layout's hybrid ELL forward
    (``twell.ops.ffn_train.ell_ffn_forward``, gated FFNs) as a third candidate. A row-count
    bucket's first ELL call synchronises the host (the measuring mode: the heavy-row count
    sizes its dense backup); later calls run its no-sync form (``backup_rows >= 0``, exact: heavy
    rows past the capacity take the overflow kernel) while the bucket's recorded count allows
    (``twell.ops.ffn._ell``), so set False where the forward is captured in a CUDA graph or must
    never block. On the recorded layers of a 2B model the no-sync form ran 1.11x of dense where
    TwELL ran 0.34x (3 % density), 2.02x vs 1.93x at 0.06 % (one H200, M 16384; BENCHMARKS.md,
    "Seventh session of 2026-12-06"; measured before the overflow kernel, which adds a few small
    launches a call, not yet timed)."""
    infer_timed_calls: int = 3
    """Inference ``auto``, measured: timed calls per path and row-count bucket, after untimed
    warm-up calls (``twell.ops.auto.WARMUP_CALLS``: one each, two for the ELL forward; their
    times include Triton's compilation); the decision compares medians."""
    infer_twell_margin: float = 0.02
    """Inference ``auto``, measured: a sparse path (TwELL, or the hybrid ELL forward when its
    median is below ``(1 - margin)`` x TwELL's: its host launches take about its GPU time,
    which its CUDA-event time does not show) is taken only when its median is below
    ``(1 - margin)`` x dense's, so a tie goes to dense (the target floor for ``auto`` is 0.98x
    of dense; a smaller win is within the noise of three timed calls). The name is older than
    the ELL candidate."""
    infer_remeasure_factor: float = 1.5
    """Inference ``auto``, measured: a bucket's choice is timed again when the layer's measured
    density has moved by more than this factor since the choice (TwELL's time grows with the
    density: 0.3 -> 1 % moved its speedup from 1.65x to 1.00x, H200)."""

    def __post_init__(self) -> None:
        for name in ("infer_density_threshold", "train_density_threshold",
                     "train_heavy_fraction", "dense_row_fraction", "hot_unit_fraction",
                     "hot_min_density", "infer_twell_margin", "backup_floor_fraction",
                     "train_switch_margin"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
                raise PolicyValueError(name, "must be a fraction in [0, 1]", v,
                                       "<a fraction in [0, 1]>")
        mf = self.infer_min_flops
        if not (isinstance(mf, (int, float)) and math.isfinite(mf) and mf >= 0):
            raise PolicyValueError("infer_min_flops", "must be a finite number >= 0", mf,
                                   "<a number >= 0>")
        for name in ("infer_min_rows", "ell_capacity", "max_hot_units", "infer_long_rows",
                     "infer_long_min_nnz"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise PolicyValueError(name, "must be an integer >= 0", v, "<int >= 0>" + (
                    " (0 = the default width)" if name == "ell_capacity" else ""))
        for name in ("infer_timed_calls", "train_timed_calls", "train_explore_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PolicyValueError(name, "must be an integer >= 1", v, "<int >= 1>")
        for name in ("infer_remeasure_factor", "train_remeasure_factor"):
            f = getattr(self, name)
            if not (isinstance(f, (int, float)) and math.isfinite(f) and f > 1.0):
                raise PolicyValueError(name, "must be a finite number > 1", f, "<a number > 1>")
        for name in ("infer_measure", "train_measure", "infer_heavy_first", "infer_ell"):
            if not isinstance(getattr(self, name), bool):
                raise PolicyValueError(name, "must be true or false", getattr(self, name),
                                       "<true or false>")

    @classmethod
    def from_env(cls, base: FFNPolicy | None = None,
                 environ: Mapping[str, str] | None = None) -> FFNPolicy:
        """``base`` (default: the defaults) with the ``TWELL_*`` overrides of ``environ`` (default
        ``os.environ``) applied: the one place environment variables set policy
        (:data:`ENV_OVERRIDES` lists them). Call it explicitly; nothing calls it at import.

        Raises:
            ValueError: a variable that does not parse as the field's type, or a bad value.
        """
        env = os.environ if environ is None else environ
        base = cls() if base is None else base
        kw = {}
        for f in dataclasses.fields(cls):
            var = ENV_OVERRIDES.get(f.name)
            if var is None or var not in env:
                continue
            typ = int if isinstance(getattr(base, f.name), int) else float
            try:
                kw[f.name] = typ(env[var])
            except ValueError:
                kind = "an integer" if typ is int else "a number"
                raise ValueError(f"{var}={env[var]!r} is not {kind} (FFNPolicy.{f.name})") from None
        return dataclasses.replace(base, **kw)

    def train_path(self, density: float, heavy_fraction: float = 0.0) -> str:
        """Training path of ``impl="auto"`` for a layer of measured density (L0 / H, a fraction)
        and heavy-row fraction (tokens above the ELL capacity / tokens, ``FFNStats.heavy_rows``).

        Returns ``"ell"`` (the ELL training kernels, ``twell.ops.ffn_train.sparse_ffn_train``)
        when ``density <= train_density_threshold`` and ``heavy_fraction <=
        train_heavy_fraction``, else ``"dense"`` (dense mode, ``dense_ffn_train``): the training
        path names of ``twell.nn.plan``.

        Raises:
            ValueError: density or heavy_fraction outside [0, 1] or NaN.
        """
        if not 0.0 <= density <= 1.0:
            raise ValueError(f"density must be a fraction in [0, 1]; got {density}")
        if not 0.0 <= heavy_fraction <= 1.0:
            raise ValueError(f"heavy_fraction must be a fraction in [0, 1]; got {heavy_fraction}")
        ok = density <= self.train_density_threshold and heavy_fraction <= self.train_heavy_fraction
        return "ell" if ok else "dense"

    def infer_dense(self, density: float | None, n_rows: int, dense_flops: float) -> bool:
        """Inference ``auto``: True when a call of ``n_rows`` token rows and ``dense_flops`` dense
        FLOPs, on a layer whose last measured density is ``density`` (None: not measured yet),
        goes to dense cuBLAS instead of TwELL."""
        return ((density is not None and density > self.infer_density_threshold)
                or n_rows < self.infer_min_rows or dense_flops < self.infer_min_flops)


__all__ = ["ENV_OVERRIDES", "FFNPolicy", "PolicyValueError"]
