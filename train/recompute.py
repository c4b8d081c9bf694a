"""Selective activation recomputation: under gradient checkpointing, recompute only the
attention half of a decoder layer whose FFN runs the sparse (ELL) training path.

Why (the whole-model benchmark's ceiling): full checkpointing replays each decoder layer's whole
forward in backward, so the sparse FFN's gate GEMM (``N x D x H``, the part TwELL cannot skip) and
its compaction, SDDMM, SpMM and CSC sort run twice. But the sparse op saves little for backward (its
ELL state), so keeping that state costs less memory than replaying it costs time. Dense FFNs save
``N x H`` tensors (two or three of them), so they keep full recomputation.

``trainer.checkpoint_ffn`` (with ``trainer.grad_checkpointing=true``):

* ``always`` (default): transformers' own per-layer checkpoint; the whole layer replays.
* ``auto``: a layer whose FFN trains on the ``ell`` path this step (its FFN plan says so:
  ``twell.nn.plan.trains_ell``; fixed within an optimizer step, changed only between steps) runs
  ``checkpoint(input_layernorm -> self_attn -> + residual -> post_attention_layernorm)`` and then
  its FFN and the second residual add outside any checkpoint; every other layer keeps the full
  checkpoint.
* ``never``: every layer runs that way (dense FFNs then keep their ``N x H`` activations:
  memory-hungry; for A/B runs at a micro-batch that fits). The memory planner's ``attention``
  mode (``train/memory.py``): its memory is largest at the start, while every FFN is dense,
  where ``auto``'s grows as layers move to the ELL path.

:func:`set_recompute` switches a model between these and no checkpointing (``none``), by the
planner's names (:data:`RECOMPUTE_MODES`).

Memory of one such layer's saved state (N tokens, D model width, H FFN width, KC ELL capacity,
R dense-backup rows, bf16 autocast over fp32 weights), against full checkpointing's ``4 N D``
bytes (the layer input, fp32):

    layer input (checkpoint's input, fp32)          4 N D      (as with full checkpointing)
    FFN input x (bf16, the sparse op's saved copy)  2 N D
    ELL state: col int32 + g, u bf16 + CSC perm     (4 + 2 + 2 + 4) N KC,  + 4 N (lengths)
    dense backup g_R, u_R (bf16)                    4 R H
    the three bf16 weight casts                     none: recast from the fp32 parameters in
                                                    backward (``_recast_weights``), one cast
                                                    each, as full checkpointing's replay does

At the 1.5B shape (N 16384, D 2048, H 5632, KC 128, R ~100): 134 + 67 + 25 + 2 MB = ~229 MB
per ELL layer against 134 MB: ~2.7 GB more over 28 layers. The post-attention norm sits
inside the checkpoint so that its fp32 output (4 N D) is not saved (it is recomputed: one cheap
elementwise pass). Saved FLOPs per ELL layer and micro-step: the gate GEMM (2 N D H = 0.38 TFLOP,
~0.56 ms on an H200) plus the op's sparse forward.

The L1 side output keeps its graph: the FFN runs once, outside any checkpoint, and its
``last_stats.l1`` is what the trainer adds to the loss. Non-reentrant semantics everywhere
(``use_reentrant=False``), as transformers' own checkpoint is configured here.

Implemented by an instance-level ``forward`` on each ``LlamaDecoderLayer`` that falls back to
the layer's own (checkpointing) forward whenever the selective path does not apply (eval mode,
no grad, a dense FFN under ``auto``), so inference and ``always`` layers run transformers' code.
Needs transformers >= 4.54 (decoder layers return a tensor; the project requires >= 4.56).
"""

from __future__ import annotations

import inspect
import types

import torch
from torch.utils.checkpoint import checkpoint

from twell.nn.plan import trains_ell

CHECKPOINT_FFN_MODES = ("always", "auto", "never")  # trainer.checkpoint_ffn
# How much of each decoder layer the backward recomputes, from least to most (the memory
# planner's vocabulary, train/memory.py): the trainer.checkpoint_ffn value of each, None = no
# checkpointing (trainer.grad_checkpointing=false).
RECOMPUTE_CHECKPOINT_FFN = {"none": None, "attention": "never", "attention_ell": "auto",
                            "full": "always"}
