"""Switch a Llama-style model's FFNs to :class:`SparseGatedMLP` in place.

Works on any ``nn.Module`` tree (no transformers import): every submodule that
has ``gate_proj``/``up_proj``/``down_proj`` linear layers without biases (the
``LlamaMLP`` layout) is replaced by a ``SparseGatedMLP`` that *shares* the same
weight tensors, so the model's parameters, ``state_dict`` keys and outputs are
unchanged (for a model whose activation is ReLU).

Source: arXiv 2603.23198, Section on the TwELL inference path (the FFN
modules of a trained model are swapped for sparse ones).
"""

from __future__ import annotations

from torch import nn

from twell.nn.mlp import SparseGatedMLP
from twell.policy import FFNPolicy


def _is_llama_mlp(m: nn.Module) -> bool:
    parts = [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return all(isinstance(p, nn.Linear) and p.bias is None for p in parts)


def convert_mlps(model: nn.Module, impl: str = "torch", *, check_relu: bool = True,
                 policy: FFNPolicy | None = None) -> int:
    """Replace every LlamaMLP-like FFN of ``model`` by a weight-sharing SparseGatedMLP.

    Modules that already are ``SparseGatedMLP`` just get their ``impl`` (and ``policy``, when
    given) set.

    Args:
        model: the model, modified in place.
        impl: ``"torch"``, ``"twell"`` or ``"auto"`` (see :class:`SparseGatedMLP`).
        policy: :class:`twell.policy.FFNPolicy` of every converted FFN (None: new modules get
            the defaults, existing ones keep theirs).
        check_relu: refuse FFNs whose ``act_fn`` is not ReLU (the TwELL / ELL kernels
            compute ``relu``; another activation would silently change outputs).

    Returns:
        The number of FFN modules converted or updated.

    Raises:
        ValueError: an FFN's activation is not ReLU (with ``check_relu``), or
            ``impl`` is unknown.
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, SparseGatedMLP):
                child.impl = impl
                if policy is not None:
                    child.policy = policy
                count += 1
                continue
            if not _is_llama_mlp(child):
                continue
            act = getattr(child, "act_fn", None)
            if check_relu and act is not None and not isinstance(act, nn.ReLU):
                raise ValueError(
                    f"{name}: FFN activation is {type(act).__name__}, not ReLU; the sparse FFN "
                    "computes relu(gate) * up. Train with hidden_act='relu' or pass check_relu=False."
                )
            d = child.gate_proj.in_features
            f = child.gate_proj.out_features
            new = SparseGatedMLP(d, f, impl=impl, policy=policy).to(
                device=child.gate_proj.weight.device, dtype=child.gate_proj.weight.dtype
            )
            new.gate_proj.weight = child.gate_proj.weight
            new.up_proj.weight = child.up_proj.weight
            new.down_proj.weight = child.down_proj.weight
            setattr(parent, name, new)
            count += 1
    return count
