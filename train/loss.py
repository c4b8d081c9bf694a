"""The distillation loss: LM head + cross-entropy + KL to a frozen teacher, without the (N, V)
logits of either model (``sparsity.distill_*``).

Shape legend: B micro-batch, T sequence length, N = B*T token rows, D model width, V vocabulary,
C rows per chunk.

The plain path (transformers' ``LlamaForCausalLM`` with ``labels``) materialises the bf16 logits
(N, V), their fp32 copy and the fp32 log-softmax saved for backward; with a teacher's logits on
top, the loss would set the activation peak of the step. Here, as in Liger-Kernel's fused linear
losses (design learned from them, code our own), the forward walks over C-row chunks: bf16
logits of both models, fp32 log-softmaxes, the loss sums, and at once the gradient of the
chunk's student logits, from which it computes the gradient of the chunk's hidden states (C, D)
and accumulates the LM-head weight gradient (V, D) in fp32. Backward only scales the two stored
gradients by the upstream scalar. Nothing of size N x V is ever live.

A run without distillation takes Liger-Kernel's fused linear cross-entropy on CUDA
(``train/liger.py``; it replaced a plain fused CE of ours that it matched in speed) and
transformers' loss elsewhere; :func:`linear_cross_entropy` (the CE alone, no gradient) is the
distillation run's validation loss.

Numerics follow the plain path under bf16 autocast: the same bf16 GEMMs for the logits and the
two gradients, log-softmax in fp32, the logit gradient rounded to bf16 before its GEMMs; only the
weight gradient is rounded to bf16 per chunk and summed in fp32 (the plain path rounds one
(V, D) product once). The mean is over the B*(T-1) shifted targets that are not ``ignore_index``,
exactly as transformers' ``ForCausalLMLoss`` (labels padded with ``ignore_index`` and shifted
left inside). Tied embeddings: the weight gradient is returned for the weight argument, so
autograd adds it to the embedding's own gradient of the shared parameter.

Source: the causal-LM objective of arXiv 2603.23198 (CE + l1_coeff * L1; the L1 term is added by
the trainer) and Hinton et al. 2015 for the KL term.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

IGNORE_INDEX = -100  # transformers' label ignore index
# Rows of logits computed at once (the default of trainer.ce_chunk_rows). Decides the loss's
# transient memory: 4096 x 49152 x ~8 bytes (fp32 logits and their log-softmax, briefly both) =
# ~1.6 GB at the paper's vocabulary, against ~10 GB for the full logits of 8 x 2048 tokens;
# 4 chunks of 4096 x 2048 x 49152 GEMMs per micro-batch (large enough for cuBLAS). The chunk size
# is not yet measured on the H200 (2048 / 4096 / 8192 to compare; BENCHMARKS.md, to come).
CE_CHUNK_ROWS = 4096


def shift_labels(labels_BT: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Targets of each position, (B*T,) int64: ``labels[b, t + 1]``, ``ignore_index`` at t = T-1
    (transformers' ``ForCausalLMLoss`` shift)."""
    pad = torch.full_like(labels_BT[:, :1], ignore_index)
    return torch.cat([labels_BT[:, 1:], pad], dim=1).reshape(-1)


def _ce_chunks(hidden_ND, weight_VD, target_N, ignore_index, compute_dtype, chunk_rows):
    """The CE's chunked loop without gradients: (loss sum fp32, valid count)."""
    n = hidden_ND.shape[0]
    acc = torch.promote_types(weight_VD.dtype, torch.float32)
    w_VD = weight_VD.detach().to(compute_dtype)  # one cast per call
    valid_N = target_N != ignore_index
    loss_sum = torch.zeros((), dtype=acc, device=hidden_ND.device)
    for s in range(0, n, chunk_rows):
        h_CD = hidden_ND[s:s + chunk_rows].detach().to(compute_dtype)
        v_C = valid_N[s:s + chunk_rows]
        t_C = torch.where(v_C, target_N[s:s + chunk_rows], 0)[:, None]  # (C, 1)
        # compute-dtype logits as the plain path's lm_head, fp32 log-softmax as its
        # F.cross_entropy of logits.float()
        logp_CV = torch.log_softmax((h_CD @ w_VD.t()).to(acc), dim=-1)
        loss_sum -= torch.where(v_C, logp_CV.gather(1, t_C)[:, 0], 0).sum()
    return loss_sum, valid_N.sum()


