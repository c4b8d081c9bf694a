"""Liger-Kernel's fused RMSNorm, RoPE and linear cross-entropy in the training model
(``trainer.liger``).

What a transformers user runs to train a dense Llama fast on one GPU is
``apply_liger_kernel_to_llama(rope=True, rms_norm=True, fused_linear_cross_entropy=True)``: one
Triton kernel per RMSNorm and per RoPE direction instead of transformers' chains of eager
elementwise passes, and the LM head + cross-entropy in row chunks without the (tokens x vocab)
logits. Every path of ours (dense, ``ell``, ``auto``) uses the same kernels for the same parts of
the step, so that a sparse-against-dense ratio measures the FFN and nothing else
(BENCHMARKS.md, "Whole model against transformers + Liger-Kernel").

Unlike Liger's ``apply_liger_kernel_to_llama``, nothing here changes a class or a module function
for other models of the process: the norms and the loss are patched on this model's instances,
and RoPE goes through a dispatcher in transformers' Llama module that takes Liger's kernel only
inside the attention modules of a model given to :func:`use_liger` and only for CUDA tensors
(a plain ``LlamaForCausalLM`` built afterwards, or this one moved to the CPU, runs stock code).
transformers' own (SiLU) ``LlamaMLP`` is never touched: our FFN is ``SparseGatedMLP``.

Numerics (bf16 autocast over fp32 master weights, the trainer's setting): Liger's RMSNorm in its
``llama`` casting mode computes in fp32 like transformers' and returns the input's dtype (fp32:
the residual stream); its RoPE rotates bf16 q and k in place of transformers' fp32 products (one
bf16 rounding apart); its fused loss multiplies in bf16 and accumulates the LM-head gradient in
fp32. On one H200 the training loss of every path of ours with these kernels matched plain
transformers' bf16 loss within the whole-model benchmark's tolerance (``check_ok`` of every row
in ``docs/model_bench/best_configs.csv``); tests/train/test_liger.py compares losses and
gradients on CUDA (skipped on CI's CPU; not yet run on a GPU).

Source: Liger-Kernel (linkedin/Liger-Kernel), ``liger_kernel.transformers``.
"""

from __future__ import annotations

import threading
import types

import torch

from twell.ops.rms_norm import add_rms_norm_cast, rms_norm_cast

