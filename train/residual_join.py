"""Each residual add of the decoder layers in one kernel with the norm that reads its sum
(``trainer.fused_norm_cast``: on wherever the norms write bf16 through
:func:`twell.ops.rms_norm.rms_norm_cast`).

transformers' ``LlamaDecoderLayer.forward`` adds each branch's bf16 output to the fp32 residual
stream with PyTorch (``residual + hidden_states``: a mixed-dtype elementwise kernel) and the
next norm reads the sum back; in backward autograd adds the sum's two gradients and casts the
total to bf16 for the branch. :func:`twell.ops.rms_norm.add_rms_norm_cast` does the add and the
norm in one kernel each way (forward 16 -> 12 bytes an element, backward ~28 -> 16). Here every
residual add goes through it with the norm after it:

* inside a layer, the attention's add with ``post_attention_layernorm``;
* across layers, the FFN's add with the next layer's ``input_layernorm``, and the last layer's
  with the final ``model.norm``: a joining layer returns its residual stream and its FFN's
  output unsummed, as a :class:`PendingJoin`, which transformers' layer loop hands on as the
  next layer's ``hidden_states`` and finally to ``model.norm`` (as vLLM's Llama layers pass
  ``residual`` on beside ``hidden_states``).

Measured (one H100, ``scripts/bench_norm.py``, 32768 x 2048): the add and the norm apart
411 us forward + 664 us backward, joined 273 + 460: 343 us less a join and step, two joins a
layer (BENCHMARKS.md, "The fused op, built"); in the 1.5B bench on one H100, with the norm
backward's launch, our dense path +3.8 % and ``ell`` +5.0 % (BENCHMARKS.md, "the 1.5B bench at
80 GB with the joins"). In a bf16 model's inference forward a join moves 8 bytes an element
where the add (6) and Liger's norm (4) move 10 (not yet timed).

A layer joins when it is not checkpointed now (``layer.gradient_checkpointing`` off:
``trainer.grad_checkpointing=false`` or the memory planner's ``none``; or grad mode off, where
nothing is checkpointed), no hidden states are being recorded (``output_hidden_states`` of the
decoder stack's call, else of its config, as transformers' decorator on its forward decides: a
forward pre-hook on the stack notes it for its layers, which the config's flag reaches in no
transformers version), and its norms write their output through ``rms_norm_cast`` for its input
(:func:`train.liger.fused_cast_dtype`, on CUDA with Liger's norms and ``fused_norm_cast``):
training's fp32 stream under bf16 autocast (the fp32 sum, with autograd; evaluation under autocast
too), or, with grad mode off, a stream of any of fp32 / bf16 / fp16 (inference: a bf16 model's
forward, generation with a KV cache, which the attention writes as in the stock layer; the sum then
in the stream's dtype, as PyTorch's add gives it). Every other call (checkpointed layers, recorded
hidden states, a bf16 stream with grad mode on, the CPU, a KV cache under a keyword that
transformers' own forward does not name) first adds a pending pair with PyTorch's add (the stock
layer's own op: the same sum) and runs the forward the layer had: transformers' (checkpointing)
forward or ``train.recompute``'s selective one, whose checkpoint then keeps the one fp32 input it
keeps now (a pair would keep the bf16 branch output too: 2 N D bytes more a layer).

Numerics: the sum is PyTorch's (fp32 + bf16 widened, rounded once; in a bf16 model bf16 + bf16
rounded to bf16); the norm output is ``rms_norm_cast``'s of that sum (the same kernel, fed the sum
it stores; bitwise under the interpreter, on CUDA ``tests/ops/test_rms_norm.py``); in backward the
residual's gradient is the norm's input gradient plus the sum's, added in fp32 in the kernel as
autograd adds them, and the branch's is that total rounded once to bf16, as autograd's cast rounds
it.

``trainer.recompute_norms`` (``train.lean_saves``) keeps working unchanged in substance: the
joined norm is still called as the module, so its forward hook registers the returned sum as
the norm's input and the normed output as its output; the recipe recomputes ``norm(sum)``
(``rms_norm_cast``, the same bits) from the sum that the join saves for its own backward anyway.

Installed on this model's instances only (an instance ``forward`` on each decoder layer, which
``train.recompute`` installs its selective forward beneath; a forward pre- and post-hook on the
decoder stack and on the final norm); no parameter or buffer is added (the state dict is stock
Llama's). The final norm's other hooks see what a stock model gives them: its forward hooks the
normed output, its forward pre-hooks the summed hidden state (B, T, D), which they may replace.
While it has other pre-hooks (``module._forward_pre_hooks`` besides the join's), the last FFN's add
runs with PyTorch's add and the norm unjoined on that sum (the same bits, one join fewer a step): a
pre-hook runs before the joined kernel would add the sum, so giving it the sum would add it twice.
Module pre-hooks registered with ``prepend=True`` after the joins and global ones
(``torch.nn.modules.module.register_module_forward_pre_hook``) run before the join's and still see
the :class:`PendingJoin`, as do hooks on the decoder layers (a joining layer's output, the next
one's ``hidden_states``). Not under FSDP: its hooks on each layer cast and track tensors of the
layer's inputs and outputs, which a pair would pass by (untested; ``train.setup`` does not install
it there).

Source: the fusion as vLLM's ``fused_add_rms_norm`` and its Llama decoder layers use it
(``LlamaDecoderLayer.forward(positions, hidden_states, residual)``); written here.
Shapes: B batch, T tokens, D model width.
"""

