"""Fused LM head + cross-entropy: the causal-LM loss without the full (N, V) logits.

Shape legend: B micro-batch, T sequence length, N = B*T token rows, D model width, V vocabulary,
C rows per chunk.

The plain path (transformers' ``LlamaForCausalLM`` with ``labels``) materialises the bf16 logits
(N, V), their fp32 copy and the fp32 log-softmax saved for backward; at 8 x 2048 tokens and
V = 49152 that is 1.6 + 3.2 + 3.2 GB, and backward adds fp32 and bf16 gradients of the same
size: the loss sets the activation peak of the step. Here, as in Liger-Kernel's
FusedLinearCrossEntropy (design learned from it, code our own), the forward walks over C-row
chunks: bf16 logits ``h_c W^T`` (C, V), fp32 log-softmax, the loss sum, and at once the
gradient ``(softmax - onehot) / count`` of the chunk's logits, from which it computes the
gradient of the chunk's hidden states (C, D) and accumulates the LM-head weight gradient (V, D)
in fp32. Backward only scales the two stored gradients by the upstream scalar. Nothing of size
N x V is ever live; per chunk at most ~ (4 + 4) C V bytes (fp32 logits and log-softmax).

Numerics follow the plain path under bf16 autocast: the same bf16 GEMMs for the logits and the
two gradients, log-softmax in fp32, the logit gradient rounded to bf16 before its GEMMs; only the
weight gradient is rounded to bf16 per chunk and summed in fp32 (the plain path rounds one
(V, D) product once). The mean is over the B*(T-1) shifted targets that are not ``ignore_index``,
exactly as transformers' ``ForCausalLMLoss`` (labels padded with ``ignore_index`` and shifted
left inside). Tied embeddings: the weight gradient is returned for the weight argument, so
autograd adds it to the embedding's own gradient of the shared parameter.

Source: the causal-LM objective of arXiv 2603.23198 (CE + l1_coeff * L1; the L1 term is added
by the trainer as before).
"""

from __future__ import annotations

import types

import torch

IGNORE_INDEX = -100  # transformers' label ignore index
# Rows of logits computed at once (the default of trainer.ce_chunk_rows). Decides the loss's
# transient memory: 4096 x 49152 x ~8 bytes (fp32 logits and their log-softmax, briefly both) =
# ~1.6 GB at the paper's vocabulary, against ~10 GB for the full logits of 8 x 2048 tokens;
# 4 chunks of 4096 x 2048 x 49152 GEMMs per micro-batch (large enough for cuBLAS). The chunk size
# is not yet measured on the H200 (2048 / 4096 / 8192 to compare; BENCHMARKS.md, to come).
CE_CHUNK_ROWS = 4096


def fused_ce_enabled(setting: bool | None, *, device_type: str, precision: str, compile: bool,
                     sharded: bool) -> bool:
    """Whether a run uses :func:`use_fused_cross_entropy` (``trainer.fused_ce``).

    ``setting`` true / false is taken as given; null (auto) is on for CUDA bf16 runs that are
    neither compiled (``trainer.compile``: the fused loss is eager-only) nor FSDP-sharded (the LM
    head weight is used outside its module's forward: untested), off elsewhere (CPU and fp32
    runs keep transformers' loss). ``precision`` is the resolved one (bf16 | fp32).
    """
    if setting is not None:
        return bool(setting)
    return device_type == "cuda" and precision == "bf16" and not compile and not sharded


