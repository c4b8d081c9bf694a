"""A prototype: the exact recomputation of the norms' outputs and the mid-layer residual.

Saved-tensor hooks (no library change) over the ``liger`` stand-ins (:mod:`.liger_like`) that
keep neither norm's bf16 output nor the fp32 residual after attention, and recompute them when
backward unpacks them. Per token and decoder layer it saves ``6 D`` bytes (D the model width;
12,288 at the 2B shape): the two bf16 norm outputs (``2 x 2 D``) and the fp32 residual after
attention (``4 D``), less the bf16 attention output kept in its place (``2 D``).
"""

from __future__ import annotations

import weakref

import torch

from studies.memory.liger_like import LigerLikeRMSNorm


class _NoCtx:
    """A stand-in autograd context for calling a Function's forward outside autograd."""

    def save_for_backward(self, *a):
        pass


class NormRecompute:
    """Saved-tensor hooks (:meth:`pack`, :meth:`unpack`) that recompute instead of keeping:

    * the residual after attention, ``mid = x + a`` (fp32 ``x``: the layer input, which the input
      norm keeps anyway; bf16 ``a``: the o_proj output), is packed as the recipe ``(x, a)`` and
      added again when backward unpacks it (the same fp32 add of the same operands: bitwise);
    * each norm's bf16 output (kept by q/k/v and by the FFN op for their weight gradients) is
      packed as ``(norm module, recipe of its input)`` and recomputed by the same norm forward.

    A recipe applies only while the tensor it was made for is alive (a weak reference), so a
    storage address reused after a free is never mistaken for it."""

    def __init__(self):
        self.recipes = {}  # storage ptr -> (weakref to the tensor, recipe)

    @staticmethod
    def _ptr(t):
        return t.untyped_storage().data_ptr()

    def _lookup(self, t):
        hit = self.recipes.get(self._ptr(t))
        if hit is None:
            return None
        ref, recipe = hit
        return recipe if ref() is not None else None

    def add(self, x, a):
        """``x + a``, registered as the recipe ``("add", x, a)``."""
        mid = x + a
        self.recipes[self._ptr(mid)] = (weakref.ref(mid), ("add", x, a))
        return mid

    def norm(self, m, x, y16):
        """Register ``y16`` (norm ``m``'s output for input ``x``) as ``("norm", m, recipe of x)``."""
        rx = self._lookup(x)
        self.recipes[self._ptr(y16)] = (weakref.ref(y16), ("norm", m, x if rx is None else rx))

    def leaves(self, recipe):
        """The tensors a recipe keeps alive (what stays saved in its place)."""
        if isinstance(recipe, torch.Tensor):
            return [recipe]
        if recipe[0] == "add":
            return [recipe[1], recipe[2]]
        return self.leaves(recipe[2])

    def materialize(self, recipe):
        """The tensor a recipe stands for, recomputed (no grad, no autocast; norms in bf16)."""
        if isinstance(recipe, torch.Tensor):
            return recipe
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            if recipe[0] == "add":
                return recipe[1] + recipe[2]
            m, x = recipe[1], self.materialize(recipe[2])
            y = LigerLikeRMSNorm.forward(_NoCtx(), x, m.weight, m.variance_epsilon)
            return y.to(torch.bfloat16)

    def pack(self, t):
        """Pack hook: ``t`` itself, or ``(recipe, shape, stride, offset, leaf versions)`` for a
        registered one."""
        recipe = self._lookup(t)
        if recipe is None:
            return t
        versions = tuple(leaf._version for leaf in self.leaves(recipe))
        return (recipe, tuple(t.shape), t.stride(), t.storage_offset(), versions)

    def unpack(self, packed):
        """Unpack hook: the tensor, recomputed from its recipe where :meth:`pack` made one.

        Raises:
            RuntimeError: a tensor the recipe recomputes from was modified in place since the
                forward (the recomputation would differ from what forward saved)."""
        if isinstance(packed, torch.Tensor):
            return packed
        recipe, shape, stride, offset, versions = packed
        if tuple(leaf._version for leaf in self.leaves(recipe)) != versions:
            raise RuntimeError("one of the variables needed for gradient computation has been "
                               "modified by an inplace operation: a tensor a NormRecompute "
                               "recipe recomputes from")
        return self.materialize(recipe).as_strided(shape, stride, offset)


def install_recompute(model, nr: NormRecompute) -> None:
    """The decoder layers' forward with ``nr``'s add, and the norms registering their outputs
    with ``nr`` (the ``liger`` stand-ins, :func:`studies.memory.liger_like.install_norms`, must be
    installed first). Changes this model only."""
    for layer in model.model.layers:
        for m in (layer.input_layernorm, layer.post_attention_layernorm):
            inner = m.forward

            def fwd(x, m=m, inner=inner):
                y = inner(x)
                nr.norm(m, x, y)
                return y
            m.forward = fwd

        def layer_fwd(hidden_states, *args, layer=layer, **kwargs):
            h = layer.input_layernorm(hidden_states)
            h, _ = layer.self_attn(hidden_states=h, **kwargs)
            mid = nr.add(hidden_states, h)
            return mid + layer.mlp(layer.post_attention_layernorm(mid))
        layer.forward = layer_fwd
