"""Keep less for backward on the no-recompute path, with bitwise-identical gradients
(``trainer.recompute_norms``, ``trainer.recast_attn_weights``; by default each on where it can
save anything, :func:`lean_saves_enabled`).

Without gradient checkpointing every decoder layer keeps, besides what it needs, tensors that
are deterministic functions of others it keeps anyway:

* ``recompute_norms``: the output of ``input_layernorm`` (kept by q/k/v for their weight
  gradients) and of ``post_attention_layernorm`` (kept by the FFN). Each norm keeps its own
  input (the fp32 residual stream) for its backward, so the output is packed as a reference to
  (the norm module, that input, the autocast state) and recomputed by the same norm forward when
  backward unpacks it: ``2 x N x D x b`` bytes less per layer (N tokens, D model width, b the
  output's element size: 2 where the norm returns bf16, as Liger's norms do with
  ``trainer.norm_out_bf16``; 4 in fp32 runs). At 2B (D 2048) with Liger: 8,192 B per token and
  layer, ~19 % of the layer's saved state. Cost: one norm forward per norm and layer in backward
  (q/k/v share one recomputation). Where a residual add is joined to the norm
  (``train.residual_join``) the norm returns (sum, normed): the sum is the norm's input, kept
  by the join for its backward, and the recipe recomputes ``norm(sum)``, the same bits. Where each consumer casts an fp32 norm output itself
  (transformers' reference norm under autocast: CPU bf16 runs, ``trainer.liger=false``) the consumers
  keep their own casts and nothing changes.
* ``recast_attn_weights``: the bf16 autocast casts of the attention projections' weights (q, k,
  v, o), which ``F.linear`` keeps for the input gradient, are recast from the fp32 parameters
  in backward instead (``train.recompute._recast_weights``, as the FFN outside a checkpoint
  does): ``2 x`` (their parameter count) bytes less, fixed (1.19 GiB at 2B); four casts per
  layer in backward. Nothing changes without autocast (fp32 runs keep no casts). The layer runs
  with autocast's cast cache off: the cache would hold every cast until the autocast region
  ends, i.e. the whole model forward, Liger's fused loss included, where the step's peak is.

Nothing outlives the step, nor a graph whose backward never runs (a forward with gradients
for a loss check, an attempt that ran out of memory): the hooks hold no reference cycle, in
Python (a cycle would keep every layer's recipes, and with them the fp32 norm inputs, past
backward until Python's cyclic collector ran) or through autograd's C++ graph, which that
collector cannot see: a tensor saved as it is, is kept as a detached alias
(``train.recompute._alias``), so an op that saves its own output does not hold its own node
(such a cycle kept whole graphs, parameters included, for the rest of the process).
tests/train/test_lean_saves.py checks both.

Bitwise: the recomputation runs the same forward (Liger's RMSNorm kernel is a per-row reduction
without atomics; transformers' reference norm is plain elementwise code) on the same operands
under the same autocast state. A recipe is used only while the tensor it was made for is alive
(a weak reference), so a storage address reused after a free is never mistaken for it; the
norm's input and weight must not change in place between forward and backward (checked with
their version counters: ``RuntimeError``).

Only layers that run without checkpointing use it (their ``gradient_checkpointing`` is false:
``trainer.grad_checkpointing=false``, or the memory planner's ``none``): a checkpointed layer
saves no norm output inside its checkpoint, and its FFN's input is the checkpoint's output,
whose recipe would keep the fp32 residual that the checkpoint drops. Installed by module
forward hooks on each decoder layer and its two norms (so the selective-recompute forward that
``train.recompute`` installs does not displace it), and by a forward of the decoder stack
(``model.model``) that undoes, whatever it raises, any layer whose forward hook did not run:
PyTorch runs ``always_call`` hooks for an ``Exception`` only, so a Ctrl-C in a layer would
leave its saved-tensor hooks pushed for every later forward; eager only (saved-tensor hooks: the config
refuses true with ``trainer.compile=true``, null is off there); not under FSDP (its sharded
parameters are swapped in and out around each layer: untested; true is refused by
``train.setup.prepare_model``, null is off); DDP wraps the same modules and parameters (two CPU
processes over gloo: bitwise the same as without, tests/e2e/test_train_multiprocess.py; not yet
run on several GPUs).
"""