@torch.compiler.disable  # trainer.compile: the model compiles around it; this runs as written
@torch.no_grad()
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
    targets that are not ``ignore_index``) without the (N, V) logits and without gradients
    (the distillation run's validation loss).

    Args:
        hidden_ND: (N, D) float hidden states (the final norm's output).
        weight_VD: (V, D) float LM-head weight (the tied embedding matrix).
        target_N: (N,) integer targets in [0, V) or ``ignore_index``.
        compute_dtype: dtype of the GEMMs (bf16 under autocast); None = hidden's dtype.
        chunk_rows: C, rows of logits per chunk (:data:`CE_CHUNK_ROWS`).

    Returns:
        Scalar tensor (fp32 for fp32/bf16 weights), detached: the mean loss; NaN when no target
        is valid (as ``F.cross_entropy``); NaN or inf in a valid row propagates.

    Raises:
        ValueError: shapes that do not match, chunk_rows < 1.
    """
    _check_ce_args("linear_cross_entropy", hidden_ND, weight_VD, target_N, chunk_rows)
    with torch.autocast(hidden_ND.device.type, enabled=False):
        loss_sum, count = _ce_chunks(hidden_ND, weight_VD, target_N.long(), ignore_index,
                                     compute_dtype or hidden_ND.dtype, chunk_rows)
    return loss_sum / count


def _scaled_grads(ctx, grad: torch.Tensor):
    """The (hidden, weight) gradients a fused loss made in forward, scaled in place by the
    incoming gradient of its loss (the weight's cast back to its dtype)."""
    dh_ND, dw_VD = ctx.saved_tensors
    if dh_ND is not None:
        dh_ND = dh_ND.mul_(grad.to(dh_ND.dtype))
    if dw_VD is not None:
        dw_VD = dw_VD.mul_(grad.to(dw_VD.dtype)).to(ctx.weight_dtype)
    return dh_ND, dw_VD


# ---------------------------------------------------------------------------- distillation
#
# CE + w T^2 KL(teacher_T || student_T) in the same row chunks (``sparsity.distill_from``): per
# chunk the student's logits h_c W^T and the teacher's g_c U^T (its final-norm hidden states and
# LM head), fp32 log-softmaxes, the CE and KL sums, and at once the gradient of the chunk's
# student logits, (softmax - onehot) / count + (w T^2 / T) (q_T - p_T) / count with p_T, q_T the
# teacher's and the student's softmax at temperature T; then, as above, the hidden-state
# gradient (C, D) and the LM-head weight gradient (V, D). The weight of the KL term is an input
# (it is known when the loss is made), so one pair of gradient GEMMs serves both terms. Memory:
# nothing of size N x V; per chunk about 6 fp32 C x V tensors (logits and log-softmaxes of both
# models, the gradient). Source of the objective: Hinton et al. 2015 ("Distilling the Knowledge
# in a Neural Network"; the T^2 factor keeps the gradient's size as T changes).


def _chunks_kl(hidden_ND, weight_VD, target_N, teacher_ND, teacher_VD, temperature, kl_weight,
               ignore_index, compute_dtype, chunk_rows, grads):
    """The chunked loop of :func:`linear_cross_entropy_kl`. Returns (CE sum, KL sum, valid
    count, dh (N, D) or None, dW (V, D) or None): dh and dW are the gradients of
    ``(CE sum + kl_weight * KL sum) / count``."""
    n = hidden_ND.shape[0]
    acc = torch.promote_types(weight_VD.dtype, torch.float32)
    w_VD = weight_VD.detach().to(compute_dtype)
    u_VD = teacher_VD.detach()  # the teacher's own dtype (bf16 on GPU, fp32 on CPU)
    valid_N = target_N != ignore_index
    count = valid_N.sum()
    inv = 1.0 / count.to(acc)  # device scalar: no host sync
    inv_t = 1.0 / temperature
    ce_sum = torch.zeros((), dtype=acc, device=hidden_ND.device)
    kl_sum = torch.zeros((), dtype=acc, device=hidden_ND.device)
    dh_ND = torch.empty_like(hidden_ND) if grads[0] else None
    dw_VD = torch.zeros(weight_VD.shape, dtype=acc, device=weight_VD.device) if grads[1] else None
    for s in range(0, n, chunk_rows):
        h_CD = hidden_ND[s:s + chunk_rows].detach().to(compute_dtype)
        v_C = valid_N[s:s + chunk_rows]
        t_C = torch.where(v_C, target_N[s:s + chunk_rows], 0)[:, None]  # (C, 1)
        z_CV = (h_CD @ w_VD.t()).to(acc)  # student logits in the compute dtype, then fp32
        logq_CV = torch.log_softmax(z_CV, dim=-1)
        ce_sum -= torch.where(v_C, logq_CV.gather(1, t_C)[:, 0], 0).sum()
        g_CD = teacher_ND[s:s + chunk_rows].detach().to(u_VD.dtype)
        logp_CV = torch.log_softmax((g_CD @ u_VD.t()).to(acc).mul_(inv_t), dim=-1)  # teacher, T
        logqt_CV = logq_CV if temperature == 1.0 else torch.log_softmax(z_CV * inv_t, dim=-1)
        del z_CV
        p_CV = logp_CV.exp()
        # KL(p || q) per row = sum_v p (log p - log q); ignored rows give 0
        kl_C = (logp_CV.sub_(logqt_CV).mul_(p_CV)).sum(-1)
        del logp_CV
        kl_sum += torch.where(v_C, kl_C, 0).sum()
        if dh_ND is None and dw_VD is None:
            continue
        # d(CE)/dz = q - onehot; d(kl_weight KL)/dz = kl_weight (q_T - p_T) / T; / count
        c = kl_weight * inv_t
        if temperature == 1.0:  # q_T = q: g = (1 + c) q - c p, in place on q
            g_CV = logq_CV.exp_().mul_(1.0 + c).sub_(p_CV, alpha=c)
        else:
            g_CV = logqt_CV.exp_().sub_(p_CV).mul_(c).add_(logq_CV.exp_())
        del p_CV, logq_CV, logqt_CV
        g_CV.scatter_add_(1, t_C, -v_C.to(acc)[:, None])
        g_CV.mul_((v_C.to(acc) * inv)[:, None])  # ignored rows: 0 (NaN stays NaN)
        g_CV = g_CV.to(compute_dtype)
        if dh_ND is not None:
            dh_ND[s:s + chunk_rows] = (g_CV @ w_VD).to(hidden_ND.dtype)
        if dw_VD is not None:
            dw_VD += (g_CV.t() @ h_CD).to(acc)
    return ce_sum, kl_sum, count, dh_ND, dw_VD


class _LinearCrossEntropyKL(torch.autograd.Function):
    """``CE + kl_weight * KL`` of student logits ``hidden_ND @ weight_VD^T`` and teacher logits
    ``teacher_ND @ teacher_VD^T``; gradients (student hidden states and LM-head weight only)
    made in forward. Outputs: (loss, ce, kl), scalars in the weight's float dtype; ce and kl are
    not differentiable (for logging)."""

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, target_N, teacher_ND, teacher_VD, temperature,
                kl_weight, ignore_index, compute_dtype, chunk_rows):
        grads = (hidden_ND.requires_grad, weight_VD.requires_grad)
        with torch.autocast(hidden_ND.device.type, enabled=False):
            ce_sum, kl_sum, count, dh_ND, dw_VD = _chunks_kl(
                hidden_ND, weight_VD, target_N, teacher_ND, teacher_VD, temperature, kl_weight,
                ignore_index, compute_dtype, chunk_rows, grads)
        ctx.save_for_backward(dh_ND, dw_VD)
        ctx.weight_dtype = weight_VD.dtype
        ctx.used = False
        ce, kl = ce_sum / count, kl_sum / count
        loss = ce + kl_weight * kl
        ctx.mark_non_differentiable(ce, kl)
        return loss, ce, kl

    @staticmethod
    def backward(ctx, grad_loss, grad_ce, grad_kl):
        if ctx.used:
            raise RuntimeError("fused cross-entropy + KL: backward ran twice (its gradients are "
                               "made in forward and scaled in place)")
        ctx.used = True
        return (*_scaled_grads(ctx, grad_loss), None, None, None, None, None, None, None, None)


@torch.compiler.disable  # trainer.compile: the model compiles around it; this runs as written
def _check_ce_args(fn: str, hidden_ND, weight_VD, target_N, chunk_rows) -> None:
    """The shared ValueError of ``fn`` (a linear cross-entropy): hidden_ND (N, D) and weight_VD
    (V, D) sharing D, target_N (N,), chunk_rows >= 1."""
    if hidden_ND.dim() != 2 or weight_VD.dim() != 2 or hidden_ND.shape[1] != weight_VD.shape[1]:
        raise ValueError(f"{fn}: hidden_ND (N, D) and weight_VD (V, D) must share D; got "
                         f"{tuple(hidden_ND.shape)}, {tuple(weight_VD.shape)}")
    if target_N.shape != hidden_ND.shape[:1]:
        raise ValueError(f"{fn}: target_N must be (N={hidden_ND.shape[0]},); got "
                         f"{tuple(target_N.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"{fn}: chunk_rows must be >= 1; got {chunk_rows}")


def _check_kl_args(hidden_ND, weight_VD, target_N, teacher_ND, teacher_VD, chunk_rows,
                   temperature, kl_weight) -> None:
    """``linear_cross_entropy_kl``'s ValueError for shapes that do not match, chunk_rows < 1,
    temperature <= 0 or kl_weight < 0."""
    _check_ce_args("linear_cross_entropy_kl", hidden_ND, weight_VD, target_N, chunk_rows)
    n, v = hidden_ND.shape[0], weight_VD.shape[0]
    if (teacher_ND.dim() != 2 or teacher_VD.dim() != 2 or teacher_ND.shape[0] != n
            or teacher_VD.shape[0] != v or teacher_ND.shape[1] != teacher_VD.shape[1]):
        raise ValueError(f"linear_cross_entropy_kl: teacher_ND must be (N={n}, E) and "
                         f"teacher_VD (V={v}, E); got "
                         f"{tuple(teacher_ND.shape)}, {tuple(teacher_VD.shape)}")
    if not temperature > 0 or not kl_weight >= 0:
        raise ValueError(f"linear_cross_entropy_kl: temperature must be > 0 and kl_weight >= 0; "
                         f"got {temperature}, {kl_weight}")


def linear_cross_entropy_kl(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    target_N: torch.Tensor,
    teacher_ND: torch.Tensor,
    teacher_VD: torch.Tensor,
    *,
    kl_weight: float = 1.0,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    compute_dtype: torch.dtype | None = None,
    chunk_rows: int = CE_CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy plus a distillation KL term without the (N, V) logits of either model.

    With student logits ``z = hidden_ND @ weight_VD^T`` and teacher logits
    ``u = teacher_ND @ teacher_VD^T``, over the rows whose target is not ``ignore_index``
    (the same rows as the CE, and its mean):

        ce   = mean  -log_softmax(z)[target]
        kl   = mean  sum_v p_T (log p_T - log q_T),  p_T = softmax(u / T), q_T = softmax(z / T)
        loss = ce + kl_weight * kl

    (``sparsity.distill_*``: the trainer passes ``kl_weight = distill_weight * T^2``.) Only the
    student gets gradients; the teacher's inputs are read as constants.

    Args:
        hidden_ND: (N, D) float, the student's final-norm hidden states.
        weight_VD: (V, D) float, the student's LM-head weight.
        target_N: (N,) integer targets in [0, V) or ``ignore_index``.
        teacher_ND: (N, E) float, the teacher's final-norm hidden states (E may differ from D).
        teacher_VD: (V, E) float, the teacher's LM-head weight; the teacher's logits are
            computed in its dtype (bf16 on GPU), log-softmax in fp32.
        kl_weight: multiplier of ``kl`` in ``loss`` (>= 0).
        temperature: T > 0.
        compute_dtype: dtype of the student's GEMMs (bf16 under autocast); None = hidden's.
        chunk_rows: C, rows of logits per chunk.

    Returns:
        (loss, ce, kl): scalars (fp32 for fp32/bf16 weights); ``loss`` carries the gradient
        (backward once), ``ce`` and ``kl`` are detached. NaN when no target is valid; NaN or
        inf in a valid row propagates.

    Raises:
        ValueError: shapes that do not match, chunk_rows < 1, temperature <= 0, kl_weight < 0.
    """
    _check_kl_args(hidden_ND, weight_VD, target_N, teacher_ND, teacher_VD, chunk_rows,
                   temperature, kl_weight)
    dt = compute_dtype or hidden_ND.dtype
    args = (hidden_ND, weight_VD, target_N.long(), teacher_ND, teacher_VD, float(temperature),
            float(kl_weight), ignore_index, dt, chunk_rows)
    if torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_VD.requires_grad):
        return _LinearCrossEntropyKL.apply(*args)
    with torch.no_grad(), torch.autocast(hidden_ND.device.type, enabled=False):
        ce_sum, kl_sum, count, _, _ = _chunks_kl(*args, (False, False))
    ce, kl = ce_sum / count, kl_sum / count
    return ce + kl_weight * kl, ce, kl


@dataclass
class DistillOutput(CausalLMOutputWithPast):
    """``model(input_ids, labels)`` of a model with :func:`use_distillation`, in training:
    ``loss`` = CE + kl_weight * KL (differentiable); ``distill_ce`` and ``distill_kl`` its two
    parts, detached (for the logs); ``logits`` None. Without gradients (validation) ``loss``
    is the CE alone and the teacher does not run."""

    distill_ce: torch.FloatTensor | None = None
    distill_kl: torch.FloatTensor | None = None


@dataclass
class DistillTeacher:
    """What :func:`use_distillation` keeps on the student (a plain attribute: the teacher is no
    submodule, so it is in no state dict, optimizer, DDP bucket or checkpoint)."""

    teacher: torch.nn.Module
    kl_weight: float
    temperature: float
    chunk_rows: int


def _distill_forward(self, input_ids=None, labels=None, **kwargs):
    """``LlamaForCausalLM.forward`` whose loss (with ``labels``) is :func:`linear_cross_entropy_kl`
    against the teacher's logits on the same ids (teacher under no_grad); without gradients the
    CE alone (chunked); without labels transformers' own forward."""
    if labels is None:
        return self._twell_plain_forward(input_ids=input_ids, **kwargs)
    if kwargs.pop("num_items_in_batch", None) is not None:
        raise ValueError("distillation takes the mean over the batch's targets; "
                         "num_items_in_batch is not supported")
    kwargs.pop("logits_to_keep", None)
    spec: DistillTeacher = self._twell_distill
    hidden_BTD = self.model(input_ids=input_ids, **kwargs).last_hidden_state
    dev = hidden_BTD.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden_BTD.dtype
    hidden_ND = hidden_BTD.reshape(-1, hidden_BTD.shape[-1])
    target_N = shift_labels(labels.to(hidden_BTD.device))
    if not torch.is_grad_enabled():
        return DistillOutput(loss=linear_cross_entropy(
            hidden_ND, self.lm_head.weight, target_N, compute_dtype=dt,
            chunk_rows=spec.chunk_rows), logits=None)
    with torch.no_grad():
        teacher_BTE = spec.teacher.model(input_ids=input_ids, **{
            k: kwargs[k] for k in ("attention_mask", "position_ids") if k in kwargs}
        ).last_hidden_state
    loss, ce, kl = linear_cross_entropy_kl(
        hidden_ND, self.lm_head.weight, target_N, teacher_BTE.reshape(-1, teacher_BTE.shape[-1]),
        spec.teacher.lm_head.weight, kl_weight=spec.kl_weight, temperature=spec.temperature,
        compute_dtype=dt, chunk_rows=spec.chunk_rows)
    return DistillOutput(loss=loss, logits=None, distill_ce=ce, distill_kl=kl)


def use_distillation(model, teacher, *, kl_weight: float, temperature: float = 1.0,
                     chunk_rows: int = CE_CHUNK_ROWS) -> None:
    """Make ``model(input_ids=..., labels=...)`` return :class:`DistillOutput`: the loss
    ``CE + kl_weight * KL(teacher_T || student_T)`` of :func:`linear_cross_entropy_kl`, the
    frozen ``teacher`` run on the same ids in the same forward, without gradients
    (``sparsity.distill_from``). Set before ``accelerate.prepare`` (an instance-level
    ``forward``, which accelerate's autocast and DDP then wrap as they wrap the stock one).

    Args:
        model: the student ``LlamaForCausalLM`` (``.model``, ``.lm_head``).
        teacher: a causal LM of the same vocabulary, every parameter frozen, on the student's
            device (:func:`train.pretrained.build_teacher`).
        kl_weight: multiplier of the KL in the loss (the trainer: ``distill_weight * T^2``).
        temperature: T > 0.
        chunk_rows: rows of logits per chunk.

    Raises:
        ValueError: not causal LMs, different vocabularies, or a teacher parameter that
            requires gradients.
    """
    for name, m in (("model", model), ("teacher", teacher)):
        if not (hasattr(m, "model") and hasattr(m, "lm_head")):
            raise ValueError(f"use_distillation: {name} must be a causal LM with .model and "
                             f".lm_head; got {type(m).__name__}")
    v_s, v_t = model.lm_head.weight.shape[0], teacher.lm_head.weight.shape[0]
    if v_s != v_t:
        raise ValueError(f"use_distillation: the teacher's vocabulary ({v_t}) is not the "
                         f"student's ({v_s})")
    if any(p.requires_grad for p in teacher.parameters()):
        raise ValueError("use_distillation: the teacher must be frozen (requires_grad_(False))")
    model._twell_distill = DistillTeacher(teacher, float(kl_weight), float(temperature),
                                          int(chunk_rows))
    model._twell_plain_forward = types.MethodType(type(model).forward, model)
    model.forward = types.MethodType(_distill_forward, model)
