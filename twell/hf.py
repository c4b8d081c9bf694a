"""twell models in the Hugging Face format: loading a checkpoint folder with SparseGatedMLP FFNs
and finding a run's checkpoint folders. Used by ``train`` (which writes the folders) and
``evals`` (which scores them), so neither imports the other for it.

A checkpoint is a ``save_pretrained`` folder (``config.json`` + safetensors) of transformers'
``LlamaForCausalLM`` with ``hidden_act="relu"``. A gated model loads into stock
``LlamaForCausalLM`` with identical logits; the non-gated variant (``relu(x Wu^T)``, no
``gate_proj``; ``config.json`` has ``twell_gated: false``) has no stock form and needs
:func:`load_model`. A training run keeps them as ``<run_dir>/checkpoints/step{N}/``, complete
once ``metadata.json`` is written (``train.checkpoint`` writes them atomically).

Loading is strict (:func:`from_pretrained_strict`, used by every loader of the project): a
truncated ``config.json``, safetensors or GGUF file is named, and a missing or unexpected
tensor is an error naming it, never a randomly initialised weight.

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


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is: a truncated or unreadable ``config.json``,
    safetensors or GGUF file, or weights that do not match the model (missing or unexpected
    tensors). The message is one line naming the file or the tensors and the fix."""


def read_config_json(d: str | Path) -> dict:
    """The parsed ``config.json`` of a checkpoint folder.

    Raises:
        FileNotFoundError: no ``config.json`` in ``d``.
        CheckpointError: it is not valid JSON (truncated or damaged; names the file).
    """
    f = Path(d) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{d}: no config.json; pass a step{{N}} checkpoint folder")
    try:
        return json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is not valid JSON ({e}): the file is truncated or damaged; "
                              "copy the checkpoint folder again.") from None


def safetensors_files(d: str | Path) -> list[Path]:
    """The weight files of a checkpoint folder: those ``model.safetensors.index.json`` maps, or
    ``model.safetensors``.

    Raises:
        CheckpointError: the index is not valid JSON or a file it names does not exist.
    """
    d = Path(d)
    index = d / "model.safetensors.index.json"
    if not index.is_file():
        return [d / "model.safetensors"]
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index ({e}): the file is "
                              "truncated or damaged; copy the checkpoint folder again.") from None
    return [d / n for n in names]


def tensor_names(d: str | Path) -> set[str]:
    """Names of the tensors stored in a checkpoint folder's safetensors files (headers only).

    safetensors checks that each header is complete and that the file covers every tensor it
    lists, so a truncated file is found here, before any weight is read.

    Raises:
        CheckpointError: a weight file is missing, truncated or not safetensors (names it).
    """
    from safetensors import SafetensorError, safe_open

    names: set[str] = set()
    for f in safetensors_files(d):
        if not f.is_file():
            raise CheckpointError(f"{f}: no such weight file; a checkpoint folder holds "
                                  "config.json and model.safetensors (save_pretrained).")
        try:
            with safe_open(str(f), "pt") as st:
                names.update(st.keys())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f} is not a complete safetensors file ({e}): the file is "
                                  "truncated or damaged; copy the checkpoint again.") from None
    return names


def check_gguf(path: str | Path) -> None:
    """Read a GGUF file's header and tensor table (no weights), so that a truncated file is named
    before transformers' loader fails inside numpy.

    Raises:
        CheckpointError: not a GGUF file, or one that ends before its tensors do.
    """
    p = Path(path)
    with p.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{p} is not a GGUF file (it starts with {magic!r}, not b'GGUF').")
    from gguf import GGUFReader

    size = p.stat().st_size
    try:
        reader = GGUFReader(str(p))
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as e:  # noqa: BLE001  (numpy reshape / struct / index errors: a short file)
        raise CheckpointError(f"{p} is truncated or damaged ({size} bytes; the GGUF reader "
                              f"stopped: {type(e).__name__}: {e}); copy the file again.") from None
    if end > size:
        raise CheckpointError(f"{p} is truncated: its tensors end at byte {end}, the file has "
                              f"{size}; copy the file again.")


def _names(keys, most: int = 6) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - most} more)" if len(keys) > most else ""
    return ", ".join(keys[:most]) + more