from __future__ import annotations

import types
import weakref

import torch

from train.recompute import _alias, _recast_weights, _unalias


class _NormRecipe:
    """How to recompute one norm output: ``norm.forward(x)`` under the recorded autocast state.

    ``pending`` counts the saved references not yet unpacked; the recomputed tensor is cached
    until the last of them is (q, k and v share one norm output: one recomputation)."""

    def __init__(self, norm, x: torch.Tensor, y: torch.Tensor) -> None:
        dev = x.device.type
        self.norm, self.x, self.dtype, self.shape = norm, x, y.dtype, tuple(y.shape)
        self.versions = (x._version, norm.weight._version)
        self.out_version = y._version  # a saved alias of y must see y as the norm left it
        self.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        self.pending, self.cached = 0, None

    def materialize(self) -> torch.Tensor:
        """The norm output again (same dtype, shape and contiguous layout as in forward).

        Raises:
            RuntimeError: the norm's input or weight changed in place since forward, or the
                recomputed output differs in dtype, shape or layout from forward's."""
        y = self.cached
        if y is None:
            if (self.x._version, self.norm.weight._version) != self.versions:
                raise RuntimeError(
                    "a norm's input or weight was modified in place between forward and "
                    "backward; trainer.recompute_norms recomputes norm outputs in backward and "
                    "needs them unchanged (step the optimizer after backward)")
            dev, enabled, dtype = self.autocast
            with torch.no_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
                y = self.norm.forward(self.x)
            if y.dtype != self.dtype or tuple(y.shape) != self.shape or not y.is_contiguous():
                raise RuntimeError(f"recompute_norms: the recomputed norm output is {y.dtype} "
                                   f"{tuple(y.shape)}, forward gave {self.dtype} {self.shape}")
        self.pending -= 1
        self.cached = y if self.pending > 0 else None
        return y


class _LayerSaves(torch.autograd.graph.saved_tensors_hooks):
    """The saved-tensor hooks of one decoder layer's forward (module docstring).

    ``register(norm, x, y)`` (the norms' forward hooks) records a norm output ``y`` (any shape,
    contiguous) of input ``x``; a saved tensor sharing ``y``'s storage (``y`` or a view of it) is
    packed as ``(recipe, shape, stride, storage offset)``. ``weights``: parameters whose autocast
    casts are recast in backward (``_recast_weights``)."""

    def __init__(self, norms: bool, weights: list[torch.Tensor]) -> None:
        # The hooks close over this dict, not over self: self holds them (pack_hook), so a
        # closure over self is a reference cycle, which kept each layer's recipes, and through
        # them the fp32 norm inputs (2 x N x D x 4 bytes, twice what is saved), past backward
        # until Python's cyclic collector ran
        outputs: dict[int, tuple[weakref.ref, _NormRecipe]] = {}
        self.outputs, self.norms = outputs, norms
        recast = _recast_weights(weights) if weights else None
        cast_pack = recast.pack_hook if recast else _alias  # never t itself: _alias says why
        cast_unpack = recast.unpack_hook if recast else _unalias

        def pack(t: torch.Tensor):
            hit = outputs.get(t.untyped_storage().data_ptr()) if outputs else None
            # the norm's output as it returned it: not changed in place since (a view shares
            # its version counter), else it is saved as it is
            if hit is not None and hit[0]() is not None and t.dtype == hit[1].dtype \
                    and t._version == hit[1].out_version:
                recipe = hit[1]
                recipe.pending += 1
                return (recipe, tuple(t.shape), t.stride(), t.storage_offset())
            return cast_pack(t)

        def unpack(packed):
            if isinstance(packed, tuple) and packed and isinstance(packed[0], _NormRecipe):
                recipe, shape, stride, offset = packed
                return recipe.materialize().as_strided(shape, stride, offset)
            return cast_unpack(packed)

        super().__init__(pack, unpack)

    def register(self, norm, x: torch.Tensor, y: torch.Tensor) -> None:
        """Record norm output ``y`` of input ``x`` for recomputation (a contiguous tensor with a
        grad_fn that is the whole of its storage, with recompute_norms on: a slice of a larger
        buffer could share its storage with other tensors; anything else is left to be saved
        as usual)."""
        if self.norms and isinstance(y, torch.Tensor) and y.is_contiguous() \
                and y.grad_fn is not None and y.storage_offset() == 0 \
                and y.untyped_storage().nbytes() == y.numel() * y.element_size():
            self.outputs[y.untyped_storage().data_ptr()] = (weakref.ref(y), _NormRecipe(norm, x, y))