from __future__ import annotations

import inspect
import types
from contextvars import ContextVar

import torch

from train.liger import fused_cast_dtype
from train.recompute import CACHE_KWARGS

# whether each decoder stack whose forward runs in this context (thread, asyncio task) records
# hidden states, the innermost last (a stack's pre-hook appends, its forward hook drops): a
# context variable, as transformers' own recording state, so that forwards of one model in two
# threads do not see each other's; the layers read only the innermost entry, so an entry left
# where a forward raised under torch.compile (which skips always_call hooks) changes no later
# stack's forward
_RECORDING: ContextVar[tuple[bool, ...]] = ContextVar("twell_recording_hidden_states",
                                                      default=())


class PendingJoin:
    """A joining layer's output left unsummed: ``residual + delta`` is the stock layer's
    output. ``residual`` (B, T, D) the stream after the attention's add (fp32 in training, the
    model's dtype in a bf16 model's inference); ``delta`` (B, T, D) the FFN's output (bf16
    under autocast). Not a tuple, so that code expecting a tensor
    fails loudly rather than taking one of the two."""

    __slots__ = ("delta", "residual")

    def __init__(self, residual: torch.Tensor, delta: torch.Tensor) -> None:
        self.residual, self.delta = residual, delta

    def resolve(self) -> torch.Tensor:
        """``residual + delta`` (B, T, D) with PyTorch's add, as the stock layer adds."""
        return self.residual + self.delta


def _hidden_states_asked(stack, kwargs: dict) -> bool:
    """Whether transformers' decorator on the decoder stack's forward (4.56's
    ``check_model_inputs``, 5.x's ``capture_outputs``) records its layers' outputs in a call
    with ``kwargs``: its ``output_hidden_states`` keyword, else the config's (5.25: also layer
    indices, recorded where not empty)."""
    asked = dict(kwargs)
    if isinstance(kwargs.get("kwargs"), dict):  # 4.56 also reads keywords nested there
        asked.update(kwargs["kwargs"])
    value = asked.get("output_hidden_states")
    if value is None:  # transformers records nothing on an explicit None: the config's errs stock
        value = getattr(stack.config, "output_hidden_states", False)
    return bool(value)


def _stack_pre_hook(stack, args, kwargs) -> None:
    """The decoder stack's forward pre-hook: notes for its layers whether this call records
    their outputs, until its forward hook."""
    _RECORDING.set((*_RECORDING.get(), _hidden_states_asked(stack, kwargs)))


def _stack_hook(stack, args, output) -> None:
    """The decoder stack's forward hook, run also where its forward raised (``always_call``):
    drops its pre-hook's note."""
    _RECORDING.set(_RECORDING.get()[:-1])


def _recording_hidden_states(kwargs: dict) -> bool:
    """Whether transformers records the decoder layers' outputs in this forward: as the
    innermost decoder stack running noted (the config's flag never reaches the layers), or as
    the layer's own ``output_hidden_states`` says (a stack's ``forward`` called past its
    hooks)."""
    return any(_RECORDING.get()[-1:]) or bool(kwargs.get("output_hidden_states"))


def _joins(layer, residual: torch.Tensor, kwargs: dict) -> bool:
    """Whether ``layer`` runs its joined forward for this input (module docstring)."""
    # a cache keyword the stock forward does not name is one that the installed transformers'
    # decorators on it may rename (with their warning), or that its body passes on for the
    # attention to ignore: only that forward itself does with it what the stock layer does
    if any(k in kwargs and k not in layer._twell_stock_params for k in CACHE_KWARGS):
        return False
    if getattr(layer, "gradient_checkpointing", False) and torch.is_grad_enabled():
        return False
    if _recording_hidden_states(kwargs):
        return False
    return all(fused_cast_dtype(norm, residual) is not None
               for norm in (layer.input_layernorm, layer.post_attention_layernorm))