_ROPE_STATE = threading.local()  # depth of liger-enabled attention forwards on this thread
_STOCK_ROPE = None  # transformers' apply_rotary_pos_emb, kept when the dispatcher goes in
# residual streams and norm weights whose inference norm rms_norm_cast writes (fp64: stock)
_STREAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def liger_available() -> bool:
    """Whether ``liger_kernel`` imports (it needs Triton: Linux x86-64)."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception:  # noqa: BLE001  (ImportError, or Triton failing to load its driver)
        return False
    return True


def liger_enabled(setting: bool | None, *, device_type: str, precision: str,
                  compile: bool) -> bool:
    """Whether a run uses :func:`use_liger` (``trainer.liger``).

    ``setting`` true / false is taken as given; null (auto) is on for CUDA bf16 runs that are
    not compiled (``trainer.compile``: inductor fuses the norms and RoPE itself) when
    ``liger_kernel`` imports; off on the CPU, whose runs keep transformers' reference code.
    ``precision`` is the resolved one (bf16 | fp32). Measured (one H200, 1.5B, micro-batch 16):
    our dense path 36.1 -> 50.3 tokens/ms, ``ell`` 39.7 -> 59.5 (BENCHMARKS.md, "Whole model
    against transformers + Liger-Kernel").
    """
    if setting is not None:
        return bool(setting)
    return device_type == "cuda" and precision == "bf16" and not compile and liger_available()


def fused_cast_dtype(norm, x) -> torch.dtype | None:
    """The dtype in which ``norm``'s forward writes its output for input ``x`` through
    :func:`twell.ops.rms_norm.rms_norm_cast`, or None where it runs something else (Liger's
    kernel, with or without a cast after it; transformers' forward).

    That is, for a norm patched by :func:`use_liger` with ``norm_out_autocast`` and
    ``fused_norm_cast`` and ``x`` on the norm's kernel device (``_twell_cast_device``:
    ``"cuda"``; tests set ``"cpu"`` to run the kernel in Triton's interpreter):

    * training's case, an fp32 ``x`` (the residual stream) under that device's autocast: the
      autocast dtype (bf16), with or without grad mode;
    * inference's, grad mode off and ``x`` and the weight fp32 / bf16 / fp16 (a bf16 model's
      forward, evaluation, generation): the stock norm's output dtype (the two promoted: bf16
      in a bf16 model), where Liger's kernel ran before (bf16 in and out; the same math and
      launch: one program a row).

    Only there can ``train.residual_join`` hand the norm a residual add: in inference's case
    the sum is then in x's dtype (``add_rms_norm_cast`` has no backward for a bf16 sum; grad
    mode is off)."""
    dev = getattr(norm, "_twell_cast_device", None)
    if not (getattr(norm, "_twell_cast_out", False) and getattr(norm, "_twell_cast_fused", False)
            and x.device.type == dev):
        return None
    if x.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    if not torch.is_grad_enabled() and x.dtype in _STREAM_DTYPES \
            and norm.weight.dtype in _STREAM_DTYPES:
        return torch.promote_types(x.dtype, norm.weight.dtype)
    return None


def _norm_forward(self, hidden_states: torch.Tensor, delta: torch.Tensor | None = None):
    """The patched norm: ``norm(x)`` -> (..., D) output; ``norm(residual, delta)`` (the residual
    join of ``train.residual_join``) -> ``(residual + delta, norm of that sum)``, the two in
    one kernel each way where :func:`fused_cast_dtype` is not None, else an add and the norm."""
    dtype = fused_cast_dtype(self, hidden_states)
    if delta is not None:
        if dtype is not None:
            return add_rms_norm_cast(hidden_states, delta, self.weight, self.variance_epsilon,
                                     dtype)
        hidden_states = hidden_states + delta
        return hidden_states, _norm_forward(self, hidden_states)
    if dtype is not None:
        # the cast in the kernel's store, the gradient's widening in its backward's load
        return rms_norm_cast(hidden_states, self.weight, self.variance_epsilon, dtype)
    if not hidden_states.is_cuda:  # Liger's kernels are CUDA-only: the stock forward
        return type(self).forward(self, hidden_states)
    from liger_kernel.ops import LigerRMSNormFunction

    # offset 0, transformers' Llama casting (fp32 math, output in the input's dtype), dY
    # overwritten by dX in backward (Liger's default for Llama), no forced row mode
    y = LigerRMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon, 0.0,
                                   "llama", True, None)
    if getattr(self, "_twell_cast_out", False) and torch.is_autocast_enabled("cuda") \
            and y.dtype == torch.float32:  # Liger's output: the input's dtype
        # one cast that q, k and v (the gate and up projections) share, where each consumer
        # would cast (and keep) its own copy: the same bf16 values, 2 of 3 casts and copies less
        y = y.to(torch.get_autocast_dtype("cuda"))
    return y


def _loss_forward(self, *args, **kwargs):
    """The causal LM's forward with Liger's fused linear cross-entropy on CUDA (its loss without
    the logits in training; logits as usual in evaluation), the stock forward elsewhere."""
    if not self.lm_head.weight.is_cuda:
        return self._twell_stock_forward(*args, **kwargs)
    from liger_kernel.transformers.model.llama import lce_forward

    return lce_forward(self, *args, **kwargs)


def _rope_dispatch(q, k, cos, sin, *args, **kwargs):
    """transformers' ``apply_rotary_pos_emb`` replaced: Liger's kernel inside a patched model's
    attention on CUDA, the stock function everywhere else."""
    if getattr(_ROPE_STATE, "depth", 0) > 0 and q.is_cuda and not args and not kwargs:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        return liger_rotary_pos_emb(q, k, cos, sin)
    return _STOCK_ROPE(q, k, cos, sin, *args, **kwargs)


def _install_rope_dispatch() -> None:
    global _STOCK_ROPE
    from transformers.models.llama import modeling_llama

    if modeling_llama.apply_rotary_pos_emb is not _rope_dispatch:
        _STOCK_ROPE = modeling_llama.apply_rotary_pos_emb
        modeling_llama.apply_rotary_pos_emb = _rope_dispatch


def _enter_rope(module, args, kwargs=None):
    _ROPE_STATE.depth = getattr(_ROPE_STATE, "depth", 0) + 1


def _leave_rope(module, args, output, kwargs=None):
    _ROPE_STATE.depth -= 1


def _check_llama(model):
    """``model.model`` after checking the Llama causal LM's form (``use_liger``'s ValueError)."""
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "norm") or not hasattr(base, "layers") \
            or not hasattr(model, "lm_head"):
        raise ValueError(f"use_liger needs a Llama causal LM (.model.norm, .model.layers, "
                         f".lm_head); got {type(model).__name__}")
    if not hasattr(base.norm, "variance_epsilon"):
        raise ValueError(f"use_liger: {type(base.norm).__name__} has no variance_epsilon (not "
                         "an RMSNorm of the LlamaRMSNorm form)")
    return base


def _patch_norms(model, norm_cls, norm_out_autocast: bool, fused_norm_cast: bool) -> int:
    """Liger's RMSNorm forward on every ``norm_cls`` module of ``model``; how many."""
    n_norm = 0
    for m in model.modules():
        if type(m) is norm_cls:
            m.forward = types.MethodType(_norm_forward, m)
            m._twell_cast_out = bool(norm_out_autocast)
            m._twell_cast_fused = bool(fused_norm_cast)
            m._twell_cast_device = "cuda"  # where Liger's kernels (and so these norms) run
            n_norm += 1
    return n_norm