def _drop_hooks(saves: _LayerSaves) -> None:
    """Take ``saves``' hooks off torch's saved-tensor hook stack wherever they are on it;
    nothing if they are not (an interrupt before they were pushed, or someone else's exit
    popped them). The stack is LIFO and its pop takes the top whatever it is, so entries pushed
    above them since are popped first and pushed back in their order."""
    autograd = torch._C._autograd
    above = []
    while (top := autograd._top_saved_tensors_default_hooks(True)) is not None:
        autograd._pop_saved_tensors_default_hooks()
        if top[0] is saves.pack_hook:
            break
        above.append(top)
    for pack, unpack in reversed(above):
        autograd._push_saved_tensors_default_hooks(pack, unpack)


def _unwind(layer, restore_cache: bool) -> None:
    """Undo ``layer``'s :func:`_layer_enter` if it is still in effect: its hooks off the stack,
    its recipes dropped and, with ``restore_cache``, the autocast cache setting it changed put
    back (only right in the autocast region it was changed in: a region's exit restores the
    setting by itself, and a later region sets its own). The record goes last, so an interrupt
    in between leaves it to the next call."""
    saves = layer.__dict__.get("_twell_saves")
    if saves is None:
        return
    _drop_hooks(saves)
    saves.outputs.clear()  # nothing packs after the layer: the recipes live in the graph
    if restore_cache and saves.cache is not None:
        torch.set_autocast_cache_enabled(saves.cache)
    del layer.__dict__["_twell_saves"]


def _layer_enter(layer, args) -> None:
    # a forward of this layer that a BaseException other than Exception ended (Ctrl-C) left
    # its hooks pushed: PyTorch runs always_call forward hooks for Exception only
    _unwind(layer, restore_cache=False)
    if not (layer.training and torch.is_grad_enabled()) or getattr(
            layer, "gradient_checkpointing", False):
        return
    recast = layer._twell_recast_attn
    weights = [p for p in layer.self_attn.parameters() if p.dim() == 2] if recast else []
    saves = _LayerSaves(layer._twell_recompute_norms, weights)
    # autocast's cast cache holds every weight's bf16 cast until the autocast region ends: the
    # model's forward, Liger's fused loss inside it, where the step's peak is. Off in the layer,
    # a recast cast goes when the op that used it returns (no weight is used twice in a layer,
    # so nothing is cast more often; the casts are the same values). Only inside an autocast
    # region (no cast, no cache outside one), whose exit restores the setting whatever ends it
    off = bool(weights) and torch.is_autocast_enabled(weights[0].device.type)
    saves.cache = torch.is_autocast_cache_enabled() if off else None
    layer._twell_saves = saves  # before the push: an interrupt after it is seen by _unwind
    if off:
        torch.set_autocast_cache_enabled(False)
    saves.__enter__()


def _layer_leave(layer, args, output) -> None:
    _unwind(layer, restore_cache=True)


def _stack_forward(stack, *args, **kwargs):
    """The decoder stack's own forward (same arguments and output), run so that no decoder
    layer's hooks outlive it whatever it raises: a layer's forward hook does not run for a
    BaseException that is not an Exception (Ctrl-C, SystemExit), and an outer
    ``saved_tensors_hooks`` context the exception leaves would pop the layer's hooks in place
    of its own. Layers interrupted when called on their own are undone first."""
    layers = list(stack.layers)
    for layer in layers:
        _unwind(layer, restore_cache=False)
    try:
        return stack._twell_stack_forward(*args, **kwargs)
    finally:
        for layer in reversed(layers):  # still in the autocast region the layer ran in
            _unwind(layer, restore_cache=True)


def _norm_done(norm, args, output) -> None:
    saves = getattr(norm._twell_layer(), "_twell_saves", None)
    if saves is not None and args:
        # a residual join (train.residual_join) returns (sum, normed): normed is norm(sum)
        x, y = output if isinstance(output, tuple) else (args[0], output)
        saves.register(norm, x, y)


