"""Memory-lean RMSNorm for training (``trainer.lean_norms``): transformers' ``LlamaRMSNorm``
with the same forward, a backward that recomputes what the stock one keeps, and, under
autocast, one cast of the output that every consumer shares.

Shape legend: N token rows (any leading dims), D model width.

What the stock norm keeps for backward, per norm and micro-batch, under bf16 autocast over
fp32 master weights (the residual stream is fp32): its input x (4 N D bytes, also needed
here), the normalised ``x * rsqrt(mean(x^2) + eps)`` in fp32 (4 N D: the weight multiply
saves it for the weight gradient) and the rsqrt (4 N). Its fp32 output is cast to bf16 by
each consumer separately, and each keeps its own copy (2 N D each): three for q / k / v after
``input_layernorm``, two for the gate and up projections of a PyTorch FFN after
``post_attention_layernorm`` (the TwELL ops cast once). Here the norm keeps x and the rsqrt only
(the normalised rows are recomputed in backward: one elementwise pass) and returns the output
already in the autocast dtype, so its consumers share one copy. At the 1.5B shape (N 16384,
D 2048) that is 134 MB per norm plus 134 MB (q/k/v) and 67 MB (a PyTorch FFN's gate/up) per
layer without recomputation: ~13 GB over 28 layers at a micro-batch of 8 x 2048
(BENCHMARKS.md, "Memory planner").

Numerics: the forward is the stock one, op for op (so the output is bitwise equal, and the bf16
cast rounds it exactly as the consumers' casts did); the backward repeats autograd's formulas for
those ops in the same order, so fp32 gradients are bitwise equal (tests/train/test_norms.py). Under
autocast one difference remains: the consumers' bf16 gradients of the shared output are summed
by autograd in bf16, where the stock graph sums their fp32 casts (one bf16 rounding per
consumer: bf16 noise). Inputs that are not fp32 (an FSDP2 model with bf16 parameters) and
evaluation take the stock forward.
"""

from __future__ import annotations

import types

import torch


class _LeanRMSNorm(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))``, output cast to ``out_dtype``.

    Inputs: x (..., D) fp32 twice (``x`` as the normalised factor, ``x_sq`` as the base of the
    square: autograd then adds their two gradients into x's one by one, in the order the stock
    graph does), weight (D,) fp32, eps float, out_dtype (None = fp32). Saves x, the rsqrt
    (..., 1) and the weight.
    """

    @staticmethod
    def forward(ctx, x, x_sq, weight, eps, out_dtype):
        variance = x_sq.pow(2).mean(-1, keepdim=True)  # the stock forward, op for op
        rstd = torch.rsqrt(variance + eps)
        y = weight * (x * rstd)
        ctx.save_for_backward(x, rstd, weight)
        return y if out_dtype is None else y.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, rstd, weight = ctx.saved_tensors
        g = grad_y.to(torch.float32)
        # autograd's derivatives of the stock graph (derivatives.yaml), in its order
        grad_w = (g * (x * rstd)).sum_to_size(weight.shape) if ctx.needs_input_grad[2] else None
        grad_x = grad_x_sq = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            g_h = g * weight  # d/d (x * rstd)
            grad_x = g_h * rstd
            g_r = (g_h * x).sum_to_size(rstd.shape)
            g_v = -0.5 * g_r * rstd.pow(3)  # rsqrt: -0.5 * grad * result^3
            g_p = g_v.expand(x.shape) / x.shape[-1]  # mean over D
            grad_x_sq = g_p * (2 * x.pow(1))  # pow(x, 2): grad * 2 * x^1
        return grad_x, grad_x_sq, grad_w, None, None


def _lean_forward(self, hidden_states):
    if not (self.training and torch.is_grad_enabled()) or hidden_states.dtype != torch.float32 \
            or self.weight.dtype != torch.float32:
        return type(self).forward(self, hidden_states)
    dev = hidden_states.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    return _LeanRMSNorm.apply(hidden_states, hidden_states, self.weight,
                              self.variance_epsilon, out_dtype)


def lean_norms(model) -> int:
    """Route every RMSNorm of a transformers decoder (the class of ``model.model.norm``: two per
    decoder layer and the final one) through :class:`_LeanRMSNorm` in training.

    Args:
        model: a ``LlamaForCausalLM`` whose norms have ``weight`` and ``variance_epsilon``.

    Returns:
        The number of norm modules patched.

    Raises:
        ValueError: the model has no ``model.norm``, or its norm class is not the stock
            ``x * rsqrt(mean(x^2) + eps)`` form (no ``variance_epsilon``).
    """
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "norm"):
        raise ValueError(f"lean_norms needs a decoder with .model.norm; got {type(model).__name__}")
    cls = type(base.norm)
    if not hasattr(base.norm, "variance_epsilon"):
        raise ValueError(f"lean_norms: {cls.__name__} has no variance_epsilon (not an RMSNorm of "
                         "the LlamaRMSNorm form)")
    n = 0
    for m in model.modules():
        if type(m) is cls:
            m.forward = types.MethodType(_lean_forward, m)
            n += 1
    return n


def lean_norms_enabled(setting: bool | None, *, device_type: str, precision: str, compile: bool,
                       compile_norms: bool) -> bool:
    """Whether a run uses :func:`lean_norms` (``trainer.lean_norms``): true / false as given;
    null (auto) = on for CUDA bf16 runs without ``trainer.compile`` / ``trainer.compile_norms``
    (inductor then fuses and plans the norms itself). ``precision`` is the resolved one."""
    if setting is not None:
        return bool(setting)
    return device_type == "cuda" and precision == "bf16" and not compile and not compile_norms