def _hook_rope(layers) -> int:
    """The hooks selecting Liger's RoPE on each layer's ``self_attn`` (once); how many new."""
    _install_rope_dispatch()
    n_rope = 0
    for layer in layers:
        attn = layer.self_attn
        if getattr(attn, "_twell_liger_rope", False):
            continue
        attn.register_forward_pre_hook(_enter_rope)
        attn.register_forward_hook(_leave_rope, always_call=True)
        attn._twell_liger_rope = True
        n_rope += 1
    return n_rope


def use_liger(model, *, fused_linear_ce: bool = True, norm_out_autocast: bool = False,
              fused_norm_cast: bool = False) -> dict:
    """Put Liger-Kernel's RMSNorm, RoPE and (``fused_linear_ce``) fused linear cross-entropy
    into a transformers Llama causal LM, on this instance only (module docstring).

    ``norm_out_autocast`` (the trainer's ``trainer.norm_out_bf16``; off for the ``liger``
    baseline, which is Liger as a user gets it): under CUDA autocast every norm (the final one
    before the LM head too) returns its output already in the autocast dtype, so that the
    consumers (q, k, v; a PyTorch FFN's gate and up) share one cast and one saved copy instead
    of casting the fp32 output each (values
    unchanged; their input gradients are then summed in bf16, one rounding each). Measured at
    2B, micro-batch 16 without recomputation: ``ell`` -9.7 GB peak and +4.4 % tokens/ms
    (BENCHMARKS.md, "2B profile: outcome"). ``fused_norm_cast`` (with ``norm_out_autocast``):
    that bf16 output written by :func:`twell.ops.rms_norm.rms_norm_cast` (the same math as
    Liger's kernel, its row sums rounded in another order, the cast in its store) instead of
    Liger's kernel and a cast after it; such a norm also takes a residual add,
    ``norm(residual, delta) -> (sum, normed)`` in one kernel
    (:func:`train.residual_join.use_fused_joins` hands it the decoder layers' adds).

    The hooks that select Liger's RoPE are module forward hooks on each decoder layer's
    ``self_attn``, so they also hold in the forward that activation checkpointing replays in
    backward (on the autograd thread: the state is per thread). Call before
    ``accelerator.prepare`` (an instance-level ``forward``, like the stock one, is then wrapped by
    autocast and DDP). ``fused_linear_ce=False`` keeps the model's loss (the distillation loss
    replaces it afterwards).

    Args:
        model: a ``LlamaForCausalLM`` (``.model.norm``, ``.model.layers[i].self_attn``,
            ``.lm_head``).

    Returns:
        ``{"rms_norm": n, "rope": n, "fused_linear_ce": bool}``: the norm and attention modules
        patched and whether the loss was.

    Raises:
        ValueError: the model has no ``.model.norm`` / ``.model.layers`` / ``.lm_head``, or its
            norm is not of the ``LlamaRMSNorm`` form (no ``variance_epsilon``).
        ImportError: ``liger_kernel`` is not installed (``pip install liger-kernel``).
    """
    base = _check_llama(model)
    import liger_kernel.transformers  # noqa: F401  (ImportError names the package)

    n_norm = _patch_norms(model, type(base.norm), norm_out_autocast, fused_norm_cast)
    n_rope = _hook_rope(base.layers)
    if fused_linear_ce:
        model._twell_stock_forward = types.MethodType(type(model).forward, model)
        model.forward = types.MethodType(_loss_forward, model)
    return {"rms_norm": n_norm, "rope": n_rope, "fused_linear_ce": bool(fused_linear_ce)}


__all__ = ["fused_cast_dtype", "liger_available", "liger_enabled", "use_liger"]