RECOMPUTE_MODES = tuple(RECOMPUTE_CHECKPOINT_FFN)
# kwargs naming a KV cache in the decoder layers of transformers 4.56 - 5.x; training never uses
# one (transformers' own checkpointing sets them to None as well)
CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _attention_block(layer, hidden_states, kwargs):
    """``input_layernorm -> self_attn -> + residual -> post_attention_layernorm``; returns the
    residual stream after attention (fp32 under autocast) and the FFN's normalised input."""
    out = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)
    attn = out[0] if isinstance(out, tuple) else out
    mid = hidden_states + attn
    return mid, layer.post_attention_layernorm(mid)


class _Kept:
    """What a pack hook keeps of a tensor it saves as it is (:func:`_alias`): a detached alias
    and the version it had when saved."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor, self.version = tensor, version


def _alias(t: torch.Tensor) -> _Kept:
    """What a pack hook keeps of a tensor it saves as it is: a detached alias (same storage and
    version counter; autograd re-attaches the graph when it unpacks) and its version. Never
    ``t`` itself: an op that saves its own output (rsqrt, softmax, SDPA's attention output)
    would then hold, in its C++ node, a tensor whose ``grad_fn`` is that node, a reference
    cycle that Python's collector cannot see. Backward breaks it as it frees each node's saved
    tensors; a graph whose backward never runs (a forward with gradients for a loss check, a
    step that ran out of memory) would keep every tensor and parameter it reaches for the rest
    of the process. The version: autograd checks it only for tensors it saves itself, not for
    what hooks keep (:func:`_unalias` does)."""
    return _Kept(t.detach(), t._version)


def _unalias(kept: _Kept) -> torch.Tensor:
    """The tensor :func:`_alias` kept.

    Raises:
        RuntimeError: it was modified in place after it was saved (autograd's own check)."""
    t = kept.tensor
    if t._version != kept.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: a saved {t.dtype} tensor of shape {tuple(t.shape)} is at "
            f"version {t._version}, saved at version {kept.version}")
    return t


class _recast_weights(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that store a low-precision cast of one of ``params`` (or its transpose,
    which ``F.linear``'s matmul saves) as a reference to the fp32 parameter and recast it when
    backward unpacks it. The cast is recognised by its autograd nodes: ``ToCopyBackward`` (after
    an optional ``TBackward``) whose input is the parameter's ``AccumulateGrad``. So the FFN
    outside the checkpoint keeps no bf16 weight copies between forward and backward; the
    parameters must not change in place in between (checked with their version counters).
    Every other tensor is kept as it would be, as a detached alias (:func:`_alias`)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        ids = {id(p) for p in params}

        def pack(t: torch.Tensor):
            fn, transposed = t.grad_fn, False
            if fn is not None and type(fn).__name__.startswith("TBackward"):
                fn, transposed = fn.next_functions[0][0], True
            if fn is not None and type(fn).__name__.startswith("ToCopyBackward"):
                src = getattr(fn.next_functions[0][0], "variable", None)
                shape = tuple(reversed(t.shape)) if transposed else tuple(t.shape)
                if src is not None and id(src) in ids and tuple(src.shape) == shape:
                    return (src, t.dtype, src._version, transposed)
            return _alias(t)

        def unpack(packed):
            if isinstance(packed, _Kept):
                return _unalias(packed)
            src, dtype, version, transposed = packed
            if src._version != version:
                raise RuntimeError(
                    "a weight was modified in place between forward and backward; "
                    "trainer.checkpoint_ffn (FFN weights) and trainer.recast_attn_weights "
                    "recast weights in backward and need them unchanged (step the optimizer "
                    "after backward)")
            w = src.detach().to(dtype)
            return w.t() if transposed else w

        super().__init__(pack, unpack)


def _selective_forward(self, hidden_states, *args, **kwargs):
    """Decoder-layer forward with only the attention half checkpointed (see module docstring).

    Shapes: hidden_states (B, T, D) -> (B, T, D), as ``LlamaDecoderLayer.forward``.
    """
    full = self._twell_full_forward  # transformers' forward (checkpoints the whole layer)
    mode = self._twell_checkpoint_ffn
    if mode == "always" or not (self.training and torch.is_grad_enabled()
                                and self.gradient_checkpointing) or (
            mode == "auto" and not trains_ell(self.mlp)):
        return full(hidden_states, *args, **kwargs)
    bound = self._twell_signature.bind(hidden_states, *args, **kwargs).arguments
    extra = bound.pop(self._twell_var_kw, {})
    bound.pop("hidden_states")
    attn_kwargs = {**bound, **extra}
    for k in CACHE_KWARGS:
        if k in attn_kwargs:
            attn_kwargs[k] = None
    if "use_cache" in attn_kwargs:
        attn_kwargs["use_cache"] = False
    mid, x = checkpoint(_attention_block, self, hidden_states, attn_kwargs, use_reentrant=False)
    mlp = self.mlp
    weights = [p for p in mlp.parameters() if p.dim() == 2]
    with _recast_weights(weights):
        y = mlp(x)
    return mid + y


def enable_selective_recompute(model, mode: str) -> None:
    """Install ``trainer.checkpoint_ffn=mode`` on every decoder layer of a transformers decoder
    whose checkpointing is already enabled (:func:`enable_grad_checkpointing`).

    Args:
        model: a ``LlamaForCausalLM`` (``model.model.layers``) with ``SparseGatedMLP`` FFNs.
        mode: one of :data:`CHECKPOINT_FFN_MODES`; ``always`` leaves the model as it is.

    Raises:
        ValueError: unknown mode; a layer without ``self_attn`` / ``mlp`` / the two norms.
    """
    if mode not in CHECKPOINT_FFN_MODES:
        raise ValueError(f"checkpoint_ffn must be one of {CHECKPOINT_FFN_MODES}; got {mode!r}")
    if mode == "always":  # layers installed earlier (set_recompute) fall back to full layers
        for layer in model.model.layers:
            if hasattr(layer, "_twell_checkpoint_ffn"):
                layer._twell_checkpoint_ffn = "always"
        return
    for i, layer in enumerate(model.model.layers):
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            if not hasattr(layer, name):
                raise ValueError(f"decoder layer {i} ({type(layer).__name__}) has no {name}; "
                                 "checkpoint_ffn needs a Llama-style decoder layer")
        cls_forward = type(layer).forward
        sig = inspect.signature(cls_forward)  # follows __wrapped__ to transformers' own forward
        params = list(sig.parameters.values())[1:]  # drop self
        var_kw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
        layer._twell_signature = sig.replace(parameters=params)
        layer._twell_var_kw = var_kw
        layer._twell_checkpoint_ffn = mode
        layer._twell_full_forward = types.MethodType(cls_forward, layer)
        # beneath train.residual_join's forward where it is installed: that one must see the
        # layer's input first (a pending residual add, summed before this forward runs)
        slot = "_twell_inner_forward" if "_twell_inner_forward" in vars(layer) else "forward"
        setattr(layer, slot, types.MethodType(_selective_forward, layer))


def set_recompute(model, recompute: str) -> None:
    """Make a transformers decoder recompute ``recompute`` of each layer in backward, whatever
    was set before (the memory planner switches between its candidates with it).

    Args:
        model: a ``LlamaForCausalLM`` with ``SparseGatedMLP`` FFNs (not a DDP wrapper: pass
            ``accelerator.unwrap_model(model)``).
        recompute: one of :data:`RECOMPUTE_MODES`: ``none`` (no checkpointing), ``attention``
            (every layer's attention half; ``checkpoint_ffn=never``), ``attention_ell`` (the
            attention half of layers on the ELL path, whole other layers; ``checkpoint_ffn=auto``),
            ``full`` (whole layers; ``checkpoint_ffn=always``).

    Raises:
        ValueError: unknown ``recompute``.
    """
    if recompute not in RECOMPUTE_CHECKPOINT_FFN:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}; got {recompute!r}")
    mode = RECOMPUTE_CHECKPOINT_FFN[recompute]
    if mode is None:
        disable = (getattr(model, "activation_checkpointing_disable", None)
                   or model.gradient_checkpointing_disable)
        disable()
        return
    enable_grad_checkpointing(model, mode)


def enable_grad_checkpointing(model, checkpoint_ffn: str = "always") -> None:
    """Recompute each decoder layer in backward, non-reentrant (the L1 side output of every FFN
    keeps its graph). transformers >= 5.2x calls it ``activation_checkpointing_enable``.

    ``checkpoint_ffn`` (``trainer.checkpoint_ffn``): ``always`` recomputes whole layers;
    ``auto`` / ``never`` recompute only the attention half of layers whose FFN trains on the
    ``ell`` path / of every layer (:func:`enable_selective_recompute`).
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    enable_selective_recompute(model, checkpoint_ffn)
