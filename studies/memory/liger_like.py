"""Stand-ins for Liger-Kernel's three autograd Functions, saving what Liger's save.

Liger-Kernel is CUDA-only; these run on the CPU and keep the same tensors for backward
(liger_kernel 0.8.5, read from its source), so that the GPU path's save sets can be audited on
the CPU:

* ``LigerRMSNormFunction`` (``llama`` casting mode): X as given (fp32 here: the residual
  stream), W and RSTD (fp32, one per row); the trainer's ``norm_out_bf16`` cast of the output
  (``train/liger.py``) is applied after it.
* ``LigerRopeFunction``: cos and sin; q and k are rotated in place, so the pre-RoPE q and k are
  not kept.
* ``LigerFusedLinearCrossEntropyFunction``: the input gradient (rows x D in the input's dtype)
  and the weight gradient (the weight's dtype), both computed in forward; nothing else.
"""

from __future__ import annotations

import contextlib

import torch


class LigerLikeRMSNorm(torch.autograd.Function):
    """``LigerRMSNormFunction`` in its ``llama`` casting mode: saves (X, W, RSTD).

    ``x``: (..., D) any float dtype; ``w``: (D,); ``eps``: float. Returns ``w * (x * rstd)``
    with the normalised ``x`` cast back to ``x``'s dtype, shape of ``x``."""

    @staticmethod
    def forward(ctx, x, w, eps):
        shape = x.shape
        x2 = x.contiguous().view(-1, shape[-1])
        rstd = torch.rsqrt(x2.float().pow(2).mean(-1) + eps)  # fp32 (N,)
        y = w * (x2.float() * rstd[:, None]).to(x.dtype)
        ctx.save_for_backward(x2, w, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape).float()
        xh = x2.float() * rstd[:, None]
        dxh = dy2 * w.float()
        dx = rstd[:, None] * (dxh - xh * (dxh * xh).mean(-1, keepdim=True))
        return dx.to(x2.dtype).view(dy.shape), (dy2 * xh).sum(0).to(w.dtype), None


def _rotate(t, c, s):
    """``t * c + rotate_half(t) * s`` in ``t``'s dtype (transformers' RoPE convention)."""
    t1, t2 = t[..., : t.shape[-1] // 2], t[..., t.shape[-1] // 2:]
    return (t * c + torch.cat((-t2, t1), -1) * s).to(t.dtype)


class LigerLikeRope(torch.autograd.Function):
    """``LigerRopeFunction``: saves (cos, sin); q, k in their own dtype.

    ``q``, ``k``: (B, heads, T, head_dim); ``cos``, ``sin``: (B, T, head_dim)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        ctx.save_for_backward(cos, sin)
        return _rotate(q, c, s), _rotate(k, c, s)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        c, s = cos.unsqueeze(1), -sin.unsqueeze(1)
        return _rotate(dq, c, s), _rotate(dk, c, s), None, None


class LigerLikeFLCE(torch.autograd.Function):
    """``LigerFusedLinearCrossEntropyFunction``: gradients computed in forward, chunk by chunk;
    saves (grad_input in the input's dtype, grad_weight in the weight's dtype).

    ``h_ND``: (N, D) hidden states; ``w_VD``: (V, D) head weight; ``target_N``: (N,) int64 with
    -100 ignored; ``chunk``: rows per chunk. Returns the mean CE over the valid rows (fp32)."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, target_N, chunk):
        dt = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else h_ND.dtype
        with torch.autocast("cpu", enabled=False):
            wc = w_VD.to(dt)
            gi = torch.zeros_like(h_ND)
            gw = torch.zeros_like(w_VD)
            n = max(int((target_N != -100).sum()), 1)
            loss = torch.zeros((), dtype=torch.float32)
            for s in range(0, h_ND.shape[0], chunk):
                hc, tc = h_ND[s:s + chunk].to(dt), target_N[s:s + chunk]
                logits = (hc @ wc.t()).float()
                ok = tc != -100
                tgt = logits.gather(1, tc.clamp(min=0)[:, None])[:, 0]
                loss += ((logits.logsumexp(-1) - tgt) * ok).sum()
                g = logits.softmax(-1)
                g[torch.arange(len(tc)), tc.clamp(min=0)] -= 1
                g = (g * ok[:, None] / n).to(dt)
                gi[s:s + chunk] = (g @ wc).to(gi.dtype)
                gw += (g.t() @ hc).float().to(gw.dtype)
        ctx.save_for_backward(gi, gw)
        return loss / n

    @staticmethod
    def backward(ctx, dl):
        gi, gw = ctx.saved_tensors
        return gi * dl.to(gi.dtype), gw * dl.to(gw.dtype), None, None


def install_norms(model, norm_out_bf16: bool = True) -> None:
    """Replace the forward of every RMSNorm of ``model`` (a ``LlamaForCausalLM``) by
    :class:`LigerLikeRMSNorm`; with ``norm_out_bf16`` an fp32 output is cast to the autocast
    dtype (the trainer's ``norm_out_bf16``). Changes this model only."""
    norm_cls = type(model.model.norm)
    for m in model.modules():
        if type(m) is norm_cls:
            def fwd(x, m=m):
                y = LigerLikeRMSNorm.apply(x, m.weight, m.variance_epsilon)
                if norm_out_bf16 and torch.is_autocast_enabled("cpu") and y.dtype == torch.float32:
                    y = y.to(torch.get_autocast_dtype("cpu"))  # train/liger.py: norm_out_bf16
                return y
            m.forward = fwd


@contextlib.contextmanager
def liger_like_rope():
    """Within the block, transformers' Llama RoPE (``modeling_llama.apply_rotary_pos_emb``, a
    module global) is :class:`LigerLikeRope`; the original is put back on exit."""
    from transformers.models.llama import modeling_llama

    orig = modeling_llama.apply_rotary_pos_emb
    modeling_llama.apply_rotary_pos_emb = (
        lambda q, k, cos, sin, *a, **kw: LigerLikeRope.apply(q, k, cos, sin))
    try:
        yield
    finally:
        modeling_llama.apply_rotary_pos_emb = orig