def _joined_forward(self, hidden_states, *args, **kwargs):
    """A Llama decoder layer's forward with its residual adds joined to the norms after them
    (module docstring); otherwise the forward the layer had (``_twell_inner_forward``).

    Args:
        hidden_states: (B, T, D) fp32 (training) or the model's dtype, or the previous layer's
            :class:`PendingJoin`.
        args, kwargs: as ``LlamaDecoderLayer.forward``'s (``attention_mask``,
            ``position_embeddings``, ``position_ids``, ``cache``, ``use_cache``, ...); the
            joined forward passes ``kwargs`` to ``self_attn`` as the stock forward does, with
            the stock forward's defaults for the parameters it names and the call omits
            (positional extras, and a KV cache under a keyword it does not name, are left to
            the layer's own forward).

    Returns:
        ``PendingJoin(residual (B, T, D) in hidden_states' dtype, FFN output (B, T, D))`` where
        the layer joins, else the layer's own output (B, T, D).
    """
    pending = hidden_states if isinstance(hidden_states, PendingJoin) else None
    residual = hidden_states if pending is None else pending.residual
    if args or not _joins(self, residual, kwargs):
        if pending is not None:
            hidden_states = pending.resolve()
        return self._twell_inner_forward(hidden_states, *args, **kwargs)
    if pending is None:  # the first layer: the embeddings, nothing to add
        x = self.input_layernorm(residual)
    else:
        residual, x = self.input_layernorm(residual, pending.delta)
    out = self.self_attn(hidden_states=x, **{**self._twell_attn_defaults, **kwargs})
    residual, x = self.post_attention_layernorm(residual, out[0] if isinstance(out, tuple)
                                                else out)
    return PendingJoin(residual, self.mlp(x))


def _final_norm_in(norm, args):
    """The final norm's first forward pre-hook: a pending pair becomes the norm's (residual,
    delta) where the norm can join it and has no other pre-hook, else its sum (B, T, D), the
    input a stock model passes, which the norm's later pre-hooks see (and may replace) and its
    own forward reads."""
    if not (args and isinstance(args[0], PendingJoin)):
        return None
    pending = args[0]
    # any other pre-hook must see the summed hidden state, which the joined kernel would only
    # produce after them: the sum is added once with PyTorch, the norm then runs unjoined
    others = any(key != norm._twell_join_pre_hook for key in norm._forward_pre_hooks)
    if not others and fused_cast_dtype(norm, pending.residual) is not None:
        return (pending.residual, pending.delta, *args[1:])
    return (pending.resolve(), *args[1:])


def _final_norm_out(norm, args, output):
    """The final norm's forward hook (run before its other forward hooks): of a join's (sum,
    normed), the normed (B, T, D) that the LM head reads (the sum has no other reader: its
    gradient stays None)."""
    return output[1] if isinstance(output, tuple) else None


def use_fused_joins(model) -> int:
    """Join the residual adds of ``model``'s decoder layers to the norms after them (module
    docstring), on this instance only; a second call changes nothing. Where the norms do not
    write through ``rms_norm_cast`` (:func:`train.liger.use_liger` with ``fused_norm_cast``)
    the layers keep running their own forwards.

    Args:
        model: a Llama-style causal LM (``model.model.layers[i]`` with ``input_layernorm``,
            ``self_attn``, ``post_attention_layernorm``, ``mlp``; ``model.model.norm``).

    Returns:
        the number of decoder layers newly set.

    Raises:
        ValueError: a layer without one of those modules, or no final ``model.model.norm``.
    """
    stack = model.model
    if getattr(stack, "norm", None) is None:
        raise ValueError(f"use_fused_joins needs a final norm (model.model.norm); "
                         f"{type(stack).__name__} has none")
    n = 0
    for i, layer in enumerate(stack.layers):
        for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
            if not hasattr(layer, name):
                raise ValueError(f"decoder layer {i} ({type(layer).__name__}) has no {name}; "
                                 "use_fused_joins needs a Llama-style decoder layer")
        if "_twell_inner_forward" in vars(layer):
            continue
        layer._twell_inner_forward = layer.forward  # the class's, or train.recompute's
        # transformers' own forward, beneath its decorators (which may rename keywords): the
        # keywords it names, and the defaults its body passes the attention for those not given
        params = inspect.signature(inspect.unwrap(type(layer).forward)).parameters
        layer._twell_stock_params = frozenset(params)
        layer._twell_attn_defaults = {name: p.default for name, p in params.items()
                                      if p.default is not p.empty}
        layer.forward = types.MethodType(_joined_forward, layer)
        n += 1
    if not getattr(stack, "_twell_join_hooks", False):
        # appended: the keywords the forward gets after the stack's other pre-hooks
        stack.register_forward_pre_hook(_stack_pre_hook, with_kwargs=True)
        stack.register_forward_hook(_stack_hook, always_call=True)
        stack._twell_join_hooks = True
    if not getattr(stack.norm, "_twell_join_hooks", False):
        # first of the norm's pre-hooks, so that those registered earlier see a tensor too
        handle = stack.norm.register_forward_pre_hook(_final_norm_in, prepend=True)
        stack.norm._twell_join_pre_hook = handle.id
        # first of the norm's forward hooks: those registered earlier see the normed output too
        stack.norm.register_forward_hook(_final_norm_out, prepend=True)
        stack.norm._twell_join_hooks = True
    return n


__all__ = ["PendingJoin", "use_fused_joins"]
