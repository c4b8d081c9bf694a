"""ReLU-gated FFN with activation statistics, dense (PyTorch) or sparse (TwELL).

Shape legend: B batch, T sequence, D model width (hidden_size), H FFN width
(intermediate_size), N = B*T tokens.

Source: arXiv 2603.23198 (FFN definition and L1 regularizer, "The L1 regularizer"). The gated FFN is exactly transformers' ``LlamaMLP`` with
``hidden_act="relu"``::

    h = relu(x Wg^T) * (x Wu^T)        (gated)
    h = relu(x Wu^T)                   (non-gated)
    y = h Wd^T

Parameter names ``gate_proj``/``up_proj``/``down_proj`` match ``LlamaMLP`` so a
checkpoint of a model using this module loads into stock ``LlamaForCausalLM``.
"""

from __future__ import annotations

import torch
from torch import nn

from twell.nn.plan import FFN_IMPLS, LayerPlan, default_path
from twell.ops.reference import gated_ffn_torch
from twell.policy import FFNPolicy
from twell.stats import FFNStats


class SparseGatedMLP(nn.Module):
    """Drop-in replacement for ``LlamaMLP`` (relu) that reports sparsity stats.

    Args:
        hidden_size: D, model width.
        intermediate_size: H, FFN width.
        gated: gated FFN (``relu(gate) * up``) if True, else ``relu(up)``
            (the non-gated variant has no ``gate_proj``).
        impl: ``"torch"`` (dense PyTorch), ``"twell"`` (TwELL / ELL Triton kernels) or
            ``"auto"`` (inference: per call, the fastest of TwELL, the hybrid ELL forward and
            dense as measured, see :func:`twell.ops.ffn.sparse_ffn`; training: per layer and
            optimizer step, the ELL kernels or dense mode as the model's
            :class:`twell.nn.plan.FFNPlan` chose). How each maps to a
            training path: :mod:`twell.nn.plan`. The one copy: a plan reads it (build the plan
            after setting it). Also an attribute.
        policy: this layer's :class:`twell.policy.FFNPolicy` (``auto``'s thresholds, the
            training layout's ELL capacity and all-dense fraction); the defaults when None.
            Also an attribute: set it to change the layer's policy.

    Attributes:
        layer_plan: the :class:`twell.nn.plan.LayerPlan` this module runs with (training path,
            dense-backup capacity, statistics on or off, hot units (training ``ell`` and the
            inference op), the timer of ``auto``'s measured choice), attached and changed by a
            :class:`twell.nn.plan.FFNPlan`; None (no plan): the default path of ``impl``,
            statistics on, the dense backup measured per call.
        last_stats: the most recent call's :class:`FFNStats` (None when statistics are off),
            for the trainer's sparsity tracker.
        twell_state: per-layer :class:`twell.ops.ffn.TwELLState` for the
            sparse paths (cached ``Wd^T``, measured density for ``"auto"``, TwELL
            factor), created on first sparse call.
        last_info: :class:`twell.ops.ffn.FFNInfo` of the last sparse call
            (path taken, density, overflow rows computed densely), or None.

    Forward: x (B, T, D) or (N, D) -> y of the same leading shape. With gradients enabled the
    layer plan's training path runs (``ell`` falls back to the inference op when no input
    needs a gradient); without, the inference path of ``impl``.

    Raises:
        ValueError: unknown ``impl``, sizes not ints >= 1; in forward, x's last dimension not
            ``hidden_size``.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, gated: bool = True, impl: str = "torch",
        policy: FFNPolicy | None = None,
    ) -> None:
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"SparseGatedMLP: {name} must be an int >= 1; got {v!r}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gated = gated
        if gated:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.impl = impl
        self.policy = policy if policy is not None else FFNPolicy()
        self.layer_plan: LayerPlan | None = None
        self.last_stats: FFNStats | None = None
        self.twell_state = None  # twell.ops.ffn.TwELLState, created lazily (triton optional)

    @property
    def last_info(self):
        """FFNInfo of the last sparse call (None before one)."""
        return None if self.twell_state is None else self.twell_state.last_info

    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, value: str) -> None:
        if value not in FFN_IMPLS:
            raise ValueError(f"ffn impl must be one of {FFN_IMPLS}; got {value!r}")
        self._impl = value

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"gated={self.gated}, impl={self.impl}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"SparseGatedMLP: x's last dimension must be hidden_size = "
                             f"{self.hidden_size}; got x of shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        x_ND = x.reshape(-1, x.shape[-1])
        ws = (self.gate_proj.weight if self.gated else None, self.up_proj.weight,
              self.down_proj.weight)
        lp = self.layer_plan
        with_stats = lp.collect_stats if lp is not None else True
        path = None  # inference
        if torch.is_grad_enabled():
            path = lp.path if lp is not None else default_path(self.impl, self.gated)
            if path == "ell" and not any(t is not None and t.requires_grad for t in (x_ND, *ws)):
                path = None  # nothing to differentiate: the inference op
        if path is None:
            y_ND, stats = self._infer(x_ND, ws, with_stats, lp)
        elif lp is not None and lp.timing is not None:  # auto's measured choice times the call
            y_ND, stats = lp.timing.run(path, x_ND,
                                        lambda x: self._train(x, ws, path, with_stats, lp))
        else:
            y_ND, stats = self._train(x_ND, ws, path, with_stats, lp)
        self.last_stats = stats
        return y_ND.reshape(*lead, y_ND.shape[-1])

    def _train(self, x_ND, ws, path: str, with_stats: bool, lp: LayerPlan | None):
        """Training forward on ``path`` (``torch``, ``dense`` or ``ell``); ``ws`` = (gate or
        None, up, down) weights."""
        if path == "dense":  # dense mode: cuBLAS + fused elementwise passes and stats
            from twell.ops.ffn_dense_train import dense_ffn_train  # per call: a test may wrap it

            return dense_ffn_train(x_ND, *ws, with_stats=with_stats,
                                   ell_capacity=self.policy.ell_capacity)
        if path == "torch":
            return gated_ffn_torch(x_ND, *ws, with_stats=with_stats,
                                   ell_capacity=self.policy.ell_capacity)
        from twell.ops.ffn import FFNInfo, TwELLState
        from twell.ops.ffn_train import sparse_ffn_train

        if self.twell_state is None:
            self.twell_state = TwELLState()
        self.twell_state.last_info = FFNInfo("train")
        backup_rows = lp.backup_rows if lp is not None and with_stats else -1
        hot = {} if lp is None or lp.hot_units is None else {"hot_units": lp.hot_units}
        return sparse_ffn_train(x_ND, *ws, with_stats=with_stats, backup_rows=backup_rows,
                                policy=self.policy, **hot)

    def _infer(self, x_ND, ws, with_stats: bool, lp: LayerPlan | None):
        """Inference forward of ``impl``: dense PyTorch (``torch``) or ``sparse_ffn`` (with the
        layer plan's hot units when it has some)."""
        if self.impl == "torch":
            return gated_ffn_torch(x_ND, *ws, with_stats=with_stats,
                                   ell_capacity=self.policy.ell_capacity)
        from twell.ops.ffn import TwELLState, sparse_ffn  # lazy: triton is optional on CPU

        if self.twell_state is None:
            self.twell_state = TwELLState()
        hot = {} if lp is None or lp.hot_units is None else {"hot_units": lp.hot_units}
        return sparse_ffn(x_ND, *ws, with_stats=with_stats, mode=self.impl,
                          state=self.twell_state, policy=self.policy, **hot)