def shift_labels(labels_BT: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Targets of each position, (B*T,) int64: ``labels[b, t + 1]``, ``ignore_index`` at t = T-1
    (transformers' ``ForCausalLMLoss`` shift)."""
    pad = torch.full_like(labels_BT[:, :1], ignore_index)
    return torch.cat([labels_BT[:, 1:], pad], dim=1).reshape(-1)


def _chunks(hidden_ND, weight_VD, target_N, ignore_index, compute_dtype, chunk_rows, grads):
    """The chunked loop. Returns (loss sum fp32, valid count, dh (N, D) or None, dW (V, D) or
    None): dh and dW are the gradients of the *mean* loss (sum / count)."""
    n = hidden_ND.shape[0]
    acc = torch.promote_types(weight_VD.dtype, torch.float32)
    w_VD = weight_VD.detach().to(compute_dtype)  # one cast per call
    valid_N = target_N != ignore_index
    count = valid_N.sum()
    inv = 1.0 / count.to(acc)  # device scalar: no host sync
    loss_sum = torch.zeros((), dtype=acc, device=hidden_ND.device)
    dh_ND = torch.empty_like(hidden_ND) if grads[0] else None
    dw_VD = torch.zeros(weight_VD.shape, dtype=acc, device=weight_VD.device) if grads[1] else None
    for s in range(0, n, chunk_rows):
        h_CD = hidden_ND[s:s + chunk_rows].detach().to(compute_dtype)
        v_C = valid_N[s:s + chunk_rows]
        t_C = torch.where(v_C, target_N[s:s + chunk_rows], 0)[:, None]  # (C, 1)
        logits_CV = h_CD @ w_VD.t()  # compute dtype, as the plain path's lm_head
        # fp32 log-softmax, as the plain path's F.cross_entropy of logits.float()
        logp_CV = torch.log_softmax(logits_CV.to(acc), dim=-1)
        del logits_CV
        loss_sum -= torch.where(v_C, logp_CV.gather(1, t_C)[:, 0], 0).sum()
        if dh_ND is None and dw_VD is None:
            continue
        # d(mean loss)/d logits = (softmax - onehot(target)) / count on valid rows, in place
        p_CV = logp_CV.exp_()
        p_CV.scatter_add_(1, t_C, -v_C.to(acc)[:, None])
        p_CV.mul_((v_C.to(acc) * inv)[:, None])  # ignored rows: 0 (NaN stays NaN)
        g_CV = p_CV.to(compute_dtype)  # rounded like the plain path's logit gradient
        del logp_CV, p_CV
        if dh_ND is not None:
            dh_ND[s:s + chunk_rows] = (g_CV @ w_VD).to(hidden_ND.dtype)
        if dw_VD is not None:
            dw_VD += (g_CV.t() @ h_CD).to(acc)
    return loss_sum, count, dh_ND, dw_VD


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean CE of ``hidden_ND @ weight_VD^T`` against ``target_N``; gradients made in forward.

    Inputs: hidden_ND (N, D) float, weight_VD (V, D) float, target_N (N,) int64, then
    ignore_index, compute_dtype, chunk_rows. Output: scalar, the weight's float dtype (fp32).
    """

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, target_N, ignore_index, compute_dtype, chunk_rows):
        grads = (hidden_ND.requires_grad, weight_VD.requires_grad)
        with torch.autocast(hidden_ND.device.type, enabled=False):
            loss_sum, count, dh_ND, dw_VD = _chunks(hidden_ND, weight_VD, target_N, ignore_index,
                                                    compute_dtype, chunk_rows, grads)
        ctx.save_for_backward(dh_ND, dw_VD)
        ctx.weight_dtype = weight_VD.dtype
        ctx.used = False
        return loss_sum / count

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.used:
            raise RuntimeError("fused cross-entropy: backward ran twice (its gradients are made "
                               "in forward and scaled in place); use trainer.fused_ce=false")
        ctx.used = True
        dh_ND, dw_VD = ctx.saved_tensors
        if dh_ND is not None:
            dh_ND = dh_ND.mul_(grad_out.to(dh_ND.dtype))
        if dw_VD is not None:
            dw_VD = dw_VD.mul_(grad_out.to(dw_VD.dtype)).to(ctx.weight_dtype)
        return dh_ND, dw_VD, None, None, None, None


def linear_cross_entropy(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    target_N: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    compute_dtype: torch.dtype | None = None,
    chunk_rows: int = CE_CHUNK_ROWS,
) -> torch.Tensor:
    """``F.cross_entropy(hidden_ND @ weight_VD^T, target_N, ignore_index=..)`` (mean over the
    targets that are not ``ignore_index``) without the (N, V) logits.

    Args:
        hidden_ND: (N, D) float hidden states (the final norm's output).
        weight_VD: (V, D) float LM-head weight (the tied embedding matrix).
        target_N: (N,) integer targets in [0, V) or ``ignore_index``.
        compute_dtype: dtype of the GEMMs (bf16 under autocast); None = hidden's dtype.
        chunk_rows: C, rows of logits per chunk (:data:`CE_CHUNK_ROWS`).

    Returns:
        Scalar tensor (fp32 for fp32/bf16 weights): the mean loss; NaN when no target is valid
        (as ``F.cross_entropy``). With gradients enabled, backward gives d/d hidden and d/d
        weight; a second backward through the same graph raises RuntimeError.

    Raises:
        ValueError: shapes that do not match, chunk_rows < 1.
    """
    if hidden_ND.dim() != 2 or weight_VD.dim() != 2 or hidden_ND.shape[1] != weight_VD.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden_ND (N, D) and weight_VD (V, D) must share "
                         f"D; got {tuple(hidden_ND.shape)}, {tuple(weight_VD.shape)}")
    if target_N.shape != hidden_ND.shape[:1]:
        raise ValueError(f"linear_cross_entropy: target_N must be (N={hidden_ND.shape[0]},); got "
                         f"{tuple(target_N.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"linear_cross_entropy: chunk_rows must be >= 1; got {chunk_rows}")
    dt = compute_dtype or hidden_ND.dtype
    target_N = target_N.long()
    if torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_VD.requires_grad):
        return _LinearCrossEntropy.apply(hidden_ND, weight_VD, target_N, ignore_index, dt,
                                         chunk_rows)
    with torch.no_grad(), torch.autocast(hidden_ND.device.type, enabled=False):
        loss_sum, count, _, _ = _chunks(hidden_ND, weight_VD, target_N, ignore_index, dt,
                                        chunk_rows, (False, False))
    return loss_sum / count


def _fused_ce_forward(self, input_ids=None, labels=None, **kwargs):
    """``LlamaForCausalLM.forward`` whose loss (when ``labels`` are given) is
    :func:`linear_cross_entropy` of the base model's last hidden state; ``logits`` is then None.
    Without labels (evaluation, generation) it is transformers' own forward."""
    if labels is None:
        return self._twell_plain_forward(input_ids=input_ids, **kwargs)
    if kwargs.pop("num_items_in_batch", None) is not None:
        raise ValueError("trainer.fused_ce takes the mean over the batch's targets; "
                         "num_items_in_batch is not supported")
    kwargs.pop("logits_to_keep", None)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    hidden_BTD = self.model(input_ids=input_ids, **kwargs).last_hidden_state
    dev = hidden_BTD.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden_BTD.dtype
    loss = linear_cross_entropy(hidden_BTD.reshape(-1, hidden_BTD.shape[-1]), self.lm_head.weight,
                                shift_labels(labels.to(hidden_BTD.device)), compute_dtype=dt,
                                chunk_rows=self._twell_ce_chunk_rows)
    return CausalLMOutputWithPast(loss=loss, logits=None)


def use_fused_cross_entropy(model, chunk_rows: int = CE_CHUNK_ROWS) -> None:
    """Make ``model(input_ids=..., labels=...)`` compute its loss with
    :func:`linear_cross_entropy` (``trainer.fused_ce=true``): an instance-level ``forward``, set
    before ``accelerator.prepare`` so that accelerate's autocast and DDP wrap it as they wrap the
    stock one (the trainer's loop is unchanged). ``model`` is a ``LlamaForCausalLM``;
    ``chunk_rows`` as in :func:`linear_cross_entropy`."""
    if not (hasattr(model, "model") and hasattr(model, "lm_head")):
        raise ValueError(f"use_fused_cross_entropy needs a causal LM with .model and .lm_head; "
                         f"got {type(model).__name__}")
    model._twell_ce_chunk_rows = int(chunk_rows)
    model._twell_plain_forward = types.MethodType(type(model).forward, model)
    model.forward = types.MethodType(_fused_ce_forward, model)
