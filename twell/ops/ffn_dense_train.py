"""Dense mode of the training FFN: cuBLAS products with one fused elementwise pass each way.

Shape legend: N tokens, D model width, H FFN width.

For layers too dense for the ELL path: the same FFN, statistics and L1 term as
``twell.ops.ffn_train`` without compaction or host sync; the fused passes are
``twell.ops.elementwise`` (Triton) or ``twell.ops.reference.sparse_train_torch`` (PyTorch).
Registered as the custom ops ``twell::ffn_dense_train_fwd`` / ``twell::ffn_dense_train_bwd``.
Source: arXiv 2603.23198 (FFN and L1 regularizer).
"""

from __future__ import annotations

import torch

from twell.ops.train_backend import (
    cast_train_args,
    check_train_args,
    dense_rows_bwd,
    pick_backend,
    stats_of,
)
from twell.stats import FFNStats, default_ell_capacity

# One fused elementwise pass each way (h, the per-row L1 / L0 and the per-unit counts forward;
# the L1 gradient folded into dg / du backward); the gate pre-activation and the up projection
# are all it saves (the autograd baseline keeps three N x H).


def _dense_fwd_body(x, wg, wu, wd, backend):
    be = pick_backend(x, backend)
    n = x.shape[0]
    g = torch.matmul(x, wg.t())
    u = torch.matmul(x, wu.t())
    h, l1_N, nnz_N, counts_H = be.dense_fwd(g, u)
    y = torch.matmul(h, wd.t())
    del h
    l1 = l1_N.sum(dtype=torch.promote_types(x.dtype, torch.float32)) / max(n, 1)
    return y, l1, nnz_N, counts_H, g, u


@torch.library.custom_op("twell::ffn_dense_train_fwd", mutates_args=())
def _ffn_dense_train_fwd(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns y, l1, nnz_N, counts_H, then the saved gate pre-activation g and up u (N x H)."""
    with torch.autocast(x.device.type, enabled=False):
        return _dense_fwd_body(x, w_gate, w_up, w_down, backend)


@_ffn_dense_train_fwd.register_fake
def _ffn_dense_train_fwd_fake(x, w_gate, w_up, w_down, backend):
    n, d = x.shape
    h = w_gate.shape[0]
    i32 = {"dtype": torch.int32}
    return (x.new_empty((n, d)), x.new_empty((), dtype=torch.promote_types(x.dtype, torch.float32)),
            x.new_empty((n,), **i32), x.new_empty((h,), **i32), x.new_empty((n, h)),
            x.new_empty((n, h)))


@torch.library.custom_op("twell::ffn_dense_train_bwd", mutates_args=())
def _ffn_dense_train_bwd(
    dy: torch.Tensor, dl1: torch.Tensor, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
    w_down: torch.Tensor, g: torch.Tensor, u: torch.Tensor, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns dx, dWg, dWu, dWd."""
    with torch.autocast(x.device.type, enabled=False):
        scale = (dl1 / max(x.shape[0], 1)).reshape(())
        return dense_rows_bwd(pick_backend(x, backend), dy.to(x.dtype).contiguous(), scale, x, w_gate,
                          w_up, w_down, g, u)


@_ffn_dense_train_bwd.register_fake
def _ffn_dense_train_bwd_fake(dy, dl1, x, w_gate, w_up, w_down, *rest):
    return (torch.empty_like(x), torch.empty_like(w_gate), torch.empty_like(w_up),
            torch.empty_like(w_down))


def _dense_setup_context(ctx, inputs, output):
    x, wg, wu, wd, backend = inputs
    ctx.backend = backend
    ctx.save_for_backward(x, wg, wu, wd, output[4], output[5])
    ctx.mark_non_differentiable(*output[2:])
    ctx.set_materialize_grads(False)


def _dense_backward(ctx, dy, dl1, *_unused):
    x, wg, wu, wd, g, u = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(x[:, : wd.shape[0]])
    if dl1 is None:
        dl1 = torch.zeros((), dtype=torch.float32, device=x.device)
    return (*_ffn_dense_train_bwd(dy, dl1, x, wg, wu, wd, g, u, ctx.backend), None)


torch.library.register_autograd("twell::ffn_dense_train_fwd", _dense_backward,
                                setup_context=_dense_setup_context)


def dense_ffn_train(
    x_ND: torch.Tensor,
    w_gate_HD: torch.Tensor,
    w_up_HD: torch.Tensor,
    w_down_DH: torch.Tensor,
    *,
    with_stats: bool = True,
    backend: str = "auto",
    ell_capacity: int = 0,
) -> tuple[torch.Tensor, FFNStats | None]:
    """Gated ReLU FFN for training in *dense mode*: cuBLAS products plus one fused elementwise
    pass each way, with the same statistics and L1 gradient as :func:`sparse_ffn_train`.

    For layers too dense for the ELL path (``ffn.impl=auto`` sends a layer here when its
    measured density or heavy-row fraction is above the policy's limits; see
    :meth:`twell.policy.FFNPolicy.train_path`). Forward: g = x Wg^T and
    u = x Wu^T (cuBLAS), one pass for h = relu(g) * u, the per-row sum |h| and L0 and the
    per-unit active counts, y = h Wd^T. Backward: dh = dy Wd (cuBLAS), one pass for
    dg = (dh + s sign(h)) u [g > 0], du = (dh + s sign(h)) relu(g) and h (s = dL/dl1 / N),
    then cuBLAS for dx and the three weight gradients. dg and du are stored in the compute
    dtype for cuBLAS, so under bf16 the L1 term's share of the weight gradients is rounded as
    on the PyTorch path (~15 % kept in ``test_l1_gradient_is_not_rounded_away_under_bf16_autocast``;
    the ELL path keeps it in fp32). Saved for backward: x, the weights, g and u (two N x H tensors; PyTorch autograd
    of the same FFN keeps three). No host synchronisation.

    Source: arXiv 2603.23198 (FFN and L1 regularizer); the dense counterpart of the hybrid
    training kernels.

    Args, returns: as :func:`sparse_ffn_train` (no ELL layout); stats from the fused pass;
    ``ell_capacity`` only sets the capacity ``stats.heavy_rows`` counts against (0 = default).

    Raises:
        ValueError: a shape, dtype, device or option mismatch (the message names it).
    """
    check_train_args(x_ND, w_gate_HD, w_up_HD, w_down_DH, backend, "dense_ffn_train")
    x, wg, wu, wd = cast_train_args(x_ND, w_gate_HD, w_up_HD, w_down_DH)
    n = x.shape[0]
    if n == 0:
        from twell.ops.reference import gated_ffn_torch

        return gated_ffn_torch(x, wg, wu, wd, with_stats=with_stats, ell_capacity=ell_capacity)
    out = _ffn_dense_train_fwd(x, wg, wu, wd, backend)
    kc = ell_capacity if ell_capacity > 0 else default_ell_capacity(wg.shape[0])
    return out[0], (stats_of(out, kc) if with_stats else None)