LEAN_SAVES = ("recompute_norms", "recast_attn_weights")  # the trainer.* keys


def lean_saves_enabled(setting: bool | None, *, key: str, device_type: str, precision: str,
                       compile: bool, fsdp: bool, norms_bf16: bool) -> bool:
    """Whether a run installs ``trainer.<key>``, one of :data:`LEAN_SAVES`.

    ``setting`` true / false is taken as given (the config refuses true with compile or
    grad_checkpointing=true, setup under FSDP). null resolves per key, on only where it saves
    something, since elsewhere it would only add hooks:

    * ``recast_attn_weights``: CUDA runs under bf16 autocast (``precision``, the resolved one:
      bf16 | fp32), where autocast keeps the weight casts, that are neither compiled
      (saved-tensor hooks are eager-only) nor sharded by FSDP (untested). fp32 keeps no casts;
      CPU runs (fp32 unless set) keep their code path.
    * ``recompute_norms``: those runs where the norms return bf16 (``norms_bf16``: Liger's
      norms, ``trainer.liger`` resolved on, with ``trainer.norm_out_bf16`` resolved on). With
      fp32 norm outputs each consumer keeps its own cast under autocast (transformers'
      reference norms, ``trainer.liger=false``, ``norm_out_bf16=false``), so no norm output is
      saved for a recipe to replace.

    Checkpointed layers skip both by themselves (``_layer_enter``). Measured with both on: 2B
    on an emulated 80 GB card, the bench's micro-batch 12 -> 16, `ell` +2.5 % tokens/ms; -0.8 %
    on 139 GB (BENCHMARKS.md, "the leak probe and the 2B bench with the flags again").

    Raises:
        ValueError: ``key`` not in :data:`LEAN_SAVES`.
    """
    if key not in LEAN_SAVES:
        raise ValueError(f"key must be one of {LEAN_SAVES}; got {key!r}")
    if setting is not None:
        return bool(setting)
    casts = device_type == "cuda" and precision == "bf16" and not compile and not fsdp
    return casts and (key == "recast_attn_weights" or norms_bf16)


def enable_lean_saves(model, *, recompute_norms: bool, recast_attn_weights: bool) -> int:
    """Install ``trainer.recompute_norms`` / ``trainer.recast_attn_weights`` (module docstring)
    on every decoder layer of a Llama-style causal LM; hooks go in once per model (a second call
    only changes the two settings). Before or after :func:`train.liger.use_liger` alike: the
    recomputation calls whatever ``norm.forward`` is at backward time (Liger's or the stock
    one), which must not change between a forward and its backward. The decoder stack
    (``model.model``) gets an instance ``forward`` that calls its own (:func:`_stack_forward`).

    Args:
        model: a ``LlamaForCausalLM`` (``model.model.layers[i]`` with ``self_attn``,
            ``input_layernorm``, ``post_attention_layernorm``; norms with a ``weight``).
        recompute_norms, recast_attn_weights: the two settings.

    Returns:
        the number of decoder layers set.

    Raises:
        ValueError: a layer without ``self_attn`` or one of the two norms.
    """
    layers = model.model.layers
    for i, layer in enumerate(layers):
        for name in ("self_attn", "input_layernorm", "post_attention_layernorm"):
            if not hasattr(layer, name):
                raise ValueError(f"decoder layer {i} ({type(layer).__name__}) has no {name}; "
                                 "recompute_norms / recast_attn_weights need a Llama-style layer")
        layer._twell_recompute_norms = bool(recompute_norms)
        layer._twell_recast_attn = bool(recast_attn_weights)
        if getattr(layer, "_twell_lean_hooks", False):
            continue
        layer.register_forward_pre_hook(_layer_enter)
        layer.register_forward_hook(_layer_leave, always_call=True)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm._twell_layer = weakref.ref(layer)
            norm.register_forward_hook(_norm_done)
        layer._twell_lean_hooks = True
    stack = model.model
    if "_twell_stack_forward" not in vars(stack):
        stack._twell_stack_forward = stack.forward
        stack.forward = types.MethodType(_stack_forward, stack)
    return len(layers)


__all__ = ["LEAN_SAVES", "enable_lean_saves", "lean_saves_enabled"]
