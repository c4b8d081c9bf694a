"""twell models in the Hugging Face format: loading a checkpoint folder with SparseGatedMLP FFNs
and finding a run's checkpoint folders. Used by ``train`` (which writes the folders) and
``evals`` (which scores them), so neither imports the other for it.

A checkpoint is a ``save_pretrained`` folder (``config.json`` + safetensors) of transformers'
``LlamaForCausalLM`` with ``hidden_act="relu"``. A gated model loads into stock
``LlamaForCausalLM`` with identical logits; the non-gated variant (``relu(x Wu^T)``, no
``gate_proj``; ``config.json`` has ``twell_gated: false``) has no stock form and needs
:func:`load_model`. A training run keeps them as ``<run_dir>/checkpoints/step{N}/``, complete
once ``metadata.json`` is written (``train.checkpoint`` writes them atomically).

transformers is imported inside the functions: ``import twell`` stays light.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from torch import nn

from twell.nn import SparseGatedMLP, convert_mlps

GATED_KEY = "twell_gated"  # extra LlamaConfig attribute saved in config.json
_STEP_RE = re.compile(r"^step(\d+)$")


def ffn_modules(model: nn.Module) -> list[SparseGatedMLP]:
    """The model's SparseGatedMLP modules in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseGatedMLP)]


def install_ffns(model: nn.Module, gated: bool, impl: str, policy=None) -> list[SparseGatedMLP]:
    """Swap every decoder layer's LlamaMLP of ``model`` (a ``LlamaForCausalLM``) for a
    :class:`twell.nn.SparseGatedMLP` that shares its weights (gated), or, non-gated, one built
    from its ``up_proj`` / ``down_proj`` (no ``gate_proj``). Returns the new FFN modules."""
    if gated:
        convert_mlps(model, impl, policy=policy)
    else:
        for layer in model.model.layers:
            old = layer.mlp
            new = SparseGatedMLP(old.up_proj.in_features, old.up_proj.out_features,
                                 gated=False, impl=impl, policy=policy)
            new.to(device=old.up_proj.weight.device, dtype=old.up_proj.weight.dtype)
            new.up_proj.weight = old.up_proj.weight
            new.down_proj.weight = old.down_proj.weight
            layer.mlp = new
    return ffn_modules(model)


def load_model(checkpoint_dir: str | Path, ffn_impl: str = "torch", **from_pretrained_kw):
    """Load a checkpoint folder (HF layout: config.json + safetensors) with SparseGatedMLP FFNs.

    Args:
        checkpoint_dir: a ``step{N}`` folder written by the trainer (or any ReLU Llama folder).
        ffn_impl: ``torch`` | ``twell`` | ``auto`` (see :class:`twell.nn.SparseGatedMLP`).
        **from_pretrained_kw: passed to ``LlamaForCausalLM.from_pretrained`` (e.g. ``dtype``,
            ``device_map``) for gated models.

    Returns:
        ``LlamaForCausalLM`` in eval mode.

    Raises:
        FileNotFoundError: no config.json in ``checkpoint_dir``.
        ValueError: unknown ``ffn_impl``; weights that do not match the config (a non-gated
            folder is loaded strictly: nothing is invented).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    d = Path(checkpoint_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d}: no config.json; pass a step{{N}} checkpoint folder")
    config = LlamaConfig.from_pretrained(d)
    if getattr(config, GATED_KEY, True):
        model = LlamaForCausalLM.from_pretrained(d, **from_pretrained_kw)
        install_ffns(model, True, ffn_impl)
    else:  # no gate_proj: stock from_pretrained would invent one; load the tensors ourselves
        model = LlamaForCausalLM(config)
        install_ffns(model, False, ffn_impl)
        _load_safetensors(model, d)
    return model.eval()


def _load_safetensors(model: nn.Module, d: Path) -> None:
    from safetensors.torch import load_file

    index = d / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.is_file() else ["model.safetensors"])
    state = {}
    for f in files:
        state.update(load_file(str(d / f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise ValueError(f"{d}: weights do not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")


def checkpoint_root(run_dir: str | Path) -> Path:
    """``<run_dir>/checkpoints``, the folder holding the ``step{N}/`` checkpoints."""
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint folders (``step{N}/`` with metadata.json) of a run, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / "metadata.json").is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The newest complete ``step{N}`` folder of ``run_dir``.

    Raises:
        FileNotFoundError: there is none (message says where it looked).
    """
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(
            f"no complete checkpoint (step{{N}}/metadata.json) under {checkpoint_root(run_dir)}"
        )
    return found[-1]
