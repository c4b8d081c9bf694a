"""ReLU-gated FFN with activation statistics, dense (PyTorch) or sparse (TwELL).

Shape legend: B batch, T sequence, D model width (hidden_size), H FFN width
(intermediate_size), N = B*T tokens.

Source: arXiv 2603.23198 (FFN definition and L1 regularizer; see
``shared/PAPER.md``). The gated FFN is exactly transformers' ``LlamaMLP`` with
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

from twell.ops.reference import gated_ffn_torch
from twell.policy import FFNPolicy
from twell.stats import FFNStats

FFN_IMPLS = ("torch", "twell", "auto")


class SparseGatedMLP(nn.Module):
    """Drop-in replacement for ``LlamaMLP`` (relu) that reports sparsity stats.

    Args:
        hidden_size: D, model width.
        intermediate_size: H, FFN width.
        gated: gated FFN (``relu(gate) * up``) if True, else ``relu(up)``
            (the non-gated variant has no ``gate_proj``).
        impl: ``"torch"`` (dense PyTorch), ``"twell"`` (TwELL Triton kernels)
            or ``"auto"`` (inference: per call, TwELL when the layer's measured density
            makes it faster, else dense; training: per layer and optimizer step, from
            ``train_path``, which the trainer sets from the layer's measured L0 and heavy-row
            fraction: the ELL training kernels, or dense mode, cuBLAS with fused elementwise
            passes).
        policy: this layer's :class:`twell.policy.FFNPolicy` (``auto``'s thresholds, the
            training layout's ELL capacity and all-dense fraction); the defaults when None.
            Also an attribute: set it to change the layer's policy.

    Attributes:
        collect_stats: when True (default) every forward stores an
            :class:`FFNStats` in ``self.last_stats`` for the trainer's
            sparsity tracker; set False for inference.
        last_stats: the most recent call's stats (or None).
        twell_state: per-layer :class:`twell.ops.ffn.TwELLState` for the
            sparse paths (cached ``Wd^T``, measured density for ``"auto"``, TwELL
            factor), created on first sparse call.
        last_info: :class:`twell.ops.ffn.FFNInfo` of the last sparse call
            (path taken, density, overflow rows computed densely), or None.

    Forward: x (B, T, D) or (N, D) -> y of the same leading shape.

    Raises:
        ValueError: unknown ``impl`` or non-positive sizes.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, gated: bool = True, impl: str = "torch",
        policy: FFNPolicy | None = None,
    ) -> None:
        super().__init__()
        if hidden_size <= 0 or intermediate_size <= 0:
            raise ValueError(
                f"hidden_size and intermediate_size must be positive; got {hidden_size}, "
                f"{intermediate_size}"
            )
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gated = gated
        if gated:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.impl = impl
        self.policy = policy if policy is not None else FFNPolicy()
        self.collect_stats = True
        self.last_stats: FFNStats | None = None
        self.twell_state = None  # twell.ops.ffn.TwELLState, created lazily (triton optional)
        # impl="auto" with gradients: "twell" (ELL kernels) or "dense" (dense mode:
        # twell.ops.sparse_train.dense_ffn_train), set between optimizer steps by the trainer
        # from this layer's measured L0 and heavy-row fraction (self.policy.train_path); fixed
        # within a step, so a checkpointed forward and its recomputation agree. Starts dense: a
        # freshly initialised ReLU FFN has ~50 % of its units active. ("torch" is also accepted:
        # the plain PyTorch path.)
        self.train_path = "dense"
        # sparse training path: dense-backup rows (twell.ops.sparse_train.sparse_ffn_train's
        # backup_rows). -1 = measure per call (one host sync); >= 0 = that capacity, no sync
        # (the trainer sets it per step from the heavy-row counts and redoes a step that
        # exceeded it). Fixed within a step, like train_path.
        self.backup_rows = -1
        # impl="torch" with gradients: "torch" (autograd through the PyTorch ops, the reference)
        # or "dense" (dense mode, twell.ops.sparse_train.dense_ffn_train: the same FFN and
        # statistics with one fused elementwise pass each way; gated FFNs only). The trainer
        # sets it from trainer.dense_ffn_fused.
        self.torch_train_path = "torch"

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
        lead = x.shape[:-1]
        x_ND = x.reshape(-1, x.shape[-1])
        w_gate = self.gate_proj.weight if self.gated else None
        impl = self.impl
        if impl == "auto" and self.train_path != "twell" and torch.is_grad_enabled():
            impl = self.train_path if self.gated else "torch"
        elif impl == "torch" and self.gated and torch.is_grad_enabled():
            impl = self.torch_train_path
        if impl == "dense":  # training dense mode: cuBLAS + fused elementwise passes and stats
            from twell.ops.sparse_train import dense_ffn_train  # lazy: triton is optional

            y_ND, stats = dense_ffn_train(
                x_ND, w_gate, self.up_proj.weight, self.down_proj.weight,
                with_stats=self.collect_stats, ell_capacity=self.policy.ell_capacity,
            )
        elif impl == "torch":
            y_ND, stats = gated_ffn_torch(
                x_ND, w_gate, self.up_proj.weight, self.down_proj.weight,
                with_stats=self.collect_stats, ell_capacity=self.policy.ell_capacity,
            )
        else:
            from twell.ops.ffn import TwELLState, sparse_ffn  # lazy: triton is optional on CPU

            if self.twell_state is None:
                self.twell_state = TwELLState()
            y_ND, stats = sparse_ffn(
                x_ND, w_gate, self.up_proj.weight, self.down_proj.weight,
                with_stats=self.collect_stats, mode=impl, state=self.twell_state,
                policy=self.policy, backup_rows=self.backup_rows if self.collect_stats else -1,
            )
        self.last_stats = stats
        return y_ND.reshape(*lead, y_ND.shape[-1])