def check_weight_names(where: str | Path, missing, unexpected, *, tied: bool,
                       mismatched=()) -> None:
    """Refuse weights that do not match the model: ``missing`` (would be randomly initialised)
    or ``unexpected`` (would be dropped) parameter names, and ``mismatched`` ``(name, shape in
    the checkpoint, shape in the model)``. ``lm_head.weight`` absent under tied embeddings is
    not missing (it is the embedding).

    Raises:
        CheckpointError: one line naming the missing, unexpected and mismatched tensors.
    """
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    unexpected = list(unexpected)
    shapes = [f"{k} {tuple(a)} (model: {tuple(b)})" for k, a, b in sorted(mismatched)]
    if not missing and not unexpected and not shapes:
        return
    parts = ([f"missing {_names(missing)} (would be randomly initialised)"] if missing else []) \
        + ([f"unexpected {_names(unexpected)} (would be dropped)"] if unexpected else []) \
        + ([f"other shape {_names(shapes, 3)}"] if shapes else [])
    raise CheckpointError(f"{where}: the weights do not match the model's config: "
                          f"{'; '.join(parts)}; use a complete checkpoint of this model.")


class _NoLoadReport:
    """A logging filter dropping transformers' load report (a table of missing / unexpected /
    mismatched keys): :func:`from_pretrained_strict` refuses each of them in one line instead."""

    @staticmethod
    def filter(record) -> bool:
        return "LOAD REPORT" not in str(record.msg)


def from_pretrained_strict(model_class, path: str | Path, **kw):
    """``model_class.from_pretrained`` that refuses what transformers only warns about.

    ``path`` is a save_pretrained folder or a ``.gguf`` file (transformers' GGUF loader, which
    needs the ``gguf`` package). The files are checked first (:func:`read_config_json`,
    :func:`tensor_names`, :func:`check_gguf`), then every missing, unexpected or shape-mismatched
    weight is an error (:func:`check_weight_names`).

    Raises:
        FileNotFoundError: no config.json in the folder, or no such GGUF file.
        CheckpointError: a truncated or damaged file, or weights that do not match.
    """
    import logging

    p = Path(path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no such GGUF file")
        check_gguf(p)
        args, kw = (str(p.parent),), {"gguf_file": p.name, **kw}
    else:
        read_config_json(p)
        tensor_names(p)
        args = (str(p),)
    # mismatched shapes are reported below like missing keys, not as transformers' RuntimeError
    kw = {"ignore_mismatched_sizes": True, **kw, "output_loading_info": True}
    log = logging.getLogger("transformers.modeling_utils")
    log.addFilter(_NoLoadReport)
    try:
        model, info = model_class.from_pretrained(*args, **kw)
    finally:
        log.removeFilter(_NoLoadReport)
    mismatched = [(k, (), ()) if isinstance(k, str) else k
                  for k in info.get("mismatched_keys", ())]
    check_weight_names(p, info.get("missing_keys", ()), info.get("unexpected_keys", ()),
                       tied=bool(getattr(model.config, "tie_word_embeddings", False)),
                       mismatched=mismatched)
    return model


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
        CheckpointError: a truncated or damaged config.json or weight file, or weights that do
            not match the config (missing or unexpected tensors, named; nothing is invented).
        ValueError: unknown ``ffn_impl``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    d = Path(checkpoint_dir)
    saved = read_config_json(d)
    if saved.get(GATED_KEY, True):
        model = from_pretrained_strict(LlamaForCausalLM, d, **from_pretrained_kw)
        install_ffns(model, True, ffn_impl)
    else:  # no gate_proj: stock from_pretrained would invent one; load the tensors ourselves
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(d))
        install_ffns(model, False, ffn_impl)
        _load_safetensors(model, d)
    return model.eval()


def _load_safetensors(model: nn.Module, d: Path) -> None:
    from safetensors.torch import load_file

    tensor_names(d)  # a truncated file is named before load_file reads it
    state = {}
    for f in safetensors_files(d):
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    check_weight_names(d, missing, unexpected,
                       tied=bool(getattr(model.config, "tie_word_embeddings", False)))


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
